"""The checkpoint frame: what is kept, when it is released, failure paths."""
import pytest
import torch
from torch import nn

import actsave
from actsave.function import checkpointed_call
from actsave.store import EXACT


def chain():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))


def test_returns_output_and_kept_bytes():
    x = torch.randn(3, 4, requires_grad=True)
    out, kept = checkpointed_call(chain(), (x,), {}, EXACT)
    assert kept == x.numel() * 4 == actsave.stored_bytes()["device"]
    out.sum().backward()
    assert actsave.stored_bytes()["device"] == 0


def test_no_grad_runs_plainly():
    with torch.no_grad():
        out, kept = checkpointed_call(chain(), (torch.randn(3, 4),), {}, EXACT)
    assert kept == 0 and not out.requires_grad


def test_failed_recompute_releases_what_it_kept():
    calls = []

    def flaky(x):
        calls.append(1)
        if len(calls) == 2:
            raise ValueError("boom in recompute")
        return torch.tanh(x)

    out, _ = checkpointed_call(flaky, (torch.randn(3, 4, requires_grad=True),), {}, EXACT)
    with pytest.raises(ValueError, match="boom in recompute"):
        out.sum().backward()
    assert actsave.stored_bytes() == {"device": 0, "host": 0}


def test_exception_in_forward_leaves_nothing_kept():
    def broken(x):
        torch.tanh(x)
        raise ValueError("boom in forward")

    with pytest.raises(ValueError, match="boom in forward"):
        checkpointed_call(broken, (torch.randn(3, 4, requires_grad=True),), {}, EXACT)
    assert actsave.stored_bytes() == {"device": 0, "host": 0}


def test_partial_backward_then_full_backward_with_retained_graph():
    model = chain()
    x = torch.randn(3, 4, requires_grad=True)
    hidden = torch.sin(x)
    out, _ = checkpointed_call(model, (hidden,), {}, EXACT)
    loss = out.square().sum()
    (g_hidden,) = torch.autograd.grad(loss, [hidden], retain_graph=True)
    loss.backward()
    expected_hidden = torch.autograd.grad(model(hidden).square().sum(), [hidden])[0]
    assert torch.equal(g_hidden, expected_hidden)
    assert torch.equal(x.grad, expected_hidden * torch.cos(x))


def test_recompute_runs_once_even_for_several_backwards():
    calls = []

    def counted(x):
        calls.append(1)
        return torch.tanh(torch.tanh(x))

    out, _ = checkpointed_call(counted, (torch.randn(3, 4, requires_grad=True),), {}, EXACT)
    loss = out.sum()
    loss.backward(retain_graph=True)
    loss.backward()
    assert len(calls) == 2  # forward, one recompute
