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

This module holds the records (:class:`Profile`, :class:`LayerProfile`) and
:func:`profile`, which fills them from the measured steps (instrumented_step.py), the
codec costs (codec_costs.py) and the plain segment's saves as priced
(stored_saves.py).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from .._torch import named_children_of
from .._torch_graphs import uncompiled
from ..checks import check_loss_function, flag
from ..codecs import LOSSY_CODECS
from ..devices import host_is_separate
from ..errors import ConfigError
from ..meta import on_meta, simulating
from ..runtime.layers import repeated_modules
from ..runtime.keep_rules import EXACT, KeepPolicy, starts_in_place
from ..text import format_table, mib, ms
from .allocator_rises import larger_of_each
from .checkpoint_host import NO_HOST_WORK, CheckpointHostWork, checkpoint_host_work
from .codec_costs import CodecCosts
from .fsdp_gathers import gathered_bytes, with_plain_step_gathers
from .instrumented_step import (CountedStep, measure_allocator_rises, measure_memory, measure_no_grad_rises,
                               measure_times, own_saves)
from .live_bytes import allocation_bytes
from .step_isolation import isolated_steps
from .stored_saves import StoredSaves, price_stored_saves


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
    relu_sign_bytes: int  # kept by a lossy segment: this layer's ReLU, Hardtanh, LeakyReLU decisions, mask counts
    relu_restore_bytes: int  # the larger restore of those (runtime/relu_signs.py, bound_decisions.py)
    pool_decision_bytes: int  # kept by a lossy segment for this layer's max pools (runtime/pool_decisions.py)
    pool_restore_bytes: int  # the larger of keeping them (forward) and restoring them (recompute)
    gathered_bytes: int  # FSDP2's parameters gathered for its forward (fsdp_gathers.py); 0 without FSDP2
    modifies_input: bool
    input_encodable: bool  # False: kept by reference whatever the codec (the caller's, not float: keep_rules.should_encode)
    kept_bytes: dict
    encode_rise: dict
    decode_rise: dict
    forward_s: float
    backward_s: float
    encode_s: dict
    decode_s: dict
    to_host_s: dict  # empty when the device has no separate host memory
    to_device_s: dict
    # The tensors this layer saves for backward: each goes through a checkpointed
    # segment's hooks (checkpoint_host.py).
    saves: int = 0
    # A snapshot of the buffers this layer's forward mutates (BatchNorm statistics), kept
    # by a checkpointed segment holding the layer until its recompute (runtime/state.py,
    # NOTE [ State a forward reads and mutates ]); on the device whatever the keep option.
    mutated_state_bytes: int = 0
    # The casts autocast caches that this layer is the first to save (a weight's, under
    # autocast with its cache on): the cache holds them to the autocast region's end, so a
    # checkpointed segment holding the layer keeps them on the device as it keeps the
    # snapshot (NOTE [ Casts autocast caches ] in runtime/replay.py; planning/cached_casts.py).
    cached_cast_bytes: int = 0

    @classmethod
    def saving_nothing(cls, name: str, kind: str, *, input_bytes: int, dense_input_bytes: int,
                       input_grad_bytes: int, input_saved_by: Optional[tuple], output_bytes: int,
                       forward_rise: int, backward_rise: int = 0) -> "LayerProfile":
        """A layer that saves nothing for backward (so its forward rises alike with and
        without grad), keeps no decisions, leaves its input as it is, and whose input
        every codec keeps as it is (by reference); no time measured. The block planner
        makes one for the step after the blocks (blocks.py, the loss)."""
        codecs = ("none", *LOSSY_CODECS)
        nothing, no_time = dict.fromkeys(codecs, 0), dict.fromkeys(codecs, 0.0)
        return cls(
            name=name, kind=kind, input_bytes=input_bytes, dense_input_bytes=dense_input_bytes,
            input_grad_bytes=input_grad_bytes, output_bytes=output_bytes, saved_bytes=0,
            input_saved_by=input_saved_by, forward_rise=forward_rise, forward_rise_to_last_save=0,
            no_grad_rise=forward_rise, backward_rise=backward_rise, saves_for_backward=False,
            relu_sign_bytes=0, relu_restore_bytes=0, pool_decision_bytes=0, pool_restore_bytes=0,
            gathered_bytes=0, modifies_input=False, input_encodable=False,
            kept_bytes=dict.fromkeys(codecs, input_bytes),
            encode_rise=nothing, decode_rise=nothing, forward_s=0.0, backward_s=0.0, encode_s=no_time,
            decode_s=no_time, to_host_s={}, to_device_s={})

    def kept_input_bytes(self, option: KeepPolicy, chain_input: bool) -> int:
        """K: what a checkpointed segment starting at this layer keeps of its input by
        ``option``, wherever that is. The exact codec keeps a private copy for an
        in-place first layer (runtime/keep_rules.py, modifies_input), else the input itself, nothing extra
        for the chain input (held by the caller)."""
        if option.lossy:
            return self.kept_bytes[option.codec.name]
        if self.modifies_input:
            return self.dense_input_bytes
        return 0 if chain_input else self.input_bytes


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
    stored_saves: Optional[StoredSaves] = None  # None: not recorded; the plain segment's saves stay exact
    # Whether a module runs in more than one layer (a block placed twice): such a chain's
    # plans do not nest checkpoints (runtime/nested.py, _refuse_repeated_modules).
    repeats_modules: bool = False
    # The gradients of parameters that more than one layer uses (a block placed twice,
    # weights tied across layers): NOTE [ Gradients pending between two uses ].
    pending_gradient_bytes: int = 0
    # (layer index, parameter name) of each parameter that did not require grad in the
    # profiled step: a plan holds while they stay so (chain_segments.py warns).
    frozen: tuple = ()
    # Whether the caller holds the output's gradient through the backward: a step without
    # a loss passes it (out.backward(g)); with the step's loss, autograd frees it after
    # the last layer's backward (memory_model.py, O and g_n).
    output_grad_held: bool = True
    # The step's loss and its gradient of 1, held through the backward (NOTE [ What a
    # step's loss holds ] in live_bytes.py); 0 without a loss.
    loss_held_bytes: int = 0
    # The chain input's shape and element size in the profiled step: a plan holds for
    # inputs no larger (chain_segments.py warns of a larger one).
    input_shape: Optional[tuple] = None
    input_element_size: int = 0
    # The host work a checkpointed segment adds beyond its layers' times (NOTE [ Host
    # work counted on a CPU only ] in checkpoint_host.py); none in profiles without it.
    checkpoint_host: CheckpointHostWork = NO_HOST_WORK

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
    # A layer compiled by torch.compile is profiled as its eager module, as the runtime
    # recomputes it: NOTE [ torch.compile ] in runtime/compiled_calls.py.
    # Every position of the chain, a module placed twice included (named_children()
    # yields each module once).
    return [(name, uncompiled(layer)) for name, layer in named_children_of(model)]


