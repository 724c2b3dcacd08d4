"""The memory and time model of a plan: what a segmentation with given keep options
allocates and takes, from a :class:`~actsave.planning.profiler.Profile`.

Budget
    ``budget`` is the peak *activation* memory of one training step on the model's
    device, in bytes: everything the step allocates beyond parameters, buffers,
    gradients and optimizer state. That is the input batch, the tensors saved for
    backward, kept segment inputs and ReLU sign bits, activation gradients and
    temporaries; :func:`actsave.estimate` reports the same quantity. The step is
    ``out = model(x); out.backward(g)``, ``g`` a full-size output gradient (what a
    loss such as cross-entropy hands back), with parameter gradients allocated
    before it, as from the second training step on.

Memory model
    Segment j holds layers [a, b). The last segment is stored (plain autograd); the
    others are checkpointed with an option o = (codec, offload). Backward runs the
    segments in reverse, so everything segment j allocates, forward or backward,
    happens while only the segments before it hold their kept bytes R:

        peak = X + max_j ( R_0 + ... + R_{j-1} + W_j )

    X is the chain input (held by the caller). A checkpointed segment keeps its
    input as the codec stores it (K; nothing for the chain input, held anyway) plus,
    for a lossy codec, one bit per element of each ReLU output inside it (S), until
    its recompute ends. R = K + S is what it keeps on the device; offloaded, R = 0 and
    F = K + S is fetched back for the recompute. W is the largest of the segment's
    events, each built from per-layer measurements of the profiled step (sums over
    a <= i < b):

    checkpointed [a, b), option o
        encode      x_a + enc(a, o)                                    lossy codecs
        decode      O + R + F + g_b + dec(a, o)                        lossy codecs
        recompute   O + R + F + D + Q + g_b + Saved'(a, i-1) + U(i) + B(a, i) + fwd_i
                    (+ restore_i)
        backward    O + Saved(a, i) + g_{i+1} + bwd_i
    stored [s, n)
        forward     Saved(s, i-1) + U(i) + fwd_i
        backward    O + Saved(s, i) + g_{i+1} + bwd_i

    O: the output and its gradient, which the caller holds through the backward.
    Saved(a, i): the distinct storages saved for backward by layers a..i, each
    counted once whichever layers share it; Saved' leaves out the segment input,
    counted by K, F or D. U(i): layer i's input while it runs, unless a layer of
    the segment before it saved it. g_i: the gradient of layer i's input. fwd_i,
    bwd_i: the rise of live bytes during layer i's forward and backward. The
    recompute stops at the segment's last saved tensor (runtime/function.py), so the last
    saving layer contributes only its rise up to its last save and later layers
    nothing; a segment that saves nothing keeps nothing. F: the input fetched back
    from the host; D: the decoded input; Q: the private copy a segment starting
    with an in-place layer recomputes from; restore_i: re-imposing the forward's
    ReLU decisions (runtime/relu_signs.py); B(a, i): the BatchNorm statistics the recompute
    of layers a..i-1 copied (runtime/state.py), held to its end; enc, dec: the rise while
    encoding, decoding.
    A checkpointed segment's forward events are left out: each is at most the same
    layer's recompute event, which also holds the incoming gradient g_b.

    Offload (CUDA only: on a CPU model host memory is device memory) brings an
    input back early, when the next offloaded segment's recompute prefetches it. The
    model charges C, the largest F of an offloaded segment of the plan, to every
    backward-time event of every checkpointed segment, and the dynamic programs run
    for every candidate C: each distinct F, or, where a lossy codec's offloaded bits
    make more than _MAX_CARRIES distinct sizes (F depends on both ends of a
    segment), the largest F below each point of a geometric grid over them. On the
    grid a plan's charge exceeds its own C by less than the grid's step, so its
    peak is within that of the optimum (tests/planning/test_memory_model.py).

    Overestimates, by design: a view of one storage passed across a segment boundary
    is counted on both sides, ReLU restores are taken to coincide with the layer's
    whole forward rise. Measured peaks (MemTracker, CPU) of applied plans are within
    a few percent below the prediction, mostly equal to it (tests/planning/test_memory_model.py).

Time model
    step = sum_i (forward_i + backward_i) + sum over checkpointed segments t(a,b,o),
    t = sum_{a<=i<b} forward_i + encode and decode time (lossy) + the host copies not
    hidden behind the segment's forward (copy out) and its recompute and backward
    (copy back; offload). Sign bits and the early stop are ignored.

The model is evaluated two ways: :class:`CostModel` over arrays of segments, for the
solvers (solver.py), and :func:`predicted` for one plan, event by event.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence

import numpy as np
import torch

from ..runtime.store import EXACT, KeepPolicy
from .profiler import LayerProfile, Profile

# Offloaded ReLU bits make a segment's fetch size depend on both its ends, so the sizes
# an offloaded segment may fetch number up to n^2 / 2. Beyond this many, the carries
# are a geometric grid over them (module docstring, "Offload").
_MAX_CARRIES = 64


def host_is_separate(device) -> bool:
    """Whether offload moves bytes off ``device``: not on the CPU, whose memory the
    host pool shares."""
    return torch.device(device).type == "cuda"


def effective_option(option: KeepPolicy, layer: LayerProfile, device: str) -> KeepPolicy:
    """What a segment starting at ``layer`` keeps its input by, asked for ``option``:
    runtime/store.py keeps a leaf or non-float input by reference, on the device, whatever the
    option; without separate host memory an offloaded input still takes its bytes."""
    if not layer.input_encodable:
        return EXACT
    return option if host_is_separate(device) else KeepPolicy(option.codec)


class CostModel:
    """The module docstring's memory and time model over the layers as numpy arrays.

    The option-independent parts of W live in three n x n tables indexed [a, b] (the
    segment [a, b)); :meth:`working_set`, :meth:`kept` and :meth:`seconds` combine
    them with an option's terms for any broadcastable arrays of starts and ends, so
    the dynamic programs read whole rows (all ends of one start) or columns (all
    starts of one end) at once.
    """

    def __init__(self, prof: Profile, options: list, fixed: Optional[Sequence[KeepPolicy]] = None):
        """``options``: the keep options the plans may use. ``fixed``: one option per
        layer instead, the only one a segment starting there may use."""
        layers = prof.layers
        n = self.n = len(layers)
        if fixed is not None:
            fixed = [effective_option(option, layer, prof.device) for option, layer in zip(fixed, layers)]
            options = sorted(set(fixed), key=lambda option: (option.codec.name, option.offload))
        self.options = options
        self.chain_input = prof.input_bytes

        def column(attr: str) -> np.ndarray:
            return np.array([getattr(layer, attr) for layer in layers], dtype=np.float64)

        self.input = column("input_bytes")
        self.grad = np.append(column("input_grad_bytes"), 0.0)  # g_0 .. g_n; g_n is in held_in_backward
        self.held_in_backward = prof.output_bytes + prof.output_grad_bytes
        self.output = prof.output_bytes
        self.output_first, self.output_last = prof.output_saved_by or (n, -1)
        self.forward_rise, self.backward_rise = column("forward_rise"), column("backward_rise")
        self.rise_to_last_save = column("forward_rise_to_last_save")
        self.restore = column("relu_restore_bytes")
        self.scratch_before = np.concatenate(([0.0], np.cumsum(column("recompute_scratch_bytes"))))
        spans = [layer.input_saved_by or (n, -1) for layer in layers]  # (n, -1): saved by no layer
        self.input_first = np.array([first for first, _ in spans])
        self.input_last = np.array([last for _, last in spans])
        saving = np.where([layer.saves_for_backward for layer in layers], np.arange(n), -1)
        self.last_saver = np.maximum.accumulate(saving)  # the last saving layer at or before i
        self.signs_before = np.concatenate(([0.0], np.cumsum(column("relu_sign_bytes"))))  # S over [0, i)
        self.forward_s_before = np.concatenate(([0.0], np.cumsum(column("forward_s"))))
        self.backward_s_before = np.concatenate(([0.0], np.cumsum(column("backward_s"))))
        self.private_copy = np.array([layer.dense_input_bytes if layer.modifies_input and layer.input_grad_bytes
                                      else 0 for layer in layers], dtype=np.float64)
        self._options_by_layer(layers)
        if fixed is not None:
            self.allowed &= np.array([[option == each for each in fixed] for option in options])
        self._event_tables(_saved_table(prof.saved, n))

    def _options_by_layer(self, layers) -> None:
        """Per option (rows) and start layer (columns): whether it may be used there, the
        input as kept (K), the bytes decoded; its encode event, decode rise, codec seconds
        and host-copy seconds."""
        shape = (len(self.options), self.n)
        self.allowed = np.zeros(shape, dtype=bool)
        self.kept_input, self.decoded, self.encode_event, self.decode_rise = (np.zeros(shape) for _ in range(4))
        self.codec_s, self.to_host_s, self.to_device_s = (np.zeros(shape) for _ in range(3))
        for o, option in enumerate(self.options):
            for a, layer in enumerate(layers):
                self._fill_option(o, option, a, layer)

    def _fill_option(self, o: int, option: KeepPolicy, a: int, layer: LayerProfile) -> None:
        self.allowed[o, a] = layer.input_encodable or option == EXACT
        self.kept_input[o, a] = layer.kept_input_bytes(option, chain_input=a == 0)
        if option.lossy:
            self.decoded[o, a] = layer.dense_input_bytes
            self.encode_event[o, a] = layer.input_bytes + layer.encode_rise[option.codec.name]
            self.decode_rise[o, a] = layer.decode_rise[option.codec.name]
            self.codec_s[o, a] = layer.encode_s[option.codec.name] + layer.decode_s[option.codec.name]
        if option.offload:
            self.to_host_s[o, a] = layer.to_host_s.get(option.codec.name, 0.0)
            self.to_device_s[o, a] = layer.to_device_s.get(option.codec.name, 0.0)

    def _event_tables(self, saved: np.ndarray) -> None:
        """recompute[a, b], lossy_recompute[a, b]: the largest recompute event of [a, b)
        less what the option holds (-inf: nothing saved, no recompute); backward[a, b]:
        the largest backward event. Also stored_peaks[a]."""
        n = self.n
        self.recompute, self.lossy_recompute, self.backward = (np.full((n, n), np.inf) for _ in range(3))
        self.stored_peaks = np.empty(n)
        for a in range(n):
            i = np.arange(a, n)
            before_recompute = self._held_before_layers(a, saved[a, a:], i)
            backward = self._backward_events(a, saved[a, a:], i)
            unsaved_input = 0.0 if a == 0 else self.input[a]  # the chain input is in X
            before_forward = np.concatenate(([unsaved_input], saved[a, a:-1] + self._unsaved(a, i)[1:]))
            self.stored_peaks[a] = max((before_forward + self.forward_rise[a:]).max(), backward.max())
            last = self.last_saver[a:n - 1] - a  # for ends b = a+1 .. n-1
            self.recompute[a, a + 1:] = _until_last_save(before_recompute + self.forward_rise[a:],
                                                         before_recompute + self.rise_to_last_save[a:], last)
            self.lossy_recompute[a, a + 1:] = _until_last_save(
                before_recompute + self.forward_rise[a:] + self.restore[a:],
                before_recompute + self.rise_to_last_save[a:] + self.restore[a:], last)
            self.backward[a, a + 1:] = np.maximum.accumulate(backward)[:n - 1 - a]

    def _held_before_layers(self, a: int, saved_row: np.ndarray, i: np.ndarray) -> np.ndarray:
        """Saved'(a, i-1) + U(i) + the scratch statistics of layers a .. i-1, for i = a ..
        n-1: what a recompute from a holds as layer i starts, beyond the segment input
        (counted by the option)."""
        own_input = (self.input_first[a] <= i) & (self.input_last[a] >= a)
        saved_without_input = saved_row - np.where(own_input, self.input[a], 0.0)
        unsaved = self._unsaved(a, i)
        unsaved[0] = 0.0
        scratch = self.scratch_before[i] - self.scratch_before[a]
        return np.concatenate(([0.0], saved_without_input[:-1])) + unsaved + scratch

    def _unsaved(self, a: int, i: np.ndarray) -> np.ndarray:
        """U(i) for i = a .. n-1: layer i's input, unless a layer in [a, i) saved it."""
        saved_before = (self.input_first[i] <= i - 1) & (self.input_last[i] >= a)
        return np.where(saved_before, 0.0, self.input[i])

    def _backward_events(self, a: int, saved_row: np.ndarray, i: np.ndarray) -> np.ndarray:
        """O + Saved(a, i) + g_{i+1} + bwd_i for i = a .. n-1, O less the output where
        Saved counts it."""
        output_in_saved = (self.output_first <= i) & (self.output_last >= a)
        held = self.held_in_backward - np.where(output_in_saved, self.output, 0.0)
        return held + saved_row + self.grad[i + 1] + self.backward_rise[i]

    def saves(self, a, b) -> np.ndarray:
        """Whether any layer of [a, b) saves a tensor (else nothing is kept or recomputed)."""
        return self.last_saver[b - 1] >= a

    def signs(self, o: int, a, b):
        """S of [a, b) under option o."""
        if not self.options[o].lossy:
            return 0.0
        return self.signs_before[b] - self.signs_before[a]

    def _stored(self, o: int, a, b) -> np.ndarray:
        """K + S: what the segment keeps, on the device or the host."""
        return np.where(self.saves(a, b), self.kept_input[o, a] + self.signs(o, a, b), 0.0)

    def kept(self, o: int, a, b) -> np.ndarray:
        """R(a, b, o): the device bytes the segment keeps from its forward to its recompute."""
        stored = self._stored(o, a, b)
        return np.zeros_like(stored) if self.options[o].offload else stored

    def fetched(self, o: int, a, b) -> np.ndarray:
        """F(a, b, o): the bytes an offloaded segment fetches back from the host."""
        stored = self._stored(o, a, b)
        return stored if self.options[o].offload else np.zeros_like(stored)

    def working_set(self, o: int, a, b, carries: np.ndarray) -> np.ndarray:
        """W(a, b, o) + C for each prefetch bound C in ``carries`` (the last axis of the
        result); inf where not allowed."""
        option, kept, fetched = self.options[o], self.kept(o, a, b), self.fetched(o, a, b)
        held = self.held_in_backward + kept + fetched + self.decoded[o, a] + self.private_copy[a] + self.grad[b]
        recompute = held + (self.lossy_recompute if option.lossy else self.recompute)[a, b]
        events = np.maximum(recompute, self.backward[a, b])  # the sign bits go with the recompute
        if option.lossy:
            decode = self.held_in_backward + kept + fetched + self.grad[b] + self.decode_rise[o, a]
            events = np.maximum(events, np.where(self.saves(a, b), decode, -np.inf))
        w = np.maximum(np.expand_dims(events, -1) + carries, np.expand_dims(self.encode_event[o, a], -1))
        usable = np.expand_dims(self.allowed[o, a], -1) & (np.expand_dims(fetched, -1) <= carries)
        return np.where(usable, w, np.inf)

    def seconds(self, o: int, a, b) -> np.ndarray:
        """t(a, b, o): the time a checkpointed segment adds to the step."""
        forward = self.forward_s_before[b] - self.forward_s_before[a]
        seconds = forward + self.codec_s[o, a]
        if self.options[o].offload:  # copy out during the forward, back during recompute and backward
            backward = self.backward_s_before[b] - self.backward_s_before[a]
            seconds = (seconds + np.maximum(0.0, self.to_host_s[o, a] - forward)
                       + np.maximum(0.0, self.to_device_s[o, a] - forward - backward))
        return seconds

    def carries(self) -> np.ndarray:
        """Candidate values of C: 0 (nothing offloaded) and the sizes an offloaded
        segment may fetch back: each distinct one, or where there are more than
        _MAX_CARRIES, the largest below each point of a geometric grid over them."""
        sizes = [np.unique(self.fetched(o, a, np.arange(a + 1, self.n)))
                 for o, option in enumerate(self.options) if option.offload
                 for a in range(self.n) if self.allowed[o, a]]
        sizes = np.unique(np.concatenate([np.zeros(1), *sizes]))
        if len(sizes) <= _MAX_CARRIES:
            return sizes
        positive = sizes[sizes > 0]
        grid = np.geomspace(positive[0], positive[-1], _MAX_CARRIES - 1)
        return np.unique(np.concatenate(([0.0], positive[np.searchsorted(positive, grid, side="right") - 1])))


