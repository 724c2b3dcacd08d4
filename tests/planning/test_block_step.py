"""The example step of a block plan (block_step.py): what it holds outside the blocks
(Outside), and the blocks as layers of a chain (BlockCall)."""
import pytest
import torch
from planning.test_other_outputs import ROWS, WIDE_BYTES, WIDTH, UNetLike, outside_of

import actsave
from actsave.planning.block_calls import record_calls
from actsave.planning.blocks import block_chain


def test_the_loss_leaves_leave_out_the_gradients_of_the_blocks_other_outputs():
    # The decoder's backward hands each skip a gradient as large as the skip, which the
    # plan counts in the skip's place until its block's backward (NOTE [ Outputs the
    # caller holds ]): the loss leaves the loss and its gradient alone.
    assert outside_of(UNetLike()).loss_leaves < WIDE_BYTES


def test_a_blocks_layer_gives_its_other_outputs_the_gradients_the_step_gives_them():
    model, x = UNetLike(), torch.randn(ROWS, WIDTH)
    blocks = [(f"blocks.{i}", block) for i, block in enumerate(model.blocks)]
    calls = record_calls(model, blocks, (x,))
    chain = block_chain(calls, outside_of(model))
    assert [layer.other_gradients for layer in chain] == [(0,)] * 3
    skip_gradients = []
    for block in model.blocks:
        block.register_forward_hook(lambda m, args, output: output[1].register_hook(skip_gradients.append) and None)
    chain(x).sum().backward()
    assert len(skip_gradients) == 3 and not any(g.any() for g in skip_gradients)
    assert [layer.other_gradients for layer in block_chain(calls)] == [()] * 3  # without the step's, none


class Doubles(torch.nn.Module):
    """Doubles its input in place, then a Linear: it says so (``inplace = True``)."""

    inplace = True

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        return self.linear(x.mul_(2))


class DoublingStack(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Linear(WIDTH, WIDTH)
        self.blocks = torch.nn.ModuleList(Doubles() for _ in range(3))

    def forward(self, x):
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return h.square().mean()


def test_the_first_blocks_hidden_state_is_recorded_as_it_was_before_the_block_changed_it():
    model, x = DoublingStack(), torch.randn(ROWS, WIDTH)
    calls = record_calls(model, [(f"blocks.{i}", block) for i, block in enumerate(model.blocks)], (x,))
    hidden = calls[0][2].hidden
    assert torch.equal(hidden, model.embed(x)) and not hidden.is_leaf and hidden.requires_grad
    with torch.no_grad():
        assert torch.equal(block_chain(calls)(hidden.clone()).square().mean(), model(x))


class ScalesItsInput(torch.nn.Module):
    """Scales its input, in place where it says so (``inplace = True``), then a Linear."""

    def __init__(self, in_place: bool):
        super().__init__()
        self.inplace = in_place
        self.linear = torch.nn.Linear(WIDTH, WIDTH)

    def forward(self, x, mask=None):
        return self.linear(x.mul_(1.5) if self.inplace else x * 1.5) * mask


class TakesTheHiddenState(torch.nn.Module):
    """Hands its input to the first block as it is (an ``inputs_embeds`` model)."""

    def __init__(self, in_place: bool):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.ModuleList(ScalesItsInput(in_place and i == 0) for i in range(3))

    def forward(self, h, mask, steps):
        for block in self.blocks:
            h = block(h, mask=mask)
        return h.square().mean() + steps.sum()


@pytest.mark.parametrize("made", [True, False])
def test_a_block_plan_leaves_the_callers_example_as_it_was(made):
    # A leaf that needs a gradient cannot be changed in place, so only one autograd made
    # goes to a first block that changes its input (NOTE [ Each step on its own input ]).
    source = torch.randn(ROWS, WIDTH, requires_grad=True)
    inputs = {"h": source * 1 if made else source, "mask": torch.ones(ROWS, 1), "steps": torch.arange(3)}
    before = {name: (t.detach().clone(), t._version) for name, t in inputs.items()}
    actsave.plan_blocks(TakesTheHiddenState(in_place=made), ScalesItsInput, 2**40, inputs)
    assert all(torch.equal(inputs[name], t) and inputs[name]._version == version
               for name, (t, version) in before.items())
    assert source.grad is None


def test_a_block_given_a_key_value_cache_is_refused_naming_use_cache():
    # Each block's options are measured by calling it again with its recorded
    # arguments: one cache would grow with each call and hold the last one's graph.
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = transformers.LlamaForCausalLM(config).train()
    ids = torch.randint(0, 64, (2, 16))
    with pytest.raises(actsave.ConfigError, match=r"key/value cache \(DynamicCache\).*use_cache = False"):
        actsave.plan_blocks(model, LlamaDecoderLayer, budget=2**30,
                            example_inputs={"input_ids": ids, "labels": ids, "use_cache": True})
    model.config.use_cache = False
    plan = actsave.plan_blocks(model, LlamaDecoderLayer, budget=2**30, example_inputs={"input_ids": ids, "labels": ids})
    assert len(plan.options) == 2
