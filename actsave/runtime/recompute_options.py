"""How a checkpointed call recomputes: the keywords of
``torch.utils.checkpoint.checkpoint`` that mean something to actsave, resolved once
into a frozen :class:`RecomputeOptions`, and the ones it refuses.

Code migrated from ``torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False,
...)`` keeps its keywords, with torch's meaning:

- ``use_reentrant``: ``None`` or ``False``. actsave implements only the non-reentrant
  variant (the one torch recommends); ``True`` is refused rather than silently
  ignored. (Unlike torch 2.13, leaving it out does not warn: there is no other variant.)
- ``preserve_rng_state`` (default ``True``): capture the RNG state before the forward
  and replay it in the recompute, so Dropout masks are the forward's. ``False`` skips
  the capture and the replay, as in torch: the recompute draws from the generators as
  they are at backward time (and advances them), so random masks differ from the
  forward's and the gradients are those of other masks. Use it only for functions
  that draw no random numbers, to save the cost of saving the RNG state.
- ``determinism_check``: ``"default"`` checks that every tensor the recompute saves has
  the shape, dtype and device the forward's had, and raises RecomputeError otherwise;
  ``"none"`` skips that check (the number of saved tensors is still checked: backward
  cannot run without them).
- ``debug`` (default ``False``): ``True`` records the operators the forward and the
  recompute run (a TorchDispatchMode, only then) and lists both in the RecomputeError
  raised when they do not match.
- ``early_stop`` (default ``True``): stop the recompute once the last saved tensor is
  recomputed; ``False`` runs the function to its end. A checkpoint whose modules hold
  one that fills a tensor after saving it runs to its end whatever the keyword says
  (NOTE [ Saves filled after they are saved ]).
- ``context_fn``: refused (only torch's ``noop_context_fn`` or ``None`` pass): actsave's
  selective checkpoint is ``keep="selective"`` (selective.py), not a context.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, fields, replace

from torch import nn
from torch.utils.checkpoint import noop_context_fn

from .._torch import TorchDispatchMode, forward_ad_on
from ..errors import ConfigError, RecomputeError

DETERMINISM_CHECKS = ("default", "none")


# NOTE [ Saves filled after they are saved ]
# The early stop ends a recompute as its last save is made, inside the op that saves it.
# An op that saves a tensor and then fills it never fills it then: RReLU in training
# saves its noise tensor and then draws into it (``rrelu_with_noise``), so a recompute
# stopped there leaves the noise uninitialized and the gradients wrong (torch's
# non-reentrant checkpoint does the same). So a checkpoint whose modules hold a training
# RReLU (or a subclass of it) runs its recompute to the end (its peak may then pass a
# plan's prediction by what runs after the last save). An op called as a function, with
# no module to find, is not seen: pass ``early_stop=False`` for such a function.


def _fills_a_save(module: nn.Module) -> bool:
    return isinstance(module, nn.RReLU) and module.training


@dataclass(frozen=True)
class RecomputeOptions:
    """How one checkpointed call recomputes (module docstring)."""

    preserve_rng_state: bool = True
    determinism_check: str = "default"
    debug: bool = False
    early_stop: bool = True

    @classmethod
    def resolve(cls, preserve_rng_state=True, determinism_check="default", debug=False,
                early_stop=True) -> "RecomputeOptions":
        for name, value in (("preserve_rng_state", preserve_rng_state), ("debug", debug),
                            ("early_stop", early_stop)):
            if not isinstance(value, bool):
                raise ConfigError(f"{name}={value!r} must be True or False")
        if not isinstance(determinism_check, str) or determinism_check not in DETERMINISM_CHECKS:
            raise ConfigError(
                f"determinism_check={determinism_check!r} is not one of {list(DETERMINISM_CHECKS)}: "
                "'default' checks the shape, dtype and device of every recomputed tensor, "
                "'none' skips the check"
            )
        return cls(preserve_rng_state, determinism_check, debug, early_stop)

    def for_modules(self, modules) -> "RecomputeOptions":
        """These options for a checkpoint of ``modules`` (``(name, module)`` pairs, None
        where not known): NOTE [ Saves filled after they are saved ]."""
        if self.early_stop and modules and any(_fills_a_save(module) for _, module in modules):
            return replace(self, early_stop=False)
        return self

    @property
    def checks_saves(self) -> bool:
        """Whether recomputed saves are checked for shape, dtype and device."""
        return self.determinism_check == "default"

    def describe(self) -> str:
        """The options that differ from the defaults, as keyword arguments."""
        return ", ".join(f"{f.name}={getattr(self, f.name)!r}" for f in fields(self)
                         if getattr(self, f.name) != f.default)


DEFAULT_RECOMPUTE = RecomputeOptions()


def check_torch_only_keywords(use_reentrant, context_fn) -> None:
    """Refuse the ``torch.utils.checkpoint.checkpoint`` keywords whose other values
    actsave does not implement (module docstring)."""
    if use_reentrant is True:
        raise ConfigError(
            "use_reentrant=True: actsave implements only the non-reentrant checkpoint (torch's "
            "use_reentrant=False, which torch recommends: same gradients, and it also supports "
            "torch.autograd.grad, keyword arguments and inputs that need no grad). Drop the "
            "keyword or pass use_reentrant=False."
        )
    if use_reentrant is not None and use_reentrant is not False:
        raise ConfigError(f"use_reentrant={use_reentrant!r} must be False or None (actsave is non-reentrant)")
    if context_fn is not None and context_fn is not noop_context_fn:
        raise ConfigError(
            f"context_fn={context_fn!r} is not supported: actsave runs the forward and the recompute "
            "under the caller's contexts. For selective checkpointing (torch's "
            "create_selective_checkpoint_contexts) use keep='selective', which keeps the outputs of "
            "linear layers and attention, or keep=actsave.KeptOps(modules=..., functions=...) to "
            "name the calls whose outputs are kept (for a model's blocks, actsave.wrap(model, Block, "
            "keep='selective')); drop context_fn."
        )


__all__ = ["RecomputeOptions", "DEFAULT_RECOMPUTE", "DETERMINISM_CHECKS", "check_torch_only_keywords", "logged",
           "mismatch"]


class OperatorLog(TorchDispatchMode):
    """The names of the operators run inside it (``aten.mul.Tensor``): what ``debug=True``
    records of the forward and of the recompute."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


