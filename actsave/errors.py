"""Exceptions actsave raises, and its deprecation warnings. Every message says what was
wrong and what to do."""
import warnings

# Raised by a Triton launch (triton_kernels/_launch.py): a RuntimeError, not an
# ActsaveError, since the kernels import nothing of actsave. Exported here with the rest.
from .triton_kernels._launch import KernelLaunchError


class ActsaveError(RuntimeError):
    """Base class of every error actsave raises on purpose."""


class ConfigError(ActsaveError, ValueError, TypeError):
    """An argument has a value or type actsave cannot use.

    It is a ``ValueError`` and a ``TypeError`` too, so code that guards a call with
    either (as it would for ``nn.Sequential``) keeps working.
    """


class RecomputeError(ActsaveError):
    """Backward could not reproduce what the forward saved, so it stopped rather
    than produce wrong gradients."""


class OffloadPoolExhausted(ActsaveError):
    """The host pool that offloaded tensors go to would have to exceed its capacity
    (``actsave.offload.set_host_pool_capacity``) to lend another buffer."""


class InternalError(ActsaveError):
    """actsave broke one of its own guarantees (a bug, not a wrong argument): the
    message says which. Please report it with the message."""


def warn_renamed(old: str, new: str, stacklevel: int = 3) -> None:
    """Warn that ``old`` is deprecated for ``new`` (the same thing, or the call that does
    it), at the caller ``stacklevel`` - 1 frames above the function that calls this. A
    renamed public name keeps working for one release, through this warning."""
    warnings.warn(f"actsave: {old} is deprecated and will be removed in the next release: use {new}",
                  DeprecationWarning, stacklevel=stacklevel)


__all__ = ["ActsaveError", "ConfigError", "RecomputeError", "OffloadPoolExhausted", "InternalError",
           "KernelLaunchError", "warn_renamed"]


def not_scriptable(module: object) -> ConfigError:
    """What ``torch.jit.script`` of an actsave module raises, from its
    ``__prepare_scriptable__`` (which TorchScript calls on every module it compiles)."""
    return ConfigError(
        f"actsave: torch.jit.script cannot compile {type(module).__name__}: its forward keeps and recomputes "
        "tensors through Python hooks TorchScript has no types for. Script the plain model, or use "
        "torch.export or torch.compile.")
