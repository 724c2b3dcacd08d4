"""Nested recompute: a checkpointed run of layers whose recompute keeps checkpoints of
its own (multi-level checkpointing, as in Beaumont et al. 2019; planning/nested_model.py
prices it, planning/nested_solver.py chooses it).

NOTE [ Nested recompute ]
The forward is that of any checkpointed segment (function.py): one frame, every save a
placeholder, only the segment's input kept. What differs is the recompute. The
segment's layers are cut into ranges (:class:`Range`), each either *plain*, its saves
filled by the pass that runs it, or *recomputed*, a checkpoint of its own: the pass
keeps only its input (exactly, by reference) and runs it for its output only; its
saves are filled by a later pass from that input, when backward first needs one of
them. For its output only means with grad, as in the forward, what it saves dropped as
it is saved, not under ``no_grad``: there some operators take other kernels (a max
pool without its indices returns another memory layout, eval-mode attention torch's
fast path), and the layers after them would compute other bits, or save other tensors
(docs/results.md, "A nineteenth adversarial run"). A recomputed range may be cut into
ranges again, to any depth. So while the last range runs backward, the segment holds
only the inputs of its earlier recomputed ranges, not their activations; each of them
is recomputed once more, later.

The forward records, at each layer, how many tensors were saved before it (so each
placeholder belongs to one layer, hence to one range), whether the tensor entering it
required grad, and at each recomputed range's start the RNG and autocast state
(state.py). A pass over a range replays the state of its start and runs its plain
ranges with grad enabled, filling their placeholders with the same checks as any
recompute, and its recomputed ranges for their output only, each layer's input given
the forward's ``requires_grad``, as is the tensor leaving them, so that every layer
runs and saves as it did in the forward. A pass stops once its last placeholder is
filled and its last input kept (the early stop). Module state the forward mutated
(BatchNorm statistics) is mutated once, not again by any pass. Passes are exact: a
range is recomputed from exact inputs, so no ReLU or max-pool decisions need keeping.
An input kept by reference (the segment's, a recomputed range's) stays as it is where
layers that turn out to hand it on lead to in-place ones: those change a copy, in the
forward and in every pass (NOTE [ A layer that turns out to pass its input on ]).
"""
from __future__ import annotations

import contextlib
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

import torch

from .._torch_graphs import eager_hooks
from ..errors import ConfigError
from .function import (
    _AllSlotsFilled,
    detached_or_same,
    CheckpointFrame,
    _recompute_depth,
    checkpointed_call,
)
from .held_generators import held_generators
from .layers import LayerChain, modules_under, repeated_modules
from .passed_inputs import HandedOn
from .recompute_options import DEFAULT_RECOMPUTE, RecomputeOptions
from .replay import ReplayState
from .keep_rules import EXACT, starts_in_place
from .store import KeptInputs


@dataclass(frozen=True)
class Range:
    """Layers ``start`` to ``stop - 1`` of a nested segment (indices into its layers).

    ``recomputed``: a checkpoint of its own (its parent's pass keeps only its input),
    else plain (its parent's pass fills its saves). ``inner``: how a recomputed
    range's own pass cuts it, contiguous ranges from ``start`` to ``stop``; () runs it
    as one plain range (a plain checkpoint)."""

    start: int
    stop: int
    recomputed: bool = True
    inner: tuple = ()

    def __post_init__(self):
        if not 0 <= self.start < self.stop:
            raise ConfigError(f"a nested range [{self.start}, {self.stop}) must hold at least one layer")
        if self.inner:
            if not self.recomputed:
                raise ConfigError(f"the plain range [{self.start}, {self.stop}) cannot be cut into inner "
                                  "ranges: only a recomputed range has a pass of its own")
            bounds = [(r.start, r.stop) for r in self.inner]
            joined = all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
            if bounds[0][0] != self.start or bounds[-1][1] != self.stop or not joined:
                raise ConfigError(f"the inner ranges {bounds} must cut [{self.start}, {self.stop}) into "
                                  "contiguous pieces")

    @property
    def parts(self) -> tuple:
        """What this range's pass runs: its inner ranges, or itself as a plain range."""
        return self.inner or (Range(self.start, self.stop, recomputed=False),)

    def walk(self):
        """This range and every range inside it."""
        yield self
        for part in self.inner:
            yield from part.walk()


