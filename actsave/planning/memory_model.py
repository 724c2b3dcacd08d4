"""The memory and time model of a plan: what a segmentation with given keep options
allocates and takes, from a :class:`~actsave.planning.profiler.Profile`.

Budget
    ``budget`` is the peak *activation* memory of one training step on the model's
    device, in bytes: everything the step allocates beyond parameters, buffers,
    gradients and optimizer state. That is the input batch, the tensors saved for
    backward, kept segment inputs and ReLU sign bits, activation gradients and
    temporaries; :func:`actsave.estimate` reports the same quantity. The step is
    ``out = model(x); loss(out).backward()`` when the profile ran the step's ``loss``
    (:func:`actsave.profile`), else ``out = model(x); out.backward(g)``, ``g`` a
    full-size output gradient (what a loss such as cross-entropy hands back, without
    the loss's own memory), with parameter gradients allocated before it, as from the
    second training step on.

Memory model
    Segment j holds layers [a, b). The last segment is stored (plain autograd); each
    of the others is checkpointed with an option o = (codec, offload), or stored too
    (a stored middle segment). Backward runs the
    segments in reverse, so everything segment j allocates, forward or backward,
    happens while only the segments before it hold their kept bytes R:

        peak = X + max_j ( R_0 + ... + R_{j-1} + W_j )

    X is the chain input (held by the caller). A checkpointed segment keeps its
    input as the codec stores it (K; nothing for the chain input, held anyway) plus,
    for a lossy codec, the decisions its recompute takes from the forward (S): one bit
    per element of each ReLU output inside it, a few per output of each max pool
    (runtime/pool_decisions.py), until its recompute ends. R = K + S is what it keeps
    on the device; offloaded, R = 0 and F = K + S is fetched back for the recompute.
    W is the largest of the segment's events, each built from per-layer measurements
    of the profiled step (sums over a <= i < b):

    checkpointed [a, b), option o
        encode      x_a + enc(a, o)                                    lossy codecs
        decode      O + R + F + g_b + dec(a, o)                        lossy codecs
        recompute   O + R + F + D + Q + g_b + Saved'(a, i-1) + U(i) + fwd_i
                    (+ restore_i)
        backward    O + Saved(a, i) + g_{i+1} + bwd_i
    stored middle [a, b), b < n: R = Saved(a, b-1), autograd's saves, kept from its
    forward to its backward (which recomputes nothing)
        forward     Saved(a, i-1) + U(i) + [x_a] + fwd_i
        backward    O + Saved(a, i) + g_{i+1} + bwd_i + C
    stored [s, n)
        forward     Saved(s, i-1) + U(i) + [x_s] + fwd_i
        loss        Saved(s, n-1) + U(n) + L
        backward    O + Saved(s, i) + g_{i+1} + bwd_i
    stored [s, n), saves kept by lossy codec k (runtime/compressed_saves.py)
        forward     Saved_k(s, i) + U_k(i) + [x_s] + max(fwd_i, enc_k(i))
        loss        Saved_k(s, n-1) + U_k(n) + L
        backward    O_k + Saved_k(s, i) + g_{i+1} + max(bwd_i + D(i), dec_k(i))

    O: the output and its gradient, which the caller holds through the backward.
    L: the rise from the end of the forward until the output's gradient arrives
    (Profile.loss_rise): the loss's forward and backward where the profile ran the
    step's loss (cross-entropy keeps its log-softmax and makes two more logits-sized
    tensors in backward, beyond the output gradient O counts), else the output
    gradient alone, and then the event is at most the last layer's backward event.
    U(n): the output, unless a layer of the segment saved it.
    Saved_k(s, i): the saves of layers s..i as codec k stores them (stored_saves.py,
    StoredSaves: each tensor once, its encoding plus one bit per element of a ReLU
    output the segment made, or held as it is when the codec takes no such tensor),
    derived from the profiled step's saves and the codec's bytes for each save's shape,
    with no step of its own. U_k, O_k: U and O, where only a save held as it is holds
    the tensor. [x_s]: the segment's input, s > 0, after its first layer: the caller
    holds it until the segment's forward returns, and no save does. enc_k(i): layer
    i's rise while it encodes a save, the rise as that save was made plus the
    encoding's temporaries. dec_k(i): its backward's rise while an
    autograd node decodes its saves, the rise as the node started plus the decoded
    saves and one decoding's temporaries (the ReLU decisions restored); D(i): the most
    bytes one node of layer i decodes, alive while it runs. The layer's new encodings
    are counted, in Saved_k, from its start, and the tensors they encode as if they
    stayed to its end (as in the profiled step): the stored events bound the codec's
    step from above, by the saves' full size at most.
    Saved(a, i): the distinct storages saved for backward by layers a..i, each
    counted once whichever layers share it; Saved' leaves out the segment input,
    counted by K, F or D. U(i): layer i's input while it runs, unless a layer of
    the segment before it saved it. [x_s]: the segment's input, s > 0, after its
    first layer, where no save of the layers before holds it: the caller holds it
    until the segment's forward returns. g_i: the gradient of layer i's input. fwd_i,
    bwd_i: the rise of live bytes during layer i's forward and backward. The
    recompute stops at the segment's last saved tensor (runtime/function.py), so the last
    saving layer contributes only its rise up to its last save and later layers
    nothing; a segment that saves nothing keeps nothing. F: the input fetched back
    from the host; D: the decoded input; Q: the private copy a segment starting
    with an in-place layer recomputes from; restore_i: re-imposing the forward's
    ReLU or max-pool decisions, the larger (runtime/relu_signs.py, pool_decisions.py);
    enc, dec: the rise while encoding, decoding. A recompute runs each call of a
    module whose forward mutates its state (BatchNorm statistics) on copies of it,
    dropped as the call returns (runtime/state.py): the copies autograd saves are
    the layer's saves as profiled, and no other copy outlives its layer.
    A checkpointed segment's forward events are left out: each is at most the same
    layer's recompute event, which also holds the incoming gradient g_b.

    Offload (CUDA only: on a CPU model host memory is device memory) brings an
    input back early, when the next offloaded segment's recompute prefetches it. The
    model charges C, the largest F of an offloaded segment of the plan, to every
    backward-time event of every checkpointed or stored middle segment (a prefetch
    may be in flight across a stored middle segment's backward), and the dynamic programs run
    for every candidate C: each distinct F, or, where a lossy codec's offloaded bits
    make more than _MAX_CARRIES distinct sizes (F depends on both ends of a
    segment), the largest F below each point of a geometric grid over them. On the
    grid a plan's charge exceeds its own C by less than the grid's step, so its
    peak is within that of the optimum (tests/planning/test_memory_model.py).

    A tensor at a stored boundary: where a stored middle segment [a', b) saves x_b,
    the next segment's input (a layer of [a', b) saves its storage: Tanh, Sigmoid and
    ReLU save their outputs), R of [a', b) holds x_b until its backward, after every
    later segment's, and the next segment counts it nowhere else (one storage):
    x = x_b, and x_s = x_b where Saved(b, .) counts it (a layer from b on saves it),
    else 0, come off its terms:
        checkpointed, K = x_b itself (exact, on the device, no private copy Q): K
            and the backward's Saved(b, i) (the recompute's saves hold x_b again);
            lossy: its encode event (the encoding's source)
        stored (middle or last): U(b) in the first forward event, and x_s off
            Saved(b, i), its R and every event counting it
        stored [b, n), saves kept by lossy codec k: [x_b] and U(b) in the forward
            events, and Saved_k(b, i) where a save holds x_b as it is
    The solvers carry this as one bit per prefix plan (solver.py).

    Overestimates, by design: a view of one storage passed across a segment boundary
    (other than the one above) is counted on both sides, ReLU restores are taken to
    coincide with the layer's whole forward rise. Measured peaks (MemTracker, CPU) of
    applied plans are within a few percent below the prediction, mostly equal to it
    (tests/planning/test_memory_model.py).

Time model
    step = sum_i (forward_i + backward_i) + sum over checkpointed segments t(a,b,o)
    (a stored segment adds nothing),
    t = sum_{a<=i<b} forward_i + encode and decode time (lossy) + the host copies not
    hidden behind the segment's forward (copy out) and its recompute and backward
    (copy back; offload). Sign bits and the early stop are ignored. A stored segment
    whose saves a codec keeps adds, for each of its stored tensors, one encoding, and
    for each save one decoding, each the seconds the codec took on a sample of that
    shape (stored_saves.py, StoredSaves).

Each term is written once (:class:`CostModel`) and read two ways: by the solvers
(solver.py) for every segment at once, from tables of each segment's largest events,
and by :meth:`CostModel.predict` for one plan, each segment from its own events.
:func:`~actsave.plan` checks that the second fits the peak the first planned for.
"""
from __future__ import annotations

