"""Profile a chain: one measured training step, layer by layer, the input to the planner.

    prof = actsave.profile(model, (x,))            # one measured training step
    print(prof)                                    # per-layer bytes and times

:func:`profile` runs a warm-up forward, then a step that counts bytes (every storage
allocated and every tensor saved for backward, attributed to the layer running) and a
step that is timed; then each distinct layer-input shape is encoded and decoded by each
codec, and on CUDA copied to pinned host memory and back. The numbers are what the
memory and time model (memory_model.py) is built from; their meaning, term by term, is
stated there. Sizes alone, at any scale and without the device, come from a profile on
meta tensors (a meta ``x``).
"""
from __future__ import annotations

import contextlib
import math
import statistics
import time
from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.module import register_module_forward_pre_hook

from .._torch import current_autograd_node, own_tensors
from ..codecs import LOSSY_CODECS, get_codec
from ..errors import ConfigError
from ..meta import fast_meta, on_meta, plans_at_first_call, simulating
from ..runtime import relu_signs
from ..runtime.pool_decisions import PoolWatch, Window, pool_at_
from ..runtime.compressed_saves import stored_once_key
from ..runtime.store import EXACT, CallerTensors, KeepPolicy, modifies_input, should_encode
from ..text import format_table, mib, ms
from .live_bytes import LiveBytes, allocation_bytes


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
    no_grad_rise: int  # the forward's rise under no_grad (a nested pass's recomputed part)
    backward_rise: int
    saves_for_backward: bool  # any tensor, parameters included
    relu_sign_bytes: int  # kept by a lossy segment for this layer's ReLU outputs
    relu_restore_bytes: int
    pool_decision_bytes: int  # kept by a lossy segment for this layer's max pools (runtime/pool_decisions.py)
    pool_restore_bytes: int  # the larger of keeping them (forward) and restoring them (recompute)
    modifies_input: bool
    input_encodable: bool  # False: kept by reference whatever the codec (the caller's, not float: store.should_encode)
    kept_bytes: dict
    encode_rise: dict
    decode_rise: dict
    forward_s: float
    backward_s: float
    encode_s: dict
    decode_s: dict
    to_host_s: dict  # empty when the device has no separate host memory
    to_device_s: dict

    def kept_input_bytes(self, option: KeepPolicy, chain_input: bool) -> int:
        """K: what a checkpointed segment starting at this layer keeps of its input by
        ``option``, wherever that is. The exact codec keeps a private copy for an
        in-place first layer (runtime/store.py), else the input itself, nothing extra
        for the chain input (held by the caller)."""
        if option.lossy:
            return self.kept_bytes[option.codec.name]
        if self.modifies_input:
            return self.dense_input_bytes
        return 0 if chain_input else self.input_bytes


@dataclass(frozen=True)
class SavedStorage:
    """A storage saved for backward: its bytes and the first and last layer saving it."""

    nbytes: int
    first: int
    last: int


@dataclass(frozen=True)
class StoredTensor:
    """One tensor of the profiled step's saves as a stored segment whose saves a lossy
    codec keeps stores it (runtime/compressed_saves.py): a floating-point save autograd
    made (store.should_encode) by the codec, once per ``stored_once_key``, else held as
    it is, once per storage. A ReLU output keeps its decisions, one bit per element,
    where the segment made it: where its first save is in the segment (relu_signs.py,
    made_by_segment_relu; an earlier save means it is the segment's input)."""

    first: int  # the first and last layer saving it
    last: int
    kept_bytes: dict  # lossy codec -> bytes kept: the encoding and the ReLU bits, or the storage held as it is
    sign_bytes: int  # the ReLU bits among kept_bytes
    encode_s: dict  # lossy codec -> seconds encoding it once


