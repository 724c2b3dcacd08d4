"""A block's outputs besides its hidden state, in a block plan (blocks.py): what the
example step's caller does with them, measured in its plain step
(:class:`OutputsWatch`, for block_step.py's ``Outside``), and their gradients handed to
the block's backward in the chain the planner profiles (:func:`with_gradients_of`).

NOTE [ Outputs the caller holds ]
A block may return more than its hidden state: a U-Net's skip connection, Hugging Face's
attention weights (``output_attentions``). The model's caller holds those other outputs
while the chain of BlockCalls (block_calls.py), which hands on the hidden state alone,
does not see them. The plain step that measures ``Outside`` notes each block's other
tensor outputs that the step allocated (not its inputs or arguments, its hidden output,
parameters, the batch, nor one an earlier block returned): their bytes, which of them
the block's own saves hold, and which of its other outputs get a gradient. One freed
before the next block starts (the caller dropped it and no save held it) is not held;
one freed later, before the last block ends (``x, _ = block(x)`` drops it as the next
block returns), is held through the forwards of the blocks in between only: it is
counted in their forward events (``passing``), not kept to the backward. The last
block's are counted even where dropped.

The plan counts each other one as kept by its block from its forward until its
backward starts, whatever its option, in its R (memory_model.py): a plain block's saves
hold some of them already, so it counts the rest; every other option counts them all
(a recompute makes its own, which it drops). In the chain the planner profiles and
measures, the block's backward gets zeros as the gradients of the outputs the step gave
one (:func:`with_gradients_of`), so that its backward events hold them, and what they
add to its own gradients, as the model's does.

That is conservative for the step a plan is for (block_step.run_step: the output's
loss kept, the rest dropped), where what reads such an output (a decoder) is part of
the loss: the reader keeps it at most until its own backward, which hands the output's
gradient, as large, on to the block's backward. The plan counts the output in its
gradient's place until then: ``Outside.loss_leaves`` leaves out each one still
allocated when the loss's backward ends, and as many bytes for each one freed by then
that gets a gradient (taken to be alive then, as it is where the readers' backward
comes before the blocks'). A caller that keeps them longer (the model's output held
through the backward) needs more than the plan counts.
"""
from __future__ import annotations

from dataclasses import dataclass
import torch
from torch.autograd.graph import saved_tensors_hooks

from .._torch import pytree
from .live_bytes import LiveBytes


@dataclass(frozen=True)
class OtherOutputs:
    """Per block, what the example step does with its other outputs (module NOTE):
    the bytes the caller holds, all of them (``kept``) and those the block's saves do
    not hold (``kept_unsaved``); and the leaves of its other outputs (of ``output[1:]``,
    flattened) whose gradients the step computes (``gradients``); and the bytes of
    earlier blocks' other outputs that the caller holds during its forward and frees
    before the blocks end (``passing``)."""

    kept: tuple
    kept_unsaved: tuple
    gradients: tuple
    passing: tuple  # per block: the bytes of earlier blocks' other outputs held through its forward only


def other_leaves(output) -> list:
    """The leaves of a block's outputs besides its hidden state (the first item of a
    tuple or list); none where it returns the hidden state alone."""
    return pytree.tree_leaves(tuple(output[1:])) if isinstance(output, (tuple, list)) else []


class _Output:
    """A block's other output, noted: as the tracker counts its storage (a one-item
    list, 0 once freed), its bytes, whether the block's saves hold it, its leaf."""

    __slots__ = ("counted", "nbytes", "saved", "leaf", "at_loss_end")

    def __init__(self, counted: list, saved: bool, leaf: int):
        self.counted, self.nbytes, self.saved, self.leaf, self.at_loss_end = counted, counted[0], saved, leaf, 0


