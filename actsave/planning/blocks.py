"""Plans for a model whose blocks run one after another: the decoder layers of a
transformer, called by the model's own loop (``for layer in self.layers: h =
layer(h, mask=..., position_embeddings=...)``), with work before them (embeddings,
masks) and after them (final norm, head, loss).

    plan = actsave.plan_blocks(model, LlamaDecoderLayer, budget=B, example_inputs=batch)
    print(plan)                     # per block: kept plain, or checkpointed and how
    actsave.wrap(model, plan)       # or in one call: wrap(model, ..., budget=B, example_inputs=batch)

How (the steps of :func:`plan_block_stack`; 1 in block_calls.py, 2 in block_step.py):

1. A forward of the example step records each selected block's call: its arguments,
   and which of them is the hidden state. The blocks must each run once, in turn, each
   one's hidden-state output being the next one's hidden-state input.
2. One plain training step, its live bytes counted (:class:`LiveBytes`, as the
   planner's profile counts them), measures what happens outside the blocks:
   :class:`Outside`, with what the caller does with the blocks' outputs besides the
   hidden state (other_outputs.py, NOTE [ Outputs the caller holds ]).
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
(see :func:`block_step.run_step` for other outputs). The parts outside the blocks
are measured on the example step and taken as fixed: the peak before the first block
(``Outside.before_peak``) and after the first block's input gradient
(``Outside.after_peak``), and the loss's rise above what the blocks hold.

Limits: the blocks' other arguments (masks, position embeddings) are the example
step's, profiled as held by the caller (one that needs a gradient needing one): one
made between two blocks is not counted. Where one would
be encoded by a codec (a float tensor autograd made), codecs are not used: a
checkpoint would keep an encoded copy of it. The plan is for the example batch's
shapes, and for one call of each block per step (Hugging Face: ``use_cache=False``).
"""
from __future__ import annotations

import contextlib
import dataclasses
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from .._torch_graphs import uncompiled
from ..checks import check_loss_function
from ..codecs import EXPECTED_GRADIENT_SQNR_DB, LOSSY_CODECS
from ..devices import host_is_separate
from ..errors import ActsaveError, ConfigError
from ..runtime.keep_rules import should_encode
from ..runtime.keep_modes import BlockOption
from ..runtime.kept_ops import DEFAULT_KEPT_OPS
from ..text import format_table, mib, ms
from .argument_grads import argument_gradients
from .block_options import BlockMeasurer, candidate_options, model_terms, options_at
from .block_solver import BlockTable, fastest, predicted_peak, smallest
from .block_calls import BlockCall, as_the_blocks_ran, record_calls
from .block_step import Outside, measure_outside
from .kept_subsets import KeptSubsets
from .memory_model import CostModel
from .other_outputs import OtherOutputs
from .plans import DEFAULT_ALLOW, LEVER_CODECS, infeasible_message, keep_options
from .profiler import LayerProfile, Profile, profile
from .tensor_specs import TensorSpec

# ------------------------------------------------------------- 3. the chain's profile


def block_chain(calls: list, outside: Optional[Outside] = None) -> nn.Sequential:
    """The blocks as a chain of :class:`BlockCall` s, called on the hidden state alone;
    with ``outside``, their backward gets the gradients of the other outputs the step
    gives one (NOTE [ Outputs the caller holds ], other_outputs.py)."""
    others = None if outside is None else outside.other_outputs
    return nn.Sequential(*(BlockCall(module, call, () if others is None else others.gradients[a])
                           for a, (_, module, call) in enumerate(calls)))


def chain_profile(chain: nn.Sequential, calls: list, outside: Outside) -> Profile:
    """The profile of the blocks as a chain, then the loss as its last layer; the chain
    input's bytes include what the step holds beside it."""
    # stored_saves=False: blocks in the plain segment run plain.
    blocks = profile(chain, (calls[0][2].hidden,), stored_saves=False, loss=outside.profiled_loss)
    return dataclasses.replace(
        blocks,
        layers=blocks.layers + (_loss_layer(blocks, outside),),
        input_bytes=blocks.input_bytes + outside.held,
        output_bytes=outside.loss_bytes,
        output_saved_by=None,
        # What the step's loss leaves, held through the blocks' backward as the planner
        # holds an output's gradient; the profiled loss holds nothing of the step's.
        output_grad_held=True, loss_held_bytes=0, output_grad_bytes=outside.loss_leaves - outside.loss_bytes,
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
        input_grad_bytes=outside.output_grad_bytes(blocks), input_saved_by=blocks.output_saved_by,
        output_bytes=outside.loss_bytes, forward_rise=outside.loss_rise)