@dataclass(frozen=True)
class StoredSaves:
    """A stored segment's saves kept by each lossy codec, derived from the profiled step
    (no step of its own): the tensors as stored, and per layer what encoding and decoding
    its saves adds. Byte and second values come from encoding and decoding a sample of
    each save's shape (as for layer inputs); the memory model's stored events read them
    (memory_model.py, "stored [s, n), saves kept by k")."""

    tensors: tuple  # of StoredTensor
    # Per layer, {codec: the layer's rise of live bytes while it encodes one of its saves,
    # beyond what stays}: the rise as the save was made in the profiled step, plus
    # the encoding's temporaries.
    encode_rise: tuple
    # Per layer, {codec: its backward's rise while one of its autograd nodes decodes its
    # saves}: the rise as the node started in the profiled step, plus the node's saves
    # decoded and one decoding's temporaries.
    decode_rise: tuple
    decoded_bytes: tuple  # per layer, the most bytes one of its nodes decodes (alive while it runs)
    decode_s: tuple  # per layer, {codec: seconds decoding its saves, once per save}
    input_held_by: tuple  # per layer, (first, last) layer holding its input's storage as a save as it is, or None
    output_held_by: Optional[tuple]  # the same for the chain output


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
    # The rise above the bytes live when the forward ends (the output included) until
    # the output's gradient arrives: the loss's forward and backward (profile's
    # ``loss``), or without one the output gradient of ones. 0: not measured.
    loss_rise: int = 0
    stored_saves: Optional[StoredSaves] = None  # None: not recorded; the stored segment's saves stay exact

    def table(self) -> str:
        """One row per layer: output and saved bytes, what a segment starting there
        keeps by each codec ("-": kept by reference), times, codec and copy costs."""
        head = ["layer", "name", "type", "out MiB", "saved MiB",
                *(f"kept {c} MiB" for c in ("none", *LOSSY_CODECS)), "fwd ms", "bwd ms",
                *(f"enc+dec {c} ms" for c in LOSSY_CODECS), "copy ms"]
        rows = [head] + [self._row(i, layer) for i, layer in enumerate(self.layers)]
        forward = sum(layer.forward_s for layer in self.layers)
        backward = sum(layer.backward_s for layer in self.layers)
        footer = (f"device {self.device}; input {mib(self.input_bytes)} MiB, output {mib(self.output_bytes)} "
                  f"MiB; step forward {ms(forward)} ms, backward {ms(backward)} ms")
        return format_table(rows) + "\n" + footer

    @staticmethod
    def _row(i: int, layer: "LayerProfile") -> list:
        lossy = [c if layer.input_encodable else None for c in LOSSY_CODECS]
        copy = layer.to_host_s.get("none", 0.0) + layer.to_device_s.get("none", 0.0)
        return [str(i), layer.name, layer.kind, mib(layer.output_bytes), mib(layer.saved_bytes),
                mib(layer.kept_input_bytes(EXACT, chain_input=i == 0)),
                *("-" if c is None else mib(layer.kept_bytes[c]) for c in lossy),
                ms(layer.forward_s), ms(layer.backward_s),
                *("-" if c is None else ms(layer.encode_s[c] + layer.decode_s[c]) for c in lossy),
                ms(copy) if layer.to_host_s else "-"]

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
def isolated_steps(model: nn.Module, device: torch.device):
    """While active, training steps of ``model`` (on ``device``) leave no trace: on
    exit each parameter's gradient is put back as it was, BatchNorm running statistics
    are untouched and the caller's RNG state (CPU, and ``device``'s on CUDA) is
    restored. Inside, every gradient starts allocated (zeros), as from the second
    training step on: each layer's new gradients are then transients accumulated into
    them, not gradient memory kept. :func:`profile` and the block planner
    (blocks.py) measure their steps inside it."""
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
    of each, as runtime/function.py's _Frame.pack decides) and the max pools it keeps
    decisions for (found by the same :class:`PoolWatch`, which runs with it)."""

    def __init__(self, device, ignored: list, tracker: LiveBytes, caller: CallerTensors):
        self.device = device
        self.tracker = tracker
        self.caller = caller  # the layers' inputs after the first are the chain's activations
        self.layer = 0
        self.layer_input = None
        self.inputs = []  # _Spec of each layer input
        self.inputs_saved_as_they_are = []  # whether a lossy codec storing saves would hold each as it is
        self.live_before = []  # the tracker's count as each layer starts
        self.input_entries = []  # the entry of each layer input's storage, or None
        self.peak_at_last_save = {}  # layer -> the tracker's peak when it last saved
        self.relu_bits = {}  # layer -> [bytes, elements of the largest]
        self.pool_decisions = {}  # layer -> [bytes, [_PoolSample of each pool]]
        self.pools = PoolWatch()
        self._ignored = {id(t.untyped_storage()) for t in ignored}
        self._entries = {}  # id(storage) -> [nbytes, first, last]; saved storages stay alive
        self._relu_saves = relu_signs.FirstSaves()
        self.as_stored = _SavesAsStored(self._ignored, tracker)

    def before_layer(self, i: int, h: torch.Tensor) -> None:
        self.layer, self.layer_input = i, h
        self.inputs.append(_Spec.of(h, self.caller if i > 0 else None))
        # runtime/compressed_saves.py asks of a save what it asks outside a chain.
        self.inputs_saved_as_they_are.append(not should_encode(h))
        self.live_before.append(self.tracker.live)

    def after_layer(self, i: int, h: torch.Tensor) -> None:
        # Looked up while the input is alive, so the storage id is its own; the entry
        # is read at the end, when later layers may have saved the storage too.
        self.input_entries.append(self.entry_of(self.layer_input))
        self.layer_input = None
        self.as_stored.watch_backward(i, h)

    def pack(self, t: torch.Tensor):
        self.peak_at_last_save[self.layer] = self.tracker.peak
        storage = t.untyped_storage()
        if id(storage) not in self._ignored:
            entry = self._entries.setdefault(
                id(storage), [allocation_bytes(storage.nbytes(), self.device), self.layer, self.layer])
            entry[2] = self.layer
        pool = self.pools.window_of(t)
        if pool is not None:
            pool = _PoolSample(*pool, tuple(t.shape))
            self._count_pool(t, pool)
        elif relu_signs.is_relu_output(t) and self._relu_saves.is_first(t):
            self._count_relu_output(t)
        # Detached: holding the output itself would be a reference cycle.
        rise = self.tracker.live - self.live_before[self.layer]
        return t.detach(), self.as_stored.pack(t, self.layer, rise, pool)

    def _count_relu_output(self, t: torch.Tensor) -> None:
        bits = self.relu_bits.setdefault(self.layer, [0, 0])
        nbytes = allocation_bytes(-(-t.numel() // 8), self.device)
        bits[0] += nbytes
        bits[1] = max(bits[1], t.numel())  # restores run one ReLU at a time

    def _count_pool(self, indices: torch.Tensor, pool: "_PoolSample") -> None:
        counted = self.pool_decisions.setdefault(self.layer, [0, []])
        counted[0] += allocation_bytes(pool.window.packed_bytes(indices.numel()), self.device)
        counted[1].append(pool)

    def unpack(self, saved):
        t, save = saved
        self.as_stored.unpack(save)
        return t

    def entry_of(self, t: torch.Tensor) -> Optional[list]:
        """The live entry of ``t``'s storage (its span may still grow), or None."""
        return self._entries.get(id(t.untyped_storage()))

    def storages(self) -> list:
        return [SavedStorage(*entry) for entry in self._entries.values()]


