"""What a checkpointed block keeps for its backward, and how: the per-op options of
``Checkpoint``, ``wrap`` and ``checkpoint`` (``keep=``), and what a block plan chooses
for each block (planning/blocks.py).

NOTE [ Keep modes ]
A block's backward needs what its forward saved. A checkpoint chooses what to keep of
it and what to make again:

- ``"inputs"`` (the default): its inputs; everything else is recomputed in backward
  (function.py). ``compress`` and ``offload`` apply to the inputs.
- ``"selective"``, or a :class:`~actsave.runtime.kept_ops.KeptOps` naming what to keep:
  its inputs and the outputs of its expensive calls (linear layers and attention by
  default); only the cheap ops are recomputed (selective.py). Exact, the kept tensors
  as they are, on the device; with ``compress`` and ``offload``, its inputs are kept so,
  and the outputs it keeps too (kept_outputs.py, NOTE [ Stored kept outputs ]):
  selective + fp8 of what it keeps. Under a lossy codec attention is recomputed, not
  kept (NOTE [ Attention's saves agree ]).
- ``"saves"``: everything autograd saves, nothing recomputed (the block runs once), as
  ``compress`` and ``offload`` store it (kept_saves.py), but attention's saves, which a
  lossy codec leaves exact (NOTE [ Attention's saves agree ]). Exact and on the device,
  it is the plain block.
- ``"linear_inputs"``: as ``"saves"``, but only the inputs of its linear layers are
  stored by ``compress`` (and offloaded), every other save as autograd keeps it
  (DeepSeek-V3 caches its Linear inputs in fp8).

A lossy codec is used only where named (``compress=``, or a plan's ``allow``), so an
exact mode's gradients are bit-identical to the plain block's. Under torch.compile an
exact ``"inputs"`` checkpoint is torch's checkpoint in the graph, an exact selective one
torch's selective checkpoint (its policy saving the aten ops of the kept calls, by
name where ``module_names`` names them: NOTE [ Kept calls in a graph ]) where every
kept call maps to aten ops; anything else runs eagerly at a graph break, with one
warning that says why.
"""
from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass
from typing import Callable, Optional, Union

import torch
from torch.utils.checkpoint import create_selective_checkpoint_contexts

from ..errors import ConfigError
from .compiled_calls import checkpoint_in_graph, out_of_dynamo, warn_eager_under_compile
from .function import checkpointed_call
from .kept_saves import call_with_kept_saves
from .recompute_options import RecomputeOptions
from .kept_ops import DEFAULT_KEPT_OPS, KeptOps, aten_policy
from .layers import known_layers
from .selective import selective_call
from .keep_rules import EXACT, KeepPolicy

KEEP_MODES = ("inputs", "selective", "saves", "linear_inputs")
KeepSpec = Union[str, KeptOps]


@dataclass(frozen=True)
class BlockOption:
    """How one checkpointed block keeps what its backward needs (NOTE [ Keep modes ]):
    ``keep`` (one of :data:`KEEP_MODES`), ``policy`` (the codec and offload of what is
    kept), ``ops`` (what a selective one keeps the outputs of)."""

    keep: str
    policy: KeepPolicy
    ops: Optional[KeptOps] = None

    @classmethod
    def resolve(cls, keep: KeepSpec = "inputs", compress=None, offload=False) -> "BlockOption":
        policy = KeepPolicy.resolve(compress, offload)
        if isinstance(keep, KeptOps):
            keep, ops = "selective", keep
        elif keep == "selective":
            ops = DEFAULT_KEPT_OPS
        elif isinstance(keep, str) and keep in KEEP_MODES:
            ops = None
        else:
            raise ConfigError(f"keep={keep!r} is not one of {list(KEEP_MODES)} or an actsave.KeptOps: 'inputs' "
                              "recomputes everything, 'selective' all but linear layers and attention, 'saves' and "
                              "'linear_inputs' nothing (NOTE [ Keep modes ])")
        return cls(keep, policy, ops)

    @property
    def lossy(self) -> bool:
        return self.policy.lossy

    @property
    def is_plain(self) -> bool:
        """Whether it runs as the plain block: its saves kept as autograd keeps them."""
        return self.keep in ("saves", "linear_inputs") and self.policy == EXACT

    def describe(self) -> str:
        """A few words for a plan's table: ``inputs none``, ``selective``, ``saves int8 host``."""
        words = [self.keep]
        if self.keep == "selective" and self.ops != DEFAULT_KEPT_OPS:
            words.append("(" + ", ".join(self.ops.names()) + ")")
        if not self.policy.codec.lossless or self.keep == "inputs":
            words.append(self.policy.codec.name)
        if self.policy.offload:
            words.append("host")
        return " ".join(words)


