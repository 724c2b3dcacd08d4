"""Exact ReLU decisions in a lossy recompute.

A segment recomputed from a compressed input computes slightly different
pre-activations; where they are near zero a ReLU decides the other way, and its
backward passes a gradient the forward blocked (or blocks one it passed). BatchNorm in
training mode puts much of the pre-activation mass near zero, so on conv-BN-ReLU
networks those flips, not the codec's rounding, set the gradient error: without the
decisions a ReLU network's worst parameter-gradient SQNR is far below the same
network's with GELU (docs/results.md, "Gradient fidelity", ReLU decisions, and
"Figures behind the code's rules").

So when a lossy checkpoint's forward saves a ReLU output, its sign pattern is kept
too, one bit per element (1/32 of the fp32 output), and the recompute corrects its
ReLU outputs in place to the forward's decisions before anything downstream reads
them (ActNN keeps ReLU masks in one bit for the same reason). Other piecewise
activations (LeakyReLU, ReLU6, Hardtanh) save their input, not their output, and are
recomputed as they come. Which saves keep bits: NOTE [ ReLU outputs that keep
decisions ], keeps_decisions.

The bit is "not (y <= 0)", the test ``threshold_backward`` applies, so NaN counts as
passing: non-finite values still reach the gradient.
"""
from __future__ import annotations

import weakref
from typing import Optional

import torch

from .._torch import is_relu_node
from ..codecs.backend import implementation
from ..triton_kernels import bitfields, decision_table


def is_relu_output(tensor: torch.Tensor) -> bool:
    """Whether autograd is saving ``tensor`` as the output of a ReLU."""
    return is_relu_node(tensor.grad_fn)


def known_non_negative(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is known, without reading it, to hold no negative value: it
    is a ReLU output (then >= 0 or NaN), so a codec may store it on an unsigned grid
    (codecs, NOTE [ Unsigned grids ]). An in-place change after the ReLU gives the
    tensor another autograd node, and it is no longer known; so is a view of it."""
    return is_relu_output(tensor)


def input_nodes(inputs) -> dict:
    """What :func:`made_by_segment_relu` needs of a segment's inputs, taken as it
    starts: the autograd node of each, by object."""
    return {id(t): t.grad_fn for t in inputs}


def made_by_segment_relu(tensor: torch.Tensor, segment_inputs: dict) -> bool:
    """Whether ``tensor`` is a ReLU output that the segment itself computed: its
    decisions are the segment's to keep. A segment input that was a ReLU output when
    the segment started was decided by the previous segment, which keeps those bits.

    Judged by the autograd node, not by the object: an in-place ReLU at the segment's
    start returns its input object, rebased on a new ReLU node, and those decisions
    are this segment's (taken for the previous segment's, no segment keeps them, and
    the recompute's ReLU flips go uncorrected: docs/results.md, "Figures behind the
    code's rules")."""
    if not is_relu_output(tensor):
        return False
    return id(tensor) not in segment_inputs or segment_inputs[id(tensor)] is not tensor.grad_fn


class FirstSaves:
    """Tells a ReLU output's first save (the ReLU's own) from the saves of the same
    tensor that follow it (the next Linear's input): only the first keeps bits, as
    correcting the recomputed output in place fixes it for later savers too."""

    def __init__(self):
        self._last = _dead_ref

    def is_first(self, relu_output: torch.Tensor) -> bool:
        # By object identity: the forward holds no saved tensor, so a new output may
        # reuse a freed one's memory, and pointers would confuse the two.
        first = self._last() is not relu_output
        self._last = weakref.ref(relu_output)
        return first


# NOTE [ ReLU outputs that keep decisions ]
# Under a lossy codec a ReLU output keeps its decisions, one bit per element, where the
# segment made it (made_by_segment_relu: not a segment input decided by the segment
# before) and, where later saves of the same tensor share the correction, at its
# first save only (FirstSaves). Who asks keeps_decisions:
# - a checkpointed segment's frame (function.py, _Frame._keep_decisions), with the
#   segment's input nodes and its FirstSaves;
# - a kept call's saves (kept_saves.py, _SavesStore._decisions), with no
#   FirstSaves: each stored copy decodes by itself, so each keeps its bits (repeated
#   saves of one copy share it: stored_once_key);
# - the planner's profile (planning/instrumented_step.py), one step of the whole chain,
#   so no segment inputs: per layer with a FirstSaves, as a frame decides; per stored
#   entry without, the segment's part priced where its first save is
#   (planning/stored_saves.py).
def keeps_decisions(tensor: torch.Tensor, segment_inputs: dict, first_saves: Optional[FirstSaves] = None) -> bool:
    """Whether this save of ``tensor`` keeps ReLU decision bits: NOTE [ ReLU outputs
    that keep decisions ]."""
    if not made_by_segment_relu(tensor, segment_inputs):
        return False
    return first_saves is None or first_saves.is_first(tensor)


def _dead_ref():
    return None


def pack_signs(output: torch.Tensor) -> torch.Tensor:
    """One bit per element of a ReLU output: 1 where backward passes the gradient
    (NOTE [ Bit fields ], row-major). One kernel launch on CUDA
    (triton_kernels/decisions/relu_signs.py)."""
    kernel = decision_table()["relu_signs", "pack"]
    return implementation(kernel, output)(output)  # the reference detaches what it reads


def unpack_signs(bits: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The forward's decisions as a bool tensor shaped like ``like``."""
    return bitfields.unpack(bits, 1, like.numel()).view(torch.bool).view(like.shape)


def restore_decisions_(recomputed: torch.Tensor, bits: torch.Tensor) -> None:
    """Make a recomputed ReLU output decide as the forward did, in place: zero where
    the forward blocked, the smallest positive normal where the forward passed but the
    recompute gave zero (a ReLU output is >= 0 or NaN: the kernel's ``max(y, tiny)``
    lifts exactly the zeros, and keeps NaN). One kernel launch on CUDA. ``recomputed`` is
    a tensor autograd does not track (the recompute's ``.data``, a decoded tensor): the
    change is no op of a graph, and its version counter is not the saved tensor's."""
    kernel = decision_table()["relu_signs", "restore"]
    implementation(kernel, recomputed)(recomputed, bits)
