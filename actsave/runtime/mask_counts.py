"""The number of True elements of each mask a lossy checkpointed forward saves, checked
against its recompute's (:class:`MaskCounts`).

NOTE [ Masks a lossy recompute counts again ]
A mask saved for backward (``x[a > 0]``, ``masked_select``, ``torch.where``) is a
decision on the values, and a lossy recompute, from decoded inputs, takes it again.
Where it finds another number of True elements, the mask keeps its shape, so the check
of each save's shape passes; a backward that acts element by element (``where``,
``masked_fill``) then only decides those elements otherwise, as limits.md says of a
comparison, but one that gathers or scatters through the mask's True elements in order
(``masked_select``, indexing by it, ``masked_scatter``, ``index_put``) moves the
gradient of the forward's elements onto the recompute's: misaligned and silent
(``masked_select``; docs/results.md, "A twenty-first adversarial run") or torch's own
shape error. So each boolean save of a
lossy forward keeps its count, a 0-d tensor attached to the kept inputs (made on the
device: no sync); the recompute, as it ends, compares them all at once (one sync per
recompute that saved a mask) and marks those that differ; and a node of the gathering
kinds that unpacks a marked one (autograd's current node) gets a RecomputeError naming
the function instead. An exact recompute computes every mask as its forward did and
counts none.
"""
from __future__ import annotations

from typing import Callable

import torch

from .placeholders import Slot


def counts_mask(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``, a save of a lossy forward, is a mask whose count it keeps."""
    return tensor.dtype == torch.bool and tensor.numel() > 0


def true_count(tensor: torch.Tensor) -> torch.Tensor:
    """The mask's number of True elements, on its device (no sync)."""
    return tensor.sum(dtype=torch.int64)


# The backwards that gather or scatter through a mask's True elements in order.
_GATHERS_BY_MASK = frozenset({"MaskedSelectBackward0", "IndexBackward0", "MaskedScatterBackward0",
                              "IndexPutBackward0"})


class MaskCounts:
    """The masks one recompute saved, each beside the count its forward's kept."""

    def __init__(self):
        self._slots, self._forward, self._recompute = [], [], []

    def note(self, tensor: torch.Tensor, slot: Slot) -> None:
        """The recompute's save ``tensor`` for ``slot``, whose forward save was a mask."""
        slot.recounted = None
        self._slots.append(slot)
        self._forward.append(slot.mask_count.fetch())
        self._recompute.append(true_count(tensor))

    def mark_differing(self) -> None:
        """As the recompute ends: each noted slot whose count differs gets ``recounted``,
        (forward's, recompute's), which :func:`check_unpacked` reads."""
        if not self._slots or self._forward[0].device.type == "meta":  # no values to count (a meta step)
            self._slots, self._forward, self._recompute = [], [], []
            return
        forward = torch.stack(self._forward)
        recompute = torch.stack(self._recompute).to(forward.device)
        for i in (forward != recompute).nonzero().flatten().tolist():  # the one sync
            self._slots[i].recounted = (int(forward[i]), int(recompute[i]))
        self._slots, self._forward, self._recompute = [], [], []


def check_unpacked(slot: Slot, mismatch: Callable[[str], Exception], function_name: str) -> None:
    """Raise ``mismatch(message)`` where the node unpacking ``slot``'s mask gathers
    through it and the recompute counted it otherwise."""
    node = torch._C._current_autograd_node()
    if slot.recounted is None or node is None or node.name() not in _GATHERS_BY_MASK:
        return
    forward, recompute = slot.recounted
    raise mismatch(
        f"the lossy recompute of {function_name} saved a mask (a boolean tensor: x > 0 for x[x > 0], "
        f"masked_select) with {recompute} elements True where its forward's had {forward}: the comparison ran on "
        f"decoded values and decided otherwise, and {node.name()} gathers the gradient through the mask's True "
        "elements, so it would land on other elements. Keep this function exactly (no codec), or compute the "
        "mask from values the codec does not change (NOTE [ Masks a lossy recompute counts again ] in "
        "runtime/mask_counts.py).")
