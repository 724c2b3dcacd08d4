"""`make gpu-check`: everything that needs a CUDA GPU, in one command of at most 25
minutes, install included.

Stages, each a subprocess with its own time limit (seconds), in this order:

  install            240  a virtual environment of its own, .venv-gpu (the CPU one,
                          .venv, is left alone), that also sees the packages of the
                          Python that runs this script: a CUDA torch already installed
                          there is used as it is, with no download and no network;
                          otherwise $TORCH (default `torch`, PyPI's CUDA build) is
                          installed. Then actsave, editable, with its test and bench
                          extras (what the machine has already is not downloaded).
  cuda_tests         240  pytest -m cuda: the tests only a GPU runs.
  kernels             90  bench/kernels.py --quick: GB/s of every codec kernel on the
                          layouts training stores (centered conv activations, ReLU
                          outputs on the unsigned grid, flat), fp32 and bf16, 64 and 256
                          MiB, and its share of a device-to-device copy measured in the
                          same run; the ReLU and ReLU6 decision kernels' too.
  offload_overlap     60  bench/offload_overlap.py: how much of the host copying hides
                          behind compute (ResNet-164, batch 64).
  step_profile       120  bench/gpu_step_profile.py at batch 512: step time, host time
                          and allocator peak of each provider (is the step GPU-bound?).
  resnet_sweep       330  bench/resnet_depth_sweep.py at batch 64, depths 110 to 542,
                          5 timed rounds, real scale at depths 164 and 1001, max-depth
                          search cut to 30 s.
  transformer_sweep  330  bench/transformer_depth_sweep.py at its CUDA defaults, search
                          cut to 120 s.
                    ----
                    1410  = 23.5 minutes at most.

and two that run only when named, each as one command of its own within a 10-minute
lease:

  speed              420  bench/gpu_speed.py: step time, host enqueue time, allocator peak
                          and actsave.estimate's peak of plain torch, torch's checkpoint
                          and every actsave mode on ResNet-164 b512 and a 16-block GPT
                          (width 2048, sequence 2048, batch 4, bf16), interleaved; the
                          issue's ratios; bench/host_overhead.py on the GPU; the codec
                          kernels' GB/s. About 5 minutes (estimated from step counts).
  frontier           440  bench/frontier.py --device cuda: step time against measured
                          activation peak of plain torch, torch's checkpointing and
                          actsave's plans at 8 budgets per lever set
                          (frontier.DEFAULT_LEVER_SETS), ResNet-164 b512 and the 16-block
                          GPT above, interleaved; actsave within each torch point's peak.
                          Its CPU run's time: docs/results.md, "The time-memory frontier".
                          It writes after each case, so a run cut at its limit keeps the
                          ResNet's.

    python bench/gpu_check.py --only speed
    python bench/gpu_check.py --only frontier

A stage other than install that finds no .venv-gpu runs install first (about 20 s on
a machine with its CUDA torch installed), so any stage runs on a fresh machine.

Measured on an H100 (2026-11-24, at f665372 and after): install 20 s, cuda_tests 44 to
67 s, offload_overlap 32 s; the resnet sweep at its CUDA defaults (depths to 1001, 10
rounds) ran past 510 s, so the stage runs the smaller sweep above (about 200 s); the
transformer sweep did not finish in 200 s with a 45 s search and has not completed on
a GPU yet. A device lease of 10 minutes a command runs the stages in several calls.

Each stage prints a line when it ends (name, elapsed time, ok or FAILED); a failed
stage does not stop the next, and the run ends with all stages listed, exit status 1
if any failed. The benchmarks write bench/results/local/<gpu>.csv (ignored by git) and
their PNGs next to it (<gpu> is the device name in lower case, e.g.
nvidia-h100-80gb-hbm3); with --record, the committed bench/results/<gpu>.csv instead.

Without an NVIDIA GPU (no working `nvidia-smi -L`), it says so and exits with status 2
before installing anything.

    python bench/gpu_check.py [--only kernels,offload_overlap] [--record]
"""
from __future__ import annotations

import argparse
import os
import shutil
import signal
import site
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, TextIO

