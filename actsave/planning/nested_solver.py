"""The nested dynamic program: for every checkpointed segment [a, b) at once, the
fastest way to cut its recompute into checkpoints of its own (nested_model.py,
runtime/nested.py) within a given number of bytes.

Recurrence
    On a grid of ``unit``-byte steps m = 0 .. steps (unit: the largest power of two
    at most the plan's headroom / GRID, so GRID to 2 GRID steps, and tensor sizes
    that are multiples of it cost no rounding), every byte term of nested_model.py
    rounded up to whole units:

        Inner(c, d)[m]   the least time the recomputed range [c, d) adds beyond its
                         own pass with E([c, d)) <= m units: 0 where it fits as one
                         plain part (a plain checkpoint), else Multi(c, d)[m]
        Multi(c, d)[m]   the same over cuts into two parts or more
        S_y(f, d)[m]     the parts covering [f, d) after the first part of a range
                         ending at d; y = 1 where the part before f is plain and
                         its saves hold x_f

    A part [f, e) of a range ending at d (terms of nested_model.Part: R kept, its pass
    event, its event after the pass; g = g_d) is

        plain        feasible where m >= max(pass + g, after); then S_y'(e, d)[m - R],
                     y' = 1 where its saves hold x_e (nothing more where e = d; the
                     pass event of that last part up to its last save)
        recomputed   e < d, feasible where m >= pass + g; then
                     t(f, e) + Inner(f, e)[m - after] + S_0(e, d)[m - R],
                     its terms without x_f where y = 1 (the saves before hold it)

    S_y(f, d) is the least over the parts from f (the first part's terms for Multi,
    which may not end at d); t(f, e) is the part's recompute: its forward and its
    call's host work (nested_model.seconds). A part's terms depend on where it starts and ends,
    whether it is its range's first, and y, nothing else of the parts before it
    (nested_model.py: a plain part after a recomputed one holds nothing more), so
    the units left and y are the whole state: the recurrence is exact for the model
    on its grid. With every term rounded up and m rounded down, a plan within
    Inner(c, d)[m] needs at most m units; where every term is a whole number of
    units, the table is the least time over every cut that fits.

    A top-level nested segment [a, b) kept by an exact option o, after a prefix
    keeping P, adds t(a, b, o) + Multi(a, b)[floor((headroom - P - O - K - Q -
    C) / unit)] (solver.py's time dynamic program reads it per label).

Cost: O(n^3 steps) in numpy rows (each (f, d, y) one row per end; rows of y = 1
only where a layer before f saves x_f): seconds at a hundred layers
(docs/results.md, "Planning time"), growing as the cube. So nesting is tried for
chains of at most MAX_LAYERS layers, with times (a meta profile has none: a nested
plan would look free), and without a limit on checkpointed segments' layers.
"""
from __future__ import annotations

import copy
import math
from functools import cached_property
from typing import NamedTuple, Optional

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from ..runtime.nested import Range
from . import nested_model

GRID = 512  # at least this many grid steps over the headroom, fewer than twice as many
MAX_LAYERS = 128  # longer chains plan single-level segments only (module docstring, "Cost")
_INFEASIBLE = np.inf


class _StartTerms(NamedTuple):
    """The parts starting at one layer f, for every end e > f (index e - f - 1), in
    grid units: (R, pass event, after event) of a plain and of a recomputed part,
    each as the first part of its range and as a later one (a recomputed one also
    after a plain part whose saves hold its input), a plain part's pass event where
    it is its range's last (the early stop), and whether a plain part's saves hold
    the input of the part after it."""

    plain: tuple  # [first, later]: (kept, during_pass, after)
    recomputed: tuple  # [first, later, later with its input held]: (kept, during_pass, after)
    last_pass: tuple  # [first, later]: during_pass of a plain part ending its range
    holds_next_input: np.ndarray  # a plain part's saves hold x_e
    held_input_matters: bool  # a layer before f saves x_f, and R differs with y

    def of(self, recomputed: bool, first: bool, input_held: bool = False) -> tuple:
        """The terms of a part that is ``recomputed`` or plain, ``first`` of its range
        or not, ``input_held`` by the plain part before it or not (module docstring, y)."""
        if not recomputed:
            return self.plain[0 if first else 1]
        return self.recomputed[0 if first else 1 + input_held]


