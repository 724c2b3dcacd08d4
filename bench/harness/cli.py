"""The sweep scripts' command line and :func:`run_benchmark`, which runs a sweep end
to end."""
from __future__ import annotations

import argparse
import re
from pathlib import Path

import torch

from .providers import PROVIDERS, REFERENCE, available_providers
from .report import estimate_deviation, max_depth_table, plot, sweep_table
from .results import (_format_mib, add_output_arguments, csv_rows, device_name, device_slug, output_path,
                      read_measurements, run_metadata, write_csv, wrote)
from .search import measured_search, search_max_depths
from .depth_sweep import sweep
from .workload import SEED, MiB, Workload


def parse_depths(text: str) -> list:
    try:
        depths = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        depths = []
    if not depths or min(depths) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give positive depths separated by commas, e.g. 29,56,110")
    return sorted(set(depths))


_UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}


def parse_budget(text: str) -> int:
    """Bytes from ``"8GiB"``, ``"512MiB"``, ``"1.5GiB"`` or a plain number of bytes."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(B|KiB|MiB|GiB|TiB)?\s*", text)
    if not match:
        raise argparse.ArgumentTypeError(f"{text!r}: give a size such as 512MiB or 8GiB (units {list(_UNITS)})")
    return int(float(match[1]) * _UNITS[match[2] or "B"])


def parse_providers(text: str) -> list:
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in PROVIDERS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown provider(s) {unknown}; choose from {list(PROVIDERS)}")
    # The reference is always measured: ratios and gradient errors are against it.
    return [REFERENCE] + [name for name in names if name != REFERENCE]


def parse_device(text: str) -> torch.device:
    device = torch.device(text)
    if device.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"{text!r}: peak memory is measured on cpu or cuda devices only")
    # MemTracker files CPU memory under torch.device("cpu"), without an index.
    return torch.device("cpu") if device.type == "cpu" else device


# Options whose default depends on the device (and on --smoke): name -> (parse, help).
SIZED_OPTIONS = {
    "depths": (parse_depths, "comma-separated depths to sweep"),
    "batch": (int, "batch size"),
    "budget": (parse_budget, "memory budget of max_depth (peak of one training step), e.g. 512MiB, 8GiB"),
    "repeats": (int, "timed steps per depth and provider (the median is reported)"),
    "search_seconds": (float, "time allowed for the whole max_depth search; past it, a lower bound"),
    # On a shared CPU, intra-op threads that wait on each other made steps 10x slower
    # and as noisy (ResNet-56, 2 cores, load 4: 0.6-1.7 s a step with 2 threads, 72 ms
    # with 1), so the CPU profiles use one.
    "threads": (int, "intra-op CPU threads, 0 for PyTorch's default"),
}
PROFILES = ("cpu", "cuda", "smoke")


def parse_arguments(argv, description: str, defaults: dict, options: dict) -> argparse.Namespace:
    """The sweep's command line, parsed.

    ``options`` adds workload-specific sized options (name -> (parse, help)).
    ``defaults[profile][name]`` gives each sized option's default, written as on the
    command line, for the profiles ``cpu``, ``cuda`` and ``smoke`` (``--smoke`` wins
    over the device); ``--help`` shows them all.
    """
    sized = {**SIZED_OPTIONS, **options}
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    for name, (parse, help_text) in sized.items():
        shown = ", ".join(f"{profile} {defaults[profile][name]}" for profile in PROFILES)
        parser.add_argument("--" + name.replace("_", "-"), type=parse, help=f"{help_text} (default: {shown})")
    parser.add_argument("--providers", type=parse_providers, default=parse_providers(",".join(PROVIDERS)),
                        help=f"comma-separated providers (default: all of {','.join(PROVIDERS)}); "
                             "torch is always measured, as the reference")
    parser.add_argument("--device", type=parse_device, default=None,
                        help="cpu or cuda[:index] (default: cuda when available, else cpu)")
    add_output_arguments(parser, "CSV path, <device>.csv; the PNG is written next to it")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes and budget, for the tests")
    parser.add_argument("--replot", action="store_true",
                        help="measure nothing: draw the PNG again from this sweep's rows in the CSV (with --record, "
                             "the committed ones)")

    args = parser.parse_args(argv)
    if args.device is None:
        args.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    profile = "smoke" if args.smoke else args.device.type
    for name, (parse, _) in sized.items():
        if getattr(args, name) is None:
            setattr(args, name, parse(defaults[profile][name]))
    if args.out is None:  # the device's name only where needed: --replot --out runs without that device
        args.out = output_path(args, f"{device_slug(args.device)}.csv")
    if args.threads:
        torch.set_num_threads(args.threads)
    return args


def run_benchmark(workload: Workload, args: argparse.Namespace, real_scale=None) -> None:
    """Sweep, search, print the tables, write the CSV and the PNG. ``real_scale``
    (bench/real_scale.py), where given, adds its meta-tensor sweep and replaces the
    measured max-depth search by its own."""
    if args.replot:
        replot(workload, args, real_scale)
        return
    for depth in args.depths:
        workload.blocks_of_depth(depth)  # a depth the family cannot build fails now, not mid-run
    providers, notes = available_providers(args.providers)
    measurements = sweep(workload, args.depths, providers, args.budget, args.repeats, args.device, notes)
    if real_scale is None:
        search = measured_search(workload, args.budget, measurements, args.device)
        scaled, max_depths = [], search_max_depths(search, providers, args.search_seconds)
    else:
        scaled, max_depths = real_scale.run(providers, args.search_seconds, notes)

    title = _title(workload, device_name(args.device))
    print(f"{title}  (ratios to torch in parentheses)")
    print(sweep_table(measurements, providers))
    deviation, compared = estimate_deviation(measurements)
    print(f"est act: the activation peak predicted on meta tensors (actsave.estimate), its deviation from the "
          f"measured one in parentheses; largest {deviation:.2%} over {compared} runs")
    if real_scale is None:
        print(f"\nmax depth whose training step peaks within {_format_mib(args.budget)}:")
        print(max_depth_table(max_depths))
    else:
        print("\n" + real_scale.report(scaled, max_depths))

    run_config = {"seed": SEED, "repeats": args.repeats, "budget_MiB": args.budget / MiB,
                  "threads": torch.get_num_threads()}
    rows = csv_rows(workload, measurements + scaled + max_depths, run_metadata(args.device), run_config)
    write_csv(rows, args.out)
    png = _png(workload, args.out)
    plot_note = plot(measurements + scaled, providers, title, png, max_depths, budget_mib=args.budget / MiB,
                     device_type=args.device.type, depth_name=workload.depth_name)
    for note in notes + ([plot_note] if plot_note else []):
        print(f"note: {note}")
    print(wrote(args.out, *([] if plot_note else [png])))


def _title(workload: Workload, device: str) -> str:
    return f"{workload.bench}: {workload.case} on {device}"


def _png(workload: Workload, csv: Path) -> Path:
    return csv.with_name(f"{csv.stem}-{workload.bench}.png")


def replot(workload: Workload, args: argparse.Namespace, real_scale=None) -> None:
    """The PNG of a sweep drawn again from its rows in ``args.out`` (the sweep's shapes,
    as ``args`` gives them, pick its rows), without measuring."""
    cases = {workload.case} | ({real_scale.case} if real_scale is not None else set())
    found, device = read_measurements(args.out, workload.bench, cases) if args.out.exists() else ([], None)
    if not found:
        raise SystemExit(f"--replot: no rows of {workload.bench} ({' or '.join(sorted(cases))}) in {args.out}")
    present = {m.provider for m in found}
    providers = [name for name in PROVIDERS if name in present]
    budget = next((m.config["budget_MiB"] for m in found if "budget_MiB" in m.config), args.budget / MiB)
    max_depths = [m for m in found if m.metric == "max_depth"]
    png = _png(workload, args.out)
    note = plot([m for m in found if m.metric != "max_depth"], providers, _title(workload, device), png, max_depths,
                budget_mib=budget, device_type=args.device.type, depth_name=workload.depth_name)
    print(f"note: {note}" if note else wrote(png))
