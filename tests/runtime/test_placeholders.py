"""What a checkpointed forward leaves alive for its backward, counted as the garbage
collector counts it (NOTE [ Objects a step leaves to the garbage collector ]), against
torch.utils.checkpoint on the same model; and the placeholders' cursor."""
import copy
import gc

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint_sequential

import actsave
from actsave.runtime.placeholders import Cursor
from tests.support import train_step


def tracked_objects_left(forward) -> int:
    """The objects the garbage collector tracks that ``forward()`` leaves alive until the
    backward of the loss it returns (which then runs), after one young collection: what
    a step moves toward the collector's oldest generation."""
    gc.collect()
    gc.disable()
    try:
        loss = forward()
        gc.collect(0)  # every object older than this forward sits in the oldest generation now
        count = len(gc.get_objects(generation=1))
        loss.backward()
    finally:
        gc.enable()
    return count


def tanh_chain(length: int):
    def function(x):
        for _ in range(length):
            x = torch.tanh(x)  # saves its output
        return x
    return function


def test_a_checkpoint_leaves_two_tracked_objects_per_save():
    x = torch.randn(4, 4, requires_grad=True)
    left = {length: tracked_objects_left(lambda: actsave.checkpoint(tanh_chain(length), x).sum()) for length in (16, 80)}
    # The Slot and the frame's weak reference to it per save (torch's checkpoint leaves
    # four); the slack is for what the process makes meanwhile (another thread's objects).
    assert left[80] - left[16] <= 2 * 64 + 16


def linear_chain(pairs: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(layer for _ in range(pairs) for layer in (nn.Linear(8, 8), nn.ReLU())))


def test_a_deeper_chain_leaves_no_more_tracked_objects_per_layer_than_torchs_checkpoint():
    x = torch.randn(2, 8)
    ours, theirs = {}, {}
    for pairs in (8, 24):
        chain = linear_chain(pairs)
        model = actsave.CheckpointedSequential.from_sequential(copy.deepcopy(chain), segments=4)
        train_step(model, x)  # what the first call builds and later ones reuse
        ours[pairs] = tracked_objects_left(lambda: model(x).sum())
        theirs[pairs] = tracked_objects_left(lambda: checkpoint_sequential(chain, 4, x, use_reentrant=False).sum())
    assert ours[24] - ours[8] <= theirs[24] - theirs[8]


def test_a_cursor_hands_out_each_position_once_in_order():
    cursor = Cursor()
    assert [cursor.take() for _ in range(3)] == [0, 1, 2] and cursor.position == 3
