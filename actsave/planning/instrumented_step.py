"""The measured steps of a profile: one training step of a chain run layer by layer
with its bytes counted, a forward under no_grad, and a timed step (:func:`profile`,
profiler.py, puts what they find into its records).

The byte-counting step (:func:`measure_memory`) counts every storage allocated
(live_bytes.py) and attributes every tensor saved for backward to the layer running
(:class:`_SaveLedger`): per layer, the rises of live bytes in forward and backward,
the storages first saved, the ReLU outputs and max pools whose decisions a lossy
checkpoint keeps, and each save as a plain segment's codec would store it
(saves_as_stored.py's :class:`SavesAsStored`, priced by stored_saves.py). A layer's
input is described by a :class:`TensorSpec` (tensor_specs.py), enough to make another
like it for the codec costs (codec_costs.py). step_isolation.py makes such steps
leave no trace on the model.
"""
from __future__ import annotations

import collections
import contextlib
import statistics
import time
from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks

from .._torch import storage_resizes_observed
from ..checks import LOSS_RULE
from ..devices import synchronize
from ..errors import ConfigError
from ..meta import fast_meta, plans_at_first_call
from ..runtime import relu_signs
from ..runtime.bound_decisions import BoundWatch
from ..runtime.layers import modules_under
from ..runtime.passed_inputs import returns_its_input
from ..runtime.pool_decisions import PoolWatch
from ..runtime.saved_masks import compares_mask, mask_bytes
from ..runtime.keep_rules import CallerTensors, should_encode
from ..runtime.kept_saves import takes_kept_saves
from .allocator_rises import AllocatorRises, larger_of_each
from .cached_casts import CastWatch
from .live_bytes import LiveBytes, allocation_bytes, loss_held_bytes
from .saves_as_stored import SavesAsStored
from .tensor_specs import PoolSample, TensorSpec


@dataclass(frozen=True)
class SavedStorage:
    """A storage saved for backward: its bytes and the first and last layer saving it."""

    nbytes: int
    first: int
    last: int


