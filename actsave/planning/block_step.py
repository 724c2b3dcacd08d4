"""The example step of a block plan (blocks.py, steps 1 and 2): the selected blocks'
calls, recorded from its forward and checked to run one after another, each as a layer
of a chain (:class:`BlockCall`); and what one plain training step holds outside the
blocks, measured as the planner's profile counts bytes (:class:`Outside`)."""
from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch
from torch import nn

from .._torch import pytree
from ..errors import ConfigError
from ..runtime.keep_modes import is_hf_cache
from ..runtime.keep_rules import modifies_input
from .instrumented_step import backward_from, checked_loss, step_input
from .step_isolation import isolated_steps
from .live_bytes import LiveBytes, allocation_bytes
from .other_outputs import OtherOutputs, OutputsWatch, with_gradients_of


# ------------------------------------------------------------------ the example step


def run_step(model: nn.Module, example_inputs, loss: Optional[Callable] = None) -> torch.Tensor:
    """The forward of the training step a block plan is for: ``model(**example_inputs)``
    for a dict, ``model(*example_inputs)`` for a tuple or list, ``model(example_inputs)``
    for a tensor; returns the loss, the tensor the backward starts from: ``loss(output)``
    where a loss function is given (a one-element tensor that requires grad:
    instrumented_step.checked_loss), else the output itself if a tensor, else its
    ``loss`` (a Hugging Face ``ModelOutput``, a dict), else its first item. Nothing
    else of the output is kept."""
    if isinstance(example_inputs, dict):
        output = model(**example_inputs)
    elif isinstance(example_inputs, (tuple, list)):
        output = model(*example_inputs)
    else:
        output = model(example_inputs)
    return _loss_of(output) if loss is None else checked_loss(loss, output)


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


# ------------------------------------------------------------- 1. the blocks' calls


class _Call:
    """One recorded call of a block: the block's ``forward``, the leaves of ``(args,
    kwargs)``, how to rebuild them, which leaf is the hidden state, and the
    hidden-state output. ``copied``: copies of its tensor leaves, taken before a block
    that changes its input in place ran (NOTE [ The first block's input as it was ])."""

    def __init__(self, forward: Callable, args: tuple, kwargs: dict, copied: bool = False):
        self.forward = forward
        self.leaves, self.spec = pytree.tree_flatten((args, kwargs))
        self.copies = {k: step_input(leaf) for k, leaf in enumerate(self.leaves)
                       if copied and isinstance(leaf, torch.Tensor)}
        self.hidden_leaf: int | None = None
        self.output: torch.Tensor | None = None

    def leaf_index(self, t: torch.Tensor) -> int | None:
        return next((k for k, leaf in enumerate(self.leaves) if leaf is t), None)

    @property
    def hidden(self) -> torch.Tensor:
        return self.leaves[self.hidden_leaf]


def _hidden_output(output, fqn: str) -> torch.Tensor:
    """A block's hidden-state output: the output itself, or its first item (the tuples
    of older Hugging Face blocks)."""
    if isinstance(output, (tuple, list)) and output:
        output = output[0]
    if not isinstance(output, torch.Tensor):
        raise ConfigError(f"block {fqn} returned a {type(output).__name__}; a block plan needs blocks that "
                          "return the hidden state (a tensor, or a tuple whose first item is it)")
    return output


