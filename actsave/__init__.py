"""actsave: train deeper or wider networks on the GPU you have.

Activation memory is traded for recompute, and what must still be kept can be
stored in 8 bits or in host memory. The one-line change::

    model = actsave.CheckpointedSequential(*layers)      # was nn.Sequential(*layers)

See the README for the modes and what each costs.
"""
import importlib as _importlib

# Installing maps actsave.triton_kernels from the folder triton_kernels/ beside actsave/
# (pyproject.toml): a checkout put on sys.path as it is lacks it.
try:
    _importlib.import_module(f"{__name__}.triton_kernels")
except ModuleNotFoundError as error:
    if error.name != f"{__name__}.triton_kernels":
        raise
    raise ImportError(
        "actsave was imported from a source checkout that is not installed: its kernels "
        "package, actsave.triton_kernels, is the folder triton_kernels/, which installing "
        "maps into actsave. Run `pip install -e .` in the checkout, then import actsave "
        "again") from error
del _importlib
from .codecs import available_codecs
from .errors import ActsaveError, ConfigError, KernelLaunchError, OffloadPoolExhausted, RecomputeError
from .planning.estimate import MemoryEstimate, estimate
from .codecs.backend import backend, get_backend, set_backend
from .planning.plan_record import Plan
from .planning.plans import plan
from .planning.profiler import Profile, profile
from .sequential import CheckpointedSequential
from .runtime.store import kept_bytes, stored_bytes
from .planning.blocks import BlockPlan
from .runtime.kept_ops import KeptOps
from .wrappers import Checkpoint, checkpoint, plan_blocks, wrap

__version__ = "0.1.0"

__all__ = [
    "CheckpointedSequential",
    "checkpoint",
    "Checkpoint",
    "wrap",
    "plan_blocks",
    "BlockPlan",
    "KeptOps",
    "kept_bytes",
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
    "OffloadPoolExhausted",
    "KernelLaunchError",
    "__version__",
]