# ------------------------------------------------------------------ 4. the plan


@dataclass(frozen=True)
class BlockPlan:
    """What :func:`actsave.wrap` does to each block, with the model's predictions.

    ``blocks[i]`` is the fully qualified name of the i-th block to run; ``options[i]``
    is None where that block is kept plain (autograd stores its activations), else the
    :class:`~actsave.runtime.keep_modes.BlockOption` its :class:`~actsave.Checkpoint`
    runs with (what it keeps, by which codec, where). Bytes are peak activation memory
    of the whole step (module docstring, "Budget"): ``budget`` the bytes it was planned
    under, ``predicted_peak_bytes`` for this plan, ``plain_peak_bytes`` for the plain model, ``smallest_peak_bytes`` the least
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
    # Weak references to the blocks themselves, () once pickled: a plan kept (printed,
    # sent to other ranks) does not keep a deleted model's weights and gradients alive.
    modules: tuple = dataclasses.field(repr=False, compare=False)
    types: tuple = dataclasses.field(default=(), repr=False)  # "module.QualName" of each block
    # Blocks of those types the planned model had and the plan left out (a filter chose
    # others): applied to another instance, only blocks beyond them are warned of.
    left_out: tuple = dataclasses.field(default=(), repr=False)
    # Each block's hidden state in the example step, (place, shape, element size) or
    # None, which the blocks it wraps check their calls against: NOTE [ A block plan's
    # input ].
    inputs: tuple = dataclasses.field(default=(), repr=False, compare=False)

    def __post_init__(self):
        blocks, options = tuple(self.blocks), tuple(self.options)
        if len(blocks) != len(options) or not all(isinstance(name, str) for name in blocks):
            raise ConfigError(f"BlockPlan(blocks={self.blocks!r}, options={self.options!r}): pass one block name "
                              "(as named_modules() spells it) and one option per block. Make block plans with "
                              "actsave.plan_blocks, or wrap(model, Block, budget=...)")
        bad = [option for option in options if option is not None and not isinstance(option, BlockOption)]
        if bad:
            raise ConfigError(f"BlockPlan(options=...): each option is None (the block kept plain) or a "
                              f"BlockOption, as plan_blocks makes them, not {bad[0]!r}. Make block plans with "
                              "actsave.plan_blocks, or wrap(model, Block, budget=...)")
        object.__setattr__(self, "blocks", blocks)
        object.__setattr__(self, "options", options)

    def __getstate__(self) -> dict:
        # Pickled (sent to another rank, saved) without the blocks: their weights, FSDP2's
        # sharded parameters. wrap(model, plan) then finds the blocks by name (wrappers._planned_blocks).
        return {**self.__dict__, "modules": ()}

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


def type_name(module: nn.Module) -> str:
    """A block's type as a plan records it: its class's module and qualified name."""
    return _name(type(uncompiled(module)))


def of_type(module: nn.Module, name: str) -> bool:
    """Whether ``module`` is of the type a plan recorded as ``name``, a subclass
    included (FSDP2's ``fully_shard`` gives a block a subclass of its own)."""
    return name in {_name(cls) for cls in type(uncompiled(module)).__mro__}


def _name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _described(option) -> list:
    """(keeps, recomputes, codec, where) of a block's row in a printed plan."""
    if option is None:
        return ["saves", "nothing", "none", "device"]  # plain: autograd's saves as they are
    keeps = {"inputs": "inputs", "selective": "inputs, nn.Linear and attention outputs", "saves": "saves",
             "linear_inputs": "saves (linear inputs by the codec)"}[option.keep]
    recomputes = {"inputs": "everything", "selective": "norms, activations"}.get(option.keep, "nothing")
    if option.keep == "selective" and option.policy.lossy:  # NOTE [ Attention's saves agree ]
        keeps, recomputes = "inputs, nn.Linear outputs", "norms, activations, attention"
    elif option.keep == "selective" and option.ops != DEFAULT_KEPT_OPS:  # NOTE [ Kept subsets ]
        kept = ["attention" if name == "scaled_dot_product_attention" else name for name in option.ops.names()]
        keeps, recomputes = "inputs, outputs of " + ", ".join(kept), "the rest"
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
        check_loss_function(loss)
        self.calls = record_calls(model, blocks, example_inputs, loss)
        self.levers, self.codecs, self._codecs_usable = _levers_for(self.calls, allow, min_sqnr_db)
        self.min_sqnr_db = min_sqnr_db
        # The codecs allow names that min_sqnr_db leaves out, which an error names.
        named = {LEVER_CODECS[lever] for lever in (allow or ()) if lever in LEVER_CODECS}
        self._below_sqnr = tuple(sorted(named - set(self.codecs))) if self._codecs_usable else ()
        self.outside = measure_outside(model, self.calls, example_inputs, loss)
        self.chain = block_chain(self.calls, self.outside)
        with _priced_alone(self.calls), as_the_blocks_ran(self.calls):
            self.profile = chain_profile(self.chain, self.calls, self.outside)
            self._measurer = BlockMeasurer(self.chain, [TensorSpec.of(call.hidden) for _, _, call in self.calls],
                                           self.profile.device, self.profile.timed, self.profile.layers,
                                           self.outside.output_grad_layout)
            self.table = _table(self.chain, self.calls, self.profile, self.levers, self.codecs, self._measurer,
                                self.outside)
        self.fixed = max(self.outside.before_peak, self.outside.after_peak)  # what the step needs outside the blocks
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
            modules=tuple(weakref.ref(module) for _, module, _ in self.calls),
            types=tuple(type_name(module) for _, module, _ in self.calls),
            inputs=tuple(call.hidden_input for _, _, call in self.calls),
        )

    def _infeasible(self, budget) -> str:
        """The error of a budget no block plan fits (plans.infeasible_message), each lossy
        codec not allowed priced by the same program with it allowed too (the options
        measured once, for every codec)."""
        lower, below = {}, {}
        if self._codecs_usable:
            for codec in LOSSY_CODECS:
                if codec in self.codecs:
                    continue
                with_codec = (*self.codecs, codec)
                with self._measurer.quietly():
                    table = _table(self.chain, self.calls, self.profile, self.levers, with_codec, self._measurer,
                                   self.outside)
                if codec in self._below_sqnr:
                    below[codec] = max(self.fixed, smallest(table).peak)
                elif self.min_sqnr_db is None or EXPECTED_GRADIENT_SQNR_DB[codec] >= self.min_sqnr_db:
                    lower[codec] = max(self.fixed, smallest(table).peak)
        named = self.levers + tuple(lever for lever in LEVER_CODECS if lever in self.codecs)
        left_out = "".join(
            f" allow names {codec!r} too, which min_sqnr_db={self.min_sqnr_db} leaves out (its expected gradient "
            f"SQNR is {EXPECTED_GRADIENT_SQNR_DB[codec]:g} dB): with it the smallest budget is {int(least):,} bytes "
            f"({mib(least)} MiB)." for codec, least in below.items())
        message = infeasible_message("block plan", budget, named, self.min_sqnr_db, max(self.fixed, self._least.peak),
                                     "one option per block, outside work included", lower, left_out)
        if not self._codecs_usable:
            message += (" (Codecs and offload are left out: a block gets a tensor argument besides its hidden state "
                        "that autograd made, which a checkpoint would keep encoded and the plan does not count.)")
        return message


