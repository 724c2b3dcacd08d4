"""Checkpointing for models that are not one chain: a function, a module, or every
matching submodule of a model.

All three keep only their inputs and recompute in backward, exactly as a segment of
:class:`~actsave.CheckpointedSequential` does (same ``compress`` / ``offload``
options), with the semantics of non-reentrant ``torch.utils.checkpoint.checkpoint``:
non-tensor and keyword arguments, outputs of any structure, inputs that need no grad.

The keywords of ``torch.utils.checkpoint.checkpoint`` keep torch's meaning
(runtime/recompute_options.py): :func:`checkpoint` takes them all (``use_reentrant`` only as
``False``/``None``, ``context_fn`` not at all); :class:`Checkpoint` and :func:`wrap`
take those that describe the recompute, ``preserve_rng_state``, ``determinism_check``,
``debug`` and ``early_stop``, with the same defaults.
:class:`~actsave.CheckpointedSequential` always uses the defaults (RNG replayed,
saves checked): its segments are chains of layers, for which they are right.
"""
from __future__ import annotations

import warnings
from typing import Callable, NamedTuple, Union

from torch import nn

from .errors import ConfigError
from .runtime.function import checkpointed_call
from .runtime.recompute_options import RecomputeOptions, check_torch_only_keywords
from .runtime.store import KeepPolicy, modifies_input

# The child name torch's own checkpoint_wrapper uses: torch.distributed.checkpoint's
# state-dict helpers already strip it from fully qualified names.
_WRAPPED = "_checkpoint_wrapped_module"


def checkpoint(function: Callable, *args, compress=None, offload=False, use_reentrant=None,
               preserve_rng_state=True, determinism_check="default", debug=False, early_stop=True,
               context_fn=None, **kwargs):
    """``function(*args, **kwargs)``, keeping only the arguments for backward.

    The drop-in for ``torch.utils.checkpoint.checkpoint(function, *args,
    use_reentrant=False, **kwargs)``, with the kept tensor arguments optionally
    compressed (``compress``) or offloaded (``offload``). RNG and autocast state are
    replayed in the recompute, and BatchNorm running statistics are not updated twice.

    Args:
        function: any callable; runs once in the forward and again in backward.
        *args, **kwargs: passed to ``function``, except the keywords below, which are
            ``checkpoint``'s own (as in torch: ``function`` cannot receive them).
        compress: codec of the kept tensor arguments: ``None`` (exact) or a name from
            :func:`actsave.available_codecs`.
        offload: keep the tensor arguments in host memory until backward.
        use_reentrant: ``None`` or ``False``; actsave is non-reentrant, and ``True``
            raises :class:`~actsave.ConfigError`.
        preserve_rng_state: ``True`` (default): the recompute replays the forward's
            RNG state (same Dropout masks). ``False``: no RNG state is captured or
            replayed, as in torch; the recompute draws from the generators as they are
            at backward time and advances them, so random masks differ from the
            forward's. Only for functions that draw no random numbers.
        determinism_check: ``"default"``: a recomputed saved tensor whose shape,
            dtype or device differs from the forward's raises
            :class:`~actsave.RecomputeError`; ``"none"``: not checked.
        debug: ``True``: record the operators the forward and the recompute run and
            list them in the RecomputeError raised when the two do not match.
        early_stop: ``True`` (default): stop the recompute after its last saved
            tensor; ``False``: run ``function`` to its end.
        context_fn: not supported (selective checkpointing); only ``None`` or torch's
            ``noop_context_fn`` are accepted. Checkpoint smaller pieces instead.

    .. warning::
        ``function`` runs again in backward and must do the same work: a recompute
        that saves a tensor of another shape, dtype or device (or another number of
        them) raises :class:`~actsave.RecomputeError`. Parameters and buffers it read
        must not change in place before backward (an optimizer step between forward
        and backward raises, as plain autograd does). With a lossy ``compress`` the
        gradients are approximate (see the README's SQNR figures).
    """
    if not callable(function):
        raise ConfigError(f"function={function!r} is not callable; pass the function (or module) to "
                          "checkpoint first, then its arguments: checkpoint(function, *args, **kwargs)")
    check_torch_only_keywords(use_reentrant, context_fn)
    options = RecomputeOptions.resolve(preserve_rng_state, determinism_check, debug, early_stop)
    policy = KeepPolicy.resolve(compress, offload)
    output, _ = checkpointed_call(function, args, kwargs, policy, modifies_input(function), options)
    return output


