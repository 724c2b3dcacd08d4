"""CheckpointedSequential: an ``nn.Sequential`` cut into segments that keep only
their input and recompute the rest in backward.

Segments are planned from ``segments`` each time the chain runs, so ``append`` and
friends need no bookkeeping. As in ``torch.utils.checkpoint.checkpoint_sequential``,
the last segment is not checkpointed: backward starts there, so its activations are
needed at once. Per-layer options (``compress``, ``offload``) are stored by child
name and apply to what a segment keeps, so they act on the layers where segments
start: a checkpointed segment keeps its input; the last keeps what autograd saves,
which a lossy codec stores too (compressed_saves.py; offload does not apply there).
``describe()`` shows which.

``segments="auto"``, ``"memory"`` and ``"speed"`` plan the segments and per-segment
options from a profiled step (planner.py): ``"auto"`` and ``"speed"`` (the same: the
name of OpenAI gradient-checkpointing's fast mode) take the fastest plan whose peak
activation memory fits ``budget``; ``"memory"`` the plan with the smallest peak.
"""
from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import Iterable, Union

import torch
from torch import nn

from . import planner
from .compressed_saves import call_with_compressed_saves
from .errors import ConfigError
from .function import checkpointed_call
from .store import KeepPolicy
from .text import format_table

SegmentsSpec = Union[int, str, Iterable[int]]
_SEGMENT_STRATEGIES = ("sqrt",)
_PLANNED_STRATEGIES = ("auto", "speed", "memory")  # need a profiled step: see CheckpointedSequential


@dataclass(frozen=True)
class Segment:
    """Layers ``start`` to ``stop - 1``; ``checkpointed`` is False for the last one."""

    start: int
    stop: int
    checkpointed: bool


def plan_segments(n_layers: int, segments: SegmentsSpec) -> list:
    """Cut ``n_layers`` layers into :class:`Segment` s as ``segments`` asks."""
    starts = segment_starts(n_layers, segments)
    stops = starts[1:] + [n_layers]
    last = len(starts) - 1
    return [Segment(a, b, i != last) for i, (a, b) in enumerate(zip(starts, stops))]


def segment_starts(n_layers: int, segments: SegmentsSpec) -> list:
    """Indices where segments start (always beginning with 0, empty for no layers)."""
    if n_layers == 0:
        return []
    if isinstance(segments, str):
        if segments not in _SEGMENT_STRATEGIES:
            raise ConfigError(_bad_segments(segments, n_layers))
        return _even_starts(n_layers, max(1, round(math.sqrt(n_layers))))
    if isinstance(segments, bool):
        raise ConfigError(_bad_segments(segments, n_layers))
    if isinstance(segments, int):
        if not 1 <= segments <= n_layers:
            raise ConfigError(_bad_segments(segments, n_layers))
        return _even_starts(n_layers, segments)
    return _explicit_starts(n_layers, segments)


def _even_starts(n_layers: int, k: int) -> list:
    # checkpoint_sequential's split: k - 1 segments of n // k layers, the rest last, so
    # "sqrt" is the field's standard plan. It suits networks whose activations shrink
    # with depth (CNNs); balancing by measured memory is segments="memory"/"auto".
    size = n_layers // k
    return [i * size for i in range(k)]


def _explicit_starts(n_layers: int, segments) -> list:
    try:
        starts = [int(s) for s in segments if not isinstance(s, bool) and int(s) == s]
        ok = len(starts) == len(list(segments))
    except (TypeError, ValueError):
        ok = False
    if not ok or not starts:
        raise ConfigError(_bad_segments(segments, n_layers))
    if any(b <= a for a, b in zip(starts, starts[1:])) or starts[0] < 0 or starts[-1] >= n_layers:
        raise ConfigError(
            f"segments={list(segments)!r} must be strictly increasing layer indices in "
            f"[0, {n_layers - 1}] (where segments start)"
        )
    return starts if starts[0] == 0 else [0, *starts]


def _bad_segments(value, n_layers: int) -> str:
    return (
        f"segments={value!r} is not valid for {n_layers} layers; use an int k with "
        f"1 <= k <= {n_layers}, one of {list(_SEGMENT_STRATEGIES)}, a sorted list of the "
        f"layer indices where segments start, or one of {list(_PLANNED_STRATEGIES)} with "
        "budget= and example_inputs="
    )


