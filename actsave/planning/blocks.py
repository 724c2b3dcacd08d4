"""Plans for a model whose blocks run one after another: the decoder layers of a
transformer, called by the model's own loop (``for layer in self.layers: h =
layer(h, mask=..., position_embeddings=...)``), with work before them (embeddings,
masks) and after them (final norm, head, loss).

    plan = actsave.plan_blocks(model, LlamaDecoderLayer, budget=B, example_inputs=batch)
    print(plan)                     # per block: kept plain, or checkpointed and how
    actsave.wrap(model, plan)       # or in one call: wrap(model, ..., budget=B, example_inputs=batch)

How (the steps of :func:`plan_block_stack`):

1. A forward of the example step records each selected block's call: its arguments,
   and which of them is the hidden state. The blocks must each run once, in turn, each
   one's hidden-state output being the next one's hidden-state input.
2. One plain training step, its live bytes counted (:class:`LiveBytes`, as the
   planner's profile counts them), measures what happens outside the blocks:
   :class:`Outside`.
3. The blocks become a chain: one layer per block (:class:`BlockCall`), called on the
   hidden state alone with the other arguments of its recorded call. The planner
   profiles it (:func:`~actsave.profile`), and a last layer stands for the loss:
   what the step allocates after the last block, while every block still holds its
   saves (``Outside.loss_rise``). What the step holds beside the chain input while the
   blocks run (``Outside.held``) is added to the chain input's bytes.
4. The planner's dynamic program chooses, with checkpointed segments of one block each
   (a checkpoint cannot span blocks that the model's own loop calls), which blocks
   are checkpointed and how each keeps its input; the others are kept plain.

Budget: the peak activation memory of the whole training step, as the planner's
``budget`` (memory_model.py, "Budget"): every byte the step allocates beyond parameters,
buffers, gradients (allocated before the step) and optimizer state, the example
inputs included. The step is ``loss = model(**example_inputs).loss; loss.backward()``
(see :func:`run_step` for other outputs). The parts outside the blocks are measured
on the example step and taken as fixed: the peak before the first block
(``Outside.before_peak``) and after the first block's input gradient
(``Outside.after_peak``), and the loss's rise above what the blocks hold.

Limits: the blocks' other arguments (masks, position embeddings) are the example
step's, profiled as constants held by the caller: one made between two blocks is not
counted, and one that needs a gradient is profiled as if it did not. Where one would
be encoded by a codec (a float tensor autograd made), codecs are not used: a
checkpoint would keep an encoded copy of it. The plan is for the example batch's
shapes, and for one call of each block per step (Hugging Face: ``use_cache=False``).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch
from torch import nn

from .._torch import pytree
from ..codecs import EXPECTED_GRADIENT_SQNR_DB, LOSSY_CODECS
from ..devices import host_is_separate
from ..errors import ConfigError
from ..runtime.keep_rules import modifies_input, should_encode
from ..text import format_table, mib, ms
from .block_options import BlockMeasurer, candidate_options, model_terms
from .block_solver import BlockTable, fastest, predicted_peak, smallest
from .instrumented_step import TensorSpec, backward_from, isolated_steps
from .live_bytes import LiveBytes, allocation_bytes
from .memory_model import CostModel
from .plans import DEFAULT_ALLOW, LEVER_CODECS, infeasible_message, keep_options
from .profiler import LayerProfile, Profile, profile

# ------------------------------------------------------------------ the example step


def run_step(model: nn.Module, example_inputs, loss: Optional[Callable] = None) -> torch.Tensor:
    """The forward of the training step a block plan is for: ``model(**example_inputs)``
    for a dict, ``model(*example_inputs)`` for a tuple or list, ``model(example_inputs)``
    for a tensor; returns the loss, the tensor the backward starts from: ``loss(output)``
    where a loss function is given, else the output itself if a tensor, else its
    ``loss`` (a Hugging Face ``ModelOutput``, a dict), else its first item. Nothing
    else of the output is kept."""
    if isinstance(example_inputs, dict):
        output = model(**example_inputs)
    elif isinstance(example_inputs, (tuple, list)):
        output = model(*example_inputs)
    else:
        output = model(example_inputs)
    return _loss_of(output if loss is None else loss(output))


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


# ------------------------------------------------------------- 1. the blocks' calls


class _Call:
    """One recorded call of a block: the leaves of ``(args, kwargs)``, how to rebuild
    them, which leaf is the hidden state, and the hidden-state output."""

    def __init__(self, args: tuple, kwargs: dict):
        self.leaves, self.spec = pytree.tree_flatten((args, kwargs))
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
                lambda m, args, kwargs, fqn=fqn: self._enter(fqn, args, kwargs), with_kwargs=True, prepend=True))
            self._handles.append(module.register_forward_hook(
                lambda m, args, output, fqn=fqn: self._exit(fqn, output)))

    def _enter(self, fqn: str, args: tuple, kwargs: dict) -> None:
        self.calls[fqn].append(_Call(args, kwargs))
        self.order.append(fqn)

    def _exit(self, fqn: str, output) -> None:
        self.calls[fqn][-1].output = _hidden_output(output, fqn)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def _chained_calls(recorder: _CallRecorder) -> list:
    """Each block's one call, in the order they ran, with its hidden-state argument
    found: the one that is the previous block's output. Raises ConfigError unless the
    blocks ran once each, one after another, each on the previous one's output."""
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
    first = calls[0]
    first.hidden_leaf = calls[1].hidden_leaf if len(calls) > 1 else _first_tensor_leaf(first, recorder.order[0])
    if not isinstance(first.hidden, torch.Tensor):
        raise ConfigError(f"block {recorder.order[0]} gets no tensor where the next blocks get the hidden state")
    return calls


