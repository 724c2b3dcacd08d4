"""The decisions a checkpointed forward keeps for its lossy recompute (function.py):
its ReLU outputs' signs (relu_signs.py), its max pools' windows (pool_decisions.py)
and its Hardtanh and LeakyReLU modules' bounds (bound_decisions.py), and its masks'
bits, which the recompute checks (saved_masks.py), attached to the
kept inputs (in the same place, offloaded with them) and taken again by the
recompute's saves. One per lossy forward; an exact recompute decides as the forward
did, and keeps none.

NOTE [ A lossy recompute that takes another path ]
A function whose control flow reads values (``if h.sum() > 0``, a loop count from
``.item()``: adaptive computation) may take another path on the decoded inputs of its
lossy recompute. Where that path saves fewer tensors, or tensors of other shapes, the
check of each save raises (function.py, ``_fill``). Where it does more, the recompute
stops at the forward's last save (early stop), and saves of other operators of the
same shapes filled the forward's places: the backward read another layer's weight, and
every gradient came back wrong, silently (docs/results.md, "A twenty-second adversarial
run"). So a lossy forward notes, for each save that reads an
``nn.Parameter`` (the parameter, a view of it: a Linear's ``weight.t()``, or a view of
a cast of it: autocast's, ``w.to(dtype)``), which parameter and the save's strides and
offset, and the recompute's save at that place must read the same so (``W`` is not
``W.t()``); another raises RecomputeError. Left out: the frame's inputs and their
bases (the recompute's are new tensors: a codec decoded them), and leaves made inside
the function (``w.detach().requires_grad_()``: a new one each call), which are no
``nn.Parameter``. A parameter replaced between the forward and the backward raises so
too. A path that differs only in activations of the same shapes is not seen (as in
torch's checkpoint, which checks shapes alone).
"""
from __future__ import annotations

import contextlib
import warnings
from typing import Optional

import torch
from torch import nn

from .._taps import TORCH_CHECKPOINT
from .._torch import leaf_base, version
from ..errors import RecomputeError
from . import bound_decisions, relu_signs
from .bound_decisions import BoundBits, BoundWatch
from .placeholders import Slot
from .pool_decisions import PoolDecisions, PoolWatch
from .saved_masks import SavedMasks, compares_mask, mask_bits


# A torch.utils.checkpoint called inside a lossy forward recomputes in the backward,
# outside actsave's recompute, from inputs the codec stored (it saves them under the
# outer hooks): its ReLUs, max pools and clamps decide again there, and no decision
# kept here reaches them (torchvision's memory-efficient DenseNet: docs/limits.md,
# "Other decisions a lossy recompute takes again"). Warned once, where code calls it
# through its module; a partial bound before (Hugging Face's gradient checkpointing) is
# not seen.
_warned_torch_checkpoint = False


def _torch_checkpoint_inside(call_next, *args, **kwargs):
    global _warned_torch_checkpoint
    if not _warned_torch_checkpoint:
        _warned_torch_checkpoint = True
        warnings.warn("actsave: torch.utils.checkpoint runs inside a checkpoint that keeps by a lossy codec: its "
                      "recompute runs in the backward, outside actsave's, from inputs the codec stored, and its "
                      "ReLUs and max pools decide again there (docs/limits.md, 'Other decisions a lossy recompute "
                      "takes again'). Nest actsave.checkpoint instead, or keep this block exactly.", stacklevel=3)
    return call_next(*args, **kwargs)


def torch_checkpoints_warned(lossy: bool):
    """While open on a lossy forward, a torch.utils.checkpoint called inside it warns once."""
    return TORCH_CHECKPOINT.handled(_torch_checkpoint_inside) if lossy else contextlib.nullcontext()


