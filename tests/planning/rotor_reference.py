"""A reference solver for optimal checkpointing of heterogeneous chains, written from
the recurrence of Beaumont, Eyraud-Dubois, Herrmann, Joly and Shilova, "Optimal
checkpointing for heterogeneous chains: how to train deep neural networks with limited
memory" (2019; the rotor project). Rotor and Rockmate do not run here (CPU-only torch),
so the tests compare actsave's planner against this instead.

The model (the paper's, in our notation; stages 0 .. n-1, all sizes integers in one
memory unit):

    act[i]          the input a_i of stage i; act[n] is the chain's output. The gradient
                    d_i of a_i has the same size.
    saved[i]        abar_i: everything stage i's "forward with saves" keeps for its
                    backward, its output a_{i+1} included (saved[i] >= act[i+1]).
    fwd_overhead[i], bwd_overhead[i]: temporary memory while stage i runs forward or
                    backward, on top of what the operation produces.
    fwd_time[i], bwd_time[i]

One term beyond the paper, zero by default:

    held            memory the caller holds from the first backward operation to the
                    end of the step (a training loop's output and its gradient, which
                    ``out.backward(g)`` keeps alive). With held = 0 this is the paper's
                    model.

Operations: Fn(i) ("F_ckpt") computes a_{i+1} from a_i and keeps nothing else; Fs(i)
("F_all") computes abar_i; B(i) computes d_i from d_{i+1} and abar_i, then frees both.

Opt(s, t, m): the least time to run the backward of stages s..t, given a_s (held by the
caller, not counted in m) and d_{t+1} (counted in m), leaving d_s, with at most m units
live. Either the first stage is run with its saves ("stored"),

    Opt_all  = fwd_s + Opt(s+1, t, m - saved[s]) + bwd_s,

or stages s .. s'-1 are run without saves, a_{s'} is kept while s'..t are processed,
and then s .. s'-1 are processed again from a_s (their "recompute", itself planned):

    Opt_ckpt = sum_{k=s}^{s'-1} fwd_k + Opt(s', t, m - act[s']) + Opt(s, s'-1, m),

each allowed when the memory its own operations need fits m (see _forward_needs and
_fill). Opt(s, s, m) = fwd_s + bwd_s when Fs(s) and B(s) fit. A whole step is
Opt(0, n-1, M - act[0]). ``held`` is live during every B and every recompute, that
is in every operation except the forward ones of the ranges ending at the last stage
(Opt(s, n-1, m), the step's forward phase): there B(s) needs ``held`` more and the
recompute Opt(s, s'-1, .) runs within m - held. A plan is written as actsave's plan trees are: a range is a
tuple of children (start, stop, inner) covering it, ``inner`` None for layers run with
their saves and a tuple of children (the recompute's own plan) for a checkpointed run.

The dynamic program runs over every m in 0..M at once (numpy over the memory axis), as
rotor does; it is exact for integer sizes. :func:`simulate` replays a plan operation by
operation and :func:`all_plans` enumerates every plan of a short chain: the tests check
the table against both.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Optional

import numpy as np

INFEASIBLE = np.inf


@dataclass(frozen=True)
class RotorChain:
    """One chain in the paper's model (module docstring); sizes in integer units."""

    fwd_time: tuple
    bwd_time: tuple
    act: tuple  # n + 1 entries: the input of each stage, then the chain's output
    saved: tuple
    fwd_overhead: tuple
    bwd_overhead: tuple
    held: int = 0  # live from the first backward operation to the end (module docstring)

    def __post_init__(self):
        n = len(self.fwd_time)
        lengths = {len(self.bwd_time), len(self.saved), len(self.fwd_overhead), len(self.bwd_overhead)}
        if lengths != {n} or len(self.act) != n + 1:
            raise ValueError(f"a chain of {n} stages needs {n} of each per-stage value and {n + 1} act sizes")
        if any(self.saved[i] < self.act[i + 1] for i in range(n)):
            raise ValueError("saved[i] (abar_i) includes the stage's output: saved[i] >= act[i + 1]")

    @property
    def n(self) -> int:
        return len(self.fwd_time)


def _held(chain: RotorChain, t: int) -> int:
    """What the backward of a range ending at stage t holds beyond the paper's model:
    ``held`` for the step's own ranges (t = n-1), else nothing more (a recompute's
    range runs within a budget its caller already reduced by ``held``)."""
    return chain.held if t == chain.n - 1 else 0


def _stored_single_needs(chain: RotorChain, s: int) -> int:
    """Units Fs(s) then B(s) need with d_{s+1} live (a_s is the caller's)."""
    grad_out = chain.act[s + 1]
    return max(grad_out + chain.saved[s] + chain.fwd_overhead[s],
               _held(chain, s) + grad_out + chain.saved[s] + chain.act[s] + chain.bwd_overhead[s])


def _forward_needs(chain: RotorChain, s: int, stop: int, t: int) -> int:
    """Units Fn(s) .. Fn(stop-1) need with d_{t+1} live: each holds its input (a_s is the
    caller's) and its output."""
    grad_out = chain.act[t + 1]
    return max(grad_out + (chain.act[k] if k > s else 0) + chain.act[k + 1] + chain.fwd_overhead[k]
               for k in range(s, stop))


