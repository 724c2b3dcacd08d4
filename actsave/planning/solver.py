"""The solvers: exact dynamic programs over memory_model.py's memory and time model.

Dynamic program
    Time-optimal, left to right. A label (P, T, z) at position b is a plan of layers
    [0, b) in checkpointed (and, where the model allows, plain middle) segments:
    P = the bytes they keep, T = their time, z = 1 where the last is a plain middle
    segment whose saves hold x_b (memory_model.py, "A tensor at a plain boundary":
    the next segment's terms, written W_z, R_z, leave x_b out). The Pareto frontier
    L(b) stays small. With L(0) = {(0, 0, 0)},

        L(b) = Pareto { (P + R_z(a,b,o), T + t(a,b,o), z'(a,b,o)) : a < b, o,
                        (P, T, z) in L(a), P + W_z(a,b,o) + C <= budget - X }
               (o ranging over the keep options, "plain": R = Saved(a, b-1),
               t = 0, W + C its largest event, memory_model.py; z' = 1 for
               "plain" where Saved(a, b-1) holds x_b, else 0; and "plain, saves
               kept by lossy codec k": R = Saved_k(a, b-1), t its encodes and
               decodes, z' = 0, where the plain segment's saves may be coded)
        best = min { T + t_plain(s, k) : s < n, k, (P, T, z) in L(s),
                     P + W_plain,z(s, k) <= budget - X }

    k: how the plain segment keeps autograd's saves (as they are, or by a lossy
    codec: memory_model.py), t_plain its encode and decode time.

    Feasibility depends on a label only through P and z, and time is additive.
    Every term with z = 1 is that with z = 0 less between 0 and x_b, so (P, T, 1)
    needs no more headroom from b than (P, T, 0), and (P, T, 0) no more than
    (P + x_b, T, 1): a label beaten so never leads to a better plan, and the
    frontier drops only those: the DP is exact for the model.
    Smallest peak ("memory" objective, and :func:`balanced`), right to left, one
    number per start, z and candidate C: h_z(a) = min(min_k W_plain,z(a, k),
    min_{b,o} max(W_z(a,b,o) + C, R_z(a,b,o) + h_z'(b))) (o again including
    "plain"), peak = X + h_0(0); then the fastest plan within that peak,
    the time dynamic program run only for the candidates whose h_0(0) fits. With every
    time 0 (a meta profile) the first plan found is kept: the one whose plain
    segment starts earliest, so the fewest layers are recomputed.

    Nested segments (objective "time"): an exact checkpointed segment whose
    recompute nests checkpoints of its own is one more option o for [a, b), with
    R and W + C as nested_model.py prices them; its time depends on the label's P,
    t(a, b, o) + Multi(a, b)[the headroom left], from nested_solver.py's table, so
    each label reads its own. h and the bound that drops labels for good
    (_Prefixes._sources) take the least bytes a nested segment needs
    (NestedTable.least_bytes), so nesting completions are not pruned.

    Plain middle segments end at the first join after their start
    (CostModel.plain_middle_reach: a boundary where two plain segments are one,
    in a chain of layers that save their outputs every boundary), as the plans of
    longer ones are the same plans split there; the plan found joins them again.
    Those whose saves a codec keeps are not additive (a tensor saved across a
    boundary is encoded on each side): every one is read. Their R and t are a key of
    the start plus a term of the end, as a checkpoint's, so they have a Sweep of their
    own; and a bound of their own that drops labels for good (the backward events of
    encoded saves, which hold less than Saved), so that a label only they can extend
    leaves the checkpoints' sweeps (Labels' ``live`` and ``coded_live``).

    Cost: the option-independent maxima of W for every segment are six n x n
    tables (O(n^2) time and memory, built row by row); the time DP extends every
    live label at each b, O(n^2 L |O|) with L the mean frontier size, vectorized
    over labels, each segment's terms read once per start; a label leaves for good
    once a segment from it to b cannot fit. The memory DP is O(n^2 |O| |C|),
    vectorized over the candidates C. Plain middle segments widen the frontiers (a
    prefix may keep more bytes to recompute less), to tens of thousands of live
    labels on long chains at tight budgets; once more than _SWEPT labels extend, each
    option kept on the device reads only those a Sweep (pareto.py) leaves (its staircase, far
    fewer), its W + C gathered from a table of every segment built once per option
    and carry (CostModel.working_set). Measured planning times: docs/results.md,
    "Planning time" (tests/planning/test_solver.py prints them for 1,000 layers).
"""
from __future__ import annotations

