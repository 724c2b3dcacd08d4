"""Buffers a call swaps in for the forward, ``torch.func.functional_call`` inside a
checkpointed function (runtime/swapped_buffers.py, NOTE [ Buffers swapped in for a
call ]): updated once, by the forward, and read by the recompute as the forward read
them, as in a plain step (torch.utils.checkpoint updates them twice)."""
import torch
from torch import nn
from torch.func import functional_call

import actsave


class Center(nn.Module):
    """Subtracts a running mean, then updates it: a buffer read, then changed."""

    def __init__(self, width: int = 8):
        super().__init__()
        self.register_buffer("ema", torch.zeros(width))

    def forward(self, x):
        y = x - self.ema
        with torch.no_grad():
            self.ema.mul_(0.9).add_(0.1 * x.mean(0))
        return y


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Tanh(), Center(), nn.Linear(8, 8), nn.Tanh(),
                         nn.Linear(8, 1))


def _steps(run, steps: int = 2) -> tuple:
    """Two steps of ``run(function, x)`` over ``functional_call`` with the parameters
    and buffers passed in: ``(parameter gradients, input gradients, the buffers passed,
    the module's own buffers)`` after them."""
    model = _model()
    params = {k: v.detach().clone().requires_grad_() for k, v in model.named_parameters()}
    buffers = {k: v.detach().clone() for k, v in model.named_buffers()}

    def function(x):
        return functional_call(model, (params, buffers), (x,))

    input_grads = []
    for step in range(steps):
        torch.manual_seed(step + 1)
        x = torch.randn(6, 8, requires_grad=True)
        run(function, x).pow(2).sum().backward()
        input_grads.append(x.grad)
    return ({k: p.grad for k, p in params.items()}, input_grads, buffers, dict(model.named_buffers()))


def test_buffers_passed_to_functional_call_are_updated_once_and_read_as_the_forward_read_them():
    plain = _steps(lambda function, x: function(x))
    checkpointed = _steps(lambda function, x: actsave.checkpoint(function, x))
    for expected, got in zip(plain, checkpointed):
        if isinstance(expected, dict):
            assert expected.keys() == got.keys()
            expected, got = list(expected.values()), list(got.values())
        for a, b in zip(expected, got):
            assert torch.equal(a, b)
    assert checkpointed[2]["1.num_batches_tracked"].item() == 2  # one update a step
    assert checkpointed[3]["1.num_batches_tracked"].item() == 0  # the model's own: not run


def test_a_forward_that_swaps_nothing_watches_no_module_call_in_its_recompute(monkeypatch):
    from actsave.runtime import swapped_buffers

    installed = []
    real = swapped_buffers._installing
    monkeypatch.setattr(swapped_buffers, "_installing", lambda *a: installed.append(a) or real(*a))
    model = _model()
    x = torch.randn(6, 8, requires_grad=True)
    actsave.checkpoint(model, x).sum().backward()
    assert installed == []
    _steps(lambda function, x: actsave.checkpoint(function, x), steps=1)
    assert len(installed) == 1
