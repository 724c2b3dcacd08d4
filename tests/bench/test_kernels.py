"""bench/kernels.py: every codec and decision kernel checked and timed at smoke scale."""

import pytest
import torch

from support import BENCH, CSV_COLUMNS, bench_exit, load_bench_module, read_rows, run_script


def test_kernels_bench_checks_every_codec_and_reports_bytes(tmp_path):
    out = tmp_path / "cpu.csv"
    run_script("kernels.py", "--out", str(out))
    columns, rows = read_rows(out)
    assert columns == CSV_COLUMNS
    ratios = {r["case"]: float(r["p50"]) for r in rows if r["metric"] == "bytes_ratio"}
    # codecs x layouts (flat, centered at 32x32, 8x8 and 14x14, ReLU outputs on the
    # unsigned grid) x dtypes, and the ReLU, ReLU6 and max-pool decisions per dtype,
    # each checked against its reference
    assert len(ratios) == 3 * 5 * 3 + 3 * 3
    assert ratios["max_pool-2x2-bf16"] == 2 / 64  # a 2x2 window's winner in 2 bits, of an int64 index
    assert {"int8-fp32", "fp8_e4m3-c14x14-bf16", "fp8_e5m2-relu32x32-fp16"} <= set(ratios)
    # Codes, scales and channel means: a little over a quarter of fp32, a half of bf16.
    assert all(ratio <= (0.27 if case.endswith("fp32") else 0.53) for case, ratio in ratios.items())


def test_kernels_bench_tries_each_tile_it_is_given_and_checks_its_bits(tmp_path):
    """--tiles: every case once per tile, each checked against its reference."""
    out = tmp_path / "cpu.csv"
    stdout = run_script("kernels.py", "--out", str(out), "--tiles", "4096x8,1024x2", "--dtypes", "bf16",
                        "--layouts", "flat,c14x14")
    _, rows = read_rows(out)
    cases = {r["case"] for r in rows if r["metric"] == "bytes_ratio"}
    assert cases == {f"{codec}-{layout}@{tile}-bf16" for codec in ("int8", "fp8_e4m3", "fp8_e5m2")
                     for layout in ("flat", "c14x14") for tile in ("4096x8", "1024x2")}
    assert "every kernel equals its reference" in stdout


def test_kernels_bench_refuses_a_tile_it_cannot_launch():
    status, _, stderr = bench_exit("kernels.py", "--smoke", "--tiles", "3000x8")
    assert status != 0 and "'3000x8' is not a power-of-two element count" in stderr


@pytest.fixture
def kernels_bench(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))  # the script imports its harness as `harness`
    return load_bench_module("kernels")


def test_kernels_bench_puts_the_launchers_own_tiles_back(kernels_bench):
    from actsave.triton_kernels import _tile
    own = _tile.CUDA_TILE, _tile.INTERPRETER_TILE
    with pytest.raises(KeyError), kernels_bench.tiles(_tile.Tile(1024, 2)):
        assert _tile.CUDA_TILE == _tile.INTERPRETER_TILE == _tile.Tile(1024, 2)
        raise KeyError
    assert (_tile.CUDA_TILE, _tile.INTERPRETER_TILE) == own


def test_kernels_bench_times_copy_encode_decode_and_means_of_each_case(kernels_bench):
    """The timed path of a CUDA run, with a timer that only calls: every metric of a
    centered case, its inputs rotated (an L2 of three inputs asks for 12 copies, 8 kept)."""
    calls = []

    class Timer:
        l2_bytes = 3 * 1024 * 4

        def __call__(self, function):
            for _ in range(9):
                function()
            calls.append(function)
            return 1e-3, 1e-5

    row = kernels_bench.measure("fp8_e4m3", "c8x8", torch.float32, 1024, 4, torch.device("cpu"), Timer())
    assert set(row) == set(kernels_bench.UNITS) - {f"{step}_{metric}"
                                                     for step in ("encode_signs", "pack", "restore", "gather")
                                                     for metric in ("ms", "gbps", "pct_copy", "host_us")}
    assert len(calls) == 4  # copy, encode, decode, means
    assert row["encode_pct_copy"] == pytest.approx(100 * row["encode_gbps"] / row["copy_gbps"])
    relu = kernels_bench.measure("int8", "relu32x32", torch.bfloat16, 4096, 4, torch.device("cpu"), Timer())
    assert "means_ms" not in relu and relu["decode_host_us"] == pytest.approx(10.0)
    # A ReLU output encoded with its decisions: its values, codes, scales and one bit each.
    assert relu["encode_signs_gbps"] == pytest.approx((2 * 4096 + 4096 + 4 * 32 + 512) / 1e-3 / 1e9)