class _StoredEntry:
    """A tensor as a stored segment's codec would store it: what it is, whether the
    codec encodes it, whether it is a ReLU output, a max pool's indices (``pool``,
    stored as its window decisions: runtime/compressed_saves.py), the first and last
    layer saving it."""

    __slots__ = ("first", "last", "pool", "relu", "spec")

    def __init__(self, t: torch.Tensor, layer: int, pool: Optional["_PoolSample"] = None):
        self.spec, self.relu, self.pool = _Spec.of(t), relu_signs.is_relu_output(t), pool
        self.first = self.last = layer

    @property
    def coded(self) -> bool:
        """Whether a lossy codec stores it other than as it is (decoded in backward)."""
        return self.spec.encodable or self.pool is not None


class _SavesAsStored:
    """Follows the byte-counting step's saves as runtime/compressed_saves.py would store
    them under a lossy codec: one entry per stored tensor (:class:`StoredTensor`), each
    save's entry, layer and the layer's rise of live bytes as it was saved, and in
    backward the saves that each autograd node unpacks, which a codec decodes
    together, with the layer's backward rise as the node starts."""

    def __init__(self, ignored: set, tracker: LiveBytes):
        self.entries = {}  # key -> _StoredEntry, in the order first saved
        self.saves = []  # per save: (its entry's key, the saving layer, the layer's rise then)
        self.nodes = []  # per autograd node: ([save indices], the layer's backward rise as it starts)
        self._ignored, self._tracker = ignored, tracker
        self._node = None
        self._backward_base = {}  # layer -> live bytes as its backward starts
        self._handles = []

    def watch_backward(self, layer: int, output: torch.Tensor) -> None:
        """Call right after ``layer`` ran: its backward starts at its output's node."""
        if output.grad_fn is not None:
            self._handles.append(output.grad_fn.register_prehook(
                lambda grads, i=layer: self._backward_base.__setitem__(i, self._tracker.live)))

    def finish(self) -> None:
        for handle in self._handles:
            handle.remove()

    def pack(self, t: torch.Tensor, layer: int, rise: int, pool: Optional["_PoolSample"] = None) -> Optional[int]:
        """Note one save of ``t`` by ``layer``, the layer's live bytes having risen by
        ``rise``; returns its index (None: held elsewhere, as the batch). ``pool``: ``t``
        is that max pool's indices, stored anew at each save."""
        if pool is not None:
            key = ("pool indices", len(self.saves))
        elif should_encode(t):
            key = stored_once_key(t) or ("stored anew", len(self.saves))
        elif id(t.untyped_storage()) in self._ignored:
            return None
        else:
            key = ("as it is", id(t.untyped_storage()))
        entry = self.entries.get(key)
        if entry is None:
            entry = self.entries[key] = _StoredEntry(t, layer, pool)
        entry.last = layer
        self.saves.append((key, layer, rise))
        return len(self.saves) - 1

    def unpack(self, save: Optional[int]) -> None:
        if save is None:
            return
        node = current_autograd_node()
        if node is None or node is not self._node:
            layer = self.saves[save][1]  # a node's saves are its own layer's
            base = self._backward_base.get(layer)
            self.nodes.append(([], None if base is None else self._tracker.live - base))
            self._node = node
        self.nodes[-1][0].append(save)


