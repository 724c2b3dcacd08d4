"""The example step of a block plan (blocks.py, steps 1 and 2): the step itself
(:func:`run_step`, on its own copy of the inputs), and what one plain training step
holds outside the blocks, measured as the planner's profile counts bytes
(:class:`Outside`). The blocks' calls in it: block_calls.py."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from .._torch import pytree
from ..errors import ConfigError
from .gradient_layout import GradientLayout, LaidOutLoss, ones_like_strides
from .instrumented_step import backward_from, checked_loss, step_input
from .step_isolation import isolated_steps
from .live_bytes import LiveBytes, allocation_bytes
from .other_outputs import OtherOutputs, OutputsWatch


# ------------------------------------------------------------------ the example step


# NOTE [ What a block plan's step holds ]
# With ``loss=`` the caller has the output in hand to pass it to the loss (``logits =
# model(x); loss = loss_fn(logits); loss.backward()``, the README's loop) and holds it
# through the backward, as a chain's plan prices its step (memory_model.py, O). Without,
# the step is ``loss = model(**batch).loss; loss.backward()``, as Hugging Face's
# Trainer runs it: nothing else of the output is held (a loop that keeps ``outputs``
# keeps its logits too: docs/limits.md, "Planning without the loss").
def run_step(model: nn.Module, example_inputs, loss: Optional[Callable] = None) -> tuple:
    """The forward of the training step a block plan is for: ``model(**example_inputs)``
    for a dict, ``model(*example_inputs)`` for a tuple or list, ``model(example_inputs)``
    for a tensor. Returns the loss, the tensor the backward starts from: ``loss(output)``
    where a loss function is given (a one-element tensor that requires grad:
    instrumented_step.checked_loss), else the output itself if a tensor, else its
    ``loss`` (a Hugging Face ``ModelOutput``, a dict), else its first item; and what the
    step holds of the output through the backward (NOTE [ What a block plan's step
    holds ]): the output where a loss function is given, else None."""
    if isinstance(example_inputs, dict):
        output = model(**example_inputs)
    elif isinstance(example_inputs, (tuple, list)):
        output = model(*example_inputs)
    else:
        output = model(example_inputs)
    if loss is None:
        return _loss_of(output), None
    return checked_loss(loss, output), output


def _loss_of(output) -> torch.Tensor:
    if isinstance(output, torch.Tensor):
        return output
    loss = output.get("loss") if isinstance(output, dict) else getattr(output, "loss", None)
    if loss is None and isinstance(output, (tuple, list)) and output:
        loss = output[0]
    if not isinstance(loss, torch.Tensor) or not loss.requires_grad:
        raise ConfigError(
            f"the model returned a {type(output).__name__} with no loss to backpropagate: a block plan is "
            "for a training step, so give example_inputs that make the model return a loss that needs a "
            "gradient (a tensor, an output with .loss, e.g. labels for a Hugging Face model, or a tuple "
            "whose first item is the loss)")
    return loss


def input_tensors(example_inputs) -> list:
    """The tensors of ``example_inputs``: held by the caller, counted in the budget."""
    return [t for t in pytree.tree_leaves(example_inputs) if isinstance(t, torch.Tensor)]


def step_inputs(example_inputs):
    """A copy of ``example_inputs`` for one step of a block plan, each tensor in it
    (in dicts, tuples and lists too) copied by instrumented_step.step_input (NOTE
    [ Each step on its own input ]): a block that changes its input in place changes
    the copy, and the gradients land on it, never on the caller's tensors. A tensor
    passed twice is copied once."""
    copies = {}

    def copied(leaf):
        if not isinstance(leaf, torch.Tensor):
            return leaf
        if id(leaf) not in copies:
            copies[id(leaf)] = (leaf, step_input(leaf))  # the leaf held: its id stays its own
        return copies[id(leaf)][1]

    return pytree.tree_map(copied, example_inputs)


def hidden_output(output, fqn: str) -> torch.Tensor:
    """A block's hidden-state output: the output itself, or its first item (the tuples
    of older Hugging Face blocks)."""
    if isinstance(output, (tuple, list)) and output:
        output = output[0]
    if not isinstance(output, torch.Tensor):
        raise ConfigError(f"block {fqn} returned a {type(output).__name__}; a block plan needs blocks that "
                          "return the hidden state (a tensor, or a tuple whose first item is it)")
    return output


# ------------------------------------------------------ 2. the step outside the blocks


@dataclass(frozen=True)
class Outside:
    """What the example step allocates outside the blocks, in bytes, the example inputs
    included, as measured on the plain model. Fixed whatever the plan: the blocks'
    plan does not change what the model does around them."""

    before_peak: int  # the peak before the first block starts: embeddings, masks, position embeddings
    held: int  # what the step holds while the blocks run, beside the first block's input
    loss_rise: int  # the rise above the bytes live when the last block ends, until its output's gradient
    loss_bytes: int  # the loss
    loss_leaves: int  # live from the loss's backward through the blocks' (the loss, its gradient, a tied weight's)
    after_peak: int  # the peak after the first block's input gradient arrives: the embeddings' backward
    other_outputs: Optional[OtherOutputs] = None  # the blocks' other outputs: NOTE [ Outputs the caller holds ]
    chain_input_until: str = "step"  # how long the first block's input lives: NOTE [ A chain input the step frees ]
    output_grad_layout: Optional[GradientLayout] = None  # NOTE [ The output gradient's layout ]; None: as ones_like

    def profiled_loss(self, output: torch.Tensor) -> torch.Tensor:
        """The blocks' profiled loss: its backward makes the output's gradient, laid out
        as the step's loss laid it out, and freed as the last block's backward is done
        with it, as the step's (one handed in stayed: an output too many)."""
        return LaidOutLoss.apply(output, self.output_grad_layout)

    def output_grad_bytes(self, blocks) -> int:
        """The bytes the output's gradient holds: as ``blocks`` (their ``Profile``)
        counted it, or those of the storage it views where the step laid it out
        otherwise (NOTE [ The output gradient's layout ])."""
        layout = self.output_grad_layout
        return blocks.output_grad_bytes if layout is None else allocation_bytes(layout.storage_bytes, blocks.device)


