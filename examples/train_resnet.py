"""Train a deep ResNet with actsave.CheckpointedSequential on synthetic 32x32 images.

    python examples/train_resnet.py            # ResNet-29, batch 8, 12 steps: about 10 s on a CPU
    python examples/train_resnet.py --real     # ResNet-1001, batch 128, 100 steps (for a GPU)
    python examples/train_resnet.py --depth 164 --batch 64 --compress none --offload off

The change from plain PyTorch is one line: ``actsave.CheckpointedSequential(*layers,
...)`` where ``nn.Sequential(*layers)`` was. The segments keep only their input and
recompute the rest in backward; here the kept inputs are stored in 8 bits
(``compress="int8"``) and, on a GPU, in pinned host memory (``offload=True``).

The data: 10 classes, each a random colour; an image is its class's colour under
Gaussian noise, so the loss falls within a few steps. At the end the
script prints what actsave kept for backward after the last forward and, on CUDA, the
allocator's peak during the steps after the first.
"""
import argparse
import time

import torch
import torch.nn.functional as F

import actsave
from resnet import preact_resnet

SMOKE = dict(depth=29, batch=8, steps=12)
REAL = dict(depth=1001, batch=128, steps=100)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--real", action="store_true", help=f"real sizes: {REAL} (default: {SMOKE})")
    parser.add_argument("--depth", type=int, help="9n + 2: 29, 164, 1001, ...")
    parser.add_argument("--batch", type=int)
    parser.add_argument("--steps", type=int)
    parser.add_argument("--compress", default="int8", help="int8 (default), fp8 or none")
    parser.add_argument("--offload", choices=("auto", "on", "off"), default="auto",
                        help="auto (default): on with CUDA, off on a CPU, where it saves nothing")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    given = {k: getattr(args, k) for k in SMOKE if getattr(args, k) is not None}
    if any(value <= 0 for value in given.values()):
        parser.error(f"sizes must be positive: {given}")
    sizes = {**(REAL if args.real else SMOKE), **given}
    device = torch.device(args.device)
    compress = None if args.compress == "none" else args.compress
    offload = device.type == "cuda" if args.offload == "auto" else args.offload == "on"

    torch.manual_seed(0)
    model = actsave.CheckpointedSequential(*preact_resnet(sizes["depth"]), compress=compress,
                                           offload=offload).to(device)   # was: nn.Sequential(*layers)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    colours = torch.randn(10, 3, 1, 1, device=device)
    print(f"ResNet-{sizes['depth']}, batch {sizes['batch']}, {device}: compress={compress}, offload={offload}")

    losses, report = [], max(1, sizes["steps"] // 4)
    start = time.perf_counter()
    for step in range(sizes["steps"]):
        y = torch.randint(0, 10, (sizes["batch"],), device=device)
        x = colours[y] + torch.randn(sizes["batch"], 3, 32, 32, device=device)
        loss = F.cross_entropy(model(x), y)
        kept = actsave.kept_bytes()  # what actsave holds for backward, at the end of the forward
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step == 0 and device.type == "cuda":  # the first step plans the segments and compiles kernels
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        losses.append(loss.item())
        if (step + 1) % report == 0:
            print(f"steps {step + 2 - report:4d}-{step + 1:<4d} mean loss {sum(losses[-report:]) / report:.3f}")
    print(f"{(time.perf_counter() - start) / sizes['steps']:.3f} s per step")

    plan = model.balanced_plan  # the segments of the last training call, and their predicted peak
    print(f"{len(plan.starts)} segments over {len(model)} layers; predicted activation peak "
          f"{plan.predicted_peak_bytes / 2**20:.1f} MiB")
    print(f"kept for backward after the last forward: {kept['device'] / 2**20:.1f} MiB on the device, "
          f"{kept['host'] / 2**20:.1f} MiB in host memory")
    if device.type == "cuda":
        print(f"CUDA allocator peak, steps 2-{sizes['steps']}: {torch.cuda.max_memory_allocated() / 2**20:.0f} MiB "
              "(parameters, gradients and optimizer state included)")


if __name__ == "__main__":
    main()
