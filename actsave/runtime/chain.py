"""A chain's segments run eagerly, one after another (CheckpointedSequential's forward
outside a compiled graph): a checkpointed segment keeps its input (function.py), a
nested one recomputes in stages (nested.py), a plain one kept by a lossy codec stores
its saves (kept_saves.py), an exact plain one leaves them to autograd. What each kept is
recorded for describe() (:class:`ChainCall`).

What these read of the chain (``chain`` below, a CheckpointedSequential): its segments'
source ``chain._segment_source`` (planning's ChainSegments: where segments start, the
segments, their policies) and its settings ``chain._settings``; they leave the record
of its call in ``chain._last_call``.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Optional

import torch
from torch import nn

from .._torch import own_tensors
from ..offload import current_tape
from .buffer_copies import shared_between
from .function import checkpointed_call
from .boundaries import Boundary
from .keep_rules import EXACT, CallerTensors, KeepPolicy, should_encode, starts_in_place
from .kept_saves import call_with_kept_saves
from .layers import LayerRun, modules_under
from .nested import nested_call
from .buffer_copies import Snapshot, snapshot_of


@torch.compiler.disable  # planning runs eagerly, once per input: NOTE [ torch.compile ]
def starts_for_call(chain, input, layers: list) -> list:
    """Where the segments of ``chain``'s call on ``input`` start."""
    settings = chain._settings
    policies = settings.policies(layers)
    starts = chain._segment_source.starts_for(chain, input, layers, policies)
    if settings.any_set():
        chain._segment_source.warn_of_unused_settings(policies, layers, starts, settings.default)
    return starts


def run_eagerly(chain, input, layers: list, starts: list):
    """``chain``'s forward outside a compiled graph, its record kept for describe()."""
    segments, policies = segments_and_policies(chain, starts, layers)
    output, chain._last_call = run_chain(chain, input, layers, segments, policies)
    return output


def segments_and_policies(chain, starts: list, layers: list) -> tuple:
    """``(segments, their policies)`` of ``chain``'s call whose segments start at ``starts``."""
    source = chain._segment_source
    segments = source.segments(starts, len(layers))
    policies = [source.policy(segment, layers, chain._settings) for segment in segments]
    return [_as_kept(segment, policy) for segment, policy in zip(segments, policies)], policies


def _as_kept(segment, policy: KeepPolicy):
    """``segment`` as it runs when it keeps by ``policy``. A nested recompute keeps
    every input exactly on the device (NOTE [ Nested recompute ]), so a segment whose
    first layer was set to keep by a codec or on the host after the plan nested it
    (set_compression, set_offload: NOTE [ An applied plan ]) keeps as set and
    recomputes in one stage, as a compiled graph runs it and describe() shows it."""
    if segment.nested is None or (policy.codec.name == EXACT.codec.name and not policy.offload):
        return segment
    return replace(segment, nested=None)


@dataclass
class ChainCall:
    """What a chain's training call kept, by segment start: the bytes stored
    (``kept``; None where autograd holds the saves) and those of an input its caller
    holds (``by_reference``); and whether the call ran in a compiled graph (``traced``),
    which keeps no such record."""

    kept: dict = field(default_factory=dict)
    by_reference: dict = field(default_factory=dict)
    traced: bool = False


def run_chain(chain: nn.Module, input, layers: list, segments: list, policies: list) -> tuple:
    """``(output, ChainCall)``: ``chain``'s ``layers`` run on ``input`` as ``segments``
    (planning/segments.py's ``Segment``), each keeping by its policy in ``policies``."""
    call = ChainCall()
    caller = CallerTensors(input, chain)  # what the later segments' inputs are not (should_encode)
    # The checkpointed segments' module state, snapshotted together as the forward starts.
    state = ChainState([layers[s.start:s.stop] for s in segments if s.checkpointed and s.nested is None])
    boundaries = _boundaries(segments, policies, caller)  # NOTE [ Decisions at a boundary ]
    try:
        for segment, policy, before, after in zip(segments, policies, [None, *boundaries], boundaries):
            input = _run_segment(layers, segment, policy, input, caller, state, call, (before, after))
    finally:  # a copy no segment claimed, where one raised
        for boundary in boundaries:
            if boundary is not None:
                boundary.discard()
    return input, call