class RotorTable:
    """Opt(s, t, m) for every 0 <= s <= t < n and 0 <= m <= memory, and the choice made:
    -1 stored first stage, s' > s a checkpointed run of s .. s'-1.

    ``single_level``: the optimum over the plans actsave's planner can express instead,
    in the same model: checkpointed runs whose recompute stores every stage, and only
    the last run stored (the choices of Opt(s, n-1, m) are then "store s .. n-1" or a
    checkpointed run followed by such a plan; every other range is stored whole).
    With ``stored_anywhere`` too, stored runs may also come before the last (the
    choices of Opt(s, n-1, m) are then "store s, then any such plan of s+1 .. n-1" or
    a checkpointed run followed by such a plan), as actsave's Plan.plain allows."""

    def __init__(self, chain: RotorChain, memory: int, single_level: bool = False, stored_anywhere: bool = False):
        self.chain, self.memory, self.single_level = chain, int(memory), single_level
        self.stored_to_end_only = single_level and not stored_anywhere
        n, width = chain.n, self.memory + 1
        self.opt = np.full((n, n, width), INFEASIBLE)
        self.choice = np.full((n, n, width), -2, dtype=np.int64)
        self._stored_to_end = {}  # single_level: s -> the row of Opt(s, n-1, m) storing s .. n-1
        m = np.arange(width)
        for s in range(n):
            fits = m >= _stored_single_needs(chain, s)
            self.opt[s, s] = np.where(fits, chain.fwd_time[s] + chain.bwd_time[s], INFEASIBLE)
            self.choice[s, s] = np.where(fits, -1, -2)
        self._stored_to_end[n - 1] = self.opt[n - 1, n - 1]
        for length in range(2, n + 1):
            for s in range(n - length + 1):
                self._fill(s, s + length - 1, m)

    def _fill(self, s: int, t: int, m: np.ndarray) -> None:
        chain = self.chain
        best = np.full(m.shape, INFEASIBLE)
        choice = np.full(m.shape, -2, dtype=np.int64)
        held = _held(chain, t)
        # stored: Fs(s) with d_{t+1} live, the rest with abar_s held, B(s) with d_{s+1}.
        stored_fits = m >= max(chain.act[t + 1] + chain.saved[s] + chain.fwd_overhead[s],
                               held + chain.saved[s] + chain.act[s + 1] + chain.act[s] + chain.bwd_overhead[s])
        step_range = t == chain.n - 1
        rest = self._stored_to_end[s + 1] if self.stored_to_end_only and step_range else self.opt[s + 1, t]
        candidate = np.where(stored_fits, chain.fwd_time[s] + chain.bwd_time[s] + _shifted(rest, chain.saved[s]),
                             INFEASIBLE)
        if self.single_level and step_range:
            self._stored_to_end[s] = candidate
        better = candidate < best
        best, choice = np.where(better, candidate, best), np.where(better, -1, choice)
        forward = 0.0
        stops = range(s + 1, t + 1) if step_range or not self.single_level else ()
        for stop in stops:  # checkpointed run of s .. stop-1, a_stop kept
            forward += chain.fwd_time[stop - 1]
            fits = m >= _forward_needs(chain, s, stop, t)
            candidate = np.where(fits, forward + _shifted(self.opt[stop, t], chain.act[stop])
                                 + _shifted(self.opt[s, stop - 1], held), INFEASIBLE)
            better = candidate < best
            best, choice = np.where(better, candidate, best), np.where(better, stop, choice)
        self.opt[s, t], self.choice[s, t] = best, choice

    def step_time(self, budget: int) -> float:
        """Opt(0, n-1, budget - act[0]): a whole step's time within ``budget`` units."""
        m = int(budget) - self.chain.act[0]
        if m < 0:
            return INFEASIBLE
        return float(self.opt[0, self.chain.n - 1, min(m, self.memory)])

    def plan(self, budget: int) -> Optional[tuple]:
        """The plan tree of :meth:`step_time`, or None when nothing fits."""
        m = min(int(budget) - self.chain.act[0], self.memory)
        if m < 0 or not np.isfinite(self.opt[0, self.chain.n - 1, m]):
            return None
        return self._plan(0, self.chain.n - 1, m)

    def _plan(self, s: int, t: int, m: int) -> tuple:
        """Children covering stages s..t; adjacent stored stages merged into one run."""
        choice = int(self.choice[s, t, m])
        if s == t:
            return ((s, s + 1, None),)
        if choice == -1 and self.stored_to_end_only and t == self.chain.n - 1:
            return ((s, t + 1, None),)
        if choice == -1:
            head, rest = (s, s + 1, None), self._plan(s + 1, t, m - self.chain.saved[s])
            if rest[0][2] is None:  # merge into the stored run that follows
                return ((s, rest[0][1], None),) + rest[1:]
            return (head,) + rest
        inner = self._plan(s, choice - 1, m - _held(self.chain, t))
        return ((s, choice, inner),) + self._plan(choice, t, m - self.chain.act[choice])


