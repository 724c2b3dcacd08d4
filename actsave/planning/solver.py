"""The solvers: exact dynamic programs over the memory and time model of
memory_model.py.

Dynamic program
    Time-optimal, left to right. A label (P, T) at position b is a plan of layers
    [0, b) in checkpointed (and, where the model allows, stored middle) segments:
    P = the bytes they keep, T = their time. The Pareto frontier L(b) (no label
    smaller in both P and T) stays small. With L(0) = {(0, 0)},

        L(b) = Pareto { (P + R(a,b,o), T + t(a,b,o)) : a < b, o, (P, T) in L(a),
                        P + W(a,b,o) + C <= budget - X }
               (o ranging over the keep options and "stored": R = Saved(a, b-1),
               t = 0, W + C its largest event, memory_model.py)
        best = min { T + t_stored(s, k) : s < n, k, (P, T) in L(s),
                     P + W_stored(s, k) <= budget - X }

    k: how the stored segment keeps autograd's saves (as they are, or by a lossy
    codec: memory_model.py), t_stored its encode and decode time.

    Feasibility depends on a label only through P and time is additive, so a
    dominated label never leads to a better plan: the DP is exact for the model.
    Smallest peak ("memory" objective, and :func:`balanced`), right to left, one
    number per start and candidate C: h(a) = min(min_k W_stored(a, k), min_{b,o} max(W(a,b,o)
    + C, R(a,b,o) + h(b))) (o again including "stored"), peak = X + h(0); then the fastest plan within that peak,
    the time dynamic program run only for the candidates whose h(0) fits. With every
    time 0 (a meta profile) the first plan found is kept: the one whose stored
    segment starts earliest, so the fewest layers are recomputed.

    Cost: the option-independent maxima of W for every segment are five n x n
    tables (O(n^2) time and memory, built row by row); the time DP extends every
    live label at each b, O(n^2 L |O|) with L the mean frontier size, vectorized
    over labels; the memory DP is O(n^2 |O| |C|), vectorized over the candidates C.
    Stored middle segments widen the frontiers (a prefix may keep more bytes to
    recompute less): for 1,000 layers, 1.3 to 8 s on one shared CPU core (1 to 2 s
    without them; tests/planning/test_solver.py prints it);
    balanced plans of ResNet-1001 (339 layers) with int8 and offload, 63 candidates:
    0.3 s.
"""
from __future__ import annotations

import math
from typing import Optional

import numpy as np

from .memory_model import CostModel


def smallest_headroom(model: CostModel, longest: Optional[int] = None) -> float:
    """min over plans of H (the peak less X), over every carry; checkpointed segments
    hold at most ``longest`` layers (None: any number)."""
    return float(_smallest_headrooms(model, longest)[1][0].min())


def _smallest_headrooms(model: CostModel, longest: Optional[int] = None) -> tuple:
    """(carries, h): h[a, c] the docstring's right-to-left recurrence h(a) =
    min(min_k W_stored(a, k), min_{b,o} max(W(a,b,o) + C, R(a,b,o) + h(b))), for every
    candidate C at once (the columns of h), over checkpointed segments [a, b) of at
    most ``longest`` layers. Computed once per model and ``longest``."""
    computed = model.__dict__.setdefault("_headrooms", {})
    if longest not in computed:
        n, carries = model.n, model.carries()
        h = np.repeat(model.stored_peaks.min(axis=0)[:, None], len(carries), axis=1)
        for a in reversed(range(n - 1)):
            b = np.arange(a + 1, n if longest is None else min(n, a + 1 + longest))
            for o in np.nonzero(model.allowed[:, a])[0]:
                through = np.maximum(model.working_set(o, a, b, carries), model.kept(o, a, b)[:, None] + h[b])
                h[a] = np.minimum(h[a], through.min(axis=0))
            if model.store_middle:  # a stored segment may hold any number of layers
                b = np.arange(a + 1, n)
                through = np.maximum(model.stored_middle_working_set(a, b, carries),
                                     model.stored_middle_kept(a, b)[:, None] + h[b])
                h[a] = np.minimum(h[a], through.min(axis=0))
        computed[longest] = carries, h
    return computed[longest]


def fastest_within(model: CostModel, headroom: float, longest: Optional[int] = None) -> Optional[list]:
    """The fastest plan with H <= headroom over every carry, as [(start, stop, option
    index, None for a stored middle segment; the stored segment last, with ~k for its
    saves' stored codec k)], or None; checkpointed segments hold at most
    ``longest`` layers (None: any number). Carries whose smallest H is above
    ``headroom`` have no such plan and are skipped."""
    best = None
    carries, h = _smallest_headrooms(model, longest)
    for c in np.nonzero(h[0] <= headroom)[0]:
        found = _Prefixes(model, headroom, float(carries[c]), h[:, c], longest).fastest()
        if found is not None and (best is None or found[0] < best[0]):
            best = found
    return None if best is None else best[1]


_STORED = -2  # the option column of a label whose last segment is a stored middle one
_ROOT = -1  # the option column of the empty plan


