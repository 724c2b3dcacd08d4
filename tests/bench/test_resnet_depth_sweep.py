"""bench/resnet_depth_sweep.py at smoke scale: the CSV it writes, memory orderings of its
modes (CPU memory is measured exactly; times never are), its real-scale stage and its
picture."""
import json
import math

import pytest

from support import CSV_COLUMNS, load_bench_module, read_rows, run_script, value


@pytest.fixture(scope="module")
def resnet_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("resnet") / "cpu.csv"
    stdout = run_script("resnet_depth_sweep.py", "--device", "cpu", "--out", str(out))
    columns, rows = read_rows(out)
    return out, stdout, columns, rows


def test_resnet_sweep_writes_the_csv_schema_and_a_png(resnet_run):
    out, stdout, columns, rows = resnet_run
    assert columns == CSV_COLUMNS
    assert {r["bench"] for r in rows} == {"resnet_depth_sweep"}
    assert {"peak_mem", "peak_act_mem", "est_act_mem", "kept_bytes", "time", "time_ratio", "grad_sqnr",
            "max_depth", "est_device_peak", "est_host_bytes"} <= {r["metric"] for r in rows}
    assert out.with_name("cpu-resnet_depth_sweep.png").stat().st_size > 0
    assert "max depth" in stdout


def test_exact_providers_have_exact_gradients(resnet_run):
    *_, rows = resnet_run
    for provider in ("torch_ckpt", "actsave_none"):
        sqnrs = [float(r["p50"]) for r in rows if r["provider"] == provider and r["metric"] == "grad_sqnr"]
        assert sqnrs and all(s == math.inf for s in sqnrs)


def test_actsave_activation_peak_is_not_above_torch(resnet_run):
    *_, rows = resnet_run
    depths = {r["x_value"] for r in rows if r["metric"] == "peak_act_mem"}
    for depth in depths:
        assert value(rows, "actsave_none", "peak_act_mem", depth) <= value(rows, "torch", "peak_act_mem", depth)


def test_int8_lowers_the_activation_peak_of_the_default_segments(resnet_run):
    # Balanced segments spend what a codec saves on more segments: the peak falls, the
    # kept bytes need not (measured at depth 11: 0.216 vs 0.236 MiB; kept 11 vs 1.5 KiB).
    *_, rows = resnet_run
    for depth in {r["x_value"] for r in rows if r["metric"] == "peak_act_mem"}:
        assert value(rows, "actsave_int8", "peak_act_mem", depth) < value(rows, "actsave_none", "peak_act_mem", depth)


def test_max_depth_rows_say_how_they_were_found(resnet_run):
    *_, rows = resnet_run
    found = [json.loads(r["config_json"]) for r in rows if r["metric"] == "max_depth"]
    assert found and all(c["method"] in ("meta_estimate", "meta_estimate_lower_bound") for c in found)
    assert all(c["estimator"] == "actsave.estimate" and c["reference_depth"] == 11 for c in found)


def test_meta_estimates_agree_with_measured_steps(resnet_run):
    # The bar for trusting the real-scale stage: within 2%.
    *_, rows = resnet_run
    pairs = [(value(rows, r["provider"], "peak_act_mem", r["x_value"]), float(r["p50"]))
             for r in rows if r["metric"] == "est_act_mem"]
    assert len(pairs) >= 2 * 7 and all(abs(estimated / measured - 1) <= 0.02 for measured, estimated in pairs)


def test_real_scale_stage_reports_device_and_host_per_provider(resnet_run):
    *_, rows = resnet_run
    scaled = [r for r in rows if r["metric"] in ("est_device_peak", "est_host_bytes")]
    assert {r["case"] for r in scaled} == {"cifar_resnet (pre-activation bottleneck) 2x3x8x8, meta tensors, cuda accounting"}
    assert "actsave_auto" not in {r["provider"] for r in scaled}  # it plans from a timed step
    for depth in ("11", "20"):
        assert value(rows, "actsave_none", "est_device_peak", depth) < value(rows, "torch", "est_device_peak", depth)
        assert value(rows, "actsave_int8_offload", "est_host_bytes", depth) > 0 == value(
            rows, "actsave_int8", "est_host_bytes", depth)


def test_the_picture_shows_how_much_deeper_in_the_same_memory(resnet_run, monkeypatch):
    harness = load_bench_module("harness")
    out, _, _, rows = resnet_run
    measurements, device = harness.results.read_measurements(out, "resnet_depth_sweep", {r["case"] for r in rows})
    figures = []
    monkeypatch.setattr(harness.report, "save_figure", lambda fig, path: figures.append(fig))
    providers = list(harness.PROVIDERS)
    max_depths = [m for m in measurements if m.metric == "max_depth"]
    note = harness.plot([m for m in measurements if m.metric != "max_depth"], providers, "smoke", out, max_depths,
                        budget_mib=2.0, device_type="cpu", depth_name="ResNet-{}")
    assert note is None and device
    (fig,) = figures
    try:
        titles = {axes.get_title() or axes.get_title(loc="left"): axes for axes in fig.axes}
        (bars,) = [axes for title, axes in titles.items() if title.startswith("How much deeper in the same memory")]
        assert [label.get_text() for label in bars.get_yticklabels()] == [harness.display_name(p) for p in providers]
        depth = {r["provider"]: int(float(r["p50"])) for r in rows if r["metric"] == "max_depth"}
        texts = " ".join(text.get_text() for text in bars.texts)
        assert f"ResNet-{depth['torch_ckpt']}   {depth['torch_ckpt'] / depth['torch']:.1f}x" in texts
        assert f"≥ ResNet-{depth['actsave_none']}" in texts  # the search stopped at its cap
        assert "plans from a timed step" in texts  # segments="auto" has no meta-tensor figures
        memory = titles["memory of a training step, measured"]
        assert [tuple(line.get_ydata()) for line in memory.lines if line.get_label().startswith("_")] == [(2.0, 2.0)]
        captions = " ".join(text.get_text() for text in memory.texts)
        assert "B = 2 MiB" in captions and "offload saves nothing here" in captions.replace("\n", " ")
        (fp8,) = [line for line in memory.lines if line.get_label() == 'compress="fp8"']
        (int8,) = [line for line in memory.lines if line.get_label() == 'compress="int8"']
        assert fp8.get_marker() != int8.get_marker()
        (legend,) = [axes.get_legend() for axes in fig.axes if axes.get_legend()]
        assert not legend.axes.axison  # beside the panels, in an axes of its own
        assert [text.get_text() for text in legend.get_texts()] == [harness.display_name(p) for p in providers]
    finally:
        harness.pyplot().close(fig)