ROOT = Path(__file__).resolve().parent.parent
VENV = ROOT / ".venv-gpu"
NO_GPU_EXIT = 2


@dataclass(frozen=True)
class Stage:
    name: str
    command: tuple
    limit_s: float
    default: bool = True  # run when no --only names the stages


@dataclass(frozen=True)
class Outcome:
    name: str
    seconds: float
    failure: Optional[str]  # None when the stage passed

    @property
    def status(self) -> str:
        return "ok" if self.failure is None else f"FAILED ({self.failure})"


# The stages that write results: --record passes on to them (bench/harness/results.py).
RECORDING = ("kernels", "offload_overlap", "step_profile", "resnet_sweep", "transformer_sweep", "speed", "frontier")


def stages(python: str, record: bool = False) -> list:
    """The stages of a GPU check, their Python being ``python`` (the GPU venv's);
    ``record``: the benchmarks update the committed results."""
    every = _stages(python)
    if not record:
        return every
    return [Stage(s.name, (*s.command, "--record"), s.limit_s, s.default) if s.name in RECORDING else s
            for s in every]


def _stages(python: str) -> list:
    bench = ROOT / "bench"
    return [
        Stage("install", (sys.executable, __file__, "--install"), 240),
        Stage("cuda_tests", (python, "-m", "pytest", "-m", "cuda", "-p", "no:cacheprovider", str(ROOT / "tests")), 240),
        Stage("kernels", (python, str(bench / "kernels.py"), "--quick"), 90),
        Stage("offload_overlap", (python, str(bench / "offload_overlap.py")), 60),
        Stage("step_profile", (python, str(bench / "gpu_step_profile.py"), "--batch", "512",
                               "--providers", "torch_ckpt,actsave_none,actsave_int8,actsave_offload"), 120),
        Stage("resnet_sweep", (python, str(bench / "resnet_depth_sweep.py"), "--depths", "110,164,272,542",
                               "--repeats", "5", "--scale-depths", "164,1001", "--depth-cap", "1001",
                               "--search-seconds", "30"), 330),
        Stage("transformer_sweep", (python, str(bench / "transformer_depth_sweep.py"), "--search-seconds", "120"), 330),
        # Unbuffered: its progress lines reach the log as they happen.
        Stage("speed", (python, "-u", str(bench / "gpu_speed.py")), 420, default=False),
        # Named alone, one lease command of at most 8 minutes with the install (20 s).
        Stage("frontier", (python, "-u", str(bench / "frontier.py"), "--device", "cuda"), 440, default=False),
    ]


def with_install(selected: list, install: Stage, venv_ready: bool) -> list:
    """``selected``, after the install stage where the venv every other stage runs
    in is missing and install is not selected already."""
    if venv_ready or not selected or any(stage.name == install.name for stage in selected):
        return selected
    return [install, *selected]


def run_stage(stage: Stage) -> Outcome:
    """Run one stage, its output going to ours; kill it and its children at its limit."""
    start = time.monotonic()
    try:
        process = subprocess.Popen(stage.command, cwd=ROOT, start_new_session=True)
    except OSError as error:  # the command could not start
        return Outcome(stage.name, 0.0, f"could not start: {error}")
    try:
        code = process.wait(timeout=stage.limit_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)  # its own session: the stage's children too
        process.wait()
        return Outcome(stage.name, time.monotonic() - start, f"over its {stage.limit_s:g} s limit")
    failure = None if code == 0 else f"exit status {code}"
    return Outcome(stage.name, time.monotonic() - start, failure)


def run_stages(to_run: list, log: TextIO = sys.stdout) -> list:
    """Run every stage, whatever the ones before did; one progress line each."""
    outcomes = []
    for stage in to_run:
        print(f"[gpu-check] {stage.name}: started (limit {stage.limit_s:g} s)", file=log, flush=True)
        outcome = run_stage(stage)
        print(f"[gpu-check] {outcome.name}: {outcome.seconds:.0f} s, {outcome.status}", file=log, flush=True)
        outcomes.append(outcome)
    return outcomes


