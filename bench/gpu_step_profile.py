"""Where a CUDA training step's time goes, per mode: ResNet-164 (pre-activation
bottleneck, 32x32, 10 classes), one cross-entropy step of each mode.

For each mode it prints the median step time over 10 steps (the GPU awaited), the
median host time to enqueue a step (the GPU not awaited: when it is close to the step
time, the step is bound by Python and kernel launches, not by the GPU), and the CUDA
allocator's peak over the warm-up and timed steps (weights and gradients included).
With ``--profile`` it also writes torch.profiler's operator tables for
``torch_ckpt`` and ``actsave`` (``<out>/profile-<mode>.txt``). CUDA only.

    python bench/gpu_step_profile.py --batch 512 --modes plain,torch_ckpt,actsave
"""
from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile
from torch.utils.checkpoint import checkpoint_sequential

import actsave
from models import cifar_resnet

MODES = ("plain", "torch_ckpt", "actsave", "actsave_sqrt", "actsave_int8", "actsave_offload")


class CheckpointSequential(torch.nn.Module):
    """torch.utils.checkpoint.checkpoint_sequential with round(sqrt(n)) segments."""

    def __init__(self, chain: torch.nn.Sequential):
        super().__init__()
        self.chain, self.segments = chain, max(1, round(math.sqrt(len(chain))))

    def forward(self, x):
        return checkpoint_sequential(self.chain, self.segments, x, use_reentrant=False)


ACTSAVE_OPTIONS = {"actsave": {}, "actsave_sqrt": {"segments": "sqrt"}, "actsave_int8": {"compress": "int8"},
                   "actsave_offload": {"offload": True}}


def build(mode: str, depth: int) -> torch.nn.Module:
    chain = cifar_resnet(depth, num_classes=10).cuda()
    if mode == "plain":
        return chain
    if mode == "torch_ckpt":
        return CheckpointSequential(chain)
    return actsave.CheckpointedSequential.from_sequential(chain, **ACTSAVE_OPTIONS[mode])


def measure(model: torch.nn.Module, batch: tuple) -> tuple:
    """(median step ms, median host enqueue ms, peak allocated MiB, the step)."""
    x, y = batch

    def step():
        torch.nn.functional.cross_entropy(model(x), y).backward()

    torch.cuda.reset_peak_memory_stats()
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    awaited, enqueued = [], []
    for _ in range(10):
        start = time.perf_counter()
        step()
        torch.cuda.synchronize()
        awaited.append(time.perf_counter() - start)
    for _ in range(5):
        torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        enqueued.append(time.perf_counter() - start)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() / 2**20
    return statistics.median(awaited) * 1e3, statistics.median(enqueued) * 1e3, peak, step


def operator_tables(step) -> str:
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    averages = prof.key_averages()
    return (averages.table(sort_by="self_cpu_time_total", row_limit=30) + "\n\n"
            + averages.table(sort_by="self_device_time_total", row_limit=30))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--depth", type=int, default=164)
    parser.add_argument("--modes", type=lambda text: text.split(","), default=list(MODES[:4]),
                        help=f"comma-separated, from {','.join(MODES)}")
    parser.add_argument("--profile", action="store_true", help="write operator tables for torch_ckpt and actsave")
    parser.add_argument("--out", type=Path, default=Path("."), help="folder of the operator tables")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.modes) - set(MODES))
    if unknown:
        parser.error(f"unknown mode(s) {unknown}; choose from {MODES}")
    if not torch.cuda.is_available():
        print("gpu_step_profile: needs a CUDA GPU", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    batch = (torch.randn(args.batch, 3, 32, 32, device="cuda"), torch.randint(0, 10, (args.batch,), device="cuda"))
    print(f"ResNet-{args.depth} b{args.batch} 32x32 on {torch.cuda.get_device_name()}")
    print(f"{'mode':16s} {'peak MiB':>9s} {'step ms':>8s} {'host ms':>8s}")
    for mode in args.modes:
        model = build(mode, args.depth)
        step_ms, host_ms, peak, step = measure(model, batch)
        print(f"{mode:16s} {peak:9.0f} {step_ms:8.1f} {host_ms:8.1f}", flush=True)
        if args.profile and mode in ("torch_ckpt", "actsave"):
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / f"profile-{mode}.txt").write_text(operator_tables(step))
        del model, step
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
