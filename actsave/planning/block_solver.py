"""The fastest block plan within a budget: one option per block (block_options.py,
NOTE [ Block options priced ]), chosen by a dynamic program over the blocks in order.

The peak is ``X + max_j (R_0 + ... + R_{j-1} + W_j)``, the loss last (memory_model.py),
so a partial plan of the first blocks is a label (P: the bytes its blocks keep, T: the
seconds they add, held: whether the last is a plain block whose saves hold the next
one's input), extended by each option that fits: ``P + W_j <= headroom``. A label that
keeps more and takes no less time than another with the same ``held`` is never better:
each block's frontier is the labels no other beats (a Pareto set, pareto.py's as for
solver.py). An offloaded block's prefetch may be in flight beside any later block's
backward, so each candidate carry C (0 and each F an option fetches) gets its own
program, with the options whose F fits it and C charged to every backward event; the
fastest plan over them wins. The least peak comes from the same program with labels (P, the largest event
so far) in place of (P, T).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from .pareto import sorted_pareto


@dataclass(frozen=True)
class BlockTable:
    """What the program reads: for each block, each option's terms as a pair
    ``(not held, held)`` (None where the option cannot run there); the loss's working
    set, not held and held; the chain input X; the plain step's seconds; and for each
    block what each of its options is (``labels``: the caller's names for them)."""

    options: Sequence[Sequence[tuple]]
    loss: tuple
    chain_input: float
    base_seconds: float
    labels: tuple

    def carries(self) -> list:
        return sorted({0.0} | {t.fetched for block in self.options for pair in block for t in pair
                               if t is not None and t.fetched > 0})


@dataclass(frozen=True)
class Chosen:
    """A plan the program chose: each block's option index, its peak and its step."""

    choices: tuple
    peak: float
    seconds: float


def fastest(table: BlockTable, budget: float) -> Optional[Chosen]:
    """The fastest plan whose peak fits ``budget`` (bytes), or None."""
    headroom = budget - table.chain_input
    best = None
    for carry in table.carries():
        found = _fastest_with_carry(table, headroom, carry)
        if found is not None and (best is None or found[1] < best[1]):
            best = found
    if best is None:
        return None
    choices, seconds = best
    return Chosen(choices, predicted_peak(table, choices), table.base_seconds + seconds)


def smallest(table: BlockTable) -> Chosen:
    """The fastest among the plans of the least peak."""
    least = min(_least_peak_with_carry(table, carry) for carry in table.carries())
    return fastest(table, table.chain_input + least)


def predicted_peak(table: BlockTable, choices: tuple) -> float:
    """The peak of a plan, each block's terms read as the program reads them."""
    terms = _terms_of(table, choices)
    carry = max((t.fetched for t in terms), default=0.0)
    kept, peak, held = 0.0, 0.0, False
    for t in terms:
        peak = max(peak, kept + t.working_set(carry))
        kept += t.kept
        held = t.holds_output
    return table.chain_input + max(peak, kept + table.loss[held])


def _terms_of(table: BlockTable, choices: tuple) -> list:
    terms, held = [], False
    for block, k in zip(table.options, choices):
        t = block[k][held]
        terms.append(t)
        held = t.holds_output
    return terms


def _fastest_with_carry(table: BlockTable, headroom: float, carry: float) -> Optional[tuple]:
    frontier = {False: [(0.0, 0.0, ())]}
    for block in table.options:
        extended = {False: [], True: []}
        for held, labels in frontier.items():
            for kept, seconds, choices in labels:
                for k, pair in enumerate(block):
                    t = pair[held]
                    if t is None or t.fetched > carry or kept + t.working_set(carry) > headroom:
                        continue
                    extended[t.holds_output].append((kept + t.kept, seconds + t.seconds, choices + (k,)))
        frontier = {held: _pareto(labels) for held, labels in extended.items() if labels}
        if not frontier:
            return None
    ends = [(seconds, choices) for held, labels in frontier.items() for kept, seconds, choices in labels
            if kept + table.loss[held] <= headroom]
    if not ends:
        return None
    seconds, choices = min(ends)
    return choices, seconds


def _least_peak_with_carry(table: BlockTable, carry: float) -> float:
    """The least headroom any plan whose fetches fit ``carry`` needs: the same program
    with labels (P, the largest event so far), neither beaten by another."""
    frontier = {False: [(0.0, 0.0)]}
    for block in table.options:
        extended = {False: [], True: []}
        for held, labels in frontier.items():
            for kept, largest in labels:
                for pair in block:
                    t = pair[held]
                    if t is not None and t.fetched <= carry:
                        extended[t.holds_output].append((kept + t.kept, max(largest, kept + t.working_set(carry))))
        frontier = {held: _pareto(labels) for held, labels in extended.items() if labels}
    return min((max(largest, kept + table.loss[held]) for held, labels in frontier.items()
                for kept, largest in labels), default=float("inf"))


def _pareto(labels: list) -> list:
    """The labels no other keeps less than and is faster than (ties: the first), by
    their first two fields, in order of the first."""
    keep = sorted_pareto(np.array([label[0] for label in labels]), np.array([label[1] for label in labels]))
    return [labels[i] for i in keep]


__all__ = ["BlockTable", "Chosen", "fastest", "smallest", "predicted_peak"]
