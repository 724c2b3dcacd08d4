"""What a selective recompute keeps the outputs of (selective.py, NOTE [ Selective
recompute ]): :class:`KeptOps`, the module types and functions whose calls it does not
run again, which of those calls may draw random numbers (:func:`may_draw`), and the aten
operators those calls are in a compiled graph, where torch's selective checkpoint saves
them (keep_modes.py)."""
from __future__ import annotations

import dataclasses
import functools
import os
from typing import Optional

from torch import nn
from torch.utils.checkpoint import CheckpointPolicy

from .._taps import ATTENTION
from .._torch import aten_overloads
from .._torch_graphs import module_of_traced_op
from ..errors import ConfigError
from .forward_dispatch import forward_set_on
from .layers import WRAPPED_CHILD, known_layers

# The functions a policy may name: called through their module, which the tap replaces.
TAPPED_FUNCTIONS = {"scaled_dot_product_attention": ATTENTION}


def _as_tuple(name: str, value, single: type, items: str) -> tuple:
    """``KeptOps``' ``name`` argument as a tuple: one ``single`` alone, or an iterable of
    them; a string of module names, None or a non-iterable is refused (``items``: what
    the tuple holds)."""
    if isinstance(value, single):
        return (value,)
    if isinstance(value, str) or value is None or not hasattr(value, "__iter__"):
        raise ConfigError(f"KeptOps({name}={value!r}): pass a tuple of {items}, () for none"
                          + (", the classes, not their names" if isinstance(value, str) else ""))
    return tuple(value)


@dataclasses.dataclass(frozen=True)
class KeptOps:
    """What a selective recompute keeps instead of recomputing: the outputs of the
    calls of ``modules`` (``nn.Module`` subclasses) and of ``functions`` (names from
    :data:`TAPPED_FUNCTIONS`) inside the checkpointed call (NOTE [ Selective
    recompute ]). The default keeps linear layers and attention, the expensive ops of a
    transformer block, as torchtitan's op list does (its matmuls and attention).

    ``module_names`` keeps only some of those modules: the ones whose qualified name
    in the checkpointed module (as its ``named_modules()`` spells it) is one of these,
    or ends with a dot and one of these, as PEFT's ``target_modules`` match:
    ``KeptOps(module_names=("attn.qkv", "mlp.0"))`` keeps a block's attention
    projection and first MLP layer and recomputes its other linear layers. A name that
    matches no module of ``modules``' types raises at the first call. None (the
    default): every module of those types. A block plan chooses such subsets itself
    (planning/kept_subsets.py)."""

    modules: tuple = (nn.Linear,)
    functions: tuple = ("scaled_dot_product_attention",)
    module_names: Optional[tuple] = None

    def __post_init__(self):
        modules = _as_tuple("modules", self.modules, type, "nn.Module subclasses (modules=(nn.Linear,))")
        functions = _as_tuple("functions", self.functions, str, "function names (functions=('scaled_dot_product_"
                              "attention',))")
        bad = [m for m in modules if not (isinstance(m, type) and issubclass(m, nn.Module))]
        if bad:
            raise ConfigError(f"KeptOps(modules={bad!r}): modules are nn.Module subclasses whose calls keep their "
                              "outputs (nn.Linear, nn.Conv2d, ...), the classes, not instances")
        unknown = [f for f in functions if f not in TAPPED_FUNCTIONS]
        if unknown:
            raise ConfigError(
                f"KeptOps(functions={unknown!r}): actsave keeps the outputs of module calls and of the functions "
                f"{sorted(TAPPED_FUNCTIONS)} only, not of other functions (F.linear) nor of aten operators "
                "(aten.mm.default): name the module type whose calls make them (modules=(nn.Linear,)) or one of "
                "those functions")
        if not modules and not functions:
            raise ConfigError("KeptOps(modules=(), functions=()) keeps the outputs of nothing: the checkpoint would "
                              "keep its inputs only, which is keep='inputs'. Name what to keep (the defaults keep "
                              "nn.Linear and attention), or pass keep='inputs'")
        object.__setattr__(self, "modules", modules)
        object.__setattr__(self, "functions", functions)
        if self.module_names is not None:
            if not modules:
                raise ConfigError(f"KeptOps(modules=(), module_names={self.module_names!r}): module_names chooses "
                                  "among the modules of the types in modules, and there are none: name the types "
                                  "too (modules=(nn.Linear,)), or leave module_names out")
            names = _as_tuple("module_names", self.module_names, str, "qualified module names")
            if not names or not all(isinstance(n, str) and n for n in names):
                raise ConfigError(f"KeptOps(module_names={self.module_names!r}): pass qualified module names, "
                                  "as named_modules() spells them ('attn.qkv'); None keeps every module of the "
                                  "types in modules, modules=() none")
            object.__setattr__(self, "module_names", names)

    def names(self) -> list:
        """The names of what it keeps the outputs of: its module classes' (or the
        modules it names), then its functions'."""
        modules = list(self.module_names) if self.module_names is not None else [m.__name__ for m in self.modules]
        return modules + list(self.functions)

    def watched(self, layers: Optional[tuple], modules: list, indexed: bool) -> list:
        """The modules among ``modules`` (``(layer index, module)`` pairs under
        ``layers``: layers.py's modules_under) whose calls it keeps: of its types, and
        where it names modules, of those names (:meth:`named_choice`)."""
        typed = [m for _, m in modules if isinstance(m, self.modules)]
        if self.module_names is None:
            return typed
        chosen = {id(m) for _, m in self.named_choice(layers, indexed)}
        return [m for m in typed if id(m) in chosen]

    def named_choice(self, layers: tuple, indexed: bool) -> list:
        """``(qualified name, module)`` of each module of its types under ``layers``
        that ``module_names`` names, in ``named_modules()``' order; ``indexed``: the
        function runs its layers as a sequence (an ``nn.Sequential``), whose names
        start with their index. A name that matches none raises, listing the names
        there are."""
        named = self._named_modules(layers, indexed)
        unmatched = self._unmatched(named)
        if unmatched:
            known = sorted({name for name, _ in named if name})
            raise ConfigError(f"KeptOps(module_names=...) names {unmatched}, which match no module of the types "
                              f"{[m.__name__ for m in self.modules]} in the checkpointed module; its modules of "
                              f"those types are {known}. Name one of them (a qualified name or its last parts)")
        return self._chosen(named)

    def names_if_all_match(self, layers: tuple, indexed: bool) -> Optional[tuple]:
        """The qualified names :meth:`named_choice` chooses, or None where a name
        matches nothing, without raising (while Dynamo traces, a raise would break the
        graph there)."""
        named = self._named_modules(layers, indexed)
        return None if self._unmatched(named) else tuple(name for name, _ in self._chosen(named))

    def _chosen(self, named: list) -> list:
        return [(name, m) for name, m in named if any(_names(name, wanted) for wanted in self.module_names)]

    def _named_modules(self, layers: tuple, indexed: bool) -> list:
        return [(_spelled(f"{i}.{name}".rstrip(".") if indexed else name), m) for i, layer in enumerate(layers)
                for name, m in layer.named_modules(remove_duplicate=False) if isinstance(m, self.modules)]

    def _unmatched(self, named: list) -> list:
        return [wanted for wanted in self.module_names if not any(_names(name, wanted) for name, _ in named)]


