"""bench/gpu_speed.py: its phases at smoke scale on CPU, and its refusal without CUDA."""
import importlib

import pytest
import torch

from support import BENCH, bench_exit, read_rows, run_script


def test_gpu_speed_runs_every_phase_at_smoke_scale(tmp_path):
    # The GPU stage's code on CPU: the CUDA allocator's figures are left out, the
    # kernels bench is cut at its limit (its own smoke test runs it through).
    out = tmp_path / "cpu.csv"
    stdout = run_script("gpu_speed.py", "--out", str(out), "--kernels-limit", "1")
    text = (tmp_path / "cpu-speed.txt").read_text()
    assert text.startswith("# ") and f"torch {torch.__version__}" in text.splitlines()[0]
    for title in ("cifar_resnet(11) b2 8x8 fp32", "gpt(2) w32 h2 v64 t16 b2 bfloat16", "host overhead, ",
                  "codec kernels (bench/kernels.py --smoke): over its 1 s limit",
                  "eager against CUDA-graphed steps, cifar_resnet(11) b2 8x8 fp32",
                  "host time per launch (bench/launch_overhead.py, 3 calls a round"):
        assert title in text and title in stdout
    assert "needs a CUDA device: not measured" in text  # the graphs phase: a capture needs CUDA
    for ratio in ("actsave_none / torch_ckpt", "actsave_int8 / actsave_none", "actsave_offload / actsave_none",
                  "actsave_int8_offload / actsave_none", "actsave_int8 / torch_ckpt", "enqueue/step"):
        assert ratio in text
    _, rows = read_rows(out)
    assert {r["bench"] for r in rows} == {"gpu_speed", "host_overhead"}
    speed = [r for r in rows if r["bench"] == "gpu_speed"]
    assert {(r["case"], r["provider"]) for r in speed if r["metric"] == "time"} == {
        *(("cifar_resnet(11) b2 8x8 fp32", p) for p in ("torch", "torch_ckpt", "actsave_none", "actsave_int8",
                                                       "actsave_fp8", "actsave_offload", "actsave_int8_offload")),
        *(("gpt(2) w32 h2 v64 t16 b2 bfloat16", p) for p in ("torch", "torch_ckpt", "actsave_none", "actsave_int8",
                                                            "actsave_offload", "actsave_int8_offload"))}
    metrics = {r["metric"] for r in speed}
    assert metrics == {"time", "host_enqueue", "time_vs_torch_ckpt", "time_vs_default", "est_peak_act_mem",
                       "live_peak_act_mem"}  # no CUDA allocator here
    assert all(float(r["p50"]) > 0 for r in speed)


def test_a_failing_gpu_speed_phase_leaves_the_others_to_run(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    gpu_speed = importlib.import_module("gpu_speed")
    report, failures = gpu_speed.Report(tmp_path / "speed.txt", ["# header"]), []
    gpu_speed.run_phase(report, failures, "broken", lambda: 1 / 0)
    gpu_speed.run_phase(report, failures, "fine", lambda: report.add("fine", "measured"))
    assert failures == ["broken: ZeroDivisionError: division by zero"]
    text = (tmp_path / "speed.txt").read_text()
    assert "broken: FAILED\nTraceback" in text and text.rstrip().endswith("fine\nmeasured")


def test_gpu_speed_reports_the_allocator_figures(tmp_path, monkeypatch):
    # The CUDA allocator's columns, fed by a stand-in allocator, so that the one GPU
    # run does not meet their code first: every step peaks 3 MiB above its start in
    # 7 allocations, and the first leaves 1 MiB allocated.
    monkeypatch.syspath_prepend(str(BENCH))
    gpu_speed = importlib.import_module("gpu_speed")

    class Allocator(gpu_speed.Memory):
        def begin(self):
            return 0, 0

        def end(self, began):
            first = not getattr(self, "ended", False)
            self.ended = True
            return 3 * 2**20, 7, 2**20 if first else 0

    monkeypatch.setattr(gpu_speed, "Memory", Allocator)
    threads = torch.get_num_threads()
    try:
        assert gpu_speed.main(["--smoke", "--phases", "resnet", "--out", str(tmp_path / "cpu.csv")]) == 0
    finally:
        torch.set_num_threads(threads)
    _, rows = read_rows(tmp_path / "cpu.csv")
    values = {(r["provider"], r["metric"]): r for r in rows}
    batch = 2 * 3 * 8 * 8 * 4 / 2**20  # the input batch counts in every activation peak
    assert float(values["actsave_int8", "peak_act_mem"]["p50"]) == pytest.approx(3 + batch)
    assert float(values["torch", "allocations"]["p80"]) == 7
    assert float(values["torch", "peak_mem_first_step"]["p50"]) == pytest.approx(3 + batch)
    text = (tmp_path / "cpu-speed.txt").read_text()
    table = text.split("cifar_resnet(11)")[1].splitlines()
    header, torch_row = table[1].split(), table[2].split()
    assert header[:3] == ["provider", "step", "ms"] and torch_row[0] == "torch"
    assert torch_row[-2:] == ["1.0", "7"]  # the first step's 1 MiB kept, 7 allocations a step


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_gpu_speed_refuses_without_cuda(tmp_path):
    status, _, stderr = bench_exit("gpu_speed.py", "--out", str(tmp_path / "x.csv"))
    assert status == 2 and "needs a CUDA GPU" in stderr
    assert not list(tmp_path.iterdir())
