"""Shared machinery of the depth sweeps: providers, measurement, max-depth search
and output (table, CSV, PNG).

A sweep script describes its workload (:class:`Workload`) and its defaults per
device (:func:`parse_arguments`); :func:`run_benchmark` does the rest:

1. For each depth, one seeded model and one batch. Every provider trains a deep copy
   of the same model on the same batch, so gradients compare exactly.
2. Per provider: one warm-up step (it allocates the gradients, so they are resident
   like in training, and lets segments="balanced" plan). Then ``repeats`` rounds in
   which every provider times one step in turn (ABAB...: a slow phase of a shared
   machine falls on all of them alike), then per provider one step under the
   memory tracker, and the same step predicted on meta tensors
   (:func:`actsave.estimate`), to validate the meta estimates at real scale. A step
   is forward, cross-entropy loss and backward. The optimizer step is left out: it
   touches no activation and costs every provider the same.
3. ``max_depth`` per provider: the deepest model whose step peaks within
   ``--budget``, found by real measurements (a search over blocks that starts from
   the swept depths, see :func:`deepest_fitting`), within ``--search-seconds``;
   past that the result is labelled a lower bound. A workload with a real-scale
   stage (bench/real_scale.py) searches on meta tensors at real scale instead.
4. A table on stdout, long-format rows in a CSV, a PNG next to it.

Metrics (see ``METRICS``): ``peak_mem`` is the peak of everything live during the
step. ``peak_act_mem`` subtracts what was resident when the step began: parameters,
buffers, gradients and the batch (there is no optimizer state). ``est_act_mem`` is
the same quantity predicted on meta tensors. ``kept_bytes`` is what actsave holds
for backward at the end of forward (actsave providers only:
:func:`actsave.stored_bytes`, device and host). ``time`` is timed without the memory
tracker; ``time_ratio`` and ``grad_sqnr`` are against the ``torch`` provider of the
same run, which is therefore always measured.

Memory on CUDA is ``max_memory_allocated``; on CPU it is PyTorch's ``MemTracker``
(DESIGN.md section 6), which counts live tensor storages exactly. CPU times are
indicative only.
"""
from __future__ import annotations

import argparse
import copy
import csv
import gc
import json
import math
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed._tools.mem_tracker import MemTracker
from torch.utils.checkpoint import checkpoint_sequential

import actsave
from actsave.estimate import allocation_bytes
from actsave.meta import plans_at_first_call

MiB = 2**20
SEED = 0
RESULTS_DIR = Path(__file__).resolve().parents[1] / "results"
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
}


# --------------------------------------------------------------------------- providers


class TorchCheckpointSequential(nn.Module):
    """``torch.utils.checkpoint.checkpoint_sequential`` over ``chain`` with
    ``round(sqrt(n))`` segments (the split of actsave's ``segments="sqrt"``)."""

    def __init__(self, chain: nn.Sequential):
        super().__init__()
        self.chain = chain
        self.segments = max(1, round(math.sqrt(len(chain))))

    def forward(self, x):
        return checkpoint_sequential(self.chain, self.segments, x, use_reentrant=False)


@dataclass(frozen=True)
class Provider:
    """How to turn a plain ``nn.Sequential`` into the model a provider trains, given a
    training batch and the memory budget (for the planned provider). ``timed_plan``:
    it plans from a timed step, so it cannot be built on meta tensors."""

    build: Callable[[nn.Sequential, tuple, int], nn.Module]
    description: str
    uses_actsave: bool = False
    timed_plan: bool = False


def _actsave(**options) -> Provider:
    settings = ", ".join(f"{k}={v!r}" for k, v in options.items())
    return Provider(
        build=lambda chain, batch, budget: actsave.CheckpointedSequential.from_sequential(chain, **options),
        description=f"actsave.CheckpointedSequential({settings})",
        uses_actsave=True,
    )


