"""Host work per training step, held as budgets: aten operators, Triton launches and
host-device syncs of one step of each provider of bench/host_overhead.py, counted by
bench/harness/counts.py on small models on CPU (ResNet-56 b2 8x8, a 4-block GPT).
These counts do not vary from run to run, so a change that adds operators, launches
or syncs per step fails here; times are never asserted. Last, the script itself at
smoke scale: what it reports.

Budgets are written three ways:
- the host-work target, as a ratio to torch.utils.checkpoint's count (aten ops of
  the default mode <= 1.05x torch_ckpt's, on ResNet-164 and the GPT stack);
- formulas from the model's structure where one exists (Triton launches, syncs);
- ceilings at today's counts, as ratios to torch_ckpt's (ATEN_OPS_CEILING): lower them
  when host work is removed, never raise them without saying why in the commit.
"""
import importlib
import re
import sys
from pathlib import Path

import pytest
import torch
from support import CSV_COLUMNS, read_rows, run_script

import actsave
from actsave.triton_kernels import kernel_table

BENCH = Path(__file__).resolve().parents[2] / "bench"
LOSSY = ("actsave_int8", "actsave_fp8", "actsave_int8_offload")
CASES = ("resnet56", "gpt4")


def _import_from_bench(name: str):
    sys.path.insert(0, str(BENCH))  # the script imports harness and models from bench/
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(BENCH))


@pytest.fixture(scope="module")
def host_overhead():
    return _import_from_bench("host_overhead")


@pytest.fixture(scope="module")
def counts():
    return _import_from_bench("harness.counts")


@pytest.fixture(scope="module")
def measured(host_overhead):
    """{case: (models, batch, counts, counts again)}: every provider warmed up (the
    default mode plans at its first call), then counted twice."""
    cpu = torch.device("cpu")
    runs = {}
    for name in CASES:
        case = host_overhead.parse_case(name)
        models, batch = host_overhead.build_models(case, list(host_overhead.PROVIDER_NAMES), cpu)
        for model in models.values():
            for _ in range(2):
                host_overhead.train_step(model, batch)
        runs[name] = (models, batch, host_overhead.count_models(models, batch, cpu),
                      host_overhead.count_models(models, batch, cpu))
    return runs


def test_counts_are_the_same_every_step(measured):
    for name, (_, _, counts, again) in measured.items():
        for provider, c in counts.items():
            d = again[provider]
            assert (c.aten_ops_forward, c.aten_ops_backward, c.triton_launches, c.syncs) == (
                d.aten_ops_forward, d.aten_ops_backward, d.triton_launches, d.syncs), (name, provider)


def test_the_counter_sees_the_backward_and_the_recompute(host_overhead, counts, measured):
    # A checkpoint's recompute runs the forward's operators inside backward: the
    # dispatch mode must see them there (and never does for plain torch).
    models, batch, *_ = measured["resnet56"]
    recomputed = {}
    for provider in ("torch", "torch_ckpt", "actsave_none"):
        ops = counts.AtenOps()
        with ops:
            loss = host_overhead.forward_loss(models[provider], batch)
            ops.phase = "backward"
            loss.backward()
        recomputed[provider] = ops.by_phase["backward", "aten.convolution.default"]
        assert ops.by_phase["backward", "aten.convolution_backward.default"] > 0
    assert recomputed["torch"] == 0
    assert recomputed["torch_ckpt"] > 0 and recomputed["actsave_none"] > 0


def test_the_counters_catch_a_sync_and_a_launch(counts):
    x = torch.randn(4, 256, requires_grad=True)

    def forward():
        y = (x * 2).relu()
        y[y > 1].sum().item()  # a mask index and a read back: two syncs on CUDA
        with actsave.set_backend("triton"):
            actsave.checkpoint(torch.nn.functional.gelu, y, compress="int8")  # one encode
        return y.sum()

    c = counts.count_step(forward, lambda loss: loss.backward(), torch.device("cpu"))
    assert c.syncs == 2 and set(c.syncs_by_op) == {"aten.index.Tensor", "aten._local_scalar_dense.default"}
    assert c.triton_launches == 1 and list(c.launches_by_kernel) == ["_encode_int8_kernel"]


