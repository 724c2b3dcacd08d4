"""The Pareto machinery of solver.py's time dynamic program: the table of prefix
plans (labels), the window of segment terms a step reads, the batches of labels it
extends, the sweeps that read only a staircase of them, and the frontiers that keep
the labels that may lead to a faster plan (solver.py's docstring says why each drop
is exact).
"""
from __future__ import annotations

import numpy as np

from .memory_model import CostModel


class Labels:
    """A growable table of prefix plans: kept bytes P, time T, whether the last segment
    is a plain middle one whose saves hold the next segment's input (held), and how
    each was made."""

    # live: whether it may still extend by a checkpointed or exact plain segment;
    # coded_live: by a plain segment whose saves a codec keeps (solver._Prefixes._sources).
    _COLUMNS = {"p": np.float64, "t": np.float64, "held": np.bool_, "position": np.int64, "option": np.int64,
                "previous": np.int64, "nested_room": np.float64, "live": np.bool_, "coded_live": np.bool_}

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


BITS = np.array([[False], [True]])  # the held bit as a column: tables are [bit, start]


class Window:
    """The starts [lo, b) of the labels that may extend to b, and the terms of the
    segments [start, b) over them as [bit, start - lo] tables, each built once."""

    def __init__(self, model: CostModel, lo: int, b: int, carry: float):
        self.model, self.lo, self.b, self.carry = model, lo, b, np.array([carry])
        self.starts = np.arange(lo, b)
        self._working_sets = {}

    def working_set(self, o: int) -> np.ndarray:
        """W + C of option o."""
        if o not in self._working_sets:
            self._working_sets[o] = self.model.working_set(o, self.starts[None], self.b, self.carry, BITS)[..., 0]
        return self._working_sets[o]

    def kept(self, o: int) -> np.ndarray:
        """R of option o."""
        return np.broadcast_to(self.model.kept(o, self.starts[None], self.b, BITS), (2, self.starts.size))


class Batch:
    """Labels extending to b and what a segment from each reads: P, T, the held bit,
    the position, and ``at`` = (bit, position - lo) into the window's tables (a
    segment's terms depend on a label only through its start and bit)."""

    def __init__(self, labels: Labels, chosen: np.ndarray, window: Window):
        self.chosen, self.window = chosen, window
        self.p, self.t, self.held = labels["p"][chosen], labels["t"][chosen], labels["held"][chosen]
        self.positions = labels["position"][chosen]
        self.at = (self.held.astype(np.int64), self.positions - window.lo)

    def extensions(self, ok, kept, times, holds, option: int, room=None) -> tuple:
        """(P, T, bit, option, previous label, nested room) of the extensions ``ok``
        (a mask over the labels): P + ``kept`` (a [bit, start] table), ``times`` their
        T, ``holds`` their new bit."""
        ok = np.nonzero(ok)[0]
        kept = np.broadcast_to(kept, (2, self.window.starts.size))
        return (self.p[ok] + kept[self.at[0][ok], self.at[1][ok]], times[ok],
                np.broadcast_to(holds, self.p.shape)[ok], np.full(ok.size, option), self.chosen[ok],
                np.full(ok.size, np.nan) if room is None else room[ok])


class OptionKeys:
    """A Sweep's keys for checkpointed segments of option o kept on the device:
    R(a, b, o) = CostModel.kept_from_start(o, a) + a term of b alone, exactly (whole
    bytes), and t(a, b, o) = CostModel.seconds_less_end(o, a) + the recompute
    time before b (recompute_s_before); where o is allowed."""

    def __init__(self, model: CostModel, o: int):
        self.model, self.o = model, o

    def allowed(self, positions: np.ndarray, held: np.ndarray) -> np.ndarray:
        return self.model.allowed[self.o, positions]

    def kept(self, positions: np.ndarray, held: np.ndarray) -> np.ndarray:
        return self.model.kept_from_start(self.o, positions, held)

    def seconds(self, positions: np.ndarray) -> np.ndarray:
        return self.model.seconds_less_end(self.o, positions)