class _Layers(LayerChain):
    """Calls the layers in order; in the first forward, records each layer's boundary
    (NOTE [ Nested recompute ]). ``private_copy``: the input is kept as a private copy,
    so in-place layers may change it (NOTE [ A layer that turns out to pass its input on ])."""

    def __init__(self, layers: Sequence, frame: Optional[_NestedFrame], private_copy: bool):
        self.layers, self.private_copy = list(layers), private_copy
        # The frame holds this as its function, so a reference back is weak: a strong one
        # would close a cycle that only Python's collector frees, and a graph dropped
        # without backward would hold the kept inputs until it runs (NOTE [ Lifetime of
        # kept inputs ]). Whoever calls this holds the frame while it runs.
        self._frame = None if frame is None else weakref.ref(frame)
        self.__qualname__ = "nested segment(" + ", ".join(type(m).__name__ for m in self.layers) + ")"

    def __call__(self, x):
        frame = None if self._frame is None else self._frame()
        watch = HandedOn(self.layers, None if self.private_copy else x)
        for i, layer in enumerate(self.layers):
            if frame is not None:
                frame.note_layer_start(i, x)
            x = watch.after(i, layer(x))
        if frame is not None:
            frame.note_layer_start(len(self.layers), x)
        return x


class _NestedFrame(CheckpointFrame):
    """A checkpointed call of ``layers`` recomputed in stages, as ``top`` cuts them."""

    def __init__(self, layers: Sequence, top: Range, kept: KeptInputs, replay: ReplayState, x: torch.Tensor,
                 options: RecomputeOptions):
        self.layers, self.top = list(layers), top
        self.slot_at, self.grad_at = [], []  # per layer start (and the end): slots saved before, requires_grad
        self.replay_at = {}  # start of a recomputed range -> the state its pass replays
        self._starts = {r.start for r in top.walk() if r.recomputed and r is not top}
        self._cuts = {bound for r in top.walk() if r is not top for bound in (r.start, r.stop)} - {0, len(layers)}
        self._inputs = {}  # recomputed range -> its input, kept by its parent's pass
        self._passed = set()
        self._recomputed_ranges = {r for r in top.walk() if r.recomputed}
        self._backward_inside = set()  # layers that ran a backward inside their forward
        super().__init__(_Layers(layers, self, kept.private_copy), kept, replay, (x,), {}, options)

    def note_layer_start(self, i: int, x: torch.Tensor) -> None:
        # Only the forward's own run records. A backward inside the forward runs the
        # layers again, in a recompute of the prefix saved so far (NOTE [ Backward inside
        # a checkpointed forward ]); its boundaries are not the forward's. (The forward
        # never runs inside a recompute: nested_call makes that a plain checkpoint.)
        if not self.in_forward or _recompute_depth() > 0:
            return
        if i in self._cuts and not isinstance(x, torch.Tensor):
            raise ConfigError(
                f"a nested segment's inner ranges are cut where layer {i} starts, but layer {i - 1} passes it a "
                f"{type(x).__name__}, not a tensor: a range keeps and recomputes from one tensor. Cut the chain "
                "only where its layers pass tensors, or give this segment no inner ranges.")
        self.slot_at.append(len(self.slots))
        self.grad_at.append(isinstance(x, torch.Tensor) and x.requires_grad)
        if i in self._starts:  # the generators the layers hold where the forward reached i too
            self.replay_at[i] = ReplayState.capture([x], self.options.preserve_rng_state, self.replay.generators)

    def unpack(self, slot) -> torch.Tensor:
        if self.in_forward:
            self._backward_inside.add(len(self.slot_at) - 1)  # the layer running now
            return self._unpack_in_forward(slot)
        if slot not in self.recomputed and not slot.handed_out:
            self._recompute_for(slot.index)
        return self.hand_out(slot)

    def _owner(self, r: Range, index: int):
        """The part of ``r`` whose layers saved placeholder ``index``."""
        return next(p for p in r.parts if self.slot_at[p.start] <= index < self.slot_at[p.stop])

    def _recompute_for(self, index: int) -> None:
        """Run the passes, outermost first, until placeholder ``index`` is filled."""
        r = self.top
        while True:
            if r not in self._passed:
                self._pass(r)
            part = self._owner(r, index)
            if not part.recomputed:
                return
            r = part

    def _pass(self, r: Range) -> None:
        kept = self.kept if r is self.top else self._inputs.pop(r)
        replay = self.replay if r is self.top else self.replay_at[r.start]
        self._filling = None
        try:
            self.touched.check_unchanged(self.function.__qualname__)
            # The module state is set part by part (_run_parts).
            with self.replaying(replay, self._fill_next, contextlib.nullcontext()):
                (x,), _ = kept.restore()
                self._run_parts(r, x, kept.private_copy)
        except _AllSlotsFilled:
            pass
        finally:
            kept.release()
        self._passed.add(r)
        if r is self.top:
            self.is_recomputed = True
        if self._passed.issuperset(self._recomputed_ranges):
            self.release()  # no pass reads the snapshot of module state again

    def _run_parts(self, r: Range, x: torch.Tensor, private_copy: bool) -> None:
        parts = r.parts
        # The early stop: after the last part the pass needs, a plain one's last
        # placeholder or a recomputed one's kept input.
        needed = [j for j, p in enumerate(parts) if p.recomputed or self.slot_at[p.stop] > self.slot_at[p.start]]
        last = needed[-1] if needed and self.options.early_stop else None
        # The pass's input and each input it keeps by reference stay as they are, while
        # layers hand them on to in-place ones; a private copy is the pass's own to
        # change (NOTE [ A layer that turns out to pass its input on ]).
        watch = HandedOn(self.layers[:r.stop], None if private_copy else x)
        for j, part in enumerate(parts):
            # The state the forward mutated, as the forward saw it: a part run without
            # grad runs on copies, dropped as it ends (a later pass runs its layers
            # again); a plain part's layers run for the last time, on the snapshot.
            with self.touched.as_in_forward(last=not part.recomputed, layers=range(part.start, part.stop)):
                if part.recomputed:
                    x = self._keep_and_skip(part, x, watch, stop=j == last)
                else:
                    # Handed over in a list, so that this frame holds no reference to the
                    # part's input while the part runs (a layer that does not save it frees it).
                    handed, x = [x], None
                    x = self._run_plain(part, handed, watch, self.slot_at[part.stop] - 1 if j == last else None)

    def _keep_and_skip(self, part: Range, x: torch.Tensor, watch: HandedOn, stop: bool) -> torch.Tensor:
        """Keep ``part``'s input for its own pass; run it without saving."""
        inputs = KeptInputs((x,), {}, EXACT, starts_in_place(self.layers, part.start))
        self._inputs[part] = inputs
        if stop:
            raise _AllSlotsFilled
        if not inputs.private_copy:
            watch.watch(x)  # kept by reference
        self._filling = None  # what its layers save is never unpacked
        x = self._cut(x, part.start, watch)
        for i in range(part.start, part.stop):
            x = self._cut(watch.after(i, self._run_for_output(i, x)), i + 1, watch)
        inputs.end_forward(self.function.__qualname__)
        return x

    def _run_for_output(self, i: int, x):
        """Layer ``i`` run for its output only, as in its forward (NOTE [ Nested
        recompute ]): with grad, what it saves dropped as it is saved (never unpacked),
        but by a layer that ran a backward inside its forward (``autograd.grad`` for a
        gradient penalty), which reads them."""
        if i in self._backward_inside:
            return self.layers[i](x)
        with _saves_dropped():
            return self.layers[i](x)

    def _cut(self, x, i: int, watch: HandedOn):
        """``x`` as it enters layer ``i`` of a range run for its output (or leaves the
        segment): cut from the graph of the layer that made it, so that what that graph
        holds (a layer's own checkpoint keeps what it saves) goes as the layer returns,
        and requiring grad where it did in the forward. ``watch`` follows the kept input
        under its new name."""
        if not isinstance(x, torch.Tensor):
            return x
        if i < len(self.layers) and self.grad_at[i]:
            cut = _requiring_grad(x)
        elif x.requires_grad:
            cut = x.detach()
        else:
            return x
        if watch.passing:  # the kept input, under another name
            watch.watch(cut)
        return cut

    def _run_plain(self, part: Range, handed: list, watch: HandedOn, stop_after) -> torch.Tensor:
        """Run ``part`` on the input ``handed`` over, with grad, filling its
        placeholders; stop after placeholder ``stop_after`` (None: run it to its end);
        ``watch`` gives in-place layers a copy of an input kept as it is."""
        x = handed.pop()
        for i in range(part.start, part.stop):
            self._filling = (self.slot_at[i], self.slot_at[i + 1], stop_after)
            x = self.layers[i](x)
            if self._filling[0] != self.slot_at[i + 1]:
                raise self._mismatch(
                    f"the recompute of layer {i} ({type(self.layers[i]).__name__}) of "
                    f"{self.function.__qualname__} saved {self._filling[0] - self.slot_at[i]} tensors for backward "
                    f"where the forward saved {self.slot_at[i + 1] - self.slot_at[i]}: it does not do the same "
                    "work twice. Make it deterministic or do not checkpoint it.")
            x = watch.after(i, x)
        return x

    def _fill_next(self, tensor: torch.Tensor):
        if self._filling is None:  # saved by a layer run for its output only: never unpacked
            return detached_or_same(tensor)
        index, end, stop_after = self._filling
        if index >= end:
            raise self._mismatch(
                f"the recompute of {self.function.__qualname__} saved more tensors for backward than the forward "
                "did: it does not do the same work twice. Make it deterministic or do not checkpoint it.")
        self._filling = (index + 1, end, stop_after)
        # The shared checks and bookkeeping; _fill stops the pass after placeholder
        # count - 1 (the early stop), so without a stop the count is one it never reaches.
        count = len(self.slots) + 1 if stop_after is None else stop_after + 1
        self._fill(index, tensor, self.recomputed, count, lossy=False)
        return detached_or_same(tensor)


