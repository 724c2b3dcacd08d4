"""The elements of each mask a lossy checkpointed forward saves, one bit each, checked
against its recompute's (:class:`SavedMasks`).

NOTE [ Masks a lossy recompute compares ]
A mask saved for backward (``x[a > 0]``, ``masked_select``, ``torch.where``) is a
decision on the values, and a lossy recompute, from decoded inputs, takes it again.
Where it decides an element otherwise, the mask keeps its shape, so the check of each
save's shape passes; a backward that acts element by element (``where``,
``masked_fill``) then only decides those elements otherwise, as limits.md says of a
comparison, but one that gathers or scatters through the mask's True elements in order
(``masked_select``, indexing by it, ``masked_scatter``, ``index_put``) moves the
gradient of the forward's elements onto the recompute's: misaligned and silent
(``masked_select``; docs/results.md, "A twenty-first adversarial run") or torch's own
shape error. A count of True elements does not see two elements flipped the two ways
(misaligned and silent: "A twenty-second adversarial run"), so each boolean save of a
lossy forward keeps its elements, one bit each (NOTE [ Bit fields ]: an eighth of the
mask's bytes), attached to the kept inputs; the recompute, as it ends, compares them
all with its own masks' at once (one sync per recompute that saved a mask) and marks
those that differ; and a node of the gathering kinds that unpacks a marked one
(autograd's current node) gets a RecomputeError naming the function instead. An exact
recompute computes every mask as its forward did and keeps none.
"""
from __future__ import annotations

from typing import Callable

import torch

from ..triton_kernels import bitfields
from .placeholders import Slot


def compares_mask(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``, a save of a lossy forward, is a mask whose bits it keeps."""
    return tensor.dtype == torch.bool and tensor.numel() > 0


def mask_bits(tensor: torch.Tensor) -> torch.Tensor:
    """The mask's distinct elements, one bit each, row-major, on its device (no sync):
    a dimension it is broadcast along (stride 0: a causal mask expanded over a batch and
    heads) is taken once."""
    return bitfields.pack(_distinct(tensor).reshape(-1).view(torch.uint8), 1)


def mask_bytes(tensor: torch.Tensor) -> int:
    """The bytes of :func:`mask_bits` of ``tensor``."""
    return -(-_distinct(tensor).numel() // 8)


def _distinct(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` with each dimension it is broadcast along cut to its first element."""
    if 0 not in tensor.stride():
        return tensor
    return tensor[tuple(slice(0, 1) if stride == 0 else slice(None) for stride in tensor.stride())]


# The backwards that gather or scatter through a mask's True elements in order. Those
# of a scatter into ``self`` (``y[mask] = v``, masked_scatter) gather the gradient of
# their source alone: with a source that needs none (``y[mask] = 0``), they go element
# by element, as ``masked_fill``'s.
_GATHERS_BY_MASK = frozenset({"MaskedSelectBackward0", "IndexBackward0", "MaskedScatterBackward0",
                              "IndexPutBackward0"})
_GATHERS_A_SOURCE = frozenset({"MaskedScatterBackward0", "IndexPutBackward0"})


class SavedMasks:
    """The masks one recompute saved, each beside the bits its forward's kept."""

    def __init__(self):
        self._slots, self._forward, self._recompute = [], [], []

    def note(self, tensor: torch.Tensor, slot: Slot) -> None:
        """The recompute's save ``tensor`` for ``slot``, whose forward save was a mask."""
        slot.recounted = None
        self._slots.append(slot)
        self._forward.append(slot.mask_bits.fetch())
        self._recompute.append(mask_bits(tensor))

    def mark_differing(self) -> None:
        """As the recompute ends: each noted slot whose mask differs gets ``recounted``,
        the (forward's, recompute's) counts of True, which :func:`check_unpacked` reads."""
        if not self._slots or self._forward[0].device.type == "meta":  # no values to compare (a meta step)
            self._slots, self._forward, self._recompute = [], [], []
            return
        pairs = list(zip(self._forward, (bits.to(forward.device) for bits, forward in zip(self._recompute,
                                                                                             self._forward))))
        # Masks broadcast otherwise in the recompute keep other bit counts: they differ.
        differing = torch.stack([torch.ne(forward, recompute).any() if forward.shape == recompute.shape
                                 else torch.ones((), dtype=torch.bool, device=forward.device)
                                 for forward, recompute in pairs])
        for i in differing.nonzero().flatten().tolist():  # the one sync
            self._slots[i].recounted = tuple(_true_count(bits) for bits in pairs[i])
        self._slots, self._forward, self._recompute = [], [], []


def _true_count(bits: torch.Tensor) -> int:
    """The True elements of a mask's bits (padding bits are 0)."""
    return int(bitfields.unpack(bits, 1, bits.numel() * 8).sum())


def check_unpacked(slot: Slot, mismatch: Callable[[str], Exception], function_name: str) -> None:
    """Raise ``mismatch(message)`` where the node unpacking ``slot``'s mask gathers
    through it and the recompute counted it otherwise."""
    node = torch._C._current_autograd_node()
    if slot.recounted is None or node is None or node.name() not in _GATHERS_BY_MASK:
        return
    if node.name() in _GATHERS_A_SOURCE and node.next_functions[-1][0] is None:  # a source with no gradient
        return
    forward, recompute = slot.recounted
    raise mismatch(
        f"the lossy recompute of {function_name} saved a mask (a boolean tensor: x > 0 for x[x > 0], "
        f"masked_select) with other elements True than its forward's ({recompute} True where its forward's had "
        f"{forward}): the comparison ran on decoded values and decided otherwise, and {node.name()} gathers the "
        "gradient through the mask's True elements, so it would land on other elements. Keep this function exactly "
        "(no codec), or compute the mask from values the codec does not change "
        "(NOTE [ Masks a lossy recompute compares ] in runtime/saved_masks.py).")