def _spelled(qualified: str) -> str:
    """``qualified`` as ``state_dict`` spells it: a checkpoint wrapper's child left out
    (``inner._checkpoint_wrapped_module.fc2`` is ``inner.fc2``)."""
    return qualified.replace("." + WRAPPED_CHILD, "").replace(WRAPPED_CHILD + ".", "")


def _names(qualified: str, wanted: str) -> bool:
    """Whether ``wanted`` names the module at ``qualified``: the whole name or its last
    parts after a dot, as PEFT's ``target_modules`` match."""
    return qualified == wanted or qualified.endswith("." + wanted)


DEFAULT_KEPT_OPS = KeptOps()


# NOTE [ Kept calls in a graph ]
# Under torch.compile an exact selective checkpoint is torch's selective checkpoint,
# whose policy AOTAutograd asks, for each aten op it traces, whether to save its output
# or recompute it. A kept call is the aten ops that do its work (_ATEN_OPS: a linear
# layer's matmul, attention's fused kernel). Kept by type, the policy is the list of
# those overloads. Kept by name (``module_names``), a module type's overloads are saved
# only where the innermost module the op runs in (Dynamo's record of it,
# _torch_graphs.module_of_traced_op) is a named one: its path ends with that module's
# qualified name in the block, found as named_choice finds it, while Dynamo traces the
# block. A name that matches nothing runs the block eagerly, where it raises the error
# it raises without compile. A function's overloads (attention's) are saved wherever
# they run, as kept by type. An op whose module the trace does not tell is recomputed:
# the graph keeps less than the plan priced, never more. Whichever ops a graph saves,
# its gradients are the same: a saved output is the one the recompute would make.


def aten_policy(ops: KeptOps, function) -> Optional[object]:
    """What torch's selective checkpoint saves of ``function``'s calls that ``ops`` keeps,
    in a compiled graph (NOTE [ Kept calls in a graph ]): a list of aten overloads, or
    a policy for ``create_selective_checkpoint_contexts``; None where a kept module type
    has no overloads known here, or ``ops`` names modules of a function that is not a
    module (whose modules actsave cannot name)."""
    module_overloads = _overloads_of(ops.modules)
    if module_overloads is None:
        return None
    function_overloads = frozenset().union(*(_ATEN_OPS[name] for name in ops.functions))
    layers = known_layers(function)
    if ops.module_names is None:
        refuse_unknown_modules(ops, function, layers)
        return list(module_overloads | function_overloads)
    if layers is None:
        return None
    names = ops.names_if_all_match(layers, type(function) is nn.Sequential)  # layers.py's rule, for a module
    if names is None:
        return None  # eagerly, where named_choice raises its error
    # Tuples, not frozensets: where the block breaks the graph, Dynamo rebuilds this
    # partial in the resumed code, and it cannot rebuild a frozenset there.
    return functools.partial(_saved_by_name, names, tuple(module_overloads), tuple(function_overloads))