class CheckpointedSequential(nn.Sequential):
    """Drop-in ``nn.Sequential`` that trades recompute (and, per layer, compression or
    host offload of what it keeps) for activation memory.

    Args:
        *modules: the layers, or one ``OrderedDict`` of them, as for ``nn.Sequential``.
        segments: ``"sqrt"`` (default, ``round(sqrt(n))`` segments split as
            ``torch.utils.checkpoint.checkpoint_sequential`` does: O(sqrt(n))
            activation memory for one extra forward), an int ``k`` (split likewise), or a sorted list
            of the layer indices where segments start (0 is implied). The last segment
            is not checkpointed. ``"auto"`` (alias ``"speed"``): the fastest plan whose
            predicted peak activation memory fits ``budget``; ``"memory"``: the plan
            with the smallest predicted peak (checked against ``budget`` if given).
            Both profile one step on ``example_inputs`` when the model is built and
            choose codecs and offload too (:func:`actsave.plan`, default levers).
        compress: codec of what segments keep (their inputs, and what the last
            segment saves): ``None`` (exact), a codec name, or ``{layer: codec}``
            with ``layer`` an index or child name (the rest exact).
        offload: keep segment inputs in host memory: a bool, or ``{layer: bool}``
            (not the last segment's saves: backward needs them at once).
        budget: peak activation memory in bytes for the planned strategies: what a
            training step allocates beyond parameters, buffers, gradients and
            optimizer state (planner.py, "Budget").
        example_inputs: ``(x,)``, a batch like those of training, for the planned
            strategies.

    Indexing, ``len``, iteration, ``append`` and ``state_dict`` keys are those of the
    ``nn.Sequential`` built from the same modules; slicing returns a
    ``CheckpointedSequential`` with default options. With ``compress=None`` outputs and
    gradients are bit-identical to the plain ``nn.Sequential``. Under
    ``torch.no_grad()`` it runs as a plain ``nn.Sequential`` and keeps nothing.
    """

    def __init__(self, *modules, segments: SegmentsSpec = "sqrt", compress=None, offload=False,
                 budget=None, example_inputs=None):
        _check_modules(modules)
        super().__init__(*modules)
        planned = isinstance(segments, str) and segments in _PLANNED_STRATEGIES
        _check_planning_arguments(segments, planned, budget, example_inputs, compress, offload)
        if not planned:
            segment_starts(len(self), segments)  # validate now, not at the first forward
        self.segments = segments
        self._default_compress, layer_compress = _split_per_layer(compress, default=None)
        self._default_offload, layer_offload = _split_per_layer(offload, default=False)
        KeepPolicy.resolve(self._default_compress, self._default_offload)
        self._layer_compress, self._layer_offload = {}, {}
        for layer, codec in layer_compress.items():
            self.set_compression(layer, codec)
        for layer, flag in layer_offload.items():
            self.set_offload(layer, flag)
        self._last_kept_bytes = {}
        self.applied_plan = None  # the last plan applied; later per-layer changes are not in it
        if planned:
            self.apply_plan(_planned(self, segments, budget, example_inputs))

    @classmethod
    def from_sequential(cls, sequential: nn.Sequential, **options) -> "CheckpointedSequential":
        """A CheckpointedSequential over the same module objects (no copies)."""
        if not isinstance(sequential, nn.Sequential):
            raise ConfigError(
                f"from_sequential expects an nn.Sequential, got {type(sequential).__name__}"
            )
        return cls(OrderedDict(sequential.named_children()), **options)

    def forward(self, input):
        if not torch.is_grad_enabled():
            return super().forward(input)
        layers, names = list(self), list(self._modules)
        self._last_kept_bytes = {}
        for segment in plan_segments(len(layers), self.segments):
            run = _Chain(layers[segment.start:segment.stop])
            policy = self._layer_policy(names[segment.start])
            if segment.checkpointed:
                private_copy = getattr(layers[segment.start], "inplace", False) is True
                input, kept = checkpointed_call(run, (input,), {}, policy, private_copy)
            elif not policy.codec.lossless:
                # Offload does not apply here: backward needs these saves at once.
                input, kept = call_with_compressed_saves(run, input, policy.codec)
            else:
                input, kept = run(input), None  # autograd holds the saves
            self._last_kept_bytes[segment.start] = kept
        return input

    def set_compression(self, layer, codec) -> None:
        """Set the codec of what is kept at ``layer`` (an index, child name or slice):
        the segment input there, or the last segment's saves when it starts there."""
        KeepPolicy.resolve(compress=codec)
        for name in self._child_names(layer):
            self._layer_compress[name] = codec

    def set_offload(self, layer, flag: bool) -> None:
        """Keep the input at ``layer`` (an index, child name or slice) on the host or not."""
        KeepPolicy.resolve(offload=flag)
        for name in self._child_names(layer):
            self._layer_offload[name] = flag

    def apply_plan(self, plan: "planner.Plan") -> None:
        """Run as ``plan`` (from :func:`actsave.plan`) says: its segments, and for each
        checkpointed segment its codec and offload. Replaces the segments and every
        per-layer option set before."""
        if not isinstance(plan, planner.Plan):
            raise ConfigError(
                f"apply_plan expects an actsave Plan (from actsave.plan), got {type(plan).__name__}")
        if plan.n_layers != len(self):
            raise ConfigError(
                f"the plan is for {plan.n_layers} layers and this CheckpointedSequential has "
                f"{len(self)}; profile and plan this model"
            )
        self.set_compression(slice(None), None)
        self.set_offload(slice(None), False)
        for start, _, option in plan.segments[:-1]:
            self.set_compression(start, option.codec)
            self.set_offload(start, option.offload)
        self.segments = list(plan.starts)
        self.applied_plan = plan

    def describe(self) -> str:
        """A per-layer table: segment, what it keeps (a checkpointed segment its
        ``input``, the last segment what autograd ``saves``), codec, offload, and bytes
        actsave kept at the last forward (with ReLU sign bits; none when the exact
        last segment's saves are autograd's own).

        Codec and offload are the layer's settings. A leaf input (the batch, at layer 0)
        is kept by reference on the device whatever they say, as its bytes show."""
        rows = [("layer", "name", "type", "segment", "keeps", "codec", "offload", "kept bytes")]
        names = list(self._modules)
        for number, segment in enumerate(plan_segments(len(self), self.segments)):
            keeps = "input" if segment.checkpointed else "saves"
            for i in range(segment.start, segment.stop):
                row = (str(i), names[i], type(self[i]).__name__, str(number))
                if i == segment.start:
                    codec, offload = self._layer_policy(names[i]).describe()
                    offload = offload if segment.checkpointed else "-"
                    kept = self._last_kept_bytes.get(i)
                    row += (keeps, codec, offload, "" if kept is None else str(kept))
                rows.append(row + ("",) * (len(rows[0]) - len(row)))
        return format_table(rows)

    def _layer_policy(self, name: str) -> KeepPolicy:
        compress = self._layer_compress.get(name, self._default_compress)
        offload = self._layer_offload.get(name, self._default_offload)
        return KeepPolicy.resolve(compress=compress, offload=offload)

    def _child_names(self, layer) -> list:
        names = list(self._modules)
        if isinstance(layer, slice):
            return names[layer]
        return [self._child_name(layer)]

    def _child_name(self, layer) -> str:
        names = list(self._modules)
        if isinstance(layer, str) and layer in self._modules:
            return layer
        if isinstance(layer, int) and not isinstance(layer, bool) and -len(names) <= layer < len(names):
            return names[layer]
        raise ConfigError(
            f"layer {layer!r} is not in this CheckpointedSequential; use an index in "
            f"[0, {len(names) - 1}], a child name (one of {names[:8]}"
            f"{'...' if len(names) > 8 else ''}) or a slice"
        )

    def extra_repr(self) -> str:
        return f"segments={self.segments!r}"