def _run_segment(layers: list, segment, policy: KeepPolicy, input, caller: CallerTensors, state: "ChainState",
                 call: ChainCall, boundaries: tuple):
    """One segment of run_chain on ``input``, what it kept noted in ``call``; its output.
    ``boundaries``: those before and after it (NOTE [ Decisions at a boundary ])."""
    current_tape().segment_starts()  # the last offloaded input leaves the device, whatever this segment keeps
    run = LayerRun(layers[segment.start:segment.stop])
    private_copy = starts_in_place(layers, segment.start)
    made_by = caller if segment.start > 0 else None
    held = _held_by_caller(input, made_by) if segment.checkpointed else 0
    if segment.nested is not None:
        input, kept = nested_call(run.layers, segment.nested, input, private_copy)
    elif segment.checkpointed:
        input, kept = checkpointed_call(run, (input,), {}, policy, private_copy, made_by=made_by,
                                        prepared=state.next(), boundaries=boundaries)
    elif not policy.codec.lossless:
        # Offload does not apply here: backward needs these saves at once.
        input, kept = call_with_kept_saves(run, (input,), {}, KeepPolicy(policy.codec, False))
        kept = None if kept is None else kept["device"]
    else:
        input, kept = run(input), None  # autograd holds the saves
    call.kept[segment.start] = kept
    if held:
        call.by_reference[segment.start] = held
    return input


def _boundaries(segments: list, policies: list, caller: CallerTensors) -> list:
    """Per segment, the Boundary after it: where it and the next are checkpointed in one
    stage, the next keeping its input by a lossy codec; else None (NOTE [ Decisions at
    a boundary ])."""
    def stored_across(first, second, policy) -> bool:
        return first.checkpointed and first.nested is None and second.checkpointed and second.nested is None \
            and policy.lossy

    return [Boundary(policy, caller) if stored_across(first, second, policy) else None
            for first, second, policy in zip(segments, segments[1:], policies[1:])] + [None]


def _held_by_caller(input, made_by: Optional[CallerTensors]) -> int:
    """The bytes of a segment's tensor ``input`` if it is kept by reference (its caller
    holds it: keep_rules.should_encode), counted as a codec counts a tensor; else 0 (for
    other inputs too: describe() reports tensor inputs only)."""
    if not isinstance(input, torch.Tensor) or should_encode(input, made_by):
        return 0
    return input.numel() * input.element_size()


__all__ = ["ChainCall", "run_chain", "run_eagerly", "segments_and_policies", "starts_for_call"]


class ChainState:
    """The module state of a chain's checkpointed segments as the chain's forward
    starts, snapshotted in one copies_of call for all of them rather than one per
    segment (host work per call: a deep chain has dozens of segments), and handed to
    each segment's frame (TouchedState.of). Each segment's modules are walked once, here,
    and handed over too. Right only where no module is under two segments and no two
    segments' buffers share memory: a later segment's state is what the earlier one
    leaves, known only then (NOTE [ Buffers that share memory ]); such a chain
    (and a lone segment) gets nothing here, and each frame snapshots as it starts. A
    frame whose buffers moved after this snapshot (a segment before it changed them
    through an alias or a reference to its module) takes its own too (Snapshot.as_copied)."""

    def __init__(self, segments: list):
        """``segments``: the layers of each checkpointed segment, in order."""
        walked = [modules_under(tuple(layers)) for layers in segments]
        owners = [[module for _, module in modules if own_tensors(module, "buffers")] for modules in walked]
        every = [module for modules in owners for module in modules]
        shared = len({id(module) for module in every}) != len(every)
        taken = snapshot_of(every, early=True) if len(segments) > 1 and not shared else None
        if taken is not None and taken.shares_memory and shared_between(owners):
            taken = None
        parts = [None] * len(segments)
        if taken is not None:
            segment_of = {id(module): i for i, mine in enumerate(owners) for module in mine}
            parts = [Snapshot() for _ in segments]
            for key, value in taken.items():
                parts[segment_of[id(key[0])]][key] = value
            for part in parts:
                part.shares_memory = taken.shares_memory
                part.originals = {key: taken.originals[key] for key in part}
        self._parts = iter(zip(walked, parts))

    def next(self) -> tuple:
        """``(modules, snapshot)`` of the next checkpointed segment (snapshot None: the
        frame takes its own)."""
        return next(self._parts)
