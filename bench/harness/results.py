"""The results files: metrics and their units, percentiles, run metadata (device,
versions, commit), CSV rows and writing."""
from __future__ import annotations

import argparse
import csv
import json
import math
import os
import re
import subprocess
from datetime import datetime, timezone
from pathlib import Path

import torch

import actsave

from .providers import PROVIDERS
from .workload import Measurement, MiB, Workload

# Where results go. A run writes to LOCAL_RESULTS_DIR (git-ignored) unless --record
# says to update the committed results in RESULTS_DIR, so that `make bench` leaves
# the clone as it found it; an explicit --out wins over both. Every bench script
# takes its default paths from output_path(): one rule, one place.
# ACTSAVE_BENCH_RESULTS moves both (the tests point it at a temporary folder).
RESULTS_DIR = Path(os.environ.get("ACTSAVE_BENCH_RESULTS") or Path(__file__).resolve().parents[1] / "results")
LOCAL_RESULTS_DIR = RESULTS_DIR / "local"
RECORD_HELP = ("update the committed results under bench/results/ (default: bench/results/local/, "
               "which git ignores)")
CSV_COLUMNS = (
    "bench", "case", "provider", "metric", "unit", "x_name", "x_value", "p20", "p50", "p80",
    "n_reps", "config_json", "device_name", "torch_version", "triton_version",
    "actsave_version", "git_sha", "timestamp_utc",
)
METRICS = {  # name -> unit
    "peak_mem": "MiB",
    "peak_act_mem": "MiB",
    "est_act_mem": "MiB",  # peak_act_mem predicted on meta tensors (actsave.estimate)
    "est_device_peak": "MiB",  # real scale, meta tensors: activation peak on the device
    "est_host_bytes": "MiB",  # real scale, meta tensors: peak of what is offloaded
    "kept_bytes": "MiB",
    "time": "ms",
    "time_ratio": "x",
    "grad_sqnr": "dB",
    "max_depth": "layers",
    # bench/fidelity.py
    "worst_tensor_sqnr": "dB",  # lowest over the meaningful parameter gradients
    "overall_sqnr": "dB",  # all parameter gradients concatenated
    "codec_var_ratio": "x",  # codec gradient noise / minibatch sampling noise
    "maxpool_argmax_changed": "%",  # recomputed max-pool windows whose argmax differs from the forward's
    "worst_tensor_sqnr_pools_as_is": "dB",  # as worst_tensor_sqnr, max pools recomputed deciding anew
    "overall_sqnr_pools_as_is": "dB",  # as overall_sqnr, likewise
    # Rows before actsave kept max-pool decisions: a bench oracle recomputing at them.
    "worst_tensor_sqnr_forward_indices": "dB",
    "overall_sqnr_forward_indices": "dB",
    # bench/host_overhead.py and bench/gpu_speed.py: per training step
    "time_vs_torch_ckpt": "x",  # median over rounds of the step time over torch_ckpt's, same round
    "time_vs_default": "x",  # likewise over actsave's default mode (actsave_none)
    "aten_ops": "ops",  # aten operators dispatched (forward, loss, backward and recompute)
    "aten_ops_backward": "ops",  # those of the backward, the recompute included
    "triton_launches": "launches",
    "syncs": "syncs",  # host-device synchronizations (harness/counts.py)
    "host_enqueue": "ms",  # host time to enqueue a step, the GPU not awaited
    "peak_mem_first_step": "MiB",  # allocator peak of a mode's first step (gradients allocated in it)
    "est_peak_act_mem": "MiB",  # actsave.estimate's activation peak, meta tensors, cuda accounting
    "live_peak_act_mem": "MiB",  # the same peak of a real step, tensor storages only (LiveBytes)
    "allocations": "allocations",  # CUDA allocator allocations per step
    # bench/accuracy_parity.py: one value per seed
    "test_accuracy": "%",
    "accuracy_gap": "points",  # test accuracy minus torch's, same seed
}


def results_dir(record: bool) -> Path:
    """The committed results under ``record``, else the local, git-ignored ones."""
    return RESULTS_DIR if record else LOCAL_RESULTS_DIR


def add_output_arguments(parser: argparse.ArgumentParser, out_help: str) -> None:
    """``--out PATH`` (``out_help`` says what it names) and ``--record``, one or the
    other: :func:`output_path` gives the path either way."""
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--out", type=Path, default=None,
                       help=f"{out_help} (default: in bench/results/local/, or bench/results/ under --record)")
    group.add_argument("--record", action="store_true", help=RECORD_HELP)


def output_path(args: argparse.Namespace, name: str) -> Path:
    """``args.out`` where given, else ``name`` in :func:`results_dir` of ``args.record``."""
    return args.out if args.out is not None else results_dir(args.record) / name


