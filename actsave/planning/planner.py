"""Automatic checkpointing plans: profile a chain once, then choose where segments start
and how each keeps its input, by an exact dynamic program over a stated memory model.

    prof = actsave.profile(model, (x,))            # one measured training step
    print(prof)                                    # per-layer bytes and times
    p = actsave.plan(prof, budget=8 * 2**30)       # the fastest plan within 8 GiB
    print(p)
    model.apply_plan(p)                            # a CheckpointedSequential

or in one line: ``CheckpointedSequential(*layers, segments="auto", budget=...,
example_inputs=(x,))``. Sizes alone, at any scale and without the device, come from a
profile on meta tensors (:func:`profile` with a meta ``x``); :func:`balanced` plans
such a profile with each layer's keep option fixed, which is what
``CheckpointedSequential``'s default ``segments="balanced"`` does at its first call.

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
    peak is within that of the optimum (tests/test_planner.py).

    Overestimates, by design: a view of one storage passed across a segment boundary
    is counted on both sides, ReLU restores are taken to coincide with the layer's
    whole forward rise. Measured peaks (MemTracker, CPU) of applied plans are within
    a few percent below the prediction, mostly equal to it (tests/test_planner.py).

Time model
    step = sum_i (forward_i + backward_i) + sum over checkpointed segments t(a,b,o),
    t = sum_{a<=i<b} forward_i + encode and decode time (lossy) + the host copies not
    hidden behind the segment's forward (copy out) and its recompute and backward
    (copy back; offload). Sign bits and the early stop are ignored.

Dynamic program
    Time-optimal, left to right. A label (P, T) at position b is a plan of layers
    [0, b) in checkpointed segments: P = the bytes they keep, T = their time. All
    labels at b recompute the same layers, so they differ only by codec and copy
    costs, and the Pareto frontier L(b) (no label smaller in both P and T) stays
    small. With L(0) = {(0, 0)},

        L(b) = Pareto { (P + R(a,b,o), T + t(a,b,o)) : a < b, o, (P, T) in L(a),
                        P + W(a,b,o) + C <= budget - X }
        best = min { T : s < n, (P, T) in L(s), P + W_stored(s) <= budget - X }

    Feasibility depends on a label only through P and time is additive, so a
    dominated label never leads to a better plan: the DP is exact for the model.
    Smallest peak ("memory" objective, and :func:`balanced`), right to left, one
    number per start and candidate C: h(a) = min(W_stored(a), min_{b,o} max(W(a,b,o)
    + C, R(a,b,o) + h(b))), peak = X + h(0); then the fastest plan within that peak,
    the time dynamic program run only for the candidates whose h(0) fits. With every
    time 0 (a meta profile) the first plan found is kept: the one whose stored
    segment starts earliest, so the fewest layers are recomputed.

    Cost: the option-independent maxima of W for every segment are three n x n
    tables (O(n^2) time and memory, built row by row); the time DP extends every
    live label at each b, O(n^2 L |O|) with L the mean frontier size, vectorized
    over labels; the memory DP is O(n^2 |O| |C|), vectorized over the candidates C.
    For 1,000 layers, about 1 s on one CPU core (tests/test_planner.py prints it);
    balanced plans of ResNet-1001 (339 layers) with int8 and offload, 63 candidates:
    0.3 s.

Limits: the chain must pass one tensor from layer to layer. Only the last segment can
be stored, as CheckpointedSequential runs it. Timings come from one step. The plan is
for the batch shape profiled.
"""
from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterable
import math
import statistics
import time
from dataclasses import dataclass
from typing import NamedTuple, Optional, Sequence

import numpy as np
import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.module import register_module_forward_pre_hook

from ..runtime import relu_signs
from .._torch import own_tensors
from ..checks import integral, real_number
from ..codecs import EXPECTED_GRADIENT_SQNR_DB, LOSSY_CODECS, available_codecs, get_codec
from ..errors import ConfigError
from ..text import format_table
from .estimate import LiveBytes, allocation_bytes
from ..meta import fast_meta, on_meta, plans_at_first_call, simulating
from ..runtime.store import EXACT, KeepPolicy, modifies_input, should_encode

MiB = 2**20

# Every lossy codec name of codecs.py, aliases included ("fp8" is e4m3), is a lever.
_LEVER_CODECS = {name: get_codec(name).name for name in available_codecs() if not get_codec(name).lossless}
LEVERS = ("recompute", *_LEVER_CODECS, "offload")
DEFAULT_ALLOW = ("recompute", "int8", "fp8", "offload")
OBJECTIVES = ("time", "memory")

# Offloaded ReLU bits make a segment's fetch size depend on both its ends, so the sizes
# an offloaded segment may fetch number up to n^2 / 2. Beyond this many, the carries
# are a geometric grid over them (module docstring, "Offload").
_MAX_CARRIES = 64


# ----------------------------------------------------------------------------- profile


@dataclass(frozen=True)
class LayerProfile:
    """What one layer of the profiled step allocated and took. Bytes are allocation
    bytes on the profiled device; per-codec values are keyed by codec name ("none",
    "int8", "fp8_e4m3", "fp8_e5m2") and describe the layer's *input*, which a segment
    starting at this layer keeps."""

    name: str
    kind: str
    input_bytes: int  # the input's storage
    dense_input_bytes: int  # the input as a new contiguous tensor (decoded, copied)
    input_grad_bytes: int  # 0 when the input needs no gradient
    output_bytes: int
    saved_bytes: int  # storages this layer is the first to save
    input_saved_by: Optional[tuple]  # (first, last) layer saving the input's storage
    forward_rise: int
    forward_rise_to_last_save: int  # where a recompute that ends in this layer stops
    backward_rise: int
    saves_for_backward: bool  # any tensor, parameters included
    relu_sign_bytes: int  # kept by a lossy segment for this layer's ReLU outputs
    relu_restore_bytes: int
    modifies_input: bool
    recompute_scratch_bytes: int  # BatchNorm statistics a recompute copies (runtime/state.py), held to its end
    input_encodable: bool  # False: kept by reference whatever the codec (a leaf, not float)
    kept_bytes: dict
    encode_rise: dict
    decode_rise: dict
    forward_s: float
    backward_s: float
    encode_s: dict
    decode_s: dict
    to_host_s: dict  # empty when the device has no separate host memory
    to_device_s: dict


