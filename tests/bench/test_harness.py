"""What the benchmarks share (bench/harness/, bench/models.py): memory trackers, the
max-depth search, results files and pictures, run metadata."""
import importlib
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import actsave
from actsave.planning.live_bytes import LiveBytes
from support import BENCH, CSV_COLUMNS, load_bench_module, read_rows


def test_sqnr_is_the_design_definition():
    harness = load_bench_module("harness")
    x = torch.randn(100)
    assert harness.sqnr_db(x, x) == math.inf
    assert harness.sqnr_db(x, 1.1 * x) == pytest.approx(20.0)
    assert harness.sqnr_db(torch.zeros(3), torch.ones(3)) == -math.inf


def test_results_of_other_benches_are_kept(tmp_path):
    harness = load_bench_module("harness")
    path = tmp_path / "cpu.csv"
    row = dict.fromkeys(CSV_COLUMNS, "")
    harness.write_csv([{**row, "bench": "a", "case": "x"}], path)
    harness.write_csv([{**row, "bench": "b", "case": "x"}], path)
    harness.write_csv([{**row, "bench": "a", "case": "x", "p50": "1"}], path)
    _, rows = read_rows(path)
    assert sorted((r["bench"], r["p50"]) for r in rows) == [("a", "1"), ("b", "")]


def test_a_provider_that_fails_to_build_is_an_error(monkeypatch):
    harness = load_bench_module("harness")

    def build(chain, batch, budget):
        raise actsave.ConfigError("no such mode")

    monkeypatch.setitem(harness.PROVIDERS, "broken", harness.Provider(build, "a broken mode"))
    assert harness.available_providers(["torch", "actsave_int8"]) == (["torch", "actsave_int8"], [])
    with pytest.raises(harness.ProviderError, match=r"'broken' \(a broken mode\) fails to build: ConfigError: no such"):
        harness.available_providers(["torch", "broken"])


def test_peak_tracker_agrees_with_memtracker():
    harness = load_bench_module("harness")
    models = load_bench_module("models")
    torch.manual_seed(0)
    model = models.cifar_resnet(20)
    batch = (torch.randn(2, 3, 8, 8), torch.randint(0, 10, (2,)))
    harness.training_step(model, batch)
    peaks = []
    for tracker in (harness.MemTracker, harness._GlobalPeakMemTracker):
        model.zero_grad(set_to_none=False)
        peaks.append(harness.measure_step_memory(model, batch, torch.device("cpu"), tracker).peak)
    assert peaks[0] == peaks[1] > 0


def test_only_an_out_of_memory_error_means_does_not_fit():
    # By type: the CPU allocator raises a plain RuntimeError, which stops the run (on CPU
    # the budget is checked against MemTracker's peak, never by running out).
    measure = load_bench_module("harness").measure

    def out_of_memory():
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    def other_error():
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 2 bytes")

    assert measure._unless_out_of_memory(out_of_memory) is None
    with pytest.raises(RuntimeError, match="DefaultCPUAllocator"):
        measure._unless_out_of_memory(other_error)


class _NoPeakHook:
    pass


class _PeakHookRenamed:
    def _update_peak_stats(self, state) -> None:
        pass


class _PeakHookWithoutSnapshots:
    def _update_peak_stats(self, peak_state) -> None:
        pass


@pytest.mark.parametrize("tracker, missing", [
    (_NoPeakHook, "_update_peak_stats(self, peak_state) (found none)"),
    (_PeakHookRenamed, "_update_peak_stats(self, peak_state) (found ['self', 'state'])"),
    (_PeakHookWithoutSnapshots, "the dict attribute _curr_mem_snap"),
])
def test_the_memtracker_override_is_checked_against_torch(tracker, missing):
    measure = load_bench_module("harness").measure
    measure.check_memtracker_override()  # this torch's MemTracker has what the override needs
    with pytest.raises(ImportError) as raised:
        measure.check_memtracker_override(tracker)
    assert f"torch {torch.__version__}" in str(raised.value) and missing in str(raised.value)


@pytest.mark.parametrize("peak", [
    lambda n: 10 + 3 * n,  # linear, like plain torch
    lambda n: 5 + 0.8 * n + 9 * math.sqrt(n),  # concave, like sqrt checkpointing
    lambda n: 10 + 3 * n if n < 50 else math.inf,  # out of memory from 50 on
])
@pytest.mark.parametrize("measured", [{}, {3: None, 6: None}, {3: None, 500: None}])
def test_max_depth_search_finds_the_boundary(peak, measured):
    harness = load_bench_module("harness")
    budget = 160
    peaks = {n: peak(n) for n in measured}
    fits, fails, complete = harness.deepest_fitting(peak, budget, peaks, out_of_time=lambda: False)
    assert complete and fails == fits + 1
    assert fits == max(n for n in range(1, 1000) if peak(n) <= budget)