@contextlib.contextmanager
def _priced_alone(calls: list):
    """While active, the errors a block raises run alone (as the planner prices each
    one, on the arguments the example step called it with) where it reads what another
    block set (an attribute it finds missing, or a graph another block's backward freed)
    say so. Others pass as they are (actsave's own, out of memory)."""
    try:
        yield
    except (AttributeError, RuntimeError) as error:
        if isinstance(error, (torch.OutOfMemoryError, ActsaveError)):
            raise
        kinds = sorted({type(block).__name__ for _, block, _ in calls})
        raise ConfigError(
            f"a block plan prices each block alone, on the arguments the example step called it with, and a block "
            f"({', '.join(kinds)}) raised there: {type(error).__name__}: {error}. If a block reads what another "
            "block set in the same forward (an attribute of another module: a cache shared across layers), it "
            "cannot run alone: pass what it reads as an argument, or wrap the blocks without a budget "
            "(wrap(model, Block, keep='selective'))") from error


def _table(chain: nn.Sequential, calls: list, profile: Profile, levers: tuple, codecs: tuple,
           measurer: Optional[BlockMeasurer] = None, outside: Optional[Outside] = None) -> BlockTable:
    """Every block's options priced (block_options.py), plain first, and the loss;
    ``measurer``: one that may have measured some already; ``outside``: the step's,
    for the blocks' other outputs its caller holds (NOTE [ Outputs the caller holds ],
    other_outputs.py), none without it."""
    candidates = candidate_options(levers, codecs, profile.device)
    policies = sorted({option.policy for option in candidates if option.keep == "inputs"},
                      key=lambda policy: (policy.codec.name, policy.offload))
    model = CostModel(profile, policies, stored_codecs=("none",), plain_middle=True)
    if measurer is None:
        measurer = BlockMeasurer(chain, [TensorSpec.of(call.hidden) for _, _, call in calls], profile.device,
                                 profile.timed, profile.layers, None if outside is None else outside.output_grad_layout)
    options = [None, *candidates]
    other_outputs = None if outside is None else outside.other_outputs
    until = "step" if outside is None else outside.chain_input_until  # NOTE [ A chain input the step frees ]
    freed = 0.0 if until == "step" else float(model.input[0])
    pending = argument_gradients(calls, profile.device,  # NOTE [ Gradients of the blocks' arguments ]
                                 tuple(block.argument_gradient_bytes for block in chain))
    subsets = KeptSubsets(measurer) if "selective" in levers else None  # NOTE [ Kept subsets ]
    rows, labels = [], []
    for a in range(len(calls)):
        row, names = [], []
        at = options_at(options, chain, a)
        if subsets is not None and any(option is not None and option.keep == "selective" for option in at):
            at += subsets.at(a)
        for option in at:
            backward = pending[a] - _saved_output(profile, a, option)
            pair = tuple(_with_backward_bytes(_with_other_outputs(_terms(model, measurer, a, option, held),
                                                                  other_outputs, a, option), backward)
                         for held in (False, True))
            if freed and (a == 0 or until == "forward"):
                keeps = a == 0 and _keeps_input_on_device(option, measurer, profile.layers[0])
                pair = tuple(_with_chain_input(terms, freed, keeps) for terms in pair)
            if pair[0] is not None or pair[1] is not None:
                row.append(pair)
                names.append(option)
        rows.append(tuple(row))
        labels.append(tuple(names))
    loss = tuple(model.plain_working_set(len(calls), 0, held) + (freed if until == "forward" else 0.0)
                 for held in (False, True))
    base = float(model.forward_s_before[-1] + model.backward_s_before[-1])
    return BlockTable(tuple(rows), loss, float(model.chain_input) - freed, base, tuple(labels))


