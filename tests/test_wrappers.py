"""checkpoint(), Checkpoint and wrap(): semantics of non-reentrant torch checkpoint,
unchanged state_dict keys, in-place selection of submodules."""
import pytest
import torch
from support import ResidualBlock, ResidualNet, assert_same_training, mixed_chain, twin
from torch import nn

import actsave
from actsave import Checkpoint, CheckpointedSequential, ConfigError, checkpoint, wrap


# --- checkpoint(function, *args, **kwargs) ------------------------------------------

def test_functional_checkpoint_with_non_tensor_args_kwargs_and_mixed_outputs():
    fc = nn.Linear(4, 4)

    def fn(x, scale, *, shift, tag):
        y = fc(x) * scale + shift
        return y, None, tag, y.sum()

    x = torch.randn(3, 4, requires_grad=True)
    shift = torch.randn(4)  # a tensor that needs no grad
    y, none, tag, total = checkpoint(fn, x, 2.0, shift=shift, tag="t")
    assert none is None and tag == "t"
    (y.square().sum() + total).backward()
    grads = [x.grad.clone(), fc.weight.grad.clone()]
    x.grad, fc.weight.grad = None, None
    y, _, _, total = fn(x, 2.0, shift=shift, tag="t")
    (y.square().sum() + total).backward()
    assert torch.equal(grads[0], x.grad) and torch.equal(grads[1], fc.weight.grad)


def test_functional_checkpoint_reaches_parameters_a_closure_uses():
    fc = nn.Linear(4, 4)
    x = torch.randn(3, 4)  # no input needs grad: only the closed-over parameters do
    loss = checkpoint(lambda t: torch.tanh(fc(t)), x).sum()
    assert actsave.stored_bytes()["device"] == x.numel() * 4  # held by reference, counted
    grads = torch.autograd.grad(loss, list(fc.parameters()))
    assert actsave.stored_bytes()["device"] == 0
    expected = torch.autograd.grad(torch.tanh(fc(x)).sum(), list(fc.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(grads, expected))


def test_functional_checkpoint_keeps_nothing_when_nothing_needs_grad():
    out = checkpoint(torch.tanh, torch.randn(3, 4))
    assert not out.requires_grad
    assert actsave.stored_bytes() == {"device": 0, "host": 0}


def test_input_modified_in_place_after_forward_raises_at_backward():
    x = torch.randn(3, 4, requires_grad=True).tanh()
    out = checkpoint(torch.sin, x)
    x.mul_(2)
    with pytest.raises(actsave.RecomputeError, match="modified in place after the forward"):
        out.sum().backward()


def test_function_modifying_its_input_in_place_is_refused_in_forward():
    def add_one_(t):
        return t.add_(1).sin()

    with pytest.raises(actsave.RecomputeError, match="modified in place by .*add_one_ during its forward"):
        checkpoint(add_one_, torch.randn(3, 4, requires_grad=True).tanh())


def test_in_place_module_gets_a_private_copy():
    x = torch.randn(3, 4, requires_grad=True)
    out = checkpoint(nn.ReLU(inplace=True), x * 1)
    out.sum().backward()
    assert torch.equal(x.grad, (x > 0).float())


# --- Checkpoint(module) --------------------------------------------------------------

def test_checkpoint_module_trains_exactly_and_keeps_state_dict_keys():
    plain = ResidualNet()
    model = twin(plain)
    model.blocks[1] = Checkpoint(model.blocks[1])
    assert list(model.state_dict()) == list(plain.state_dict())
    assert_same_training(plain, model, torch.randn(5, 8))


def test_checkpoint_state_dict_loads_with_and_without_the_wrapper():
    block = ResidualBlock()
    wrapped = Checkpoint(twin(block))
    nn.init.zeros_(wrapped.fc.weight)
    block.load_state_dict(wrapped.state_dict())
    assert torch.equal(block.fc.weight, torch.zeros(8, 8))
    nn.init.ones_(block.fc.weight)
    wrapped.load_state_dict(block.state_dict())
    assert torch.equal(wrapped.module.fc.weight, torch.ones(8, 8))


def test_checkpoint_forwards_attribute_lookups_to_the_module():
    block = ResidualBlock()
    wrapped = Checkpoint(block)
    assert wrapped.fc is block.fc and wrapped.module is block
    with pytest.raises(AttributeError):
        wrapped.no_such_attribute


def test_checkpoint_rejects_what_is_not_a_module():
    with pytest.raises(ConfigError, match="Checkpoint wraps an nn.Module"):
        Checkpoint(torch.relu)


def test_checkpoint_inside_a_checkpointed_segment_is_exact():
    plain = mixed_chain()
    model = twin(plain)
    model[5] = Checkpoint(model[5])
    model[6] = Checkpoint(model[6])  # in-place ReLU inside an outer segment
    model = CheckpointedSequential.from_sequential(model, segments=2)
    assert_same_training(plain, model, torch.randn(8, 16))
    assert actsave.stored_bytes() == {"device": 0, "host": 0}


# --- wrap(model, filter_fn) ----------------------------------------------------------

@pytest.mark.parametrize("filter_fn", [
    ResidualBlock,
    (ResidualBlock, nn.GRU),
    lambda module, fqn: fqn.startswith("blocks."),
], ids=["class", "tuple", "callable"])
def test_wrap_replaces_matching_submodules_in_place(filter_fn):
    plain = ResidualNet()
    model = twin(plain)
    assert wrap(model, filter_fn) is model
    assert all(isinstance(b, Checkpoint) for b in model.blocks)
    assert not isinstance(model.head, Checkpoint)
    assert list(model.state_dict()) == list(plain.state_dict())
    assert_same_training(plain, model, torch.randn(5, 8))


def test_wrap_passes_fully_qualified_names_and_skips_wrapped_subtrees():
    seen = []
    model = ResidualNet()
    wrap(model, lambda module, fqn: seen.append(fqn) or fqn == "blocks.0")
    assert "blocks.0" in seen and "blocks.0.fc" not in seen and "blocks.1.fc" in seen
    seen.clear()
    wrap(model, lambda module, fqn: seen.append(fqn) or isinstance(module, nn.Linear))
    assert not any(name.startswith("blocks.0") for name in seen)
    assert isinstance(model.blocks[1].fc, Checkpoint) and not isinstance(model.blocks[0].module.fc, Checkpoint)


def test_wrap_never_wraps_the_root():
    block = ResidualBlock()
    assert wrap(block, ResidualBlock) is block and not isinstance(block, Checkpoint)


@pytest.mark.parametrize("filter_fn", ["ResidualBlock", (ResidualBlock, "x"), 3])
def test_wrap_rejects_a_bad_filter(filter_fn):
    with pytest.raises(ConfigError, match="filter_fn="):
        wrap(ResidualNet(), filter_fn)
