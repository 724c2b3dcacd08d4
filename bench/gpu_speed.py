"""The GPU speed stage (``python bench/gpu_check.py --only speed``): actsave's step
time, host time and memory against plain torch and torch's checkpointing, measured in
one process, every baseline in the same run, providers interleaved, in a few minutes
of GPU time. CUDA only; ``--smoke`` runs the same code on CPU at tiny sizes (tests).

Phases, each with a progress line and its elapsed time, results written after each
(so a run cut short keeps what it measured):

- ``resnet``: ResNet-164 b512 32x32 fp32, every provider of harness.PROVIDERS but
  actsave_auto (plain, torch_ckpt = checkpoint_sequential, actsave default, int8, fp8,
  offload, int8+offload); then host profiles of a few providers (cProfile's
  functions, torch.profiler's operators by CPU and device time) in
  ``<gpu>-speed-profile-resnet164.txt``.
- ``gpt``: 16 GPT blocks (bench/models.TransformerBlock, pre-LN, causal SDPA) at width
  2048, 16 heads, sequence 2048, batch 4, vocabulary 8192, bf16: plain, torch's
  checkpoint per block, ``actsave.wrap(model, TransformerBlock)`` default, int8,
  offload, int8+offload. One set of parameters (3.2 GiB with gradients) serves every
  provider: each wraps the same blocks in a container of its own.
- ``graphs``: ResNet-164 b64 32x32 fp32, torch's checkpoint and every actsave mode,
  each step eager against the same step captured whole in a CUDA graph and replayed
  (bench/graphed_steps.py): times and whether the gradients are bit-equal. CUDA only.
- ``launch``: bench/launch_overhead.py: host time per launch of each codec and
  decision launcher, against its Python work alone and Triton's own launch path.
- ``host``: bench/host_overhead.py's cases (ResNet-164 and an 8-block GPT at tiny
  sizes) on the GPU, 10 rounds: steps that are all host work, and the counts (aten
  ops, Triton launches, syncs) on CUDA, where autograd runs backward on its own
  threads and Triton's launch hook and torch's sync debug mode can check the
  counters.
- ``kernels``: bench/kernels.py ``--sizes-mib 64,256 --repeats 10`` in a subprocess
  cut at ``--kernels-limit`` seconds: GB/s of each codec kernel.

Per provider of ``resnet`` and ``gpt``: gradients are allocated first (as from the
second step of training), then ``--warmup`` steps (the first one's peak recorded: the
default mode plans, cuDNN and cuBLAS set up, Triton compiles), then ``--rounds``
rounds of one step per provider in turn. Of each step: its wall time, the device
synchronized before and after; the host time until the step's call returned (the
device not awaited: close to the step time means the step is bound by the host); the
allocator peak above what was allocated when it began (``max_memory_allocated`` after
``reset_peak_memory_stats``), plus the input batch: the activation peak that
``actsave.estimate`` predicts, printed beside it (meta tensors, CUDA accounting), with
one more step under ``LiveBytes`` (the estimate's tracker on the real step: tensor
storages only), so that a gap splits into tensors that CUDA kernels save unlike the
meta ones (estimate vs live) and memory no operator returns, such as cuDNN and cuBLAS
workspaces (live vs allocator). Ratios are medians of per-round ratios.

Expected on an H100, from step counts (measured figures replace these once run): start
and imports 15 s; resnet 45 s (7 providers x 13 steps, a round of all 7 about 1.9 s
at the step times of bench/results/nvidia-h100-80gb-hbm3-step_profile-b512.txt, plus
planning, Triton compiles and 7 estimates); gpt 20 s (6 x 13 steps of 0.1-0.2 s,
about 4.4e13 FLOP a plain step); graphs 20 s (6 providers x 2 models, 4 steps
to capture, then 10 eager steps and 10 replays of a b64 step, about 25 ms eager); launch 15 s
(3 references and 14 launchers, the launchers twice: real and stubbed, x 5 rounds x 500
calls of 5-130 us); host 20 s (7 x 13 host-bound steps of ResNet-164 b2,
then the counted steps; the GPT's are shorter); kernels 40 s (18 kernel builds, then
60 timed launches per case), cut at 150 s. About 3 minutes, under the stage's 420 s.

    python bench/gpu_speed.py [--phases resnet,gpt,graphs,launch,host,kernels] [--rounds 10] [--smoke]
"""
from __future__ import annotations

