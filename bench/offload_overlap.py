"""How much of offload's host copying hides behind compute, on CUDA.

A ResNet (bench/models.py) is cut into the same segments (``segments="sqrt"``) twice:
keeping its segment inputs on the device, and offloading them (``offload=True``),
with no codec and with int8. Per pair:

- ``copy``: the offloaded bytes (``actsave.kept_bytes()["host"]`` at the end of a
  forward) copied device -> pinned host and back alone, on a side stream, as one
  buffer (segment inputs are megabytes, where PCIe runs at full speed);
- ``step`` and ``step_offload``: a training step without and with offload, timed in
  turn (ABAB...), medians;
- ``hidden``: the share of the copy time the step does not pay,
  ``1 - (step_offload - step) / copy`` (100% when the copies overlap compute fully).

Without CUDA the copies are plain synchronous memcpys with nothing to overlap, so the
script refuses, except with ``--smoke`` (tiny shapes, for the tests).

    python bench/offload_overlap.py [--depth 164] [--batch 64] [--repeats 20] [--out PATH]
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import json
import statistics
import sys
import time

import torch

import actsave
from actsave import devices
import harness
from actsave.text import format_table
from models import cifar_resnet

NUM_CLASSES = 10
CODECS = (None, "int8")
UNITS = {"copy_ms": "ms", "step_ms": "ms", "step_offload_ms": "ms", "hidden_pct": "%", "offloaded_MiB": "MiB"}


def _elapsed_ms(function, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    function()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - start) * 1e3


def copy_ms(nbytes: int, device: torch.device, repeats: int) -> float:
    """Median time of ``nbytes`` copied to (pinned) host memory and back, on a side stream."""
    source = torch.empty(nbytes, dtype=torch.uint8, device=device)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    stream = torch.cuda.stream(torch.cuda.Stream(device)) if device.type == "cuda" else contextlib.nullcontext()

    def round_trip():
        with stream:
            host.copy_(source, non_blocking=True)
            source.copy_(host, non_blocking=True)

    round_trip()
    return statistics.median(_elapsed_ms(round_trip, device) for _ in range(repeats))


def offloaded_bytes(model, batch: tuple) -> int:
    """What a forward of ``model`` leaves in host memory for its backward."""
    loss = torch.nn.functional.cross_entropy(model(batch[0]), batch[1])
    host = actsave.kept_bytes()["host"]
    loss.backward()
    return host


def measure(base: torch.nn.Module, batch: tuple, codec, repeats: int, device: torch.device) -> dict:
    models = {offload: actsave.CheckpointedSequential.from_sequential(
        copy.deepcopy(base).to(device), segments="sqrt", compress=codec, offload=offload)
        for offload in (False, True)}
    for model in models.values():
        harness.training_step(model, batch)  # warm-up: gradients allocated, kernels compiled
    times = harness.interleaved_times(models, batch, repeats, device)
    nbytes = offloaded_bytes(models[True], batch)
    copied = copy_ms(nbytes, device, repeats)
    step, step_offload = statistics.median(times[False]), statistics.median(times[True])
    return {"offloaded_MiB": nbytes / harness.MiB, "copy_ms": copied, "step_ms": step,
            "step_offload_ms": step_offload, "hidden_pct": 100 * (1 - (step_offload - step) / copied)}


def csv_rows(results: dict, case: str, metadata: dict, config: dict) -> list:
    return [{
        "bench": "offload_overlap", "case": case, "provider": f"actsave_{codec or 'none'}_offload",
        "metric": metric, "unit": UNITS[metric], "x_name": "depth", "x_value": config["depth"],
        "p20": value, "p50": value, "p80": value, "n_reps": config["repeats"],
        "config_json": json.dumps({**config, "codec": codec}, sort_keys=True), **metadata,
    } for codec, row in results.items() for metric, value in row.items()]


def table(results: dict) -> str:
    lines = [("codec", *UNITS)]
    lines += [(codec or "none", *(f"{row[m]:.2f}" for m in UNITS)) for codec, row in results.items()]
    return format_table(lines)


def parse_arguments(argv) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--depth", type=int, default=164, help="CIFAR ResNet depth, 9n + 2 (default 164)")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=20, help="timed steps per variant (median)")
    harness.add_output_arguments(parser, "CSV, <device>.csv")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on any device, for the tests")
    args = parser.parse_args(argv)
    if args.smoke:
        args.depth, args.batch, args.image_size, args.repeats = 11, 2, 8, 1
    return args


def main(argv=None) -> int:
    args = parse_arguments(argv)
    cuda = torch.cuda.is_available()
    if not (cuda or args.smoke):
        print("offload_overlap.py needs a CUDA device: without one, offload copies synchronously and nothing "
              "overlaps. Run it on a GPU machine (make gpu-check), or with --smoke to check the script.",
              file=sys.stderr)
        return 2
    device = torch.device("cuda" if cuda else "cpu")
    if not cuda:
        torch.set_num_threads(1)  # see harness.SIZED_OPTIONS["threads"]: two threads on a shared CPU crawl
    torch.manual_seed(harness.SEED)
    base = cifar_resnet(args.depth, num_classes=NUM_CLASSES)
    generator = torch.Generator().manual_seed(harness.SEED)
    batch = (torch.randn(args.batch, 3, args.image_size, args.image_size, generator=generator).to(device),
             torch.randint(0, NUM_CLASSES, (args.batch,), generator=generator).to(device))
    # On a CPU offload keeps tensors where they are (NOTE [ Separate host memory ]); the
    # smoke run copies them to the pool all the same, to run the script's whole path.
    with contextlib.nullcontext() if cuda else devices.host_tier_simulated():
        results = {codec: measure(base, batch, codec, args.repeats, device) for codec in CODECS}
    case = f"cifar_resnet b{args.batch} {args.image_size}x{args.image_size} sqrt segments"
    print(f"offload overlap: ResNet-{args.depth}, {case}, on {harness.device_name(device)}")
    print(table(results))
    if not cuda:
        print("CPU (--smoke): copies are synchronous; the numbers check the script, not the overlap")
    out = harness.output_path(args, f"{harness.device_slug(device)}.csv")
    config = {"depth": args.depth, "batch": args.batch, "image_size": args.image_size, "repeats": args.repeats}
    harness.write_csv(csv_rows(results, case, harness.run_metadata(device), config), out)
    print(harness.wrote(out))
    return 0


if __name__ == "__main__":
    harness.imports_frozen()  # NOTE [ A script's imports, frozen ]
    sys.exit(main(sys.argv[1:]))