def _first_tensor_leaf(call: _Call, fqn: str) -> int:
    index = next((k for k, leaf in enumerate(call.leaves) if isinstance(leaf, torch.Tensor)), None)
    if index is None:
        raise ConfigError(f"block {fqn} was called with no tensor argument: there is no hidden state to plan for")
    return index


def record_calls(model: nn.Module, blocks: Sequence[tuple], example_inputs, loss: Optional[Callable] = None) -> list:
    """Run the example step's forward (only) and return the blocks' calls, in the order
    they ran (:func:`_chained_calls`)."""
    recorder = _CallRecorder(blocks)
    try:
        with isolated_steps(model), torch.enable_grad():
            run_step(model, example_inputs, loss)
    finally:
        recorder.remove()
    calls = _chained_calls(recorder)
    for call in calls:  # the outputs were for the chaining check only
        call.output = None
    return [(fqn, dict(blocks)[fqn], call) for fqn, call in zip(recorder.order, calls)]


class _Argument(NamedTuple):
    """Stands, among a recorded call's leaves, for a tensor kept as a buffer."""

    buffer: str


class BlockCall(nn.Module):
    """A block as a layer of a chain: called on the hidden state alone, it calls the
    block with the other arguments of its recorded call. Their tensors are buffers of
    this module (not in its state dict), so that the profile counts them as held by
    the caller, as the model's own loop holds them."""

    def __init__(self, block: nn.Module, call: _Call):
        super().__init__()
        self.block = block
        self.inplace = modifies_input(block)  # a segment starting here keeps a copy, as Checkpoint(block) does
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
        return _hidden_output(self.block(*args, **kwargs), type(self.block).__name__)


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