def _until_last_save(full: np.ndarray, truncated: np.ndarray, last: np.ndarray) -> np.ndarray:
    """For each segment end, the largest recompute event: layers before the segment's
    last saving layer (``last``, relative to the start) run whole (``full``), that
    layer up to its last save (``truncated``: the early stop), the rest not at all;
    -inf when no layer saves."""
    running = np.maximum.accumulate(full)
    whole = np.where(last > 0, running[np.maximum(last - 1, 0)], -np.inf)
    return np.where(last >= 0, np.maximum(whole, truncated[np.maximum(last, 0)]), -np.inf)


def _saved_table(saved: tuple, n: int) -> np.ndarray:
    """table[a, i] = Saved(a, i): bytes of storages whose saving layers meet [a, i]
    (first <= i and last >= a), by two cumulative sums over (first, last)."""
    by_span = np.zeros((n, n))
    if saved:
        np.add.at(by_span, ([s.first for s in saved], [s.last for s in saved]), [s.nbytes for s in saved])
    first_at_most = by_span.cumsum(axis=0)  # [i, last]: first <= i
    last_at_least = first_at_most[:, ::-1].cumsum(axis=1)[:, ::-1]  # [i, a]: first <= i, last >= a
    return np.ascontiguousarray(last_at_least.T)


