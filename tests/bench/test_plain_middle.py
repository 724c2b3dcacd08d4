"""bench/plain_middle.py at smoke scale."""
import re


from support import run_script


def test_plain_middle_compares_the_plans_with_and_without_them():
    lines = run_script("plain_middle.py").splitlines()
    assert [line.split()[3] for line in lines] == ["recompute", "recompute+int8+fp8"]
    for line in lines:
        smallest = re.search(r"with / without +([\d.]+) / +([\d.]+) MiB", line)
        # Allowing plain middle segments can only widen the search.
        assert smallest and float(smallest.group(1)) <= float(smallest.group(2)), line
        win = re.search(r"largest time win ([+-][\d.]+)%", line)
        assert win and float(win.group(1)) >= 0, line
    assert re.search(r"middle saves by a codec at \d+ of 3 budgets$", lines[1]), lines[1]
