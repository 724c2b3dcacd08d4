"""`make gpu-check` (bench/gpu_check.py) on a machine without a GPU: it refuses at
once, and its stage runner, fed fake stages, runs past a failing one and reports it."""
import importlib.util
import io
import subprocess
import sys
from pathlib import Path

import pytest

from support import bench_exit

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "gpu_check.py"


@pytest.fixture(scope="module")
def gpu_check():
    spec = importlib.util.spec_from_file_location("bench_gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _run_with_path(path: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT)], env={"PATH": path}, capture_output=True, text=True,
                          timeout=60)


def test_without_a_driver_it_refuses_before_installing(tmp_path, gpu_check):
    venv_existed = gpu_check.VENV.exists()
    done = _run_with_path(str(tmp_path))  # an empty PATH: no nvidia-smi
    assert done.returncode == gpu_check.NO_GPU_EXIT
    assert "no CUDA GPU: nvidia-smi is not on the PATH" in done.stderr and "make test" in done.stderr
    assert "[gpu-check] install" not in done.stdout
    assert venv_existed or not gpu_check.VENV.exists()


def test_a_driver_that_lists_no_gpu_is_refused(tmp_path, gpu_check):
    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\necho 'NVIDIA-SMI has failed because it could not communicate with the driver' >&2\n"
                    "exit 9\n")
    fake.chmod(0o755)
    done = _run_with_path(str(tmp_path))
    assert done.returncode == gpu_check.NO_GPU_EXIT
    assert "nvidia-smi -L lists no GPU (NVIDIA-SMI has failed" in done.stderr


def _stage(gpu_check, name, code, limit_s=60):
    return gpu_check.Stage(name, (sys.executable, "-c", code), limit_s)


def test_stages_run_past_a_failure_and_all_are_reported(gpu_check):
    log = io.StringIO()
    outcomes = gpu_check.run_stages([
        _stage(gpu_check, "first", "pass"),
        _stage(gpu_check, "broken", "raise SystemExit(3)"),
        gpu_check.Stage("missing", ("/nonexistent/python",), 60),
        _stage(gpu_check, "slow", "import time; time.sleep(60)", limit_s=0.5),
        _stage(gpu_check, "last", "pass"),
    ], log)
    assert [(o.name, o.status) for o in outcomes] == [
        ("first", "ok"),
        ("broken", "FAILED (exit status 3)"),
        ("missing", "FAILED (could not start: [Errno 2] No such file or directory: '/nonexistent/python')"),
        ("slow", "FAILED (over its 0.5 s limit)"),
        ("last", "ok"),
    ]
    ended = [line for line in log.getvalue().splitlines() if "started" not in line]
    assert [line.split(":")[0] for line in ended] == [f"[gpu-check] {o.name}" for o in outcomes]
    assert ended[1].endswith("s, FAILED (exit status 3)")
    report = gpu_check.summary(outcomes)
    assert report.splitlines()[-1] == "[gpu-check] 3 of 5 stages FAILED"
    assert all(o.name in report for o in outcomes)


def test_the_stage_limits_fit_25_minutes(gpu_check):
    assert sum(stage.limit_s for stage in gpu_check.stages("python") if stage.default) <= 25 * 60


def test_the_speed_stage_is_one_lease_command(gpu_check):
    # Named alone (--only speed), it runs in one device command of at most 8 minutes,
    # install included where the venv is missing (measured 20 s): 7 minutes for itself.
    (speed,) = [stage for stage in gpu_check.stages("python") if stage.name == "speed"]
    assert not speed.default and speed.limit_s <= 7 * 60
    assert speed.command[1:3] == ("-u", str(SCRIPT.with_name("gpu_speed.py")))
    assert "speed" not in gpu_check.parse_arguments([]).only
    assert gpu_check.parse_arguments(["--only", "speed"]).only == ["speed"]


def test_the_frontier_stage_is_one_lease_command(gpu_check):
    # Named alone (--only frontier), at the GPU stage's sizes, within 8 minutes with the install.
    (frontier,) = [stage for stage in gpu_check.stages("python") if stage.name == "frontier"]
    assert not frontier.default and frontier.limit_s + 20 <= 8 * 60
    assert frontier.command[1:] == ("-u", str(SCRIPT.with_name("frontier.py")), "--device", "cuda")
    assert "frontier" not in gpu_check.parse_arguments([]).only
    assert gpu_check.parse_arguments(["--only", "frontier"]).only == ["frontier"]


def test_a_stage_on_a_fresh_machine_installs_first(gpu_check):
    every = gpu_check.stages("python")
    install, speed, kernels = (next(s for s in every if s.name == name) for name in ("install", "speed", "kernels"))
    assert gpu_check.with_install([speed], install, venv_ready=False) == [install, speed]
    assert gpu_check.with_install([kernels, speed], install, venv_ready=True) == [kernels, speed]
    assert gpu_check.with_install([install, speed], install, venv_ready=False) == [install, speed]


def test_record_passes_on_to_every_stage_that_writes_results(gpu_check):
    plain, recorded = gpu_check.stages("python"), gpu_check.stages("python", record=True)
    benches = {s.name for s in plain if any(str(part).endswith(".py") and "gpu_check" not in str(part)
                                             for part in s.command)}
    assert set(gpu_check.RECORDING) == benches
    for before, after in zip(plain, recorded):
        assert "--record" not in before.command
        assert after.command == ((*before.command, "--record") if before.name in benches else before.command)
    assert gpu_check.parse_arguments(["--record"]).record and not gpu_check.parse_arguments([]).record


@pytest.mark.parametrize("script", ["kernels.py", "offload_overlap.py", "gpu_step_profile.py",
                                    "resnet_depth_sweep.py", "transformer_depth_sweep.py", "gpu_speed.py",
                                    "frontier.py"])
def test_each_recording_stage_takes_record(script):
    status, stdout, stderr = bench_exit(script, "--help")
    assert status == 0 and "--record" in stdout, stderr[-2000:]