def _single_input(example_inputs) -> torch.Tensor:
    inputs = (example_inputs,) if isinstance(example_inputs, torch.Tensor) else example_inputs
    if isinstance(inputs, (tuple, list)) and len(inputs) == 1 and isinstance(inputs[0], torch.Tensor):
        return inputs[0]
    given = _type_name(example_inputs)
    if isinstance(inputs, (tuple, list)):
        given += f" of {len(inputs)} ({', '.join(_type_name(item) for item in inputs)})"
    raise ConfigError(f"example_inputs must be (x,), the one tensor the chain takes, got {given}; an array "
                      "becomes a tensor by torch.as_tensor(array)")


def _type_name(value) -> str:
    """``value``'s type as code names it: ``numpy.ndarray``, ``int``."""
    kind = type(value)
    return kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"


def _layer_profile(i: int, name: str, layer: nn.Module, found: CountedStep, no_grad_rises: list, times: tuple,
                   costs: CodecCosts, gathered: int, mutated: int, in_place: bool,
                   input_saved_by: Optional[tuple]) -> LayerProfile:
    spec, device = found.inputs[i], costs.device
    keep_costs = costs.of(spec)

    def by_codec(field: str) -> dict:
        return {codec: getattr(cost, field) for codec, cost in keep_costs.items()}

    next_spec = found.inputs[i + 1] if i + 1 < len(found.inputs) else None
    host_copies = host_is_separate(device)
    return LayerProfile(
        name=name,
        kind=type(layer).__name__,
        input_bytes=allocation_bytes(spec.storage_bytes, device),
        dense_input_bytes=allocation_bytes(spec.dense_bytes, device),
        input_grad_bytes=allocation_bytes(spec.dense_bytes, device) if spec.requires_grad else 0,
        output_bytes=allocation_bytes(next_spec.storage_bytes, device) if next_spec else found.output_bytes,
        saved_bytes=found.saved_bytes[i],
        input_saved_by=input_saved_by,
        forward_rise=found.forward_rise[i],
        forward_rise_to_last_save=found.rise_to_last_save[i],
        no_grad_rise=no_grad_rises[i],
        backward_rise=found.backward_rise[i],
        saves_for_backward=i in found.saving_layers,
        relu_sign_bytes=found.relu_sign_bytes[i],
        relu_restore_bytes=max(costs.relu_restore_rise(found.relu_elements[i]),
                               costs.bound_restore_rise(found.bound_elements[i])),
        pool_decision_bytes=found.pool_decision_bytes[i],
        pool_restore_bytes=costs.pool_restore_rise(found.pools[i]),
        gathered_bytes=gathered,
        modifies_input=in_place,
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
        mutated_state_bytes=mutated,
        cached_cast_bytes=found.cached_cast_bytes[i],
        saves=found.saves[i],
    )