class CodedKeys:
    """A Sweep's keys for plain middle segments whose saves stored codec k keeps:
    R(a, b) and t(a, b) are CostModel.coded_middle_keys(k, a) plus terms of b alone
    (exactly for R), where that holds for every b (CostModel.coded_middle_separable)."""

    def __init__(self, model: CostModel, k: int):
        self.model, self.k = model, k

    def allowed(self, positions: np.ndarray, held: np.ndarray) -> np.ndarray:
        return self.model.coded_middle_separable[self.k - 1, held.astype(np.int64), positions]

    def kept(self, positions: np.ndarray, held: np.ndarray) -> np.ndarray:
        return self.model.coded_middle_keys(self.k, positions, held)[0]

    def seconds(self, positions: np.ndarray) -> np.ndarray:
        return self.model.coded_middle_keys(self.k, positions)[1]


class Sweep:
    """The labels that may extend by one kind of segment (``keys``: OptionKeys,
    CodedKeys), in the order of their extensions: P + R(a, b) = (P + keys.kept(a)) + a
    term of b alone, exactly (whole bytes), and T + t(a, b) = (T + keys.seconds(a)) +
    a term of b alone, a sum whose order adding the same term keeps. So one order, by
    those keys (then by label), serves every b, kept up to date as labels come and go
    instead of sorted at each b.

    An extension whose T is no less than that of an earlier feasible one is beaten or
    equalled by it (no smaller P, both unheld; of equal ones the earlier, smaller
    label stays, as in sorted_pareto): it cannot be on the frontier. The staircase
    of the keys (the labels whose T key is below every earlier one's) changes only as
    labels come and go; where each of its labels is live and its extension feasible,
    the extensions that may be on the frontier are among the staircase's, and no
    other label is read. Else one pass of running minima over every live label finds
    them. On long chains at tight budgets the staircase is a small fraction of the
    live labels (docs/results.md, "Figures behind the code's rules";
    tests/planning/test_solver.py prints the time)."""

    def __init__(self, keys):
        self.keys = keys
        self.labels, self.p_keys, self.t_keys = np.empty(0, dtype=np.int64), np.empty(0), np.empty(0)
        self.staircase_at = np.empty(0, dtype=np.int64)  # indices into labels

    def add(self, labels: Labels, new: np.ndarray) -> None:
        """Merge the labels ``new`` (increasing) in, where the keys allow them."""
        new = new[self.keys.allowed(labels["position"][new], labels["held"][new])]
        positions, held = labels["position"][new], labels["held"][new]
        p_keys = labels["p"][new] + self.keys.kept(positions, held)
        t_keys = labels["t"][new] + self.keys.seconds(positions)
        order = np.argsort(p_keys, kind="stable")  # equal keys by label
        at = np.searchsorted(self.p_keys, p_keys[order], side="right")
        # Where each old and each new label lands: the new ones after the old of equal key.
        new_at = at + np.arange(at.size)
        old_at = np.ones(self.labels.size + at.size, dtype=bool)
        old_at[new_at] = False
        merged = []
        for column, values in ((self.labels, new), (self.p_keys, p_keys), (self.t_keys, t_keys)):
            both = np.empty(old_at.size, dtype=column.dtype)
            both[old_at], both[new_at] = column, values[order]
            merged.append(both)
        # The new labels may join the staircase; no label off it comes back on.
        on = self.staircase_at
        candidates = np.sort(np.concatenate((on + np.searchsorted(at, on, side="right"), new_at)))
        self.labels, self.p_keys, self.t_keys = merged
        self.staircase_at = candidates[below_every_earlier(self.t_keys[candidates])]

    def staircase(self, live: np.ndarray) -> np.ndarray:
        """The labels of the staircase, increasing; ``live``: a flag per label, whether
        it still extends."""
        if not live[self.labels[self.staircase_at]].all():
            self._leave(live)
        return np.sort(self.labels[self.staircase_at])

    def everyone(self, live: np.ndarray) -> np.ndarray:
        """Every label that still extends, in key order."""
        self._leave(live)
        return self.labels

    def undominated(self, ok: np.ndarray, times: np.ndarray) -> np.ndarray:
        """Of :meth:`everyone`, given whether each extension is allowed, fits and keeps
        anything (``ok``) and its T, those below every earlier one, increasing."""
        return np.sort(self.labels[below_every_earlier(np.where(ok, times, np.inf))])

    def _leave(self, live: np.ndarray) -> None:
        """Drop the labels that no longer extend (for good: solver._Prefixes._sources)."""
        stay = live[self.labels]
        if not stay.all():
            self.labels, self.p_keys, self.t_keys = self.labels[stay], self.p_keys[stay], self.t_keys[stay]
            self.staircase_at = np.nonzero(below_every_earlier(self.t_keys))[0]