def predicted(profile: Profile, segments: list) -> tuple:
    """(peak bytes, step seconds, index of the segment setting the peak)."""
    layers = profile.layers
    # runtime/store.py keeps a leaf or non-float input as it is, whatever the option.
    segments = [(a, b, option if option is None or layers[a].input_encodable else EXACT)
                for a, b, option in segments]
    carry = max((_stored_by(profile, a, b, option) for a, b, option in segments if option and option.offload),
                default=0)
    kept_before, peak, peak_segment = 0, -math.inf, 0
    seconds = sum(layer.forward_s + layer.backward_s for layer in layers)
    for j, (a, b, option) in enumerate(segments):
        if option is None:
            working, kept = _stored_working_set(profile, a), 0
        else:
            working = _checkpointed_working_set(profile, a, b, option, carry)
            kept = 0 if option.offload else _stored_by(profile, a, b, option)
            seconds += _checkpointed_seconds(layers, a, b, option)
        if kept_before + working > peak:
            peak, peak_segment = kept_before + working, j
        kept_before += kept
    return profile.input_bytes + peak, seconds, peak_segment


def _saved_running(profile: Profile, a: int, stop: int) -> list:
    """[Saved(a, i) for i in a .. stop-1]."""
    total = sum(s.nbytes for s in profile.saved if s.first < a <= s.last)
    starting = [0] * len(profile.layers)
    for s in profile.saved:
        if s.first >= a and s.last >= a:
            starting[s.first] += s.nbytes
    running = []
    for i in range(a, stop):
        total += starting[i]
        running.append(total)
    return running