def test_search_out_of_time_reports_a_lower_bound():
    harness = load_bench_module("harness")
    peaks = {4: 40.0}
    fits, fails, complete = harness.deepest_fitting(lambda n: 10.0 * n, 1000, peaks, out_of_time=lambda: True)
    assert (fits, fails, complete) == (4, None, False)


@pytest.mark.parametrize("text, nbytes", [("8GiB", 8 * 2**30), ("512MiB", 512 * 2**20), ("1.5KiB", 1536), ("100", 100)])
def test_budget_parsing(text, nbytes):
    assert load_bench_module("harness").parse_budget(text) == nbytes


def test_models_are_flat_chains():
    models = load_bench_module("models")
    resnet = models.cifar_resnet(164)
    assert len(resnet) == 1 + 3 * 18 + 5  # stem, blocks, BN, ReLU, pool, flatten, linear
    assert models.cifar_resnet(20)(torch.randn(2, 3, 32, 32)).shape == (2, 10)
    gpt = models.gpt(3, width=32, heads=2, vocab_size=50, max_seq_len=8)
    assert len(gpt) == 3 + 3 and gpt(torch.randint(0, 50, (2, 8))).shape == (2, 8, 50)
    chain = models.conv_bn_relu_chain(16)
    assert len(chain) == 3 * 16 + 2 and chain(torch.randn(2, 16, 16, 16)).shape == (2, 10)
    llama = models.llama(3, width=32, heads=2, vocab_size=50, max_seq_len=8)
    assert len(llama) == 3 + 3 and llama(torch.randint(0, 50, (2, 8))).shape == (2, 8, 50)
    pooled = models.pooled_resnet(2)
    assert len(pooled) == 4 + 3 * 2 + 2 + 3  # stem, blocks, pools between stages, head
    assert sum(isinstance(m, torch.nn.MaxPool2d) for m in pooled) == 3
    assert pooled(torch.randn(2, 3, 32, 32)).shape == (2, 10)
    with pytest.raises(ValueError):
        models.cifar_resnet(100)


def test_every_provider_has_a_display_name_and_a_style_of_its_own(monkeypatch):
    harness = load_bench_module("harness")
    monkeypatch.syspath_prepend(str(BENCH))
    scripts = [importlib.import_module(name) for name in ("accuracy_parity", "host_overhead", "gpu_speed")]
    ids = {*harness.PROVIDERS, *harness.BLOCK_PROVIDERS, *scripts[0].PROVIDERS, *scripts[1].PROVIDER_NAMES,
           *scripts[2].RESNET_PROVIDERS, *scripts[2].GPT_PROVIDERS}
    for path in (BENCH / "results").glob("*.csv"):  # the committed results of every bench
        columns, rows = read_rows(path)
        if columns == CSV_COLUMNS:  # the harness's files (frontier's names systems, not providers)
            ids |= {r["provider"] for r in rows}
    assert not ids - set(harness.DISPLAY_NAMES)
    # The API's spelling, not the ids.
    assert [harness.display_name(name) for name in harness.PROVIDERS] == [
        "nn.Sequential", "torch.utils.checkpoint", "CheckpointedSequential()", 'compress="int8"', 'compress="fp8"',
        "offload=True", 'compress="int8", offload=True', 'segments="auto", budget=B']
    styles = [harness.style(name) for name in harness.PROVIDERS]
    assert set(harness.PROVIDERS) <= set(harness.STYLES)
    assert len({(s["color"], s["marker"], s["linestyle"]) for s in styles}) == len(styles)
    int8, fp8 = harness.style("actsave_int8"), harness.style("actsave_fp8")  # their memory lines coincide
    assert int8["marker"] != fp8["marker"] and int8["linestyle"] != fp8["linestyle"]