class _CallRecorder:
    """Forward hooks that record each block's calls, in the order the blocks run."""

    def __init__(self, blocks: Sequence[tuple]):
        self.calls = {fqn: [] for fqn, _ in blocks}
        self.order = []  # fqn of each call, in order
        self._handles = []
        for fqn, module in blocks:
            # First of the pre-hooks: the arguments as the caller passed them, before a
            # hook such as FSDP2's hands the block new tensor objects.
            self._handles.append(module.register_forward_pre_hook(
                lambda m, args, kwargs, fqn=fqn: self._enter(fqn, m, args, kwargs), with_kwargs=True, prepend=True))
            self._handles.append(module.register_forward_hook(
                lambda m, args, output, fqn=fqn: self._exit(fqn, output)))

    def _enter(self, fqn: str, module: nn.Module, args: tuple, kwargs: dict) -> None:
        first_changing = not self.order and modifies_input(module)  # NOTE [ The first block's input as it was ]
        self.calls[fqn].append(_Call(module.forward, args, kwargs, copied=first_changing))
        self.order.append(fqn)

    def _exit(self, fqn: str, output) -> None:
        self.calls[fqn][-1].output = _hidden_output(output, fqn)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def _chained_calls(recorder: _CallRecorder) -> list:
    """Each block's one call, in the order they ran, with its hidden-state argument
    found: the one that is the previous block's output; the first block's, the
    argument the second block gets it as (:func:`_same_argument`). Raises ConfigError
    unless the blocks ran once each, one after another, each on the previous one's
    output."""
    ran = {fqn: len(calls) for fqn, calls in recorder.calls.items()}
    if any(count != 1 for count in ran.values()):
        raise ConfigError(f"a block plan needs each selected block to run exactly once in the example step; "
                          f"calls per block: {ran}. Select the blocks the model's forward calls once each")
    calls = [recorder.calls[fqn][0] for fqn in recorder.order]
    for previous_fqn, previous, fqn, call in zip(recorder.order, calls, recorder.order[1:], calls[1:]):
        call.hidden_leaf = call.leaf_index(previous.output)
        if call.hidden_leaf is None:
            raise ConfigError(
                f"block {fqn} is not called on the output of block {previous_fqn}, which ran just before it: a "
                "block plan needs blocks that run one after another, each on the previous one's hidden "
                "state (work between them, or blocks in parallel branches, cannot be planned per block)")
    first, first_fqn = calls[0], recorder.order[0]
    first.hidden_leaf = _same_argument(first, calls[1]) if len(calls) > 1 else _first_tensor_leaf(first, first_fqn)
    if first.hidden_leaf is None or not isinstance(first.hidden, torch.Tensor):
        raise ConfigError(f"block {first_fqn} gets no tensor where the next blocks get the hidden state (block "
                          f"{recorder.order[1]} gets it as its {_argument_text(calls[1])})")
    _check_one_hidden_parameter(recorder.order, calls)
    _check_no_cache(recorder.order, calls)
    return calls


def _check_no_cache(order: list, calls: list) -> None:
    """Raise where a block got a key/value cache (a Hugging Face ``Cache``): the plan
    measures each block's options by calling it again with its recorded arguments, and
    each call would append to that one cache, holding the last call's graph (a backward
    through it a second time)."""
    for fqn, call in zip(order, calls):
        cache = next((leaf for leaf in call.leaves if is_hf_cache(leaf)), None)
        if cache is not None:
            raise ConfigError(
                f"block {fqn} got a key/value cache ({type(cache).__name__}) in the example step: a block plan "
                "calls each block again with its arguments, which would append to that cache. Train without one, "
                "as any checkpointing does: model.config.use_cache = False (Hugging Face), or use_cache=False in "
                "the example inputs")


def _check_one_hidden_parameter(order: list, calls: list) -> None:
    """Raise where a block takes the previous block's output as another parameter than
    a block of its type takes its hidden state as: BART's first decoder layer gets the
    encoder's output as ``encoder_hidden_states``, for its cross-attention. Those are
    two chains, not one (the decoder's hidden state starts from its embeddings)."""
    seen = {}  # block type -> (the first block of it, its hidden state's parameter)
    for fqn, call in zip(order, calls):
        path = _bound_places(call).get(call.hidden_leaf)
        if not path:  # its forward's signature could not be bound
            continue
        name = getattr(path[0], "key", None)
        kind_fqn, kind_name = seen.setdefault(type(getattr(call.forward, "__self__", None)), (fqn, name))
        if name != kind_name:
            raise ConfigError(
                f"blocks {kind_fqn} and {fqn}, of one type, take the previous block's output as different arguments "
                f"({kind_name!r} and {name!r}): the blocks are not one chain (an encoder's output going into a "
                "decoder's cross-attention, say). Plan each stack of blocks on its own")