class _Phases:
    """Hooks that split the example step into the work before the blocks, the blocks,
    the loss (from the last block's end to its output's gradient) and the work after
    the blocks' backward, and measure each outside part with ``tracker``."""

    def __init__(self, tracker: LiveBytes, calls: list):
        self.tracker = tracker
        self.before_rise = self.held = self.chain_input = self.loss_rise = self.after_start = self.after_rise = 0
        self.blocks_end = self.loss_leaves = 0
        self.loss_hooked = self.after_measured = False
        self._first_hidden_leaf = calls[0][2].hidden_leaf
        self._arguments = []  # the blocks' other tensor arguments, held until the loss has run
        self._span = None
        self._handles = [module.register_forward_pre_hook(
            lambda m, args, kwargs, hidden_leaf=call.hidden_leaf: self._hold_arguments(args, kwargs, hidden_leaf),
            with_kwargs=True) for _, module, call in calls]
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
        self.held, self.chain_input = self.tracker.live, _storage_bytes(hidden, self.tracker.device)
        if hidden.requires_grad:
            self._handles.append(hidden.register_hook(self._blocks_backward_ends))

    def _last_ends(self, module, args, output) -> None:
        hidden = _hidden_output(output, type(module).__name__)
        if hidden.requires_grad:
            self.blocks_end = self.tracker.live - _storage_bytes(hidden, self.tracker.device)
            self._open()
            self._handles.append(hidden.register_hook(self._loss_ends))
            self.loss_hooked = True

    def _hold_arguments(self, args: tuple, kwargs: dict, hidden_leaf: int) -> None:
        # A checkpointed block keeps its arguments until its backward; the plain model
        # may free some (a mask no block saves) as its forward returns, before the loss.
        # Held here, the loss is measured as it runs with any block checkpointed.
        self._arguments += [t for k, t in enumerate(pytree.tree_leaves((args, kwargs)))
                            if isinstance(t, torch.Tensor) and k != hidden_leaf]

    def _loss_ends(self, grad) -> None:
        self.loss_rise = self._close()
        # The loss's backward may leave more than the gradient it hands the blocks: a
        # weight tied to the embeddings' holds its gradient until theirs adds to it.
        # (The last block's output is not counted in blocks_end: the loss frees it.)
        left = self.tracker.live - self.blocks_end - _storage_bytes(grad, self.tracker.device)
        self.loss_leaves = max(left, 0)
        self._arguments.clear()

    def _blocks_backward_ends(self, grad) -> None:
        self.after_start, self.after_measured = self.tracker.live, True
        self._open()

    def finish(self) -> None:
        if self._span is not None:
            self.after_rise = self._close()
        for handle in self._handles:
            handle.remove()


def _storage_bytes(t: torch.Tensor, device) -> int:
    return allocation_bytes(t.untyped_storage().nbytes(), device)


def measure_outside(model: nn.Module, calls: list, example_inputs, loss_fn: Optional[Callable] = None) -> Outside:
    """One plain training step of ``model``, its live bytes counted as the planner's
    profile counts them: what it allocates before, around and after the blocks."""
    first_call, last_fqn = calls[0][2], calls[-1][0]
    device = first_call.hidden.device
    batch = input_tensors(example_inputs)
    batch_bytes = sum(_storage_bytes(t, device) for t in {id(t.untyped_storage()): t for t in batch}.values())
    with isolated_steps(model):
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        tracker = LiveBytes(device, known=[*model.parameters(), *model.buffers(), *grads, *batch])
        phases = _Phases(tracker, calls)
        try:
            with tracker, torch.enable_grad():
                phases.start()
                loss = run_step(model, example_inputs, loss_fn)
                loss_bytes = _storage_bytes(loss, device)
                if not phases.loss_hooked:
                    raise ConfigError(f"the output of the last block, {last_fqn}, needs no gradient: there is no "
                                      "backward through the blocks to plan for")
                backward_from(loss)
                del loss
        finally:
            phases.finish()
    return Outside(before_peak=batch_bytes + phases.before_rise,
                   held=batch_bytes + phases.held - phases.chain_input,
                   loss_rise=phases.loss_rise, loss_bytes=loss_bytes, loss_leaves=phases.loss_leaves,
                   after_peak=batch_bytes + phases.after_start + phases.after_rise if phases.after_measured else 0)


# ------------------------------------------------------------- 3. the chain's profile


def block_chain(calls: list) -> nn.Sequential:
    """The blocks as a chain of :class:`BlockCall` s, called on the hidden state alone."""
    return nn.Sequential(*(BlockCall(module, call) for _, module, call in calls))