def below_every_earlier(values: np.ndarray) -> np.ndarray:
    """Whether each value is below every one before it."""
    least = np.minimum.accumulate(values)
    return least < np.concatenate(([np.inf], least[:-1]))


_SAMPLED = 1024  # pairs whose frontier screens the rest before the full sort


def held_pareto(p: np.ndarray, t: np.ndarray, held: np.ndarray, reused: float) -> np.ndarray:
    """Indices of the labels at one position that may lead to a faster plan. A held
    label (its plain middle segment holds the next input, ``reused`` bytes) needs
    at most as much headroom from here as an unheld one of the same P, and at least
    that less ``reused``: it beats an unheld label of no smaller P and T, and is
    beaten by an unheld one at least ``reused`` smaller in P and no larger in T,
    strictly smaller in one (so that of two labels beating each other, one stays)."""
    unheld, holding = np.nonzero(~held)[0], np.nonzero(held)[0]
    unheld = unheld[pareto(p[unheld], t[unheld])]
    holding = holding[pareto(p[holding], t[holding])]
    unheld = unheld[~beaten(p[holding], t[holding], p[unheld], t[unheld], strictly=False)]
    holding = holding[~beaten(p[unheld] + reused, t[unheld], p[holding], t[holding], strictly=True)]
    return np.concatenate((unheld, holding))


def beaten(by_p: np.ndarray, by_t: np.ndarray, p: np.ndarray, t: np.ndarray, strictly: bool) -> np.ndarray:
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


def pareto(p: np.ndarray, t: np.ndarray) -> np.ndarray:
    """Indices of the pairs that no other pair beats in both P and T (of equal pairs,
    one). Many pairs: first the frontier of a sample drops every pair it beats or
    equals, so that only the few left are sorted (the same frontier: each pair dropped
    is beaten or equalled by a sample pair, which stays)."""
    if len(p) <= 2 * _SAMPLED:
        return sorted_pareto(p, t)
    sample = np.unique(np.concatenate((np.linspace(0, len(p) - 1, _SAMPLED).astype(np.int64),
                                       [np.argmin(p), np.argmin(t)])))
    front = sample[sorted_pareto(p[sample], t[sample])]  # P increasing, T decreasing
    front = front[np.argsort(p[front], kind="stable")]
    at = np.searchsorted(p[front], p, side="right") - 1  # the sample frontier's last pair with P <= p
    beaten = (at >= 0) & (t[front[np.maximum(at, 0)]] <= t)
    # Each front pair equals itself (the front's P are distinct), so none is left
    # unbeaten: the two index sets are disjoint.
    rest = np.concatenate((np.nonzero(~beaten)[0], front))
    return rest[sorted_pareto(p[rest], t[rest])]


def sorted_pareto(p: np.ndarray, t: np.ndarray) -> np.ndarray:
    order = np.lexsort((t, p))
    best_before = np.minimum.accumulate(np.concatenate(([np.inf], t[order][:-1])))
    return order[t[order] < best_before]