class ForwardDecisions:
    """The watches a lossy forward runs under and the decisions it attaches to its
    saves' placeholders. ``modules``: those under the function's known layers, or None
    (NOTE [ Known layers ]); ``inputs``: the forward's input tensors, whose ReLU
    decisions the segment before keeps (relu_signs.made_by_segment_relu)."""

    def __init__(self, modules, inputs):
        # NOTE [ Max-pool decisions ], NOTE [ In-place ReLUs on views ].
        self.pools = PoolWatch.among(modules)
        self.relus = relu_signs.InplaceRelus.among(modules)
        self.bounds = BoundWatch()  # NOTE [ Bound decisions ]
        self._relu_saves = relu_signs.FirstSaves()
        # Read during the forward only, while the caller still holds the inputs.
        self._input_nodes = relu_signs.input_nodes(inputs)
        # NOTE [ A lossy recompute that takes another path ]: the parameters among them.
        self._input_bases = {id(base) for base in map(leaf_base, inputs) if base is not None}
        self.nbytes = 0  # the decisions kept
        # NOTE [ Decisions at a boundary ]: whether the latest ReLU save waits to be
        # packed, and that save (tensor, its version, slot, kept inputs) while it does.
        self._holds, self._held = False, None
        self.masks = SavedMasks()  # NOTE [ Masks a lossy recompute compares ]

    @contextlib.contextmanager
    def forward_watching(self):
        with self.pools.watching(), self.relus.watching(), self.bounds.watching(), torch_checkpoints_warned(True):
            yield

    def recompute_watching(self):
        """What the recompute runs under: its max pools pool at the forward's windows;
        its masks counted anew."""
        self.masks = SavedMasks()
        return self.pools.watching()

    def keep(self, tensor: torch.Tensor, slot: Slot, kept) -> None:
        """Attach to ``slot`` the decisions of the save ``tensor``, kept as ``kept``
        (store.KeptInputs) keeps the inputs."""
        if self._held is not None:
            self._pack_held(self._unchanged_held())
        # The parameter it reads, if any: NOTE [ A lossy recompute that takes another path ].
        slot.parameter = _parameter_read(tensor, self._input_bases)
        pool = self.pools.window_of(tensor)  # also notes a pool's input: called for every save
        if pool is not None:
            window, input_size = pool
            attached = kept.attach(window.encode(tensor, input_size))
            slot.pool_decisions = PoolDecisions(attached, window, input_size)
            self.nbytes += attached.nbytes
        elif (bounds := BoundWatch.bounds_of_save()) is not None:
            slot.bound_decisions = BoundBits(kept.attach(bound_decisions.keep(tensor, bounds)), bounds)
            self.nbytes += slot.bound_decisions.bits.nbytes
        elif relu_signs.keeps_decisions(tensor, self._input_nodes, self._relu_saves):
            if self._holds:
                self._held = (tensor, version(tensor), slot, kept)
            else:
                self._attach_signs(relu_signs.pack_signs(tensor), slot, kept)
        elif compares_mask(tensor) and id(tensor) not in self._input_nodes:  # an input mask is kept as it is
            slot.mask_bits = kept.attach(mask_bits(tensor))
            self.nbytes += slot.mask_bits.nbytes

    def _attach_signs(self, bits: torch.Tensor, slot: Slot, kept) -> None:
        slot.relu_signs = kept.attach(bits)
        self.nbytes += slot.relu_signs.nbytes

    def hold_relu_saves(self) -> None:
        """From here (a chain segment's last layer starts) the latest ReLU save's
        decisions wait to be packed until the next save or the forward's end, where
        :meth:`hand_off` may take them from the encode of the next segment's kept input:
        NOTE [ Decisions at a boundary ]."""
        self._holds = True

    def _unchanged_held(self) -> torch.Tensor:
        """The held save's tensor, which must hold the values the ReLU saved. A change in
        place since is one autograd refuses in the backward too; its decisions are lost,
        so it raises now."""
        tensor, saved_version, _, _ = self._held
        if version(tensor) != saved_version:
            self._held = None
            raise RecomputeError(
                "a ReLU output was changed in place after the ReLU saved it, in the last layer of a checkpointed "
                "segment (or a forward hook on it). Autograd refuses such a change in the backward ('modified by "
                "an inplace operation'), and the ReLU's decisions, which a lossy recompute restores, are lost. "
                "Change a copy instead (out = out.clone()).")
        return tensor

    def _pack_held(self, tensor: torch.Tensor) -> None:
        _, _, slot, kept = self._held
        self._held = None
        self._attach_signs(relu_signs.pack_signs(tensor), slot, kept)

    def hand_off(self, output, boundary) -> None:
        """As the forward ends: where the held save is of ``output``, its decisions come
        from ``boundary``'s encode of it (boundaries.Boundary)."""
        if self._held is None or self._unchanged_held() is not output:
            return  # what is held, end_forward packs
        bits = boundary.encode_with_signs(output)
        if bits is not None:
            _, _, slot, kept = self._held
            self._held = None
            self._attach_signs(bits, slot, kept)

    def restore(self, tensor: torch.Tensor, slot: Slot, mismatch) -> None:
        """Make the recompute's save ``tensor`` decide as the forward's did, in place,
        through its ``.data`` (no op of a graph; read only where a decision applies:
        an alias is an operator of the host's); ``mismatch(message)`` is raised where
        the recompute took another path (NOTE [ A lossy recompute that takes another
        path ])."""
        if slot.parameter is not None and _parameter_read(tensor, ()) != slot.parameter:
            raise mismatch(_other_path(tensor, slot))
        if slot.relu_signs is not None:
            relu_signs.restore_decisions_(tensor.data, slot.relu_signs.fetch())
        if slot.pool_decisions is not None:
            self.pools.restored(tensor.data, slot.pool_decisions)
        if slot.bound_decisions is not None:
            decisions = slot.bound_decisions
            bound_decisions.restore_(tensor.data, decisions.bits.fetch(), decisions.bounds)
        if slot.mask_bits is not None:
            self.masks.note(tensor, slot)

    def drop_held(self) -> None:
        """Let go of a save held back, unpacked: its frame is released (a forward that
        raised, where hand_off may have raised on it)."""
        self._held = None

    def end_forward(self) -> None:
        """A save still held (the forward did not end on it) has its decisions packed."""
        if self._held is not None:
            self._pack_held(self._held[0])
        self._input_nodes, self._input_bases = {}, set()  # ids may be reused once the inputs are gone