def refuse_unknown_modules(ops: KeptOps, function, layers: Optional[tuple]) -> None:
    """A selective checkpoint keeps modules' outputs only where it knows the modules
    ``function`` runs (``layers``: layers.known_layers'), eagerly and compiled alike: in
    a graph it would keep every matching operator of the function, by type."""
    if ops.modules and layers is None:
        name = getattr(function, "__qualname__", None) or type(function).__name__
        raise ConfigError(
            f"a selective checkpoint of {name} keeps the outputs of {ops.names()}, but actsave finds the modules a "
            "function runs only where it is a module (an nn.Sequential, a module's bound forward, a functools.partial "
            "of one that binds only tensors and plain values, not modules or objects that may hold them): checkpoint "
            "the module itself, or keep functions only (KeptOps(modules=()))")


def _overloads_of(module_types: tuple) -> Optional[frozenset]:
    found = set()
    for module_type in module_types:
        overloads = next((names for known, names in _ATEN_OPS.items() if issubclass(module_type, known)), None)
        if overloads is None:
            return None
        found |= overloads
    return frozenset(found)


def _saved_by_name(names: tuple, module_overloads: tuple, function_overloads: tuple, ctx, op, *args,
                   **kwargs) -> CheckpointPolicy:
    """The policy of a checkpoint that keeps the modules at ``names`` (NOTE [ Kept calls
    in a graph ])."""
    if op in function_overloads:
        return CheckpointPolicy.MUST_SAVE
    if op in module_overloads:
        found = module_of_traced_op()
        if found is not None and any(_names(_spelled(found[0]), name) for name in names):
            return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


# A kept call's work as the aten operators a compiled graph runs: a linear layer's
# matmul (addmm with a bias, mm without; 3-D inputs are folded to 2-D first), a
# convolution, attention's fused kernels (each device's). Not the math path's bmm: a
# graph cannot tell its matmuls from any other bmm the block runs (hand-written
# attention), and saving every bmm keeps more than the eager checkpoint does (the score
# matrix among them), where a graph must keep no more: its attention is recomputed.
_ATEN_OPS = {
    nn.Linear: aten_overloads("mm.default", "addmm.default"),
    nn.modules.conv._ConvNd: aten_overloads("convolution.default"),
    "scaled_dot_product_attention": aten_overloads(
        "_scaled_dot_product_flash_attention.default", "_scaled_dot_product_efficient_attention.default",
        "_scaled_dot_product_cudnn_attention.default", "_scaled_dot_product_flash_attention_for_cpu.default"),
}


# torch's own layers whose forward draws no random number, where they run torch's code.
# Exactly these types: a subclass may draw (a LoRA Linear's input dropout, a
# parametrization adding noise to the weight, which makes a ParametrizedLinear), and so
# may a forward (or a convolution's _conv_forward, which its forward calls) set on the
# instance or patched on the class, before actsave was imported or after. A kept call
# skipped in the recompute must then still advance the generator as its forward did.
# Not seen: torch's functions replaced (F.linear patched to draw: docs/limits.md).
_DRAW_NOTHING = frozenset({nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d,
                           nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d})
_OWN_CODE = ("forward", "_conv_forward")  # the methods of theirs that their forward runs


def may_draw(target, args: tuple, kwargs: dict) -> bool:
    """Whether a kept call may draw random numbers: attention with dropout, a module of
    any type but torch's own linear layers and convolutions (it may hold a Dropout), or
    one of those that runs code of its own."""
    if isinstance(target, str):
        dropout = kwargs.get("dropout_p", args[4] if len(args) > 4 else 0.0)
        return bool(dropout)
    return type(target) not in _DRAW_NOTHING or not _runs_torchs_code(target)


def _runs_torchs_code(module: nn.Module) -> bool:
    """Whether ``module``'s forward and _conv_forward are torch's: their code is in torch's
    files (a wrapper made with functools.wraps takes torch's name, not its code), and
    none is set on the instance."""
    methods = [getattr(type(module), name, None) for name in _OWN_CODE]
    return (all(method is None or _in_torchs_modules(method) for method in methods)
            and not forward_set_on(module) and "_conv_forward" not in vars(module))


@functools.lru_cache(maxsize=64)  # asked at every kept call: a few functions, each read once
def _in_torchs_modules(function) -> bool:
    code = getattr(function, "__code__", None)
    return code is not None and os.path.dirname(code.co_filename) == _TORCH_MODULES_DIR


_TORCH_MODULES_DIR = os.path.dirname(nn.modules.linear.__file__)


__all__ = ["KeptOps", "DEFAULT_KEPT_OPS", "TAPPED_FUNCTIONS", "aten_policy", "may_draw"]