class _Labels:
    """A growable table of prefix plans: kept bytes P, time T, and how each was made."""

    _COLUMNS = {"p": np.float64, "t": np.float64, "position": np.int64, "option": np.int64,
                "previous": np.int64}

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
    is that of the whole frontier: a label at b whose P + h(b) (``rest``: the least
    headroom any plan of the layers from b needs) exceeds the headroom has no
    feasible completion, and one whose T is no less than the best finished plan's
    cannot beat it (times only add)."""

    def __init__(self, model: CostModel, headroom: float, carry: float, rest: np.ndarray,
                 longest: Optional[int] = None):
        self.model, self.headroom, self.carry, self.rest = model, headroom, carry, rest
        self.longest = model.n if longest is None else longest
        self.labels = _Labels()
        self.labels.append(p=np.zeros(1), t=np.zeros(1), position=np.zeros(1, dtype=np.int64),
                           option=np.full(1, _ROOT), previous=np.full(1, -1))
        # (time, label whose plan ends with the stored segment, its stored codec)
        self.best = (math.inf, -1, 0)

    def fastest(self) -> Optional[tuple]:
        """(extra seconds, segments) of the fastest plan, or None when none fits."""
        self._finish_at(0, np.arange(1))
        for b in range(1, self.model.n):
            self._finish_at(b, self._extend_to(b))
        if self.best[1] < 0:
            return None
        return self.best[0], self._segments_from(self.best[1], self.best[2])

    def _extend_to(self, b: int) -> np.ndarray:
        """Add the frontier at b; return its label indices."""
        labels, model, carry = self.labels, self.model, np.array([self.carry])
        # W >= the backward events + C whatever the option: a cheap test drops most labels.
        source = np.nonzero((labels["p"] + model.backward[labels["position"], b] + self.carry <= self.headroom)
                            & (labels["t"] < self.best[0]))[0]
        parts = []
        if model.store_middle:  # any length
            p, t, a = labels["p"][source], labels["t"][source], labels["position"][source]
            ok = p + model.stored_middle_working_set(a, b, carry)[:, 0] <= self.headroom
            if ok.any():
                parts.append((p[ok] + model.stored_middle_kept(a[ok], b), t[ok], np.full(int(ok.sum()), _STORED),
                              source[ok]))
        source = source[labels["position"][source] >= b - self.longest]
        p, t, a = labels["p"][source], labels["t"][source], labels["position"][source]
        for o in range(len(model.options)):
            ok = p + model.working_set(o, a, b, carry)[:, 0] <= self.headroom
            if ok.any():
                parts.append((p[ok] + model.kept(o, a[ok], b), t[ok] + model.seconds(o, a[ok], b),
                              np.full(int(ok.sum()), o), source[ok]))
        if not parts:
            return np.empty(0, dtype=np.int64)
        new_p, new_t, option, previous = (np.concatenate(columns) for columns in zip(*parts))
        completable = np.nonzero(new_p + self.rest[b] <= self.headroom)[0]
        keep = completable[_pareto(new_p[completable], new_t[completable])]
        first = labels.size
        labels.append(p=new_p[keep], t=new_t[keep], position=np.full(keep.size, b), option=option[keep],
                      previous=previous[keep])
        return np.arange(first, labels.size)

    def _finish_at(self, s: int, at: np.ndarray) -> None:
        """End the plans of labels ``at`` (position s) with the stored segment [s, n),
        its saves kept by each stored codec k in turn (as they are first, so that it
        wins ties)."""
        for k in range(len(self.model.stored_codecs)):
            fits = at[self.labels["p"][at] + self.model.stored_peaks[k, s] <= self.headroom]
            if fits.size:
                best = fits[np.argmin(self.labels["t"][fits])]
                seconds = float(self.labels["t"][best]) + self.model.stored_time[k, s]
                if seconds < self.best[0]:
                    self.best = (seconds, int(best), k)

    def _segments_from(self, label: int, stored: int) -> list:
        """[(start, stop, option, None for a stored middle segment)] of a finished plan,
        the stored segment last with ~k for its stored codec k (CostModel.predict)."""
        labels = self.labels
        stops = [(int(labels["position"][label]), self.model.n, ~stored)]
        while labels["previous"][label] >= 0:
            previous = int(labels["previous"][label])
            option = int(labels["option"][label])
            stops.append((int(labels["position"][previous]), int(labels["position"][label]),
                          None if option == _STORED else option))
            label = previous
        return stops[::-1]


_SAMPLED = 1024  # pairs whose frontier screens the rest before the full sort


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
    rest = np.union1d(np.nonzero(~beaten)[0], front)
    return rest[_sorted_pareto(p[rest], t[rest])]


def _sorted_pareto(p: np.ndarray, t: np.ndarray) -> np.ndarray:
    order = np.lexsort((t, p))
    best_before = np.minimum.accumulate(np.concatenate(([np.inf], t[order][:-1])))
    return order[t[order] < best_before]