def _shifted(row: np.ndarray, by: int) -> np.ndarray:
    """row[m - by] for every m (infeasible where m < by)."""
    if by <= 0:
        return row.copy()
    out = np.full(row.shape, INFEASIBLE)
    out[by:] = row[:-by] if by < len(row) else out[by:]
    return out


# ------------------------------------------------------------------------ checking


def simulate(chain: RotorChain, plan: tuple) -> tuple:
    """(time, peak units) of running ``plan`` for a whole step, operation by operation:
    a ledger of live tensors, each operation's peak its live units plus what it
    allocates and its temporary overhead. The chain input a_0 is live throughout, and
    d_n from the start (the DP's convention: Opt(0, n-1, M - act[0]) with d_n in m), and
    ``held`` from the first backward operation."""
    run = _Run(chain)
    run.alloc(("a", 0), chain.act[0])
    run.alloc(("d", chain.n), chain.act[chain.n])
    run.backward_range(0, chain.n, plan)
    return run.time, run.peak


class _Run:
    def __init__(self, chain: RotorChain):
        self.chain, self.live, self.time, self.peak = chain, {}, 0.0, 0

    def alloc(self, key, size: int, overhead: int = 0) -> None:
        assert key not in self.live, key
        self.peak = max(self.peak, sum(self.live.values()) + size + overhead)
        self.live[key] = size

    def free(self, key) -> None:
        del self.live[key]

    def backward_range(self, start: int, stop: int, children: tuple) -> None:
        """a_start live (someone else's), d_stop live; leaves d_start, frees d_stop."""
        assert children and children[0][0] == start and children[-1][1] == stop and children[-1][2] is None
        child_start, child_stop, inner = children[0]
        rest = children[1:]
        c = self.chain
        if inner is None:  # Fs over the child's stages, then the rest, then B in reverse
            for i in range(child_start, child_stop):
                self.alloc(("abar", i), c.saved[i], c.fwd_overhead[i])
                self.time += c.fwd_time[i]
            if rest:
                self.backward_range(child_stop, stop, rest)
            for i in reversed(range(child_start, child_stop)):
                if "held" not in self.live:  # the step's first backward operation
                    self.alloc("held", c.held)
                self.alloc(("d", i), c.act[i], c.bwd_overhead[i])
                self.time += c.bwd_time[i]
                self.free(("abar", i))
                self.free(("d", i + 1))
            return
        assert rest, "the last child of a range runs with its saves"
        for k in range(child_start, child_stop):  # Fn: keep only a_{child_stop}
            self.alloc(("a", k + 1), c.act[k + 1], c.fwd_overhead[k])
            self.time += c.fwd_time[k]
            if k > child_start:
                self.free(("a", k))
        self.backward_range(child_stop, stop, rest)
        self.free(("a", child_stop))
        self.backward_range(child_start, child_stop, inner)


def all_plans(start: int, stop: int):
    """Every plan of the range [start, stop): sequences of children, the last one run
    with its saves, stored runs maximal (no two adjacent), checkpointed runs not the
    last child, each with any plan of its own range."""
    if stop - start == 1:
        yield ((start, stop, None),)
        return
    yield ((start, stop, None),)
    for split in range(start + 1, stop):
        for rest in all_plans(split, stop):
            if rest[0][2] is not None:
                yield ((start, split, None),) + rest
            for inner in all_plans(start, split):
                yield ((start, split, inner),) + rest


def random_chain(rng: np.random.Generator, n: int, max_size: int = 6, held: bool = False) -> RotorChain:
    """A heterogeneous chain: sizes 1..max_size units, saves 1-3x the output; with
    ``held``, 1..max_size units held through the backward."""
    act = tuple(int(v) for v in rng.integers(1, max_size + 1, n + 1))
    saved = tuple(int(act[i + 1] * rng.integers(1, 4)) for i in range(n))
    return RotorChain(
        fwd_time=tuple(float(v) for v in rng.integers(1, 10, n)),
        bwd_time=tuple(float(v) for v in rng.integers(1, 20, n)),
        act=act, saved=saved,
        fwd_overhead=tuple(int(v) for v in rng.integers(0, 3, n)),
        bwd_overhead=tuple(int(v) for v in rng.integers(0, 3, n)),
        held=int(rng.integers(1, max_size + 1)) if held else 0,
    )


def brute_force(chain: RotorChain, budget: int) -> float:
    """The least simulated time over every plan whose simulated peak fits ``budget``."""
    best = INFEASIBLE
    for plan in all_plans(0, chain.n):
        time, peak = simulate(chain, plan)
        if peak <= budget:
            best = min(best, time)
    return best


def count_plans(n: int) -> int:
    return sum(1 for _ in all_plans(0, n))


__all__ = ["RotorChain", "RotorTable", "simulate", "all_plans", "brute_force", "random_chain", "count_plans",
           "INFEASIBLE", "itertools"]