@dataclass(frozen=True)
class SavedStorage:
    """A storage saved for backward: its bytes and the first and last layer saving it."""

    nbytes: int
    first: int
    last: int


@dataclass(frozen=True)
class Profile:
    """One measured training step of a chain: the input to :func:`plan`. Print it for
    a per-layer table."""

    layers: tuple
    saved: tuple  # of SavedStorage
    input_bytes: int  # the chain input, held by the caller
    output_bytes: int  # the chain output, held by the caller through the backward
    output_saved_by: Optional[tuple]  # (first, last) layer saving the output's storage
    output_grad_bytes: int
    device: str  # the device the bytes are for (a meta profile stands for one)
    timed: bool = True  # False for a profile on meta tensors: every time is 0

    def table(self) -> str:
        """One row per layer: output and saved bytes, what a segment starting there
        keeps by each codec ("-": kept by reference), times, codec and copy costs."""
        head = ["layer", "name", "type", "out MiB", "saved MiB",
                *(f"kept {c} MiB" for c in ("none", *LOSSY_CODECS)), "fwd ms", "bwd ms",
                *(f"enc+dec {c} ms" for c in LOSSY_CODECS), "copy ms"]
        rows = [head] + [self._row(i, layer) for i, layer in enumerate(self.layers)]
        forward = sum(layer.forward_s for layer in self.layers)
        backward = sum(layer.backward_s for layer in self.layers)
        footer = (f"device {self.device}; input {_mib(self.input_bytes)} MiB, output {_mib(self.output_bytes)} "
                  f"MiB; step forward {_ms(forward)} ms, backward {_ms(backward)} ms")
        return format_table(rows) + "\n" + footer

    @staticmethod
    def _row(i: int, layer: "LayerProfile") -> list:
        lossy = [c if layer.input_encodable else None for c in LOSSY_CODECS]
        copy = layer.to_host_s.get("none", 0.0) + layer.to_device_s.get("none", 0.0)
        return [str(i), layer.name, layer.kind, _mib(layer.output_bytes), _mib(layer.saved_bytes),
                _mib(_kept_input(i, layer, EXACT)),
                *("-" if c is None else _mib(layer.kept_bytes[c]) for c in lossy),
                _ms(layer.forward_s), _ms(layer.backward_s),
                *("-" if c is None else _ms(layer.encode_s[c] + layer.decode_s[c]) for c in lossy),
                _ms(copy) if layer.to_host_s else "-"]

    def __str__(self) -> str:
        return self.table()


def _chain_layers(model) -> list:
    if not isinstance(model, nn.Sequential):
        raise ConfigError(f"model={model!r}: profile expects an nn.Sequential chain of layers (a "
                          f"CheckpointedSequential is one), got {type(model).__name__}")
    if len(model) == 0:
        raise ConfigError("model is an empty nn.Sequential: profile needs a chain with at least one layer")
    return list(model.named_children())


def _single_input(example_inputs) -> torch.Tensor:
    inputs = (example_inputs,) if isinstance(example_inputs, torch.Tensor) else example_inputs
    if not isinstance(inputs, (tuple, list)) or len(inputs) != 1 or not isinstance(inputs[0], torch.Tensor):
        raise ConfigError(
            f"example_inputs must be (x,), the one tensor the chain takes, got {type(example_inputs).__name__}"
        )
    return inputs[0]


@contextlib.contextmanager
def _step_isolated(model: nn.Module, device: torch.device):
    """Run profiling steps without leaving a trace: gradients put back, BatchNorm
    statistics untouched, the caller's RNG state restored. Gradients start allocated,
    as from the second training step on: each layer's new gradients are then
    transients accumulated into them, not gradient memory kept."""
    grads = [(p, p.grad) for p in model.parameters()]
    for p, _ in grads:
        p.grad = torch.zeros_like(p) if p.requires_grad else None
    accelerators = [device.index if device.index is not None else torch.cuda.current_device()] \
        if device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=accelerators), _batchnorm_statistics_untouched():
            yield
    finally:
        for p, grad in grads:
            p.grad = grad


def _updates_running_statistics(module: nn.Module) -> bool:
    """Whether ``module``'s forward updates running statistics: the buffers the
    planner models as mutated in forward (the runtime finds them by version,
    runtime/state.py TouchedState)."""
    return isinstance(module, _BatchNorm) and module.training and module.track_running_stats


@contextlib.contextmanager
def _batchnorm_statistics_untouched():
    """While active, every BatchNorm that runs in training mode updates scratch copies
    of its running statistics (allocated as a recompute's are, so the profiled step
    sees them), and the originals are put back on exit."""
    swapped = []

    def use_scratch_statistics(module, args):
        if _updates_running_statistics(module):
            buffers = own_tensors(module, "buffers")
            for name, original in list(buffers.items()):
                if original is not None:
                    swapped.append((buffers, name, original))
                    buffers[name] = original.clone()

    handle = register_module_forward_pre_hook(use_scratch_statistics)
    try:
        yield
    finally:
        handle.remove()
        # Reversed, so a module run twice gets its first original back.
        for buffers, name, original in reversed(swapped):
            buffers[name] = original


