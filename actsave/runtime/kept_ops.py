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
    transformer block, as torchtitan's op list does (its matmuls and attention)."""

    modules: tuple = (nn.Linear,)
    functions: tuple = ("scaled_dot_product_attention",)

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

    def names(self) -> list:
        """The names of what it keeps the outputs of: its module classes', then its
        functions'."""
        return [m.__name__ for m in self.modules] + list(self.functions)


DEFAULT_KEPT_OPS = KeptOps()


def aten_ops_of(ops: KeptOps) -> Optional[frozenset]:
    """The aten overloads whose outputs torch's selective checkpoint saves for the calls
    ``ops`` names, in a compiled graph (keep_modes.py); None where a named module type
    has none known here."""
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
