"""What plain middle segments buy the planner (issue 36, item 4).

A plain middle segment is one before the last that runs plainly, never recomputed,
its saves as autograd keeps them or, with a lossy codec allowed, by the codec
(``actsave.plan(..., plain_middle=True)``, the default). For each chain: one profile
(per-layer median times of --profiles profiled steps, as bench/rotor_compare.py),
then, on that profile, the smallest feasible peak with and without plain middle
segments, and at --points budgets from the larger of those to plain's peak, the
predicted step time of each plan. Printed: the smallest peaks, the largest
predicted time win of allowing them (time without / time with - 1) and the budget
where it is, and with codecs, at how many budgets the plan keeps a middle segment's
saves by one. Predictions of the memory model, so both sides read the same profile;
a loaded machine moves both together.

    python bench/plain_middle.py            # the bench chains, CPU, one thread
    python bench/plain_middle.py --smoke    # one small chain, a few budgets
"""
import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import actsave  # noqa: E402
from actsave.planning import plans  # noqa: E402
from models import cifar_resnet, conv_bn_relu_chain, gpt, pooled_resnet  # noqa: E402
from rotor_compare import median_times  # noqa: E402

LEVERS = {"recompute": ("recompute",), "recompute+int8+fp8": ("recompute", "int8", "fp8")}


def chains(smoke: bool) -> dict:
    torch.manual_seed(0)
    if smoke:
        return {"convbnrelu4 b2 8x8": (conv_bn_relu_chain(4, image_size=8), torch.randn(2, 16, 8, 8))}
    return {
        "resnet164 b8 16x16": (cifar_resnet(164), torch.randn(8, 3, 16, 16)),
        "resnet56 b8 16x16": (cifar_resnet(56), torch.randn(8, 3, 16, 16)),
        "convbnrelu16 b8 16x16": (conv_bn_relu_chain(16), torch.randn(8, 16, 16, 16)),
        "pooled_resnet b8 32x32": (pooled_resnet(), torch.randn(8, 3, 32, 32)),
        "gpt8 w256 b2 t128": (gpt(8), torch.randint(0, 1024, (2, 128))),
    }


def planned(prof, budget: int, allow: tuple, plain_middle: bool):
    try:
        return actsave.plan(prof, budget, allow=allow, plain_middle=plain_middle)
    except actsave.ConfigError:  # infeasible at this budget
        return None


def compare(prof, allow: tuple, points: int) -> tuple:
    """(smallest peak with, without; largest time win; its budget; plain's peak; the
    budgets where a middle segment's saves are kept by a codec)."""
    plain = plans.predict(prof, [0]).predicted_peak_bytes
    smallest = [actsave.plan(prof, None, objective="memory", allow=allow, plain_middle=flag).predicted_peak_bytes
                for flag in (True, False)]
    low, best, at, coded = max(smallest), 0.0, None, 0
    for i in range(points):
        budget = int(low + (plain - low) * i / (points - 1))
        with_, without = (planned(prof, budget, allow, flag) for flag in (True, False))
        if with_ is None or without is None:
            continue
        coded += any(codec not in (None, "none") for codec in with_.saves_codecs[:-1])
        win = without.predicted_step_seconds / with_.predicted_step_seconds - 1
        if win > best:
            best, at = win, budget
    return (*smallest, best, at, plain, coded)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="one small chain, a few budgets")
    parser.add_argument("--points", type=int, default=17, help="budgets per chain and levers")
    parser.add_argument("--profiles", type=int, default=3, help="profiled steps per chain (median times)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    points = 3 if args.smoke else args.points
    for name, (model, x) in chains(args.smoke).items():
        prof = median_times([actsave.profile(model, (x,)) for _ in range(1 if args.smoke else args.profiles)])
        for levers, allow in LEVERS.items():
            with_, without, win, at, plain, coded = compare(prof, allow, points)
            where = "" if at is None else f" at {at / 2**20:.2f} MiB (plain {plain / 2**20:.2f})"
            by_codec = f"; middle saves by a codec at {coded} of {points} budgets" if len(allow) > 1 else ""
            print(f"{name:24s} {levers:20s} smallest peak with / without {with_ / 2**20:8.3f} / "
                  f"{without / 2**20:8.3f} MiB; largest time win {win:+.2%}{where}{by_codec}", flush=True)


if __name__ == "__main__":
    main()