class _RequiresGrad(torch.autograd.Function):
    """``x`` as a tensor that requires grad, for the layers after a recomputed range to
    save what they saved in the forward. Not a leaf of ``x`` (``x.detach().requires_grad_()``):
    the pass's graph would hold that leaf, and with it ``x``, to the pass's end, where
    the layers may have freed it; here the graph holds only the anchor, a scalar. And
    not a view of ``x``, so an in-place first layer may modify it without a copy. The
    pass's graph is never run backward (NOTE [ Nested recompute ])."""

    @staticmethod
    def forward(ctx, anchor: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return x.detach()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return None, grad


# The scalar leaf every _RequiresGrad output hangs from, made at import, not inside a
# measured step.
_GRAPH_ANCHOR = torch.zeros((), requires_grad=True)


def _requiring_grad(x: torch.Tensor) -> torch.Tensor:
    # Handed over detached: a range run without grad may leave a view it made of its
    # input (nn.Unflatten's) changed in place, which autograd refuses as a Function's input.
    return _RequiresGrad.apply(_GRAPH_ANCHOR, x.detach())


def nested_call(layers: Sequence, top: Range, x: torch.Tensor, private_copy: bool = False,
                options: RecomputeOptions = DEFAULT_RECOMPUTE) -> tuple:
    """Run ``layers`` on ``x`` as a checkpointed segment recomputed in stages, as
    ``top`` (a recomputed :class:`Range` over all of them) cuts them; returns
    ``(output, kept_bytes)`` as :func:`~actsave.runtime.function.checkpointed_call`
    does. NOTE [ Nested recompute ]"""
    if top.start != 0 or top.stop != len(layers) or not top.recomputed:
        raise ConfigError(f"the nested segment's range {top} must be a recomputed range over all "
                          f"{len(layers)} layers")
    if not torch.is_grad_enabled() or _recompute_depth() > 0:
        # Inside another recompute a plain checkpoint keeps its input by reference anyway
        # (NOTE [ Nested checkpoints ]).
        return checkpointed_call(_Layers(layers, None, private_copy), (x,), {}, EXACT, private_copy, options)
    _refuse_repeated_modules(layers)
    # Each pass replays the generators the layers hold (NOTE [ Generators a module holds ]).
    held = held_generators(module for _, module in modules_under(tuple(layers)))
    replay = ReplayState.capture([x], options.preserve_rng_state, held)
    kept = KeptInputs((x,), {}, EXACT, private_copy)
    frame = _NestedFrame(layers, top, kept, replay, x, options)
    try:
        with frame.forward_hooks():
            output = frame.function(x)
    except BaseException:
        frame.release()
        raise
    finally:
        frame.end_forward()
    kept.end_forward(frame.function.__qualname__)
    if not frame.slots:
        frame.release()
        return output, 0
    return output, kept.nbytes + frame.account_kept()


def _refuse_repeated_modules(layers: Sequence) -> None:
    """A nested pass runs part of the layers on copies of the module state the forward
    started from, not on what the earlier layers of the segment left: right only where
    no module runs in two layers (NOTE [ State a forward reads and mutates ])."""
    repeated = repeated_modules(layers)
    if repeated:
        raise ConfigError(
            f"a nested segment cannot hold one module in two of its layers ({type(repeated[0]).__name__} "
            "does): its passes would recompute the later one from the module state the segment started "
            "from. Checkpoint the segment without nesting (plans do not nest such chains).")


def _dropped(tensor: torch.Tensor) -> None:
    return None


def _never_unpacked(saved) -> torch.Tensor:
    raise AssertionError("a save of a layer run for its output only was read")


def _saves_dropped() -> torch.autograd.graph.saved_tensors_hooks:
    """Saved-tensor hooks that hold nothing a layer saves: its graph is never run
    backward, so its activations are freed as they go, as under no_grad."""
    return torch.autograd.graph.saved_tensors_hooks(_dropped, _never_unpacked)


eager_hooks(_NestedFrame.unpack, _dropped, _never_unpacked)  # NOTE [ Eager hooks Dynamo leaves alone ]