def _terms(model: CostModel, measurer: BlockMeasurer, a: int, option, held: bool):
    if option is None or option.keep == "inputs":
        terms = model_terms(model, a, option, held)
        if terms is not None and option is not None and measurer.timed and not option.policy.offload:
            # Its time measured as the other options' (NOTE [ Block options priced ]).
            seconds = measurer.seconds(a, option)
            terms = None if seconds is None else dataclasses.replace(terms, seconds=seconds)
        return terms
    return measurer.terms(model, a, option, held)


def _with_other_outputs(terms, others: Optional[OtherOutputs], a: int, option):
    """``terms`` with block ``a``'s other outputs its caller holds in its R: those its
    saves do not hold where it is plain, all of them else; and in its forward event,
    earlier blocks' that the caller holds through its forward only (NOTE [ Outputs the
    caller holds ], other_outputs.py)."""
    if terms is None or others is None:
        return terms
    kept = others.kept_unsaved[a] if option is None else others.kept[a]
    return dataclasses.replace(terms, kept=terms.kept + kept, forward_event=terms.forward_event + others.passing[a])


# NOTE [ A chain input the step frees ]
# The chain's memory model counts its input X at every event: a chain's caller holds
# it (memory_model.py). A block stack's first input is the model's own (the embeddings'
# output), which the plain step drops where no op of the first block saves it (a norm
# that saves its centred input; an embedding that needs no gradient, as under LoRA):
# as the first block returns, or as the model's forward returns (Hugging Face's
# decoders hold `inputs_embeds` until then). Counted as held, a checkpoint of the first
# block, which keeps it to its backward, was priced as keeping nothing: one hidden state
# below what it measured, over its budget. So the example step watches that input
# (block_step.py, _Phases) and says how long it lived: the whole step (counted in X, as
# before), the first block, or the blocks' forward (gone by the time the loss's gradient
# reaches them). Where it did not live through the step it leaves X, and it is counted
# in the first block's forward event and, where that block's option keeps it itself on
# the device, in its R and backward event; where it lived through the forward, also in
# every later block's forward event and the loss's.