import math
from functools import cached_property
from typing import NamedTuple, Optional, Sequence

import numpy as np
import torch

from ..errors import InternalError
from ..runtime.store import EXACT, KeepPolicy
from . import nested_model
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

    Each term is written once, in one method, for a start a and every layer i >= a
    (:meth:`events_from`) or for broadcastable arrays of starts and ends (:meth:`kept`,
    :meth:`fetched`, :meth:`seconds`, the held bytes of :meth:`_working_set`). Two
    readers combine them:

    - the solvers (solver.py) read :meth:`working_set` for whole rows (all ends of one
      start) or columns (all starts of one end) at once, from three n x n tables of the
      largest option-independent events of every segment [a, b) (:attr:`tables`, built
      on first use);
    - :meth:`predict` evaluates one plan, each segment from its own events.

    Both take the same events and differ only in how they find a segment's largest
    one (a running maximum over ends, or the maximum over the segment's layers), so
    each checks the other (tests/planning/test_memory_model.py).
    """

    def __init__(self, prof: Profile, options: list, fixed: Optional[Sequence[KeepPolicy]] = None,
                 stored_codecs: Sequence[str] = ("none",), store_middle: bool = False):
        """``options``: the keep options the plans may use. ``fixed``: one option per
        layer instead, the only one a segment starting there may use.
        ``stored_codecs``: how the stored segment may keep autograd's saves, "none"
        (as they are) first, then lossy codec names (the profile's StoredSaves).
        ``store_middle``: whether the solvers may store segments before the last
        (:meth:`predict` prices them either way)."""
        self.store_middle = store_middle
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
        self.loss_rise = prof.loss_rise
        self.output = prof.output_bytes
        self.output_first, self.output_last = prof.output_saved_by or (n, -1)
        self.forward_rise, self.backward_rise = column("forward_rise"), column("backward_rise")
        self.rise_to_last_save = column("forward_rise_to_last_save")
        self.no_grad_rise = column("no_grad_rise")
        # One restore at a time: a ReLU's or a max pool's (runtime/relu_signs.py, pool_decisions.py).
        self.restore = np.maximum(column("relu_restore_bytes"), column("pool_restore_bytes"))
        spans = [layer.input_saved_by or (n, -1) for layer in layers]  # (n, -1): saved by no layer
        self.input_first = np.array([first for first, _ in spans])
        self.input_last = np.array([last for _, last in spans])
        # A stored middle segment ending at a may hold x_a in its saves (module docstring,
        # "A tensor at a stored boundary"): x_a where a layer before a saves it, and the
        # part of it that Saved(a, .) counts (a layer from a on saves it too).
        layer_index = np.arange(n)
        self.reused_input = np.where(self.input_first < layer_index, self.input, 0.0)
        self.reused_saved = np.where(self.input_last >= layer_index, self.reused_input, 0.0)
        saving = np.where([layer.saves_for_backward for layer in layers], np.arange(n), -1)
        self.last_saver = np.maximum.accumulate(saving)  # the last saving layer at or before i
        decisions = column("relu_sign_bytes") + column("pool_decision_bytes")
        self.signs_before = np.concatenate(([0.0], np.cumsum(decisions)))  # S over [0, i)
        self.forward_s_before = np.concatenate(([0.0], np.cumsum(column("forward_s"))))
        self.backward_s_before = np.concatenate(([0.0], np.cumsum(column("backward_s"))))
        # A checkpoint whose first layer changes its input in place keeps a copy of the
        # input (runtime/store.py), and its recompute, where the input needs a gradient,
        # runs on one more copy (Q).
        self.kept_copy = np.array([layer.dense_input_bytes if layer.modifies_input else 0 for layer in layers],
                                  dtype=np.float64)
        self.private_copy = np.where(column("input_grad_bytes") > 0, self.kept_copy, 0.0)
        self._options_by_layer(layers)
        if fixed is not None:
            self.allowed &= np.array([[option == each for each in fixed] for option in options])
        self.saved_first, self.saved_last, self.saved_bytes = (
            np.array([getattr(s, field) for s in prof.saved], dtype=dtype)
            for field, dtype in (("first", np.int64), ("last", np.int64), ("nbytes", np.float64)))
        self.stored_codecs = list(stored_codecs)
        if self.stored_codecs[0] != "none":
            raise InternalError(f"stored_codecs={stored_codecs!r} must start with 'none'")
        if len(self.stored_codecs) > 1 and prof.stored_saves is None:
            raise InternalError("this profile records no stored saves: its stored segment can only be exact")
        self._stored_by_codec = [_CodedSaves(prof, codec) for codec in self.stored_codecs[1:]]
        self.stored_middle_reach = self._stored_middle_reach()

    def _stored_middle_reach(self) -> np.ndarray:
        """[a]: the farthest end a stored middle segment from a needs: the first boundary
        b > a where two stored segments [., b) [b, .) are one (else n - 1).

        They are where Saved is additive across b: no storage is saved on both sides
        but x_b's (held by the first, left out by the second: "A tensor at a stored
        boundary"), and x_b's storage is not x_{b+1}'s too (a view), which the second
        would count again as U(b+1). There the stored middle segment [a, c), c > b,
        has the events, R and bit of [a, b) then [b, c): the solvers stop at b and
        go on with [b, c), the same plans in fewer steps."""
        n = self.n
        boundaries = np.arange(1, n)
        # Storages saved on both sides of b: first <= b-1 and last >= b.
        crossing = np.zeros(n + 1)
        np.add.at(crossing, self.saved_first + 1, 1)
        np.add.at(crossing, np.maximum(self.saved_last + 1, self.saved_first + 1), -1)
        crossing = np.cumsum(crossing)[boundaries]
        input_crosses = (self.input_first[boundaries] < boundaries) & (self.input_last[boundaries] >= boundaries)
        next_first = np.append(self.input_first[2:], self.output_first)
        next_last = np.append(self.input_last[2:], self.output_last)
        view = ((self.input_first[boundaries] < n) & (next_first == self.input_first[boundaries])
                & (next_last == self.input_last[boundaries]))
        joins = (crossing == input_crosses) & ~view
        reach = np.full(n, n - 1)
        join_at = boundaries[joins]
        later = np.searchsorted(join_at, np.arange(n), side="right")  # the first join b > a
        found = later < join_at.size
        reach[found] = join_at[later[found]]
        return reach

    def _options_by_layer(self, layers) -> None:
        """Per option (rows) and start layer (columns): whether it may be used there, the
        input as kept (K), the bytes decoded; its encode event, decode rise, codec seconds
        and host-copy seconds."""
        shape = (len(self.options), self.n)
        self.allowed, self.shares_input = np.zeros(shape, dtype=bool), np.zeros(shape, dtype=bool)
        self.kept_input, self.decoded, self.encode_event, self.decode_rise = (np.zeros(shape) for _ in range(4))
        self.codec_s, self.to_host_s, self.to_device_s = (np.zeros(shape) for _ in range(3))
        for o, option in enumerate(self.options):
            for a, layer in enumerate(layers):
                self._fill_option(o, option, a, layer)

    def _fill_option(self, o: int, option: KeepPolicy, a: int, layer: LayerProfile) -> None:
        self.allowed[o, a] = layer.input_encodable or option == EXACT
        self.kept_input[o, a] = layer.kept_input_bytes(option, chain_input=a == 0)
        # K is x_a itself, the storage the recompute's saves hold again (runtime/store.py).
        self.shares_input[o, a] = not option.lossy and not option.offload and not layer.modifies_input and a > 0
        if option.lossy:
            self.decoded[o, a] = layer.dense_input_bytes
            self.encode_event[o, a] = layer.input_bytes + layer.encode_rise[option.codec.name]
            self.decode_rise[o, a] = layer.decode_rise[option.codec.name]
            self.codec_s[o, a] = layer.encode_s[option.codec.name] + layer.decode_s[option.codec.name]
        if option.offload:
            self.to_host_s[o, a] = layer.to_host_s.get(option.codec.name, 0.0)
            self.to_device_s[o, a] = layer.to_device_s.get(option.codec.name, 0.0)

    # ----------------------------------------------------------------- the terms

    def saved_from(self, a: int) -> np.ndarray:
        """Saved(a, i) for i = a .. n-1: the storages whose saving layers meet [a, i]
        (first <= i and last >= a), each counted from max(first, a)."""
        meets = self.saved_last >= a
        counted_from = np.maximum(self.saved_first[meets], a) - a
        return np.cumsum(np.bincount(counted_from, weights=self.saved_bytes[meets], minlength=self.n - a))

    def events_from(self, a: int) -> "_Events":
        """The option-independent events of every layer i = a .. n-1 in a segment
        starting at a (index i - a)."""
        i = np.arange(a, self.n)
        saved = self.saved_from(a)
        unsaved = self._unsaved(a, i)
        unsaved_input = 0.0 if a == 0 else self.input[a]  # the chain input is in X
        caller_held = self._held_by_caller(a, i)
        stored_forward = (np.concatenate(([unsaved_input], saved[:-1] + unsaved[1:])) + caller_held
                          + self.forward_rise[a:])
        before_recompute = self._held_before_layers(a, saved, unsaved)
        return _Events(saved=saved,
                       stored_forward=stored_forward,
                       caller_held=caller_held,
                       loss=self._loss_event(a, saved[-1]),
                       backward=self._backward_events(a, saved, i),
                       recompute=before_recompute + self.forward_rise[a:],
                       recompute_to_last_save=before_recompute + self.rise_to_last_save[a:])

    def _held_by_caller(self, a: int, i: np.ndarray) -> np.ndarray:
        """[x_a] for i = a .. n-1: after its first layer, the segment's input, which the
        caller holds until the segment's forward returns (sequential.py), where no save
        of layers a .. i-1 holds it (X holds the chain input)."""
        return np.where((i > a) & (a > 0) & ~self.saved_within(a, a, i - 1), self.input[a], 0.0)

    def _held_before_layers(self, a: int, saved: np.ndarray, unsaved: np.ndarray) -> np.ndarray:
        """Saved'(a, i-1) + U(i), for i = a .. n-1: what a recompute from a
        holds as layer i starts, beyond the segment input (counted by the option)."""
        i = np.arange(a, self.n)
        saved_without_input = saved - np.where(self.saved_within(a, a, i), self.input[a], 0.0)
        return np.concatenate(([0.0], saved_without_input[:-1] + unsaved[1:]))

    def saved_within(self, k, a, last) -> np.ndarray:
        """Whether a save of the layers a .. ``last`` holds x_k: the span of the layers
        that save it (input_first .. input_last) meets [a, last]. Broadcastable arrays."""
        return (self.input_first[k] <= last) & (self.input_last[k] >= a)

    def _unsaved(self, a: int, i: np.ndarray) -> np.ndarray:
        """U(i) for i = a .. n-1: layer i's input, unless a layer in [a, i) saved it."""
        return np.where(self.saved_within(i, a, i - 1), 0.0, self.input[i])

    def _loss_event(self, s: int, saved_by_all: float) -> float:
        """Saved(s, n-1) + U(n) + L: the stored segment [s, n) while the loss runs."""
        output_saved = self.output_first <= self.n - 1 and self.output_last >= s
        return saved_by_all + (0.0 if output_saved else self.output) + self.loss_rise

    def _backward_events(self, a: int, saved: np.ndarray, i: np.ndarray) -> np.ndarray:
        """O + Saved(a, i) + g_{i+1} + bwd_i for i = a .. n-1, O less the output where
        Saved counts it."""
        output_in_saved = (self.output_first <= i) & (self.output_last >= a)
        held = self.held_in_backward - np.where(output_in_saved, self.output, 0.0)
        return held + saved + self.grad[i + 1] + self.backward_rise[i]

    def stored_working_set(self, s: int, k: int = 0, input_held: bool = False) -> float:
        """W_stored(s, k): the largest event of the stored segment [s, n), its saves kept
        by ``stored_codecs[k]``; ``input_held``: after a stored middle segment whose
        saves hold x_s."""
        if k == 0:
            return self._stored_events_from(s, input_held).stored_peak
        return float(self._coded_stored_working_sets(k, np.array([s]), input_held)[0])

    def _stored_events_from(self, a: int, input_held: bool) -> "_Events":
        """events_from(a), with ``input_held`` as a stored segment reads them: x_a,
        held by the stored middle segment before, taken off its first forward event
        and, where Saved(a, .) counts it, off every event and Saved."""
        events = self.events_from(a)
        if not input_held:
            return events
        return events.without_input(self.reused_input[a], self.reused_saved[a])

    def _coded_stored_working_sets(self, k: int, starts: np.ndarray, input_held: bool = False) -> np.ndarray:
        """W_stored(s, k) for each s in ``starts``, k > 0 (a lossy codec): the module
        docstring's events, broadcast over starts (rows) and layers i (columns);
        ``input_held``: after a stored middle segment whose saves hold x_s, which the
        segment's events then leave out (as its input, the caller's or a save as it is)."""
        coded, n = self._stored_by_codec[k - 1], self.n
        s, i = starts[:, None], np.arange(n)[None, :]
        reused = self.reused_input[s] if input_held else np.zeros((len(starts), 1))
        input_as_is = (coded.input_first[s] <= i) & (coded.input_last[s] >= s)  # x_s held by a save as it is
        saved = coded.saved_table()[starts] - np.where(input_as_is, reused, 0.0)  # [s, i] = Saved_k(s, i), i >= s
        held = (coded.input_first[i] <= i - 1) & (coded.input_last[i] >= s)
        unsaved = np.where(i == s, np.where(s > 0, self.input[s] - reused, 0.0),  # the chain input is in X
                           np.where(held, 0.0, self.input[i]))
        # The caller holds the segment's input until the segment's forward returns
        # (sequential.py), which no save holds here: X holds the chain input.
        caller_held = np.where((i > s) & (s > 0) & ~input_as_is, self.input[s] - reused, 0.0)
        forward = saved + unsaved + caller_held + np.maximum(self.forward_rise[i], coded.encode_rise[i])
        output_held = (coded.output_first <= i) & (coded.output_last >= s)
        backward = (self.held_in_backward - np.where(output_held, self.output, 0.0) + saved + self.grad[i + 1]
                    + np.maximum(self.backward_rise[i] + coded.decoded[i], coded.decode_rise[i]))
        events = np.where(i >= s, np.maximum(forward, backward), -np.inf).max(axis=1)
        output_held_at_end = (coded.output_first <= n - 1) & (coded.output_last >= starts)
        loss = saved[:, -1] + np.where(output_held_at_end, 0.0, self.output) + self.loss_rise
        return np.maximum(events, loss)

    def stored_seconds(self, s: int, k: int) -> float:
        """What keeping the saves of the stored segment [s, n) by ``stored_codecs[k]``
        adds to the step (0 for "none")."""
        return 0.0 if k == 0 else float(self._stored_by_codec[k - 1].seconds_from[s])

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

    def kept(self, o: int, a, b, input_held=False) -> np.ndarray:
        """R(a, b, o): the device bytes the segment keeps from its forward to its
        recompute; ``input_held`` (broadcastable): after a stored middle segment whose
        saves hold x_a, where K is x_a itself the stored segment holds it."""
        saves = self.saves(a, b)
        if self.options[o].offload:
            return np.zeros(np.shape(saves))
        signs_to_end = self.signs_before[b] if self.options[o].lossy else 0.0
        return np.where(saves, self.kept_from_start(o, a, input_held) + signs_to_end, 0.0)

    def kept_from_start(self, o: int, a, input_held=False) -> np.ndarray:
        """R(a, b, o) less the sign bits before b (lossy options), for a segment that
        keeps anything (``saves``): the part of R that does not depend on the end, so
        that for every end b, R(a, b, o) - R(a', b, o) is the same (solver._Sweep
        orders prefixes by it). Exact in float64: every term is a whole number of
        bytes or of bits / 8."""
        signs_before_start = self.signs_before[a] if self.options[o].lossy else 0.0
        return self.kept_input[o, a] - signs_before_start - self._reused(o, a, input_held)

    def _reused(self, o: int, a, input_held) -> np.ndarray:
        """The bytes of K that a stored middle segment before a holds (its saves hold
        x_a, ``input_held``) and option o keeps as x_a itself: counted there only."""
        return np.where(input_held & self.shares_input[o, a], self.reused_input[a], 0.0)

    def stored_middle_holds_output(self, a, b) -> np.ndarray:
        """Whether the saves of the stored middle segment [a, b), Saved(a, b-1), hold
        x_b, the next segment's input (a layer of [a, b) saves its storage)."""
        return self.saved_within(b, a, b - 1)

    def fetched(self, o: int, a, b) -> np.ndarray:
        """F(a, b, o): the bytes an offloaded segment fetches back from the host."""
        stored = self._stored(o, a, b)
        return stored if self.options[o].offload else np.zeros_like(stored)

    def _working_set(self, o: int, a, b, recompute, backward, carries: np.ndarray, input_held=False) -> np.ndarray:
        """W(a, b, o) + C for each C in ``carries`` (the last axis of the result), given
        the segment's largest recompute event less what the option holds (``recompute``,
        -inf when nothing is recomputed) and its largest backward event; inf where the
        option may not be used. ``input_held``: after a stored middle segment whose
        saves hold x_a, counted there: where K is x_a itself, not in K nor in the
        backward's Saved(a, i); with a lossy codec, not in the encode event."""
        option, fetched = self.options[o], self.fetched(o, a, b)
        kept = self.kept(o, a, b, input_held)
        backward = backward - np.where(input_held & self.shares_input[o, a], self.reused_saved[a], 0.0)
        held = self.held_in_backward + kept + fetched + self.decoded[o, a] + self.private_copy[a] + self.grad[b]
        events = np.maximum(held + recompute, backward)  # the sign bits go with the recompute
        encode = self.encode_event[o, a]
        if option.lossy:
            decode = self.held_in_backward + kept + fetched + self.grad[b] + self.decode_rise[o, a]
            events = np.maximum(events, np.where(self.saves(a, b), decode, -np.inf))
            encode = encode - np.where(input_held, self.reused_input[a], 0.0)
        w = np.maximum(np.expand_dims(events, -1) + carries, np.expand_dims(encode, -1))
        usable = np.expand_dims(self.allowed[o, a], -1) & (np.expand_dims(fetched, -1) <= carries)
        return np.where(usable, w, np.inf)

    def seconds_less_end(self, o: int, a) -> np.ndarray:
        """t(a, b, o) less the forward time before b, for an option kept on the device:
        the part of t that does not depend on the end (solver._Sweep orders prefixes
        by it; the time DP adds the forward time before b to it)."""
        return self.codec_s[o, a] - self.forward_s_before[a]

    def seconds(self, o: int, a, b) -> np.ndarray:
        """t(a, b, o): the time a checkpointed segment adds to the step."""
        forward = self.forward_s_before[b] - self.forward_s_before[a]
        seconds = forward + self.codec_s[o, a]
        if self.options[o].offload:  # copy out during the forward, back during recompute and backward
            backward = self.backward_s_before[b] - self.backward_s_before[a]
            seconds = (seconds + np.maximum(0.0, self.to_host_s[o, a] - forward)
                       + np.maximum(0.0, self.to_device_s[o, a] - forward - backward))
        return seconds

    # ----------------------------------------------------- the solvers' reading

    @cached_property
    def tables(self) -> "_Tables":
        """The largest events of every segment [a, b), from each start's events by
        running maxima over the ends."""
        n = self.n
        recompute, lossy_recompute, backward, stored_forward, saved = (np.full((n, n), np.inf) for _ in range(5))
        stored_peaks, held_stored_peaks = np.empty(n), np.empty(n)
        held_stored_forward = stored_forward.copy()
        for a in range(n):
            events = self.events_from(a)
            stored_peaks[a] = events.stored_peak
            held = events.without_input(self.reused_input[a], self.reused_saved[a]) if self.reused_input[a] else events
            held_stored_peaks[a] = held.stored_peak
            held_stored_forward[a, a + 1:] = np.maximum.accumulate(held.stored_forward)[:n - 1 - a]
            last = self.last_saver[a:n - 1] - a  # for ends b = a+1 .. n-1
            recompute[a, a + 1:] = until_last_save(events.recompute, events.recompute_to_last_save, last)
            lossy_recompute[a, a + 1:] = until_last_save(events.recompute + self.restore[a:],
                                                          events.recompute_to_last_save + self.restore[a:], last)
            backward[a, a + 1:] = np.maximum.accumulate(events.backward)[:n - 1 - a]
            stored_forward[a, a + 1:] = np.maximum.accumulate(events.stored_forward)[:n - 1 - a]
            saved[a, a + 1:] = events.saved[:n - 1 - a]
        codecs = range(1, len(self.stored_codecs))
        coded = [self._coded_stored_working_sets(k, np.arange(n)) for k in codecs]
        held_coded = [self._coded_stored_working_sets(k, np.arange(n), input_held=True) for k in codecs]
        return _Tables(recompute, lossy_recompute, backward, stored_forward, held_stored_forward, saved,
                       np.array([stored_peaks, *coded]), np.array([held_stored_peaks, *held_coded]))

    @property
    def stored_peaks(self) -> np.ndarray:
        """[k, s]: W_stored(s, k) for every stored codec k and start s."""
        return self.tables.stored_peaks

    @property
    def held_stored_peaks(self) -> np.ndarray:
        """[k, s]: W_stored(s, k) after a stored middle segment whose saves hold x_s
        (where none can, as stored_peaks)."""
        return self.tables.held_stored_peaks

    @cached_property
    def stored_time(self) -> np.ndarray:
        """[k, s]: stored_seconds(s, k)."""
        return np.array([np.zeros(self.n), *(coded.seconds_from[:self.n] for coded in self._stored_by_codec)])

    @property
    def backward(self) -> np.ndarray:
        """[a, b]: the largest backward event of the segment [a, b)."""
        return self.tables.backward

    def working_set(self, o: int, a, b, carries: np.ndarray, input_held=False) -> np.ndarray:
        """W(a, b, o) + C for each prefetch bound C in ``carries`` (the last axis of the
        result), for broadcastable arrays of starts and ends (and ``input_held``: after
        a stored middle segment whose saves hold x_a); inf where not allowed."""
        if np.size(carries) == 1:  # the time DP's case, and every plan without offload
            held = np.asarray(input_held).astype(np.int64)
            return self._working_sets_within(o, float(carries[0]))[held, a, b][..., None]
        tables = self.tables
        recompute = (tables.lossy_recompute if self.options[o].lossy else tables.recompute)[a, b]
        return self._working_set(o, a, b, recompute, tables.backward[a, b], carries, input_held)

    def _working_sets_within(self, o: int, carry: float) -> np.ndarray:
        """[bit, a, b]: W(a, b, o) + ``carry`` of every segment, without (bit 0) and
        with (bit 1) ``input_held``: computed once per option and carry (the last one
        asked for), since the solvers read them at every position."""
        computed = self.__dict__.setdefault("_working_set_tables", {})
        if o not in computed or computed[o][0] != carry:
            tables, a, b = self.tables, np.arange(self.n)[:, None], np.arange(self.n)[None, :]
            recompute = tables.lossy_recompute if self.options[o].lossy else tables.recompute
            held = np.array([False, True])[:, None, None]
            table = self._working_set(o, a, b, recompute, tables.backward, np.array([carry]), held)[..., 0]
            computed[o] = carry, np.broadcast_to(table, (2, self.n, self.n))
        return computed[o][1]

    def stored_middle_working_set(self, a, b, carries: np.ndarray, input_held=False) -> np.ndarray:
        """W of the stored middle segment [a, b) + C on its backward events, for each C
        in ``carries`` (the last axis), for broadcastable arrays of starts and ends (and
        ``input_held``: after a stored middle segment whose saves hold x_a)."""
        tables = self.tables
        forward = np.where(input_held, tables.held_stored_forward[a, b], tables.stored_forward[a, b])
        backward = tables.backward[a, b] - np.where(input_held, self.reused_saved[a], 0.0)
        return _stored_middle_events(forward, backward, carries)

    def stored_middle_kept(self, a, b, input_held=False) -> np.ndarray:
        """R of the stored middle segment [a, b): Saved(a, b-1), for broadcastable
        arrays of starts and ends (less x_a where ``input_held``: the stored middle
        segment before holds it)."""
        return self.tables.saved[a, b] - np.where(input_held, self.reused_saved[a], 0.0)

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

    # ------------------------------------------------------------ one plan

    def segment_working_set(self, o: int, a: int, b: int, carry: float, input_held: bool = False) -> float:
        """W(a, b, o) + C of one segment, from its own layers' events: the recompute
        runs layers a .. the last saving one, that one up to its last save (the early
        stop); every layer runs backward."""
        events, stop = self.events_from(a), b - a
        restore = self.restore[a:b] if self.options[o].lossy else 0.0
        whole, to_last_save = events.recompute[:stop] + restore, events.recompute_to_last_save[:stop] + restore
        last = int(self.last_saver[b - 1]) - a
        recompute = max(whole[:last].max(initial=-np.inf), to_last_save[last]) if last >= 0 else -np.inf
        return float(self._working_set(o, a, b, recompute, events.backward[:stop].max(), np.array([carry]),
                                       input_held)[0])

    def segment_stored_middle(self, a: int, b: int, carry: float, input_held: bool = False) -> tuple:
        """(W + C, R) of the stored middle segment [a, b), from its own layers' events
        (``input_held``: after a stored middle segment whose saves hold x_a)."""
        events, stop = self._stored_events_from(a, input_held), b - a
        working = _stored_middle_events(events.stored_forward[:stop].max(), events.backward[:stop].max(),
                                        np.array([carry]))[0]
        return float(working), float(events.saved[stop - 1])

    def predict(self, segments: list, nested: Sequence = ()) -> tuple:
        """(peak bytes, step seconds, index of the segment setting the peak) of a plan
        given as [(start, stop, option index, or None for a stored middle segment)],
        the stored segment last with ~k (-1 - k) for its saves' codec stored_codecs[k]
        (-1: as they are): the module docstring's peak = X + max_j (R_0 + ... +
        R_{j-1} + W_j), C the largest F of the plan's offloaded segments.
        ``nested[j]``: the Range that cuts checkpointed segment j's recompute, or None
        (nested_model.py)."""
        nested = list(nested) or [None] * (len(segments) - 1)
        checkpointed = [(a, b, o, r) for (a, b, o), r in zip(segments[:-1], nested) if o is not None]
        carry = max((float(self.fetched(o, a, b)) for a, b, o, _ in checkpointed if self.options[o].offload),
                    default=0.0)
        seconds = self.forward_s_before[-1] + self.backward_s_before[-1]
        seconds += sum(float(self.seconds(o, a, b)) if r is None else nested_model.seconds(self, o, a, r)
                       for a, b, o, r in checkpointed)
        stored_start, _, stored = segments[-1]
        seconds += self.stored_seconds(stored_start, ~stored)
        kept_before, peak, peak_segment, input_held = 0.0, -math.inf, 0, False
        for j, (a, b, o) in enumerate(segments):
            if o is None:
                working, kept = self.segment_stored_middle(a, b, carry, input_held)
            elif o < 0:
                working, kept = self.stored_working_set(a, ~o, input_held), 0.0
            elif nested[j] is not None:
                working = nested_model.working_set(self, o, a, b, nested[j], carry, input_held)
                kept = float(self.kept(o, a, b, input_held))
            else:
                working = self.segment_working_set(o, a, b, carry, input_held)
                kept = float(self.kept(o, a, b, input_held))
            if kept_before + working > peak:
                peak, peak_segment = kept_before + working, j
            kept_before += kept
            input_held = o is None and bool(self.stored_middle_holds_output(a, b))
        return self.chain_input + peak, seconds, peak_segment


class _Events(NamedTuple):
    """The option-independent events of the layers i = a .. n-1 of a segment starting
    at a, one array each (index i - a), in the module docstring's terms."""

    saved: np.ndarray  # Saved(a, i): a stored middle segment [a, i+1) keeps these
    stored_forward: np.ndarray  # Saved(a, i-1) + U(i) + [x_a] + fwd_i: a stored segment's forward
    caller_held: np.ndarray  # [x_a]: the segment's input, held by the caller and no save
    loss: float  # Saved(a, n-1) + U(n) + L: the stored segment's loss
    backward: np.ndarray  # O + Saved(a, i) + g_{i+1} + bwd_i
    recompute: np.ndarray  # Saved'(a, i-1) + U(i) + fwd_i: the option adds its held bytes
    recompute_to_last_save: np.ndarray  # the same, the layer's rise up to its last save

    @property
    def stored_peak(self) -> float:
        """W_stored(a): the largest event of the stored segment [a, n)."""
        return float(max(self.stored_forward.max(), self.loss, self.backward.max()))

    def without_input(self, first: float, saved: float) -> "_Events":
        """The stored segment's events when the stored middle segment before holds x_a:
        ``first`` (x_a) off its first forward event (U(a)) and those where the caller
        holds it ([x_a]), ``saved`` (x_a where Saved(a, .) counts it, else 0) off Saved
        and every other event counting it."""
        forward = self.stored_forward - np.where(self.caller_held > 0, first, saved)
        forward[0] = self.stored_forward[0] - first
        return self._replace(saved=self.saved - saved, stored_forward=forward, loss=self.loss - saved,
                             backward=self.backward - saved)


class _Tables(NamedTuple):
    """[a, b]: the largest event of the segment [a, b) (inf below the diagonal)."""

    recompute: np.ndarray  # -inf where nothing is recomputed
    lossy_recompute: np.ndarray  # with the ReLU restores of a lossy codec
    backward: np.ndarray
    stored_forward: np.ndarray  # the largest forward event of a stored middle segment
    held_stored_forward: np.ndarray  # the same after a stored middle segment whose saves hold x_a
    saved: np.ndarray  # Saved(a, b-1): what a stored middle segment keeps
    stored_peaks: np.ndarray  # [k, s]: W_stored(s, k)
    held_stored_peaks: np.ndarray  # [k, s]: the same after a stored middle segment whose saves hold x_s


def _stored_middle_events(forward, backward, carries: np.ndarray) -> np.ndarray:
    """A stored middle segment's largest event, given its largest forward and backward
    events, for each C in ``carries`` (the last axis): C is charged to the backward."""
    return np.maximum(np.expand_dims(forward, -1), np.expand_dims(backward, -1) + carries)


def until_last_save(full: np.ndarray, truncated: np.ndarray, last: np.ndarray) -> np.ndarray:
    """For each segment end, the largest recompute event: layers before the segment's
    last saving layer (``last``, relative to the start) run whole (``full``), that
    layer up to its last save (``truncated``: the early stop), the rest not at all;
    -inf when no layer saves."""
    running = np.maximum.accumulate(full)
    whole = np.where(last > 0, running[np.maximum(last - 1, 0)], -np.inf)
    return np.where(last >= 0, np.maximum(whole, truncated[np.maximum(last, 0)]), -np.inf)


class _CodedSaves:
    """The terms of a stored segment whose saves one lossy codec keeps (module
    docstring: Saved_k, U_k, O_k, enc_k, dec_k), from the profile's StoredSaves."""

    def __init__(self, prof: Profile, codec: str):
        n, stored = len(prof.layers), prof.stored_saves
        self.n = n
        tensors = stored.tensors
        self.first = np.array([t.first for t in tensors], dtype=np.int64)
        self.last = np.array([t.last for t in tensors], dtype=np.int64)
        self.kept = np.array([t.kept_bytes[codec] for t in tensors], dtype=np.float64)
        self.signs = np.array([t.sign_bytes for t in tensors], dtype=np.float64)
        self.encode_rise = np.array([rises[codec] for rises in stored.encode_rise], dtype=np.float64)
        self.decode_rise = np.array([rises[codec] for rises in stored.decode_rise], dtype=np.float64)
        self.decoded = np.array(stored.decoded_bytes, dtype=np.float64)
        spans = [span or (n, -1) for span in stored.input_held_by]  # (n, -1): held by no save
        self.input_first = np.array([first for first, _ in spans])
        self.input_last = np.array([last for _, last in spans])
        self.output_first, self.output_last = stored.output_held_by or (n, -1)
        # Each stored tensor is encoded once (at its first save in the segment), each
        # save decoded once.
        encoded_by_last = np.bincount(self.last, weights=[t.encode_s[codec] for t in tensors], minlength=n)
        decode_s = np.array([seconds[codec] for seconds in stored.decode_s], dtype=np.float64)
        self.seconds_from = np.append(np.cumsum((encoded_by_last + decode_s)[::-1])[::-1], 0.0)

    @cached_property
    def _table(self) -> np.ndarray:
        n = self.n
        by_span = np.zeros((n, n))
        np.add.at(by_span, (self.first, self.last), self.kept)
        first_at_most = by_span.cumsum(axis=0)  # [i, last]: first <= i
        last_at_least = first_at_most[:, ::-1].cumsum(axis=1)[:, ::-1]  # [i, s]: first <= i, last >= s
        # A tensor first saved before s is the segment's input: it keeps no ReLU bits.
        crossing = np.zeros(n + 1)
        np.add.at(crossing, self.first + 1, self.signs)
        np.add.at(crossing, self.last + 1, -self.signs)
        return last_at_least.T - np.cumsum(crossing)[:n, None]

    def saved_table(self) -> np.ndarray:
        """[s, i] = Saved_k(s, i) for i >= s: the stored tensors whose saving layers meet
        [s, i], each counted once (undefined for i < s)."""
        return self._table