class _Structure:
    """What the byte-counting step found, per layer and for the chain output."""

    def __init__(self, ledger: _SaveLedger, forward_rise: list, backward_rise: list, loss_rise: int,
                 output: torch.Tensor):
        n, device = len(forward_rise), ledger.device
        self.loss_rise = loss_rise
        self.inputs = ledger.inputs
        self.inputs_saved_as_they_are = ledger.inputs_saved_as_they_are
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
        pools = [ledger.pool_decisions.get(i, (0, [])) for i in range(n)]
        self.pool_decision_bytes, self.pools = (list(c) for c in zip(*pools))
        self.output_bytes = allocation_bytes(output.untyped_storage().nbytes(), device)
        self.output_saved_by = _span(ledger.entry_of(output))
        self.output_grad_bytes = allocation_bytes(output.numel() * output.element_size(), device)
        self.as_stored = ledger.as_stored
        self.output_encodable = should_encode(output)


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


def _run_step(layers: list, x: torch.Tensor, meter, before_layer=None, after_layer=None, loss=None) -> tuple:
    """One training step through the chain, each layer's forward and backward measured
    by ``meter``, and the loss: from the end of the forward until the output's gradient
    arrives. The backward starts from ``loss(output)`` (:func:`profile`), or without a
    loss from a full-size output gradient of ones. Returns (forward values, backward
    values, loss value, output)."""
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
    loss_span = _OpenSpan(meter)
    handle = h.register_hook(loss_span.close)  # runs before the last layer's backward
    try:
        if loss is None:
            torch.autograd.backward(h, torch.ones_like(h))
        else:
            _backward_from_loss(h, loss)
    finally:
        handle.remove()
        loss_span.close()
    return forward, spans.finish(), loss_span.value[0], h


