"""A compiled model over actsave, and blocks compiled then checkpointed: gradients equal eager ones."""
import copy

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