import math
from typing import Optional

import numpy as np

from . import nested_model
from .memory_model import CostModel
from .nested_solver import NestedTable, exact_options
from .pareto import BITS, Batch, CodedKeys, Labels, OptionKeys, Sweep, Window, held_pareto
from .planned_segment import PlannedSegment


def smallest_headroom(model: CostModel, longest: Optional[int] = None) -> float:
    """min over plans of H (the peak less X), over every carry; checkpointed segments
    hold at most ``longest`` layers (None: any number)."""
    return float(_smallest_headrooms(model, longest)[1][0, 0].min())


def smallest_nested_headroom(model: CostModel, longest: Optional[int] = None,
                             start: Optional[tuple] = None) -> tuple:
    """(H, table): the least H within which :func:`fastest_within` with ``nest=True``
    finds a plan, and the nested table searched there (None where it does not nest).

    Below the single-level least H only nested segments help. Their table's grid is
    set by the headroom (NestedTable.unit_for: about H / GRID), and a plan that fits on
    one grid fits on every finer one (each term rounds up to no more), so the least H
    on one grid is searched again on the finer grid of that H, until the grid is that
    H's own (there a smaller H gives the same least). ``start``: (H, table) of this
    search for the same profile with fewer options: its plans are plans here too, so
    the search begins from its least, on its table (no table is built where the
    grid stays)."""
    headroom = smallest_headroom(model, longest)
    if not NestedTable.nests(model, headroom, longest):
        return headroom, None
    if start is not None and start[1] is not None and start[0] <= headroom:
        headroom, candidate = start[0], start[1].for_options_of(model)
    else:
        candidate = NestedTable(model, headroom)
    while True:
        least = float(_smallest_headrooms(model, longest, candidate)[1][0, 0].min())
        if least > headroom:  # nesting does not reach below the single-level least
            return headroom, candidate
        headroom, table = least, candidate
        if NestedTable.unit_for(headroom) == candidate.unit or not NestedTable.nests(model, headroom, longest):
            return headroom, table
        candidate = NestedTable(model, headroom)


def _smallest_headrooms(model: CostModel, longest: Optional[int] = None,
                        nested: Optional[NestedTable] = None) -> tuple:
    """(carries, h): h[z, a, c] the docstring's right-to-left recurrence h_z(a), for
    every candidate C at once (the last axis), z = 1 after a plain middle segment
    whose saves hold x_a, over checkpointed segments [a, b) of at most ``longest``
    layers, and, with ``nested``, nested segments within its grid. Computed once per
    model and ``longest`` (once per table with ``nested``)."""
    computed = (nested.__dict__ if nested is not None else model.__dict__).setdefault("_headrooms", {})
    if longest not in computed:
        n, carries = model.n, model.carries()
        h = np.stack([np.repeat(peaks.min(axis=0)[:, None], len(carries), axis=1)
                      for peaks in (model.plain_peaks, model.held_plain_peaks)])
        for a in reversed(range(n - 1)):
            # Where no plain middle segment before a can hold x_a, h_1(a) = h_0(a).
            h[:, a] = _headroom_from(model, a, np.array([[False], [True]]) if model.reused_input[a]
                                     else np.array([[False]]), longest, carries, h, nested)
        computed[longest] = carries, h
    return computed[longest]