class _Phases:
    """Hooks that split the example step into the work before the blocks, the blocks,
    the loss (from the last block's end to its output's gradient) and the work after
    the blocks' backward, and measure each outside part with ``tracker``."""

    def __init__(self, tracker: LiveBytes, calls: list):
        self.tracker = tracker
        self.before_rise = self.held = self.chain_input = self.loss_rise = self.after_start = self.after_rise = 0
        self.blocks_end = self.loss_leaves = 0
        self.output_grad_layout, self._output_strides = None, ()
        self.loss_hooked = self.after_measured = False
        self.chain_input_until, self._chain_input_count, self._blocks_end_storages = "step", None, []
        self._first_hidden_leaf = calls[0][2].hidden_leaf
        self._arguments = []  # the blocks' other tensor arguments, held until the loss has run
        self._span = None
        self.others = OutputsWatch(tracker, len(calls))
        self._handles = [module.register_forward_pre_hook(
            lambda m, args, kwargs, a=a, hidden_leaf=call.hidden_leaf: self._block_starts(a, args, kwargs, hidden_leaf),
            with_kwargs=True) for a, (_, module, call) in enumerate(calls)]
        self._handles += [module.register_forward_hook(
            lambda m, args, kwargs, output, a=a: self.others.block_ends(
                a, (args, kwargs), hidden_output(output, type(m).__name__), output),
            with_kwargs=True) for a, (_, module, _) in enumerate(calls)]
        self._handles += [calls[0][1].register_forward_pre_hook(self._first_starts, with_kwargs=True),
                          calls[-1][1].register_forward_hook(self._last_ends)]

    def _open(self) -> None:
        context = self.tracker.span()
        self._span = (context, context.__enter__())

    def _close(self) -> int:
        context, rise = self._span
        context.__exit__(None, None, None)
        self._span = None
        return rise[0]

    def start(self) -> None:
        self._open()

    def _first_starts(self, module, args, kwargs) -> None:
        self.before_rise = self._close()
        hidden = pytree.tree_leaves((args, kwargs))[self._first_hidden_leaf]
        # At its own size, as the profile counts it: the rest of a storage it views is the step's.
        own = min(_storage_bytes(hidden, self.tracker.device),
                  allocation_bytes(hidden.numel() * hidden.element_size(), self.tracker.device))
        self.held, self.chain_input = self.tracker.live, own
        # NOTE [ A chain input the step frees ]: one the step did not make is the caller's.
        count = self.tracker.counted_bytes(hidden.untyped_storage())
        self._chain_input_count = count if count[0] > 0 else None
        if hidden.requires_grad:
            self._handles.append(hidden.register_hook(self._blocks_backward_ends))

    def _last_ends(self, module, args, output) -> None:
        hidden = hidden_output(output, type(module).__name__)
        if hidden.requires_grad:
            # Counted as the next op starts: this hook's arguments still hold the last block's
            # input, which its caller may drop as it returns (else the loss's rise comes out short).
            hidden_count = self.tracker.counted_bytes(hidden.untyped_storage())
            hidden_bytes = _storage_bytes(hidden, self.tracker.device)
            self.tracker.before_next_op(lambda: self._loss_starts(hidden_bytes, hidden_count))
            self._output_strides = ones_like_strides(hidden)  # NOTE [ The output gradient's layout ]
            self._handles.append(hidden.register_hook(self._loss_ends))
            self.loss_hooked = True

    def _loss_starts(self, hidden_bytes: int, hidden_count: list) -> None:
        # The blocks' other outputs are counted as their blocks keep them, not here.
        self.blocks_end = self.tracker.live - hidden_bytes - self.others.live()
        # Each storage live now, with its bytes: what the step drops while the loss runs (HF
        # decoders drop `inputs_embeds` as their forward returns) is no leaf of the loss.
        outside = {id(hidden_count)} | self.others.counts()
        self._blocks_end_storages = [(count, count[0]) for count in self.tracker.live_counts()
                                     if id(count) not in outside]
        self._chain_input_gone("forward" if len(self.others.outputs) > 1 else "first block")  # of one block
        self._open()

    def _chain_input_gone(self, until: str) -> None:
        """The chain input lived ``until`` that, if it is gone now and was not before."""
        count = self._chain_input_count
        if count is not None and count[0] == 0 and self.chain_input_until == "step":
            self.chain_input_until = until

    def _block_starts(self, a: int, args: tuple, kwargs: dict, hidden_leaf: int) -> None:
        self.others.block_starts(a)
        if a == 1:
            self._chain_input_gone("first block")
        # A checkpointed block keeps its arguments until its backward; the plain model
        # may free some (a mask no block saves) as its forward returns, before the loss.
        # Held here, the loss is measured as it runs with any block checkpointed.
        self._arguments += [t for k, t in enumerate(pytree.tree_leaves((args, kwargs)))
                            if isinstance(t, torch.Tensor) and k != hidden_leaf]

    def _loss_ends(self, grad) -> None:
        self.loss_rise = self._close()
        self.output_grad_layout = GradientLayout.of(grad, self._output_strides)
        self._chain_input_gone("forward")
        # The loss's backward may leave more than the gradient it hands the blocks: a
        # weight tied to the embeddings' holds its gradient until theirs adds to it.
        # (The last block's output is not counted in blocks_end: the loss frees it.) The
        # blocks' other outputs, or their gradients, come off when the step ends (finish):
        # NOTE [ Outputs the caller holds ].
        dropped = sum(nbytes for count, nbytes in self._blocks_end_storages if count[0] == 0)
        self.loss_leaves = self.tracker.live - (self.blocks_end - dropped) - self._handed_bytes(grad)
        self.others.loss_ends()
        self._arguments.clear()

    def _handed_bytes(self, grad: torch.Tensor) -> int:
        """The bytes of the output's gradient that the profile's own stands for: its
        storage; none where that is one number expanded (``out.sum()``'s is the loss's
        gradient of 1 itself, held through the whole backward: NOTE [ What a step's loss
        holds ]), which the profile counts beside its own."""
        layout = self.output_grad_layout
        return 0 if layout is not None and layout.storage_numel == 1 else _storage_bytes(grad, self.tracker.device)

    def _blocks_backward_ends(self, grad) -> None:
        self.after_start, self.after_measured = self.tracker.live, True
        self._open()

    def finish(self) -> OtherOutputs:
        """Ends the measurement: what the step did with the blocks' other outputs."""
        if self._span is not None:
            self.after_rise = self._close()
        for handle in self._handles:
            handle.remove()
        others = self.others.finish()
        self.loss_leaves = max(self.loss_leaves - self.others.held_at_loss_end(), 0)
        return others


