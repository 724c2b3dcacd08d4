"""bench/offload_overlap.py: its smoke run on CPU, and its refusal of a real CPU run."""
import pytest
import torch

from support import CSV_COLUMNS, bench_exit, read_rows, run_script


def test_offload_overlap_smoke_writes_every_metric(tmp_path):
    out = tmp_path / "cpu.csv"
    stdout = run_script("offload_overlap.py", "--out", str(out))
    columns, rows = read_rows(out)
    assert columns == CSV_COLUMNS and "copies are synchronous" in stdout
    metrics = {(r["provider"], r["metric"]) for r in rows}
    assert metrics == {(f"actsave_{codec}_offload", metric) for codec in ("none", "int8")
                       for metric in ("offloaded_MiB", "copy_ms", "step_ms", "step_offload_ms", "hidden_pct")}
    assert all(float(r["p50"]) > 0 for r in rows if r["metric"] == "offloaded_MiB")


def test_offload_overlap_refuses_a_cpu_run(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    status, _, stderr = bench_exit("offload_overlap.py", "--out", str(tmp_path / "x.csv"))
    assert status != 0 and "needs a CUDA device" in stderr
    assert not (tmp_path / "x.csv").exists()
