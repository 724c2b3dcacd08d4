"""The solvers: exact dynamic programs over the memory and time model of
memory_model.py.

Dynamic program
    Time-optimal, left to right. A label (P, T, z) at position b is a plan of layers
    [0, b) in checkpointed (and, where the model allows, stored middle) segments:
    P = the bytes they keep, T = their time, z = 1 where the last is a stored middle
    segment whose saves hold x_b (memory_model.py, "A tensor at a stored boundary":
    the next segment's terms, written W_z, R_z, leave x_b out). The Pareto frontier
    L(b) stays small. With L(0) = {(0, 0, 0)},

        L(b) = Pareto { (P + R_z(a,b,o), T + t(a,b,o), z'(a,b,o)) : a < b, o,
                        (P, T, z) in L(a), P + W_z(a,b,o) + C <= budget - X }
               (o ranging over the keep options and "stored": R = Saved(a, b-1),
               t = 0, W + C its largest event, memory_model.py; z' = 1 for
               "stored" where Saved(a, b-1) holds x_b, else 0)
        best = min { T + t_stored(s, k) : s < n, k, (P, T, z) in L(s),
                     P + W_stored,z(s, k) <= budget - X }

    k: how the stored segment keeps autograd's saves (as they are, or by a lossy
    codec: memory_model.py), t_stored its encode and decode time.

    Feasibility depends on a label only through P and z, and time is additive.
    Every term with z = 1 is that with z = 0 less between 0 and x_b, so (P, T, 1)
    needs no more headroom from b than (P, T, 0), and (P, T, 0) no more than
    (P + x_b, T, 1): a label beaten so never leads to a better plan, and the
    frontier drops only those: the DP is exact for the model.
    Smallest peak ("memory" objective, and :func:`balanced`), right to left, one
    number per start, z and candidate C: h_z(a) = min(min_k W_stored,z(a, k),
    min_{b,o} max(W_z(a,b,o) + C, R_z(a,b,o) + h_z'(b))) (o again including
    "stored"), peak = X + h_0(0); then the fastest plan within that peak,
    the time dynamic program run only for the candidates whose h_0(0) fits. With every
    time 0 (a meta profile) the first plan found is kept: the one whose stored
    segment starts earliest, so the fewest layers are recomputed.

    Nested segments (objective "time"): an exact checkpointed segment whose
    recompute nests checkpoints of its own is one more option o for [a, b), with
    R and W + C as nested_model.py prices them; its time depends on the label's P,
    t(a, b, o) + Multi(a, b)[the headroom left], from nested_solver.py's table, so
    each label reads its own. h and the bound that drops labels for good
    (_Prefixes._sources) take the least bytes a nested segment needs
    (NestedTable.least_bytes), so nesting completions are not pruned.

    Stored middle segments end at the first join after their start
    (CostModel.stored_middle_reach: a boundary where two stored segments are one,
    in a chain of layers that save their outputs every boundary), as the plans of
    longer ones are the same plans split there; the plan found joins them again.

    Cost: the option-independent maxima of W for every segment are six n x n
    tables (O(n^2) time and memory, built row by row); the time DP extends every
    live label at each b, O(n^2 L |O|) with L the mean frontier size, vectorized
    over labels, each segment's terms read once per start; a label leaves for good
    once a segment from it to b cannot fit. The memory DP is O(n^2 |O| |C|),
    vectorized over the candidates C. Stored middle segments widen the frontiers (a
    prefix may keep more bytes to recompute less): for 1,000 layers, 1 to 8 s on
    one shared CPU core (tests/planning/test_solver.py prints it);
    balanced plans of ResNet-1001 (339 layers) with int8 and offload, 63 candidates:
    0.3 s.
"""
from __future__ import annotations

import math
from typing import Optional

import numpy as np

from . import nested_model
from .memory_model import CostModel
from .nested_solver import NestedTable, exact_options


def smallest_headroom(model: CostModel, longest: Optional[int] = None) -> float:
    """min over plans of H (the peak less X), over every carry; checkpointed segments
    hold at most ``longest`` layers (None: any number)."""
    return float(_smallest_headrooms(model, longest)[1][0, 0].min())