def profile(model: nn.Module, example_inputs, device=None, loss=None, stored_saves: bool = True) -> Profile:
    """Measure one training step of the chain ``model`` on its device, layer by layer.

    ``model`` is an ``nn.Sequential`` (a :class:`~actsave.CheckpointedSequential` is
    profiled as the plain chain); ``example_inputs`` is ``(x,)`` (or ``x``), the batch
    the plan is for. A forward warms up; then a step counts bytes (every storage
    allocated and every tensor saved for backward, by layer) and a step is timed.
    Then each distinct layer-input shape is encoded and decoded by each codec, and on
    CUDA copied to pinned host memory and back. The model's parameter gradients and
    BatchNorm statistics are left as they were, and so is ``x``: each step runs on a
    copy of it (NOTE [ Each step on its own input ]). Its steps draw random numbers as
    training steps do, and advance the generators (seed after profiling for a
    reproducible run): putting them back would undo what other threads drew
    meanwhile (NOTE [ Steps other threads do not see ]). On meta tensors nothing draws.

    ``loss``: the training step's loss, a function of the chain's output returning the
    one-element tensor the backward starts from (``lambda logits:
    F.cross_entropy(logits.flatten(0, -2), targets.flatten())``). Its memory
    (cross-entropy's log-softmax, the gradients it makes) comes on top of everything
    the forward left, so a plan that fills its budget needs it measured:
    ``Profile.loss_rise``, the memory model's loss event. Without it the backward
    starts from a full-size output gradient of ones.

    ``stored_saves``: whether to derive what the plain segment's saves cost under each
    lossy codec (``Profile.stored_saves``, for :func:`plan`'s ``compress_saves``), from
    a sample of each save's shape; False leaves it None, for plans whose plain
    segment keeps its saves as they are (:func:`balanced`).

    Sizes only, at any scale: give ``x`` on the meta device (``torch.empty(128, 3, 32,
    32, device="meta")``) and the ``device`` it stands for (default ``"cpu"``; ``"cuda"``
    counts CUDA's 512-byte blocks and makes offload a lever). The step then runs on meta
    tensors, the model's parameters and buffers swapped for meta copies (it is left as
    it was): no data, no device memory, no times, so plan it with
    ``objective="memory"``. ``segments="balanced"`` measures a chain so.
    """
    layers = _chain_layers(model)
    check_loss_function(loss)
    flag(stored_saves, "stored_saves")
    x = _single_input(example_inputs)  # each step runs on a copy: NOTE [ Each step on its own input ]
    device = _profiled_device(x, device)
    sizes_only = x.device.type == "meta"
    gathered = [gathered_bytes(layer, device) for _, layer in layers]  # before on_meta swaps the shards
    with contextlib.ExitStack() as stack:
        stack.enter_context(own_saves())  # the profiled steps' saves are their own
        if sizes_only:
            stack.enter_context(on_meta(model))
            stack.enter_context(simulating(device))
        state = stack.enter_context(isolated_steps(model))
        found = measure_memory(layers, x, model, device, loss)
        mutated = [state.mutated_bytes(layer, device) for _, layer in layers]
        no_grad_rises = measure_no_grad_rises(layers, x, model, device)
        times = ([0.0] * len(layers),) * 2 if sizes_only else measure_times(layers, x, loss)
        allocator = None if sizes_only else measure_allocator_rises(layers, x, loss)  # after the timed steps
        if allocator is not None:  # NOTE [ Allocator rises ]
            found.take_larger_rises(allocator)
            no_grad_rises = larger_of_each(no_grad_rises, allocator.no_grad_rise)
        costs = CodecCosts(x.device, device)
        modules = [layer for _, layer in layers]
        saved_by = _saved_through_passes(found.input_saved_by, found.passes_on)
        profiles = [_layer_profile(i, name, layer, found, no_grad_rises, times, costs, gathered[i], mutated[i],
                                   _starts_in_place(modules, i, found.passes_on), saved_by[i])
                    for i, (name, layer) in enumerate(layers)]
        return Profile(
            # A meta step runs without FSDP2's hooks: NOTE [ Gathered parameters ].
            layers=tuple(with_plain_step_gathers(profiles) if sizes_only else profiles),
            saved=tuple(found.saved),
            input_bytes=allocation_bytes(found.inputs[0].storage_bytes, device),  # the steps' input
            output_bytes=found.output_bytes,
            output_saved_by=found.output_saved_by,
            output_grad_bytes=found.output_grad_bytes,
            device=str(device),
            timed=not sizes_only,
            loss_rise=found.loss_rise,
            stored_saves=price_stored_saves(found, costs) if stored_saves else None,
            repeats_modules=bool(repeated_modules([layer for _, layer in layers])),
            pending_gradient_bytes=_pending_gradient_bytes([layer for _, layer in layers], device),
            frozen=tuple((i, name) for i, (_, layer) in enumerate(layers)
                         for name, parameter in layer.named_parameters() if not parameter.requires_grad),
            input_shape=tuple(x.shape),
            input_element_size=x.element_size(),
            output_grad_held=loss is None,
            loss_held_bytes=found.loss_held_bytes,
            checkpoint_host=NO_HOST_WORK if sizes_only else checkpoint_host_work(device),
        )


