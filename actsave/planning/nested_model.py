"""The memory and time model of a checkpointed segment whose recompute nests
checkpoints of its own (runtime/nested.py, NOTE [ Nested recompute ]), in the terms of
memory_model.py.

A nested segment [a, b) is exact and on the device; its recompute is cut by a
:class:`~actsave.runtime.nested.Range` tree. Processing a recomputed range r = [c, d)
means its pass (a forward over its parts) and then the backward of its parts, last
first. With P_j the bytes kept by r's parts before part j (a recomputed part keeps its
input, R = x_s, except the first, whose input is r's own and held outside, and one
after a plain part whose saves hold x_s, processed after it; one whose first layer
changes its input in place keeps a copy of it, wherever the input is held; a plain
part keeps Saved(s, e-1), less r's input where the first one saves it), r's largest
event, beyond what is held outside r (its input included), is

    E(r) = max_j P_j + max( pass_j + g_d,  after_j )
      plain part [s, e)       pass_j  = its forward events: Saved(s, i-1) + U(i) + fwd_i
                                         (as a recompute, Saved'(s, i-1) + U(i) + fwd_i,
                                         for the first part: its input is held)
                               after_j = its backward events less O: Saved(s, i) +
                                         g_{i+1} + bwd_i (Saved' for the first part)
      recomputed part [s, e)   pass_j  = R + max_i ([i > s or a copy] x_i + nfwd_i)
                                         ("a copy": R is one, and j > 0)
                               after_j = R + Q_s + E(part)

where g_d, the gradient arriving at r, is held while r's pass runs, fwd_i is the
layer's rise in a forward with grad, and nfwd_i its rise under no_grad, which runs
recomputed parts (the profile measures both). The last plain part of a range ends
the pass at its last save (runtime/nested.py, the early stop), as a single-level
recompute does (memory_model.py, recompute_to_last_save). A plain part after a
recomputed one runs as any plain forward does: the pass gives its input the
forward's requires_grad without holding it (runtime/nested.py, _RequiresGrad) and
runs on copies of the snapshot of module state its layers mutate (runtime/state.py),
runs its plain parts on the snapshot itself (their layers' last run), and its
recomputed parts, run without grad, on copies of their layers' share of it, made as
the part starts and dropped as it ends: M(s, e) in the part's pass.

A top-level nested segment's working set is W = O + K + Q + C + E(top), O, K, Q and
C as for any checkpointed segment (memory_model.py), or its forward's largest event
where that is larger (NOTE [ A checkpointed segment's forward ]: the forward is one
pass whatever the cut), and it keeps R = K until its
recompute; after a plain middle segment whose saves hold x_a, K (x_a itself) is
counted there (memory_model.py, "A tensor at a plain boundary"), and its first
part's saves of x_a are K's storage.

Time: every recomputed range's pass runs the forward of its layers once more, a
checkpointed call of its own, so a nested segment adds sum over the recomputed ranges
r of its tree of forward(r) and the call's host work c (memory_model.py): each layer
saves in one pass only, so the top range, the single-level segment's time, counts
every save's host work h.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ..runtime.nested import Range
from .layer_events import until_last_save


class Part(NamedTuple):
    """A part [s, e) of a range's pass, for every end e of an array (module docstring):
    what it keeps for the rest of the pass and its backward (R; a plain part its saves),
    its largest event during the pass and after it, each beyond the bytes the parts
    before it keep and g_d (a recomputed part's ``after`` less its own E(part))."""

    kept: np.ndarray
    during_pass: np.ndarray
    after: np.ndarray


def held_outside(model, o: int, a, b, input_held=False) -> np.ndarray:
    """O + K + Q of the nested segment [a, b) kept by option o, for broadcastable
    starts, ends and ``input_held`` (after a plain middle segment whose saves hold
    x_a, which holds K then: CostModel.kept): what its top range's events come on top
    of, less the carry. Its first part's saves of x_a are the same storage as K
    (Part.kept), so neither counts x_a again. The snapshot M of module state, in R, is
    held to the last pass (what autograd saves of it, to the layers' backward)."""
    return model.held_in_backward + model.kept(o, a, b, input_held) + model.private_copy[a]


def working_set(model, o: int, a: int, b: int, top: Range, carry: float, input_held: bool = False) -> float:
    """W + C of the nested segment [a, b) kept by option o (exact, on the device),
    its recompute cut as ``top`` (relative to a) says (``input_held``: as held_outside)."""
    forward = model.held_in_forward(o, a, b, input_held) + model.events_from(a).checkpointed_forward[:b - a].max()
    return max(float(forward), float(held_outside(model, o, a, b, input_held)) + carry + _largest_event(model, a, top))


def seconds(model, o: int, a: int, top: Range) -> float:
    """t of the nested segment starting at a: its passes' forwards, each a
    checkpointed call of its own (checkpoint_host.py). Each layer saves in one pass
    only, the one that runs it with grad (the others run it without), so the top
    range's time counts every save's host work, and the inner ranges their forwards
    and calls."""
    before = model.forward_s_before
    return float(model.seconds(o, a, a + top.stop)) + sum(
        model.call_s + before[a + r.stop] - before[a + r.start] for r in top.walk() if r.recomputed and r is not top)


def plain_part(model, s: int, stops: np.ndarray, first: bool, events=None, last: bool = False) -> Part:
    """The plain part [s, e) for each e in ``stops`` (``events``: model.events_from(s),
    where the caller has it). The first part of a range runs as a recompute from the
    range's input, held outside it, so neither its pass nor what it keeps counts it. A
    later part runs as a plain forward whose input nothing else holds (the pass hands
    it over): no [x_s] after its first layer. The ``last`` part of its range ends the
    pass at its last save (the early stop), as a single-level recompute does; one that
    saves nothing is priced whole (the pass ends before it, lower)."""
    events = model.events_from(s) if events is None else events
    at = stops - s - 1
    own_input = own_input_saved(model, s, stops) if first else 0.0
    forward = events.recompute if first else events.plain_forward - events.caller_held
    during_pass = np.maximum.accumulate(forward)[at]
    if last:
        to_last_save = forward - model.forward_rise[s:] + model.rise_to_last_save[s:]
        saver = model.last_saver[stops - 1] - s
        during_pass = np.where(saver >= 0, until_last_save(forward, to_last_save, saver), during_pass)
    return Part(kept=events.saved[at] - own_input, during_pass=during_pass,
                after=np.maximum.accumulate(events.backward - model.held_in_backward)[at] - own_input)


def recomputed_part(model, s: int, stops: np.ndarray, first: bool, input_held: bool = False) -> Part:
    """The recomputed part [s, e) for each e in ``stops``: it keeps its input (the
    range's own, held outside, for the first; ``input_held``: held by the saves of the
    plain part before it, processed after it) and runs under no_grad, holding one
    layer's input and rise at a time; its ``after`` is what its own backward holds
    beyond its E(part): R and the private copy an in-place first layer recomputes from.
    Where its first layer changes its input in place, what it keeps is a copy, even of
    an input held elsewhere (runtime/keep_rules.py), and a later part's input, changed
    beside it, is one more tensor as that layer runs, unless held."""
    copy = float(model.kept_copy[s])
    held_elsewhere = first or input_held
    if copy:
        kept = copy
    else:
        kept = 0.0 if held_elsewhere else float(model.input[s])
    input_beside_copy = bool(copy) and not held_elsewhere
    later = np.arange(s, stops.max())
    inputs = np.where((later > s) | input_beside_copy, model.input[later], 0.0)
    copies = model.state(s, stops)  # of the module state the part's layers mutate
    during_pass = kept + copies + np.maximum.accumulate(inputs + model.no_grad_rise[later])[stops - s - 1]
    return Part(kept=np.full(stops.shape, kept), during_pass=during_pass,
                after=np.full(stops.shape, kept + model.private_copy[s]))


def _largest_event(model, a: int, r: Range) -> float:
    """E(r) of the module docstring, r relative to layer a."""
    gradient = model.grad[a + r.stop]
    kept_before, largest, parts = 0.0, -np.inf, r.parts
    for j, part in enumerate(parts):
        s, stop = a + part.start, np.array([a + part.stop])
        if part.recomputed:
            terms = recomputed_part(model, s, stop, first=j == 0, input_held=j > 0 and input_held_before(
                model, a + parts[j - 1].start, s, parts[j - 1].recomputed))
            after = float(terms.after[0]) + _largest_event(model, a, part)
        else:
            terms = plain_part(model, s, stop, first=j == 0, last=j == len(parts) - 1)
            after = float(terms.after[0])
        largest = max(largest, kept_before + float(terms.during_pass[0]) + gradient,
                      kept_before + after)
        kept_before += float(terms.kept[0])
    return largest


def input_held_before(model, c, s, recomputed) -> np.ndarray:
    """Whether the part [c, s) before a part starting at s holds x_s: it is plain and
    its saves hold it (broadcastable arrays)."""
    return ~np.asarray(recomputed) & model.saved_within(s, c, s - 1)


def own_input_saved(model, s: int, stops) -> np.ndarray:
    """The part's input where a layer of [s, e) saves it (held outside, so not kept)."""
    return np.where(model.saved_within(s, s, stops - 1), model.input[s], 0.0)
