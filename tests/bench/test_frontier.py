"""bench/frontier.py: the time-memory frontier at smoke scale."""
import importlib

import pytest
import torch

from support import bench_exit, load_bench_module, read_rows, run_script


@pytest.fixture(scope="module")
def frontier_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("frontier") / "cpu-frontier.csv"
    # Bench's own Llama stack is the GPT's code with another block (frontier_cases.stack_case):
    # the smoke run leaves it out.
    cases = "resnet,gpt" + ",hf_llama" * (importlib.util.find_spec("transformers") is not None)
    stdout = run_script("frontier.py", "--cases", cases, "--out", str(out))
    columns, rows = read_rows(out)
    return out, stdout, columns, rows


def test_frontier_measures_every_system_of_every_case(frontier_run):
    out, stdout, columns, rows = frontier_run
    frontier = load_bench_module("frontier")
    assert tuple(columns) == frontier.COLUMNS
    assert out.with_suffix(".png").stat().st_size > 0
    has_transformers = importlib.util.find_spec("transformers") is not None
    cases = list(dict.fromkeys(r["case"] for r in rows))
    assert [case.split("(")[0] for case in cases] == ["cifar_resnet", "gpt", *["hf_llama"][:has_transformers]]
    for case in cases:
        mine = [r for r in rows if r["case"] == case]
        families = {r["family"] for r in mine}
        peers = ({"torch checkpoint_sequential"} if case.startswith("cifar") else
                 {"torch checkpoint per block", "torch SAC (torchtitan's ops)"})
        # No offload on a CPU: the host's memory is the device's.
        assert families == {"plain", "again", "actsave recompute", "actsave exact", "actsave int8",
                            "actsave exact at a peer's peak", *peers, *["actsave default"][:case.startswith("cifar")]}, case
        (plain,) = [r for r in mine if r["family"] == "plain"]
        assert float(plain["step_vs_plain"]) == float(plain["peak_vs_plain"]) == 1.0
        for family in ("actsave recompute", "actsave exact", "actsave int8"):  # --smoke: 3 budgets, smallest to plain's
            points = [r for r in mine if r["family"] == family]
            assert len(points) == 3 and all(r["pred_peak_bytes"] and r["pred_step_s"] and r["plan"] for r in points)
            assert float(points[0]["peak_bytes"]) < float(plain["peak_bytes"])  # memory is exact on a CPU
        at_peer = [r for r in mine if r["peer"]]
        assert at_peer and all(float(r["peak_vs_peer"]) > 0 and float(r["step_vs_peer"]) > 0 for r in at_peer)
        assert all(float(r["step_vs_peer_paired"]) > 0 for r in at_peer)  # each also timed in rounds of its pair
        (again,) = [r for r in mine if r["family"] == "again"]
        assert float(again["step_vs_peer_paired"]) > 0  # the noise floor of a pair
        assert {r["peer"] for r in at_peer} <= {r["system"] for r in mine if r["family"] in peers} | {"plain"}
        half = [r for r in at_peer if r["point"] == "half of plain's peak"]
        assert all(r["peer"] == "plain" and int(r["budget_bytes"]) == int(plain["peak_bytes"]) // 2 for r in half)
        if case.startswith("cifar"):  # the smoke blocks' smallest plan is above half of plain's peak
            assert half
        for r in mine:
            if r["family"].startswith("torch SAC"):  # the policy matched ops: it names overloads
                assert "saved a step: " in r["note"] and "mm.default" in r["note"], r
            if r["system"] == "torch checkpoint, every block":
                assert float(r["peak_bytes"]) < float(plain["peak_bytes"])
    assert "noise floor" in stdout and "summary: each peer point against actsave" in stdout


def test_frontier_compiles_each_memory_budget_into_a_graph_of_its_own(tmp_path):
    # aot_eager: AOTAutograd's partitioner, which reads the budget, without Inductor's
    # C++ builds. A budget whose backend compiled nothing (it ran another's graph) fails the run.
    out = tmp_path / "cpu-frontier.csv"
    run_script("frontier.py", "--cases", "gpt", "--compile", "--compile-backend", "aot_eager", "--points", "2",
               "--rounds", "1", "--levers", "recompute", "--out", str(out))
    rows = read_rows(out)[1]
    compiled = [r for r in rows if r["family"] == "torch.compile memory budget"]
    assert [r["point"] for r in compiled] == ["budget 0.1", "budget 0.3", "budget 0.5"]
    assert all(r["note"] == "backend aot_eager" and float(r["peak_vs_plain"]) < 1 for r in compiled)
    assert {r["peer"] for r in rows if r["peer"]} >= {r["system"] for r in compiled}
    # actsave's exact plan within each compiled peer's peak, compiled by the same backend.
    actsave_compiled = [r for r in rows if r["family"] == "actsave exact compiled at a compiled peer's peak"]
    assert sorted(r["peer"] for r in actsave_compiled) == sorted(r["system"] for r in compiled)
    assert all(r["note"] == "backend aot_eager" and r["levers"] == "exact, compiled" for r in actsave_compiled)


def test_frontier_skips_a_lever_set_the_planner_rejects(tmp_path, monkeypatch, capsys):
    frontier = load_bench_module("frontier")
    monkeypatch.setitem(frontier.LEVER_SETS, "bogus", ("recompute", "bogus"))
    out = tmp_path / "cpu-frontier.csv"
    assert frontier.main(["--smoke", "--cases", "gpt", "--levers", "recompute,bogus", "--points", "2",
                          "--rounds", "1", "--out", str(out)]) == 0
    stdout = capsys.readouterr().out
    assert "note: lever set bogus ('recompute', 'bogus') skipped: the planner rejects it" in stdout
    assert {r["family"] for r in read_rows(out)[1]} >= {"actsave recompute"}


def test_frontier_shells_share_parameters_and_wrap_apart():
    systems = load_bench_module("frontier_systems")
    models = load_bench_module("models")
    plain = models.gpt(4, width=32, heads=2, vocab_size=50, max_seq_len=8)
    wrapped = systems.every_kth_block(systems.shell(plain, (models.TransformerBlock,)), models.TransformerBlock, 2,
                                      systems.TorchCheckpoint)
    # torchtitan's layer-selective rule: block i where (i + 1) % k == 0.
    assert [type(m).__name__ for m in wrapped][1:5] == ["TransformerBlock", "TorchCheckpoint"] * 2
    assert all(isinstance(m, models.TransformerBlock) for m in plain[1:5])
    assert [p.data_ptr() for p in wrapped.parameters()] == [p.data_ptr() for p in plain.parameters()]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_frontier_refuses_cuda_without_a_gpu():
    status, _, stderr = bench_exit("frontier.py", "--device", "cuda")
    assert status == 2 and "needs a CUDA GPU" in stderr