def _backward_from_loss(output: torch.Tensor, loss) -> None:
    # The loss's saves are not the last layer's: the ledger (and any outer hooks) must
    # not see them.
    with saved_tensors_hooks(_detached, _as_is):
        value = loss(output)
    if not isinstance(value, torch.Tensor) or not value.requires_grad:
        got = "a tensor that needs no gradient" if isinstance(value, torch.Tensor) else type(value).__name__
        raise ConfigError(f"loss(output) returned {got}: loss must return a tensor computed from the chain's "
                          "output, the one the backward starts from")
    torch.autograd.backward(value, None if value.dim() == 0 else torch.ones_like(value))


class _OpenSpan:
    """``meter()`` entered now and left at the first :meth:`close`; ``value`` holds its
    one-item result."""

    def __init__(self, meter):
        self._context = meter()
        self.value = self._context.__enter__()
        self._open = True

    def close(self, *_) -> None:
        if self._open:
            self._open = False
            self._context.__exit__(None, None, None)


def _checked_output(output, index: int) -> torch.Tensor:
    if not isinstance(output, torch.Tensor):
        raise ConfigError(
            f"layer {index} returned a {type(output).__name__}; the planner needs a chain "
            "whose layers pass one tensor each"
        )
    return output


def _measure_memory(layers: list, x: torch.Tensor, model: nn.Module, device: torch.device, loss=None) -> _Structure:
    """The byte-counting step, with allocations as on ``device``."""
    if any(plans_at_first_call(layer) for _, layer in layers):
        with fast_meta(), torch.enable_grad():
            _run_forward(layers, x)  # nested plans, made now, not in the measured step
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    known = [*model.parameters(), *model.buffers(), *grads, x]
    tracker = LiveBytes(device, known=known)
    ledger = _SaveLedger(device, ignored=known, tracker=tracker, caller=CallerTensors(x, model))
    with tracker, saved_tensors_hooks(ledger.pack, ledger.unpack), ledger.pools.watching():
        try:
            forward_rise, backward_rise, loss_rise, output = _run_step(layers, x, tracker.span, ledger.before_layer,
                                                                       ledger.after_layer, loss)
        finally:
            ledger.as_stored.finish()
    return _Structure(ledger, forward_rise, backward_rise, loss_rise, output)


def _measure_no_grad_rises(layers: list, x: torch.Tensor, model: nn.Module, device: torch.device) -> list:
    """Each layer's rise of live bytes in a forward under no_grad, which frees what the
    layer would save as it goes (a nested pass runs its recomputed parts so), with
    allocations as on ``device``; on a copy of ``x``, which an in-place first layer
    changes."""
    h = x.detach().clone()
    tracker = LiveBytes(device, known=[*model.parameters(), *model.buffers(), h])
    rises = []
    with tracker, torch.no_grad():
        for i, (_, layer) in enumerate(layers):
            with tracker.span() as rise:
                h = _checked_output(layer(h), i)
            rises.append(rise[0])
    return rises


def _run_forward(layers: list, x: torch.Tensor) -> None:
    for _, layer in layers:
        x = layer(x)