def _headroom_from(model: CostModel, a: int, bits: np.ndarray, longest: Optional[int], carries: np.ndarray,
                   h: np.ndarray, nested: Optional[NestedTable] = None) -> np.ndarray:
    """[z, c]: h_z(a) for each z in ``bits`` (a column) and every carry, from h of the
    positions after a; with ``nested``, segments may nest within its grid."""
    rows = bits[:, 0].astype(np.int64)
    n, best = model.n, h[rows, a]  # the plain segment [a, n)
    b = np.arange(a + 1, n if longest is None else min(n, a + 1 + longest))
    # (o, W + C) of each checkpointed segment [a, b): plain, then nested within the grid
    checkpointed = [(o, model.working_set(o, a, b, carries, bits)) for o in np.nonzero(model.allowed[:, a])[0]]
    if nested is not None:
        checkpointed += [(o, nested.least_working_set(o)[rows, a][:, b][..., None] + carries)
                         for o in exact_options(model)]
    for o, working in checkpointed:
        kept = np.broadcast_to(model.kept(o, a, b, bits), (len(bits), b.size))
        through = np.maximum(working, kept[..., None] + h[0, b])
        best = np.minimum(best, through.min(axis=1))
    if model.plain_middle:  # any number of layers, up to the first join (CostModel.plain_middle_reach)
        b = np.arange(a + 1, model.plain_middle_reach[a] + 1)
        rest = np.where(model.plain_middle_holds_output(a, b)[:, None], h[1, b], h[0, b])
        through = np.maximum(model.plain_middle_working_set(a, b, carries, bits),
                             model.plain_middle_kept(a, b, bits)[..., None] + rest)
        best = np.minimum(best, through.min(axis=1))
    if model.coded_middle:  # saves kept by a lossy codec: they hold no next input as it is
        b = np.arange(a + 1, n)
        for k in range(1, len(model.stored_codecs)):
            through = np.maximum(model.coded_middle_working_set(k, a, b, carries, bits),
                                 model.coded_middle_kept(k, a, b, bits)[..., None] + h[0, b])
            best = np.minimum(best, through.min(axis=1))
    return best


