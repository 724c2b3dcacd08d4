"""The memory and time model of a checkpointed segment whose recompute nests
checkpoints of its own (runtime/nested.py, NOTE [ Nested recompute ]), in the terms of
memory_model.py.

A nested segment [a, b) is exact and on the device; its recompute is cut by a
:class:`~actsave.runtime.nested.Range` tree. Processing a recomputed range r = [c, d)
means its pass (a forward over its parts) and then the backward of its parts, last
first. With P_j the bytes kept by r's parts before part j (a recomputed part keeps its
input, R = x_s, except the first, whose input is r's own and held outside; a stored
part keeps Saved(s, e-1), less r's input where the first one saves it), r's largest
event, beyond what is held outside r (its input included), is

    E(r) = max_j P_j + max( pass_j + g_d,  after_j )
      stored part [s, e)       pass_j  = its forward events: Saved(s, i-1) + U(i) + fwd_i
                                         (as a recompute, Saved'(s, i-1) + U(i) + B(s, i)
                                         + fwd_i, for the first part: its input is held)
                               after_j = its backward events less O: Saved(s, i) +
                                         g_{i+1} + bwd_i (Saved' for the first part)
      recomputed part [s, e)   pass_j  = R + max_i ([i > s] x_i + fwd_i)   (no_grad)
                               after_j = R + Q_s + E(part)

where g_d, the gradient arriving at r, is held while r's pass runs, and fwd_i, the
layer's rise measured with grad, bounds its rise under no_grad. The pass also pins, to
its end, the input of each stored part that follows a recomputed one (the leaf that
gives it the forward's requires_grad is held by the pass's graph), where the part's
layers do not save it, and the copy an in-place first layer modifies (Q): added to
the pass events from that part on. A top-level nested
segment's working set is W = O + K + Q + C + E(top), O, K, Q and C as for any
checkpointed segment (memory_model.py), and it keeps R = K until its recompute.

Time: every recomputed range's pass runs the forward of its layers once more, so a
nested segment adds sum over the recomputed ranges r of its tree of forward(r); the
top range alone is the single-level segment's time.
"""
from __future__ import annotations

import numpy as np

from ..runtime.nested import Range


def working_set(model, o: int, a: int, b: int, top: Range, carry: float) -> float:
    """W + C of the nested segment [a, b) kept by option o (exact, on the device),
    its recompute cut as ``top`` (relative to a) says."""
    held = model.held_in_backward + float(model.kept(o, a, b)) + model.private_copy[a] + carry
    return held + _largest_event(model, a, top, external_input=True)


def seconds(model, o: int, a: int, top: Range) -> float:
    """t of the nested segment starting at a: its passes' forwards."""
    before = model.forward_s_before
    return float(model.seconds(o, a, a + top.stop)) + sum(
        before[a + r.stop] - before[a + r.start] for r in top.walk() if r.recomputed and r is not top)


def _largest_event(model, a: int, r: Range, external_input: bool) -> float:
    """E(r) of the module docstring, r relative to layer a."""
    gradient = model.grad[a + r.stop]
    kept_before, pinned, largest = 0.0, 0.0, -np.inf
    parts = r.parts
    for j, part in enumerate(parts):
        s, e = a + part.start, a + part.stop
        first = j == 0
        if not first and parts[j - 1].recomputed and not part.recomputed:
            pinned += float(model.input[s]) - _own_input_saved(model, s, e) + model.private_copy[s]
        if part.recomputed:
            kept = 0.0 if first else model.input[s]
            later = np.arange(s, e)
            inputs = np.where(later > s, model.input[later], 0.0)
            during_pass = kept + (inputs + model.forward_rise[s:e]).max()
            after = kept + model.private_copy[s] + _largest_event(model, a, part, external_input=True)
        else:
            events, stop = model.events_from(s), e - s
            own_input = _own_input_saved(model, s, e) if first else 0.0
            forward = events.recompute[:stop] if first else events.stored_forward[:stop]
            during_pass = forward.max()
            after = (events.backward[:stop] - model.held_in_backward).max() - own_input
            kept = float(events.saved[stop - 1]) - own_input
        largest = max(largest, kept_before + pinned + during_pass + gradient, kept_before + after)
        kept_before += kept
    return largest


def _own_input_saved(model, s: int, e: int) -> float:
    """The part's input where a layer of [s, e) saves it (held outside, so not kept)."""
    return float(model.input[s]) if model.input_first[s] < e and model.input_last[s] >= s else 0.0