@pytest.mark.parametrize("case", CASES)
def test_no_mode_syncs(measured, case):
    # Every mode must run its step without waiting for the device: a sync stalls the
    # host behind the GPU, and with it every kernel launch after it.
    _, _, counts, _ = measured[case]
    assert {provider: c.syncs for provider, c in counts.items()} == dict.fromkeys(counts, 0)


def _codec_kernels() -> set:
    return {kernel.jit.fn.__name__ for kernel in kernel_table().values()}


def _relu_ops_per_layer(counts, chain, inputs) -> list:
    """aten.relu calls of each layer of ``chain`` in a forward: each is a ReLU output
    whose decisions a lossy recompute keeps (runtime/relu_signs.py)."""
    per_layer, x = [], inputs
    with torch.no_grad():
        for layer in chain:
            with counts.AtenOps() as ops:
                x = layer(x)
            per_layer.append(ops.by_phase["forward", "aten.relu.default"])
    return per_layer


def test_triton_launches_of_the_resnet_follow_its_segments(counts, measured):
    # Per step, under a lossy codec: one encode (forward) and one decode (recompute)
    # per kept input, i.e. per checkpointed segment but the first (it keeps the batch,
    # a leaf, by reference; the last segment is not checkpointed, and with balanced
    # segments autograd keeps its saves). Decisions (ReLU signs) kept per ReLU output
    # of those segments: one launch packs them in the forward, one restores them in
    # the recompute (triton_kernels/decisions/relu_signs.py).
    models, batch, step_counts, _ = measured["resnet56"]
    codec = _codec_kernels()
    for provider in LOSSY:
        model = models[provider]
        plan = model.balanced_plan
        stops = [*plan.starts[1:], plan.n_layers]
        kept = [(start, stop) for j, (start, stop) in enumerate(zip(plan.starts[:-1], stops))
                if start > 0 and not plan.plain[j]]
        relus = _relu_ops_per_layer(counts, model, batch[0])
        decisions = sum(sum(relus[start:stop]) for start, stop in kept)
        launched = step_counts[provider].launches_by_kernel
        codec_launches = sum(n for kernel, n in launched.items() if kernel in codec)
        decision_launches = sum(n for kernel, n in launched.items() if kernel not in codec)
        assert len(kept) >= 3 and decisions > 0
        assert codec_launches == 2 * len(kept), (provider, launched, plan.starts)
        assert decision_launches == 2 * decisions, (provider, launched, decisions)  # a pack, a restore
    for provider in ("torch", "torch_ckpt", "actsave_none", "actsave_offload"):
        assert step_counts[provider].triton_launches == 0


def test_triton_launches_of_the_gpt_follow_its_blocks(measured):
    # actsave.wrap keeps each block's input (the first block's is the embedding's
    # output, not a leaf): one encode and one decode per block under a lossy codec.
    models, _, counts, _ = measured["gpt4"]
    blocks = sum(isinstance(m, actsave.Checkpoint) for m in models["actsave_int8"].modules())
    assert blocks == 4
    for provider in LOSSY:
        assert counts[provider].triton_launches == 2 * blocks, counts[provider].launches_by_kernel
        assert set(counts[provider].launches_by_kernel) <= _codec_kernels()
    for provider in ("torch", "torch_ckpt", "actsave_none", "actsave_offload"):
        assert counts[provider].triton_launches == 0


# The host-work target: the default mode's step runs at most 5% more aten
# operators than torch.utils.checkpoint's, on ResNet-164 (checkpoint_sequential's
# sqrt split against the balanced plan, which recomputes a few more blocks for a lower
# peak) and the GPT stack (a checkpoint per block). ResNet-56, held by the ceilings
# below, stays above it: there the balanced plan's extra recompute is a larger share.
def test_default_mode_runs_at_most_5_percent_more_aten_ops_than_torch_checkpoint(host_overhead, measured):
    torch.set_num_threads(1)
    cpu = torch.device("cpu")
    case = host_overhead.parse_case("resnet164")
    models, batch = host_overhead.build_models(case, ["torch_ckpt", "actsave_none"], cpu)
    for model in models.values():
        for _ in range(2):
            host_overhead.train_step(model, batch)
    counts = host_overhead.count_models(models, batch, cpu)
    assert counts["actsave_none"].aten_ops <= 1.05 * counts["torch_ckpt"].aten_ops
    _, _, gpt, _ = measured["gpt4"]
    assert gpt["actsave_none"].aten_ops <= 1.05 * gpt["torch_ckpt"].aten_ops