def fastest_within(model: CostModel, headroom: float, longest: Optional[int] = None,
                   nest: bool = False) -> Optional[tuple]:
    """The fastest plan with H <= headroom over every carry, as (segments, nested):
    its PlannedSegments (NOTE [ Planned segments ]) and, for each segment before the
    last, the Range cutting its recompute or None (Plan.nested); or None
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


# The option column of a label whose last segment is a plain middle one, its saves
# kept by stored codec k: _PLAIN - k (as autograd keeps them: _PLAIN). Labels keep
# kinds and options as integers, PlannedSegments are made from them only for the plan
# found (_Prefixes._segments_from).
_PLAIN = -2
_ROOT = -1  # the option column of the empty plan


_SWEPT = 2048  # more labels extending than this: a Sweep reads fewer (below, its upkeep costs more)


class _Prefixes:
    """The time-optimal dynamic program, left to right over prefix plans (the layers
    before b, all in checkpointed segments): at each b the Pareto frontier of (P, T),
    P = kept bytes, T = time so far. All prefixes ending at b recompute the same
    layers, so T differs only by codec and copy costs and frontiers stay small.

    Each label at b extends a label at a < b by the segment [a, b) with option o,
    allowed when P + W(a,b,o) + C <= headroom; a plan ends with the plain segment
    at s when P + W_plain(s, k) <= headroom for a stored codec k: L(b) and "best" of
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
            # [bit, a, b]: the least headroom a nested segment [a, b) or a longer one
            # from a needs beyond P, a bound that grows with b as _sources requires.
            least = np.min([nested.least_working_set(o) for o in exact_options(model)], axis=0) + carry
            self.nested_floor = np.minimum.accumulate(least[..., ::-1], axis=-1)[..., ::-1]
        self.labels = Labels()
        self.labels.append(p=np.zeros(1), t=np.zeros(1), held=np.zeros(1, dtype=bool),
                           position=np.zeros(1, dtype=np.int64),
                           option=np.full(1, _ROOT), previous=np.full(1, -1), nested_room=np.full(1, np.nan),
                           live=np.ones(1, dtype=bool), coded_live=np.ones(1, dtype=bool))
        # (time, label whose plan ends with the plain segment, its stored codec)
        self.best = (math.inf, -1, 0)
        # The labels that may still extend (_sources): by a checkpointed or exact plain
        # segment, and by a plain one whose saves a codec keeps.
        self.alive = np.arange(1)
        self.coded_alive = np.arange(1) if model.coded_middle else np.arange(0)
        # option (_PLAIN - k for plain middle segments kept by codec k) -> Sweep, from the
        # first b where more than _SWEPT labels extend
        self.sweeps = {}

    def fastest(self) -> Optional[tuple]:
        """(extra seconds, segments) of the fastest plan, or None when none fits."""
        self._finish_at(0, np.arange(1))
        for b in range(1, self.model.n):
            frontier = self._extend_to(b)
            self._finish_at(b, frontier)
            self.alive = np.concatenate((self.alive, frontier))
            if self.model.coded_middle:
                self.coded_alive = np.concatenate((self.coded_alive, frontier))
            for sweep in self.sweeps.values():
                sweep.add(self.labels, frontier)
            if not (self.alive.size or self.coded_alive.size):  # no label extends any further
                break
        if self.best[1] < 0:
            return None
        return (self.best[0], *self._segments_from(self.best[1], self.best[2]))

    def _extend_to(self, b: int) -> np.ndarray:
        """Add the frontier at b; return its label indices."""
        source, coded_source = self._sources(b)
        if not (source.size or coded_source.size):
            return source
        new_p, new_t, new_held, option, previous, room = self._candidates(b, source, coded_source)
        completable = np.nonzero((new_p + self.rest[new_held.astype(np.int64), b] <= self.headroom)
                                 & (new_t < self.best[0]))[0]
        keep = completable[held_pareto(new_p[completable], new_t[completable], new_held[completable],
                                        self.model.reused_input[b])]
        labels, first = self.labels, self.labels.size
        labels.append(p=new_p[keep], t=new_t[keep], held=new_held[keep], position=np.full(keep.size, b),
                      option=option[keep], previous=previous[keep], nested_room=room[keep],
                      live=np.ones(keep.size, dtype=bool), coded_live=np.ones(keep.size, dtype=bool))
        return np.arange(first, labels.size)

    def _sources(self, b: int) -> tuple:
        """(labels that may extend to b by a checkpointed or exact plain segment, those
        that may by a plain one whose saves a codec keeps). W >= the backward events + C
        whatever the option (less x_a where a plain middle segment before holds it),
        those of its encoded saves for the latter: a cheap test drops most labels. The
        bound grows with b (a running maximum) and the best time only falls, so a label
        that fails it now fails it for every later b: it leaves ``alive`` (or
        ``coded_alive``) for good."""
        labels, model, alive = self.labels, self.model, self.alive
        a, held = labels["position"][alive], labels["held"][alive]
        lowest = labels["p"][alive] + model.backward[a, b] - np.where(held, model.reused_saved[a], 0.0) + self.carry
        if self.nested is not None:  # a nested segment's backward holds less: its own floor
            lowest = np.minimum(lowest, labels["p"][alive] + self.nested_floor[held.astype(np.int64), a, b])
        self.alive = self._still(alive, lowest, "live")
        if model.coded_middle:
            alive = self.coded_alive
            a, held = labels["position"][alive], labels["held"][alive]
            backward = np.min([model.coded_middle_backward(k, a, b, held) for k in range(1, len(model.stored_codecs))],
                              axis=0)
            self.coded_alive = self._still(alive, labels["p"][alive] + backward + self.carry, "coded_live")
        return self.alive, self.coded_alive

    def _still(self, alive: np.ndarray, lowest: np.ndarray, flag: str) -> np.ndarray:
        """Of ``alive``, those whose bound ``lowest`` fits and whose time may still beat
        the best; the others' ``flag`` goes for good."""
        extends = (lowest <= self.headroom) & (self.labels["t"][alive] < self.best[0])
        self.labels[flag][alive[~extends]] = False
        return alive[extends]

    def _candidates(self, b: int, source: np.ndarray, coded_source: np.ndarray) -> tuple:
        """(P, T, bit, option, previous label, nested room) of the extensions to b of
        the labels ``source`` and ``coded_source`` (_sources; in order of position)
        that may be on the frontier: every allowed one, less those a Sweep shows
        beaten. In the order of a stable Pareto sort's ties: plain middle segments
        (exact, then kept by each codec), each option, nested segments; within each,
        by label."""
        model, labels, parts, everyone = self.model, self.labels, [], None
        lowest = min(labels["position"][sources[0]] for sources in (source, coded_source) if sources.size)
        window = Window(model, int(lowest), b, self.carry)
        if coded_source.size:
            parts += [self._coded_middle_extensions(coded_source, window, k) for k in range(1, len(model.stored_codecs))]
        if not source.size:
            return tuple(np.concatenate(columns) for columns in zip(*parts))
        if model.plain_middle:
            parts.insert(0, self._plain_middle_extensions(window))
        for o in range(len(model.options)):
            if not model.options[o].offload and source.size > _SWEPT and o not in self.sweeps:
                self.sweeps[o] = Sweep(OptionKeys(model, o))
                self.sweeps[o].add(labels, source)
            if o in self.sweeps:
                batch, (ok, times) = self._swept(o, window)
            else:
                batch = everyone = everyone or Batch(labels, source, window)
                ok, times = self._usable(o, batch)
            parts.append(batch.extensions(ok, window.kept(o), times, False, o))
        if self.nested is not None:  # after the plain options, so that they win ties
            batch = everyone or Batch(labels, source, window)
            for o in exact_options(model):
                outside = nested_model.held_outside(model, o, window.starts[None], b, BITS)
                room = self.headroom - batch.p - outside[batch.at] - self.carry
                seconds = model.seconds(o, window.starts, b)[batch.at[1]] + self.nested.time(batch.positions, b, room)
                ok = self._near(batch) & np.isfinite(seconds)
                parts.append(batch.extensions(ok, window.kept(o), batch.t + seconds, False, o, room))
        return tuple(np.concatenate(columns) for columns in zip(*parts))

    def _swept(self, o: int, window: "Window") -> tuple:
        """(batch, (ok, T)) of the labels whose extension to b by option o (kept on the
        device) may be on the frontier: those of its sweep's staircase where each
        extends and keeps anything, else those one pass over the sweep finds; and
        every label from which the segment keeps nothing (then P + R = P: outside the
        sweep's order)."""
        labels, sweep, b = self.labels, self.sweeps[o], window.b
        keeps_nothing = self._alive_from(self.model.last_saver[b - 1] + 1)
        staircase = sweep.staircase(labels["live"])
        batch = Batch(labels, np.concatenate((staircase, keeps_nothing)), window)
        found = self._usable(o, batch)
        on_staircase = slice(staircase.size)
        if not (found[0][on_staircase] & self.model.saves(batch.positions[on_staircase], b)).all():
            everyone = Batch(labels, sweep.everyone(labels["live"]), window)
            chosen = sweep.undominated(*self._usable(o, everyone, saving=True))
            batch = Batch(labels, np.concatenate((chosen, keeps_nothing)), window)
            found = self._usable(o, batch)
        return batch, found

    def _near(self, batch: "Batch"):
        """Whether a checkpointed segment from each label to b holds at most ``longest``
        layers."""
        return (batch.positions >= batch.window.b - self.longest) if self.longest < self.model.n else True

    def _usable(self, o: int, batch: "Batch", saving: bool = False) -> tuple:
        """(ok, T) of extending each label of ``batch`` to b with option o: whether it
        is allowed and fits (and, with ``saving``, keeps anything), and its time; for
        an option kept on the device, T + t by Sweep's terms (the time before the
        start, then the end's), so that its order is the sweep's."""
        model, b = self.model, batch.window.b
        ok = self._near(batch) & (batch.p + batch.window.working_set(o)[batch.at] <= self.headroom)
        if saving:
            ok &= model.saves(batch.positions, b)
        if not model.options[o].offload:
            times = (batch.t + model.seconds_less_end(o, batch.positions)) + model.recompute_s_before[b]
        else:
            times = batch.t + model.seconds(o, batch.window.starts, b)[batch.at[1]]
        return ok, times

    def _plain_middle_extensions(self, window: "Window") -> tuple:
        """The extensions to b by a plain middle segment: from the labels at the
        positions whose first join is at or after b (CostModel.plain_middle_reach)."""
        model, b, reach = self.model, window.b, self.model.plain_middle_reach
        reaching = window.starts[reach[window.starts] >= b]
        chosen = self._alive_from(reaching[0] if reaching.size else b)
        batch = Batch(self.labels, chosen[reach[self.labels["position"][chosen]] >= b], window)
        starts = window.starts[None]
        working = model.plain_middle_working_set(starts, b, window.carry, BITS)[..., 0]
        ok = batch.p + working[batch.at] <= self.headroom
        holds = model.plain_middle_holds_output(window.starts, b)[batch.at[1]]
        return batch.extensions(ok, model.plain_middle_kept(starts, b, BITS), batch.t, holds, _PLAIN)

    def _coded_middle_extensions(self, source: np.ndarray, window: "Window", k: int) -> tuple:
        """The extensions to b by a plain middle segment whose saves stored codec k
        keeps (its saves hold no next input as it is), from the labels ``source``: all
        of them, or once more than _SWEPT extend, those its Sweep leaves."""
        labels, option = self.labels, _PLAIN - k
        if source.size > _SWEPT and option not in self.sweeps:
            self.sweeps[option] = Sweep(CodedKeys(self.model, k))
            self.sweeps[option].add(labels, source)
        if option in self.sweeps:
            batch, (ok, times) = self._coded_swept(source, window, k)
        else:
            batch = Batch(labels, source, window)
            ok, times = self._coded_usable(batch, k)
        kept = self.model.coded_middle_kept(k, window.starts[None], window.b, BITS)
        return batch.extensions(ok, kept, times, False, option)

    def _coded_swept(self, source: np.ndarray, window: "Window", k: int) -> tuple:
        """(batch, (ok, T)) as _swept, for the plain middle segments kept by codec k:
        its sweep's staircase, or one pass over the sweep where some staircase label's
        segment does not fit; and the labels outside the sweep (whose R is not its
        keys': CostModel.coded_middle_separable), every one."""
        labels, sweep = self.labels, self.sweeps[_PLAIN - k]
        outside = source[~sweep.keys.allowed(labels["position"][source], labels["held"][source])]
        staircase = sweep.staircase(labels["coded_live"])
        batch = Batch(labels, np.concatenate((staircase, outside)), window)
        found = self._coded_usable(batch, k)
        if not found[0][:staircase.size].all():
            everyone = Batch(labels, sweep.everyone(labels["coded_live"]), window)
            chosen = sweep.undominated(*self._coded_usable(everyone, k))
            batch = Batch(labels, np.concatenate((chosen, outside)), window)
            found = self._coded_usable(batch, k)
        return batch, found

    def _coded_usable(self, batch: "Batch", k: int) -> tuple:
        """(ok, T) of extending each label of ``batch`` to b by a plain middle segment
        kept by codec k: whether it fits, and its time by the sweep's terms (the key of
        its start, less its end's), so that its order is the sweep's."""
        model, window = self.model, batch.window
        working = model.coded_middle_working_set(k, window.starts[None], window.b, window.carry, BITS)[..., 0]
        ok = batch.p + working[batch.at] <= self.headroom
        times = (batch.t + model.coded_middle_keys(k, batch.positions)[1]) - model.coded_middle_ends(k, window.b)[1]
        return ok, times

    def _alive_from(self, position: int) -> np.ndarray:
        """The labels that may extend, at ``position`` or later (labels are made in
        order of position)."""
        first = np.searchsorted(self.labels["position"], position, side="left")
        return self.alive[np.searchsorted(self.alive, first):]

    def _finish_at(self, s: int, at: np.ndarray) -> None:
        """End the plans of labels ``at`` (position s) with the plain segment [s, n),
        its saves kept by each stored codec k in turn (as they are first, so that it
        wins ties)."""
        held = self.labels["held"][at]
        for k in range(len(self.model.stored_codecs)):
            peak = np.where(held, self.model.held_plain_peaks[k, s], self.model.plain_peaks[k, s])
            fits = at[self.labels["p"][at] + peak <= self.headroom]
            if fits.size:
                best = fits[np.argmin(self.labels["t"][fits])]
                seconds = float(self.labels["t"][best]) + self.model.plain_time[k, s]
                if seconds < self.best[0]:
                    self.best = (seconds, int(best), k)

    def _segments_from(self, label: int, stored: int) -> tuple:
        """(segments, nested) of a finished plan: its PlannedSegments, the last kept by
        stored codec ``stored``, and the Range of each segment before the last that
        nests, else None (CostModel.predict). Here the labels' integer columns become
        PlannedSegments (NOTE [ Planned segments ])."""
        labels, reach = self.labels, self.model.plain_middle_reach
        segments = [PlannedSegment.plain_last(int(labels["position"][label]), self.model.n, stored)]
        nested = []
        while labels["previous"][label] >= 0:
            previous = int(labels["previous"][label])
            start, stop = int(labels["position"][previous]), int(labels["position"][label])
            option = int(labels["option"][label])
            exact_plain = option == _PLAIN and segments[-1].is_plain and segments[-1].codec == 0
            if exact_plain and reach[stop - 1] == stop:  # one plain segment
                segments[-1] = PlannedSegment.plain(start, segments[-1].stop)
            else:
                segments.append(PlannedSegment.plain(start, stop, _PLAIN - option) if option <= _PLAIN
                                else PlannedSegment.checkpointed(start, stop, option))
                room = float(labels["nested_room"][label])
                nested.append(None if math.isnan(room) else self.nested.tree(start, stop, room))
            label = previous
        return segments[::-1], nested[::-1]
