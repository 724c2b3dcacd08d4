"""bench/compile_memory.py at smoke scale."""
import math
import re

import pytest

from support import load_bench_module, run_script


def compile_memory_tables(stdout: str) -> dict:
    """compile_memory.py's output as {case name: {mode: its cells}}."""
    sections = re.split(r"^\n?(.+), aot_eager, cpu:$", stdout, flags=re.MULTILINE)
    return {name: {cells[0]: cells for cells in (re.split(r"\s{2,}", line) for line in text.splitlines())
                   if cells[0] and cells[0] != "mode" and len(cells) == 8}
            for name, text in zip(sections[1::2], sections[2::2])}


def test_compile_memory_measures_eager_and_compiled_modes():
    # One case, the GPT: what the script reports per mode. What a compiled ResNet (its
    # ReLU decisions run eagerly) and a compiled Hugging Face Llama keep is held by
    # tests/compile/, without the cost of a process of its own per case here.
    stdout = run_script("compile_memory.py", "--models", "gpt")
    tables = compile_memory_tables(stdout)
    assert list(tables) == ["gpt4 w64 b8 t64"], stdout
    gpt = tables["gpt4 w64 b8 t64"]
    modes = ("plain", "actsave", "actsave int8", "wrap int8")
    assert set(gpt) == {*modes, *(f"{mode}, {run}" for mode in modes for run in ("compiled", "again"))}
    for mode in modes:  # the eager code timed twice, as the ratios' noise floor
        assert gpt[f"{mode}, again"][1:4] == gpt[mode][1:4] and gpt[f"{mode}, again"][-2:] == ["0", "0"]
    kept = {mode: float(cells[1]) for mode, cells in gpt.items()}
    sqnr = {mode: float(cells[3]) for mode, cells in gpt.items()}
    assert kept["actsave, compiled"] < kept["plain, compiled"] / 2  # the compiled backward recomputes
    assert gpt["actsave, compiled"][-2:] == ["1", "1"]  # one graph, one break (the segment lookup)
    assert sqnr["plain"] == math.inf and sqnr["actsave int8"] < 60
    assert stdout.count("predicted activation peak") == 1  # the Sequential's balanced plan
    # The GPT makes no ReLU decisions: one graph at one break, kept by int8 in it.
    assert gpt["actsave int8, compiled"][-2:] == ["1", "1"]
    assert float(gpt["actsave int8, compiled"][1]) <= 1.05 * float(gpt["actsave int8"][1])
    assert abs(float(gpt["actsave int8, compiled"][3]) - float(gpt["actsave int8"][3])) <= 1.0
    assert gpt["wrap int8, compiled"][-2:] == ["1", "1"]  # one graph at the root's one break
    assert float(gpt["wrap int8, compiled"][1]) <= 1.05 * float(gpt["wrap int8"][1])


def test_compile_memory_runs_the_cases_its_models_name_in_their_order():
    chosen = load_bench_module("compile_memory").chosen
    found = {"resnet20 b2": 1, "gpt4 w64": 2, "llama2 w64 (Hugging Face)": 3}
    assert list(chosen(found, ["llama", "resnet"])) == ["llama2 w64 (Hugging Face)", "resnet20 b2"]
    assert chosen(found, None) == found
    with pytest.raises(SystemExit, match="no case starts with 'bert'"):
        chosen(found, ["bert"])