def _actsave_planned(chain: nn.Sequential, batch: tuple, budget: int) -> nn.Module:
    # The fastest plan within the budget; where no plan fits it, the smallest peak
    # (so the sweep still shows the planner at depths past the budget). The sweep's
    # budget bounds the whole step; the planner's bounds activations, so the resident
    # parameters, their gradients and the buffers come off first.
    inputs = (batch[0],)
    resident = sum(2 * p.numel() * p.element_size() for p in chain.parameters())
    resident += sum(b.numel() * b.element_size() for b in chain.buffers())
    try:
        return actsave.CheckpointedSequential.from_sequential(
            chain, segments="auto", budget=budget - resident, example_inputs=inputs)
    except actsave.ConfigError:
        return actsave.CheckpointedSequential.from_sequential(chain, segments="memory", example_inputs=inputs)


PROVIDERS = {
    "torch": Provider(lambda chain, batch, budget: chain, "nn.Sequential"),
    "torch_ckpt": Provider(
        lambda chain, batch, budget: TorchCheckpointSequential(chain),
        "checkpoint_sequential(round(sqrt(n)) segments, use_reentrant=False)",
    ),
    "actsave_none": _actsave(),
    "actsave_int8": _actsave(compress="int8"),
    "actsave_fp8": _actsave(compress="fp8"),
    "actsave_offload": _actsave(offload=True),
    "actsave_int8_offload": _actsave(compress="int8", offload=True),
    "actsave_auto": Provider(
        _actsave_planned, "actsave.CheckpointedSequential(segments='auto', budget=--budget)", uses_actsave=True,
        timed_plan=True,
    ),
}
REFERENCE = "torch"


def available_providers(names: list) -> tuple:
    """``(available, notes)``: the names among ``names`` whose provider this version
    of actsave can build, and one note for each it cannot (its ConfigError): modes
    still being built light up here by themselves when they land."""
    probe, batch = nn.Sequential(nn.Linear(2, 2), nn.ReLU()), (torch.randn(2, 2), None)
    available, notes = [], []
    for name in names:
        try:
            PROVIDERS[name].build(probe, batch, 2**30)
        except actsave.ConfigError as error:
            notes.append(f"{name} skipped: {error}")
            continue
        available.append(name)
    return available, notes


# --------------------------------------------------------------------------- one step


def training_step(model: nn.Module, batch: tuple) -> int:
    """Forward, cross-entropy loss, backward. Returns the bytes actsave keeps for
    backward at the end of the forward."""
    inputs, targets = batch
    before = _actsave_stored_bytes()
    logits = model(inputs)
    kept = _actsave_stored_bytes() - before
    F.cross_entropy(logits.flatten(0, -2), targets.flatten()).backward()
    return kept


def _actsave_stored_bytes() -> int:
    stored = actsave.stored_bytes()
    return stored["device"] + stored["host"]


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_steps(model: nn.Module, batch: tuple, repeats: int, device: torch.device) -> list:
    """Milliseconds of ``repeats`` training steps, each timed alone."""
    times = []
    for _ in range(repeats):
        model.zero_grad(set_to_none=False)
        _synchronize(device)
        start = time.perf_counter()
        training_step(model, batch)
        _synchronize(device)
        times.append((time.perf_counter() - start) * 1e3)
    return times


class _GlobalPeakMemTracker(MemTracker):
    """``MemTracker`` without its per-module peaks.

    After every op MemTracker updates the peak of each module seen so far: O(modules)
    per op, quadratic in depth (one step of ResNet-164 took 33 s instead of 1 s on
    CPU). The global peak, all the benchmark reads, is kept exactly as MemTracker
    keeps it; tests/bench checks that both report the same peak.
    """

    def _update_peak_stats(self, peak_state) -> None:
        for device, snapshot in self._curr_mem_snap.items():
            if snapshot["Total"] > self._peak_mem.get(device, 0):
                self._peak_mem[device] = snapshot["Total"]
                self._peak_mem_snap[device] = dict(snapshot)


@dataclass(frozen=True)
class StepMemory:
    peak: int  # bytes live at the peak of the step
    resident: int  # bytes live when the step began: parameters, buffers, gradients, batch
    kept: int  # bytes actsave kept at the end of forward