def _smallest_headrooms(model: CostModel, longest: Optional[int] = None,
                        nested: Optional[NestedTable] = None) -> tuple:
    """(carries, h): h[z, a, c] the docstring's right-to-left recurrence h_z(a), for
    every candidate C at once (the last axis), z = 1 after a stored middle segment
    whose saves hold x_a, over checkpointed segments [a, b) of at most ``longest``
    layers, and, with ``nested``, nested segments within its grid. Computed once per
    model and ``longest`` (once per table with ``nested``)."""
    computed = (nested.__dict__ if nested is not None else model.__dict__).setdefault("_headrooms", {})
    if longest not in computed:
        n, carries = model.n, model.carries()
        h = np.stack([np.repeat(peaks.min(axis=0)[:, None], len(carries), axis=1)
                      for peaks in (model.stored_peaks, model.held_stored_peaks)])
        for a in reversed(range(n - 1)):
            # Where no stored middle segment before a can hold x_a, h_1(a) = h_0(a).
            h[:, a] = _headroom_from(model, a, np.array([[False], [True]]) if model.reused_input[a]
                                     else np.array([[False]]), longest, carries, h, nested)
        computed[longest] = carries, h
    return computed[longest]


def _headroom_from(model: CostModel, a: int, bits: np.ndarray, longest: Optional[int], carries: np.ndarray,
                   h: np.ndarray, nested: Optional[NestedTable] = None) -> np.ndarray:
    """[z, c]: h_z(a) for each z in ``bits`` (a column) and every carry, from h of the
    positions after a; with ``nested``, segments may nest within its grid."""
    n, best = model.n, h[bits[:, 0].astype(np.int64), a]  # the stored segment [a, n)
    b = np.arange(a + 1, n if longest is None else min(n, a + 1 + longest))
    for o in np.nonzero(model.allowed[:, a])[0]:
        kept = np.broadcast_to(model.kept(o, a, b, bits), (len(bits), b.size))
        through = np.maximum(model.working_set(o, a, b, carries, bits), kept[..., None] + h[0, b])
        best = np.minimum(best, through.min(axis=1))
    if nested is not None:  # as nested_model.py prices them, whatever the bit
        for o in exact_options(model):
            working = nested.least_working_set(o)[a, b]
            through = np.maximum(working[:, None] + carries, model.kept(o, a, b)[:, None] + h[0, b])
            best = np.minimum(best, through.min(axis=0))
    if model.store_middle:  # any number of layers, up to the first join (CostModel.stored_middle_reach)
        b = np.arange(a + 1, model.stored_middle_reach[a] + 1)
        rest = np.where(model.stored_middle_holds_output(a, b)[:, None], h[1, b], h[0, b])
        through = np.maximum(model.stored_middle_working_set(a, b, carries, bits),
                             model.stored_middle_kept(a, b, bits)[..., None] + rest)
        best = np.minimum(best, through.min(axis=1))
    return best


def fastest_within(model: CostModel, headroom: float, longest: Optional[int] = None,
                   nest: bool = False) -> Optional[tuple]:
    """The fastest plan with H <= headroom over every carry, as (segments, nested):
    segments [(start, stop, option index, None for a stored middle segment; the
    stored segment last, with ~k for its saves' stored codec k)] and, for each segment
    before the last, the Range cutting its recompute or None (Plan.nested); or None
    when nothing fits. Checkpointed segments hold at most ``longest`` layers (None:
    any number). ``nest``: exact segments may nest checkpoints (nested_solver.py).
    Carries whose smallest H is above ``headroom`` have no such plan and are skipped."""
    best = None
    nested = NestedTable.for_plans(model, headroom, longest) if nest else None
    carries, h = _smallest_headrooms(model, longest, nested)
    for c in np.nonzero(h[0, 0] <= headroom)[0]:
        found = _Prefixes(model, headroom, float(carries[c]), h[:, :, c], longest, nested).fastest()
        if found is not None and (best is None or found[0] < best[0]):
            best = found
    return None if best is None else best[1:]


_STORED = -2  # the option column of a label whose last segment is a stored middle one
_ROOT = -1  # the option column of the empty plan


