"""Does it fit? Estimate and plan a training step at real scale without the GPU.

    python examples/plan_at_scale.py              # ResNet-164, batch 128: about 10 s on a CPU
    python examples/plan_at_scale.py --real       # ResNet-1001, batch 128: about a minute
    python examples/plan_at_scale.py --budget-mib 1000 --gpu-gib 24

Everything runs on meta tensors, which have shapes and dtypes but no data: the model
is built on the meta device (no memory, no initialisation) and each step is simulated
as on a CUDA device (its 512-byte allocation granularity, the Triton codecs'
allocations, offload to a separate host memory).

1. ``actsave.estimate`` runs one training step of each mode (and of plain PyTorch and
   ``torch.utils.checkpoint.checkpoint_sequential``, sqrt(n) segments) and reports its peak
   activation memory on the device, the host memory offload takes, and the total
   with parameters, gradients and SGD-momentum state.
2. ``actsave.profile`` measures the chain once, per layer, and ``actsave.plan``
   finds the smallest peak for each set of levers (a meta profile has no times, so
   ``objective="memory"``): exact recompute, then with offload, then with int8 too.
3. The first set whose plan fits ``--budget-mib`` is applied, and the model
   estimated again: the estimate is the plan's prediction.

On a real GPU keep a margin: kernels that need workspaces (cuDNN) are not simulated
(docs/limits.md, "Meta estimates").
"""
import argparse
import math

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint_sequential

import actsave
from resnet import preact_resnet

SMOKE = dict(depth=164, batch=128)
REAL = dict(depth=1001, batch=128)
MODES = {  # name: CheckpointedSequential options, or how to build the baselines
    "nn.Sequential": "plain",
    "torch checkpoint": "torch",
    "actsave default": {},
    'compress="int8"': {"compress": "int8"},
    "offload=True": {"offload": True},
    'int8 + offload': {"compress": "int8", "offload": True},
}
LEVERS = {  # what actsave.plan may use: allow=
    "recompute (exact)": ("recompute",),
    "+ offload": ("recompute", "offload"),
    "+ int8 + offload": ("recompute", "int8", "offload"),
}
MiB, GiB = 2**20, 2**30


class TorchCheckpoint(nn.Sequential):
    """The baseline: torch.utils.checkpoint.checkpoint_sequential, round(sqrt(n)) segments."""

    def forward(self, x):
        return checkpoint_sequential(self, max(1, round(math.sqrt(len(self)))), x, use_reentrant=False)


def build(layers: list, options) -> nn.Module:
    if options == "plain":
        return nn.Sequential(*layers)
    if options == "torch":
        return TorchCheckpoint(*layers)
    return actsave.CheckpointedSequential(*layers, **options)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--real", action="store_true", help=f"real sizes: {REAL} (default: {SMOKE})")
    parser.add_argument("--depth", type=int, help="9n + 2: 164, 1001, 2000, ...")
    parser.add_argument("--batch", type=int)
    parser.add_argument("--budget-mib", type=float, default=300.0, help="activation budget to plan for (300)")
    parser.add_argument("--gpu-gib", type=float, default=16.0, help="the GPU's memory, to say what fits (16)")
    args = parser.parse_args()
    given = {k: getattr(args, k) for k in SMOKE if getattr(args, k) is not None}
    if any(value <= 0 for value in given.values()) or not args.budget_mib > 0:
        parser.error(f"sizes and --budget-mib must be positive: {given}, --budget-mib {args.budget_mib}")
    sizes = {**(REAL if args.real else SMOKE), **given}
    shape = (sizes["batch"], 3, 32, 32)
    with torch.device("meta"):  # parameters too: ResNet-1001 costs no memory
        layers = preact_resnet(sizes["depth"])
    print(f"ResNet-{sizes['depth']}, batch {sizes['batch']}, 32x32, as on CUDA (meta tensors)\n")

    print(f"{'mode':18} {'activations':>12} {'host':>12} {'total':>10}  fits {args.gpu_gib:g} GiB")
    for name, options in MODES.items():
        model = build(layers, options)
        est = actsave.estimate(model, shape, device="cuda", optimizer="momentum")
        fits = "yes" if est.total_peak_bytes <= args.gpu_gib * GiB else "no"
        print(f"{name:18} {est.activation_peak_bytes / MiB:8.1f} MiB {est.host_peak_bytes / MiB:8.1f} MiB "
              f"{est.total_peak_bytes / MiB:6.0f} MiB  {fits}")

    model = actsave.CheckpointedSequential(*layers)
    profile = actsave.profile(model, (torch.empty(shape, device="meta"),), device="cuda")
    budget = int(args.budget_mib * MiB)
    print(f"\nsmallest activation peak per set of levers (actsave.plan, objective='memory'); "
          f"budget {args.budget_mib:g} MiB:")
    chosen = None
    for name, allow in LEVERS.items():
        plan = actsave.plan(profile, None, objective="memory", allow=allow)
        fits = plan.predicted_peak_bytes <= budget
        chosen = chosen or (plan if fits else None)  # the first, least lossy set that fits
        print(f"  {name:20} {plan.predicted_peak_bytes / MiB:8.1f} MiB in {len(plan.starts):3d} segments"
              + ("  fits" if fits else ""))
    if chosen is None:
        raise SystemExit(f"no plan fits {args.budget_mib:g} MiB at batch {sizes['batch']}: try a smaller batch")
    model.apply_plan(chosen)
    est = actsave.estimate(model, shape, device="cuda")
    print(f"\nthe first that fits, applied and estimated: {est.activation_peak_bytes / MiB:.1f} MiB on the device "
          f"(predicted {chosen.predicted_peak_bytes / MiB:.1f}), {est.host_peak_bytes / MiB:.1f} MiB in host memory")


if __name__ == "__main__":
    main()
