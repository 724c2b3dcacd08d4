"""bench/planning_time.py at smoke scale, in this process (it sets no global state)."""
import re

from support import load_bench_module


def test_planning_time_plans_each_share_with_each_lever_set(capsys):
    load_bench_module("planning_time").main(["--smoke"])
    lines = capsys.readouterr().out.splitlines()
    assert [re.match(r"planning 130 layers, allow=(\(.*?\)):", line).group(1) for line in lines] == [
        "('recompute', 'offload')", "('recompute', 'int8')"]
    for line in lines:
        segments = [int(n) for n in re.findall(r"of the no-checkpoint peak: [\d.]+ s, (\d+) segments", line)]
        assert segments[0] == 1 and segments[1] > 1, line  # plain's peak needs no cut; 30% of it does
        assert re.search(r"; smallest peak: [\d.]+ s$", line), line
