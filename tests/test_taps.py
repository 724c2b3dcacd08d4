"""The functions actsave taps while it runs (actsave/_taps.py, FunctionTap)."""
import inspect

import torch
import torch.nn.functional as F

from actsave._taps import CLAMPS, FunctionTap


def test_a_tapped_function_reads_as_the_original():
    original = F.relu6
    with CLAMPS["relu6"].handled(lambda call_next, *args, **kwargs: call_next(*args, **kwargs)):
        tapped = F.relu6
        assert tapped is not original
        assert (tapped.__name__, tapped.__doc__) == (original.__name__, original.__doc__)
        assert inspect.signature(tapped) == inspect.signature(original)
    assert F.relu6 is original


def test_handlers_run_innermost_first_down_to_the_original():
    class Owner:
        @staticmethod
        def scale(x, by=2):
            return x * by

    tap, seen = FunctionTap(Owner, "scale"), []

    def handler(name):
        def run(call_next, *args, **kwargs):
            seen.append(name)
            return call_next(*args, **kwargs)
        return run

    with tap.handled(handler("outer")), tap.handled(handler("inner")):
        assert Owner.scale(torch.tensor(3.0), by=4) == 12
    assert seen == ["inner", "outer"]
    assert Owner.scale(1) == 2 and seen == ["inner", "outer"]
