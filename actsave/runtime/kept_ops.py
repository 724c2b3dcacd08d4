"""What a selective recompute keeps the outputs of (selective.py, NOTE [ Selective
recompute ]): :class:`KeptOps`, the module types and functions whose calls it does not
run again, which of those calls may draw random numbers (:func:`may_draw`), and the aten
operators those calls are in a compiled graph, where torch's selective checkpoint saves
them (keep_modes.py)."""
from __future__ import annotations

import dataclasses
from typing import Optional

from torch import nn

from .._torch import ATTENTION, aten_overloads
from ..errors import ConfigError

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
        named = [(f"{i}.{name}".rstrip(".") if indexed else name, m) for i, layer in enumerate(layers)
                 for name, m in layer.named_modules(remove_duplicate=False) if isinstance(m, self.modules)]
        unmatched = [wanted for wanted in self.module_names if not any(_names(name, wanted) for name, _ in named)]
        if unmatched:
            known = sorted({name for name, _ in named if name})
            raise ConfigError(f"KeptOps(module_names=...) names {unmatched}, which match no module of the types "
                              f"{[m.__name__ for m in self.modules]} in the checkpointed module; its modules of "
                              f"those types are {known}. Name one of them (a qualified name or its last parts)")
        return [(name, m) for name, m in named if any(_names(name, wanted) for wanted in self.module_names)]


def _names(qualified: str, wanted: str) -> bool:
    """Whether ``wanted`` names the module at ``qualified``: the whole name or its last
    parts after a dot, as PEFT's ``target_modules`` match."""
    return qualified == wanted or qualified.endswith("." + wanted)


DEFAULT_KEPT_OPS = KeptOps()


def aten_ops_of(ops: KeptOps) -> Optional[frozenset]:
    """The aten overloads whose outputs torch's selective checkpoint saves for the calls
    ``ops`` names, in a compiled graph (keep_modes.py); None where a named module type
    has none known here, or where ``ops`` keeps some modules of a type by name: a policy
    per aten operator cannot tell one linear layer's matmul from another's."""
    if ops.module_names is not None:
        return None
    found = set()
    for module_type in ops.modules:
        overloads = next((names for known, names in _ATEN_OPS.items() if issubclass(module_type, known)), None)
        if overloads is None:
            return None
        found |= overloads
    for name in ops.functions:
        found |= _ATEN_OPS[name]
    return frozenset(found)


# A kept call's work as the aten operators a compiled graph runs: a linear layer's
# matmul (addmm with a bias, mm without; 3-D inputs are folded to 2-D first), a
# convolution, attention's fused kernels (each device's) and the math path's matmuls.
_ATEN_OPS = {
    nn.Linear: aten_overloads("mm.default", "addmm.default"),
    nn.modules.conv._ConvNd: aten_overloads("convolution.default"),
    "scaled_dot_product_attention": aten_overloads(
        "_scaled_dot_product_flash_attention.default", "_scaled_dot_product_efficient_attention.default",
        "_scaled_dot_product_cudnn_attention.default", "_scaled_dot_product_flash_attention_for_cpu.default",
        "bmm.default"),
}


# torch's own layers whose forward draws no random number. Exactly these types: a
# subclass may draw (a LoRA Linear's input dropout, a parametrization adding noise to
# the weight, which makes a ParametrizedLinear), and a kept call skipped in the
# recompute must then still advance the generator as its forward did.
_DRAW_NOTHING = frozenset({nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d,
                           nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d})


def may_draw(target, args: tuple, kwargs: dict) -> bool:
    """Whether a kept call may draw random numbers: attention with dropout, a module of
    any type but torch's own linear layers and convolutions (it may hold a Dropout)."""
    if isinstance(target, str):
        dropout = kwargs.get("dropout_p", args[4] if len(args) > 4 else 0.0)
        return bool(dropout)
    return type(target) not in _DRAW_NOTHING


__all__ = ["KeptOps", "DEFAULT_KEPT_OPS", "TAPPED_FUNCTIONS", "aten_ops_of", "may_draw"]