def measure_step_memory(
    model: nn.Module, batch: tuple, device: torch.device, tracker_class: type = _GlobalPeakMemTracker
) -> StepMemory:
    """Peak memory of one training step of ``model`` (its gradients already allocated)."""
    if device.type == "cuda":
        _synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        resident = torch.cuda.memory_allocated(device)
        kept = training_step(model, batch)
        _synchronize(device)
        return StepMemory(torch.cuda.max_memory_allocated(device), resident, kept)
    tracker = tracker_class()
    tracker.track_external(model, *batch)
    resident = tracker.get_tracker_snapshot("current")[device]["Total"]
    with tracker:
        kept = training_step(model, batch)
    return StepMemory(tracker.get_tracker_snapshot("peak")[device]["Total"], resident, kept)


def _release_memory(device: torch.device) -> None:
    """Free what the last run left, so that the next one's CUDA peak starts clean.
    Not needed on CPU, where the tracker counts only the tensors of the step it
    watches (and a full collection costs 0.2 s)."""
    if device.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()


def worst_grad_sqnr(reference: list, grads: list) -> float:
    """Lowest SQNR in dB, ``20*log10(|ref| / |ref - x|)``, over parameter gradients;
    ``inf`` when every gradient is exact."""
    worst = math.inf
    for ref, x in zip(reference, grads):
        error = torch.linalg.vector_norm((ref - x).double()).item()
        if error > 0:
            signal = torch.linalg.vector_norm(ref.double()).item()
            worst = min(worst, 20 * math.log10(signal / error) if signal > 0 else -math.inf)
    return worst


# --------------------------------------------------------------------------- workloads


@dataclass(frozen=True)
class Workload:
    """What a sweep trains. Depth is counted as the model family counts it; the
    max-depth search steps over ``blocks`` (per stage for ResNets), the unit in which
    the family grows."""

    bench: str
    case: str  # the shapes, e.g. "cifar_resnet b8 16x16"
    build: Callable[[int], nn.Sequential]  # depth -> model
    make_batch: Callable[[torch.Generator], tuple]  # -> (inputs, targets) on the CPU
    depth_of_blocks: Callable[[int], int]
    blocks_of_depth: Callable[[int], int]
    config: dict


def _seeded_model(workload: Workload, depth: int) -> nn.Sequential:
    torch.manual_seed(SEED)
    return workload.build(depth)


def _batch(workload: Workload, device: torch.device) -> tuple:
    inputs, targets = workload.make_batch(torch.Generator().manual_seed(SEED))
    return inputs.to(device), targets.to(device)


# --------------------------------------------------------------------------- the sweep


@dataclass(frozen=True)
class Measurement:
    """One metric of one provider; ``values`` are the repeats (one for exact metrics).
    ``case``: the shapes, where not the workload's (a real-scale stage's)."""

    provider: str
    metric: str
    x_name: str
    x_value: float
    values: tuple
    config: dict = field(default_factory=dict)
    case: Optional[str] = None


@dataclass
class ProviderRun:
    times_ms: list
    memory: StepMemory
    grads: list  # on the CPU: the sweep holds the reference's while others run
    estimated_act: int  # peak activation bytes less the batch, predicted on meta tensors


def prepared(provider: Provider, base: nn.Sequential, batch: tuple, budget: int, device) -> nn.Module:
    """The provider's model after one training step, which allocates the gradients (so
    they count as resident) and lets a model that plans at its first call plan."""
    model = provider.build(copy.deepcopy(base).to(device), batch, budget)
    training_step(model, batch)
    return model


def interleaved_times(models: dict, batch: tuple, repeats: int, device) -> dict:
    """``{name: [ms, ...]}``: ``repeats`` rounds, each timing one step of every model
    in turn (ABAB...), so that the noise of a shared machine falls on all alike."""
    times = {name: [] for name in models}
    for _ in range(repeats):
        for name, model in models.items():
            times[name] += time_steps(model, batch, 1, device)
    return times