def summary(outcomes: list) -> str:
    width = max(len(o.name) for o in outcomes)
    lines = [f"  {o.name:<{width}}  {o.seconds:6.0f} s  {o.status}" for o in outcomes]
    failed = sum(o.failure is not None for o in outcomes)
    verdict = "all stages passed" if not failed else f"{failed} of {len(outcomes)} stages FAILED"
    return "\n".join(["[gpu-check] summary:", *lines, f"[gpu-check] {verdict}"])


def missing_gpu() -> Optional[str]:
    """Why this machine cannot run the check, or None. Asks the driver (nvidia-smi),
    not torch, so that a machine without a GPU is told before anything is installed."""
    nvidia_smi = shutil.which("nvidia-smi")
    if nvidia_smi is None:
        return "nvidia-smi is not on the PATH: no NVIDIA driver here"
    try:
        listed = subprocess.run([nvidia_smi, "-L"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"nvidia-smi -L failed: {error}"
    if listed.returncode != 0 or "GPU" not in listed.stdout:
        return f"nvidia-smi -L lists no GPU ({(listed.stderr or listed.stdout).strip() or 'no output'})"
    return None


def _pip(python: Path, *args: str) -> int:
    return subprocess.run([str(python), "-m", "pip", "install", "--disable-pip-version-check", *args], cwd=ROOT).returncode


def make_venv(venv: Path) -> Path:
    """A venv that sees, after its own, the packages of the Python running this script.
    Not `venv --system-site-packages`: where that Python is itself a venv (as GPU
    images ship PyTorch), that option shows the base interpreter's packages, not its."""
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = venv / "bin" / "python"
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    Path(purelib, "_gpu_check_parent.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    return python


def install(venv: Path, torch_spec: str) -> int:
    """The install stage (see the module docstring); the exit status of the last step."""
    python = venv / "bin" / "python"
    if not python.exists():
        python = make_venv(venv)
    has_cuda_torch = subprocess.run([str(python), "-c", "import torch; assert torch.cuda.is_available()"],
                                    capture_output=True).returncode == 0
    if not has_cuda_torch and _pip(python, torch_spec) != 0:
        return 1
    # Without build isolation the build needs no download (setuptools comes from the
    # machine); a machine whose setuptools is too old gets it from the index instead.
    if _pip(python, "--no-build-isolation", "-e", ".[test,bench]") == 0:
        return 0
    return _pip(python, "-e", ".[test,bench]")


def parse_arguments(argv) -> argparse.Namespace:
    names = [stage.name for stage in stages("python")]
    default = [stage.name for stage in stages("python") if stage.default]
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", type=lambda text: text.split(","), default=default,
                        help=f"comma-separated stages to run, in their order (default: {','.join(default)}; "
                             f"all: {','.join(names)}); a lease of 10 minutes a command runs them in several calls")
    parser.add_argument("--install", action="store_true", help="the install stage alone, without its time limit")
    parser.add_argument("--record", action="store_true",
                        help="the benchmarks update the committed results under bench/results/ (default: "
                             "bench/results/local/, which git ignores)")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.only) - set(names))
    if unknown:
        parser.error(f"unknown stage(s) {unknown}; choose from {names}")
    return args


def main(argv=None) -> int:
    args = parse_arguments(argv)
    reason = missing_gpu()
    if reason:
        print(f"[gpu-check] no CUDA GPU: {reason}. make gpu-check runs on a machine with an NVIDIA GPU; "
              "here, run `make test` (the CPU tiers) instead.", file=sys.stderr)
        return NO_GPU_EXIT
    if args.install:
        return install(VENV, os.environ.get("TORCH", "torch"))
    every = stages(str(VENV / "bin" / "python"), args.record)
    selected = [s for s in every if s.name in args.only]
    to_run = with_install(selected, every[0], (VENV / "bin" / "python").exists())
    if len(to_run) > len(selected):
        print(f"[gpu-check] {VENV.name} is missing: install runs first", flush=True)
    outcomes = run_stages(to_run)
    print(summary(outcomes), flush=True)
    return 0 if all(o.failure is None for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