def _unsaved_input(layers: tuple, a: int, i: int) -> int:
    """U(i) in a segment starting at a, for i > a."""
    span = layers[i].input_saved_by
    return 0 if span is not None and span[0] <= i - 1 and span[1] >= a else layers[i].input_bytes


def _input_grad(profile: Profile, i: int) -> int:
    """g_i; g_n is held by the caller through the whole backward (_held_in_backward)."""
    return 0 if i == len(profile.layers) else profile.layers[i].input_grad_bytes


def _held_in_backward(profile: Profile, a: int = 0, i: int = -1) -> int:
    """O: the output and its gradient, which the caller holds through the backward;
    less the output if Saved(a, i) counts it."""
    span = profile.output_saved_by
    counted = span is not None and span[0] <= i and span[1] >= a
    return profile.output_grad_bytes + (0 if counted else profile.output_bytes)


def _stored_working_set(profile: Profile, a: int) -> int:
    layers, n = profile.layers, len(profile.layers)
    saved = _saved_running(profile, a, n)
    events = []
    for i in range(a, n):
        unsaved = (layers[a].input_bytes if a > 0 else 0) if i == a else _unsaved_input(layers, a, i)
        events.append((saved[i - a - 1] if i > a else 0) + unsaved + layers[i].forward_rise)
        events.append(_held_in_backward(profile, a, i) + saved[i - a] + _input_grad(profile, i + 1)
                      + layers[i].backward_rise)
    return max(events)