def measure_provider(model: nn.Module, batch: tuple, times: list, device) -> ProviderRun:
    """One step under the memory tracker, the same step estimated on meta tensors."""
    model.zero_grad(set_to_none=False)
    memory = measure_step_memory(model, batch, device)
    grads = [p.grad.detach().cpu() for p in model.parameters()]
    inputs = batch[0]
    estimate = actsave.estimate(model, [torch.empty_like(inputs, device="meta")], device=device)
    # The estimate counts the batch as activation memory; the sweep counts it resident.
    estimated = estimate.activation_peak_bytes - allocation_bytes(inputs.untyped_storage().nbytes(), device)
    return ProviderRun(times, memory, grads, estimated)


def provider_measurements(name: str, depth: int, run: ProviderRun, reference: Optional[ProviderRun]) -> list:
    def measured(metric, values):
        return Measurement(name, metric, "depth", depth, tuple(values))

    measurements = [
        measured("peak_mem", [run.memory.peak / MiB]),
        measured("peak_act_mem", [(run.memory.peak - run.memory.resident) / MiB]),
        measured("est_act_mem", [run.estimated_act / MiB]),
        measured("time", run.times_ms),
    ]
    if PROVIDERS[name].uses_actsave:
        measurements.append(measured("kept_bytes", [run.memory.kept / MiB]))
    if reference is not None:
        reference_ms = _median(reference.times_ms)
        measurements.append(measured("time_ratio", [t / reference_ms for t in run.times_ms]))
        measurements.append(measured("grad_sqnr", [worst_grad_sqnr(reference.grads, run.grads)]))
    return measurements


def sweep(workload: Workload, depths: list, providers: list, budget: int, repeats: int, device,
          notes: list) -> list:
    """Measurements of every provider at every depth (reference first at each depth)."""
    measurements = []
    progress = Progress(len(depths) * len(providers) * 2, workload.bench)
    for depth in depths:
        base, batch = _seeded_model(workload, depth), _batch(workload, device)
        models = {}
        for name in providers:
            progress.describe(f"depth {depth} {name}: warm-up")
            models[name] = _unless_out_of_memory(prepared, PROVIDERS[name], base, batch, budget, device)
            progress.advance()
            if models[name] is None:
                notes.append(f"{name} at depth {depth}: out of memory")
                del models[name]
        progress.describe(f"depth {depth}: timing, {repeats} rounds")
        times = interleaved_times(models, batch, repeats, device)
        reference = None
        for name in list(models):
            progress.describe(f"depth {depth} {name}: memory")
            run = measure_provider(models.pop(name), batch, times[name], device)
            _release_memory(device)
            progress.advance()
            reference = run if name == REFERENCE else reference
            measurements += provider_measurements(name, depth, run, reference)
    progress.close()
    return measurements


def _unless_out_of_memory(function, *args):
    """``function(*args)``, or None when the device runs out of memory."""
    try:
        return function(*args)
    except torch.cuda.OutOfMemoryError:
        return None


# --------------------------------------------------------------------------- max depth


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


# --------------------------------------------------------------------------- progress


class Progress:
    """A progress bar on stderr: tqdm when it is installed, else one rewritten line."""

    def __init__(self, total: int, title: str):
        self.total, self.title, self.done = total, title, 0
        try:
            from tqdm import tqdm
        except ImportError:
            self._bar = None
        else:
            self._bar = tqdm(total=total, desc=title, file=sys.stderr, leave=False)

    def describe(self, label: str) -> None:
        """Say what runs now."""
        if self._bar is not None:
            self._bar.set_postfix_str(label)
        else:
            print(f"\r{self.title} [{self.done}/{self.total}] {label}\033[K", end="", file=sys.stderr)

    def advance(self) -> None:
        """Count one more item done."""
        self.done += 1
        if self._bar is not None:
            self._bar.update(1)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        else:
            print(file=sys.stderr)


