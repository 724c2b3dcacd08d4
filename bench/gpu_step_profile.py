"""Where a CUDA training step's time goes, per provider: ResNet (pre-activation
bottleneck, 32x32, 10 classes), one forward, cross-entropy (the sweeps' loss) and
backward under each of the sweeps' providers (harness.PROVIDERS).

For each provider it prints the median step time over 10 steps (the GPU awaited), the
median host time to enqueue a step (the GPU not awaited: when it is close to the step
time, the step is bound by Python and kernel launches, not by the GPU), and the CUDA
allocator's peak over the warm-up and timed steps (weights and gradients included).
With ``--profile`` it also writes torch.profiler's operator tables for ``torch_ckpt``
and ``actsave_none`` (``<out>/<gpu>-profile-<provider>-b<batch>.txt``; the folder is
bench/results/local/, or bench/results/ with --record). CUDA only.

    python bench/gpu_step_profile.py --batch 512 --providers torch,torch_ckpt,actsave_none
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

import harness  # noqa: E402  (bench/ is on sys.path when this script runs)
from harness.cli import parse_providers
from harness.measure import step_loss
from models import cifar_resnet

PROFILED = ("torch_ckpt", "actsave_none")


def timings(step) -> tuple:
    """(median step ms, median host enqueue ms, allocator peak MiB) of ``step``, after
    3 warm-up steps."""
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
    peak_mib = torch.cuda.max_memory_allocated() / 2**20
    return statistics.median(awaited) * 1e3, statistics.median(enqueued) * 1e3, peak_mib


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
    parser.add_argument("--providers", type=parse_providers, default=parse_providers("torch_ckpt,actsave_none"),
                        help=f"comma-separated, from {','.join(harness.PROVIDERS)} (torch is always measured); "
                             "actsave_auto plans for the whole card")
    parser.add_argument("--profile", action="store_true", help=f"write operator tables for {' and '.join(PROFILED)}")
    harness.add_output_arguments(parser, "folder of the operator tables, <device>-profile-<provider>-b<batch>.txt")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_step_profile: needs a CUDA GPU", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    inputs = torch.randn(args.batch, 3, 32, 32, device="cuda")
    targets = torch.randint(0, 10, (args.batch,), device="cuda")
    budget = torch.cuda.get_device_properties(0).total_memory
    folder = harness.output_path(args, "")
    slug = harness.device_slug(torch.device("cuda"))
    print(f"ResNet-{args.depth} b{args.batch} 32x32 on {torch.cuda.get_device_name()}")
    print(f"{'provider':22s} {'peak MiB':>9s} {'step ms':>8s} {'host ms':>8s}")
    for name in args.providers:
        chain = cifar_resnet(args.depth, num_classes=10).cuda()
        model = harness.PROVIDERS[name].build(chain, (inputs, targets), budget)

        def step():
            step_loss(model(inputs), targets).backward()

        step_ms, host_ms, peak = timings(step)
        print(f"{name:22s} {peak:9.0f} {step_ms:8.1f} {host_ms:8.1f}", flush=True)
        if args.profile and name in PROFILED:
            folder.mkdir(parents=True, exist_ok=True)
            table = folder / f"{slug}-profile-{name}-b{args.batch}.txt"
            table.write_text(operator_tables(step))
            print(harness.wrote(table))
        del chain, model, step
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    harness.imports_frozen()  # NOTE [ A script's imports, frozen ]
    sys.exit(main(sys.argv[1:]))