def _stored_by(profile: Profile, a: int, b: int, option: KeepPolicy) -> int:
    """K + S: what the checkpointed segment [a, b) keeps, on the device (R) or, when
    offloaded, on the host (F, fetched back); nothing when no layer saves."""
    layers = profile.layers
    if not any(layer.saves_for_backward for layer in layers[a:b]):
        return 0
    signs = sum(layer.relu_sign_bytes for layer in layers[a:b]) if option.lossy else 0
    return layers[a].kept_input_bytes(option, chain_input=a == 0) + signs


def _checkpointed_working_set(profile: Profile, a: int, b: int, option: KeepPolicy, carry: int) -> int:
    """W of the checkpointed segment [a, b), C = ``carry`` included."""
    layers, first = profile.layers, profile.layers[a]
    backward = [_held_in_backward(profile, a, i) + saved + _input_grad(profile, i + 1) + layers[i].backward_rise
                + carry for i, saved in zip(range(a, b), _saved_running(profile, a, b))]
    savers = [i for i in range(a, b) if layers[i].saves_for_backward]
    if not savers:  # nothing to recompute, nothing kept
        return max(backward)
    held = _held_in_backward(profile) + _stored_by(profile, a, b, option) + _input_grad(profile, b)
    events = list(backward)  # the sign bits are released with the inputs, after the recompute
    events += _recompute_events(profile, a, savers[-1], option, held + carry)
    if option.lossy:
        events.append(held + first.decode_rise[option.codec.name] + carry)
        events.append(first.input_bytes + first.encode_rise[option.codec.name])
    return max(events)


