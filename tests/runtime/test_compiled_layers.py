"""Which code a checkpointed call runs its compiled layers by (runtime/compiled_layers.py,
NOTE [ Decisions in compiled layers ]); the gradients this buys are in
tests/compile/."""
import contextlib
import warnings

import pytest
import torch
from torch import nn

from actsave._torch_graphs import is_compiled
from actsave.runtime import compiled_layers
from actsave.runtime.compiled_layers import LayerCode
from actsave.runtime.layers import modules_under


@pytest.fixture(autouse=True)
def fresh_records(monkeypatch):
    monkeypatch.setattr(compiled_layers, "_KEEPS_DECISIONS", {})
    monkeypatch.setattr(compiled_layers, "_warned", False)


def code_for(layers: tuple, lossy: bool) -> LayerCode:
    return LayerCode(None, layers, modules_under(layers), lossy)


def test_compiled_modules_and_functions_are_told_from_eager_ones():
    in_place = nn.Linear(2, 2)
    in_place.compile()
    assert is_compiled(torch.compile(nn.Linear(2, 2))) and is_compiled(in_place)
    assert is_compiled(torch.compile(torch.relu))
    assert not is_compiled(nn.Linear(2, 2)) and not is_compiled(torch.relu)


def test_exact_calls_and_calls_without_compiled_layers_run_the_code_they_have():
    compiled = (torch.compile(nn.Linear(2, 2)),)
    assert not code_for(compiled, lossy=False).eager
    assert not code_for((nn.Linear(2, 2),), lossy=True).eager
    assert not LayerCode(torch.relu, None, None, lossy=True).eager  # an eager function of unknown modules
    assert LayerCode(torch.compile(torch.relu), None, None, lossy=True).eager  # a compiled one: found out


@pytest.mark.parametrize("kept_decisions", [True, False])
def test_the_first_lossy_call_runs_eager_code_and_later_ones_follow_what_it_found(kept_decisions):
    layers = (torch.compile(nn.Linear(2, 2)), nn.ReLU())
    first = code_for(layers, lossy=True)
    assert first.eager
    with pytest.warns(UserWarning, match="Decisions in compiled layers") if kept_decisions else _no_warning():
        first.forward_ended(kept_decisions)
    assert code_for(layers, lossy=True).eager is kept_decisions
    assert code_for(layers[:1], lossy=True).eager  # other layers: a first call of their own
    later = code_for(layers, lossy=True)
    later.forward_ended(not kept_decisions)  # only the first call records
    assert code_for(layers, lossy=True).eager is kept_decisions


@contextlib.contextmanager
def _no_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        yield


def test_the_records_of_collected_layers_are_dropped(monkeypatch):
    monkeypatch.setattr(compiled_layers, "_PRUNE_AT", 2)
    for _ in range(3):
        code = code_for((torch.compile(nn.Linear(2, 2)),), lossy=True)
        code.forward_ended(False)
        del code
    assert len(compiled_layers._KEEPS_DECISIONS) <= 2


def test_a_forward_that_raised_records_nothing():
    import actsave

    class Failing(nn.Module):
        def forward(self, x):
            raise RuntimeError("data-dependent failure")

    block = torch.compile(Failing(), backend="aot_eager")
    with pytest.raises(RuntimeError, match="data-dependent failure"):
        actsave.checkpoint(block, torch.randn(2, 2, requires_grad=True) * 1.0, compress="int8")
    assert compiled_layers._KEEPS_DECISIONS == {}