def chain_profile(chain: nn.Sequential, calls: list, outside: Outside) -> Profile:
    """The profile of the blocks as a chain, then the loss as its last layer; the chain
    input's bytes include what the step holds beside it."""
    blocks = profile(chain, (calls[0][2].hidden,), stored_saves=False)  # blocks in the stored segment run plain
    return dataclasses.replace(
        blocks,
        layers=blocks.layers + (_loss_layer(blocks, outside),),
        input_bytes=blocks.input_bytes + outside.held,
        output_bytes=outside.loss_bytes,
        output_saved_by=None,
        # Held through the blocks' backward, as the planner holds an output's gradient.
        output_grad_bytes=outside.loss_leaves - outside.loss_bytes,
        # The loss is the chain's last layer here (its rise measured in the model's
        # step); after it comes only the backward from the loss itself.
        loss_rise=0,
    )


def _loss_layer(blocks: Profile, outside: Outside) -> LayerProfile:
    """The loss as a layer that saves nothing and is never checkpointed (it is not a
    block): on the last block's output, it rises by ``outside.loss_rise`` (its forward
    and backward, measured together) and hands back that output's gradient."""
    return LayerProfile.saving_nothing(
        "loss", "after the blocks", input_bytes=blocks.output_bytes, dense_input_bytes=blocks.output_grad_bytes,
        input_grad_bytes=blocks.output_grad_bytes, input_saved_by=blocks.output_saved_by,
        output_bytes=outside.loss_bytes, forward_rise=outside.loss_rise)


# ------------------------------------------------------------------ 4. the plan


@dataclass(frozen=True)
class BlockPlan:
    """What :func:`actsave.wrap` does to each block, with the model's predictions.

    ``blocks[i]`` is the fully qualified name of the i-th block to run; ``options[i]``
    is None where that block is kept plain (autograd stores its activations), else the
    :class:`~actsave.runtime.keep_modes.BlockOption` its :class:`~actsave.Checkpoint`
    runs with (what it keeps, by which codec, where). Bytes are peak activation memory
    of the whole step (module docstring, "Budget"): ``predicted_peak_bytes`` for this
    plan, ``plain_peak_bytes`` for the plain model, ``smallest_peak_bytes`` the least
    any block plan of the levers searched reaches.

    ``predicted_step_seconds`` is the planner's time of the blocks' part of the step
    under this plan: their forwards, backwards, recomputes, codecs and copies, as the
    example step profiled them; ``plain_step_seconds`` the same with every block plain.
    The work outside the blocks (embeddings, masks, head, loss), the same under any
    plan, is in neither: their difference is what the plan is predicted to add.
    """

    blocks: tuple
    options: tuple
    budget: int
    predicted_peak_bytes: int
    plain_peak_bytes: int
    smallest_peak_bytes: int
    predicted_step_seconds: float
    plain_step_seconds: float
    modules: tuple = dataclasses.field(repr=False, compare=False)  # the blocks themselves

    @property
    def checkpointed(self) -> list:
        """Names of the blocks that are not kept plain."""
        return [name for name, option in zip(self.blocks, self.options) if option is not None]

    def __str__(self) -> str:
        head = (f"block plan for {len(self.blocks)} blocks, {len(self.checkpointed)} checkpointed: predicted peak "
                f"activation memory {mib(self.predicted_peak_bytes)} MiB (budget {mib(self.budget)} MiB; plain "
                f"{mib(self.plain_peak_bytes)} MiB, smallest {mib(self.smallest_peak_bytes)} MiB); the blocks' "
                f"predicted time {ms(self.predicted_step_seconds)} ms a step (plain {ms(self.plain_step_seconds)} ms)")
        rows = [["block", "name", "keeps", "recomputes", "codec", "where"]]
        for i, (name, option) in enumerate(zip(self.blocks, self.options)):
            rows.append([str(i), name, *_described(option)])
        return head + "\n" + format_table(rows)


def _described(option) -> list:
    """(keeps, recomputes, codec, where) of a block's row in a printed plan."""
    if option is None:
        return ["saves (plain)", "nothing", "none", "device"]
    keeps = {"inputs": "inputs", "selective": "inputs, linear and attention outputs", "saves": "saves",
             "linear_inputs": "saves (linear inputs by the codec)"}[option.keep]
    recomputes = {"inputs": "everything", "selective": "norms, activations"}.get(option.keep, "nothing")
    return [keeps, recomputes, option.policy.codec.name, "host" if option.policy.offload else "device"]