# NOTE [ Gradients pending between two uses ]
# A parameter that two layers use gets one gradient from each. Autograd's engine holds
# the later use's (the first computed) in the input buffer of the parameter's
# accumulation until the earlier use's arrives: through the backward, and the
# recomputes, of every segment between the two. The plain step's rises see it only
# where it is made, so the model charges these gradients to every backward-time event
# (layer_events.py's held_in_backward): an upper bound, exact where the two uses are
# the chain's ends.


def _pending_gradient_bytes(layers: list, device) -> int:
    """The gradient bytes of the parameters that more than one of ``layers`` uses, each
    parameter once: NOTE [ Gradients pending between two uses ]."""
    users = {}
    for index, layer in enumerate(layers):
        for parameter in layer.parameters():
            if parameter.requires_grad:
                users.setdefault(id(parameter), (parameter, set()))[1].add(index)
    return sum(allocation_bytes(parameter.numel() * parameter.element_size(), device)
               for parameter, used_by in users.values() if len(used_by) > 1)


def _saved_through_passes(spans: list, passes_on: list) -> list:
    """The (first, last) layers whose saves hold each layer's input storage (``spans``,
    None: none), that of a layer that passed its input on (``passes_on``) joined with
    its output's: the same storage, which the in-place layers after it change and save
    (NOTE [ A layer that turns out to pass its input on ])."""
    spans = list(spans)
    for i in range(len(spans) - 2, -1, -1):
        later = spans[i + 1]
        if passes_on[i] and later is not None:
            spans[i] = later if spans[i] is None else (min(spans[i][0], later[0]), max(spans[i][1], later[1]))
    return spans


def _starts_in_place(modules: list, start: int, passes_on: list) -> bool:
    """Whether a segment of ``modules`` starting at ``start`` changes its input in place,
    or hands it on to layers that do, as the runtime finds it: keep_rules.starts_in_place,
    or layers the profiled step saw return their input (or a view of it) before such
    layers (NOTE [ A layer that turns out to pass its input on ], runtime/passed_inputs.py).
    Either way the runtime holds a copy of the input beside it."""
    for layer in range(start, len(modules)):
        if starts_in_place(modules, layer):
            return True
        if not passes_on[layer]:
            return False
    return False


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