def _run_with_results_in(results: Path, script: str, *args: str) -> str:
    done = subprocess.run([sys.executable, str(BENCH / script), "--smoke", *args], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "ACTSAVE_BENCH_RESULTS": str(results)})
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_a_run_writes_local_results_unless_it_records(tmp_path):
    # The least sweep that writes both files: where they go is what is held here.
    providers = ("--providers", "torch", "--depths", "11", "--scale-depths", "11", "--depth-cap", "20")
    stdout = _run_with_results_in(tmp_path, "resnet_depth_sweep.py", *providers)
    local = tmp_path / "local"
    assert sorted(p.name for p in local.iterdir()) == ["cpu-resnet_depth_sweep.png", "cpu.csv"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["local"]
    assert f"wrote {local / 'cpu.csv'} and {local / 'cpu-resnet_depth_sweep.png'} (local results" in stdout
    stdout = _run_with_results_in(tmp_path, "resnet_depth_sweep.py", *providers, "--record")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cpu-resnet_depth_sweep.png", "cpu.csv", "local"]
    assert stdout.splitlines()[-1] == f"wrote {tmp_path / 'cpu.csv'} and {tmp_path / 'cpu-resnet_depth_sweep.png'}"
    # --replot draws the recorded rows again, measuring nothing.
    (tmp_path / "cpu-resnet_depth_sweep.png").unlink()
    stdout = _run_with_results_in(tmp_path, "resnet_depth_sweep.py", "--replot", "--record")
    assert stdout.strip() == f"wrote {tmp_path / 'cpu-resnet_depth_sweep.png'}"


def test_results_go_to_a_git_ignored_folder_by_default():
    if os.environ.get("ACTSAVE_BENCH_RESULTS"):
        pytest.skip("ACTSAVE_BENCH_RESULTS moves the results folder")
    harness = load_bench_module("harness")
    assert harness.results_dir(record=False) == BENCH / "results" / "local"
    assert harness.results_dir(record=True) == BENCH / "results"
    ignored = subprocess.run(["git", "-C", str(BENCH), "check-ignore", "-q", "results/local/cpu.csv"])
    if ignored.returncode == 128:
        pytest.skip("not a git checkout")
    assert ignored.returncode == 0, "bench/results/local/ is not ignored by git"


def test_every_bench_script_takes_its_paths_from_the_harness():
    # One rule, one place: a script that writes results gets --out and --record from
    # harness.add_output_arguments and no path of bench/results of its own (the sweeps
    # get theirs through harness.parse_arguments; gpu_check.py passes --record on).
    writes = ("harness.write_csv(", "harness.save_figure(", ".write_text(")
    writers = [script for script in BENCH.glob("*.py")
               if script.name != "gpu_check.py" and any(call in script.read_text() for call in writes)]
    assert {script.name for script in writers} == {
        "accuracy_parity.py", "fidelity.py", "frontier.py", "gpu_speed.py", "gpu_step_profile.py", "host_overhead.py",
        "kernels.py", "offload_overlap.py", "rotor_compare.py"}
    for script in BENCH.glob("*.py"):
        source = script.read_text()
        assert "RESULTS_DIR" not in source, script.name
        if script in writers:
            assert "harness.add_output_arguments(parser" in source and "harness.output_path(args" in source, script.name


def test_the_allocator_peak_agrees_with_live_bytes_on_plain_tensors_and_sees_storage_resizes():
    harness = load_bench_module("harness")
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 64))
    x = torch.randn(32, 64, requires_grad=True)

    def step():
        out = model(x)
        out.backward(torch.ones_like(out))

    step()
    tracker = LiveBytes("cpu", known=[*model.parameters(), *(p.grad for p in model.parameters()), x])
    with tracker:
        step()
    assert harness.allocator_peak(step) == tracker.peak > 0

    kept = torch.empty(4096, dtype=torch.uint8)

    def refill_in_place():  # as FSDP2 frees and gathers a unit's parameters
        kept.untyped_storage().resize_(0)
        kept.untyped_storage().resize_(4096)

    assert harness.allocator_peak(refill_in_place) == 4096


FREED_ON_ANOTHER_THREAD = """
import sys, threading
import torch
sys.path.insert(0, sys.argv[1])
import harness
harness.count_frees_on_every_thread()


def step():  # 4 KiB made here and freed on a thread, then 4 KiB more
    box = [torch.empty(1024)]
    thread = threading.Thread(target=box.clear)
    thread.start()
    thread.join()
    torch.empty(1024)


print(harness.process_allocator_peak(step), harness.allocator_peak(step))
"""


def test_the_process_allocator_peak_sees_a_free_made_on_another_thread():
    """NOTE [ Frees on other threads ]: the profiler's events miss the thread's free,
    the allocator's total over every thread does not. In a process of its own: the
    flag stays set for the rest of a process."""
    result = subprocess.run([sys.executable, "-c", FREED_ON_ANOTHER_THREAD, str(BENCH)], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["4096", "8192"]


def test_results_record_the_commit_a_command_names_over_a_stale_checkouts(monkeypatch):
    def recorded():
        return load_bench_module("harness").run_metadata(torch.device("cpu"))["git_sha"]
    assert re.fullmatch(r"[0-9a-f]{40}(\+dirty)?|unknown", recorded())
    monkeypatch.setenv("ACTSAVE_GIT_SHA", "845e05b25954954e3496920141d81b64606a3688")
    assert recorded() == "845e05b25954954e3496920141d81b64606a3688"
