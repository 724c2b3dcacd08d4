"""Selective options that keep some of a block's expensive calls, not all: which a
block plan may choose (block_options.py, NOTE [ Block options priced ]).

NOTE [ Kept subsets ]
``"selective"`` keeps the outputs of every linear layer and of attention
(runtime/kept_ops.py's default), torchtitan's rule. What keeping a call's output saves
and what recomputing it costs differ from call to call: a projection whose output only
joins the residual stream keeps bytes that only the recompute reads (the residual, for
the next norm), where recomputing it costs one matmul (the block's last one keeps
nothing: the early stop ends the recompute as its input is saved, before it returns,
runtime/selective.py); an MLP's wide first layer keeps four times the hidden width
for one matmul. So between
``"selective"`` and a checkpoint of the block's input lie options that keep a subset
of the calls (``KeptOps(module_names=...)``), each a point of its own in bytes and
seconds, which the plan's program can mix across blocks.

Which subsets, without measuring all 2^k of a block's k calls:

1. The calls a selective block would keep, in the order its forward makes them: each
   module of the default's types that the forward calls, named as the block's
   ``named_modules()`` names it, and attention where it runs.
2. Each call dropped alone (every other one kept), its step run once, untimed: the
   bytes it keeps, counted as any option's are, and the FLOPs of its matmuls and
   attention (``torch.utils.flop_counter``), which count what its recompute runs again
   and are the same from run to run, where the seconds of a call dropped move within a
   timed step's noise.
3. The calls that save bytes when dropped, ordered by the FLOPs that adds per byte
   saved, cheapest first; then the subsets that drop the first one, two, ... of them:
   a path from ``"selective"`` towards the input checkpoint, k - 1 options at most,
   each measured as any option is, its bytes counted. A call whose drop saves no
   bytes (the block's last projection, whose output is not kept) stays in every
   subset: kept, it spares its matmul in the recompute.
4. Their seconds: the path's last subset is timed against the plain block, as any
   option is, and priced at least at ``"selective"``'s seconds (it recomputes what
   that one does, and more); each subset between them is priced by its FLOPs, on the
   line through those two: ``s = s_selective + (F - F_selective) * (s_last -
   s_selective) / (F_last - F_selective)``. Neighbours on the path differ by one
   projection's recompute, within a timed step's noise: timed apart, their prices come
   in the noise's order, and a plan takes a subset that recomputes more for nothing.
   On the line, the path's prices rise with what each subset recomputes, and a kind
   of block costs two timed options, not k - 1.

The path's subsets are offered to the program with their measured terms, as
``"selective"`` is; the program takes whichever is fastest within the budget. Only
exact (the codecs' and offload's selective options keep every call), only where the
profile has times (a meta profile has no seconds to price by), and only for blocks of
at most :data:`MOST_CALLS` calls.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from .._taps import ATTENTION
from ..runtime.keep_modes import BlockOption
from ..runtime.keep_rules import EXACT
from ..runtime.kept_ops import DEFAULT_KEPT_OPS, KeptOps
from .step_isolation import isolated_steps

# The most calls a block's subsets are searched over: k untimed steps for the calls
# alone and two or three more per subset of the path (a block of 16 linear layers and
# attention, an 8-expert MoE's 24 linear layers are left out).
MOST_CALLS = 12

_ATTENTION = "scaled_dot_product_attention"


def called_units(block: nn.Module, run) -> list:
    """The calls a selective ``block`` keeps, in forward order (NOTE [ Kept subsets ],
    step 1): ``("module", name)`` for each module of the default's types that
    ``run()`` (a forward of the block) calls, ``("function", name)`` for attention."""
    found, names = [], {}
    for name, module in block.named_modules():
        if name and isinstance(module, DEFAULT_KEPT_OPS.modules):
            names[module] = name

    def seen(unit):
        if unit not in found:
            found.append(unit)

    def record(module, args):
        seen(("module", names[module]))

    def attention(call_next, *args, **kwargs):
        seen(("function", _ATTENTION))
        return call_next(*args, **kwargs)

    handles = [module.register_forward_pre_hook(record) for module in names]
    try:
        with ATTENTION.handled(attention):
            run()
    finally:
        for handle in handles:
            handle.remove()
    return _outermost(found)


def _outermost(units: list) -> list:
    """``units`` but those under another module unit (a Linear inside a kept Linear
    subclass): a selective recompute keeps the outermost call."""
    modules = [name for kind, name in units if kind == "module"]
    return [(kind, name) for kind, name in units
            if kind != "module" or not any(name.startswith(other + ".") for other in modules)]


def subset_option(units: list, kept: list) -> Optional[BlockOption]:
    """The exact selective option keeping the calls ``kept`` of ``units``; None where it
    keeps none."""
    if not kept:
        return None
    if len(kept) == len(units):
        return BlockOption("selective", EXACT, DEFAULT_KEPT_OPS)
    names = tuple(name for kind, name in kept if kind == "module")
    functions = tuple(name for kind, name in kept if kind == "function")
    ops = KeptOps(modules=DEFAULT_KEPT_OPS.modules if names else (), functions=functions,
                  module_names=names or None)
    return BlockOption("selective", EXACT, ops)


class KeptSubsets:
    """The subset options of each block (NOTE [ Kept subsets ]), found with
    ``measurer`` (block_options.BlockMeasurer), once per kind of block."""

    def __init__(self, measurer):
        self.measurer = measurer
        self._found = {}

    def at(self, a: int) -> list:
        """The subset options of block ``a`` besides ``"selective"`` itself."""
        key = self.measurer.signature(a)
        if key not in self._found:
            self._found[key] = self._search(a)
        return self._found[key]

    def _search(self, a: int) -> list:
        measurer = self.measurer
        if not measurer.timed:
            return []
        layer = measurer.layers[a]
        block = getattr(layer, "block", layer)
        with isolated_steps(layer), torch.enable_grad():  # the forward a selective block runs
            units = called_units(block, lambda: layer(measurer.example(a)))
        if not 2 <= len(units) <= MOST_CALLS:
            return []
        everything = measurer.sized(a, subset_option(units, units))
        if everything is None:
            return []
        alone = {unit: measurer.sized(a, subset_option(units, [u for u in units if u != unit])) for unit in units}
        saving = [unit for unit, sized in alone.items() if sized is not None and sized[0] < everything[0]]
        order = sorted(saving, key=lambda unit: _cost_per_byte(everything, alone[unit]))
        path = [subset_option(units, [u for u in units if u not in order[:count]])
                for count in range(1, len(order) + 1)]
        return _priced(measurer, a, subset_option(units, units), everything,
                       [option for option in path if option is not None])


def _priced(measurer, a: int, selective: BlockOption, everything: tuple, path: list) -> list:
    """The options of ``path`` that block ``a`` can run, priced (NOTE [ Kept subsets ],
    step 4); ``everything``: ``selective``'s ``(R, FLOPs)``."""
    first = measurer.measured(a, selective)
    last = measurer.measured(a, path[-1]) if path else None
    flops = [measurer.sized(a, option) for option in path]
    if first is None or last is None or None in flops or flops[-1][1] <= everything[1]:
        return [option for option in path if measurer.measured(a, option) is not None]  # no line: each timed
    measurer.at_least(a, path[-1], first.seconds)
    rate = (max(last.seconds, first.seconds) - first.seconds) / (flops[-1][1] - everything[1])
    options, added = [], 0
    for option, sized in zip(path[:-1], flops):
        added = max(added, sized[1] - everything[1])  # each recomputes all the one before it does
        if measurer.priced(a, option, first.seconds + rate * added) is not None:
            options.append(option)
    return options + [path[-1]]


def _cost_per_byte(everything: tuple, dropped: tuple) -> float:
    """FLOPs added per byte saved by dropping a call (``(R, FLOPs)`` pairs): how the
    path orders them."""
    return max(dropped[1] - everything[1], 0) / (everything[0] - dropped[0])


__all__ = ["KeptSubsets", "MOST_CALLS", "called_units", "subset_option"]