def _keeps_input_on_device(option, measurer: BlockMeasurer, first: LayerProfile) -> bool:
    """Whether the first block under ``option`` keeps its input itself on the device:
    a checkpoint's exact input (not a private copy for an in-place first layer), or a
    measured option's, as its step held it."""
    if option is None:
        return False  # the step freed it: the plain block saves none of it
    if option.keep == "inputs":
        return not option.policy.lossy and not option.policy.offload and not first.modifies_input
    measured = measurer.measured(0, option)
    return measured is not None and measured.input_kept


def _with_chain_input(terms, x_bytes: float, kept: bool):
    """A block's ``terms`` with the chain input, which the step frees, in its forward
    event, and where ``kept``, in R and its backward event (NOTE [ A chain input the
    step frees ])."""
    if terms is None:
        return None
    held = x_bytes if kept else 0.0
    return dataclasses.replace(terms, kept=terms.kept + held, forward_event=terms.forward_event + x_bytes,
                               backward_event=terms.backward_event + held)


def _with_backward_bytes(terms, extra: int):
    """``terms`` with ``extra`` bytes in its backward event: argument gradients pending (NOTE
    [ Gradients of the blocks' arguments ]) less an output counted twice (_saved_output)."""
    if terms is None or not extra:
        return terms
    return dataclasses.replace(terms, backward_event=terms.backward_event + extra)


def _saved_output(profile: Profile, a: int, option) -> int:
    """The last block's output where that plain block alone saves it (a final tanh): one of
    the loss's leaves (O, in every block's backward), and in its own its saves count it too."""
    last_block, loss = len(profile.layers) - 2, profile.layers[-1]
    return loss.input_bytes if option is None and a == last_block and loss.input_saved_by == (a, a) else 0


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
    if isinstance(allow, str) or not isinstance(allow, (Iterable, type(None))):
        keep_options(allow, min_sqnr_db, device, BLOCK_LEVERS)  # raises: allow is a tuple of lever names
    if allow is None:
        allow = [lever for lever in (*DEFAULT_ALLOW, *BLOCK_LEVERS) if separate_host or lever != "offload"]
    elif "offload" in allow and not separate_host:
        raise ConfigError(
            f"allow={tuple(allow)} names 'offload', but the blocks run on {device}, whose memory is the host's: "
            "offload would move nothing off the device. Leave 'offload' out of allow (or plan on a CUDA device)")
    chain_levers = [lever for lever in allow if lever not in BLOCK_LEVERS]
    keep_options(chain_levers, min_sqnr_db, device, BLOCK_LEVERS)  # checks allow and min_sqnr_db
    encoded = any(should_encode(leaf) for _, _, call in calls
                  for k, leaf in enumerate(call.leaves)
                  if isinstance(leaf, torch.Tensor) and k != call.hidden_leaf)
    if encoded:
        allow = [lever for lever in allow if lever in ("recompute", *BLOCK_LEVERS)]
    codecs = tuple(sorted({LEVER_CODECS[lever] for lever in allow if lever in LEVER_CODECS}))
    codecs = tuple(c for c in codecs if min_sqnr_db is None or EXPECTED_GRADIENT_SQNR_DB[c] >= min_sqnr_db)
    levers = tuple(lever for lever in allow if lever in ("recompute", "offload", *BLOCK_LEVERS))
    return levers, codecs, not encoded