def call_block(option: BlockOption, function: Callable, args: tuple, kwargs: dict, options: RecomputeOptions,
               private_copy: bool = False, eager_because: Optional[str] = None) -> tuple:
    """``function(*args, **kwargs)`` keeping what ``option`` says; ``(output, kept
    bytes)`` as :func:`~actsave.runtime.function.checkpointed_call` returns them."""
    compiling = torch.compiler.is_compiling()  # under torch.export too
    if (compiling and torch.compiler.is_exporting()) or torch.jit.is_tracing():  # NOTE [ torch.export ]
        return function(*args, **kwargs), None
    if option.keep in ("inputs", "selective") and torch.is_grad_enabled() and not compiling:
        _warn_of_a_cache(function, (*args, *kwargs.values()))
    if option.keep == "inputs":
        return checkpointed_call(function, args, kwargs, option.policy, private_copy, options,
                                 eager_because=eager_because)
    if compiling:
        return _under_compile(option, function, args, kwargs, options, private_copy)
    return out_of_dynamo(_eager)(option, function, args, kwargs, options, private_copy)


def _eager(option: BlockOption, function, args, kwargs, options, private_copy) -> tuple:
    if option.keep == "selective":
        return selective_call(function, args, kwargs, option.ops, options, private_copy, policy=option.policy)
    if option.is_plain or not torch.is_grad_enabled():
        return function(*args, **kwargs), None  # autograd keeps the saves
    return call_with_kept_saves(function, args, kwargs, option.policy, scope=_SCOPES[option.keep])


def _eager_of(function, args, kwargs, option, options, private_copy) -> tuple:
    """_eager with checkpoint_in_graph's arguments first."""
    return _eager(option, function, args, kwargs, options, private_copy)


_SCOPES = {"saves": "all", "linear_inputs": "linear_inputs"}

# Hugging Face's key-value cache, passed to a block in training (use_cache=True): its
# recompute appends to it again (docs/limits.md, "The recompute check"). Warned once
# per block type.
_WARNED_OF_A_CACHE = set()


def is_hf_cache(value) -> bool:
    """Whether ``value`` is a Hugging Face key/value cache (transformers.cache_utils.Cache),
    known by name: transformers is optional."""
    return any(c.__name__ == "Cache" and c.__module__.startswith("transformers") for c in type(value).__mro__)


def _warn_of_a_cache(function: Callable, values: tuple) -> None:
    for value in values:
        if is_hf_cache(value):
            name = getattr(function, "__qualname__", None) or type(function).__name__
            if name not in _WARNED_OF_A_CACHE:
                _WARNED_OF_A_CACHE.add(name)
                warnings.warn(f"actsave: {name} is checkpointed with a Hugging Face cache while training "
                              "(use_cache=True): its recompute appends the keys and values to the cache again, "
                              "with padding raises, and a forward dropped without backward is never freed (the "
                              "cache holds its graph, as under torch.utils.checkpoint). Pass use_cache=False to "
                              "the model's call to train, as activation_checkpointing_enable() (formerly "
                              "gradient_checkpointing_enable()) does.", stacklevel=4)
            return


def _under_compile(option: BlockOption, function, args, kwargs, options, private_copy) -> tuple:
    if option.is_plain:
        return function(*args, **kwargs), None
    if option.keep == "selective" and option.policy == EXACT:
        saved = aten_policy(option.ops, function)
        if saved is not None:
            # torch's selective checkpoint saving the outputs of the kept calls and recomputing the rest.
            context = functools.partial(create_selective_checkpoint_contexts, saved)
            return checkpoint_in_graph(function, args, kwargs, options, context_fn=context, eager_call=_eager_of,
                                       eager_args=(option, options, private_copy)), None
        why = _why_no_policy(option.ops, function)
    elif option.keep == "selective":
        why = "what it keeps is stored by a codec or on the host as its forward ends, which a graph does not do"
    else:
        why = "its saves are kept by a codec or on the host through saved-tensor hooks, which a graph does not hold"
    return _eagerly(option, function, args, kwargs, options, private_copy, why)


def _why_no_policy(ops: KeptOps, function) -> str:
    """Why :func:`aten_policy` found no policy for ``ops`` on ``function``."""
    if ops.module_names is None:
        return f"the kept calls {ops.names()} have no aten operators actsave knows to save in a graph"
    if known_layers(function) is None:
        return (f"it keeps the calls of {list(ops.module_names)} by name in a function that is not a module, whose "
                "modules actsave cannot name: checkpoint the module")
    return (f"it keeps the calls of {list(ops.module_names)} by name, and some name matches no module of the block: "
            "run eagerly, it raises the error that lists the names there are")


@torch.compiler.disable
def _eagerly(option, function, args, kwargs, options, private_copy, why: str) -> tuple:
    warn_eager_under_compile(f"a checkpoint with keep={option.keep!r}", "a graph break at each such call", why)
    return _eager(option, function, args, kwargs, options, private_copy)


__all__ = ["BlockOption", "KEEP_MODES", "KeepSpec", "call_block"]