def logged(options: RecomputeOptions, operators: dict, stage: str):
    """With ``debug=True``, a mode that records the operators ``stage`` runs in
    ``operators[stage]``."""
    if not options.debug:
        return contextlib.nullcontext()
    log = OperatorLog()
    operators[stage] = log.names
    return log


# What a recompute that does other work than its forward also says: a flag the forward
# changed after a use (NOTE [ Parameters a recompute reads ]) is the flag it runs with.
FLAGS_CHANGED = (" Or the forward changes a parameter's requires_grad after using it (a freeze schedule inside "
                 "forward), and the recompute runs with the flag as the forward left it: change flags outside the "
                 "checkpointed forward.")


def other_shapes(function_name: str, recomputed: tuple, forward: tuple, lossy: bool) -> str:
    """What a recompute that saved a tensor of another shape, dtype or device than its
    forward's says (``(shape, dtype, device)`` each): a lossy recompute decided a shape
    from decoded values; an exact one ran code that is not deterministic; either may
    run with a parameter's flag as the forward left it (docs/limits.md)."""
    said = (f"the recompute of {function_name} saved a tensor of shape/dtype/device {recomputed} where the forward "
            f"saved {forward}: ")
    if lossy:
        return said + (
            "its inputs were kept by a lossy codec, and a shape decided by their values (nonzero, argwhere, "
            "torch.where(mask), masked_select, a branch or a loop count on a value) came out otherwise on the "
            "decoded ones, so its gradients would be wrong. Keep this function's inputs exactly (compress=None for "
            "it), or decide the shape from values the codec does not change (docs/limits.md, 'Other decisions a "
            "lossy recompute takes again').") + FLAGS_CHANGED
    return said + (
        "the function is not deterministic in its shapes or dtypes, so its gradients would be wrong (state it "
        "appends to runs again: Hugging Face's use_cache=True, pass use_cache=False to train). Make it "
        "deterministic or do not checkpoint it (determinism_check='none' skips this check).") + FLAGS_CHANGED


def mismatch(options: RecomputeOptions, operators: dict, message: str, forward_ad: bool = False) -> RecomputeError:
    """The error of a recompute that did not do the forward's work; with ``debug=True``
    it lists the operators each ran (``operators``, from :func:`logged`). ``forward_ad``:
    a forward-mode AD level was open as the forward ran (it may be closed by the backward)."""
    if forward_ad or forward_ad_on():
        message += (" Forward-mode AD was on (in the forward or the backward): actsave recomputes from its inputs "
                    "without their tangents, so the recompute saves less than the forward did (docs/limits.md, "
                    "\"What a recompute's input is\"); checkpoint such a function with torch.utils.checkpoint.")
    if not options.debug:
        return RecomputeError(message)
    parts = [message, "debug=True: the operators the forward and the recompute ran, in order; look "
                      "where the lists part (the recompute stops at a mismatch, or after its last save)."]
    for stage in ("forward", "recompute"):
        names = operators.get(stage, [])
        parts.append(f"Operators the {stage} ran ({len(names)}):\n  " + "\n  ".join(names))
    return RecomputeError("\n\n".join(parts))