class Checkpoint(nn.Module):
    """Wraps ``module`` so that its forward keeps only its inputs for backward.

    ``state_dict`` keys are those of ``module`` itself: a checkpoint saved with the
    wrapper loads without it and the other way round. Attributes not found on the
    wrapper are looked up on ``module``.

    ``compress``, ``offload``, ``preserve_rng_state``, ``determinism_check``, ``debug``
    and ``early_stop`` mean what they mean for :func:`checkpoint`.
    """

    def __init__(self, module: nn.Module, compress=None, offload=False, *, preserve_rng_state=True,
                 determinism_check="default", debug=False, early_stop=True):
        super().__init__()
        if not isinstance(module, nn.Module):
            raise ConfigError(f"Checkpoint wraps an nn.Module instance; module={module!r} is a "
                              f"{type(module).__name__} (for a function, use actsave.checkpoint(function, *args))")
        self.policy = KeepPolicy.resolve(compress, offload)
        self.recompute = RecomputeOptions.resolve(preserve_rng_state, determinism_check, debug, early_stop)
        self.add_module(_WRAPPED, module)
        self.register_state_dict_post_hook(_strip_wrapper_prefix)
        self.register_load_state_dict_pre_hook(_add_wrapper_prefix)

    @property
    def module(self) -> nn.Module:
        """The wrapped module."""
        return self._modules[_WRAPPED]

    def forward(self, *args, **kwargs):
        output, _ = checkpointed_call(self.module, args, kwargs, self.policy, modifies_input(self.module),
                                      self.recompute)
        return output

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            wrapped = self._modules.get(_WRAPPED)
            if wrapped is None:  # still inside __init__
                raise
            return getattr(wrapped, name)

    def extra_repr(self) -> str:
        recompute = self.recompute.describe()
        return (f"compress={self.policy.codec.name!r}, offload={self.policy.offload}"
                + (", " + recompute if recompute else ""))


FilterSpec = Union[Callable[[nn.Module, str], bool], type, tuple]


def wrap(model: nn.Module, filter_fn: FilterSpec, compress=None, offload=False, *, preserve_rng_state=True,
         determinism_check="default", debug=False, early_stop=True) -> nn.Module:
    """Replace, in place, each submodule of ``model`` that ``filter_fn`` selects by a
    :class:`Checkpoint` of it, and return ``model``.

    ``filter_fn`` is ``callable(module, fqn) -> bool`` or an ``nn.Module`` subclass
    (or a non-empty tuple of them). ``model`` itself is never wrapped, nor is anything
    inside a module that is wrapped already. ``state_dict`` keys do not change. The
    other arguments are given to each :class:`Checkpoint` (see :func:`checkpoint`).

    A ``filter_fn`` that selects nothing (and a model with no :class:`Checkpoint` in it
    already) warns: the model then trains exactly as before, with no memory saved,
    which is rarely what was meant (a class from another copy of a package, a
    misspelled name in the predicate).
    """
    if not isinstance(model, nn.Module):
        raise ConfigError(f"model={model!r} is not an nn.Module instance: wrap replaces submodules of a "
                          "model in place (for a function, use actsave.checkpoint(function, *args))")
    matches = _as_predicate(filter_fn)
    policy = KeepPolicy.resolve(compress, offload)
    options = RecomputeOptions.resolve(preserve_rng_state, determinism_check, debug, early_stop)
    blocks = matching_blocks(model, matches)
    for block in blocks:
        if not block.wrapped:
            block.replace(_checkpoint_of(block.module, policy, options))
    if not blocks:
        warnings.warn(f"actsave.wrap: filter_fn={filter_fn!r} selected no submodule of the "
                      f"{type(model).__name__}, so nothing is checkpointed; check the class or predicate "
                      "(it is called with each submodule and its fully qualified name)", stacklevel=2)
    return model


class Block(NamedTuple):
    """A submodule :func:`wrap` selected: where it sits in the model, and whether it
    is a :class:`Checkpoint` already (from an earlier call)."""

    parent: nn.Module
    name: str  # in ``parent``
    fqn: str
    module: nn.Module

    @property
    def wrapped(self) -> bool:
        return isinstance(self.module, Checkpoint)

    def replace(self, module: nn.Module) -> None:
        setattr(self.parent, self.name, module)


def matching_blocks(model: nn.Module, matches, prefix: str = "") -> list:
    """The :class:`Block` s of ``model`` that ``matches(module, fqn)`` selects, in
    module order: never ``model`` itself, nor anything inside a selected module; a
    :class:`Checkpoint` counts as selected (by an earlier :func:`wrap`)."""
    found = []
    for name, child in model.named_children():
        fqn = prefix + name
        if isinstance(child, Checkpoint) or matches(child, fqn):
            found.append(Block(model, name, fqn, child))
        else:
            found += matching_blocks(child, matches, fqn + ".")
    return found


def _checkpoint_of(module: nn.Module, policy: KeepPolicy, options: RecomputeOptions) -> Checkpoint:
    """``Checkpoint(module)`` with its settings resolved already."""
    wrapper = Checkpoint(module)
    wrapper.policy, wrapper.recompute = policy, options
    return wrapper


def _as_predicate(filter_fn: FilterSpec):
    classes = filter_fn if isinstance(filter_fn, tuple) else (filter_fn,)
    if classes and all(isinstance(c, type) and issubclass(c, nn.Module) for c in classes):
        return lambda module, fqn: isinstance(module, classes)
    if callable(filter_fn) and not isinstance(filter_fn, (type, tuple, nn.Module)):
        return filter_fn
    raise ConfigError(
        f"filter_fn={filter_fn!r} must be callable(module, fqn) -> bool, an nn.Module "
        "subclass (the class, not an instance), or a non-empty tuple of nn.Module subclasses"
    )


def _strip_wrapper_prefix(module, state_dict, prefix, local_metadata):
    inner = prefix + _WRAPPED + "."
    for key in [k for k in state_dict if k.startswith(inner)]:
        state_dict[prefix + key[len(inner):]] = state_dict.pop(key)


def _add_wrapper_prefix(module, state_dict, prefix, *args):
    inner = prefix + _WRAPPED + "."
    for key in [k for k in state_dict if k.startswith(prefix) and not k.startswith(inner)]:
        state_dict[inner + key[len(prefix):]] = state_dict.pop(key)
