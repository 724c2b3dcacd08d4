"""A chain segment whose first layer turns out to return its input to in-place layers:
its input is left as it is, forward and recompute (NOTE [ A layer that turns out to
pass its input on ])."""
import pytest
import torch
from torch import nn

from actsave.codecs import sqnr_db
from actsave.runtime.function import checkpointed_call
from actsave.runtime.keep_rules import EXACT, KeepPolicy
from actsave.runtime.layers import LayerRun
from actsave.runtime.passed_inputs import returns_its_input


class _Tap(nn.Module):
    """Notes a statistic and returns its input, as it is or as a view of it."""

    def __init__(self, as_view: bool = False):
        super().__init__()
        self.as_view = as_view

    def forward(self, x):
        self.mean = x.detach().mean()
        return x.view(x.shape) if self.as_view else x


def test_a_layer_returns_its_input_as_it_is_or_as_a_view_of_it_or_of_its_base():
    base = torch.randn(4, 6)
    x = base[:, :3]
    assert returns_its_input(x, x) and returns_its_input(x.t(), x) and returns_its_input(base.t(), x)
    assert not returns_its_input(x.clone(), x) and not returns_its_input((x,), x)
    assert returns_its_input(base.view(24), base) and not returns_its_input(torch.relu(base), base)


@pytest.mark.parametrize("as_view", [False, True])
@pytest.mark.parametrize("compress", [None, "int8"])
def test_the_in_place_layers_after_a_tap_change_a_copy_and_train_as_plain(as_view, compress):
    torch.manual_seed(0)
    layers = [_Tap(as_view), nn.ReLU(inplace=True), nn.Linear(8, 8)]
    x = torch.randn(4, 8, requires_grad=True)
    expected = LayerRun(layers)(x * 1)
    expected.sum().backward()
    grads, x.grad = [p.grad.clone() for p in layers[2].parameters()] + [x.grad], None
    layers[2].zero_grad()
    h = x * 1  # an activation, as a chain segment's input
    values = h.detach().clone()
    out, _ = checkpointed_call(LayerRun(layers), (h,), {}, KeepPolicy.resolve(compress))
    assert torch.equal(h, values)  # the ReLU changed a copy
    assert torch.equal(out, expected)
    out.sum().backward()  # the recompute's ReLU changes a copy of its restored leaf
    got = [*(p.grad for p in layers[2].parameters()), x.grad]
    if compress is None:
        assert all(torch.equal(a, b) for a, b in zip(grads, got))
    else:
        assert min(sqnr_db(a, b) for a, b in zip(grads, got)) > 33


def test_a_declared_private_copy_leaves_the_layers_to_change_the_input_itself():
    layers = [nn.Identity(), nn.ReLU(inplace=True)]
    h = torch.randn(4, 8, requires_grad=True) * 1
    out, _ = checkpointed_call(LayerRun(layers), (h,), {}, EXACT, private_copy=True)
    assert out is h
    out.sum().backward()