import argparse
import cProfile
import gc
import io
import os
import pstats
import signal
import statistics
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # --smoke: the kernels run under the interpreter

from actsave.planning.live_bytes import LiveBytes  # noqa: E402
from actsave.text import format_table  # noqa: E402

import graphed_steps  # noqa: E402  (bench/ is on sys.path when this script runs)
import harness  # noqa: E402
import launch_overhead  # noqa: E402
import host_overhead  # noqa: E402
from host_overhead import TORCH_CKPT, DEFAULT, forward_loss, paired_ratio  # noqa: E402

BENCH = "gpu_speed"
MiB = 2**20
PHASES = ("resnet", "gpt", "graphs", "launch", "host", "kernels")
RESNET_PROVIDERS = ("torch", "torch_ckpt", "actsave_none", "actsave_int8", "actsave_fp8", "actsave_offload",
                    "actsave_int8_offload")
# Profiled after the ResNet's rounds, on CUDA: where the host time of a step goes.
RESNET_PROFILED = ("torch_ckpt", "actsave_none", "actsave_int8", "actsave_offload")
GPT_PROVIDERS = ("torch", "torch_ckpt", "actsave_none", "actsave_int8", "actsave_offload", "actsave_int8_offload")
# The ratios: (numerator, denominator) of paired step times.
RESNET_RATIOS = (("actsave_none", "torch_ckpt"), ("actsave_int8", "actsave_none"), ("actsave_offload", "actsave_none"),
                 ("actsave_int8_offload", "actsave_none"))
GPT_RATIOS = (("actsave_none", "torch_ckpt"), ("actsave_int8", "torch_ckpt"), ("actsave_offload", "torch_ckpt"),
              ("actsave_int8_offload", "torch_ckpt"))

SIZES = {  # profile -> the cases' sizes
    "cuda": {"resnet": {"depth": 164, "batch": 512, "image": 32},
             "gpt": {"blocks": 16, "width": 2048, "heads": 16, "vocab": 8192, "seq_len": 2048, "batch": 4},
             "graphs": {"depth": 164, "batch": 64, "image": 32}, "launch_calls": 500,
             "host": "resnet164,gpt8", "host_rounds": 10, "kernels": ["--sizes-mib", "64,256", "--repeats", "10"]},
    "smoke": {"resnet": {"depth": 11, "batch": 2, "image": 8},
              "gpt": {"blocks": 2, "width": 32, "heads": 2, "vocab": 64, "seq_len": 16, "batch": 2},
              "graphs": {"depth": 11, "batch": 2, "image": 8}, "launch_calls": 3,
              "host": "resnet11,gpt1", "host_rounds": 2, "kernels": ["--smoke"]},
}


class Clock:
    """Progress lines with the time since the run began."""

    def __init__(self):
        self.start = time.monotonic()

    def log(self, message: str) -> None:
        print(f"[speed +{time.monotonic() - self.start:6.1f} s] {message}", flush=True)


