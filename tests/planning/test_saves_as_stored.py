"""A plain segment's saves followed as a lossy codec would store them
(actsave/planning/saves_as_stored.py): which the codec encodes and which it holds as
they are, as runtime/kept_saves.py decides."""
import contextlib

import pytest
import torch
from torch.autograd.graph import saved_tensors_hooks
from transformer_blocks import AttentionBlock

from actsave.codecs import get_codec
from actsave.planning.live_bytes import LiveBytes
from actsave.planning.saves_as_stored import SavesAsStored
from actsave.runtime.keep_rules import KeepPolicy
from actsave.runtime.kept_saves import call_with_kept_saves


def coded_shapes(watching: bool) -> list:
    """The shapes of the saves of one forward of the block that SavesAsStored counts as
    encoded (with its attention watch active or not)."""
    torch.manual_seed(0)
    block, x = AttentionBlock(), torch.randn(2, 16, 32, requires_grad=True) * 1
    tracker = LiveBytes("cpu")
    stored = SavesAsStored(set(), tracker)
    with tracker, saved_tensors_hooks(lambda t: (t.detach(), stored.pack(t, 0, 0)), lambda saved: saved[0]), \
            stored.watching() if watching else contextlib.nullcontext():
        block(x)
        stored.finish()
    return [tuple(entry.spec.shape) for entry in stored.entries.values() if entry.coded]


class _Recording(type(get_codec("int8"))):
    def __init__(self):
        super().__init__("int8", 33.0)
        self.encoded = []

    def encode(self, x, non_negative=False):
        self.encoded.append(tuple(x.shape))
        return super().encode(x, non_negative)


@pytest.mark.parametrize("watching", [True, False])
def test_an_attention_calls_saves_are_counted_as_held_where_the_step_watches_its_calls(watching):
    # NOTE [ Attention's saves agree ]: under the watch, what the runtime encodes (the
    # norm's input and the qkv projection's); without it, the attention's q, k, v and
    # output and the output projection's input too (the planner's step must enter it).
    torch.manual_seed(0)
    block, codec = AttentionBlock(), _Recording()
    out, _ = call_with_kept_saves(block, (torch.randn(2, 16, 32, requires_grad=True) * 1,), {},
                                  KeepPolicy(codec, False))
    del out
    counted = coded_shapes(watching)
    assert codec.encoded == [(2, 16, 32), (32, 32)]
    assert counted == codec.encoded if watching else len(counted) == 2 + 5
