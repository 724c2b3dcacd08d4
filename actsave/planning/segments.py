"""Where a CheckpointedSequential's segments start: the ``segments`` argument parsed
(:func:`segment_starts`), an even split's boundaries moved onto ReLU outputs under a
lossy codec (:func:`split_starts`, NOTE [ Boundaries on ReLU outputs ]), and the
:class:`Segment` s that starts cut a chain into (:func:`segments_from`).

``segments="balanced"`` (:data:`BALANCED`, the default) has starts that depend on the
input: balanced_cache.py plans and caches them (NOTE [ Balanced segments ] there).
The planned strategies (:data:`PLANNED_STRATEGIES`) come from plans.py's plan().
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Optional, Union

from torch import nn

from ..checks import integral
from ..errors import ConfigError
from ..runtime.nested import Range
from .plan_record import Plan

SegmentsSpec = Union[int, str, Iterable[int]]
BALANCED = "balanced"  # balanced_cache.py, NOTE [ Balanced segments ]
_SEGMENT_STRATEGIES = ("sqrt",)
PLANNED_STRATEGIES = ("auto", "speed", "memory")  # need a profiled step: see CheckpointedSequential


@dataclass(frozen=True)
class Segment:
    """Layers ``start`` to ``stop - 1``; ``checkpointed`` is False for the last one and
    the plain segments of an applied plan."""

    start: int
    stop: int
    checkpointed: bool
    nested: Optional[Range] = None  # how its recompute nests checkpoints (NOTE [ Nested recompute ])


def plan_segments(n_layers: int, segments: SegmentsSpec) -> list:
    """Cut ``n_layers`` layers into :class:`Segment` s as ``segments`` asks (any
    ``segments`` but ``"balanced"``, whose starts depend on the input)."""
    return segments_from(segment_starts(n_layers, segments), n_layers)


def segment_starts(n_layers: int, segments: SegmentsSpec) -> list:
    """Indices where segments start (always beginning with 0, empty for no layers), for
    every ``segments`` but ``"balanced"``, whose starts depend on the input."""
    if n_layers == 0:
        return []
    if segments == BALANCED:
        raise ConfigError("segments='balanced' starts depend on the input: CheckpointedSequential chooses them "
                          "at the first training call of each input")
    if isinstance(segments, str):
        if segments not in _SEGMENT_STRATEGIES:
            raise ConfigError(_bad_segments(segments, n_layers))
        return _even_starts(n_layers, max(1, round(math.sqrt(n_layers))))
    if isinstance(segments, bool):
        raise ConfigError(_bad_segments(segments, n_layers))
    k = integral(segments)  # any integral number: numpy's too
    if k is not None:
        if not 1 <= k <= n_layers:
            raise ConfigError(_bad_segments(segments, n_layers))
        return _even_starts(n_layers, k)
    return _explicit_starts(n_layers, segments)


def _even_starts(n_layers: int, k: int) -> list:
    # checkpoint_sequential's split: k - 1 segments of n // k layers, the rest last, so
    # "sqrt" is the field's standard plan. It suits networks whose activations shrink
    # with depth (CNNs); balancing by measured memory is segments="memory"/"auto".
    size = n_layers // k
    return [i * size for i in range(k)]


# NOTE [ Boundaries on ReLU outputs ]
#
# An even split ("sqrt", or an int k) cuts wherever the count falls, often on a conv
# or BatchNorm output: signed values, which a lossy codec stores with one bit less
# than a ReLU's output (the unsigned grid, codecs/__init__.py). The gradient error of
# a lossy checkpoint stays mostly within its segment and is set by how well its
# kept input is stored, and a BatchNorm's weight gradient (sum(dy * x_hat), with
# much cancellation) is where it shows first. So under a lossy codec a boundary
# that falls on BatchNorm or ReLU layers moves forward past them to the first
# ReLU's output: the same shape as the conv output it replaces, so the kept input
# costs the same bytes. The price is longer segments, so a somewhat higher peak: on a
# conv-BN-ReLU chain, with a ReLU output every third layer, a boundary moves by at most
# two layers. In return the worst parameter gradient gains several dB; the last
# segment's saved BatchNorm inputs then set the worst, and centering them
# (codecs/centering.py) gains again (docs/results.md, "Gradient fidelity" and "Figures
# behind the code's rules"). A boundary moves only within its segment, and only where
# the layer it lands on has the same settings (codec, offload) as the one it leaves, so
# per-layer choices hold.
# Explicit lists of starts are the caller's and are kept as given.
_PASSED_ON_THE_WAY_TO_A_RELU = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)


def split_starts(layers: list, segments: SegmentsSpec, policies: tuple) -> list:
    """:func:`segment_starts` for ``layers`` kept by ``policies`` (one per layer),
    with an even split's boundaries on ReLU outputs under a lossy codec (NOTE
    [ Boundaries on ReLU outputs ])."""
    starts = segment_starts(len(layers), segments)
    if isinstance(segments, str) or integral(segments) is not None:
        starts = _onto_relu_outputs(starts, layers, policies)
    return starts


def _onto_relu_outputs(starts: list, layers: list, policies: tuple) -> list:
    moved = starts[:1]
    for start, next_start in zip(starts[1:], [*starts[2:], len(layers)]):
        moved.append(start)
        if not policies[start].lossy:
            continue
        j = start
        while j < next_start and isinstance(layers[j], _PASSED_ON_THE_WAY_TO_A_RELU):
            j += 1
        if j + 1 < next_start and isinstance(layers[j], nn.ReLU) and policies[j + 1] == policies[start]:
            moved[-1] = j + 1
    return moved


def _explicit_starts(n_layers: int, segments) -> list:
    try:
        starts = [integral(s) for s in segments]
    except TypeError:  # not iterable
        starts = []
    if not starts or None in starts:
        raise ConfigError(_bad_segments(segments, n_layers))
    if any(b <= a for a, b in zip(starts, starts[1:])) or starts[0] < 0 or starts[-1] >= n_layers:
        raise ConfigError(
            f"segments={list(segments)!r} must be strictly increasing layer indices in "
            f"[0, {n_layers - 1}] (where segments start)"
        )
    return starts if starts[0] == 0 else [0, *starts]


def normalized_segments(segments):
    """``segments`` as an ``int``, a list of starts or a name: one value to compare and
    print, whatever integral or iterable type the caller used (a numpy array, a range).
    A set is refused (its order is not the layers'), and so is a Plan, which is applied,
    not passed as segments."""
    if isinstance(segments, (str, bool)):
        return segments
    if isinstance(segments, Plan):
        raise ConfigError("segments= takes where segments start, not a Plan: build the CheckpointedSequential, "
                          "then call .apply_plan(plan) on it (its segments, codecs and offload)")
    if isinstance(segments, (set, frozenset)):
        raise ConfigError(f"segments={segments!r} is a set, which has no order: pass the layer indices where "
                          f"segments start as a sorted list ({sorted(segments)!r})")
    k = integral(segments)
    if k is not None:
        return k
    try:
        return list(segments)
    except TypeError:
        return segments  # rejected, with the allowed values, by segment_starts


def _bad_segments(value, n_layers: int) -> str:
    return (
        f"segments={value!r} is not valid for {n_layers} layers; use {BALANCED!r} (the default), "
        f"an int k with 1 <= k <= {n_layers}, one of {list(_SEGMENT_STRATEGIES)}, a sorted list of the "
        f"layer indices where segments start, or one of {list(PLANNED_STRATEGIES)} with "
        "budget= and example_inputs="
    )


def segments_from(starts: list, n_layers: int, stored: frozenset = frozenset(), nested: Optional[dict] = None) -> list:
    """The segments starting at ``starts``: the last and those starting in ``stored``
    run plainly, the others checkpointed, those starting in ``nested`` with the
    recompute that Range cuts."""
    stops = starts[1:] + [n_layers]
    last = len(starts) - 1
    nested = nested or {}
    return [Segment(a, b, i != last and a not in stored, nested.get(a) if i != last else None)
            for i, (a, b) in enumerate(zip(starts, stops))]


__all__ = ["BALANCED", "PLANNED_STRATEGIES", "Segment", "SegmentsSpec", "normalized_segments", "plan_segments",
           "segment_starts", "segments_from", "split_starts"]