def _same_argument(call: _Call, second: _Call) -> int | None:
    """The leaf of ``call`` (the first block's) passed as the argument that ``second``
    (the second block's) passes its hidden state as, or None: the same parameter of the
    block's forward (by name, however the caller ordered or passed it), else the same
    place in the call as written (a first block whose forward names it otherwise).
    Never by leaf index alone: keyword arguments in another order, or one more before
    it, move every leaf."""
    for places in (_bound_places, _written_places):
        wanted = places(second).get(second.hidden_leaf)
        index = next((k for k, place in places(call).items() if place == wanted), None)
        if index is not None:
            return index
    return None


def _argument_text(call: _Call) -> str:
    """Where ``call`` passes its hidden state, in words: "keyword argument 'x'" or
    "positional argument 0", and the path within it if it is nested."""
    path = _written_places(call)[call.hidden_leaf]
    argument = f"keyword argument {path[1].key!r}" if path[0].idx == 1 else f"positional argument {path[1].idx}"
    return argument + (f" at {pytree.keystr(path[2:])}" if len(path) > 2 else "")


def _written_places(call: _Call) -> dict:
    """{leaf index: its path in ``(args, kwargs)``}: keywords by name, positions by index."""
    paths = [path for path, _ in pytree.tree_flatten_with_path(pytree.tree_unflatten(call.leaves, call.spec))[0]]
    return dict(enumerate(paths))


def _bound_places(call: _Call) -> dict:
    """{leaf index: (the block's forward parameter it was bound to, its path within
    it)}; empty where the signature cannot be read or bound."""
    args, kwargs = pytree.tree_unflatten(call.leaves, call.spec)
    try:
        bound = inspect.signature(call.forward).bind(*args, **kwargs)
    except (TypeError, ValueError):
        return {}
    places = {}
    for path, leaf in pytree.tree_flatten_with_path(dict(bound.arguments))[0]:
        index = call.leaf_index(leaf) if isinstance(leaf, torch.Tensor) else None
        if index is not None:
            places.setdefault(index, path)
    return places


def _first_tensor_leaf(call: _Call, fqn: str) -> int:
    index = next((k for k, leaf in enumerate(call.leaves) if isinstance(leaf, torch.Tensor)), None)
    if index is None:
        raise ConfigError(f"block {fqn} was called with no tensor argument: there is no hidden state to plan for")
    return index


# NOTE [ The first block's input as it was ]
# The block chain is profiled from the first block's recorded hidden state. A first
# block that changes its input in place (modifies_input: ``inplace = True``) changes
# that very tensor as the example step runs, so the chain would be profiled from the
# changed values (a ReLU applied twice, a mul_ compounding). So its call records copies
# of its tensor arguments before it runs (step_input: cut from the graph, a leaf where
# the argument is one); the hidden state's copy stands in for it, the rest are dropped.
# Later blocks' hidden states are recorded as they are: found by identity (the previous
# block's output), and in the chain each block runs on what the block before returns.


def record_calls(model: nn.Module, blocks: Sequence[tuple], example_inputs, loss: Optional[Callable] = None) -> list:
    """Run the example step's forward (only), on its own copy of ``example_inputs``
    (:func:`step_inputs`), and return the blocks' calls, in the order they ran
    (:func:`_chained_calls`); the first one's hidden state as it was before it ran
    (NOTE [ The first block's input as it was ])."""
    recorder = _CallRecorder(blocks)
    try:
        with isolated_steps(model), torch.enable_grad():
            run_step(model, step_inputs(example_inputs), loss)
    finally:
        recorder.remove()
    calls = _chained_calls(recorder)
    first = calls[0]
    if first.copies:
        first.leaves[first.hidden_leaf] = first.copies[first.hidden_leaf]
    for call in calls:  # the outputs were for the chaining check only, the copies for the first hidden state
        call.output, call.copies = None, {}
    return [(fqn, dict(blocks)[fqn], call) for fqn, call in zip(recorder.order, calls)]


class _Argument(NamedTuple):
    """Stands, among a recorded call's leaves, for a tensor kept as a buffer."""

    buffer: str


