"""bench/gpu_step_profile.py: its refusal without CUDA, and its report on a GPU."""
import subprocess
import sys

import pytest
import torch

from support import BENCH, bench_exit, load_bench_module


def _step_profile(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(BENCH / "gpu_step_profile.py"), *args],
                          capture_output=True, text=True, timeout=300)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_the_step_profile_refuses_without_cuda():
    status, _, stderr = bench_exit("gpu_step_profile.py")
    assert status == 2 and "needs a CUDA GPU" in stderr


@pytest.mark.cuda
def test_the_step_profile_reports_each_mode(tmp_path):
    done = _step_profile("--batch", "2", "--depth", "11", "--providers", "torch_ckpt,actsave_none",
                         "--profile", "--out", str(tmp_path))
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line for line in done.stdout.splitlines()[2:] if not line.startswith("wrote ")]
    rows = {line.split()[0]: line.split()[1:] for line in lines}
    assert sorted(rows) == ["actsave_none", "torch", "torch_ckpt"]
    assert all(len(values) == 3 and all(float(v) > 0 for v in values) for values in rows.values())
    slug = load_bench_module("harness").device_slug(torch.device("cuda"))
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"{slug}-profile-actsave_none-b2.txt",
                                                          f"{slug}-profile-torch_ckpt-b2.txt"]
