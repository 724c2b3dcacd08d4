"""bench/transformer_depth_sweep.py at smoke scale."""


from support import CSV_COLUMNS, read_rows, run_script, value


def test_transformer_sweep_writes_the_csv_schema(tmp_path):
    out = tmp_path / "cpu.csv"
    run_script("transformer_depth_sweep.py", "--device", "cpu", "--out", str(out), "--providers", "torch,actsave_none")
    columns, rows = read_rows(out)
    assert columns == CSV_COLUMNS
    assert {r["provider"] for r in rows} == {"torch", "actsave_none"}
    for depth in {r["x_value"] for r in rows if r["metric"] == "peak_act_mem"}:
        assert value(rows, "actsave_none", "peak_act_mem", depth) <= value(rows, "torch", "peak_act_mem", depth)
