"""The boundary between two chain segments where the next keeps the first's output by a
lossy codec: a ReLU output stored with its decisions from one read (:class:`Boundary`;
NOTE [ Decisions at a boundary ])."""
from __future__ import annotations

from typing import Optional

import torch

from .._torch import version
from .keep_rules import CallerTensors, KeepPolicy, placed, should_encode
from .relu_signs import known_non_negative
from .shared_copies import StoredCopy
from .store import stored_copy

# NOTE [ Decisions at a boundary ]
# Where a chain's checkpointed segment ends on a ReLU (an nn.ReLU layer; a block whose
# last op is one, as torchvision's BasicBlock; an even split's boundaries are moved onto
# ReLU outputs: NOTE [ Boundaries on ReLU outputs ]) and the next segment keeps its
# input by a lossy codec, the forward reads that output twice as it crosses the
# boundary: the first segment packs its ReLU decisions, which its lossy recompute
# restores (ForwardDecisions, as the ReLU saves its output), and the next segment
# encodes it as its kept input. The 8-bit codecs take both from one read (NOTE [ Signs
# from the encoder's read ]). So run_chain gives such a pair of segments a Boundary
# naming the next one's policy, and:
# - as the first segment's last layer starts, its ForwardDecisions holds back the
#   packing of each ReLU save that follows, to the next save (whoever makes it) or the
#   forward's end. A ReLU output's next user saves it (a conv, a Linear, a BatchNorm),
#   and so ends the hold: the hold keeps alive nothing the forward would have freed.
#   The exception: where the ops after the ReLU in the last layer save nothing, the
#   output lives to the forward's end (the end of that layer);
# - the held values must be those the ReLU saved: a change in place since (by the
#   tensor's version, checked as the hold ends) raises. Autograd refuses that change in
#   the backward too, as the ReLU's saved output modified by an in-place operation;
# - as the forward ends, if the held save is of the output and the next policy encodes
#   it (should_encode, on the unsigned grid), one encode makes its stored copy and its
#   bits. The bits are the first segment's decisions, attached to its kept inputs
#   (offloaded with them, where they are); the copy waits in the Boundary;
# - the next segment's kept input claims the copy where it would have encoded the same
#   tensor (store._KeptTensor, through SHARED as every stored copy); its KeptInputs lets
#   go of one it did not claim, run_chain of one no segment reached.
# The bits and codes are those of the two calls apart (the references are those calls),
# but where the last layer changes its ReLU output through ``.data`` (no version moves):
# then the bits are the changed values' (docs/limits.md, "ReLU decisions").
# A segment that starts in place (a private copy of its input) runs its layers as one
# call (passed_inputs.run_segment): no hold, its decisions packed apart.


class Boundary:
    """Between a chain's checkpointed segment and the next, which keeps its input by
    ``policy``: the first segment's output, where it is a ReLU's, stored by that policy
    with its ReLU decisions (NOTE [ Decisions at a boundary ]). ``made_by``: the tensors
    the chain's caller holds (should_encode)."""

    def __init__(self, policy: KeepPolicy, made_by: Optional[CallerTensors]):
        self._policy, self._made_by = policy, made_by
        self._tensor = self._version = self._kept = self._copy = None

    def encode_with_signs(self, output: torch.Tensor) -> Optional[torch.Tensor]:
        """The ReLU decisions of ``output``, the segment's, where the next policy encodes
        it; then its stored copy, made by the same encode, waits for :meth:`claim`.
        None where the next segment keeps it otherwise (the caller packs the bits). The
        next segment's kept input decides as it is made: :meth:`claim` hands the copy
        over only where that decision is this one."""
        if not known_non_negative(output) or not should_encode(output, self._made_by):
            return None
        kept = placed(self._policy, output.device)  # a lossy codec: run_chain's _boundaries
        packed, bits = kept.codec.encode_with_signs(output.detach())
        self._copy = stored_copy(kept, output, packed)
        self._tensor, self._version, self._kept = output, version(output), kept
        return bits

    def claim(self, tensor: torch.Tensor, kept: KeepPolicy, non_negative: bool) -> Optional[StoredCopy]:
        """The copy made of ``tensor`` where it is still that tensor, kept by the same placed
        policy on the unsigned grid: the caller's from now on. Else None."""
        copy = self._copy
        if copy is None or tensor is not self._tensor or version(tensor) != self._version or kept != self._kept \
                or not non_negative:
            return None
        self._copy = self._tensor = None
        return copy

    def discard(self) -> None:
        """Let go of a copy no segment claimed."""
        copy, self._copy, self._tensor = self._copy, None, None
        if copy is not None:
            copy.storage.release()
            copy.settle()


__all__ = ["Boundary"]