def wrote(*paths: Path) -> str:
    """"wrote A and B", and where they are local results, how to record them."""
    text = "wrote " + " and ".join(str(path) for path in paths)
    if any(LOCAL_RESULTS_DIR.resolve() in Path(path).resolve().parents for path in paths):
        text += f" (local results, ignored by git; --record updates the committed ones in {RESULTS_DIR})"
    return text


def _median(values) -> float:
    return _percentile(values, 50)


def _percentile(values, q: float) -> float:
    """Linear interpolation between the closest ranks, except between equal values,
    so that a constant ``inf`` (an exact gradient) stays ``inf`` instead of ``nan``."""
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    below, above = ordered[math.floor(position)], ordered[math.ceil(position)]
    return below if below == above else below + (above - below) * (position - math.floor(position))


def _format_mib(nbytes: float) -> str:
    return f"{nbytes / MiB:g} MiB"


def run_metadata(device: torch.device) -> dict:
    """The columns every CSV row shares: device, versions, commit, time."""
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = ""
    return {
        "device_name": device_name(device),
        "torch_version": torch.__version__,
        "triton_version": triton_version,
        "actsave_version": actsave.__version__,
        "git_sha": git_sha(),
        "timestamp_utc": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    cpuinfo = Path("/proc/cpuinfo")
    models = re.findall(r"^model name\s*:\s*(.+)$", cpuinfo.read_text(), re.M) if cpuinfo.exists() else []
    return models[0].strip() if models else "cpu"


def device_slug(device: torch.device) -> str:
    """``cpu``, or the CUDA device name in lower case with dashes: the results file name."""
    if device.type != "cuda":
        return "cpu"
    return re.sub(r"[^a-z0-9]+", "-", device_name(device).lower()).strip("-")


def git_sha() -> str:
    """The commit of this checkout, ``+dirty`` when tracked files changed; ``unknown``
    outside git or before the first commit. ``ACTSAVE_GIT_SHA`` in the environment
    overrides it: a copy of the tree whose ``.git`` is stale (the lent GPU machines'
    copy kept the session's first commit) is told its commit by the command."""
    if os.environ.get("ACTSAVE_GIT_SHA"):
        return os.environ["ACTSAVE_GIT_SHA"]
    repo = Path(__file__).resolve().parents[2]

    def git(*args):
        return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True)

    head = git("rev-parse", "HEAD")
    if head.returncode != 0:
        return "unknown"
    dirty = git("status", "--porcelain", "--untracked-files=no").stdout.strip()
    return head.stdout.strip() + ("+dirty" if dirty else "")


def csv_rows(workload: Workload, measurements: list, metadata: dict, run_config: dict) -> list:
    rows = []
    for m in measurements:
        config = {**workload.config, **run_config, "provider": PROVIDERS[m.provider].description, **m.config}
        rows.append(csv_row(workload.bench, m.case or workload.case, m.provider, m.metric, m.x_name, m.x_value,
                            m.values, config, metadata))
    return rows


def csv_row(bench: str, case: str, provider: str, metric: str, x_name: str, x_value, values, config: dict,
            metadata: dict) -> dict:
    """One long-format row: percentiles of ``values`` (the repeats), the unit from ``METRICS``."""
    return {
        "bench": bench,
        "case": case,
        "provider": provider,
        "metric": metric,
        "unit": METRICS[metric],
        "x_name": x_name,
        "x_value": x_value,
        "p20": _percentile(values, 20),
        "p50": _percentile(values, 50),
        "p80": _percentile(values, 80),
        "n_reps": len(values),
        "config_json": json.dumps(config, sort_keys=True),
        **metadata,
    }


def read_measurements(path: Path, bench: str, cases: set) -> tuple:
    """The rows of ``bench`` and ``cases`` in the CSV at ``path``, back as measurements
    (their medians: enough to draw them again), and the device they were measured on
    (None without rows)."""
    with path.open(newline="") as f:
        rows = [row for row in csv.DictReader(f) if row["bench"] == bench and row["case"] in cases]

    def number(text: str):
        value = float(text)
        return int(value) if value.is_integer() else value

    measurements = [Measurement(row["provider"], row["metric"], row["x_name"], number(row["x_value"]),
                                (number(row["p50"]),), json.loads(row["config_json"]), row["case"]) for row in rows]
    return measurements, rows[0]["device_name"] if rows else None


def write_csv(rows: list, path: Path) -> None:
    """Write ``rows`` to ``path``, keeping the rows of other (bench, case) pairs that
    are already there: one results file per device gathers every benchmark. A file
    with other columns (an older schema) is replaced."""
    replaced = {(row["bench"], row["case"]) for row in rows}
    kept = []
    if path.exists():
        with path.open(newline="") as f:
            reader = csv.DictReader(f)
            if tuple(reader.fieldnames or ()) == CSV_COLUMNS:
                kept = [row for row in reader if (row["bench"], row["case"]) not in replaced]
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_COLUMNS)
        writer.writeheader()
        writer.writerows(kept + rows)