class OutputsWatch:
    """Follows each block's other outputs through the measured plain step (module
    NOTE): called as each block starts and ends, and as the loss's backward ends."""

    def __init__(self, tracker: LiveBytes, blocks: int):
        self.tracker = tracker
        self.outputs = [[] for _ in range(blocks)]  # per block: its _Output s
        self.gradients = [set() for _ in range(blocks)]  # per block: the leaves given a gradient
        self.passing = [0] * blocks  # per block: earlier blocks' outputs held through its forward only
        self._saved = [{} for _ in range(blocks)]  # per block: id(counted) -> counted, of each storage it saves
        self._block, self._hooks, self._handles = None, None, []

    def block_starts(self, a: int) -> None:
        """Block ``a`` starts: the earlier blocks' outputs that nothing holds now are
        dropped, counted in the forwards they were held through; the saves of ``a``
        are watched until it ends."""
        self._drop_freed(a)
        self._unwatch()
        self._block, self._hooks = a, saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()

    def block_ends(self, a: int, inputs, hidden: torch.Tensor, output) -> None:
        """Block ``a`` returned ``output`` (``hidden`` its hidden state), called on
        ``inputs``."""
        self._unwatch()
        if a == len(self.outputs) - 1:
            self._drop_freed(a + 1)
        held = [self._counted(t) for t in (hidden, *pytree.tree_leaves(inputs)) if isinstance(t, torch.Tensor)]
        taken = {id(counted) for counted in held if counted[0]}
        taken |= {id(noted.counted) for outputs in self.outputs for noted in outputs}
        for k, t in enumerate(other_leaves(output)):
            if not isinstance(t, torch.Tensor):
                continue
            if t.requires_grad:
                self._handles.append(t.register_hook(lambda grad, a=a, k=k: self.gradients[a].add(k)))
            counted = self._counted(t)
            if counted[0] and id(counted) not in taken:
                taken.add(id(counted))
                self.outputs[a].append(_Output(counted, id(counted) in self._saved[a], k))

    def _drop_freed(self, a: int) -> None:
        """The outputs of blocks before ``a`` freed by now, as no save held them: each
        block's dropped, counted in the forwards of the blocks between it and ``a``
        (none for block ``a - 1``'s: it was freed in its own block's forward)."""
        for j in range(a):
            freed = [output for output in self.outputs[j] if not (output.saved or output.counted[0])]
            self.outputs[j] = [output for output in self.outputs[j] if output not in freed]
            for k in range(j + 1, a):
                self.passing[k] += sum(output.nbytes for output in freed)

    def live(self) -> int:
        """Bytes of the noted outputs still allocated."""
        return sum(output.counted[0] for outputs in self.outputs for output in outputs)

    def counts(self) -> set:
        """The ids of the noted outputs' one-item counts (LiveBytes.counted_bytes)."""
        return {id(output.counted) for outputs in self.outputs for output in outputs}

    def loss_ends(self) -> None:
        for outputs in self.outputs:
            for output in outputs:
                output.at_loss_end = output.counted[0]

    def held_at_loss_end(self) -> int:
        """Once the step ends: the bytes of the noted outputs allocated when the loss's
        backward ended, and as many for each one freed by then that got a gradient
        (module NOTE)."""
        return sum(output.at_loss_end or (output.nbytes if output.leaf in self.gradients[a] else 0)
                   for a, outputs in enumerate(self.outputs) for output in outputs)

    def finish(self) -> OtherOutputs:
        """What the step did with the blocks' other outputs; the watch's hooks removed."""
        self._unwatch()
        for handle in self._handles:
            handle.remove()
        return OtherOutputs(kept=tuple(sum(output.nbytes for output in outputs) for outputs in self.outputs),
                            kept_unsaved=tuple(sum(output.nbytes for output in outputs if not output.saved)
                                               for outputs in self.outputs),
                            gradients=tuple(tuple(sorted(leaves)) for leaves in self.gradients),
                            passing=tuple(self.passing))

    def _counted(self, t: torch.Tensor) -> list:
        return self.tracker.counted_bytes(t.untyped_storage())

    def _pack(self, t: torch.Tensor):
        counted = self._counted(t)
        if counted[0]:
            self._saved[self._block][id(counted)] = counted
        return t.detach()  # the tensor itself would be a reference cycle where it is an output

    def _unwatch(self) -> None:
        if self._hooks is not None:
            self._hooks.__exit__(None, None, None)
            self._block, self._hooks = None, None


class _WithGradients(torch.autograd.Function):
    """The hidden state as it is (an alias of its storage and version, not a view),
    whose backward also hands zeros to the other outputs given, as their gradients."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, *others: torch.Tensor) -> torch.Tensor:
        ctx.others = [(other.shape, other.dtype, other.device) for other in others]
        # Not a view: a view made in a Function may not be changed in place, which the
        # next block may do to its input.
        return hidden.detach()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return (grad, *(torch.zeros(shape, dtype=dtype, device=device) for shape, dtype, device in ctx.others))


def with_gradients_of(hidden: torch.Tensor, output, leaves: tuple) -> torch.Tensor:
    """``hidden``, the hidden state of a block's ``output``, whose backward also gives
    zeros as the gradients of its other outputs' ``leaves`` (module NOTE); ``hidden``
    itself where there are none, or where it needs no gradient."""
    others = [t for k, t in enumerate(other_leaves(output))
              if k in leaves and isinstance(t, torch.Tensor) and t.requires_grad]
    if not others or not hidden.requires_grad:
        return hidden
    return _WithGradients.apply(hidden, *others)


__all__ = ["OtherOutputs", "OutputsWatch", "other_leaves", "with_gradients_of"]