def _recompute_events(profile: Profile, a: int, last_saver: int, option: KeepPolicy, held: int) -> list:
    """The recompute of [a, last_saver]: the early stop ends it at the last save."""
    layers, first = profile.layers, profile.layers[a]
    decoded = first.dense_input_bytes if option.lossy else 0
    private_copy = first.dense_input_bytes if first.modifies_input and first.input_grad_bytes else 0
    own = first.input_saved_by
    saved = _saved_running(profile, a, last_saver + 1)
    events = []
    for i in range(a, last_saver + 1):
        before = sum(layer.recompute_scratch_bytes for layer in layers[a:i])
        if i > a:
            own_counted = own is not None and own[0] <= i - 1 and own[1] >= a
            input_counted = first.input_bytes if own_counted else 0
            before += saved[i - a - 1] - input_counted + _unsaved_input(layers, a, i)
        rise = layers[i].forward_rise_to_last_save if i == last_saver else layers[i].forward_rise
        restore = layers[i].relu_restore_bytes if option.lossy else 0
        events.append(held + decoded + private_copy + before + rise + restore)
    return events


def _checkpointed_seconds(layers: tuple, a: int, b: int, option: KeepPolicy) -> float:
    forward = sum(layer.forward_s for layer in layers[a:b])
    backward = sum(layer.backward_s for layer in layers[a:b])
    first = layers[a]
    seconds = forward
    if option.lossy:
        seconds += first.encode_s[option.codec.name] + first.decode_s[option.codec.name]
    if option.offload:
        # No copy times where host memory is the device's (a CPU profile) or unmeasured (meta).
        seconds += (max(0.0, first.to_host_s.get(option.codec.name, 0.0) - forward)
                    + max(0.0, first.to_device_s.get(option.codec.name, 0.0) - forward - backward))
    return seconds