class NestedTable:
    """Multi(c, d)[m] of the module docstring for every range of a model's chain, on
    the grid of one headroom; :meth:`tree` rebuilds the cut it prices.

    The tables hold ``width`` infeasible columns before m = 0, so that a row shifted
    right by any number of units (``_shifted``) is a window of it, not a gather."""

    def __init__(self, model, headroom: float):
        self.model, self.unit = model, self.unit_for(headroom)
        self.steps = int(headroom // self.unit)  # m = 0 .. steps
        self.width = width = self.steps + 1
        n, self.m = model.n, np.arange(width)
        self._terms = [self._start_terms(f) for f in range(n)]
        self.multi = np.full((n, n, 2 * width), _INFEASIBLE)  # [c, d, width + m]
        self._multi_windows = sliding_window_view(self.multi, width, axis=-1)
        self.single_need = np.full((n, n), width, dtype=np.int64)  # [c, d]: units as one plain part
        for c in range(n - 1):
            _, _, after = self._terms[c].of(recomputed=False, first=True)
            during_pass = self._terms[c].last_pass[0]
            self.single_need[c, c + 1:] = np.maximum(during_pass + self._units(model.grad[c + 1:n]), after)
        for d in range(2, n):
            rest = self._rest(d)
            for c in range(d - 1):
                self.multi[c, d, width:] = self._cuts(c, d, rest, first=True)[0].min(axis=0)

    @staticmethod
    def unit_for(headroom: float) -> float:
        """The grid's unit for ``headroom``: a power of two, as tensor sizes, often
        multiples of one, then take whole units."""
        return 2.0 ** math.floor(math.log2(headroom / GRID))

    @classmethod
    def for_plans(cls, model, headroom: float, longest: Optional[int]) -> Optional["NestedTable"]:
        """The table the time dynamic program reads, or None where nesting is not tried
        (module docstring, "Cost") or no option can nest (exact, on the device)."""
        return cls(model, headroom) if cls.nests(model, headroom, longest) else None

    @staticmethod
    def nests(model, headroom: float, longest: Optional[int]) -> bool:
        """Whether the time dynamic program nests for ``model`` within ``headroom``."""
        timed = model.forward_s_before[-1] > 0
        return longest is None and timed and model.n <= MAX_LAYERS and headroom > 0 and bool(exact_options(model))

    def for_options_of(self, model) -> "NestedTable":
        """This table for ``model``, a CostModel of the same profile with other keep
        options: the recomputes of ranges are priced from the chain's layers alone, so
        only the nested segments' own terms are read anew, and nothing is rebuilt."""
        other = copy.copy(self)
        other.model = model
        for cached in ("_least_working_sets", "_headrooms"):
            other.__dict__.pop(cached, None)
        return other

    def time(self, a, b, available) -> np.ndarray:
        """Multi(a, b) within ``available`` bytes (broadcastable arrays; inf where
        nothing fits)."""
        steps = np.floor(np.asarray(available, dtype=np.float64) / self.unit)
        return self.multi[a, b, self.width + np.clip(steps, -1, self.steps).astype(np.int64)]

    @cached_property
    def least_bytes(self) -> np.ndarray:
        """[a, b]: the fewest bytes within which Multi(a, b) is finite (inf where none)."""
        finite = np.isfinite(self.multi[:, :, self.width:])
        first = np.argmax(finite, axis=-1).astype(np.float64)
        return np.where(finite.any(axis=-1), first * self.unit, _INFEASIBLE)

    def least_working_set(self, o: int) -> np.ndarray:
        """[bit, a, b]: the least W (less C) of a nested segment [a, b) kept by option
        o: O + K + Q + the fewest bytes its recompute nests within (inf where none), or
        its forward's largest event where larger (nested_model.working_set);
        bit 1 after a plain middle segment whose saves hold x_a (nested_model.held_outside)."""
        return self._least_working_sets[o]

    @cached_property
    def _least_working_sets(self) -> dict:
        model, bits = self.model, np.array([False, True])[:, None, None]
        a, b = np.arange(model.n)[:, None], np.arange(model.n)
        return {o: np.maximum(nested_model.held_outside(model, o, a, b, bits) + self.least_bytes,
                              model.held_in_forward(o, a, b, bits) + model.tables.checkpointed_forward)
                for o in exact_options(model)}

    def tree(self, a: int, b: int, available: float) -> Range:
        """The top Range (relative to a) of the cut that :meth:`time` prices."""
        steps = int(min(math.floor(available / self.unit), self.steps))
        return Range(0, b - a, inner=tuple(self._parts(a, b, steps, a)))

    # ------------------------------------------------------------- the recurrence

    def _units(self, size) -> np.ndarray:
        """Bytes as whole grid units, rounded up (past the grid: width, which no m reaches)."""
        units = np.ceil(np.asarray(size, dtype=np.float64) / self.unit - 1e-9)
        return np.clip(units, 0, self.width).astype(np.int64)

    def _start_terms(self, f: int) -> _StartTerms:
        model, ends = self.model, np.arange(f + 1, self.model.n)
        if not ends.size:
            return _StartTerms((), (), (), np.zeros(0, dtype=bool), False)
        events = model.events_from(f)
        plain = [nested_model.plain_part(model, f, ends, at_start, events) for at_start in (True, False)]
        recomputed = [nested_model.recomputed_part(model, f, ends, at_start, held)
                      for at_start, held in ((True, False), (False, False), (False, True))]
        last = [nested_model.plain_part(model, f, ends, at_start, events, last=True) for at_start in (True, False)]
        return _StartTerms(tuple(self._part_units(part) for part in plain),
                           tuple(self._part_units(part) for part in recomputed),
                           tuple(self._units(part.during_pass) for part in last),
                           nested_model.input_held_before(model, f, ends, False),
                           bool(model.input_first[f] < f) and not model.kept_copy[f])

    def _part_units(self, part: nested_model.Part) -> tuple:
        return tuple(self._units(term) for term in part)

    def _rest(self, d: int) -> np.ndarray:
        """Windows [y, f, width - shift, m] of S_y(f, d) for 0 < f <= d (row d:
        nothing left, 0), shifted right (_shifted)."""
        width = self.width
        rest = np.full((2, d + 1, 2 * width), _INFEASIBLE)
        rest[:, d, width:] = 0.0
        windows = sliding_window_view(rest, width, axis=-1)
        for f in range(d - 1, 0, -1):
            unheld, held = self._cuts(f, d, windows, first=False)
            rest[0, f, width:] = unheld.min(axis=0)
            rest[1, f, width:] = rest[0, f, width:] if held is unheld else held.min(axis=0)
        return windows

    def _cuts(self, f: int, d: int, rest: np.ndarray, first: bool) -> list:
        """For each y (only y = 0 for the first part of a range, ``first``), the time of
        each way to go on from a part starting at f within every m, one row per choice
        of that part (_choices)."""
        gradient, terms = int(self._units(self.model.grad[d])), self._terms[f]
        plain_ends = np.arange(f + 1, d if first else d + 1)
        kept, during_pass, after = (term[:plain_ends.size] for term in terms.of(recomputed=False, first=first))
        if not first:  # the part ending at d is the range's last
            during_pass = np.append(during_pass[:-1], terms.last_pass[1][plain_ends.size - 1])
        need = np.maximum(during_pass + gradient, after)
        y_after = terms.holds_next_input[:plain_ends.size].astype(np.int64)
        plain_rows = np.where(self.m >= need[:, None], self._shifted(rest, kept, y_after, plain_ends), _INFEASIBLE)
        ends = np.arange(f + 1, d)
        if not ends.size:
            return [plain_rows] * (1 if first else 2)
        # Each recomputed part is a checkpointed call of its own; its saves' host work is
        # the top range's (nested_model.seconds).
        before = self.model.forward_s_before
        forward = self.model.call_s + before[ends] - before[f]
        rows = []
        # y = 1 rows are the y = 0 rows where y changes no term (x_f never held, or copied).
        for held in (False, True) if not first and terms.held_input_matters else (False,):
            kept, during_pass, after = (term[:ends.size] for term in terms.of(True, first, held))
            inner = np.where(self.m >= (after + self.single_need[f, ends])[:, None], 0.0,
                             self._shifted(self._multi_windows[f], after, ends))
            recomputed_rows = np.where(self.m >= (during_pass + gradient)[:, None],
                                       forward[:, None] + inner + self._shifted(rest, kept, 0, ends), _INFEASIBLE)
            rows.append(np.concatenate((plain_rows, recomputed_rows)))
        return rows if first or len(rows) == 2 else rows * 2

    @staticmethod
    def _choices(f: int, d: int, first: bool) -> list:
        """The parts from f that _cuts' rows stand for, as (end, recomputed): plain,
        then recomputed, each by its end (a cut's first part ends before d)."""
        return [(e, False) for e in range(f + 1, d if first else d + 1)] + [(e, True) for e in range(f + 1, d)]

    def _shifted(self, windows: np.ndarray, by: np.ndarray, *rows) -> np.ndarray:
        """table[*row, width + m - by] for each row (``rows``: broadcastable indices)
        and every m, from the table's windows: the row shifted right by ``by`` units,
        infeasible where m < by (the table's infeasible first half)."""
        return windows[(*rows, self.width - by)]

    def _parts(self, c: int, d: int, steps: int, origin: int) -> list:
        """The parts (Ranges relative to ``origin``) of the cut of [c, d) that
        Multi(c, d)[steps] prices, recursing into recomputed parts."""
        rest, first, held, f, parts = self._rest(d), True, False, c, []
        while f < d:
            rows = self._cuts(f, d, rest, first)[held]
            end, recomputed = self._choices(f, d, first)[int(np.argmin(rows[:, steps]))]
            terms = self._terms[f]
            kept, _, after = (int(term[end - f - 1]) for term in terms.of(recomputed, first, held))
            if recomputed:
                inner_steps = steps - after
                inner = () if inner_steps >= self.single_need[f, end] else \
                    tuple(self._parts(f, end, inner_steps, origin))
                parts.append(Range(f - origin, end - origin, inner=inner))
            else:
                parts.append(Range(f - origin, end - origin, recomputed=False))
            steps -= kept
            f, first, held = end, False, not recomputed and bool(terms.holds_next_input[end - f - 1])
        return parts


def exact_options(model) -> list:
    """The options a nested segment may keep its input by: exact, on the device."""
    return [o for o, option in enumerate(model.options) if not option.lossy and not option.offload]