# Levers a block plan has beyond a chain plan's: a block may recompute selectively.
BLOCK_LEVERS = ("selective",)


def plan_block_stack(model: nn.Module, blocks: Sequence[tuple], budget, example_inputs,
                     allow: Sequence[str], min_sqnr_db: float | None, loss: Optional[Callable] = None) -> BlockPlan:
    """The fastest :class:`BlockPlan` for ``blocks`` ((fqn, module) of each selected
    block) whose predicted peak fits ``budget`` (module docstring; NOTE [ Block options
    priced ] in block_options.py)."""
    return BlockPlanner(model, blocks, example_inputs, allow, min_sqnr_db, loss).plan(budget)


class BlockPlanner:
    """The example step of ``blocks`` profiled and every block's options priced once
    (steps 1 to 4 of the module docstring), for plans at any number of budgets
    (:meth:`plan`): what ``bench/frontier.py`` sweeps, and :func:`plan_block_stack` runs
    once."""

    def __init__(self, model: nn.Module, blocks: Sequence[tuple], example_inputs, allow: Sequence[str] = None,
                 min_sqnr_db: float | None = None, loss: Optional[Callable] = None):
        self.calls = record_calls(model, blocks, example_inputs, loss)
        self.levers, self.codecs, self._codecs_usable = _levers_for(self.calls, allow, min_sqnr_db)
        self.min_sqnr_db = min_sqnr_db
        outside = measure_outside(model, self.calls, example_inputs, loss)
        self.chain = block_chain(self.calls)
        self.profile = chain_profile(self.chain, self.calls, outside)
        self.fixed = max(outside.before_peak, outside.after_peak)  # what the step needs outside the blocks
        self._measurer = BlockMeasurer(self.chain, [TensorSpec.of(call.hidden) for _, _, call in self.calls],
                                       self.profile.device, self.profile.timed)
        self.table = _table(self.chain, self.calls, self.profile, self.levers, self.codecs, self._measurer)
        self._least = smallest(self.table)

    @property
    def smallest_peak_bytes(self) -> int:
        """The least peak any plan of these levers reaches."""
        return int(max(self.fixed, self._least.peak))

    @property
    def plain_peak_bytes(self) -> int:
        return int(max(self.fixed, predicted_peak(self.table, (0,) * len(self.calls))))

    def plan(self, budget) -> BlockPlan:
        """The fastest plan whose predicted peak fits ``budget``; ConfigError below the
        smallest, naming the levers searched and the codecs that would lower it."""
        if budget < self.smallest_peak_bytes:
            raise ConfigError(self._infeasible(budget))
        chosen = fastest(self.table, budget)
        return BlockPlan(
            blocks=tuple(fqn for fqn, _, _ in self.calls),
            options=tuple(self.table.labels[a][k] for a, k in enumerate(chosen.choices)),
            budget=int(budget),
            predicted_peak_bytes=int(max(self.fixed, chosen.peak)),
            plain_peak_bytes=self.plain_peak_bytes,
            smallest_peak_bytes=self.smallest_peak_bytes,
            predicted_step_seconds=chosen.seconds,
            plain_step_seconds=self.table.base_seconds,
            modules=tuple(module for _, module, _ in self.calls),
        )

    def _infeasible(self, budget) -> str:
        """The error of a budget no block plan fits (plans.infeasible_message), each lossy
        codec not allowed priced by the same program with it allowed too (the options
        measured once, for every codec)."""
        lower = {}
        if self._codecs_usable:
            for codec in LOSSY_CODECS:
                if codec in self.codecs or (self.min_sqnr_db is not None
                                            and EXPECTED_GRADIENT_SQNR_DB[codec] < self.min_sqnr_db):
                    continue
                with_codec = (*self.codecs, codec)
                table = _table(self.chain, self.calls, self.profile, self.levers, with_codec, self._measurer)
                lower[codec] = max(self.fixed, smallest(table).peak)
        named = self.levers + tuple(lever for lever in LEVER_CODECS if lever in self.codecs)
        return infeasible_message("block plan", budget, named, self.min_sqnr_db, max(self.fixed, self._least.peak),
                                  "one option per block, outside work included", lower)