# --------------------------------------------------------------------------- output


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
    outside git or before the first commit."""
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
        rows.append({
            "bench": workload.bench,
            "case": m.case or workload.case,
            "provider": m.provider,
            "metric": m.metric,
            "unit": METRICS[m.metric],
            "x_name": m.x_name,
            "x_value": m.x_value,
            "p20": _percentile(m.values, 20),
            "p50": _percentile(m.values, 50),
            "p80": _percentile(m.values, 80),
            "n_reps": len(m.values),
            "config_json": json.dumps(config, sort_keys=True),
            **metadata,
        })
    return rows


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


def _medians(measurements: list) -> dict:
    return {(m.x_value, m.provider, m.metric): _median(m.values) for m in measurements}


def _cell(medians: dict, key: tuple, digits: int, ratio_to: Optional[tuple] = None) -> str:
    if key not in medians:
        return "-"
    text = f"{medians[key]:.{digits}f}"
    if ratio_to in medians and medians[ratio_to] > 0:
        text += f" ({medians[key] / medians[ratio_to]:.2f}x)"
    return text


def sweep_table(measurements: list, providers: list) -> str:
    """One line per depth and provider; ratios to torch at the same depth in parentheses,
    the meta estimate of the activation peak as its deviation from the measured one."""
    medians = _medians(measurements)
    lines = [("depth", "provider", "peak MiB", "act MiB", "est act MiB", "kept MiB", "time ms", "grad SQNR dB")]
    for depth in sorted({m.x_value for m in measurements}):
        lines += [_sweep_line(medians, depth, name) for name in providers if (depth, name, "peak_mem") in medians]
    return _fixed_width(lines, left_aligned={1})


def _sweep_line(medians: dict, depth: int, name: str) -> tuple:
    def cell(metric, digits, with_ratio=True):
        return _cell(medians, (depth, name, metric), digits, (depth, REFERENCE, metric) if with_ratio else None)

    measured, estimated = medians.get((depth, name, "peak_act_mem")), medians.get((depth, name, "est_act_mem"))
    deviation = "-" if not measured or estimated is None else f"{estimated:.2f} ({estimated / measured - 1:+.2%})"
    return (
        str(depth), name,
        cell("peak_mem", 2), cell("peak_act_mem", 2), deviation, cell("kept_bytes", 2, with_ratio=False),
        cell("time", 1), cell("grad_sqnr", 1, with_ratio=False),
    )


def estimate_deviation(measurements: list) -> tuple:
    """(largest |estimated / measured - 1| of the activation peaks, runs compared)."""
    medians = _medians(measurements)
    ratios = [medians[(x, p, "est_act_mem")] / v for (x, p, m), v in medians.items()
              if m == "peak_act_mem" and v > 0 and (x, p, "est_act_mem") in medians]
    return max((abs(r - 1) for r in ratios), default=math.nan), len(ratios)


def max_depth_table(results: list) -> str:
    reference = next((m.values[0] for m in results if m.provider == REFERENCE), 0)
    lines = [("provider", "max depth", "vs torch", "method")]
    for m in results:
        depth = m.values[0]
        bound = ">= " if m.config["method"].endswith("_lower_bound") else ""
        ratio = f"{depth / reference:.2f}x" if reference else "-"
        lines.append((m.provider, f"{bound}{depth}", ratio, _describe_search(m.config)))
    return _fixed_width(lines, left_aligned={0, 3})


def _describe_search(config: dict) -> str:
    method = config["method"]
    if config["does_not_fit"] is not None:
        method += f" (does not fit: {config['does_not_fit']})"
    elif config.get("depth_cap") is not None and method.endswith("_lower_bound"):
        method += f" (the search stops at depth {config['depth_cap']})"
    return method


def _fixed_width(lines: list, left_aligned: set) -> str:
    """Columns padded to their widest cell; numbers right-aligned, the columns in
    ``left_aligned`` (names) left-aligned."""
    widths = [max(len(line[c]) for line in lines) for c in range(len(lines[0]))]

    def padded(c: int, cell: str) -> str:
        return cell.ljust(widths[c]) if c in left_aligned else cell.rjust(widths[c])

    return "\n".join("  ".join(padded(c, cell) for c, cell in enumerate(line)).rstrip() for line in lines)


MATPLOTLIB_MISSING = "no PNG: matplotlib is not installed (pip install actsave[bench])"


def pyplot():
    """``matplotlib.pyplot`` drawing to files only, or None when it is not installed."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def save_figure(fig, path: Path) -> None:
    """Write ``fig`` to ``path``, making folders as needed, and free it."""
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    pyplot().close(fig)


