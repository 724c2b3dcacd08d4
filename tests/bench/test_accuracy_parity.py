"""bench/accuracy_parity.py at smoke scale."""


from support import CSV_COLUMNS, read_rows, run_script


def test_accuracy_parity_reports_every_available_mode(tmp_path):
    png = tmp_path / "parity.png"
    stdout = run_script("accuracy_parity.py", "--out", str(png))
    assert "largest mean gap to torch" in stdout
    assert png.stat().st_size > 0
    columns, rows = read_rows(tmp_path / "cpu.csv")  # the CSV goes next to the PNG
    assert columns == CSV_COLUMNS and {r["bench"] for r in rows} == {"accuracy_parity"}
    keys = {(r["provider"], r["metric"], r["x_value"]) for r in rows}
    assert keys == {(p, m, b) for p in ("torch", "actsave_int8", "actsave_fp8")
                    for m in ("test_accuracy", "accuracy_gap") for b in ("8", "32")}
    for r in rows:
        assert r["n_reps"] == "2"  # one value per seed
        if r["provider"] == "torch" and r["metric"] == "accuracy_gap":
            assert float(r["p20"]) == float(r["p80"]) == 0.0
        if r["metric"] == "test_accuracy":
            assert 0.0 <= float(r["p20"]) <= float(r["p80"]) <= 100.0