def _measure_times(layers: list, x: torch.Tensor, loss=None) -> tuple:
    forward, backward, _, _ = _run_step(layers, x, lambda: _timer(x.device), loss=loss)
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
    def of(cls, t: torch.Tensor, made_by: Optional[CallerTensors] = None) -> "_Spec":
        """``made_by``: ``t`` is a layer input after the first, made by the chain."""
        return cls(tuple(t.shape), t.dtype, t.untyped_storage().nbytes(), t.requires_grad, should_encode(t, made_by))

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
        self._pool_restore_rises = {}
        self._sign_rises = {}

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
            allocation_bytes(t.untyped_storage().nbytes(), self.device) for t in packed.tensors().values())
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
        parts = list(packed.tensors().values())
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
            relu_signs.restore_decisions_(output, bits)  # the tables a restore keeps, made before measuring
            tracker = LiveBytes(self.device, known=[output, bits])
            with tracker, tracker.span() as rise:
                relu_signs.restore_decisions_(output, bits)
            self._restore_rises[elements] = rise[0]
        return self._restore_rises[elements]

    def pool_restore_rise(self, pools: list) -> int:
        """The largest rise of live bytes while a lossy forward keeps a max pool's
        decisions or its recompute pools at them (runtime/pool_decisions.py), over a
        layer's max pools (``_PoolSample`` s). The memory model charges it to the
        recompute, whose event holds all the forward's and more (memory_model.py):
        keeping takes more than restoring (an int64 temporary per window)."""
        return max((self._pool_restore_rise(pool) for pool in pools), default=0)

    def _pool_restore_rise(self, pool: "_PoolSample") -> int:
        if pool not in self._pool_restore_rises:
            window, dims = pool.window, len(pool.window.kernel)
            planes = math.prod(pool.indices_shape[:-dims])  # as channels of one unbatched input
            x = torch.randn(planes, *pool.input_size, device=self.tensors)
            max_pool = getattr(torch.nn.functional, f"max_pool{dims}d")
            pooled, indices = max_pool(x, window.kernel, window.stride, window.padding, window.dilation,
                                       window.ceil_mode, return_indices=True)
            # The tables the implementations keep (triton_kernels/decisions.py), made
            # before measuring: they outlive every call, and an earlier call may have made them.
            window.decode_into_(indices, window.encode(indices, pool.input_size), pool.input_size)
            tracker = LiveBytes(self.device, known=[x, pooled, indices])
            with tracker:
                with tracker.span() as encode_rise:
                    packed = window.encode(indices, pool.input_size)
                with tracker.span() as restore_rise:
                    window.decode_into_(indices, packed, pool.input_size)
                    pool_at_(pooled, x, indices, dims)
            self._pool_restore_rises[pool] = max(encode_rise[0], restore_rise[0])
        return self._pool_restore_rises[pool]

    def relu_sign_rise(self, elements: int) -> int:
        """The rise of live bytes while the decisions of a ReLU output of ``elements``
        elements are packed into bits (runtime/relu_signs.py), the bits included."""
        if elements not in self._sign_rises:
            output = torch.relu(torch.randn(elements, device=self.tensors))
            tracker = LiveBytes(self.device, known=[output])
            with tracker, tracker.span() as rise:
                relu_signs.pack_signs(output)
            self._sign_rises[elements] = rise[0]
        return self._sign_rises[elements]

    def sign_bytes(self, elements: int) -> int:
        """The bits a ReLU output of ``elements`` elements keeps its decisions in."""
        return allocation_bytes(-(-elements // 8), self.device)


class _PoolSample(NamedTuple):
    """A max pool call of the profiled step: enough to make one like it."""

    window: Window
    input_size: tuple
    indices_shape: tuple


def _stored_saves(found: _Structure, costs: _CodecCosts) -> StoredSaves:
    """What a stored segment's saves cost under each lossy codec, from the profiled
    step's record of them and each save shape's codec costs (no step of its own).

    Encoding runs as a save is made (at most once per stored tensor), one at a time: a
    save made when the layer's live bytes had risen by r in the profiled step is
    charged r plus its encoding's temporaries; the packed bytes are in Saved_k. In
    backward each autograd node decodes its saves as it starts, and they live until
    it ends: a node that started at a rise of d is charged d plus its decoded saves
    and one decoding's temporaries, and the whole layer's rise is charged the most one
    node decodes (memory_model.py). Both hold the profiled step's tensors as if the
    codec freed none, so they bound the codec's step from above. A ReLU output's
    decisions are counted as restored at every decode; a max pool's indices are kept
    as its window decisions, whatever the codec, and restored to int64 at decode."""
    recorded, n = found.as_stored, len(found.inputs)
    encode_rise, decode_rise = ([dict.fromkeys(LOSSY_CODECS, 0) for _ in range(n)] for _ in range(2))
    decode_s, decoded_bytes = [dict.fromkeys(LOSSY_CODECS, 0.0) for _ in range(n)], [0] * n
    for key, layer, rise in recorded.saves:
        entry = recorded.entries[key]
        if entry.coded:
            for codec in LOSSY_CODECS:
                encoding = rise + _encode_extra(entry, codec, costs)
                encode_rise[layer][codec] = max(encode_rise[layer][codec], encoding)
                decode_s[layer][codec] += 0.0 if entry.pool is not None else costs.of(entry.spec)[codec].decode_s
    for saves, started_at in recorded.nodes:
        layer = recorded.saves[saves[0]][1]
        entries = [recorded.entries[recorded.saves[save][0]] for save in saves]
        entries = [entry for entry in entries if entry.coded]
        dense = [allocation_bytes(entry.spec.dense_bytes, costs.device) for entry in entries]
        decoded_bytes[layer] = max(decoded_bytes[layer], sum(dense))
        # A node whose start was not seen (its layer's backward began elsewhere) is
        # charged the layer's whole backward rise.
        started_at = found.backward_rise[layer] if started_at is None else started_at
        for codec in LOSSY_CODECS:
            temporaries = max((_decode_rise(entry, codec, costs) - size for entry, size in zip(entries, dense)),
                              default=0)
            decode_rise[layer][codec] = max(decode_rise[layer][codec], started_at + sum(dense) + temporaries)
    return StoredSaves(
        tensors=tuple(_stored_tensor(entry, costs) for entry in recorded.entries.values()),
        encode_rise=tuple(encode_rise), decode_rise=tuple(decode_rise), decoded_bytes=tuple(decoded_bytes),
        decode_s=tuple(decode_s),
        input_held_by=tuple(span if as_it_is else None
                            for as_it_is, span in zip(found.inputs_saved_as_they_are, found.input_saved_by)),
        output_held_by=None if found.output_encodable else found.output_saved_by,
    )


def _stored_tensor(entry: _StoredEntry, costs: _CodecCosts) -> StoredTensor:
    signs = costs.sign_bytes(math.prod(entry.spec.shape)) if entry.relu and entry.spec.encodable else 0
    return StoredTensor(first=entry.first, last=entry.last,
                        kept_bytes={codec: _kept(entry, codec, costs) + signs for codec in LOSSY_CODECS},
                        sign_bytes=signs,
                        encode_s={codec: 0.0 if entry.pool is not None else costs.of(entry.spec)[codec].encode_s
                                  for codec in LOSSY_CODECS})


def _kept(entry: _StoredEntry, codec: str, costs: _CodecCosts) -> int:
    """What the codec keeps of the tensor: a max pool's indices as its window's
    decisions (every codec alike), else as the codec encodes it."""
    if entry.pool is not None:
        return allocation_bytes(entry.pool.window.packed_bytes(math.prod(entry.spec.shape)), costs.device)
    return costs.of(entry.spec)[codec].kept


def _encode_extra(entry: _StoredEntry, codec: str, costs: _CodecCosts) -> int:
    """The rise while a save is stored (encoded, then its ReLU bits packed; a max
    pool's indices packed as decisions, charged the larger of packing and restoring
    them: _CodecCosts.pool_restore_rise), beyond what stays."""
    kept = _kept(entry, codec, costs)
    if entry.pool is not None:
        return max(0, costs.pool_restore_rise([entry.pool]) - kept)
    rise = costs.of(entry.spec)[codec].encode_rise
    if entry.relu:
        elements = math.prod(entry.spec.shape)
        rise, kept = max(rise, kept + costs.relu_sign_rise(elements)), kept + costs.sign_bytes(elements)
    return max(0, rise - kept)


def _decode_rise(entry: _StoredEntry, codec: str, costs: _CodecCosts) -> int:
    """The rise while a save is decoded (and its ReLU decisions restored; a max pool's
    indices restored from its decisions), the decoded tensor included."""
    if entry.pool is not None:
        return allocation_bytes(entry.spec.dense_bytes, costs.device) + costs.pool_restore_rise([entry.pool])
    rise = costs.of(entry.spec)[codec].decode_rise
    if entry.relu:
        dense = allocation_bytes(entry.spec.dense_bytes, costs.device)
        rise = max(rise, dense + costs.relu_restore_rise(math.prod(entry.spec.shape)))
    return rise


def _layer_profile(i: int, name: str, layer: nn.Module, found: _Structure, no_grad_rises: list, times: tuple,
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
        no_grad_rise=no_grad_rises[i],
        backward_rise=found.backward_rise[i],
        saves_for_backward=i in found.saving_layers,
        relu_sign_bytes=found.relu_sign_bytes[i],
        relu_restore_bytes=costs.relu_restore_rise(found.relu_elements[i]),
        pool_decision_bytes=found.pool_decision_bytes[i],
        pool_restore_bytes=costs.pool_restore_rise(found.pools[i]),
        modifies_input=modifies_input(layer),
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


def profile(model: nn.Module, example_inputs, device=None, loss=None, stored_saves: bool = True) -> Profile:
    """Measure one training step of the chain ``model`` on its device, layer by layer.

    ``model`` is an ``nn.Sequential`` (a :class:`~actsave.CheckpointedSequential` is
    profiled as the plain chain); ``example_inputs`` is ``(x,)`` (or ``x``), the batch
    the plan is for. A forward warms up; then a step counts bytes (every storage
    allocated and every tensor saved for backward, by layer) and a step is timed.
    Then each distinct layer-input shape is encoded and decoded by each codec, and on
    CUDA copied to pinned host memory and back. The model's parameter gradients and
    BatchNorm statistics and the caller's RNG state are left as they were.

    ``loss``: the training step's loss, a function of the chain's output returning the
    tensor the backward starts from (``lambda logits: F.cross_entropy(logits.flatten(0,
    -2), targets.flatten())``). Its memory (cross-entropy's log-softmax, the gradients
    it makes) comes on top of everything the forward left, so a plan that fills its
    budget needs it measured: ``Profile.loss_rise``, the memory model's loss event.
    Without it the backward starts from a full-size output gradient of ones.

    ``stored_saves``: whether to derive what the stored segment's saves cost under each
    lossy codec (``Profile.stored_saves``, for :func:`plan`'s ``compress_stored``), from
    a sample of each save's shape; False leaves it None, for plans whose stored
    segment keeps its saves as they are (:func:`balanced`).

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
        stack.enter_context(isolated_steps(model, x.device))
        found = _measure_memory(layers, x, model, device, loss)
        no_grad_rises = _measure_no_grad_rises(layers, x, model, device)
        times = ([0.0] * len(layers),) * 2 if sizes_only else _measure_times(layers, x, loss)
        costs = _CodecCosts(x.device, device)
        return Profile(
            layers=tuple(_layer_profile(i, name, layer, found, no_grad_rises, times, costs)
                         for i, (name, layer) in enumerate(layers)),
            saved=tuple(found.saved),
            input_bytes=allocation_bytes(x.untyped_storage().nbytes(), device),
            output_bytes=found.output_bytes,
            output_saved_by=found.output_saved_by,
            output_grad_bytes=found.output_grad_bytes,
            device=str(device),
            timed=not sizes_only,
            loss_rise=found.loss_rise,
            stored_saves=_stored_saves(found, costs) if stored_saves else None,
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

