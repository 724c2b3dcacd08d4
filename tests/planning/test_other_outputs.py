"""A block's outputs besides its hidden state in a block plan (other_outputs.py, NOTE
[ Outputs the caller holds ]): what the example step's caller does with them, and
their gradients in the chain the planner profiles."""
import pytest
import torch
from torch import nn

from actsave.planning.block_calls import record_calls
from actsave.planning.block_step import measure_outside
from actsave.planning.other_outputs import with_gradients_of

WIDTH, WIDE, ROWS = 16, 64, 32
WIDE_BYTES = ROWS * WIDE * 4


class SkipBlock(nn.Module):
    """Returns its hidden state and a skip connection: a new tensor (``"new"``) no node
    of the block saves, or its ReLU output itself (``"saved"``), which ReLU saves."""

    def __init__(self, skip: str = "new"):
        super().__init__()
        self.skip = skip
        self.a, self.b = nn.Linear(WIDTH, WIDE), nn.Linear(WIDE, WIDTH)

    def forward(self, x):
        inner = torch.relu(self.a(x))
        return self.b(inner), (inner * 2 if self.skip == "new" else inner)


class UNetLike(nn.Module):
    """A decoder that reads the skips after the blocks (``keep_skips``), or a loop that
    drops them as each block returns."""

    def __init__(self, skips=("new", "new", "new"), keep_skips: bool = True):
        super().__init__()
        torch.manual_seed(0)
        self.keep_skips = keep_skips
        self.blocks = nn.ModuleList(SkipBlock(skip) for skip in skips)
        self.up = nn.Linear(WIDE, WIDTH)

    def forward(self, x):
        skips = []
        for block in self.blocks:
            if self.keep_skips:
                x, skip = block(x)
                skips.append(skip)
            else:
                x = block(x)[0]
        for skip in reversed(skips):
            x = x + self.up(skip)
        return x.square().mean()


def outside_of(model: nn.Module):
    x = torch.randn(ROWS, WIDTH)
    blocks = [(f"blocks.{i}", block) for i, block in enumerate(model.blocks)]
    return measure_outside(model, record_calls(model, blocks, (x,)), (x,))


def test_the_other_outputs_a_caller_holds_are_measured_with_their_gradients():
    others = outside_of(UNetLike()).other_outputs
    assert others.kept == others.kept_unsaved == (WIDE_BYTES,) * 3
    assert others.gradients == ((0,),) * 3


def test_an_other_output_the_blocks_saves_hold_is_counted_only_beside_them():
    # A plain block's saves hold its ReLU output already: only its other options count it.
    others = outside_of(UNetLike(skips=("saved", "new", "saved"))).other_outputs
    assert others.kept == (WIDE_BYTES,) * 3
    assert others.kept_unsaved == (0, WIDE_BYTES, 0)


def test_other_outputs_the_caller_drops_are_not_held():
    # The last block's are counted even so: nothing after the blocks shows they are dropped.
    others = outside_of(UNetLike(keep_skips=False)).other_outputs
    assert others.kept == others.kept_unsaved == (0, 0, WIDE_BYTES)
    assert others.gradients == ((),) * 3
    assert others.passing == (0, 0, 0)


class ReassignsSkips(UNetLike):
    """``x, skip = block(x)``: each skip is dropped as the next block returns."""

    def forward(self, x):
        for block in self.blocks:
            x, skip = block(x)
        return x.square().mean()


def test_other_outputs_dropped_a_block_later_are_held_through_that_blocks_forward_only():
    # Block 0's skip lives through block 1's forward; block 1's until after the blocks end.
    others = outside_of(ReassignsSkips()).other_outputs
    assert others.kept == (0, WIDE_BYTES, WIDE_BYTES)
    assert others.passing == (0, WIDE_BYTES, 0)


def test_the_hidden_state_with_gradients_of_other_outputs_is_an_alias_changeable_in_place():
    weight = torch.randn(WIDTH, WIDTH, requires_grad=True)
    x = torch.randn(ROWS, WIDTH)
    hidden, skip = x @ weight, (x @ weight) * 2
    out = with_gradients_of(hidden, (hidden, skip), (0,))
    assert out.untyped_storage() is hidden.untyped_storage() and not out._is_view()
    torch.relu_(out).sum().backward()  # a next block that changes its input in place
    expected = weight.grad.clone()
    weight.grad = None
    torch.relu(x @ weight).sum().backward()
    assert torch.equal(weight.grad, expected)  # the other output's gradient is zero


@pytest.mark.parametrize("leaves", [(), (1,)])
def test_the_hidden_state_is_handed_on_as_it_is_without_other_gradients(leaves):
    hidden = torch.randn(2, 3, requires_grad=True) * 1
    assert with_gradients_of(hidden, (hidden, torch.randn(2, 3, requires_grad=True) * 1), leaves) is hidden