class _Labels:
    """A growable table of prefix plans: kept bytes P, time T, whether the last segment
    is a stored middle one whose saves hold the next segment's input (held), and how
    each was made."""

    _COLUMNS = {"p": np.float64, "t": np.float64, "held": np.bool_, "position": np.int64, "option": np.int64,
                "previous": np.int64, "nested_room": np.float64}

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
    at s when P + W_stored(s, k) <= headroom for a stored codec k: L(b) and "best" of
    the module docstring.
    With ``longest``, only from labels at a >= b - longest.

    Two bounds drop labels that cannot lead to a strictly faster plan, so the result
    is that of the whole frontier: a label (P, T, z) at b whose P + h_z(b) (``rest[z,
    b]``: the least headroom any plan of the layers from b needs) exceeds the headroom has no
    feasible completion, and one whose T is no less than the best finished plan's
    cannot beat it (times only add)."""

    def __init__(self, model: CostModel, headroom: float, carry: float, rest: np.ndarray,
                 longest: Optional[int] = None, nested: Optional[NestedTable] = None):
        self.model, self.headroom, self.carry, self.rest = model, headroom, carry, rest
        self.longest = model.n if longest is None else longest
        self.nested = nested
        if nested is not None:
            # [a, b]: the least headroom a nested segment [a, b) or a longer one from a
            # needs beyond P, a bound that grows with b as _sources requires.
            least = np.min([nested.least_working_set(o) for o in exact_options(model)], axis=0) + carry
            self.nested_floor = np.minimum.accumulate(least[:, ::-1], axis=1)[:, ::-1]
        self.labels = _Labels()
        self.labels.append(p=np.zeros(1), t=np.zeros(1), held=np.zeros(1, dtype=bool),
                           position=np.zeros(1, dtype=np.int64),
                           option=np.full(1, _ROOT), previous=np.full(1, -1), nested_room=np.full(1, np.nan))
        # (time, label whose plan ends with the stored segment, its stored codec)
        self.best = (math.inf, -1, 0)
        self.alive = np.arange(1)  # the labels that may still extend (_extend_to)

    def fastest(self) -> Optional[tuple]:
        """(extra seconds, segments) of the fastest plan, or None when none fits."""
        self._finish_at(0, np.arange(1))
        for b in range(1, self.model.n):
            frontier = self._extend_to(b)
            self._finish_at(b, frontier)
            self.alive = np.concatenate((self.alive, frontier))
            if not self.alive.size:  # no label extends any further
                break
        if self.best[1] < 0:
            return None
        return (self.best[0], *self._segments_from(self.best[1], self.best[2]))

    def _extend_to(self, b: int) -> np.ndarray:
        """Add the frontier at b; return its label indices."""
        source = self._sources(b)
        if not source.size:
            return source
        new_p, new_t, new_held, option, previous, room = self._candidates(b, source)
        completable = np.nonzero((new_p + self.rest[new_held.astype(np.int64), b] <= self.headroom)
                                 & (new_t < self.best[0]))[0]
        keep = completable[_held_pareto(new_p[completable], new_t[completable], new_held[completable],
                                        self.model.reused_input[b])]
        labels, first = self.labels, self.labels.size
        labels.append(p=new_p[keep], t=new_t[keep], held=new_held[keep], position=np.full(keep.size, b),
                      option=option[keep], previous=previous[keep], nested_room=room[keep])
        return np.arange(first, labels.size)

    def _sources(self, b: int) -> np.ndarray:
        """The labels that may extend to b. W >= the backward events + C whatever the
        option (less x_a where a stored middle segment before holds it): a cheap test
        drops most labels. The bound grows with b (a running maximum) and the best
        time only falls, so a label that fails it now fails it for every later b: it
        leaves ``alive`` for good."""
        labels, model, alive = self.labels, self.model, self.alive
        a, held = labels["position"][alive], labels["held"][alive]
        lowest = labels["p"][alive] + model.backward[a, b] - np.where(held, model.reused_saved[a], 0.0) + self.carry
        if self.nested is not None:  # a nested segment's backward holds less: its own floor
            lowest = np.minimum(lowest, labels["p"][alive] + self.nested_floor[a, b])
        self.alive = alive[(lowest <= self.headroom) & (labels["t"][alive] < self.best[0])]
        return self.alive

    def _candidates(self, b: int, source: np.ndarray) -> tuple:
        """(P, T, bit, option, previous label) of every allowed extension of the labels
        ``source`` (in order of position) to b."""
        labels, model, carry = self.labels, self.model, np.array([self.carry])
        p, t, held = labels["p"][source], labels["t"][source], labels["held"][source]
        # A segment's terms depend on the label only through its start and bit: read
        # them once per start and bit, [bit, start], then for each label.
        positions = labels["position"][source]
        first_of_start = np.diff(positions, prepend=-1) != 0
        starts, start_of = positions[first_of_start], np.cumsum(first_of_start) - 1
        bits = np.array([[False], [True]]) if held.any() else np.array([[False]])
        at = (held.astype(np.int64), start_of)
        parts = []

        def extend(ok, kept, seconds, holds, option, room=None) -> None:
            ok = np.nonzero(ok)[0]
            if ok.size:
                kept = np.broadcast_to(kept, (len(bits), starts.size))  # one row where no bit matters
                room = np.full(ok.size, np.nan) if room is None else room[ok]
                parts.append((p[ok] + kept[at][ok], t[ok] + seconds[ok], holds[ok], np.full(ok.size, option),
                              source[ok], room))

        if model.store_middle:  # any length up to the first join (CostModel.stored_middle_reach)
            working = model.stored_middle_working_set(starts[None], b, carry, bits)[..., 0]
            ok = (model.stored_middle_reach[starts] >= b)[start_of] & (p + working[at] <= self.headroom)
            extend(ok, model.stored_middle_kept(starts[None], b, bits), np.zeros(source.size),
                   model.stored_middle_holds_output(starts, b)[start_of], _STORED)
        near = (positions >= b - self.longest) if self.longest < model.n else True
        for o in range(len(model.options)):
            ok = near & (p + model.working_set(o, starts[None], b, carry, bits)[..., 0][at] <= self.headroom)
            extend(ok, model.kept(o, starts[None], b, bits), model.seconds(o, starts, b)[start_of],
                   np.zeros(source.size, dtype=bool), o)
        if self.nested is not None:  # after the plain options, so that they win ties
            for o in exact_options(model):
                room = self.headroom - p - nested_model.held_outside(model, o, starts, b)[start_of] - carry[0]
                seconds = self.nested.time(positions, b, room)
                ok = near & np.isfinite(seconds)
                extend(ok, model.kept(o, starts[None], b), model.seconds(o, starts, b)[start_of] + seconds,
                       np.zeros(source.size, dtype=bool), o, room)
        if not parts:
            empty = np.empty(0)
            return empty, empty, empty.astype(bool), empty.astype(np.int64), empty.astype(np.int64), empty
        return tuple(np.concatenate(columns) for columns in zip(*parts))

    def _finish_at(self, s: int, at: np.ndarray) -> None:
        """End the plans of labels ``at`` (position s) with the stored segment [s, n),
        its saves kept by each stored codec k in turn (as they are first, so that it
        wins ties)."""
        held = self.labels["held"][at]
        for k in range(len(self.model.stored_codecs)):
            peak = np.where(held, self.model.held_stored_peaks[k, s], self.model.stored_peaks[k, s])
            fits = at[self.labels["p"][at] + peak <= self.headroom]
            if fits.size:
                best = fits[np.argmin(self.labels["t"][fits])]
                seconds = float(self.labels["t"][best]) + self.model.stored_time[k, s]
                if seconds < self.best[0]:
                    self.best = (seconds, int(best), k)

    def _segments_from(self, label: int, stored: int) -> tuple:
        """([(start, stop, option, None for a stored middle segment)], nested) of a
        finished plan, the stored segment last with ~k for its stored codec k, and the
        Range of each segment before it that nests, else None (CostModel.predict)."""
        labels, reach = self.labels, self.model.stored_middle_reach
        stops, nested = [(int(labels["position"][label]), self.model.n, ~stored)], []
        while labels["previous"][label] >= 0:
            previous = int(labels["previous"][label])
            option = None if labels["option"][label] == _STORED else int(labels["option"][label])
            start, stop = int(labels["position"][previous]), int(labels["position"][label])
            after = stops[-1]
            if option is None and after[2] is None and reach[stop - 1] == stop:  # one stored segment
                stops[-1] = (start, after[1], None)
            else:
                stops.append((start, stop, option))
                room = float(labels["nested_room"][label])
                nested.append(None if math.isnan(room) else self.nested.tree(start, stop, room))
            label = previous
        return stops[::-1], nested[::-1]


_SAMPLED = 1024  # pairs whose frontier screens the rest before the full sort


def _held_pareto(p: np.ndarray, t: np.ndarray, held: np.ndarray, reused: float) -> np.ndarray:
    """Indices of the labels at one position that may lead to a faster plan. A held
    label (its stored middle segment holds the next input, ``reused`` bytes) needs
    at most as much headroom from here as an unheld one of the same P, and at least
    that less ``reused``: it beats an unheld label of no smaller P and T, and is
    beaten by an unheld one at least ``reused`` smaller in P and no larger in T,
    strictly smaller in one (so that of two labels beating each other, one stays)."""
    unheld, holding = np.nonzero(~held)[0], np.nonzero(held)[0]
    unheld = unheld[_pareto(p[unheld], t[unheld])]
    holding = holding[_pareto(p[holding], t[holding])]
    unheld = unheld[~_beaten(p[holding], t[holding], p[unheld], t[unheld], strictly=False)]
    holding = holding[~_beaten(p[unheld] + reused, t[unheld], p[holding], t[holding], strictly=True)]
    return np.concatenate((unheld, holding))


def _beaten(by_p: np.ndarray, by_t: np.ndarray, p: np.ndarray, t: np.ndarray, strictly: bool) -> np.ndarray:
    """Whether some pair (by_p, by_t) is no larger than each (p, t) in both (and, if
    ``strictly``, smaller in one)."""
    if not by_p.size:
        return np.zeros(p.size, dtype=bool)
    order = np.argsort(by_p, kind="stable")
    least_t = np.minimum.accumulate(by_t[order])  # the least T among the pairs up to each P
    at_most = np.searchsorted(by_p[order], p, side="right") - 1
    beaten = (at_most >= 0) & (least_t[np.maximum(at_most, 0)] <= t)
    if strictly:
        below = np.searchsorted(by_p[order], p, side="left") - 1
        smaller_t = (at_most >= 0) & (least_t[np.maximum(at_most, 0)] < t)
        smaller_p = (below >= 0) & (least_t[np.maximum(below, 0)] <= t)
        beaten = smaller_t | smaller_p
    return beaten


def _pareto(p: np.ndarray, t: np.ndarray) -> np.ndarray:
    """Indices of the pairs that no other pair beats in both P and T (of equal pairs,
    one). Many pairs: first the frontier of a sample drops every pair it beats or
    equals, so that only the few left are sorted (the same frontier: each pair dropped
    is beaten or equalled by a sample pair, which stays)."""
    if len(p) <= 2 * _SAMPLED:
        return _sorted_pareto(p, t)
    sample = np.unique(np.concatenate((np.linspace(0, len(p) - 1, _SAMPLED).astype(np.int64),
                                       [np.argmin(p), np.argmin(t)])))
    front = sample[_sorted_pareto(p[sample], t[sample])]  # P increasing, T decreasing
    front = front[np.argsort(p[front], kind="stable")]
    at = np.searchsorted(p[front], p, side="right") - 1  # the sample frontier's last pair with P <= p
    beaten = (at >= 0) & (t[front[np.maximum(at, 0)]] <= t)
    # Each front pair equals itself (the front's P are distinct), so none is left
    # unbeaten: the two index sets are disjoint.
    rest = np.concatenate((np.nonzero(~beaten)[0], front))
    return rest[_sorted_pareto(p[rest], t[rest])]


def _sorted_pareto(p: np.ndarray, t: np.ndarray) -> np.ndarray:
    order = np.lexsort((t, p))
    best_before = np.minimum.accumulate(np.concatenate(([np.inf], t[order][:-1])))
    return order[t[order] < best_before]
