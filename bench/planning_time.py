"""How long the planner takes on a long chain (docs/results.md, "Planning time").

One profile of a 1,000-layer MLP (500 x Linear(16, 16), ReLU; batch 8, CPU), then
``actsave.plan`` on it at 100%, 30% and 10% of its no-checkpoint peak and for the
smallest peak, with the default levers and with int8 allowed (plain segments kept by
it too). Printed: the wall time of each plan and its segment count. A planner's
time is the host's alone, so the figures are this CPU's.

    python bench/planning_time.py            # 1,000 layers
    python bench/planning_time.py --smoke    # 130 layers, for the tests
"""
import argparse
import time

import torch
from torch import nn

import actsave
from actsave.planning import plans

SHARES = (1.0, 0.3, 0.1)  # budgets, as shares of the no-checkpoint peak
LEVERS = (plans.DEFAULT_ALLOW, ("recompute", "int8"))


def mlp(blocks: int, width: int = 16) -> nn.Sequential:
    """``blocks`` x (Linear(width, width), ReLU), seeded: 2 * blocks layers."""
    torch.manual_seed(0)
    return nn.Sequential(*[m for _ in range(blocks) for m in (nn.Linear(width, width), nn.ReLU())])


def timed(plan_call) -> tuple:
    """``(seconds, plan)`` of one call."""
    start = time.perf_counter()
    plan = plan_call()
    return time.perf_counter() - start, plan


def planning_times(prof, allow, shares) -> list:
    """One line's parts: the time and segment count of each share's plan, then the
    smallest peak's time."""
    everything = plans.predict(prof, [0]).predicted_peak_bytes
    parts = []
    for share in shares:
        seconds, plan = timed(lambda: actsave.plan(prof, int(share * everything), allow=allow))
        parts.append(f"{share:.0%} of the no-checkpoint peak: {seconds:.3f} s, {len(plan.starts)} segments")
    seconds, _ = timed(lambda: actsave.plan(prof, None, objective="memory", allow=allow))
    return parts + [f"smallest peak: {seconds:.3f} s"]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="130 layers at 100%% and 30%%, for the tests")
    args = parser.parse_args(argv)
    # The smoke chain is longer than nested_solver.MAX_LAYERS, so planned single-level
    # as the 1,000 layers are; 10% of its peak is below its smallest one.
    blocks, shares = (65, SHARES[:2]) if args.smoke else (500, SHARES)
    prof = actsave.profile(mlp(blocks), (torch.randn(8, 16),))
    for allow in LEVERS:
        times = planning_times(prof, allow, shares)
        print(f"planning {2 * blocks:,} layers, allow={allow}: " + "; ".join(times), flush=True)


if __name__ == "__main__":
    main()
