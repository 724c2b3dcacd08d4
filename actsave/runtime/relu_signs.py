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
decisions ], keeps_decisions; an in-place ReLU on a view: NOTE [ In-place ReLUs on
views ], InplaceRelus.

The bit is "not (y <= 0)", the test ``threshold_backward`` applies, so NaN counts as
passing: non-finite values still reach the gradient.
"""
from __future__ import annotations

import contextlib
import threading
import weakref
from typing import Optional

import torch
from torch import nn
from torch.utils.weak import WeakTensorKeyDictionary

from .._torch import is_relu_node, version
from ..codecs import pack_relu_signs
from ..codecs.backend import implementation
from ..triton_kernels import bitfields, decision_table
from .forward_dispatch import runs_its_class_forward
from .layers import module_hooks, modules_among


def is_relu_output(tensor: torch.Tensor) -> bool:
    """Whether autograd is saving ``tensor`` as the output of a ReLU: by its autograd
    node, or for an in-place ReLU module on a view, as InplaceRelus saw it (NOTE
    [ In-place ReLUs on views ])."""
    return is_relu_node(tensor.grad_fn) or _watched_relu_output(tensor)


# NOTE [ In-place ReLUs on views ]
# An in-place op on a view rebases the view's history: its autograd node is then a view
# node (AsStridedBackward0, or the view's own op replayed) over the base's CopySlices,
# which wraps the ReluBackward0 where Python cannot see it, so the node does not say
# ReLU, and the tensor alone cannot tell ``relu_`` from ``tanh_``. That is so whoever
# made the view (a Linear on a 3-D input returns one, so does ``x.view(...)`` or
# ``x[:, :]``); known by its node alone, its decisions would not be kept, and a lossy
# recompute's ReLU flips on it would go uncorrected. So while a lossy forward runs
# (a checkpointed segment's, function.py; a kept call's, kept_saves.py), InplaceRelus
# watches the ``nn.ReLU(inplace=True)`` modules that run their class's own forward (a
# subclass's, or one set on the instance that does not say it wraps it, may change
# its input otherwise: forward_dispatch.runs_its_class_forward): hooks on
# those among the known layers (layers.py, NOTE [ Known layers ]), none where there
# are none, global ones only for
# a function whose layers are not known; exact modes watch nothing. While one runs, its
# input object is the ReLU output being saved; once it returns, that view is marked
# with its version. It stays a ReLU output while its version is that one: an in-place
# change after the ReLU (of it, or of its base) moves it, and it is no longer known (as
# a non-view's ReLU node is replaced). The mark holds no autograd node, which could hold
# the view and so keep the mark alive. The recompute needs no watch: it restores each
# save the forward kept bits for by its placeholder, and the restore writes through the
# view into the storage the next layer reads. ``F.relu(x, inplace=True)`` or
# ``x.relu_()`` called on a view by a module's own code runs no ReLU module, and stays
# unknown.
_VIEW_OUTPUTS = WeakTensorKeyDictionary()  # view -> its version as the ReLU left it
_RUNNING = threading.local()


def _running_relus() -> list:
    """The inputs of this thread's watched in-place ReLU modules running now, innermost last."""
    if not hasattr(_RUNNING, "inputs"):
        _RUNNING.inputs = []
    return _RUNNING.inputs


def _watched_relu_output(tensor: torch.Tensor) -> bool:
    running = getattr(_RUNNING, "inputs", None)
    if running and running[-1] is tensor:
        return True
    if not _VIEW_OUTPUTS or not tensor._is_view():
        return False
    return _VIEW_OUTPUTS.get(tensor) == version(tensor)


def _is_inplace_relu(module) -> bool:
    # Its class's forward: a subclass's, or one set on the instance, may do something else in place.
    return (isinstance(module, nn.ReLU) and module.inplace and type(module).forward is nn.ReLU.forward
            and runs_its_class_forward(module))


class InplaceRelus:
    """Follows the in-place ReLU modules that run on this thread while :meth:`watching`,
    so that :func:`is_relu_output` knows their outputs on views (NOTE [ In-place ReLUs
    on views ]). ``relus``: the in-place ReLU modules the watched function can run, when
    its layers are known (layers.py, NOTE [ Known layers ]): hooks go on those alone,
    and none at all where there are none. None: global module hooks watch every call."""

    def __init__(self, relus: Optional[list] = None):
        self._relus = relus
        self._thread = threading.get_ident()

    @classmethod
    def among(cls, modules) -> "InplaceRelus":
        """A watch of the in-place ReLUs among ``modules`` (layers.modules_among)."""
        return cls(modules_among(modules, _is_inplace_relu))

    @contextlib.contextmanager
    def watching(self):
        """Register the module hooks for the body (none where no in-place ReLU can run)."""
        if self._relus == []:
            yield self
            return
        self._thread = threading.get_ident()
        running = _running_relus()
        depth = len(running)
        try:
            with module_hooks(self._relus, self._before, self._after):
                yield self
        finally:
            del running[depth:]  # a ReLU that raised

    def _before(self, module, args) -> None:
        if threading.get_ident() == self._thread and _is_inplace_relu(module):
            _running_relus().append(args[0] if args else None)

    def _after(self, module, args, output) -> None:
        if threading.get_ident() != self._thread or not _is_inplace_relu(module):
            return
        running = _running_relus()
        if running:
            running.pop()
        if isinstance(output, torch.Tensor) and output.requires_grad and output._is_view():
            _VIEW_OUTPUTS[output] = version(output)


def known_non_negative(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is known, without reading it, to hold no negative value: it
    is a ReLU output, or a Hardtanh's clamped at 0 or above (ReLU6's): then >= 0 or NaN,
    so a codec may store it on an unsigned grid (codecs, NOTE [ Unsigned grids ]). An
    in-place change after it gives the tensor another autograd node, and it is no longer
    known; so is a view of it (an in-place ReLU module on a view: NOTE [ In-place ReLUs
    on views ])."""
    node = tensor.grad_fn
    if node is not None and type(node).__name__ == "HardtanhBackward0" and node._saved_min_val >= 0:
        return True
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
# - a checkpointed segment's frame (function.py, CheckpointFrame._keep_decisions), with the
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
    """The forward's decisions of a ReLU output, one bit per element
    (:func:`actsave.codecs.pack_relu_signs`)."""
    return pack_relu_signs(output)


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
