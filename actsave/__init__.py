"""actsave: train deeper or wider networks on the GPU you have.

Activation memory is traded for recompute, and what must still be kept can be
stored in 8 bits or in host memory. The one-line change::

    model = actsave.CheckpointedSequential(*layers)      # was nn.Sequential(*layers)

See the README for the modes and what each costs.
"""
from .codecs import available_codecs
from .errors import ActsaveError, ConfigError, RecomputeError
from .planning.estimate import MemoryEstimate, estimate
from .codecs.backend import backend, get_backend, set_backend
from .planning.plans import Plan, plan
from .planning.profiler import Profile, profile
from .sequential import CheckpointedSequential
from .runtime.store import stored_bytes
from .planning.blocks import BlockPlan
from .wrappers import Checkpoint, checkpoint, plan_blocks, wrap

__version__ = "0.1.0"

__all__ = [
    "CheckpointedSequential",
    "checkpoint",
    "Checkpoint",
    "wrap",
    "plan_blocks",
    "BlockPlan",
    "stored_bytes",
    "profile",
    "plan",
    "Profile",
    "Plan",
    "estimate",
    "MemoryEstimate",
    "available_codecs",
    "set_backend",
    "get_backend",
    "backend",
    "ActsaveError",
    "ConfigError",
    "RecomputeError",
    "__version__",
]