class BlockCall(nn.Module):
    """A block as a layer of a chain: called on the hidden state alone, it calls the
    block with the other arguments of its recorded call. Their tensors are buffers of
    this module (not in its state dict), so that the profile counts them as held by
    the caller, as the model's own loop holds them. It returns the hidden state alone;
    its backward gives zeros as the gradients of the block's other outputs whose leaves
    ``other_gradients`` names, as the model's step gives them gradients (NOTE [ Outputs
    the caller holds ], other_outputs.py)."""

    def __init__(self, block: nn.Module, call: _Call, other_gradients: tuple = ()):
        super().__init__()
        self.block = block
        self.other_gradients = other_gradients
        self.inplace = modifies_input(block)  # a segment starting here keeps a copy, as Checkpoint(block) does
        self.__qualname__ = type(block).__qualname__  # the name a checkpoint's messages give it
        self._spec, self._hidden_leaf = call.spec, call.hidden_leaf
        self._leaves = []
        for k, leaf in enumerate(call.leaves):
            if isinstance(leaf, torch.Tensor) and k != call.hidden_leaf:
                self.register_buffer(f"argument_{k}", leaf.detach(), persistent=False)
                leaf = _Argument(f"argument_{k}")
            self._leaves.append(leaf)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        leaves = [hidden if k == self._hidden_leaf else
                  self._buffers[leaf.buffer] if isinstance(leaf, _Argument) else leaf
                  for k, leaf in enumerate(self._leaves)]
        args, kwargs = pytree.tree_unflatten(leaves, self._spec)
        output = self.block(*args, **kwargs)
        hidden = _hidden_output(output, type(self.block).__name__)
        return with_gradients_of(hidden, output, self.other_gradients) if self.other_gradients else hidden


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


class _Phases:
    """Hooks that split the example step into the work before the blocks, the blocks,
    the loss (from the last block's end to its output's gradient) and the work after
    the blocks' backward, and measure each outside part with ``tracker``."""

    def __init__(self, tracker: LiveBytes, calls: list):
        self.tracker = tracker
        self.before_rise = self.held = self.chain_input = self.loss_rise = self.after_start = self.after_rise = 0
        self.blocks_end = self.loss_leaves = 0
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
                a, (args, kwargs), _hidden_output(output, type(m).__name__), output),
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
        hidden = _hidden_output(output, type(module).__name__)
        if hidden.requires_grad:
            # Counted as the next op starts: this hook's arguments still hold the last block's
            # input, which its caller may drop as it returns (else the loss's rise comes out short).
            hidden_count = self.tracker.counted_bytes(hidden.untyped_storage())
            hidden_bytes = _storage_bytes(hidden, self.tracker.device)
            self.tracker.before_next_op(lambda: self._loss_starts(hidden_bytes, hidden_count))
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
        self._chain_input_gone("forward")
        # The loss's backward may leave more than the gradient it hands the blocks: a
        # weight tied to the embeddings' holds its gradient until theirs adds to it.
        # (The last block's output is not counted in blocks_end: the loss frees it.) The
        # blocks' other outputs, or their gradients, come off when the step ends (finish):
        # NOTE [ Outputs the caller holds ].
        dropped = sum(nbytes for count, nbytes in self._blocks_end_storages if count[0] == 0)
        self.loss_leaves = self.tracker.live - (self.blocks_end - dropped) - _storage_bytes(grad, self.tracker.device)
        self.others.loss_ends()
        self._arguments.clear()

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
                loss = run_step(model, inputs, loss_fn)
                loss_bytes = _storage_bytes(loss, device)
                if not phases.loss_hooked:
                    raise ConfigError(f"the output of the last block, {last_fqn}, needs no gradient: there is no "
                                      "backward through the blocks to plan for")
                backward_from(loss)
                del loss
        finally:
            others = phases.finish()
    return Outside(before_peak=batch_bytes + phases.before_rise,
                   held=batch_bytes + phases.held - phases.chain_input,
                   loss_rise=phases.loss_rise, loss_bytes=loss_bytes, loss_leaves=phases.loss_leaves,
                   after_peak=batch_bytes + phases.after_start + phases.after_rise if phases.after_measured else 0,
                   other_outputs=others, chain_input_until=phases.chain_input_until)