@pytest.mark.parametrize("decisions", ["measure_relu_decisions", "measure_bound_decisions"])
def test_kernels_bench_times_the_decision_kernels_against_a_copy(kernels_bench, decisions):
    """The timed path of the ReLU and ReLU6 decisions with a timer that only calls: a
    pack moves the save and its bits, a restore the save twice and the bits."""
    class Timer:
        l2_bytes = 3 * 1024 * 4

        def __call__(self, function):
            function()
            return 1e-3, 1e-5

    row = getattr(kernels_bench, decisions)(torch.bfloat16, 4096, torch.device("cpu"), Timer())
    assert row["bytes_ratio"] == 1 / 16
    assert row["pack_gbps"] == pytest.approx((2 * 4096 + 512) / 1e-3 / 1e9)
    assert row["restore_gbps"] == pytest.approx((4 * 4096 + 512) / 1e-3 / 1e9)
    assert row["restore_pct_copy"] == pytest.approx(100 * row["restore_gbps"] / row["copy_gbps"])


def test_kernels_bench_times_the_max_pool_decision_kernels_against_a_copy(kernels_bench):
    """The timed path of the max-pool decisions with a timer that only calls: an encode
    and a decode move the indices and their bits, a gather the indices and two values
    per window."""
    calls = []

    class Timer:
        l2_bytes = 3 * 1024 * 4

        def __call__(self, function):
            calls.append(function())
            return 1e-3, 1e-5

    row = kernels_bench.measure_max_pool_decisions(torch.bfloat16, 4096, torch.device("cpu"), Timer())
    windows = 2 * kernels_bench.POOL_CHANNELS * 5 * 5  # 2, 16, 10, 10 pooled 2x2
    assert row["encode_gbps"] == row["decode_gbps"] == pytest.approx((8 * windows + windows // 4) / 1e-3 / 1e9)
    assert row["gather_gbps"] == pytest.approx((8 + 2 * 2) * windows / 1e-3 / 1e9)
    assert row["gather_pct_copy"] == pytest.approx(100 * row["gather_gbps"] / row["copy_gbps"])
    assert len(calls) == 4  # copy, encode, decode, gather


def test_kernels_bench_gpu_timer_waits_for_the_host_to_queue_every_call(kernels_bench, monkeypatch):
    """GpuTimer against fake CUDA events and sleep: GPU time per call from the events
    around a batch, host time per call from the queueing."""
    import time as time_module
    from types import SimpleNamespace

    class Event:
        def __init__(self, enable_timing):
            self.at = None

        def record(self):
            self.at = time_module.perf_counter()

        def synchronize(self):
            pass

        def elapsed_time(self, end):
            return (end.at - self.at) * 1e3

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "_sleep", lambda cycles: None)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(L2_cache_size=2**20))
    timer = kernels_bench.GpuTimer(torch.device("cuda"), repeats=4, batches=3)
    assert timer.l2_bytes == 2**20
    calls = []
    gpu, host = timer(lambda: calls.append(time_module.sleep(1e-4)))
    # A warm call, a timed one, then batches of 4: 3 kept, and any the host was too
    # slow for (queued longer than the sleep before it) run again.
    assert len(calls) >= 2 + 3 * 4 and (len(calls) - 2) % 4 == 0
    assert gpu >= 1e-4 and host >= 1e-4