class _SaveLedger:
    """Follows the byte-counting step: attributes the tensors autograd saves to the
    layer running, one entry per storage; notes where each layer starts and last
    saves; counts the ReLU outputs a lossy checkpoint keeps bits for (the first save
    of each, as a frame decides: relu_signs.keeps_decisions, its in-place ReLU modules
    watched as a lossy forward watches them) and the max pools it keeps decisions for
    (found by the same :class:`PoolWatch`, which runs with it, on the chain's own max
    pools: NOTE [ Steps other threads do not see ])."""

    def __init__(self, device, ignored: list, tracker: LiveBytes, caller: CallerTensors, layers: tuple):
        self.device = device
        self.tracker = tracker
        self.caller = caller  # the layers' inputs after the first are the chain's activations
        self.layer = 0
        self.layer_input = None
        self.inputs = []  # TensorSpec of each layer input
        self.inputs_saved_as_they_are = []  # whether a lossy codec storing saves would hold each as it is
        self.passes_on = []  # whether each layer returned its input or a view of it (returns_its_input)
        self.live_before = []  # the tracker's count as each layer starts
        self.input_entries = []  # the entry of each layer input's storage, or None
        self.peak_at_last_save = {}  # layer -> the tracker's peak when it last saved
        self.saves = collections.Counter()  # layer -> tensors it saved (each pack)
        # layer -> [bytes, elements of the largest ReLU output]; bound decisions' and mask
        # counts' bytes too
        self.relu_bits = {}
        self.bound_elements = {}  # layer -> elements of the largest save keeping bound decisions
        self.pool_decisions = {}  # layer -> [bytes, [PoolSample of each pool]]
        self.pools = PoolWatch.among(modules_under(layers))
        # The in-place ReLU modules a lossy forward watches (NOTE [ In-place ReLUs on views ]).
        self.relus = relu_signs.InplaceRelus.among(modules_under(layers))
        self.bounds = BoundWatch()  # NOTE [ Bound decisions ]
        self._ignored = {id(t.untyped_storage()) for t in ignored}
        self._entries = {}  # id(storage) -> [nbytes, first, last]; saved storages stay alive
        self._relu_saves = relu_signs.FirstSaves()
        self.as_stored = SavesAsStored(self._ignored, tracker)
        self.casts = CastWatch(device)  # NOTE [ Casts autocast caches ]

    def before_layer(self, i: int, h: torch.Tensor) -> None:
        self.layer, self.layer_input = i, h
        self.inputs.append(TensorSpec.of(h, self.caller if i > 0 else None))
        # runtime/kept_saves.py asks of a save what it asks outside a chain.
        self.inputs_saved_as_they_are.append(not should_encode(h))
        self.live_before.append(self.tracker.live)
        self.casts.layer_starts(i)

    def after_layer(self, i: int, h: torch.Tensor) -> None:
        # Looked up while the input is alive, so the storage id is its own; the entry
        # is read at the end, when later layers may have saved the storage too.
        self.input_entries.append(self.entry_of(self.layer_input))
        self.passes_on.append(returns_its_input(h, self.layer_input))
        self.layer_input = None
        self.casts.layer_ends()
        self.as_stored.watch_backward(i, h)

    @takes_kept_saves
    def pack(self, t: torch.Tensor):
        self.peak_at_last_save[self.layer] = self.tracker.peak
        self.saves[self.layer] += 1
        storage = t.untyped_storage()
        if id(storage) not in self._ignored:
            entry = self._entries.setdefault(
                id(storage), [allocation_bytes(storage.nbytes(), self.device), self.layer, self.layer])
            entry[2] = self.layer
        pool = self.pools.window_of(t)
        bounded = pool is None and BoundWatch.bounds_of_save() is not None
        if pool is not None:
            pool = PoolSample(*pool, tuple(t.shape))
            self._count_pool(t, pool)
        elif bounded:
            self._count_bounded(t)
        elif relu_signs.keeps_decisions(t, {}, self._relu_saves):  # one step of the whole chain: no segment inputs
            self._count_relu_output(t)
        elif compares_mask(t):  # NOTE [ Masks a lossy recompute compares ]: its bits, beside the decisions
            self.relu_bits.setdefault(self.layer, [0, 0])[0] += allocation_bytes(mask_bytes(t), self.device)
        # Detached: holding the output itself would be a reference cycle.
        rise = self.tracker.live - self.live_before[self.layer]
        return t.detach(), self.as_stored.pack(t, self.layer, rise, pool, bounded)

    def resized(self, storage, before: int, after: int) -> None:
        """A saved storage emptied in place is not held to its backward: FSDP2 frees a
        unit's gathered parameters so after the forward that saved them, and gathers
        them again for the backward, which the byte count sees as that layer's
        backward rise (NOTE [ Storage resizes ] in _torch.py)."""
        if after == 0:
            self._entries.pop(id(storage), None)

    def _count_bounded(self, t: torch.Tensor) -> None:
        """A Hardtanh's or LeakyReLU's save: its bits as a ReLU output's, its restore apart."""
        self.relu_bits.setdefault(self.layer, [0, 0])[0] += allocation_bytes(-(-t.numel() // 8), self.device)
        self.bound_elements[self.layer] = max(self.bound_elements.get(self.layer, 0), t.numel())

    def _count_relu_output(self, t: torch.Tensor) -> None:
        bits = self.relu_bits.setdefault(self.layer, [0, 0])
        nbytes = allocation_bytes(-(-t.numel() // 8), self.device)
        bits[0] += nbytes
        bits[1] = max(bits[1], t.numel())  # restores run one ReLU at a time

    def _count_pool(self, indices: torch.Tensor, pool: PoolSample) -> None:
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


class CountedStep:
    """What the byte-counting step found, per layer and for the chain output."""

    def __init__(self, ledger: _SaveLedger, forward_rise: list, backward_rise: list, loss_rise: int,
                 output: torch.Tensor, loss: Optional[torch.Tensor]):
        n, device = len(forward_rise), ledger.device
        self.loss_rise = loss_rise
        # NOTE [ What a step's loss holds ] in live_bytes.py.
        self.loss_held_bytes = 0 if loss is None else loss_held_bytes(loss, output, device)
        self.inputs = ledger.inputs
        self.inputs_saved_as_they_are = ledger.inputs_saved_as_they_are
        self.passes_on = ledger.passes_on
        self.forward_rise, self.backward_rise = forward_rise, backward_rise
        self.rise_to_last_save = [ledger.peak_at_last_save[i] - ledger.live_before[i]
                                  if i in ledger.peak_at_last_save else 0 for i in range(n)]
        self.saving_layers = set(ledger.peak_at_last_save)
        self.saves = [ledger.saves[i] for i in range(n)]
        self.saved = ledger.storages()
        self.saved_bytes = [0] * n  # by the first layer saving each storage
        for storage in self.saved:
            self.saved_bytes[storage.first] += storage.nbytes
        self.cached_cast_bytes = ledger.casts.bytes_by_layer(n)
        self.input_saved_by = [_span(entry) for entry in ledger.input_entries]
        bits = [ledger.relu_bits.get(i, (0, 0)) for i in range(n)]
        self.relu_sign_bytes, self.relu_elements = (list(c) for c in zip(*bits))
        self.bound_elements = [ledger.bound_elements.get(i, 0) for i in range(n)]
        pools = [ledger.pool_decisions.get(i, (0, [])) for i in range(n)]
        self.pool_decision_bytes, self.pools = (list(c) for c in zip(*pools))
        self.output_bytes = allocation_bytes(output.untyped_storage().nbytes(), device)
        self.output_saved_by = _span(ledger.entry_of(output))
        self.output_grad_bytes = allocation_bytes(output.numel() * output.element_size(), device)
        self.as_stored = ledger.as_stored
        self.output_encodable = should_encode(output)

    def take_larger_rises(self, allocator: "AllocatorStep") -> None:
        """Each span's rise becomes the larger of the live storages' and the
        allocator's (NOTE [ Allocator rises ])."""
        self.forward_rise = larger_of_each(self.forward_rise, allocator.forward_rise)
        self.rise_to_last_save = larger_of_each(self.rise_to_last_save, allocator.rise_to_last_save)
        self.backward_rise = larger_of_each(self.backward_rise, allocator.backward_rise)
        self.loss_rise = max(self.loss_rise, allocator.loss_rise)


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


# NOTE [ Each step on its own input ]
# Every measured step of a profile starts from its own copy of the example input
# (step_input), made as the step begins. A first layer that changes its input in place
# (ReLU(inplace=True)) changes that copy: a step reusing one input would start from the
# values the last step left (a mul_ compounding), and a non-leaf input would carry the
# last step's in-place node, whose saves that step's backward freed ("backward through
# the graph a second time"). The caller's example tensor is never run, so it is left as
# it was, values and gradient alike.


def step_input(x: torch.Tensor) -> torch.Tensor:
    """A copy of the example input ``x`` for one measured step (NOTE [ Each step on its
    own input ]), cut from the graph that made ``x``: a leaf where ``x`` is one, on a
    storage of the same size and layout (a view of a larger batch stays one); else a
    non-leaf (actsave encodes such inputs, not leaves), as a clone lays it out."""
    if not x.is_leaf:
        return x.detach().requires_grad_(x.requires_grad).clone()
    storage = x.untyped_storage().clone()
    copy = x.detach().new_empty(0).set_(storage, x.storage_offset(), x.size(), x.stride())
    return copy.requires_grad_(x.requires_grad)


def _run_step(layers: list, x: torch.Tensor, meter, before_layer=None, after_layer=None, loss=None) -> tuple:
    """One training step through the chain, each layer's forward and backward measured
    by ``meter``, and the loss: from the end of the forward until the output's gradient
    arrives. The backward starts from ``loss(output)`` (:func:`~actsave.profile`), or
    without a loss from a full-size output gradient of ones. Returns (forward values,
    backward values, loss value, output, the loss or None)."""
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
    value = None
    try:
        if loss is None:
            backward_from(h)
        else:
            value = _backward_from_loss(h, loss)
    finally:
        handle.remove()
        loss_span.close()
    return forward, spans.finish(), loss_span.value[0], h, value


def _backward_from_loss(output: torch.Tensor, loss) -> torch.Tensor:
    # The loss's saves are not the last layer's: the ledger (and any outer hooks) must
    # not see them.
    with own_saves():
        value = checked_loss(loss, output)
    backward_from(value)
    return value


def checked_loss(loss, output) -> torch.Tensor:
    """``loss(output)``, the value a training step's backward starts from: a
    one-element tensor that requires grad (``profile``, ``estimate`` and ``plan_blocks``
    alike), else a ConfigError that says what to return."""
    value = loss(output)
    if not (isinstance(value, torch.Tensor) and value.numel() == 1 and value.requires_grad):
        raise ConfigError(f"loss(output) gave {_shown_value(value)}: {LOSS_RULE}")
    return value


def _shown_value(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}{'' if value.requires_grad else ' that needs no grad'}"
    return f"a {type(value).__name__}"


def backward_from(loss: torch.Tensor) -> None:
    """The step's backward: from 1 for a scalar loss, else from a gradient of ones; after
    the forward's autocast region, as torch recommends a training step: the casts
    autocast cached in the forward are dropped first, as that region's exit drops them
    (the caller's autocast, where it plans inside one; NOTE [ Casts autocast caches ] in
    runtime/replay.py)."""
    torch.clear_autocast_cache()
    loss.backward(None if loss.dim() == 0 else torch.ones_like(loss))


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


def measure_memory(layers: list, x: torch.Tensor, model: nn.Module, device: torch.device, loss=None) -> CountedStep:
    """The byte-counting step, with allocations as on ``device``, on a copy of the
    example input ``x`` (NOTE [ Each step on its own input ])."""
    if any(plans_at_first_call(layer) for _, layer in layers):
        with fast_meta(), torch.enable_grad():
            _run_forward(layers, step_input(x))  # nested plans, made now, not in the measured step
    x = step_input(x)
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    known = [*model.parameters(), *model.buffers(), *grads, x]
    tracker = LiveBytes(device, known=known)
    ledger = _SaveLedger(device, ignored=known, tracker=tracker, caller=CallerTensors(x, model),
                         layers=tuple(layer for _, layer in layers))
    with tracker, storage_resizes_observed(ledger.resized), saved_tensors_hooks(ledger.pack, ledger.unpack), \
            ledger.pools.watching(), ledger.relus.watching(), ledger.bounds.watching(), \
            ledger.as_stored.watching(), ledger.casts:  # NOTE [ Attention's saves agree ]
        try:
            forward_rise, backward_rise, loss_rise, output, value = _run_step(
                layers, x, tracker.span, ledger.before_layer, ledger.after_layer, loss)
        finally:
            ledger.as_stored.finish()
    return CountedStep(ledger, forward_rise, backward_rise, loss_rise, output, value)


def measure_no_grad_rises(layers: list, x: torch.Tensor, model: nn.Module, device: torch.device) -> list:
    """Each layer's rise of live bytes in a forward under no_grad, which frees what the
    layer would save as it goes (a nested pass runs its recomputed parts so), with
    allocations as on ``device``; on a copy of ``x``, which an in-place first layer
    changes."""
    h = x.detach().clone()
    tracker = LiveBytes(device, known=[*model.parameters(), *model.buffers(), h])
    with tracker:
        return _no_grad_forward(layers, h, tracker.span)


def _no_grad_forward(layers: list, h: torch.Tensor, meter) -> list:
    """Each layer's value of ``meter`` in a forward from ``h`` under no_grad."""
    rises = []
    with torch.no_grad():
        for i, (_, layer) in enumerate(layers):
            with meter() as rise:
                h = _checked_output(layer(h), i)
            rises.append(rise[0])
    return rises


class AllocatorStep(NamedTuple):
    """The allocator's rises over the spans of a training step and a forward under
    no_grad, as CountedStep's and measure_no_grad_rises' (NOTE [ Allocator rises ])."""

    forward_rise: list
    rise_to_last_save: list
    backward_rise: list
    loss_rise: int
    no_grad_rise: list


def measure_allocator_rises(layers: list, x: torch.Tensor, loss=None) -> Optional[AllocatorStep]:
    """The allocator's rises of a training step and a no_grad forward on ``x``'s
    device, or None where its count is not read (NOTE [ Allocator rises ]); each
    layer's forward also up to its last save, where a recompute ending there stops."""
    rises = AllocatorRises(x.device)
    if not rises.readable:
        return None
    running, at_last_save = [0], [0] * len(layers)

    @takes_kept_saves
    def pack(t: torch.Tensor) -> torch.Tensor:
        at_last_save[running[0]] = rises.rise_so_far()
        return _detached(t)

    def before_layer(i: int, _) -> None:
        running[0] = i

    with saved_tensors_hooks(pack, _as_is):  # the loss's saves are its own: _backward_from_loss
        forward, backward, loss_rise, *_ = _run_step(layers, step_input(x), rises.span, before_layer, loss=loss)
    no_grad = _no_grad_forward(layers, x.detach().clone(), rises.span)
    return AllocatorStep(forward, at_last_save, backward, loss_rise, no_grad)


def _run_forward(layers: list, x: torch.Tensor) -> None:
    for _, layer in layers:
        x = layer(x)


# Timed steps of a profile; each layer's forward and backward time is the median of
# them: a single step is at the mercy of a stray delay (the first call of a kernel,
# another process on a shared machine), which would price a layer's recompute at many
# times its cost, and a plan would follow it.
TIMED_STEPS = 3


def measure_times(layers: list, x: torch.Tensor, loss=None) -> tuple:
    """Each layer's forward and backward seconds: medians over TIMED_STEPS steps, each
    on its own copy of ``x`` (NOTE [ Each step on its own input ])."""
    runs = [_run_step(layers, step_input(x), lambda: timer(x.device), loss=loss)[:2] for _ in range(TIMED_STEPS)]
    return tuple([statistics.median(step[part][i] for step in runs) for i in range(len(layers))]
                 for part in (0, 1))


@contextlib.contextmanager
def timer(device: torch.device):
    """Yields a one-item list that holds, on exit, the seconds the body took on
    ``device``."""
    synchronize(device)
    start = time.perf_counter()
    elapsed = [0.0]
    try:
        yield elapsed
    finally:
        synchronize(device)
        elapsed[0] = time.perf_counter() - start


def own_saves() -> saved_tensors_hooks:
    """Saved-tensor hooks under which what is saved is the profile's own: hooks around
    it (an outer checkpoint whose forward is running) do not see it."""
    return saved_tensors_hooks(_detached, _as_is)


@takes_kept_saves
def _detached(t: torch.Tensor) -> torch.Tensor:
    return t.detach()  # not ``t`` itself: a saved output holding its own node is a cycle


def _as_is(t: torch.Tensor) -> torch.Tensor:
    return t