def _parameter_read(tensor: torch.Tensor, input_bases) -> Optional[tuple]:
    """``(id, strides, offset)``: the ``nn.Parameter`` that ``tensor`` is, views, or views
    a cast of, and how it reads it; None for any other tensor and for parameters among
    ``input_bases`` (ids): NOTE [ A lossy recompute that takes another path ]."""
    base = tensor._base if tensor._is_view() else tensor
    if not base.is_leaf:
        node = base.grad_fn  # a cast of a parameter (autocast's, w.to(dtype)), or casts of casts
        while node is not None and node.name() == "ToCopyBackward0":
            node = node.next_functions[0][0]
        base = getattr(node, "variable", None)
    if not isinstance(base, nn.Parameter) or id(base) in input_bases:
        return None
    return id(base), tensor.stride(), tensor.storage_offset()


def _other_path(tensor: torch.Tensor, slot: Slot) -> str:
    return (f"a lossy recompute saved a tensor of shape {list(tensor.shape)} where its forward saved a parameter, "
            f"read otherwise, at the same place (save {slot.index}): on the decoded inputs, the function took "
            "another path than its forward (a branch or a loop count decided by values: .item(), bool(tensor)), or "
            "the parameter was replaced between the forward and the backward, so its backward would read other "
            "operators' saves and the gradients would be wrong. Keep this function's inputs exactly (compress=None "
            "for it), make its control flow depend on no value a codec rounds, and replace parameters after the "
            "backward (NOTE [ A lossy recompute that takes another path ] in runtime/forward_decisions.py).")
