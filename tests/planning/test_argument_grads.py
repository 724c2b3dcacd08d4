"""The gradients of blocks' other arguments in a block plan (argument_grads.py, NOTE [
Gradients of the blocks' arguments ])."""
import copy

import pytest
import torch
import torch.nn.functional as F
from planning.test_blocks import step_peak_bytes
from support import peak_activation_bytes
from torch import nn

import actsave
from actsave.planning.argument_grads import argument_gradients
from actsave.planning.block_calls import record_calls

WIDTH = 32


class CrossAttention(nn.Module):
    """A decoder block's cross-attention over the encoder's output (``memory``)."""

    def __init__(self):
        super().__init__()
        self.q, self.kv, self.out = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, 2 * WIDTH), nn.Linear(WIDTH, WIDTH)

    def forward(self, x, memory):
        k, v = self.kv(memory).chunk(2, dim=-1)
        return x + self.out(F.gelu(F.scaled_dot_product_attention(self.q(x), k, v)))


class EncoderDecoder(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.encoder, self.embed = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH)
        self.blocks = nn.ModuleList(CrossAttention() for _ in range(4))

    def forward(self, x):
        memory, h = self.encoder(x), self.embed(x)
        for block in self.blocks:
            h = block(h, memory=memory)  # by keyword: MemTracker holds positional arguments' gradients
        return h.square().mean()


def example() -> torch.Tensor:
    return torch.randn(4, 24, WIDTH, generator=torch.Generator().manual_seed(0))


def test_the_encoders_output_gradient_is_pending_through_every_decoder_blocks_backward():
    model, x = EncoderDecoder(), example()
    calls = record_calls(model, [(f"blocks.{i}", b) for i, b in enumerate(model.blocks)], (x,), None)
    assert argument_gradients(calls, torch.device("cpu")) == (4 * 24 * WIDTH * 4,) * 4


def test_plans_of_a_decoder_stack_measure_at_most_their_prediction():
    plain, x = EncoderDecoder(), example()
    smallest = actsave.plan_blocks(copy.deepcopy(plain), CrossAttention, 2**40, (x,)).smallest_peak_bytes
    for budget in (smallest, (smallest + peak_activation_bytes(copy.deepcopy(plain), x, loss=lambda out: out)) // 2):
        model = copy.deepcopy(plain)
        plan = actsave.plan_blocks(model, CrossAttention, budget, (x,))
        actsave.wrap(model, plan)
        assert peak_activation_bytes(model, x, loss=lambda out: out) <= plan.predicted_peak_bytes <= budget


def test_a_t5_decoder_planned_at_its_smallest_budget_measures_at_most_it():
    # T5's decoder blocks take the encoder's output and the position bias its first block
    # makes; without their pending gradients its smallest plan peaked 12 KiB over.
    transformers = pytest.importorskip("transformers")
    from transformers.models.t5.modeling_t5 import T5Block
    config = transformers.T5Config(d_model=64, d_kv=16, d_ff=128, num_layers=2, num_decoder_layers=4, num_heads=4,
                                   vocab_size=128, dropout_rate=0.0, use_cache=False, relative_attention_num_buckets=8,
                                   decoder_start_token_id=0, pad_token_id=0)
    torch.manual_seed(0)
    plain = transformers.T5ForConditionalGeneration(config).train()
    ids = torch.randint(1, 128, (2, 24), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids[:, :16].clone()}

    def decoder(module, name):
        return isinstance(module, T5Block) and name.startswith("decoder.")
    smallest = actsave.plan_blocks(copy.deepcopy(plain), decoder, 2**40, batch).smallest_peak_bytes
    model = copy.deepcopy(plain)
    plan = actsave.plan_blocks(model, decoder, smallest, batch)
    actsave.wrap(model, plan)
    assert step_peak_bytes(model, batch) <= plan.predicted_peak_bytes <= smallest


class ScaledBy(nn.Module):
    """A block that multiplies its projection by a table the model learns, made once
    before the blocks and passed to each: the product saves the projection only
    because the table needs a gradient."""

    def __init__(self):
        super().__init__()
        self.q, self.out = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH)

    def forward(self, x, table):
        return x + self.out(torch.tanh(self.q(x) * table))