# Ceilings on aten ops per step as multiples of torch_ckpt's in the same run (torch
# 2.13, CPU, codecs and decisions by their Triton kernels as on a GPU): the ratios
# measured now, plus 0.005. Lower a figure when the runtime removes host work.
ATEN_OPS_CEILING = {
    "resnet56": {"torch": 0.567, "actsave_none": 1.062, "actsave_int8": 1.161, "actsave_fp8": 1.161,
                 "actsave_offload": 1.062, "actsave_int8_offload": 1.161},
    "gpt4": {"torch": 0.637, "actsave_none": 1.011, "actsave_int8": 1.036, "actsave_fp8": 1.036,
             "actsave_offload": 1.011, "actsave_int8_offload": 1.036},
}


@pytest.mark.parametrize("case", CASES)
def test_aten_ops_stay_within_their_ceilings(measured, case):
    _, _, counts, _ = measured[case]
    reference = counts["torch_ckpt"].aten_ops
    ratios = {provider: round(c.aten_ops / reference, 4) for provider, c in counts.items() if provider != "torch_ckpt"}
    over = {provider: (ratio, ATEN_OPS_CEILING[case][provider]) for provider, ratio in ratios.items()
            if ratio > ATEN_OPS_CEILING[case][provider]}
    assert not over, f"aten ops per step over their ceiling (ratio to torch_ckpt, ceiling): {over}"


@pytest.mark.parametrize("rotate", [False, True])
def test_interleaved_rounds_rotate_their_order_when_asked(host_overhead, rotate):
    ran = []
    steps = {name: (lambda name=name: ran.append(name)) for name in "abc"}
    times = host_overhead.interleaved_times(steps, 6, torch.device("cpu"), rotate=rotate)
    assert {name: len(seconds) for name, seconds in times.items()} == {"a": 6, "b": 6, "c": 6}
    rounds = ["".join(ran[i:i + 3]) for i in range(0, len(ran), 3)]
    assert rounds == (["abc", "bca", "cab"] * 2 if rotate else ["abc"] * 6)


def test_host_overhead_reports_time_and_counts_of_every_mode(tmp_path):
    out = tmp_path / "cpu.csv"
    stdout = run_script("host_overhead.py", "--out", str(out))
    columns, rows = read_rows(out)
    assert columns == CSV_COLUMNS and {r["bench"] for r in rows} == {"host_overhead"}
    assert {r["case"] for r in rows} == {"cifar_resnet(11) b2 8x8 fp32", "gpt(1) w64 h4 v128 t16 b2 float32"}
    providers = {"torch", "torch_ckpt", "actsave_none", "actsave_int8", "actsave_fp8", "actsave_offload",
                 "actsave_int8_offload"}
    metrics = {"time", "time_vs_torch_ckpt", "time_vs_default", "aten_ops", "aten_ops_backward", "triton_launches",
               "syncs"}
    assert {(r["case"], r["provider"], r["metric"]) for r in rows} == {
        (case, p, m) for case in {r["case"] for r in rows} for p in providers for m in metrics}
    for r in rows:
        if r["metric"] == "time":
            assert r["n_reps"] == "2" and float(r["p50"]) > 0
        if r["metric"] == "time_vs_torch_ckpt" and r["provider"] == "torch_ckpt":
            assert float(r["p20"]) == float(r["p80"]) == 1.0
        if r["metric"] == "syncs":
            assert float(r["p50"]) == 0
        if r["metric"] == "triton_launches":
            assert (float(r["p50"]) > 0) == ("int8" in r["provider"] or "fp8" in r["provider"])
    assert "x torch_ckpt" in stdout and "operators seen on 1 thread(s)" in stdout
    # Each launcher's Python work per call, with a stub launcher.
    launchers = stdout.split("Python work per launcher call before its launch")[1]
    for name in ("int8 encode, centered", "fp8_e4m3 decode, flat", "ReLU signs packed", "ReLU signs restored"):
        assert re.search(rf"{re.escape(name)} +\d+\.\d", launchers), name