class _Chain:
    """Calls a run of layers in order; the function a checkpointed segment recomputes."""

    def __init__(self, layers: list):
        self.layers = layers
        self.__qualname__ = "segment(" + ", ".join(type(m).__name__ for m in layers) + ")"

    def __call__(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def _check_modules(modules: tuple) -> None:
    layers = modules[0].values() if len(modules) == 1 and isinstance(modules[0], OrderedDict) else modules
    for i, layer in enumerate(layers):
        if not isinstance(layer, nn.Module):
            raise ConfigError(
                f"layer {i} is {layer!r} of type {type(layer).__name__}, not an nn.Module; "
                "CheckpointedSequential takes modules as nn.Sequential does: wrap a "
                "function in a small nn.Module"
            )


def _check_planning_arguments(segments, planned: bool, budget, example_inputs, compress, offload) -> None:
    if not planned:
        if budget is not None or example_inputs is not None:
            raise ConfigError(
                f"budget= and example_inputs= are used by segments={list(_PLANNED_STRATEGIES)} only, "
                f"not by segments={segments!r}"
            )
        return
    if example_inputs is None:
        raise ConfigError(f"segments={segments!r} profiles one training step: pass example_inputs=(x,), "
                          "a batch like those of training")
    if budget is None and segments != "memory":
        raise ConfigError(f"segments={segments!r} needs budget=, the peak activation memory in bytes; "
                          "segments='memory' needs none")
    if compress is not None or offload is not False:
        raise ConfigError(
            f"segments={segments!r} chooses codecs and offload itself: leave compress and offload "
            "unset (to limit the levers, use actsave.plan(..., allow=...) and apply_plan)"
        )


def _planned(model: "CheckpointedSequential", strategy: str, budget, example_inputs) -> "planner.Plan":
    objective = "memory" if strategy == "memory" else "time"
    return planner.plan(planner.profile(model, example_inputs), budget, objective=objective)


def _split_per_layer(value, default) -> tuple:
    """``(global value, {layer: value})`` from a global value or a per-layer dict."""
    if isinstance(value, dict):
        return default, dict(value)
    return value, {}


__all__ = ["CheckpointedSequential", "Segment", "plan_segments"]