def _table(chain: nn.Sequential, calls: list, profile: Profile, levers: tuple, codecs: tuple,
           measurer: Optional[BlockMeasurer] = None) -> BlockTable:
    """Every block's options priced (block_options.py), plain first, and the loss;
    ``measurer``: one that may have measured some already."""
    candidates = candidate_options(levers, codecs, profile.device)
    policies = sorted({option.policy for option in candidates if option.keep == "inputs"},
                      key=lambda policy: (policy.codec.name, policy.offload))
    model = CostModel(profile, policies, stored_codecs=("none",), store_middle=True)
    if measurer is None:
        measurer = BlockMeasurer(chain, [TensorSpec.of(call.hidden) for _, _, call in calls], profile.device,
                                 profile.timed)
    options = [None, *candidates]
    rows, labels = [], []
    for a in range(len(calls)):
        row, names = [], []
        for option in options:
            pair = tuple(_terms(model, measurer, a, option, held) for held in (False, True))
            if pair[0] is not None or pair[1] is not None:
                row.append(pair)
                names.append(option)
        rows.append(tuple(row))
        labels.append(tuple(names))
    loss = tuple(model.stored_working_set(len(calls), 0, held) for held in (False, True))
    base = float(model.forward_s_before[-1] + model.backward_s_before[-1])
    return BlockTable(tuple(rows), loss, float(model.chain_input), base, tuple(labels))


def _terms(model: CostModel, measurer: BlockMeasurer, a: int, option, held: bool):
    if option is None or option.keep == "inputs":
        return model_terms(model, a, option, held)
    return measurer.terms(model, a, option, held)


def _levers_for(calls: list, allow: Sequence[str] | None, min_sqnr_db) -> tuple:
    """(the levers to plan with, the lossy codecs, whether codecs may be used at all):
    ``allow``, by default the exact levers of the blocks' device (recompute, selective,
    and offload on CUDA; codecs only when named). "offload" on a CPU model is refused:
    the host's memory is the device's. Codecs and offload are left out when a block
    gets a tensor argument besides its hidden state that a codec would encode (one
    autograd made): a checkpoint would keep an encoded copy of it, which the chain's
    profile does not count."""
    device = calls[0][2].hidden.device
    separate_host = host_is_separate(device)
    if allow is None:
        allow = [lever for lever in (*DEFAULT_ALLOW, *BLOCK_LEVERS) if separate_host or lever != "offload"]
    elif not isinstance(allow, str) and "offload" in allow and not separate_host:
        raise ConfigError(
            f"allow={tuple(allow)} names 'offload', but the blocks run on {device}, whose memory is the host's: "
            "offload would move nothing off the device. Leave 'offload' out of allow (or plan on a CUDA device)")
    chain_levers = [lever for lever in allow if lever not in BLOCK_LEVERS] if not isinstance(allow, str) else allow
    keep_options(chain_levers, min_sqnr_db, device)  # checks allow and min_sqnr_db
    encoded = any(should_encode(leaf) for _, _, call in calls
                  for k, leaf in enumerate(call.leaves)
                  if isinstance(leaf, torch.Tensor) and k != call.hidden_leaf)
    if encoded:
        allow = [lever for lever in allow if lever in ("recompute", *BLOCK_LEVERS)]
    codecs = tuple(sorted({LEVER_CODECS[lever] for lever in allow if lever in LEVER_CODECS}))
    codecs = tuple(c for c in codecs if min_sqnr_db is None or EXPECTED_GRADIENT_SQNR_DB[c] >= min_sqnr_db)
    levers = tuple(lever for lever in allow if lever in ("recompute", "offload", *BLOCK_LEVERS))
    return levers, codecs, not encoded
