"""Compiled layers inside a lossy checkpoint: which code they run, compiled or eager.

NOTE [ Decisions in compiled layers ]
A lossy recompute takes the forward's ReLU and max-pool decisions (relu_signs.py,
pool_decisions.py): the pack hook finds them among autograd's saves by their autograd
nodes and module hooks, and the recompute corrects each ReLU output before anything
reads it. A compiled layer (``torch.compile(layer)``, ``layer.compile()``) hides both:
its saves are its graph's, under one node, and its recompute runs the graph whole.
Without the decisions a conv-BN-ReLU network's BatchNorm gradients lose most of their
precision (docs/limits.md, "torch.compile"). So the first lossy call of a chain of
layers that holds a compiled module runs with compiled code off on its thread
(``_torch.compiled_code_eager``; not ``torch.compiler.set_stance``, which turns it off
for every thread: NOTE [ Compiled code run eagerly on one thread ]) and records
whether that eager forward kept any decision. Where it did, every later call of those layers runs their eager
code too (one warning per process); where it did not (a transformer block: GELU, no
max pool), later calls run the compiled code, which then loses nothing. A call's
recompute runs the code its forward ran, so that both save the same tensors.
"""
from __future__ import annotations

import contextlib
import warnings
import weakref
from typing import Optional

from .._torch import compiled_code_eager
from .._torch_graphs import is_compiled

# (weak references to a call's layers) -> whether their eager code keeps decisions.
# A weak reference hashes as its module while alive and keeps that hash after; the
# entries of collected layers are dropped once there are _PRUNE_AT entries.
_KEEPS_DECISIONS: dict = {}
_PRUNE_AT = 1024
_warned = False


class LayerCode:
    """Which code one checkpointed call runs its layers' compiled modules by: their
    compiled code, or their eager code (NOTE [ Decisions in compiled layers ]).
    ``function``: what the call checkpoints, ``layers`` and ``modules`` the modules it
    runs where known (layers.py); a compiled function of unknown modules counts as
    one compiled layer."""

    def __init__(self, function, layers: Optional[tuple], modules: Optional[list], lossy: bool):
        self._key = None
        self.eager = False
        if layers is None:
            layers, modules = (function,), [(0, function)]
        if lossy and any(is_compiled(module) for _, module in modules):
            self._key = tuple(weakref.ref(layer) for layer in layers)
            known = _KEEPS_DECISIONS.get(self._key)
            self._probing = known is None
            self.eager = True if known is None else known

    def running(self):
        """The context the call's forward and its recompute run in."""
        return compiled_code_eager() if self.eager else contextlib.nullcontext()

    def forward_ended(self, kept_decisions: bool) -> None:
        """Record what the first call's eager forward found: whether it kept decisions."""
        if self._key is None or not self._probing:
            return
        if len(_KEEPS_DECISIONS) >= _PRUNE_AT:
            # Over a copy of the keys (one C call): another thread may add an entry meanwhile.
            for key in [key for key in list(_KEEPS_DECISIONS) if any(ref() is None for ref in key)]:
                _KEEPS_DECISIONS.pop(key, None)
        _KEEPS_DECISIONS[self._key] = kept_decisions
        if kept_decisions:
            _warn_once()


def _warn_once() -> None:
    global _warned
    if _warned:
        return
    _warned = True
    warnings.warn(
        "actsave: a checkpoint that keeps its input by a lossy codec holds compiled layers whose eager code "
        "makes ReLU or max-pool decisions; a compiled graph hides them from the recompute, so those layers run "
        "their eager code there, forward and recompute (NOTE [ Decisions in compiled layers ]). Keep them "
        "compiled with an exact checkpoint (compress=None), or accept the eager code.", stacklevel=5)
