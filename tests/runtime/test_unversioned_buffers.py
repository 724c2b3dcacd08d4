"""Buffers a kernel updates without moving a version (runtime/unversioned_buffers.py,
NOTE [ Buffers a kernel updates unversioned ]): torch.ao's fused fake quantization, what
``prepare_qat`` inserts for the default QAT qconfigs, updated once and read by the
recompute as the forward read them (torch.utils.checkpoint updates them twice)."""
import pytest
import torch
import torch.ao.quantization as tq
from torch import nn

import actsave
from actsave.runtime.unversioned_buffers import unversioned_updates


def _model():
    torch.manual_seed(0)
    qconfig = tq.get_default_qat_qconfig("x86")
    return nn.Sequential(nn.Linear(8, 16), qconfig.activation(), nn.Tanh(), nn.Linear(16, 4), qconfig.activation())


def _train(model, call, steps: int = 3) -> tuple:
    """``(gradients of each step, the state dict after them)``; the inputs grow from step
    to step, so that the observers' running min and max move after the first."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    grads = []
    for step in range(steps):
        x = torch.randn(32, 8, generator=torch.Generator().manual_seed(step)) * (1 + step)
        optimizer.zero_grad()
        call(model, x).pow(2).mean().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        optimizer.step()
    return grads, list(model.state_dict().values())


CALLS = {
    "chain": lambda model: (actsave.CheckpointedSequential(*model, segments=[0, 2]), lambda m, x: m(x)),
    "Checkpoint": lambda model: (actsave.Checkpoint(model), lambda m, x: m(x)),
    "checkpoint(function)": lambda model: (model, lambda m, x: actsave.checkpoint(lambda y: m(y), x)),
}


def test_the_fused_fake_quantize_names_the_observer_whose_buffers_it_updates():
    fused = _model()[1]
    assert unversioned_updates(fused) == (fused, fused.activation_post_process)
    versions = [b._version for b in fused.buffers()]
    fused(torch.randn(4, 16))
    assert [b._version for b in fused.buffers()] == versions  # the kernel moves none
    assert unversioned_updates(nn.BatchNorm1d(4)) == ()


@pytest.mark.parametrize("how", list(CALLS))
def test_default_qat_observers_are_updated_once_and_read_as_the_forward_read_them(how):
    plain_grads, plain_state = _train(_model(), lambda m, x: m(x))
    model, call = CALLS[how](_model())
    grads, state = _train(model, call)
    assert all(torch.equal(a, b) for step, other in zip(plain_grads, grads) for a, b in zip(step, other))
    assert len(state) == len(plain_state) and all(torch.equal(a, b) for a, b in zip(plain_state, state))
