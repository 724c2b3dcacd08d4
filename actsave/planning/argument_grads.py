"""The gradients of a block plan's block arguments besides the hidden state, pending
through the blocks' backward (blocks.py adds them to each block's backward event).

NOTE [ Gradients of the blocks' arguments ]
A block's tensor argument beside its hidden state may need a gradient: the encoder's
output that a decoder block's cross-attention reads (BART, T5, Whisper), T5's position
bias that its first block makes and the others read. Autograd sums that gradient from
every block that reads it in one buffer, alive from the backward of the last of them
(the first to run backward) until the tensor's own node runs: after every block's
backward where the tensor was made before the blocks (the encoder's backward follows
the decoder's), at its block's backward where a block returned it. The chain the
planner profiles holds those arguments as buffers (block_calls.py's BlockCall) that
need a gradient where the argument does, so that each profiled block saves what that
gradient needs and its backward makes its part of it; each part is dropped as it comes,
so no profiled event holds the sum: the backward event of each block up to the last
reader counts it (its dense size). The part the last reader's profiled backward gave
it may be a slice of a larger buffer (``torch.cat([x, skip])``'s backward hands a
U-Net's skip a slice of the whole concatenation's gradient), which keeps all of it
alive: the rest of that buffer is counted after the last reader's backward (whose own
events hold the buffer) until the block that made the argument runs its backward (a
reader before the last adds its part out of place and lets the slice go sooner: counted
to the maker still, on the safe side). Where a block made the tensor, its own backward
counts it twice, once as the gradient of its other output
(NOTE [ Outputs the caller holds ]). Conservative by design: the last
reader's own part, which becomes the buffer, is counted from the start of its backward,
where it is made at its end, and as the part its profiled backward makes. Counted
before the last reader only, a T5 decoder's plan peaked over its prediction and budget;
counted so, a stack whose peak lies elsewhere, or whose blocks read the argument
detached (no gradient comes), is over-predicted by that one gradient (docs/limits.md,
"Decoder stacks with cross-attention").
"""
from __future__ import annotations

import torch

from .live_bytes import allocation_bytes


def argument_gradients(calls: list, device, gradient_bytes: tuple = ()) -> tuple:
    """Per block of ``calls`` (block_calls.record_calls'), the bytes on ``device`` (the
    profile's) of the gradients of the blocks' other tensor arguments pending while its
    backward runs: each argument that needs a gradient, once, at every block from the
    one that made it (the first, where none did) to the last that reads it. Where the
    part the last reader's profiled backward gave it holds a larger storage
    (``gradient_bytes``, per block: its BlockCall's ``argument_gradient_bytes``; a slice
    of one buffer, as ``torch.cat([x, skip])``'s backward hands a U-Net's skip), the
    rest of that storage is counted from it to the block that made the argument."""
    readers = {}  # id -> (the argument, [(block, its leaf there)] of each block reading it, in order)
    for a, (_, _, call) in enumerate(calls):
        for k, leaf in enumerate(call.leaves):
            if k != call.hidden_leaf and isinstance(leaf, torch.Tensor) and leaf.requires_grad:
                read = readers.setdefault(id(leaf), (leaf, []))[1]
                if not read or read[-1][0] != a:
                    read.append((a, k))
    pending = [0] * len(calls)
    for leaf, read in readers.values():
        last, k = read[-1]
        dense = allocation_bytes(leaf.numel() * leaf.element_size(), device)
        held = allocation_bytes(gradient_bytes[last].get(k, 0), device) if gradient_bytes else 0
        # The slice's buffer beyond the argument's own bytes: after the last reader's
        # backward (whose profiled events hold the buffer it makes) until the block that
        # made the argument. The reader before the last adds its part out of place and
        # lets it go sooner; counted to the maker still, on the safe side.
        maker = _maker(calls, leaf, read[0][0])
        for a in range(maker, last + 1):
            pending[a] += dense + (max(held - dense, 0) if a < last else 0)
    return tuple(pending)


def _maker(calls: list, leaf: torch.Tensor, reader: int) -> int:
    """The block before ``reader`` whose output holds ``leaf``, whose backward takes its
    gradient; 0 where none does (made before the blocks: the encoder's output)."""
    for a in range(reader - 1, -1, -1):
        made = calls[a][2].made.get(id(leaf))
        if made is not None and made() is leaf:
            return a
    return 0


__all__ = ["argument_gradients"]