def _storage_bytes(t: torch.Tensor, device) -> int:
    return allocation_bytes(t.untyped_storage().nbytes(), device)


def measure_outside(model: nn.Module, calls: list, example_inputs, loss_fn: Optional[Callable] = None) -> Outside:
    """One plain training step of ``model``, on its own copy of ``example_inputs``
    (:func:`step_inputs`), its live bytes counted as the planner's profile counts them:
    what it allocates before, around and after the blocks."""
    first_call, last_fqn = calls[0][2], calls[-1][0]
    device = first_call.hidden.device
    batch = input_tensors(example_inputs)  # the caller's, counted as it holds them
    batch_bytes = sum(_storage_bytes(t, device) for t in {id(t.untyped_storage()): t for t in batch}.values())
    inputs = step_inputs(example_inputs)  # the step's own copy, standing for them
    with isolated_steps(model):
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        tracker = LiveBytes(device, known=[*model.parameters(), *model.buffers(), *grads, *input_tensors(inputs)])
        phases = _Phases(tracker, calls)
        try:
            with tracker, torch.enable_grad():
                phases.start()
                loss, held = run_step(model, inputs, loss_fn)
                loss_bytes = _storage_bytes(loss, device)
                if not phases.loss_hooked:
                    raise ConfigError(f"the output of the last block, {last_fqn}, needs no gradient: there is no "
                                      "backward through the blocks to plan for")
                backward_from(loss)
                del loss, held
        finally:
            others = phases.finish()
    return Outside(before_peak=batch_bytes + phases.before_rise,
                   held=batch_bytes + phases.held - phases.chain_input,
                   loss_rise=phases.loss_rise, loss_bytes=loss_bytes, loss_leaves=phases.loss_leaves,
                   after_peak=batch_bytes + phases.after_start + phases.after_rise if phases.after_measured else 0,
                   other_outputs=others, chain_input_until=phases.chain_input_until,
                   output_grad_layout=phases.output_grad_layout)
