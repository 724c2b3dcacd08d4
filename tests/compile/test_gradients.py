"""A compiled model over actsave, and blocks compiled then checkpointed: gradients equal eager ones."""
import copy
import warnings

import pytest
import torch
from torch import nn

import actsave
from support import ResidualBlock, ResidualNet
from compile.steps import BACKEND, COMPRESS, assert_same_gradients, chain, grads_of_a_step


@pytest.mark.parametrize("compress", COMPRESS)
def test_compiled_checkpointed_sequential_has_eager_gradients(compress):
    x = torch.randn(4, 8)
    expected = grads_of_a_step(nn.Sequential(*chain()), x)
    model = actsave.CheckpointedSequential(*chain(), segments=2, compress=compress)
    assert_same_gradients(expected, grads_of_a_step(torch.compile(model, backend=BACKEND), x), compress)


@pytest.mark.parametrize("compress", COMPRESS)
def test_compiled_model_with_wrapped_blocks_has_eager_gradients(compress):
    plain, x = ResidualNet(), torch.randn(4, 8)
    model = actsave.wrap(copy.deepcopy(plain), ResidualBlock, compress=compress)
    compiled = torch.compile(model, backend=BACKEND)
    assert_same_gradients(grads_of_a_step(plain, x), grads_of_a_step(compiled, x), compress)


@pytest.mark.parametrize("compress", COMPRESS)
def test_blocks_compiled_then_wrapped_have_eager_gradients(compress):
    plain, x = ResidualNet(), torch.randn(4, 8)
    model = copy.deepcopy(plain)
    for block in model.blocks:
        block.compile(backend=BACKEND)
    actsave.wrap(model, ResidualBlock, compress=compress)
    assert all(isinstance(block, actsave.Checkpoint) for block in model.blocks)
    assert_same_gradients(grads_of_a_step(plain, x), grads_of_a_step(model, x), compress)


def test_inductor_compiled_block_then_wrapped_has_eager_gradients():
    # fallback_random: Inductor's own RNG would draw other Dropout masks than eager.
    plain, x = ResidualNet(depth=1), torch.randn(4, 8)
    model = copy.deepcopy(plain)
    model.blocks[0].compile(backend="inductor")
    actsave.wrap(model, ResidualBlock)
    with torch._inductor.config.patch(fallback_random=True):
        got = grads_of_a_step(model, x)
    assert_same_gradients(grads_of_a_step(plain, x), got, None)


def test_a_checkpoints_backward_under_compiled_autograd_traces_whole_and_has_eager_gradients():
    # Whether the backward keeps its graph is a builtin Dynamo cannot trace: asked in
    # compiled autograd's trace, it broke the graph and warned, in every recompute.
    compiled_autograd = pytest.importorskip("torch._dynamo.compiled_autograd")
    torch.manual_seed(0)
    block, x = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8)), torch.randn(4, 8)
    block(x).square().sum().backward()
    expected = [p.grad.clone() for p in block.parameters()]
    block.zero_grad(set_to_none=True)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="Dynamo does not know how to trace")
        with compiled_autograd._enable(torch.compile(backend=BACKEND)):
            actsave.checkpoint(block, x).square().sum().backward()
    assert all(torch.equal(p.grad, e) for p, e in zip(block.parameters(), expected))