class ScaledStack(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.table = nn.Parameter(torch.randn(24, WIDTH))
        self.blocks = nn.ModuleList(ScaledBy() for _ in range(4))

    def forward(self, x):
        table = self.table.cos()
        for block in self.blocks:
            x = block(x, table=table)
        return x.square().mean()


def test_plans_count_what_an_arguments_gradient_makes_the_blocks_save():
    plain, x = ScaledStack(), example()
    plain_peak = peak_activation_bytes(copy.deepcopy(plain), x, loss=lambda out: out)
    for fraction in (0.7, 0.9):
        model = copy.deepcopy(plain)
        plan = actsave.plan_blocks(model, ScaledBy, int(fraction * plain_peak), (x,))
        actsave.wrap(model, plan)
        measured = peak_activation_bytes(model, x, loss=lambda out: out)
        assert measured <= plan.predicted_peak_bytes <= int(fraction * plain_peak)


class _TokenBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear, self.embedding = nn.Linear(8, 8), nn.Embedding(7, 8)

    def forward(self, h, memory=None, ids=None):
        return torch.relu(self.linear(h + memory)) + self.embedding(ids)


class _TokenNet(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.encoder, self.blocks = nn.Linear(8, 8), nn.ModuleList(_TokenBlock() for _ in range(3))

    def forward(self, x, ids):
        memory = self.encoder(x)  # needs a gradient, read by every block
        for block in self.blocks:
            x = block(x, memory=memory, ids=ids)
        return x.square().mean()


def test_blocks_given_an_argument_that_needs_a_gradient_and_an_integer_one_are_planned():
    # Held as the blocks' buffers while planning: their copies were one foreach call,
    # which autograd refuses for integer tensors beside ones that require grad.
    batch = {"x": torch.randn(4, 5, 8), "ids": torch.randint(0, 7, (4, 5))}
    plain, planned = _TokenNet(), _TokenNet()
    plain(**batch).backward()
    actsave.wrap(planned, _TokenBlock, budget=2**40, example_inputs=batch)
    planned(**batch).backward()
    for a, b in zip(plain.parameters(), planned.parameters()):
        assert torch.equal(a.grad, b.grad)


class Down(nn.Module):
    def __init__(self, width, attention=False):
        super().__init__()
        self.conv, self.down = nn.Conv2d(width, width, 3, padding=1), nn.Conv2d(width, width, 3, stride=2, padding=1)
        self.attention = attention

    def forward(self, x):
        h = torch.tanh(self.conv(x))
        if self.attention:  # over positions: a large temporary in the backward
            tokens = h.flatten(2).transpose(1, 2)
            h = h + F.scaled_dot_product_attention(tokens, tokens, tokens).transpose(1, 2).reshape(h.shape)
        return self.down(h), h  # the skip


class Up(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.conv = nn.Conv2d(2 * width, width, 3, padding=1)

    def forward(self, x, skip):
        return torch.tanh(self.conv(torch.cat([F.interpolate(x, scale_factor=2.0), skip], 1)))


class UNet(nn.Module):
    def __init__(self, width=8):
        super().__init__()
        torch.manual_seed(0)
        self.d1, self.d2, self.u2, self.u1 = Down(width), Down(width, attention=True), Up(width), Up(width)

    def forward(self, x):
        h, s1 = self.d1(x)
        h, s2 = self.d2(h)
        return self.u1(self.u2(h, s2), s1)


def test_a_unet_planned_at_its_smallest_budget_measures_at_most_it():
    # torch.cat's backward hands the skip a slice of the concatenation's gradient, which
    # holds all of it until the skip's block runs its backward: 2x the skip's own bytes here.
    plain, x = UNet(), torch.randn(4, 8, 32, 32, generator=torch.Generator().manual_seed(0))
    loss = lambda out: out.square().mean()  # noqa: E731
    smallest = actsave.plan_blocks(copy.deepcopy(plain), (Down, Up), 2**40, (x,), loss=loss).smallest_peak_bytes
    model = copy.deepcopy(plain)
    actsave.wrap(model, actsave.plan_blocks(model, (Down, Up), smallest, (x,), loss=loss))
    assert peak_activation_bytes(model, x, loss=loss) <= smallest


class DeepUNet(nn.Module):
    def __init__(self, width=8, depth=3):
        super().__init__()
        torch.manual_seed(0)
        self.downs = nn.ModuleList(Down(width) for _ in range(depth))
        self.ups = nn.ModuleList(Up(width) for _ in range(depth))

    def forward(self, x):
        skips = []
        for down in self.downs:
            x, skip = down(x)
            skips.append(skip)
        for up in self.ups:
            x = up(x, skips.pop())
        return x


def test_a_skips_gradient_is_pending_from_the_block_that_made_it_to_its_reader():
    # Down block i makes skip i, which up block 5 - i reads: its gradient is alive from
    # that reader's backward until block i's own, not at the down blocks before it.
    model, x = DeepUNet(), torch.randn(2, 8, 32, 32, generator=torch.Generator().manual_seed(0))
    blocks = [(f"downs.{i}", b) for i, b in enumerate(model.downs)] + [(f"ups.{i}", b) for i, b in enumerate(model.ups)]
    calls = record_calls(model, blocks, (x,), lambda out: out.square().mean())
    s0, s1, s2 = (2 * 8 * side * side * 4 for side in (32, 16, 8))
    assert argument_gradients(calls, torch.device("cpu")) == (s0, s0 + s1, s0 + s1 + s2, s0 + s1 + s2, s0 + s1, s0)
