"""Exceptions actsave raises. Every message says what was wrong and what to do."""


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
