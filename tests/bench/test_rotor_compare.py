"""bench/rotor_compare.py at smoke scale."""
import json


from support import CSV_COLUMNS, read_rows, run_script


def test_rotor_compare_writes_every_solver_at_every_budget(tmp_path):
    out = tmp_path / "cpu.csv"
    stdout = run_script("rotor_compare.py", "--out", str(out))
    columns, rows = read_rows(out)
    assert columns == CSV_COLUMNS and {r["bench"] for r in rows} == {"rotor_compare"}
    assert "at every budget of the sweep" in stdout and "random chains per family" in stdout
    times = {(r["provider"], r["x_value"]): float(r["p50"]) for r in rows if r["metric"] == "pred_step_time"}
    budgets = {budget for _, budget in times}
    assert len(budgets) == 6 and len(times) == 5 * 6
    for budget in budgets:
        def time(provider):
            return times[provider, budget]
        # Orderings that hold by construction: auto's levers include recompute; rotor's
        # rounded-down sizes relax its rounded-up ones; its plans include the single-level ones.
        assert time("actsave_auto") <= time("actsave_recompute")
        assert time("rotor_lower_bound") <= time("rotor") <= time("rotor_single_level")
    peaks = [(float(r["x_value"]), float(r["p50"])) for r in rows if r["metric"] == "pred_peak"]
    assert peaks and all(peak <= budget for budget, peak in peaks)
    # Every plan is applied and measured: within 3% of its prediction, never above.
    predicted, measured = ({(r["provider"], r["x_value"]): float(r["p50"]) for r in rows if r["metric"] == metric}
                           for metric in ("pred_peak", "measured_peak"))
    assert measured.keys() == predicted.keys()
    assert all(0.97 <= measured[key] / predicted[key] <= 1.0 for key in measured), (measured, predicted)
    # Levels of recompute, counted alike for actsave's plans and rotor's: none at the
    # plain budget, at least one wherever a plan fits below it.
    nesting = {(r["provider"], r["x_value"]): json.loads(r["config_json"])["nesting"] for r in rows
               if r["metric"] == "pred_step_time" and r["provider"] in ("actsave_auto", "actsave_recompute", "rotor")}
    for (_, budget), levels in nesting.items():
        if levels is not None:  # None: no plan fits
            assert (levels == 0) == (budget == max(budgets)), nesting
    (depth,) = [r for r in rows if r["metric"] == "max_depth"]
    search = json.loads(depth["config_json"])
    assert search["measured_peak_MiB"] <= 2.0 and search["does_not_fit"] > float(depth["p50"])
    # The codecs keeping plain segments' saves, a column of every actsave_auto row: lossy
    # codecs only, the last segment's among them (at smoke scale on a CPU, where the
    # codecs run their torch references, no plan keeps saves by one: the lists are empty).
    auto = [json.loads(r["config_json"]) for r in rows if r["metric"] == "pred_step_time"
            and r["provider"] == "actsave_auto"]
    assert auto and all(("plain_saves_codecs" in config) for config in auto)
    for config in auto:
        saved_by, last = config["plain_saves_codecs"], config["stored_codec"]
        if saved_by is None:  # no plan fits
            continue
        assert set(saved_by) <= {"int8", "fp8_e4m3", "fp8_e5m2"} and saved_by == sorted(saved_by), config
        assert last in (None, "none") or last in saved_by, config