class _SaveLedger:
    """Follows the byte-counting step: attributes the tensors autograd saves to the
    layer running, one entry per storage; notes where each layer starts and last
    saves; counts the ReLU outputs a lossy checkpoint keeps bits for (the first save
    of each, as runtime/function.py's _Frame.pack decides)."""

    def __init__(self, device, ignored: list, tracker: LiveBytes):
        self.device = device
        self.tracker = tracker
        self.layer = 0
        self.layer_input = None
        self.inputs = []  # _Spec of each layer input
        self.live_before = []  # the tracker's count as each layer starts
        self.input_entries = []  # the entry of each layer input's storage, or None
        self.peak_at_last_save = {}  # layer -> the tracker's peak when it last saved
        self.relu_bits = {}  # layer -> [bytes, elements of the largest]
        self._ignored = {id(t.untyped_storage()) for t in ignored}
        self._entries = {}  # id(storage) -> [nbytes, first, last]; saved storages stay alive
        self._relu_saves = relu_signs.FirstSaves()

    def before_layer(self, i: int, h: torch.Tensor) -> None:
        self.layer, self.layer_input = i, h
        self.inputs.append(_Spec.of(h))
        self.live_before.append(self.tracker.live)

    def after_layer(self, i: int, h: torch.Tensor) -> None:
        # Looked up while the input is alive, so the storage id is its own; the entry
        # is read at the end, when later layers may have saved the storage too.
        self.input_entries.append(self.entry_of(self.layer_input))
        self.layer_input = None

    def pack(self, t: torch.Tensor):
        self.peak_at_last_save[self.layer] = self.tracker.peak
        storage = t.untyped_storage()
        if id(storage) not in self._ignored:
            entry = self._entries.setdefault(
                id(storage), [allocation_bytes(storage.nbytes(), self.device), self.layer, self.layer])
            entry[2] = self.layer
        if relu_signs.is_relu_output(t) and self._relu_saves.is_first(t):
            self._count_relu_output(t)
        return t.detach()  # detached: holding the output itself would be a reference cycle

    def _count_relu_output(self, t: torch.Tensor) -> None:
        bits = self.relu_bits.setdefault(self.layer, [0, 0])
        nbytes = allocation_bytes(-(-t.numel() // 8), self.device)
        bits[0] += nbytes
        bits[1] = max(bits[1], t.numel())  # restores run one ReLU at a time

    @staticmethod
    def unpack(t):
        return t

    def entry_of(self, t: torch.Tensor) -> Optional[list]:
        """The live entry of ``t``'s storage (its span may still grow), or None."""
        return self._entries.get(id(t.untyped_storage()))

    def storages(self) -> list:
        return [SavedStorage(*entry) for entry in self._entries.values()]


class _Structure:
    """What the byte-counting step found, per layer and for the chain output."""

    def __init__(self, ledger: _SaveLedger, forward_rise: list, backward_rise: list, output: torch.Tensor):
        n, device = len(forward_rise), ledger.device
        self.inputs = ledger.inputs
        self.forward_rise, self.backward_rise = forward_rise, backward_rise
        self.rise_to_last_save = [ledger.peak_at_last_save[i] - ledger.live_before[i]
                                  if i in ledger.peak_at_last_save else 0 for i in range(n)]
        self.saving_layers = set(ledger.peak_at_last_save)
        self.saved = ledger.storages()
        self.saved_bytes = [0] * n  # by the first layer saving each storage
        for storage in self.saved:
            self.saved_bytes[storage.first] += storage.nbytes
        self.input_saved_by = [_span(entry) for entry in ledger.input_entries]
        bits = [ledger.relu_bits.get(i, (0, 0)) for i in range(n)]
        self.relu_sign_bytes, self.relu_elements = (list(c) for c in zip(*bits))
        self.output_bytes = allocation_bytes(output.untyped_storage().nbytes(), device)
        self.output_saved_by = _span(ledger.entry_of(output))
        self.output_grad_bytes = allocation_bytes(output.numel() * output.element_size(), device)


def _span(entry: Optional[list]) -> Optional[tuple]:
    return None if entry is None else (entry[1], entry[2])


class _BackwardSpans:
    """Splits a backward into layers, at the first autograd node of each layer's
    output, and measures each stretch with ``meter`` (a context manager yielding a
    one-item list, as :meth:`LiveBytes.span`)."""

    def __init__(self, n: int, meter):
        self.values = [0] * n
        self._meter = meter
        self._open = None  # (layer, context, holder)
        self._handles = []

    def watch(self, layer: int, output: torch.Tensor, input_node) -> None:
        """Call right after ``layer`` ran. A layer that made no node of its own (an
        identity, or no gradient needed) gets no stretch."""
        node = output.grad_fn
        if node is not None and node is not input_node:
            self._handles.append(node.register_prehook(lambda grads, i=layer: self._begin(i)))

    def _begin(self, layer: int) -> None:
        self._close()
        context = self._meter()
        self._open = (layer, context, context.__enter__())

    def _close(self) -> None:
        if self._open is not None:
            layer, context, holder = self._open
            context.__exit__(None, None, None)
            self.values[layer] = holder[0]
            self._open = None

    def finish(self) -> list:
        self._close()
        for handle in self._handles:
            handle.remove()
        return self.values


def _run_step(layers: list, x: torch.Tensor, meter, before_layer=None, after_layer=None) -> tuple:
    """One training step through the chain, each layer's forward and backward measured
    by ``meter``; the backward starts from a full-size output gradient. Returns
    (forward values, backward values, output)."""
    spans = _BackwardSpans(len(layers), meter)
    forward = [0] * len(layers)
    h, node = x, x.grad_fn
    for i, (_, layer) in enumerate(layers):
        if before_layer is not None:
            before_layer(i, h)
        with meter() as value:
            h = _checked_output(layer(h), i)
        forward[i] = value[0]
        if after_layer is not None:
            after_layer(i, h)
        spans.watch(i, h, node)
        node = h.grad_fn
    if not h.requires_grad:
        raise ConfigError("the chain's output does not require grad: there is no backward to plan for")
    torch.autograd.backward(h, torch.ones_like(h))
    return forward, spans.finish(), h


def _checked_output(output, index: int) -> torch.Tensor:
    if not isinstance(output, torch.Tensor):
        raise ConfigError(
            f"layer {index} returned a {type(output).__name__}; the planner needs a chain "
            "whose layers pass one tensor each"
        )
    return output


def _measure_memory(layers: list, x: torch.Tensor, model: nn.Module, device: torch.device) -> _Structure:
    """The byte-counting step, with allocations as on ``device``."""
    if any(plans_at_first_call(layer) for _, layer in layers):
        with fast_meta(), torch.enable_grad():
            _run_forward(layers, x)  # nested plans, made now, not in the measured step
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    known = [*model.parameters(), *model.buffers(), *grads, x]
    tracker = LiveBytes(device, known=known)
    ledger = _SaveLedger(device, ignored=known, tracker=tracker)
    with tracker, saved_tensors_hooks(ledger.pack, ledger.unpack):
        forward_rise, backward_rise, output = _run_step(layers, x, tracker.span, ledger.before_layer,
                                                        ledger.after_layer)
    return _Structure(ledger, forward_rise, backward_rise, output)


def _run_forward(layers: list, x: torch.Tensor) -> None:
    for _, layer in layers:
        x = layer(x)


def _measure_times(layers: list, x: torch.Tensor) -> tuple:
    forward, backward, _ = _run_step(layers, x, lambda: _timer(x.device))
    return forward, backward


@contextlib.contextmanager
def _timer(device: torch.device):
    """Yields a one-item list that holds, on exit, the seconds the body took on
    ``device``."""
    _synchronize(device)
    start = time.perf_counter()
    elapsed = [0.0]
    try:
        yield elapsed
    finally:
        _synchronize(device)
        elapsed[0] = time.perf_counter() - start


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass(frozen=True)
class _Spec:
    """What the planner needs of a layer input: enough to make another like it."""

    shape: tuple
    dtype: torch.dtype
    storage_bytes: int
    requires_grad: bool
    encodable: bool  # whether actsave would encode or offload it: store.should_encode

    @classmethod
    def of(cls, t: torch.Tensor) -> "_Spec":
        return cls(tuple(t.shape), t.dtype, t.untyped_storage().nbytes(), t.requires_grad, should_encode(t))

    @property
    def dense_bytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


class _KeepCost(NamedTuple):
    """Keeping one input by one codec: bytes kept, rises of live bytes, seconds."""

    kept: int
    encode_rise: int
    decode_rise: int
    encode_s: float
    decode_s: float
    to_host_s: float
    to_device_s: float


class _CodecCosts:
    """Bytes and seconds of keeping an input of a given shape by each codec, measured
    once per distinct (shape, dtype): encode, decode, and on CUDA the copies to a
    pinned host buffer and back. Medians of a few repeats. Tensors are made on
    ``tensors`` (meta: sizes only, no seconds); bytes are counted as on ``device``."""

    _REPEATS = 3

    def __init__(self, tensors: torch.device, device: torch.device):
        self.tensors = tensors
        self.device = device
        self.timed = tensors.type != "meta"
        self._by_shape = {}
        self._restore_rises = {}

    def of(self, spec: _Spec) -> dict:
        """{codec: _KeepCost}; a leaf or non-float input is kept as it is by every codec."""
        if not spec.encodable:
            kept = allocation_bytes(spec.storage_bytes, self.device)
            return {codec: _KeepCost(kept, 0, 0, 0.0, 0.0, 0.0, 0.0) for codec in ("none", *LOSSY_CODECS)}
        key = (spec.shape, spec.dtype)
        if key not in self._by_shape:
            self._by_shape[key] = {codec: self._measure(codec, spec) for codec in ("none", *LOSSY_CODECS)}
        return self._by_shape[key]

    def _measure(self, codec_name: str, spec: _Spec) -> _KeepCost:
        sample = torch.randn(spec.shape, device=self.tensors).to(spec.dtype)
        codec = get_codec(codec_name)
        tracker = LiveBytes(self.device, known=[sample])
        with tracker:
            with tracker.span() as encode_rise:
                packed = codec.encode(sample)
            with tracker.span() as decode_rise:
                codec.decode(packed)
        # The exact codec keeps the input's own storage, which may be larger than a sample.
        kept = allocation_bytes(spec.storage_bytes, self.device) if codec_name == "none" else sum(
            allocation_bytes(t.untyped_storage().nbytes(), self.device) for t in (packed.data, packed.scales)
            if t is not None)
        encode_s = self._seconds(lambda: codec.encode(sample))
        decode_s = self._seconds(lambda: codec.decode(packed))
        return _KeepCost(kept, encode_rise[0], decode_rise[0], encode_s, decode_s, *self._copy_seconds(packed))

    def _seconds(self, work) -> float:
        if not self.timed:
            return 0.0
        runs = []
        for _ in range(self._REPEATS):
            with _timer(self.device) as elapsed:
                work()
            runs.append(elapsed[0])
        return statistics.median(runs)

    def _copy_seconds(self, packed) -> tuple:
        if self.device.type != "cuda" or not self.timed:
            return 0.0, 0.0
        parts = [t for t in (packed.data, packed.scales) if t is not None]
        hosts = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in parts]
        to_host = self._seconds(lambda: [h.copy_(t, non_blocking=True) for h, t in zip(hosts, parts)])
        to_device = self._seconds(lambda: [h.to(self.device, non_blocking=True) for h in hosts])
        return to_host, to_device

    def relu_restore_rise(self, elements: int) -> int:
        """The rise of live bytes while a lossy recompute re-imposes the forward's
        decisions on a ReLU output of ``elements`` elements (runtime/relu_signs.py)."""
        if elements == 0:
            return 0
        if elements not in self._restore_rises:
            output = torch.relu(torch.randn(elements, device=self.tensors))
            bits = relu_signs.pack_signs(output)
            tracker = LiveBytes(self.device, known=[output, bits])
            with tracker, tracker.span() as rise:
                relu_signs.restore_decisions_(output, bits)
            self._restore_rises[elements] = rise[0]
        return self._restore_rises[elements]


def _layer_profile(i: int, name: str, layer: nn.Module, found: _Structure, times: tuple,
                   costs: _CodecCosts) -> LayerProfile:
    spec, device = found.inputs[i], costs.device
    keep_costs = costs.of(spec)

    def by_codec(field: str) -> dict:
        return {codec: getattr(cost, field) for codec, cost in keep_costs.items()}

    next_spec = found.inputs[i + 1] if i + 1 < len(found.inputs) else None
    host_copies = device.type == "cuda"
    return LayerProfile(
        name=name,
        kind=type(layer).__name__,
        input_bytes=allocation_bytes(spec.storage_bytes, device),
        dense_input_bytes=allocation_bytes(spec.dense_bytes, device),
        input_grad_bytes=allocation_bytes(spec.dense_bytes, device) if spec.requires_grad else 0,
        output_bytes=allocation_bytes(next_spec.storage_bytes, device) if next_spec else found.output_bytes,
        saved_bytes=found.saved_bytes[i],
        input_saved_by=found.input_saved_by[i],
        forward_rise=found.forward_rise[i],
        forward_rise_to_last_save=found.rise_to_last_save[i],
        backward_rise=found.backward_rise[i],
        saves_for_backward=i in found.saving_layers,
        relu_sign_bytes=found.relu_sign_bytes[i],
        relu_restore_bytes=costs.relu_restore_rise(found.relu_elements[i]),
        modifies_input=modifies_input(layer),
        recompute_scratch_bytes=_scratch_statistics_bytes(layer, device),
        input_encodable=spec.encodable,
        kept_bytes=by_codec("kept"),
        encode_rise=by_codec("encode_rise"),
        decode_rise=by_codec("decode_rise"),
        forward_s=times[0][i],
        backward_s=times[1][i],
        encode_s=by_codec("encode_s"),
        decode_s=by_codec("decode_s"),
        to_host_s=by_codec("to_host_s") if host_copies else {},
        to_device_s=by_codec("to_device_s") if host_copies else {},
    )


def _scratch_statistics_bytes(layer: nn.Module, device) -> int:
    """The buffers a recompute of the layer copies (runtime/state.py, TouchedState): those its
    forward mutates, modelled as the running statistics of its BatchNorms."""
    return sum(allocation_bytes(b.numel() * b.element_size(), device) for m in layer.modules()
               if _updates_running_statistics(m)
               for b in m.buffers(recurse=False))


def profile(model: nn.Module, example_inputs, device=None) -> Profile:
    """Measure one training step of the chain ``model`` on its device, layer by layer.

    ``model`` is an ``nn.Sequential`` (a :class:`~actsave.CheckpointedSequential` is
    profiled as the plain chain); ``example_inputs`` is ``(x,)`` (or ``x``), the batch
    the plan is for. A forward warms up; then a step counts bytes (every storage
    allocated and every tensor saved for backward, by layer) and a step is timed.
    Then each distinct layer-input shape is encoded and decoded by each codec, and on
    CUDA copied to pinned host memory and back. The model's parameter gradients and
    BatchNorm statistics and the caller's RNG state are left as they were.

    Sizes only, at any scale: give ``x`` on the meta device (``torch.empty(128, 3, 32,
    32, device="meta")``) and the ``device`` it stands for (default ``"cpu"``; ``"cuda"``
    counts CUDA's 512-byte blocks and makes offload a lever). The step then runs on meta
    tensors, the model's parameters and buffers swapped for meta copies (it is left as
    it was): no data, no device memory, no times, so plan it with
    ``objective="memory"``. ``segments="balanced"`` measures a chain so.
    """
    layers = _chain_layers(model)
    x = _without_history(_single_input(example_inputs))
    device = _profiled_device(x, device)
    sizes_only = x.device.type == "meta"
    with contextlib.ExitStack() as stack:
        # The profiled steps are the profile's own: saved-tensor hooks around it (an
        # outer checkpoint whose forward is running) must not see their saves.
        stack.enter_context(saved_tensors_hooks(_detached, _as_is))
        if sizes_only:
            stack.enter_context(on_meta(model))
            stack.enter_context(simulating(device))
        stack.enter_context(_step_isolated(model, x.device))
        found = _measure_memory(layers, x, model, device)
        times = ([0.0] * len(layers),) * 2 if sizes_only else _measure_times(layers, x)
        costs = _CodecCosts(x.device, device)
        return Profile(
            layers=tuple(_layer_profile(i, name, layer, found, times, costs)
                         for i, (name, layer) in enumerate(layers)),
            saved=tuple(found.saved),
            input_bytes=allocation_bytes(x.untyped_storage().nbytes(), device),
            output_bytes=found.output_bytes,
            output_saved_by=found.output_saved_by,
            output_grad_bytes=found.output_grad_bytes,
            device=str(device),
            timed=not sizes_only,
        )


def _without_history(x: torch.Tensor) -> torch.Tensor:
    """``x`` cut from the graph that made it (each profiled step backpropagates into its
    input), still a non-leaf when it was one: actsave encodes such inputs, not leaves."""
    if x.is_leaf:
        return x
    return x.detach().requires_grad_(x.requires_grad).clone()


def _detached(t: torch.Tensor) -> torch.Tensor:
    return t.detach()  # not ``t`` itself: a saved output holding its own node is a cycle


def _as_is(t: torch.Tensor) -> torch.Tensor:
    return t


def _profiled_device(x: torch.Tensor, device) -> torch.device:
    """The device a profile's bytes are for: ``x``'s own, or for a meta ``x`` the one
    it stands for."""
    try:
        asked = None if device is None else torch.device(device)
    except (RuntimeError, TypeError) as error:
        raise ConfigError(f"device={device!r} is not a torch device ('cuda', 'cpu')") from error
    if x.device.type != "meta":
        if asked is not None and asked != x.device:
            raise ConfigError(f"device={device!r} is for meta inputs (the device they stand for); this "
                              f"input is on {x.device}, which is where the profile measures")
        return x.device
    return torch.device("cpu") if asked is None else asked


# -------------------------------------------------------------------------- the plan


@dataclass(frozen=True)
class Plan:
    """Where segments start and how each checkpointed segment keeps its input, with
    the model's predictions. Apply it with ``CheckpointedSequential.apply_plan``.

    ``starts[j]`` is the first layer of segment j (``starts[0] == 0``); the last
    segment is stored, the others checkpointed, segment j keeping its input by
    ``codecs[j]`` ("none" = exact) in host memory if ``offload[j]``.
    ``predicted_peak_bytes`` is peak activation memory (see the module docstring);
    ``peak_segment`` is the segment whose events set it.
    """

    n_layers: int
    starts: tuple
    codecs: tuple
    offload: tuple
    predicted_peak_bytes: int
    predicted_step_seconds: float
    peak_segment: int
    budget: Optional[int] = None

    def __post_init__(self):
        n_layers = integral(self.n_layers)
        if n_layers is None or n_layers < 1:
            raise ConfigError(f"plan n_layers={self.n_layers!r} must be a positive integer")
        try:
            starts = [integral(start) for start in self.starts]
        except TypeError:  # not iterable
            starts = [None]
        if None in starts:
            raise ConfigError(f"plan starts={self.starts!r} must be a sequence of layer indices (integers)")
        increasing = all(a < b for a, b in zip(starts, starts[1:]))
        if not starts or starts[0] != 0 or not increasing or starts[-1] >= n_layers:
            raise ConfigError(
                f"plan starts={self.starts!r} must increase from 0 and stay below {self.n_layers}")
        checkpointed = len(starts) - 1
        if not isinstance(self.codecs, (tuple, list)) or not isinstance(self.offload, (tuple, list)):
            raise ConfigError(f"plan codecs={self.codecs!r} and offload={self.offload!r} must be tuples, one "
                              "item per checkpointed segment")
        if len(self.codecs) != checkpointed or len(self.offload) != checkpointed:
            raise ConfigError(
                f"a plan with {len(starts)} segments needs {checkpointed} codecs and offload flags "
                f"(one per checkpointed segment), got {len(self.codecs)} and {len(self.offload)}"
            )
        for codec in self.codecs:
            get_codec(codec)
        if not all(isinstance(flag, bool) for flag in self.offload):
            raise ConfigError(f"plan offload={self.offload!r} must hold True or False for each checkpointed segment")

    @property
    def segments(self) -> list:
        """[(start, stop, KeepPolicy or None for the stored segment)]"""
        stops = [*self.starts[1:], self.n_layers]
        options = [KeepPolicy.resolve(c, f) for c, f in zip(self.codecs, self.offload)] + [None]
        return list(zip(self.starts, stops, options))

    def __str__(self) -> str:
        budget = "none" if self.budget is None else f"{_mib(self.budget)} MiB"
        lines = [f"plan for {self.n_layers} layers: {len(self.starts)} segments; predicted peak activation "
                 f"memory {_mib(self.predicted_peak_bytes)} MiB (budget {budget}), step "
                 f"{_ms(self.predicted_step_seconds)} ms"]
        rows = [["segment", "layers", "input kept", "where", ""]]
        for j, (start, stop, option) in enumerate(self.segments):
            kept = "stored (no recompute)" if option is None else option.codec.name
            where = "" if option is None else ("host" if option.offload else "device")
            marker = "<- peak" if j == self.peak_segment else ""
            rows.append([str(j), f"{start}-{stop - 1}", kept, where, marker])
        return "\n".join(lines) + "\n" + format_table(rows)


def plan(profile: Profile, budget: Optional[int], min_sqnr_db: Optional[float] = None,
         allow: Sequence[str] = DEFAULT_ALLOW, objective: str = "time") -> Plan:
    """Choose segments and keep options for the profiled chain.

    Args:
        profile: from :func:`profile`.
        budget: peak activation memory in bytes (module docstring, "Budget").
        min_sqnr_db: codecs whose expected gradient SQNR
            (:data:`EXPECTED_GRADIENT_SQNR_DB`) is below it are not used.
        allow: the levers: "recompute" (checkpoint segments; the others need it),
            "int8", "fp8" (e4m3; "fp8_e4m3", "fp8_e5m2" name one) and "offload"
            (used on CUDA only: on a CPU model host memory is device memory).
        objective: "time": the fastest plan whose predicted peak fits ``budget``;
            "memory": the smallest predicted peak (the fastest such plan), checked
            against ``budget`` unless it is None.

    Raises :class:`~actsave.ConfigError` when no plan fits, stating the smallest
    feasible budget.

    .. warning::
        Predictions are for the profiled step: another batch shape, dtype or device
        needs another profile. The model does not predict allocator fragmentation,
        and on CUDA kernels that save other tensors than the CPU/meta ones (flash
        attention, cuDNN workspaces) shift the peak; keep a margin in ``budget``.
    """
    _check_plan_arguments(profile, budget, objective)
    model = _CostModel(profile, keep_options(allow, min_sqnr_db, profile.device))
    if objective == "time":
        segments = _fastest_within(model, budget - model.chain_input)
    else:
        smallest = _smallest_headroom(model)
        fits = budget is None or model.chain_input + smallest <= budget
        segments = _fastest_within(model, smallest) if fits else None
    if segments is None:
        levers = f"allow={tuple(allow)}" + ("" if min_sqnr_db is None else f" and min_sqnr_db={min_sqnr_db}")
        smallest_budget = model.chain_input + _smallest_headroom(model)
        raise ConfigError(
            f"no plan fits budget={int(budget):,} bytes ({_mib(budget)} MiB) with {levers}: the smallest "
            f"feasible budget is {int(smallest_budget):,} bytes ({_mib(smallest_budget)} MiB). Raise the "
            "budget, allow more levers, or use a smaller batch."
        )
    return _plan_of(profile, model, segments, budget)


def balanced(profile: Profile, options: Sequence[KeepPolicy]) -> Plan:
    """The plan of ``CheckpointedSequential(segments="balanced")``: where segments
    start when a segment starting at layer i keeps its input as ``options[i]`` says
    (a leaf or non-float input is kept by reference whatever it says, as runtime/store.py
    does). The smallest predicted peak over single-level plans (each layer recomputed
    at most once), so a codec or offload that makes kept inputs cheaper buys more,
    shorter segments; among the plans with that peak, the fastest, which on a profile
    without times (meta tensors) is the one that recomputes the fewest layers."""
    if not isinstance(profile, Profile):
        raise ConfigError(f"balanced expects a Profile from actsave.profile, got {type(profile).__name__}")
    if len(options) != len(profile.layers) or not all(isinstance(o, KeepPolicy) for o in options):
        raise ConfigError(f"balanced needs one KeepPolicy per layer ({len(profile.layers)}), got {options!r}")
    model = _CostModel(profile, [], fixed=options)
    segments = _fastest_within(model, _smallest_headroom(model))
    return _plan_of(profile, model, segments, budget=None)


def _plan_of(profile: Profile, model: "_CostModel", segments: list, budget: Optional[int]) -> Plan:
    """The Plan of a dynamic program's [(start, stop, option index)], with predictions."""
    checkpointed = [model.options[o] for _, _, o in segments[:-1]]
    return predict(profile, [start for start, _, _ in segments], [option.codec.name for option in checkpointed],
                   [option.offload for option in checkpointed], budget)


def keep_options(allow: Sequence[str], min_sqnr_db: Optional[float], device: str) -> list:
    """The KeepPolicys ``allow`` and ``min_sqnr_db`` permit on ``device`` (empty:
    nothing may be checkpointed)."""
    if min_sqnr_db is not None and not real_number(min_sqnr_db):
        raise ConfigError(f"min_sqnr_db={min_sqnr_db!r} must be a number of dB or None")
    if isinstance(allow, str) or not isinstance(allow, Iterable) or not all(isinstance(lever, str) for lever in allow):
        raise ConfigError(f"allow={allow!r} must be a tuple of lever names, some of {list(LEVERS)}")
    unknown = [lever for lever in allow if lever not in LEVERS]
    if unknown:
        raise ConfigError(f"allow names unknown levers {unknown}; use some of {list(LEVERS)}")
    if "recompute" not in allow:
        if allow:
            raise ConfigError(
                f"allow={tuple(allow)!r}: codecs and offload act on the inputs of checkpointed "
                "segments, so they need 'recompute' in allow too"
            )
        return []
    codecs = ["none"] + sorted({_LEVER_CODECS[lever] for lever in allow if lever in _LEVER_CODECS})
    codecs = [c for c in codecs if min_sqnr_db is None or EXPECTED_GRADIENT_SQNR_DB[c] >= min_sqnr_db]
    places = [False, True] if "offload" in allow and _host_is_separate(device) else [False]
    return [KeepPolicy.resolve(codec, offload) for codec in codecs for offload in places]


def _host_is_separate(device) -> bool:
    """Whether offload moves bytes off ``device``: not on the CPU, whose memory the
    host pool shares."""
    return torch.device(device).type == "cuda"


def _effective_option(option: KeepPolicy, layer: LayerProfile, device: str) -> KeepPolicy:
    """What a segment starting at ``layer`` keeps its input by, asked for ``option``:
    runtime/store.py keeps a leaf or non-float input by reference, on the device, whatever the
    option; without separate host memory an offloaded input still takes its bytes."""
    if not layer.input_encodable:
        return EXACT
    return option if _host_is_separate(device) else KeepPolicy(option.codec)


def _check_plan_arguments(profile, budget, objective) -> None:
    if not isinstance(profile, Profile):
        raise ConfigError(f"profile={profile!r}: plan expects a Profile from actsave.profile(model, "
                          f"example_inputs), got {type(profile).__name__}")
    if objective not in OBJECTIVES:
        raise ConfigError(f"objective={objective!r} must be one of {list(OBJECTIVES)}")
    if objective == "time" and not profile.timed:
        raise ConfigError("this profile was measured on meta tensors and has no times, so it has no fastest "
                          "plan; plan it with objective='memory', or profile on the device for times")
    if budget is None:
        if objective == "time":
            raise ConfigError("budget (peak activation bytes) is required for the fastest plan; pass "
                              "objective='memory' for the smallest peak without a budget")
        return
    if not real_number(budget) or not budget > 0:
        raise ConfigError(f"budget={budget!r} must be a positive number of bytes (peak activation memory)")


class _CostModel:
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
            fixed = [_effective_option(option, layer, prof.device) for option, layer in zip(fixed, layers)]
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
        self.kept_input[o, a] = _kept_input(a, layer, option)
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


def _kept_input(a: int, layer: LayerProfile, option: KeepPolicy) -> int:
    """K: the input as the option keeps it, wherever that is. The exact codec keeps a
    private copy for an in-place first layer (runtime/store.py), else the input itself,
    nothing extra for the chain input (in X)."""
    if option.lossy:
        return layer.kept_bytes[option.codec.name]
    if layer.modifies_input:
        return layer.dense_input_bytes
    return 0 if a == 0 else layer.input_bytes


def _saved_table(saved: tuple, n: int) -> np.ndarray:
    """table[a, i] = Saved(a, i): bytes of storages whose saving layers meet [a, i]
    (first <= i and last >= a), by two cumulative sums over (first, last)."""
    by_span = np.zeros((n, n))
    if saved:
        np.add.at(by_span, ([s.first for s in saved], [s.last for s in saved]), [s.nbytes for s in saved])
    first_at_most = by_span.cumsum(axis=0)  # [i, last]: first <= i
    last_at_least = first_at_most[:, ::-1].cumsum(axis=1)[:, ::-1]  # [i, a]: first <= i, last >= a
    return np.ascontiguousarray(last_at_least.T)


# ------------------------------------------------------------------ dynamic programs


def _smallest_headroom(model: _CostModel) -> float:
    """min over plans of H (the peak less X), over every carry."""
    return float(_smallest_headrooms(model)[1].min())


def _smallest_headrooms(model: _CostModel) -> tuple:
    """(carries, h(0) for each): the docstring's right-to-left recurrence h(a) =
    min(W_stored(a), min_{b,o} max(W(a,b,o) + C, R(a,b,o) + h(b))), for every
    candidate C at once (the columns of h). Computed once per model."""
    if not hasattr(model, "_headrooms"):
        n, carries = model.n, model.carries()
        h = np.repeat(model.stored_peaks[:, None], len(carries), axis=1)
        for a in reversed(range(n - 1)):
            b = np.arange(a + 1, n)
            for o in np.nonzero(model.allowed[:, a])[0]:
                through = np.maximum(model.working_set(o, a, b, carries), model.kept(o, a, b)[:, None] + h[b])
                h[a] = np.minimum(h[a], through.min(axis=0))
        model._headrooms = carries, h[0]
    return model._headrooms


def _fastest_within(model: _CostModel, headroom: float) -> Optional[list]:
    """The fastest plan with H <= headroom over every carry, as [(start, stop, option
    index or -1 for the stored segment)], or None. Carries whose smallest H is above
    ``headroom`` have no such plan and are skipped."""
    best = None
    carries, smallest = _smallest_headrooms(model)
    for carry in carries[smallest <= headroom]:
        found = _Prefixes(model, headroom, float(carry)).fastest()
        if found is not None and (best is None or found[0] < best[0]):
            best = found
    return None if best is None else best[1]


class _Labels:
    """A growable table of prefix plans: kept bytes P, time T, and how each was made."""

    _COLUMNS = {"p": np.float64, "t": np.float64, "position": np.int64, "option": np.int64,
                "previous": np.int64}

    def __init__(self, capacity: int = 1024):
        self.size = 0
        self._data = {name: np.empty(capacity, dtype) for name, dtype in self._COLUMNS.items()}

    def append(self, **columns) -> None:
        count = len(columns["p"])
        if self.size + count > len(self._data["p"]):
            grown = max(2 * len(self._data["p"]), self.size + count)
            for name, old in self._data.items():
                self._data[name] = np.resize(old, grown)
        for name, values in columns.items():
            self._data[name][self.size:self.size + count] = values
        self.size += count

    def __getitem__(self, name: str) -> np.ndarray:
        return self._data[name][:self.size]


class _Prefixes:
    """The time-optimal dynamic program, left to right over prefix plans (the layers
    before b, all in checkpointed segments): at each b the Pareto frontier of (P, T),
    P = kept bytes, T = time so far. All prefixes ending at b recompute the same
    layers, so T differs only by codec and copy costs and frontiers stay small.

    Each label at b extends a label at a < b by the segment [a, b) with option o,
    allowed when P + W(a,b,o) + C <= headroom; a plan ends with the stored segment
    at s when P + W_stored(s) <= headroom: L(b) and "best" of the module docstring."""

    def __init__(self, model: _CostModel, headroom: float, carry: float):
        self.model, self.headroom, self.carry = model, headroom, carry
        self.labels = _Labels()
        self.labels.append(p=np.zeros(1), t=np.zeros(1), position=np.zeros(1, dtype=np.int64),
                           option=np.full(1, -1), previous=np.full(1, -1))
        self.best = (math.inf, -1)  # (time, label whose plan ends with the stored segment)

    def fastest(self) -> Optional[tuple]:
        """(extra seconds, segments) of the fastest plan, or None when none fits."""
        self._finish_at(0, np.arange(1))
        for b in range(1, self.model.n):
            self._finish_at(b, self._extend_to(b))
        if self.best[1] < 0:
            return None
        return self.best[0], self._segments_from(self.best[1])

    def _extend_to(self, b: int) -> np.ndarray:
        """Add the frontier at b; return its label indices."""
        labels = self.labels
        # W >= the backward events + C whatever the option: a cheap test drops most labels.
        source = np.nonzero(labels["p"] + self.model.backward[labels["position"], b] + self.carry
                            <= self.headroom)[0]
        p, t, a = labels["p"][source], labels["t"][source], labels["position"][source]
        parts = []
        for o in range(len(self.model.options)):
            ok = p + self.model.working_set(o, a, b, np.array([self.carry]))[:, 0] <= self.headroom
            if ok.any():
                parts.append((p[ok] + self.model.kept(o, a[ok], b), t[ok] + self.model.seconds(o, a[ok], b),
                              np.full(int(ok.sum()), o), source[ok]))
        if not parts:
            return np.empty(0, dtype=np.int64)
        new_p, new_t, option, previous = (np.concatenate(columns) for columns in zip(*parts))
        keep = _pareto(new_p, new_t)
        first = labels.size
        labels.append(p=new_p[keep], t=new_t[keep], position=np.full(keep.size, b), option=option[keep],
                      previous=previous[keep])
        return np.arange(first, labels.size)

    def _finish_at(self, s: int, at: np.ndarray) -> None:
        """End the plans of labels ``at`` (position s) with the stored segment [s, n)."""
        fits = at[self.labels["p"][at] + self.model.stored_peaks[s] <= self.headroom]
        if fits.size:
            best = fits[np.argmin(self.labels["t"][fits])]
            if self.labels["t"][best] < self.best[0]:
                self.best = (float(self.labels["t"][best]), int(best))

    def _segments_from(self, label: int) -> list:
        """[(start, stop, option)] of a finished plan, the stored segment last."""
        labels = self.labels
        stops = [(int(labels["position"][label]), self.model.n, -1)]
        while labels["previous"][label] >= 0:
            previous = int(labels["previous"][label])
            stops.append((int(labels["position"][previous]), int(labels["position"][label]),
                          int(labels["option"][label])))
            label = previous
        return stops[::-1]


def _pareto(p: np.ndarray, t: np.ndarray) -> np.ndarray:
    """Indices of the pairs that no other pair beats in both P and T."""
    order = np.lexsort((t, p))
    best_before = np.minimum.accumulate(np.concatenate(([np.inf], t[order][:-1])))
    return order[t[order] < best_before]


# ------------------------------------------------------------- predicting one plan


def predict(profile: Profile, starts: Sequence[int], codecs: Optional[Sequence[str]] = None,
            offload: Optional[Sequence[bool]] = None, budget: Optional[int] = None) -> Plan:
    """The :class:`Plan` for given segment starts (and per checkpointed segment codec
    and offload; default exact, on the device), with the model's predictions: to
    compare any segmentation, "sqrt"'s say, with a planned one. Written apart from the
    dynamic program, event by event, so each checks the other."""
    starts = list(starts)
    checkpointed = len(starts) - 1
    codecs = ["none"] * checkpointed if codecs is None else [get_codec(c).name for c in codecs]
    offload = [False] * checkpointed if offload is None else list(offload)
    draft = Plan(len(profile.layers), tuple(starts), tuple(codecs), tuple(offload), 0, 0.0, 0, budget)
    peak, seconds, peak_segment = _predicted(profile, draft.segments)
    return dataclasses.replace(draft, predicted_peak_bytes=int(peak), predicted_step_seconds=seconds,
                               peak_segment=peak_segment)


def _predicted(profile: Profile, segments: list) -> tuple:
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
    return _kept_input(a, layers[a], option) + signs


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


# ------------------------------------------------------------------------ printing


def _mib(nbytes) -> str:
    return f"{nbytes / MiB:.2f}"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f}"


__all__ = ["profile", "plan", "balanced", "predict", "keep_options", "Profile", "LayerProfile", "SavedStorage", "Plan",
           "EXPECTED_GRADIENT_SQNR_DB", "DEFAULT_ALLOW", "LEVERS"]
