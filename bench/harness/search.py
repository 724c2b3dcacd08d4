"""``max_depth``: the deepest model whose step peaks within a budget, found by a
secant search over blocks (:func:`deepest_fitting`)."""
from __future__ import annotations

import math
import time
from typing import Callable, Optional

import torch

from actsave.meta import plans_at_first_call

from .measure import _release_memory, _unless_out_of_memory, measure_step_memory
from .progress import Progress
from .providers import PROVIDERS, Provider
from .results import _format_mib
from .workload import Measurement, MiB, Workload, _batch, _seeded_model


def step_peak_at_depth(workload: Workload, provider: Provider, depth: int, budget: int, device) -> float:
    """Peak bytes of one training step at ``depth`` (inf when the device runs out)."""

    def probe():
        batch = _batch(workload, device)
        model = provider.build(_seeded_model(workload, depth).to(device), batch, budget)
        if plans_at_first_call(model):
            model(batch[0])  # plans now, not under the memory tracker
        for parameter in model.parameters():
            # What a first step would allocate, without paying for that step.
            parameter.grad = torch.zeros_like(parameter)
        return measure_step_memory(model, batch, device).peak

    peak = _unless_out_of_memory(probe)
    _release_memory(device)
    return math.inf if peak is None else peak


def deepest_fitting(peak_of: Callable[[int], float], budget: float, peaks: dict, out_of_time,
                    cap: Optional[int] = None) -> tuple:
    """Largest n with ``peak_of(n) <= budget``, given ``peaks`` (n -> peak) already
    measured; ``peaks`` gains every probe. Returns ``(fits, fails, complete)``: the
    largest n measured to fit (0: none), the smallest measured not to (None: none),
    and whether they are adjacent (False: time ran out, or ``cap``, the largest n
    probed, fits: ``fits`` is a lower bound).

    Peak memory grows about linearly in n, so each probe goes where the line through
    the two nearest measurements crosses the budget, kept strictly inside the
    bracket (or just past the deepest fit, at most 4x, while there is no upper end):
    two or three probes usually settle it. After two probes in a row on the same side
    the next one bisects (or at least doubles), which bounds the worst case.
    """
    sides = []
    while True:
        fits = max((n for n, peak in peaks.items() if peak <= budget), default=0)
        fails = min((n for n, peak in peaks.items() if peak > budget), default=None)
        if fails is not None and fails - fits <= 1:
            return fits, fails, True
        if out_of_time() or (cap is not None and fits >= cap):
            return fits, fails, False
        halve = len(sides) >= 2 and sides[-1] == sides[-2]
        n = _next_probe(peaks, budget, fits, fails, halve)
        n = n if cap is None else min(n, cap)
        peaks[n] = peak_of(n)
        sides.append(peaks[n] <= budget)


def _next_probe(peaks: dict, budget: float, fits: int, fails: Optional[int], halve: bool) -> int:
    if fails is None:  # no upper end yet: extrapolate just past the crossing, at most 4x
        deepest = sorted(peaks)[-2:]
        guess = 2 * fits if len(deepest) < 2 else _crossing(peaks, budget, *deepest) + 1
        return _clamp(max(guess, 2 * fits) if halve else guess, fits + 1, max(2, 4 * fits))
    if halve or fits == 0 or math.isinf(peaks[fails]):
        return max(1, (fits + fails) // 2)
    return _clamp(_crossing(peaks, budget, fits, fails), fits + 1, fails - 1)


def _crossing(peaks: dict, budget: float, a: int, b: int) -> float:
    """Where the line through the peaks at ``a`` and ``b`` reaches ``budget``."""
    slope = (peaks[b] - peaks[a]) / (b - a)
    return math.inf if slope <= 0 else b + (budget - peaks[b]) / slope


def _clamp(x: float, low: int, high: int) -> int:
    return low if x < low else high if x > high else int(x)


class MaxDepthSearch:
    """Finds, per provider, the deepest model of ``workload`` whose peak stays within
    ``budget`` bytes. ``peak_of(name, depth)`` gives a peak (measured, or estimated
    on meta tensors: ``method`` says which); ``seeds[name]`` the peaks known already
    (depth -> bytes), where the search starts. No depth beyond ``cap_depth`` is probed:
    a provider that fits there gets a lower bound."""

    def __init__(self, workload: Workload, budget: float, peak_of: Callable[[str, int], float], seeds: dict,
                 method: str, x_name: str, cap_depth: Optional[int] = None):
        self.workload, self.budget, self.peak_of, self.seeds = workload, budget, peak_of, seeds
        self.method, self.x_name, self.cap_depth = method, x_name, cap_depth

    def run(self, name: str, seconds: float, progress: "Progress") -> Measurement:
        blocks_of, depth_of = self.workload.blocks_of_depth, self.workload.depth_of_blocks
        peaks = {blocks_of(depth): peak for depth, peak in self.seeds.get(name, {}).items()}
        probed = []

        def peak_of(blocks: int) -> float:
            depth = depth_of(blocks)
            progress.describe(f"{name}: depth {depth}")
            probed.append(depth)
            return self.peak_of(name, depth)

        deadline = time.perf_counter() + seconds
        cap = None if self.cap_depth is None else blocks_of(self.cap_depth)
        fits, fails, complete = deepest_fitting(peak_of, self.budget, peaks, lambda: time.perf_counter() > deadline,
                                                cap)
        config = {
            "method": self.method if complete else self.method + "_lower_bound",
            "search": "secant search over blocks from the swept depths, bisection safeguard",
            "does_not_fit": depth_of(fails) if fails else None,
            "depth_cap": self.cap_depth,
            "probed_depths": probed,
            "search_seconds": round(seconds, 1),
        }
        depth = depth_of(fits) if fits else 0
        return Measurement(name, "max_depth", self.x_name, self.budget / MiB, (depth,), config)


def measured_search(workload: Workload, budget: int, swept: list, device) -> MaxDepthSearch:
    """The search on real training steps, whose whole peak must fit ``budget``."""
    seeds = {}
    for m in swept:
        if m.metric == "peak_mem":
            seeds.setdefault(m.provider, {})[m.x_value] = m.values[0] * MiB
    return MaxDepthSearch(
        workload, budget, lambda name, depth: step_peak_at_depth(workload, PROVIDERS[name], depth, budget, device),
        seeds, method="measured", x_name="budget_MiB")


def search_max_depths(search: MaxDepthSearch, providers: list, seconds: float) -> list:
    """``max_depth`` of every provider; the search time is shared out evenly."""
    progress = Progress(len(providers), f"max depth in {_format_mib(search.budget)}")
    deadline = time.perf_counter() + seconds
    results = []
    for left, name in zip(range(len(providers), 0, -1), providers):
        progress.describe(name)
        share = max(0.0, deadline - time.perf_counter()) / left
        results.append(search.run(name, share, progress))
        progress.advance()
    progress.close()
    return results
