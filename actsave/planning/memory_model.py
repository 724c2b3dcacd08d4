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
    Segment j holds layers [a, b). The last segment is plain (never recomputed; its
    saves as autograd keeps them or by a lossy codec); each of the others is
    checkpointed with an option o = (codec, offload), or plain too (a plain middle
    segment, its saves kept likewise). Backward runs the segments in reverse, so everything segment j allocates, forward or backward,
    happens while only the segments before it hold their kept bytes R:

        peak = X + max_j ( R_0 + ... + R_{j-1} + W_j )

    X is the chain input (held by the caller). A checkpointed segment keeps its
    input as the codec stores it (K; nothing for the chain input, held anyway) plus,
    for a lossy codec, the decisions its recompute takes from the forward (S): one bit
    per element of each ReLU output inside it, a few per output of each max pool
    (runtime/pool_decisions.py), until its recompute ends, and a snapshot of the module
    state its layers mutate (M: BatchNorm's statistics, any module's moving averages;
    runtime/state.py, NOTE [ State a forward reads and mutates ]), which its recompute
    reads, with the weight casts its layers made under autocast with its cache on,
    which the cache holds (NOTE [ Casts autocast caches ] in runtime/replay.py). R = K
    + S + M is what it keeps on the device; offloaded, R = M and F = K + S
    is fetched back for the recompute.
    W is the largest of the segment's events, each built from per-layer measurements
    of the profiled step (sums over a <= i < b):

    checkpointed [a, b), option o
        encode      x_a + enc(a, o)                                    lossy codecs
        forward     [x_a] + K' + S + M + [i > a] x_i + nfwd_i
        decode      O + R + F + g_b + dec(a, o)                        lossy codecs
        recompute   O + R + F + D + Q + g_b + Saved'(a, i-1) + U(i) + G(a, i-1)
                    + fwd_i (+ restore_i)
        backward    O + Saved(a, i) + G'(a, i-1) + g_{i+1} + bwd_i (+ D + F at a = 0:
                    Saved leaves out the chain input, and the recompute saves its copy)
    plain middle [a, b), b < n: R = Saved(a, b-1), autograd's saves, kept from its
    forward to its backward (which recomputes nothing)
        forward     Saved(a, i-1) + U(i) + [x_a] + fwd_i
        backward    O + Saved(a, i) + g_{i+1} + bwd_i + C
    plain last [s, n)
        forward     Saved(s, i-1) + U(i) + [x_s] + fwd_i
        loss        Saved(s, n-1) + U(n) + L
        backward    O + Saved(s, i) + g_{i+1} + bwd_i
    plain last [s, n), saves kept by lossy codec k (runtime/kept_saves.py)
        forward     Saved_k(s, i) + U_k(i) + [x_s] + max(fwd_i, enc_k(i))
        loss        Saved_k(s, n-1) + U_k(n) + L
        backward    O_k + Saved_k(s, i) + g_{i+1} + max(bwd_k(i), dec_k(i))
    plain middle [a, b), saves kept by lossy codec k: R = Saved_k(a, b-1); the
    events of the plain last [a, n) kept by k at layers a .. b-1, C on the backward
    ones. Its saves hold no tensor as it is for the next segment (they are encoded),
    so the next segment counts its input; where a save is held as it is (a tensor the
    codec does not take), that counts it twice, above the step. Each segment encodes
    the tensors its layers save, a tensor saved on both sides of a boundary once on
    each side, as the runtime does (one store per segment).

    O: the output, which the caller holds through the backward (``out = model(x)``), its
    gradient where the caller holds that too (a step without the loss passes it:
    ``out.backward(g)``; with the step's loss autograd frees it after the last layer's
    backward, which counts it as g_n: Profile.output_grad_held), and the gradients of
    parameters two layers use, which autograd holds between the two uses' backwards
    (profiler.py, NOTE [ Gradients pending between two uses ]).
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
    saves and one decoding's temporaries (the ReLU decisions restored); bwd_k(i): its
    backward's rise with each node's decoded saves alive to the next such node. The
    profiled rises are net of the saves the step freed as their nodes finished, whole,
    where the codec frees only their encodings: both add back the rest of those freed
    so far in the layer's backward (stored_saves.py). The layer's new encodings
    are counted, in Saved_k, from its start, and the tensors they encode as if they
    stayed to its end (as in the profiled step): the stored events bound the codec's
    step from above, by the saves' full size at most.
    Saved(a, i): the distinct storages saved for backward by layers a..i, each counted
    once whichever layers share it; Saved' leaves out the segment input, counted by K,
    F or D. U(i): layer i's input while it runs, unless a layer of the segment before
    it saved it. G(a, i): the parameters FSDP2 gathers for layers a..i, which a
    recompute keeps gathered until each layer's backward (fsdp_gathers.py,
    NOTE [ Gathered parameters ]; 0 without FSDP2); the rises fwd_i and bwd_i hold
    those of a plain step, so G' leaves out the layer bwd_i holds prefetched. [x_s]:
    the segment's input, s > 0, after its first layer, where no save of the layers
    before holds it: the caller holds it until the segment's forward returns. g_i: the
    gradient of layer i's input. fwd_i, bwd_i: the rise of live bytes during layer i's
    forward and backward. The recompute stops at the segment's last saved tensor
    (runtime/function.py), so the last saving layer contributes only its rise up to
    its last save and later layers nothing; a segment that saves nothing keeps
    nothing. F: the input fetched back from the host; D: the decoded input; Q: the
    private copy a segment starting with an in-place layer recomputes from; restore_i:
    re-imposing the forward's ReLU or max-pool decisions, the larger
    (runtime/relu_signs.py, pool_decisions.py); enc, dec: the rise while encoding,
    decoding. A recompute runs on the snapshot M, which it keeps to its end, and the
    profile's steps on copies of every buffer made before them: autograd's saves of
    them (BatchNorm's statistics) are not in Saved, as parameters are not, so R counts
    them once, and the segment's backward events M (what autograd saved of it, at most).
    nfwd_i: layer i's rise in a forward under no_grad; K': K where it is on the device
    and not x_a itself (NOTE [ A checkpointed segment's forward ]).

    Offload (CUDA only: on a CPU model host memory is device memory) brings an
    input back early, when the next offloaded segment's recompute prefetches it. The
    model charges C, the largest F of an offloaded segment of the plan, to every
    backward-time event of every checkpointed or plain middle segment (a prefetch
    may be in flight across a plain middle segment's backward), and the dynamic programs run
    for every candidate C: each distinct F, or, where a lossy codec's offloaded bits
    make more than _MAX_CARRIES distinct sizes (F depends on both ends of a
    segment), the largest F below each point of a geometric grid over them. On the
    grid a plan's charge exceeds its own C by less than the grid's step, so its
    peak is within that of the optimum (tests/planning/test_memory_model.py).

    A tensor at a plain boundary: where a plain middle segment [a', b) saves x_b,
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
    (a plain segment adds nothing),
    t = sum_{a<=i<b} (forward_i + h * saves_i) + c + encode and decode time (lossy) +
    the host copies not hidden behind the segment's forward (copy out) and its
    recompute and backward (copy back; offload), where c and h are the runtime's host
    work per checkpointed call and per save (checkpoint_host.py; 0 off a CPU). Sign
    bits and the early stop are ignored. A plain segment whose saves a codec keeps
    adds, for each of its stored tensors, one encoding, and for each save one
    decoding, each the seconds the codec took on a sample of that shape
    (stored_saves.py, StoredSaves).

Each term is written once (:class:`CostModel`: the checkpointed segments' terms, on
the plain segments' of plain_model.py and the option-independent events of
layer_events.py) and read two ways: by the solvers
(solver.py) for every segment at once, from tables of each segment's largest events,
and by :meth:`CostModel.predict` for one plan, each segment from its own events.
:func:`~actsave.plan` checks that the second fits the peak the first planned for.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence

import numpy as np

from ..devices import host_is_separate
from ..runtime.keep_rules import KeepPolicy, kept_as
from . import nested_model
from .profiler import LayerProfile, Profile
from .planned_segment import Kind
from .plain_model import PlainTerms

# Offloaded ReLU bits make a segment's fetch size depend on both its ends, so the sizes
# an offloaded segment may fetch number up to n^2 / 2. Beyond this many, the carries
# are a geometric grid over them (module docstring, "Offload").
_MAX_CARRIES = 64


def effective_option(option: KeepPolicy, layer: LayerProfile, device: str) -> KeepPolicy:
    """What a segment starting at ``layer`` keeps its input by, asked for ``option``:
    an input should_encode refuses is kept by reference, on the device, whatever the
    option (keep_rules.kept_as); without separate host memory an offloaded input still takes
    its bytes."""
    kept = kept_as(option, layer.input_encodable)
    return kept if host_is_separate(device) else KeepPolicy(kept.codec, False)


class CostModel(PlainTerms):
    """The module docstring's memory and time model over the layers as numpy arrays:
    the checkpointed segments' terms here, on the plain segments' (plain_model.py)
    and the option-independent events (layer_events.py).

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
                 stored_codecs: Sequence[str] = ("none",), plain_middle: bool = False):
        """``options``: the keep options the plans may use. ``fixed``: one option per
        layer instead, the only one a segment starting there may use.
        ``stored_codecs``, ``plain_middle``: as PlainTerms (:meth:`predict` prices
        plain middle segments either way)."""
        super().__init__(prof, stored_codecs, plain_middle)
        if fixed is not None:
            fixed = [effective_option(option, layer, prof.device) for option, layer in zip(fixed, prof.layers)]
            options = sorted(set(fixed), key=lambda option: (option.codec.name, option.offload))
        self.options = options
        self._options_by_layer(prof.layers)
        if fixed is not None:
            self.allowed &= np.array([[option == each for each in fixed] for option in options])

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
        self.allowed[o, a] = kept_as(option, layer.input_encodable) == option
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
        recompute; ``input_held`` (broadcastable): after a plain middle segment whose
        saves hold x_a, where K is x_a itself the plain segment holds it. Offloaded,
        only the snapshot M of mutated module state stays on the device."""
        saves = self.saves(a, b)
        if self.options[o].offload:
            return np.where(saves, self.state(a, b), 0.0)
        signs_to_end = self.signs_before[b] if self.options[o].lossy else 0.0
        return np.where(saves, self.kept_from_start(o, a, input_held) + signs_to_end + self.state_before[b], 0.0)

    def state(self, a, b):
        """M(a, b): the snapshot of the module state layers a .. b-1 mutate."""
        return self.state_before[b] - self.state_before[a]

    def kept_from_start(self, o: int, a, input_held=False) -> np.ndarray:
        """R(a, b, o) less the sign bits (lossy options) and the snapshot before b, for
        a segment that keeps anything (``saves``): the part of R that does not depend on
        the end, so that for every end b, R(a, b, o) - R(a', b, o) is the same
        (pareto.Sweep orders prefixes by it). Exact in float64: every term is a whole
        number of bytes or of bits / 8."""
        signs_before_start = self.signs_before[a] if self.options[o].lossy else 0.0
        return self.kept_input[o, a] - signs_before_start - self.state_before[a] - self._reused(o, a, input_held)

    def _reused(self, o: int, a, input_held) -> np.ndarray:
        """The bytes of K that a plain middle segment before a holds (its saves hold
        x_a, ``input_held``) and option o keeps as x_a itself: counted there only."""
        return np.where(input_held & self.shares_input[o, a], self.reused_input[a], 0.0)

    def fetched(self, o: int, a, b) -> np.ndarray:
        """F(a, b, o): the bytes an offloaded segment fetches back from the host."""
        stored = self._stored(o, a, b)
        return stored if self.options[o].offload else np.zeros_like(stored)

    # NOTE [ A checkpointed segment's forward ]
    # A segment's recompute stops at its last save (runtime/function.py), where its
    # forward goes on: a layer that makes a large temporary after its last save (or a
    # layer after the segment's last saving one) rises in the forward by more than any
    # recompute event holds, and no backward event holds it either. So the forward is an
    # event of its own, layer by layer: the layer's rise with its saves dropped (the
    # profile's forward under no_grad: the forward's saves become placeholders), its
    # input where it is not the segment's, and what the segment holds throughout: its
    # input, held by the caller (or the plain middle segment before), what the option
    # keeps of it on the device besides that input itself, the decisions and the
    # snapshot. A block plan reads a checkpointed block's forward so too
    # (block_options.py): a block whose caller drops an output made after the block's
    # last save rises by that output's temporaries there.

    def held_in_forward(self, o: int, a, b, input_held=False) -> np.ndarray:
        """[x_a] + K' + S + M: what the checkpointed segment [a, b) holds beside each
        layer's input and rise in its forward (NOTE [ A checkpointed segment's forward
        ]); ``input_held``: after a plain middle segment whose saves hold x_a."""
        caller = np.where(np.asarray(a) > 0, self.input[a] - np.where(input_held, self.reused_input[a], 0.0), 0.0)
        own = 0.0 if self.options[o].offload else np.where(self.shares_input[o, a], 0.0, self.kept_input[o, a])
        return caller + own + self.signs(o, a, b) + self.state(a, b)

    def forward_working_set(self, o: int, a, b, input_held=False, forward=None) -> np.ndarray:
        """The checkpointed segment [a, b)'s largest event before its backward: the
        encoding of its input (a lossy codec) or its forward (NOTE [ A checkpointed
        segment's forward ]); ``forward``: its largest forward event less what it holds,
        by default from the tables; ``input_held``: as for :meth:`held_in_forward`."""
        encode = self.encode_event[o, a]
        if self.options[o].lossy:
            encode = encode - np.where(input_held, self.reused_input[a], 0.0)
        if forward is None:
            forward = self.tables.checkpointed_forward[a, b]
        return np.maximum(encode, self.held_in_forward(o, a, b, input_held) + forward)

    def _working_set(self, o: int, a, b, recompute, backward, forward, carries: np.ndarray,
                     input_held=False) -> np.ndarray:
        """W(a, b, o) + C for each C in ``carries`` (the last axis of the result), given
        the segment's largest recompute event less what the option holds (``recompute``,
        -inf when nothing is recomputed), its largest backward event and its largest
        forward event less what the option holds (``forward``); inf where the
        option may not be used. ``input_held``: after a plain middle segment whose
        saves hold x_a, counted there: where K is x_a itself, not in K nor in the
        backward's Saved(a, i); with a lossy codec, not in the encode event."""
        option, fetched = self.options[o], self.fetched(o, a, b)
        kept = self.kept(o, a, b, input_held)
        backward = backward - np.where(input_held & self.shares_input[o, a], self.reused_saved[a], 0.0)
        # The plain step's saves leave out the chain input (the caller's): a recompute
        # from a copy of it (decoded, or fetched back) saves that copy, to the backward.
        backward = backward + np.where(np.asarray(a) == 0, self.decoded[o, a] + fetched, 0.0)
        held = self.held_in_backward + kept + fetched + self.decoded[o, a] + self.private_copy[a] + self.grad[b]
        # After the recompute, autograd's saves of the snapshot (BatchNorm's statistics)
        # stay to their layers' backward: at most M.
        backward = backward + np.where(self.saves(a, b), self.state(a, b), 0.0)
        events = np.maximum(held + recompute, backward)  # the sign bits go with the recompute
        if option.lossy:
            decode = self.held_in_backward + kept + fetched + self.grad[b] + self.decode_rise[o, a]
            events = np.maximum(events, np.where(self.saves(a, b), decode, -np.inf))
        # The forward's events come before any prefetch: no carry.
        in_forward = self.forward_working_set(o, a, b, input_held, forward)
        w = np.maximum(np.expand_dims(events, -1) + carries, np.expand_dims(in_forward, -1))
        usable = np.expand_dims(self.allowed[o, a], -1) & (np.expand_dims(fetched, -1) <= carries)
        return np.where(usable, w, np.inf)

    def seconds_less_end(self, o: int, a) -> np.ndarray:
        """t(a, b, o) less the recompute time before b, for an option kept on the
        device: the part of t that does not depend on the end (pareto.Sweep orders
        prefixes by it; the time DP adds recompute_s_before[b] to it)."""
        return self.codec_s[o, a] + self.call_s - self.recompute_s_before[a]

    def seconds(self, o: int, a, b) -> np.ndarray:
        """t(a, b, o): the time a checkpointed segment adds to the step."""
        recompute = self.recompute_s_before[b] - self.recompute_s_before[a]
        seconds = recompute + self.call_s + self.codec_s[o, a]
        if self.options[o].offload:  # copy out during the forward, back during recompute and backward
            backward = self.backward_s_before[b] - self.backward_s_before[a]
            forward = self.forward_s_before[b] - self.forward_s_before[a]
            seconds = (seconds + np.maximum(0.0, self.to_host_s[o, a] - forward)
                       + np.maximum(0.0, self.to_device_s[o, a] - forward - backward))
        return seconds

    # ----------------------------------------------------- the solvers' reading

    def working_set(self, o: int, a, b, carries: np.ndarray, input_held=False) -> np.ndarray:
        """W(a, b, o) + C for each prefetch bound C in ``carries`` (the last axis of the
        result), for broadcastable arrays of starts and ends (and ``input_held``: after
        a plain middle segment whose saves hold x_a); inf where not allowed."""
        if np.size(carries) == 1:  # the time DP's case, and every plan without offload
            held = np.asarray(input_held).astype(np.int64)
            return self._working_sets_within(o, float(carries[0]))[held, a, b][..., None]
        tables = self.tables
        recompute = (tables.lossy_recompute if self.options[o].lossy else tables.recompute)[a, b]
        return self._working_set(o, a, b, recompute, tables.checkpointed_backward[a, b],
                                 tables.checkpointed_forward[a, b], carries, input_held)

    def _working_sets_within(self, o: int, carry: float) -> np.ndarray:
        """[bit, a, b]: W(a, b, o) + ``carry`` of every segment, without (bit 0) and
        with (bit 1) ``input_held``: computed once per option and carry (the last one
        asked for), since the solvers read them at every position."""
        computed = self.__dict__.setdefault("_working_set_tables", {})
        if o not in computed or computed[o][0] != carry:
            tables, a, b = self.tables, np.arange(self.n)[:, None], np.arange(self.n)[None, :]
            recompute = tables.lossy_recompute if self.options[o].lossy else tables.recompute
            held = np.array([False, True])[:, None, None]
            table = self._working_set(o, a, b, recompute, tables.checkpointed_backward, tables.checkpointed_forward,
                                      np.array([carry]), held)[..., 0]
            computed[o] = carry, np.broadcast_to(table, (2, self.n, self.n))
        return computed[o][1]

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
        return float(self._working_set(o, a, b, recompute, events.checkpointed_backward[:stop].max(),
                                       events.checkpointed_forward[:stop].max(), np.array([carry]), input_held)[0])

    def predict(self, segments: list, nested: Sequence = ()) -> tuple:
        """(peak bytes, step seconds, index of the segment setting the peak) of a plan
        given as PlannedSegments (NOTE [ Planned segments ]): the module docstring's
        peak = X + max_j (R_0 + ... + R_{j-1} + W_j), C the largest F of the plan's
        offloaded segments. ``nested[j]``: the Range that cuts checkpointed segment j's
        recompute, or None (nested_model.py)."""
        nested = list(nested) or [None] * (len(segments) - 1)
        checkpointed = [(s.start, s.stop, s.option, r) for s, r in zip(segments[:-1], nested) if s.is_checkpointed]
        carry = max((float(self.fetched(o, a, b)) for a, b, o, _ in checkpointed if self.options[o].offload),
                    default=0.0)
        seconds = self.forward_s_before[-1] + self.backward_s_before[-1]
        seconds += sum(float(self.seconds(o, a, b)) if r is None else nested_model.seconds(self, o, a, r)
                       for a, b, o, r in checkpointed)
        seconds += self.plain_seconds(segments[-1].start, segments[-1].codec)
        seconds += sum(float(self.coded_middle_seconds(s.codec, s.start, s.stop)) for s in segments[:-1]
                       if s.is_plain and s.codec)
        kept_before, peak, peak_segment, input_held = 0.0, -math.inf, 0, False
        for j, (a, b, kind, o, k) in enumerate(segments):
            if kind is Kind.PLAIN and k:
                working, kept = self.segment_coded_middle(a, b, k, carry, input_held)
            elif kind is Kind.PLAIN:
                working, kept = self.segment_plain_middle(a, b, carry, input_held)
            elif kind is Kind.PLAIN_LAST:
                working, kept = self.plain_working_set(a, k, input_held), 0.0
            elif nested[j] is not None:
                working = nested_model.working_set(self, o, a, b, nested[j], carry, input_held)
                kept = float(self.kept(o, a, b, input_held))
            else:
                working = self.segment_working_set(o, a, b, carry, input_held)
                kept = float(self.kept(o, a, b, input_held))
            if kept_before + working > peak:
                peak, peak_segment = kept_before + working, j
            kept_before += kept
            input_held = kind is Kind.PLAIN and not k and bool(self.plain_middle_holds_output(a, b))
        return self.chain_input + peak, seconds, peak_segment