PANELS = (  # metric, y label, y scale, title; a panel without rows is left out
    ("peak_act_mem", "peak activation memory (MiB)", "log", "memory, measured"),
    ("time_ratio", "step time / torch", "linear", "time ratio, measured"),
    ("est_device_peak", "device peak, meta estimate (MiB)", "log", "device peak at real scale"),
)


def plot(measurements: list, providers: list, title: str, path: Path) -> Optional[str]:
    """Activation memory and time ratio vs depth, and where a real-scale stage ran,
    the estimated device peak vs depth (log axes), one line per provider. Returns a
    note when it cannot, else None."""
    plt = pyplot()
    if plt is None:
        return MATPLOTLIB_MISSING
    medians = _medians(measurements)
    panels = [panel for panel in PANELS if any(m == panel[0] for _, _, m in medians)]
    fig, axes_row = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.5), squeeze=False)
    for axes, (metric, label, scale, panel_title) in zip(axes_row[0], panels):
        for name in providers:
            points = sorted((x, v) for (x, p, m), v in medians.items() if p == name and m == metric)
            if points:
                axes.plot(*zip(*points), marker="o", label=name)
        axes.set(xlabel="depth", ylabel=label, yscale=scale, title=panel_title)
        if metric == "est_device_peak":
            axes.set_xscale("log")
        axes.grid(True, which="both", alpha=0.3)
        axes.legend(fontsize="small")
    fig.suptitle(title)
    save_figure(fig, path)
    return None


# --------------------------------------------------------------------------- command line


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
    parser.add_argument("--out", type=Path, default=None,
                        help="CSV path (default: bench/results/<device>.csv); the PNG is written next to it")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes and budget, for the tests")

    args = parser.parse_args(argv)
    if args.device is None:
        args.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    profile = "smoke" if args.smoke else args.device.type
    for name, (parse, _) in sized.items():
        if getattr(args, name) is None:
            setattr(args, name, parse(defaults[profile][name]))
    if args.out is None:
        args.out = RESULTS_DIR / f"{device_slug(args.device)}.csv"
    if args.threads:
        torch.set_num_threads(args.threads)
    return args


def run_benchmark(workload: Workload, args: argparse.Namespace, real_scale=None) -> None:
    """Sweep, search, print the tables, write the CSV and the PNG. ``real_scale``
    (bench/real_scale.py), where given, adds its meta-tensor sweep and replaces the
    measured max-depth search by its own."""
    for depth in args.depths:
        workload.blocks_of_depth(depth)  # a depth the family cannot build fails now, not mid-run
    providers, notes = available_providers(args.providers)
    measurements = sweep(workload, args.depths, providers, args.budget, args.repeats, args.device, notes)
    if real_scale is None:
        search = measured_search(workload, args.budget, measurements, args.device)
        scaled, max_depths = [], search_max_depths(search, providers, args.search_seconds)
    else:
        scaled, max_depths = real_scale.run(providers, args.search_seconds, notes)

    title = f"{workload.bench}: {workload.case} on {device_name(args.device)}"
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
    png = args.out.with_name(f"{args.out.stem}-{workload.bench}.png")
    plot_note = plot(measurements + scaled, providers, title, png)
    for note in notes + ([plot_note] if plot_note else []):
        print(f"note: {note}")
    print(f"wrote {args.out}" + ("" if plot_note else f" and {png}"))