@dataclass
class ModeResult:
    """One provider's measurements; byte figures are activation peaks (module docstring)."""

    step_s: list = field(default_factory=list)
    enqueue_s: list = field(default_factory=list)
    act_peaks: list = field(default_factory=list)  # allocator, per timed step (CUDA)
    allocations: list = field(default_factory=list)  # allocator allocations per timed step (CUDA)
    first_act_peak: Optional[int] = None  # the first step's (CUDA)
    first_step_kept: Optional[int] = None  # bytes the first step left allocated (workspaces, caches)
    est_act: Optional[int] = None
    live_act: Optional[int] = None
    static: int = 0  # parameters, gradients, buffers, targets: resident, not in the activation peak
    error: Optional[str] = None  # out of memory: not measured from there on
    notes: list = field(default_factory=list)  # what failed to measure (an estimate, the LiveBytes step)


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class Memory:
    """The CUDA allocator's figures; on CPU (``--smoke``) every figure is None."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.device = device

    def synchronize(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def begin(self) -> tuple:
        if not self.cuda:
            return None, None
        self.synchronize()
        torch.cuda.reset_peak_memory_stats(self.device)
        return torch.cuda.memory_allocated(self.device), self._allocations()

    def end(self, began: tuple) -> tuple:
        """(peak above the start, allocations made, bytes still allocated above the start)."""
        resident, allocations = began
        if resident is None:
            return None, None, None
        self.synchronize()
        return (torch.cuda.max_memory_allocated(self.device) - resident, self._allocations() - allocations,
                torch.cuda.memory_allocated(self.device) - resident)

    def _allocations(self) -> int:
        return torch.cuda.memory_stats(self.device).get("allocation.all.allocated", 0)


def _release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def build_shared(case: host_overhead.Case, names, device: torch.device) -> tuple:
    """``(models, batch, plain)``: every provider over the same modules (one set of
    parameters), built on ``device``, gradients allocated."""
    batch = case.make_batch(device)
    torch.manual_seed(harness.SEED)
    with torch.device(device):
        plain = case.build()
    for p in plain.parameters():
        p.grad = torch.zeros_like(p)
    models = {name: case.providers[name](torch.nn.Sequential(*plain), batch) for name in names}
    return models, batch, plain




def live_act_peak(model: torch.nn.Module, plain: torch.nn.Module, batch: tuple, device: torch.device) -> int:
    """The activation peak of one real step as LiveBytes counts it (tensor storages
    that operators return), the batch included, as actsave.estimate counts."""
    known = (list(plain.parameters()), [p.grad for p in plain.parameters()], list(plain.buffers()), list(batch))
    tracker = LiveBytes(device, known=known)
    with tracker:
        forward_loss(model, batch).backward()
    Memory(device).synchronize()
    return tracker.peak + _nbytes(batch[:1])


def _step(model, batch) -> float:
    """One step; returns the host time until its call returned."""
    start = time.perf_counter()
    forward_loss(model, batch).backward()
    return time.perf_counter() - start


def measure_case(case: host_overhead.Case, names, warmup: int, rounds: int, device: torch.device,
                 clock: Clock, profiled: tuple = (), profile_path: Optional[Path] = None, lean: bool = False) -> dict:
    """``{name: ModeResult}`` (module docstring). A provider that runs out of memory
    is reported so and left out of the rounds after. The providers in ``profiled``
    are profiled after the rounds, into ``profile_path`` (:func:`profile_steps`).
    ``lean``: the timed rounds and the allocator's peaks only (no estimate, no
    LiveBytes step, no profile: a lease of minutes; estimates run on meta tensors
    anywhere)."""
    models, batch, plain = build_shared(case, names, device)
    memory = Memory(device)
    results = {name: ModeResult() for name in names}
    inputs = _nbytes(batch[:1])  # counted in every activation peak, as actsave.estimate counts it
    static = _nbytes([*plain.parameters(), *plain.parameters(), *plain.buffers(), *batch[1:]])
    clock.log(f"{case.name}: built {len(names)} providers over one model "
              f"({_nbytes(plain.parameters()) / MiB:.0f} MiB of parameters); estimates on meta tensors")
    alive = dict(models)

    def guarded(name, function, what=None):
        """``function()``; out of memory leaves the provider out from here on; with
        ``what``, any other failure is a note (that figure is missing) and None."""
        try:
            return function()
        except torch.cuda.OutOfMemoryError as error:
            results[name].error = f"out of memory: {str(error).splitlines()[0][:80]}"
            alive.pop(name, None)
            clock.log(f"{case.name}: {name} ran out of memory; left out from here")
            _release(device)
        except Exception as error:
            if what is None:
                raise
            results[name].notes.append(f"{what} failed: {type(error).__name__}: {error}")
        return None

    for name, model in models.items():
        results[name].static = static
        if not lean:
            results[name].est_act = guarded(name, lambda model=model: harness.estimated_act_peak(model, batch, "cuda"),
                                            "actsave.estimate")

    def measured_step(model):
        began = memory.begin()
        start = time.perf_counter()
        enqueued = _step(model, batch)
        memory.synchronize()
        return time.perf_counter() - start, enqueued, memory.end(began)

    clock.log(f"{case.name}: first steps ({warmup} warm-up steps per provider)")
    for name, model in models.items():
        done = guarded(name, lambda model=model: measured_step(model))
        if done is not None and done[2][0] is not None:
            peak, _, kept = done[2]
            results[name].first_act_peak, results[name].first_step_kept = peak + inputs, kept
    for _ in range(warmup - 1):
        for name, model in list(alive.items()):
            guarded(name, lambda model=model: _step(model, batch))
    clock.log(f"{case.name}: {rounds} rounds of {len(alive)} providers")
    for _ in range(rounds):
        for name, model in list(alive.items()):
            model.zero_grad(set_to_none=False)
            done = guarded(name, lambda model=model: measured_step(model))
            if done is None:
                continue
            total, enqueued, (peak, allocations, _) = done
            result = results[name]
            result.step_s.append(total)
            result.enqueue_s.append(enqueued)
            if peak is not None:
                result.act_peaks.append(peak + inputs)
                result.allocations.append(allocations)
    if profiled and profile_path is not None and not lean:
        clock.log(f"{case.name}: profiling {', '.join(profiled)}")
        profile_steps({name: alive[name] for name in profiled if name in alive}, batch, profile_path, device)
    clock.log(f"{case.name}: one step each under LiveBytes" if not lean else f"{case.name}: done")
    for name, model in list(alive.items()) if not lean else []:
        model.zero_grad(set_to_none=False)
        results[name].live_act = guarded(name, lambda model=model: live_act_peak(model, plain, batch, device),
                                         "the LiveBytes step")
    del models, alive, plain, batch
    _release(device)
    return results


def profile_steps(models: dict, batch: tuple, path: Path, device: torch.device) -> None:
    """Where each provider's step spends host time: Python functions by their own time
    (cProfile, two steps) and operators by self CPU and self device time
    (torch.profiler, one step), written to ``path``; a failure is written there too."""
    sections = []
    for name, model in models.items():
        try:
            profiler = cProfile.Profile()
            profiler.enable()
            for _ in range(2):
                _step(model, batch)
            Memory(device).synchronize()
            profiler.disable()
            text = io.StringIO()
            pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(30)
            activities = [torch.profiler.ProfilerActivity.CPU]
            if device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            with torch.profiler.profile(activities=activities) as prof:
                _step(model, batch)
                Memory(device).synchronize()
            averages = prof.key_averages()
            sections.append(f"## {name}: cProfile of two steps (by own time)\n{text.getvalue()}\n"
                            f"## {name}: operators of one step by self CPU time\n"
                            f"{averages.table(sort_by='self_cpu_time_total', row_limit=25)}\n"
                            f"## {name}: operators of one step by self device time\n"
                            f"{averages.table(sort_by='self_device_time_total', row_limit=25)}")
        except Exception:
            sections.append(f"## {name}: profiling failed\n{traceback.format_exc()}")
        path.parent.mkdir(parents=True, exist_ok=True)  # before the CSV writer makes it
        path.write_text("\n\n".join(sections) + "\n")


def _mib(nbytes) -> str:
    return "-" if nbytes is None else f"{nbytes / MiB:.1f}"


def _ms(seconds: list) -> str:
    return f"{statistics.median(seconds) * 1e3:.1f}" if seconds else "-"


def speed_table(results: dict) -> str:
    rows = [("provider", "step ms", "enqueue ms", "enqueue/step", "x torch_ckpt", "x default", "peak MiB",
             "act MiB", "1st step act", "est act", "act - est", "live act", "1st step kept", "allocs/step")]
    times = {name: r.step_s for name, r in results.items() if r.step_s}
    for name, r in results.items():
        if r.error or not r.step_s:
            rows.append((name, r.error or "not measured") + ("",) * (len(rows[0]) - 2))
            continue
        act = max(r.act_peaks) if r.act_peaks else None

        def ratio(reference):
            return f"{paired_ratio(times, name, reference):.3f}" if reference in times else "-"

        rows.append((
            name, _ms(r.step_s), _ms(r.enqueue_s),
            f"{statistics.median(r.enqueue_s) / statistics.median(r.step_s):.2f}", ratio(TORCH_CKPT), ratio(DEFAULT),
            _mib(None if act is None else act + r.static), _mib(act), _mib(r.first_act_peak), _mib(r.est_act),
            _mib(None if act is None or r.est_act is None else act - r.est_act), _mib(r.live_act),
            _mib(r.first_step_kept), f"{statistics.median(r.allocations):.0f}" if r.allocations else "-"))
    return format_table(rows)


def ratio_lines(results: dict, pairs) -> list:
    """The issue's step-time ratios (host enqueue / step is the table's column)."""
    times = {name: r.step_s for name, r in results.items() if r.step_s}
    return [f"{a} / {b}: {paired_ratio(times, a, b):.3f}" for a, b in pairs if a in times and b in times]


def csv_rows(case: host_overhead.Case, results: dict, descriptions: dict, metadata: dict, run_config: dict) -> list:
    rows = []
    times = {name: r.step_s for name, r in results.items() if r.step_s}
    for name, r in results.items():
        if not r.step_s:
            continue
        values = {"time": [s * 1e3 for s in r.step_s], "host_enqueue": [s * 1e3 for s in r.enqueue_s]}
        for metric, reference in (("time_vs_torch_ckpt", TORCH_CKPT), ("time_vs_default", DEFAULT)):
            if reference in times:
                values[metric] = [a / b for a, b in zip(r.step_s, times[reference])]
        if r.act_peaks:
            values["peak_act_mem"] = [b / MiB for b in r.act_peaks]
            values["allocations"] = r.allocations
        for metric, nbytes in (("peak_mem_first_step", r.first_act_peak), ("est_peak_act_mem", r.est_act),
                               ("live_peak_act_mem", r.live_act)):
            if nbytes is not None:
                values[metric] = [nbytes / MiB]
        config = {**case.config, **run_config, "provider": descriptions[name]}
        rows += [harness.csv_row(BENCH, case.description, name, metric, case.x_name, case.x_value, v, config,
                                 metadata) for metric, v in values.items()]
    return rows


def run_kernels(arguments: list, csv: Path, limit_s: float) -> tuple:
    """bench/kernels.py in a subprocess of its own session, killed at ``limit_s``:
    (its output, a failure or None)."""
    command = [sys.executable, str(Path(__file__).with_name("kernels.py")), *arguments, "--out", str(csv)]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               start_new_session=True)
    try:
        output, _ = process.communicate(timeout=limit_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        return output, f"over its {limit_s:g} s limit"
    return output, None if process.returncode == 0 else f"exit status {process.returncode}"


class Report:
    """The text results file, rewritten after each phase."""

    def __init__(self, path: Path, header: list):
        self.path, self.sections = path, ["\n".join(header)]

    def add(self, title: str, body: str) -> None:
        print(f"\n{title}\n{body}", flush=True)
        self.sections.append(f"{title}\n{body}")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text("\n\n".join(self.sections) + "\n")


def parse_arguments(argv) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--phases", type=lambda text: text.split(","), default=list(PHASES),
                        help=f"comma-separated, in their order (default all of {','.join(PHASES)})")
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds per provider (default 10; --smoke 2)")
    parser.add_argument("--warmup", type=int, default=None, help="warm-up steps per provider (default 2; --smoke 1)")
    parser.add_argument("--kernels-limit", type=float, default=150.0,
                        help="seconds bench/kernels.py may run (default 150)")
    harness.add_output_arguments(parser, "CSV, <device>.csv; the text results go next to it, <name>-speed.txt")
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny sizes: the same code paths, for the tests")
    parser.add_argument("--lean", action="store_true",
                        help="timed rounds and allocator peaks only: no actsave.estimate, LiveBytes step or profile "
                             "(for a lease of a few minutes; estimates run on meta tensors on any machine)")
    parser.add_argument("--providers", type=lambda text: tuple(text.split(",")), default=None,
                        help="comma-separated providers of both cases (default: every one of each)")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.phases) - set(PHASES))
    if unknown:
        parser.error(f"unknown phase(s) {unknown}; choose from {list(PHASES)}")
    args.rounds = args.rounds or (2 if args.smoke else 10)
    args.warmup = args.warmup or (1 if args.smoke else 2)
    return args


def _chosen(names: tuple, args: argparse.Namespace) -> tuple:
    """The case's providers that ``--providers`` keeps, in the case's order."""
    return names if args.providers is None else tuple(name for name in names if name in args.providers)


def run_phase(report: Report, failures: list, title: str, function) -> None:
    """``function()``; an exception fails this phase only, the traceback going to the
    report: one GPU run is all a lease may give, so the other phases still run."""
    try:
        function()
    except Exception:
        text = traceback.format_exc().rstrip()
        failures.append(f"{title}: {text.splitlines()[-1]}")
        report.add(f"{title}: FAILED", text)


def case_phase(case, names, providers, pairs, args, device, clock, report, csv, metadata, failures,
               profiled: tuple = ()) -> None:
    clock.log(f"{case.name}: {case.description}")
    profile_path = csv.with_name(f"{csv.stem}-speed-profile-{case.name}.txt")
    results = measure_case(case, names, args.warmup, args.rounds, device, clock, profiled, profile_path, args.lean)
    notes = [f"{name}: {note}" for name, r in results.items() for note in r.notes]
    report.add(f"{case.description}  (step: median wall ms; ratios: medians of per-round ratios)",
               "\n".join([speed_table(results), *ratio_lines(results, pairs), *notes]))
    descriptions = {name: providers[name].description for name in names}
    harness.write_csv(csv_rows(case, results, descriptions, metadata, {"warmup": args.warmup, "rounds": args.rounds}),
                      csv)
    failures += [f"{case.name} {name}: {r.error}" for name, r in results.items() if r.error]


def host_phase(name, rounds, args, device, clock, report, csv, metadata) -> None:
    result = host_overhead.measure_case(host_overhead.parse_case(name), list(host_overhead.PROVIDER_NAMES), rounds,
                                        args.warmup, device, log=clock.log)
    clock_name = "wall ms, synchronized" if device.type == "cuda" else "process CPU ms"
    report.add(f"host overhead, {result.case.description} on {device.type}  ({clock_name})",
               "\n".join([host_overhead.table(result), *host_overhead.notes(result, device)]))
    harness.write_csv(host_overhead.csv_rows(result, metadata, {"rounds": rounds, "warmup": args.warmup}), csv)
    _release(device)


def graphs_phase(sizes: dict, args, device, clock, report, failures) -> None:
    case = host_overhead.resnet_case(sizes["depth"], sizes["batch"], sizes["image"])
    results = graphed_steps.measure(case, _chosen(graphed_steps.PROVIDERS, args), args.rounds, device, clock.log)
    report.add(f"eager against CUDA-graphed steps, {case.description}  (wall ms, synchronized; ratio: median of "
               "per-round ratios)", graphed_steps.table(results) if results else "needs a CUDA device: not measured")
    failures += [f"graphs {name}: gradients differ from the eager step's" for name, r in results.items()
                 if r.same_gradients is False]
    failures += [f"graphs {name}: {r.error}" for name, r in results.items()  # README says every mode captures
                 if r.error and name.startswith("actsave")]
    _release(device)


def main(argv=None) -> int:
    args = parse_arguments(argv)
    if not args.smoke and not torch.cuda.is_available():
        print("gpu_speed: needs a CUDA GPU (--smoke runs the same code on CPU at tiny sizes)", file=sys.stderr)
        return 2
    device = torch.device("cpu" if args.smoke else "cuda")
    if device.type == "cpu":
        torch.set_num_threads(1)
    sizes = SIZES["smoke" if args.smoke else "cuda"]
    csv = harness.output_path(args, f"{harness.device_slug(device)}.csv")
    metadata = harness.run_metadata(device)
    report = Report(csv.with_name(f"{csv.stem}-speed.txt"), [
        f"# {metadata['device_name']}, torch {metadata['torch_version']}, Triton {metadata['triton_version'] or '-'}, "
        f"{metadata['timestamp_utc']}, at {metadata['git_sha']}",
        f"# python bench/gpu_speed.py {' '.join(argv or [])}".rstrip(),
        f"# {args.warmup} warm-up steps, {args.rounds} interleaved rounds per provider; cudnn.benchmark="
        f"{torch.backends.cudnn.benchmark}, cudnn.allow_tf32={torch.backends.cudnn.allow_tf32}, "
        f"matmul.allow_tf32={torch.backends.cuda.matmul.allow_tf32}",
        "# act: allocator peak above what was allocated when the step began, plus the input batch (what "
        "actsave.estimate's activation peak counts); peak: act plus parameters, gradients, buffers and targets; "
        "est: actsave.estimate of the same step, its loss included (meta tensors, cuda accounting); live: LiveBytes "
        "on a real step (tensor storages "
        "only); 1st step kept: what the first step left allocated (workspaces, caches)",
    ])
    clock = Clock()
    failures = []
    if "resnet" in args.phases:
        s = sizes["resnet"]
        case = host_overhead.resnet_case(s["depth"], s["batch"], s["image"])
        run_phase(report, failures, case.name, lambda: case_phase(
            case, _chosen(RESNET_PROVIDERS, args), harness.PROVIDERS, RESNET_RATIOS, args, device, clock, report, csv,
            metadata, failures, RESNET_PROFILED))
    if "gpt" in args.phases:
        s = sizes["gpt"]
        case = host_overhead.gpt_case(s["blocks"], s["width"], s["heads"], s["vocab"], s["seq_len"], s["batch"],
                                      dtype=torch.bfloat16)
        run_phase(report, failures, case.name, lambda: case_phase(
            case, _chosen(GPT_PROVIDERS, args), harness.BLOCK_PROVIDERS, GPT_RATIOS, args, device, clock, report, csv,
            metadata, failures))
    _release(device)
    if "graphs" in args.phases:
        run_phase(report, failures, "graphs", lambda: graphs_phase(sizes["graphs"], args, device, clock, report,
                                                                  failures))
    if "launch" in args.phases:
        clock.log(f"launch: bench/launch_overhead.py, {sizes['launch_calls']} calls a round")
        run_phase(report, failures, "launch", lambda: report.add(
            f"host time per launch (bench/launch_overhead.py, {sizes['launch_calls']} calls a round, best of 5; "
            "launch: the call less its Python work)",
            launch_overhead.table(launch_overhead.measure(device, sizes["launch_calls"]))))
    if "host" in args.phases:
        clock.log(f"host: bench/host_overhead.py --models {sizes['host']} --rounds {sizes['host_rounds']} on {device}")
        for name in sizes["host"].split(","):
            run_phase(report, failures, f"host {name}", lambda name=name: host_phase(
                name, sizes["host_rounds"], args, device, clock, report, csv, metadata))
    if "kernels" in args.phases:
        clock.log(f"kernels: bench/kernels.py {' '.join(sizes['kernels'])} (at most {args.kernels_limit:g} s)")
        output, failure = run_kernels(sizes["kernels"], csv, args.kernels_limit)
        report.add(f"codec kernels (bench/kernels.py {' '.join(sizes['kernels'])})"
                   + (f": {failure}" if failure else ""), output.rstrip())
        if failure and not failure.startswith("over"):  # cut at its limit: what it printed is still reported
            failures.append(f"kernels: {failure}")
    clock.log(harness.wrote(report.path, csv))
    for failure in failures:
        print(f"FAILED {failure}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    harness.imports_frozen()  # NOTE [ A script's imports, frozen ]
    sys.exit(main(sys.argv[1:]))
