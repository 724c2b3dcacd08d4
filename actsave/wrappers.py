"""Checkpointing for models that are not one chain: a function, a module, or every
matching submodule of a model, all alike or, within a memory budget, each as
:func:`plan_blocks` chooses (planning/blocks.py).

All three keep only their inputs and recompute in backward, exactly as a segment of
:class:`~actsave.CheckpointedSequential` does (same ``compress`` / ``offload``
options), with the semantics of non-reentrant ``torch.utils.checkpoint.checkpoint``:
non-tensor and keyword arguments, outputs of any structure, inputs that need no grad.

The keywords of ``torch.utils.checkpoint.checkpoint`` keep torch's meaning
(runtime/recompute_options.py): :func:`checkpoint` takes them all (``use_reentrant`` only as
``False``/``None``, ``context_fn`` not at all); :class:`Checkpoint` and :func:`wrap`
take those that describe the recompute, ``preserve_rng_state``, ``determinism_check``,
``debug`` and ``early_stop``, with the same defaults.
:class:`~actsave.CheckpointedSequential` always uses the defaults (RNG replayed,
saves checked): its segments are chains of layers, for which they are right.
"""
from __future__ import annotations

import dataclasses
import warnings
from typing import Callable, Optional, Union

import torch
from torch import nn

from ._torch_graphs import uncompiled, uncompiled_name
from .checks import byte_count, filter_predicate, nothing_selected, refuse_module_class
from .errors import ConfigError, not_scriptable
from .planning.blocks import BlockPlan, of_type, plan_block_stack, type_name
from .planning.planned_inputs import PlannedInput
from .planning.step_isolation import user_stacklevel
from .runtime import graph_codecs
from .runtime.compiled_calls import checkpoint_in_graph
from .runtime.function import eager_checkpointed_call
from .runtime.keep_modes import BlockOption, call_block
from .runtime.recompute_options import RecomputeOptions, check_torch_only_keywords
from .runtime.keep_rules import KeepPolicy, modifies_input
from .runtime.layers import WRAPPED_CHILD
from .transparent_wrapper import TransparentWrapper, yields_to_wrapped
from .wrap_selection import matching_blocks


def checkpoint(function: Callable, *args, compress=None, offload=False, keep="inputs", use_reentrant=None,
               preserve_rng_state=True, determinism_check="default", debug=False, early_stop=True,
               context_fn=None, **kwargs):
    """``function(*args, **kwargs)``, keeping only the arguments for backward.

    The drop-in for ``torch.utils.checkpoint.checkpoint(function, *args,
    use_reentrant=False, **kwargs)``, with the kept tensor arguments optionally
    compressed (``compress``) or offloaded (``offload``). RNG and autocast state and
    each module's train/eval mode are replayed in the recompute, and module state
    (BatchNorm's running statistics) is updated once and recomputed as the forward
    read it.

    Args:
        function: any callable; runs once in the forward and again in backward.
        *args, **kwargs: passed to ``function``, except the keywords below, which are
            ``checkpoint``'s own (as in torch: ``function`` cannot receive them).
        compress: codec of what is kept (the tensor arguments; with
            ``keep="selective"`` also the outputs it keeps; with ``keep="saves"``
            what autograd saves): ``None`` (exact) or a name from
            :func:`actsave.available_codecs`.
        offload: keep it in host memory until backward.
        keep: what is kept for backward (runtime/keep_modes.py, NOTE [ Keep modes ]):
            ``"inputs"`` (default; everything else recomputed), ``"selective"`` (also
            the outputs of linear layers and attention: only cheap ops recomputed; an
            :class:`actsave.KeptOps` names other calls), ``"saves"`` (everything,
            nothing recomputed: with ``compress`` or ``offload``) or
            ``"linear_inputs"`` (as ``"saves"``, ``compress`` on the linear layers'
            inputs only). ``"selective"`` with module types needs ``function`` to be a
            module.
        use_reentrant: ``None`` or ``False``; actsave is non-reentrant, and ``True``
            raises :class:`~actsave.ConfigError`.
        preserve_rng_state: ``True`` (default): the recompute replays the forward's
            RNG state (same Dropout masks), that of a ``torch.Generator`` passed as an
            argument too. ``False``: no RNG state is captured or
            replayed, as in torch; the recompute draws from the generators as they are
            at backward time and advances them, so random masks differ from the
            forward's. Only for functions that draw no random numbers.
        determinism_check: ``"default"``: a recomputed saved tensor whose shape,
            dtype or device differs from the forward's raises
            :class:`~actsave.RecomputeError`; ``"none"``: not checked.
        debug: ``True``: record the operators the forward and the recompute run and
            list them in the RecomputeError raised when the two do not match.
        early_stop: ``True`` (default): stop the recompute after its last saved
            tensor; ``False``: run ``function`` to its end.
        context_fn: only ``None`` or torch's ``noop_context_fn``; for selective
            checkpointing use ``keep="selective"`` or ``keep=KeptOps(...)``.

    .. warning::
        ``function`` runs again in backward and must do the same work: a recompute
        that saves a tensor of another shape, dtype or device (or another number of
        them) raises :class:`~actsave.RecomputeError`. Parameters and buffers it read
        must not change in place before backward (an optimizer step between forward
        and backward raises, as plain autograd does). With a lossy ``compress`` the
        gradients are approximate (see the README's SQNR figures).
    """
    refuse_module_class(function, "function", "checkpoint calls function(*args), which would build a new module")
    if not callable(function):
        raise ConfigError(f"function={function!r} is not callable; pass the function (or module) to "
                          "checkpoint first, then its arguments: checkpoint(function, *args, **kwargs)")
    check_torch_only_keywords(use_reentrant, context_fn)
    options = RecomputeOptions.resolve(preserve_rng_state, determinism_check, debug, early_stop)
    option = BlockOption.resolve(keep, compress, offload)
    output, _ = call_block(option, function, args, kwargs, options, modifies_input(function))
    return output


class Checkpoint(TransparentWrapper):
    """Wraps ``module`` so that its forward keeps only its inputs for backward.

    ``state_dict`` keys are those of ``module`` itself: a checkpoint saved with the
    wrapper loads without it and the other way round. Attributes not found on the
    wrapper are looked up on ``module`` and set, deleted and registered there
    (``transparent_wrapper.py``), and so are the wrapper's own public names (``module``, ``option``, ``recompute``, ``policy``,
    ``inputs_policy``, ``eager_because``) where ``module`` has an attribute of that
    name: the wrapper hides nothing of the module it wraps (``model.get_parameter``
    walks a state dict name, ``block.module.weight``, through them).

    ``compress``, ``offload``, ``keep``, ``preserve_rng_state``, ``determinism_check``,
    ``debug`` and ``early_stop`` mean what they mean for :func:`checkpoint`; ``option``
    holds the first three, resolved (a
    :class:`~actsave.runtime.keep_modes.BlockOption`). ``eager_because`` says why a
    compiled forward runs the block eagerly though its codec could be in the graph
    (its ReLU or max-pool decisions, a model that fails on meta tensors), or None
    (NOTE [ Codecs in a compiled graph ]).
    """

    def __init__(self, module: nn.Module, compress=None, offload=False, *, keep="inputs", preserve_rng_state=True,
                 determinism_check="default", debug=False, early_stop=True):
        super().__init__()
        refuse_module_class(module, "module", "Checkpoint wraps a module (a function: actsave.checkpoint)")
        if not isinstance(module, nn.Module):
            raise ConfigError(f"Checkpoint wraps an nn.Module instance; module={module!r} is a "
                              f"{type(module).__name__} (for a function, use actsave.checkpoint(function, *args))")
        self._option = BlockOption.resolve(keep, compress, offload)
        self._recompute = RecomputeOptions.resolve(preserve_rng_state, determinism_check, debug, early_stop)
        # Why a compiled forward runs this block eagerly, though its codec could be in
        # the graph; set at the root's first break (NOTE [ Codecs in a compiled graph ]).
        self._eager_because: Optional[str] = None
        self._planned_input: Optional[PlannedInput] = None  # a block plan's: NOTE [ A block plan's input ]
        self._wrap(module)  # last: from here a name the wrapper has not is the module's

    @yields_to_wrapped
    def module(self) -> nn.Module:
        """The wrapped module."""
        return self._modules[WRAPPED_CHILD]

    @yields_to_wrapped
    def option(self) -> BlockOption:
        """What it keeps and how (``keep``, ``compress``, ``offload``, resolved)."""
        return self._option

    @yields_to_wrapped
    def recompute(self) -> RecomputeOptions:
        """How it recomputes (``preserve_rng_state``, ``determinism_check``, ``debug``,
        ``early_stop``, resolved)."""
        return self._recompute

    @yields_to_wrapped
    def policy(self) -> KeepPolicy:
        """The codec and offload of what it keeps (``option.policy``)."""
        return self._option.policy

    @yields_to_wrapped
    def inputs_policy(self) -> Optional[KeepPolicy]:
        """How it keeps its inputs where it keeps only them (``keep="inputs"``), else
        None: what a compiled graph's codec hooks read (runtime/graph_codecs.py)."""
        return self._kept_inputs_policy

    @yields_to_wrapped
    def eager_because(self) -> Optional[str]:
        """Why a compiled forward runs it eagerly, or None (class docstring)."""
        return self._eager_because

    # The library reads module and inputs_policy under these names, which no wrapped
    # module's attribute takes (the public ones yield to the module's).
    @property
    def _wrapped(self) -> nn.Module:
        return self._modules[WRAPPED_CHILD]

    @property
    def _kept_inputs_policy(self) -> Optional[KeepPolicy]:
        return self._option.policy if self._option.keep == "inputs" else None

    def forward(self, *args, **kwargs):
        policy, wrapped = self._kept_inputs_policy, self._wrapped
        if torch.compiler.is_compiling() and policy is not None and not torch.compiler.is_exporting() and \
                graph_codecs.blocks_in_graph(policy, self._eager_because):
            args, kwargs = graph_codecs.inputs_copied(args, kwargs, policy)
            with graph_codecs.block_annotation(policy):
                output = checkpoint_in_graph(wrapped, args, kwargs, self._recompute, eager_call=eager_checkpointed_call,
                                             eager_args=(policy, modifies_input(wrapped), self._recompute))
            return graph_codecs.output_copied(output)
        if self._planned_input is not None:
            self._planned_input.check(args, kwargs)
        output, _ = call_block(self._option, wrapped, args, kwargs, self._recompute, modifies_input(wrapped),
                               eager_because=self._eager_because)
        return output

    def __prepare_scriptable__(self):
        raise not_scriptable(self)

    def extra_repr(self) -> str:
        recompute = self._recompute.describe()
        policy = self._option.policy
        keep = "" if self._option.keep == "inputs" else f", keep={self._option.keep!r}"
        return (f"compress={policy.codec.name!r}, offload={policy.offload}{keep}"
                + (", " + recompute if recompute else ""))


FilterSpec = Union[Callable[[nn.Module, str], bool], type, tuple]


def wrap(model: nn.Module, filter_fn: FilterSpec | BlockPlan, compress=None, offload=False, *, keep="inputs",
         budget=None, example_inputs=None, loss=None, allow=None, min_sqnr_db=None, preserve_rng_state=True,
         determinism_check="default", debug=False, early_stop=True) -> nn.Module:
    """Replace, in place, each submodule of ``model`` that ``filter_fn`` selects by a
    :class:`Checkpoint` of it, and return ``model``.

    ``filter_fn`` is ``callable(module, fqn) -> bool`` or an ``nn.Module`` subclass
    (or a non-empty tuple of them). ``model`` itself is never wrapped, nor is anything
    inside a module that is wrapped already, nor a module without a forward of its own
    (``nn.ModuleList``: what it holds is asked instead). A module placed at several places (shared
    weights) is asked once, under its first name, and one :class:`Checkpoint` of it
    takes each place (NOTE [ Shared blocks ]). ``state_dict`` keys do not change. The
    other arguments are given to each :class:`Checkpoint` (see :func:`checkpoint`;
    ``keep="selective"`` keeps each block's linear outputs and attention, recomputing
    its norms and activations only); a
    :class:`Checkpoint` from an earlier call whose module ``filter_fn`` selects takes
    them in place of its own (``wrap(model, Block, compress="int8")`` after
    ``wrap(model, Block)`` makes every block int8).

    With ``budget`` (bytes) and ``example_inputs``, each selected block runs plain,
    selective (``keep="selective"``), with its saves kept by a codec or on the host,
    or checkpointed keeping its input exactly, by a codec or on the host, as
    :func:`plan_blocks` chooses among the levers ``allow`` names: the fastest plan
    whose predicted peak activation memory of the whole training step fits
    ``budget`` (see :func:`plan_blocks`, which takes ``loss``, ``allow`` and
    ``min_sqnr_db`` too; ``compress``, ``offload`` and ``keep`` are then chosen, not
    given). ``filter_fn`` may also be a :class:`BlockPlan` from
    :func:`plan_blocks`, to apply a plan made (and printed) before::

        plan = actsave.plan_blocks(model, LlamaDecoderLayer, budget=2 * 2**30, example_inputs=batch)
        print(plan)
        actsave.wrap(model, plan)    # same as wrap(model, LlamaDecoderLayer, budget=..., example_inputs=batch)

    Where a selected block keeps by a lossy codec, ``model.forward`` is set on the
    instance to a callable that calls the model's own forward: under torch.compile
    it does so from one graph break that sets the saved-tensor hooks which put the
    codec in the compiled graph (NOTE [ Codecs in a compiled graph ]). The class's
    ``forward`` is untouched, a ``forward`` set on the instance before is called in
    turn, and the model keeps its signature, deep-copies and pickles.

    A ``filter_fn`` that selects nothing (and a model with no :class:`Checkpoint` in it
    already) warns: the model then trains exactly as before, with no memory saved,
    which is rarely what was meant (a class from another copy of a package, a
    misspelled name in the predicate).
    """
    _check_model(model, "wrap replaces submodules of a model in place")
    options = RecomputeOptions.resolve(preserve_rng_state, determinism_check, debug, early_stop)
    planned = budget is not None or isinstance(filter_fn, BlockPlan)
    planning = {"example_inputs": example_inputs, "loss": loss, "allow": allow, "min_sqnr_db": min_sqnr_db}
    if planned or any(value is not None for value in planning.values()):
        _check_planned_arguments(filter_fn, compress, offload, keep, budget, planning)
    if planned:
        plan = filter_fn if isinstance(filter_fn, BlockPlan) else plan_blocks(
            model, filter_fn, budget, example_inputs, loss=loss, allow=allow, min_sqnr_db=min_sqnr_db)
        _apply(model, plan, options)
        return model
    matches = filter_predicate(filter_fn)
    option = BlockOption.resolve(keep, compress, offload)
    blocks = matching_blocks(model, matches, Checkpoint)
    for block in blocks:
        if not block.wrapped:
            block.replace(_checkpoint_of(block.module, option, options))
        elif matches(uncompiled(block.module._wrapped), block.fqn):
            # Wrapped by an earlier call and selected again: this call's options win,
            # as they would for a module wrapped now (never the old ones, silently).
            block.module._option, block.module._recompute = option, options
    if option.keep == "inputs" and option.lossy:
        graph_codecs.watch_root(model)
    if not blocks:
        warnings.warn(f"actsave.wrap: {nothing_selected(model, filter_fn, matches)}; nothing is checkpointed",
                      stacklevel=2)
    return model


def plan_blocks(model: nn.Module, filter_fn: FilterSpec, budget, example_inputs, *, loss=None, allow=None,
                min_sqnr_db=None) -> BlockPlan:
    """Choose, for each block of ``model`` that ``filter_fn`` selects, whether
    :func:`wrap` checkpoints it and how its checkpoint keeps its input: the fastest
    such plan whose predicted peak activation memory fits ``budget``. ``model`` is
    left as it was; apply the plan with ``wrap(model, plan)``, print it to see it.

    For models whose selected blocks run one after another, each on the previous
    one's output, called by the model's own loop with any other arguments (attention
    masks, position embeddings, flags), as the decoder layers of Hugging Face GPT-2 or
    Llama models are. The plan is made from one profiled example step
    (actsave/planning/blocks.py says how).

    Args:
        model: the model, as it will train (``model.train()``; for Hugging Face
            models ``config.use_cache = False``, as for any checkpointing).
        filter_fn: selects the blocks, as for :func:`wrap`.
        budget: peak activation memory of the whole training step, in bytes: what the
            step allocates on the device beyond parameters, buffers, parameter
            gradients and optimizer state. That includes the example inputs, the work
            outside the blocks (embeddings, masks, the final norm, the head's logits,
            the loss and their gradients), measured on the example step, and the
            blocks' saved activations, kept inputs and gradients. The step is the
            forward of ``example_inputs`` (see below) then the backward of the loss,
            with parameter gradients allocated before it, as from the second training
            step on. Measured on CPU (MemTracker), the peak of the applied plan stays
            within it (tests/planning/test_blocks.py).
        example_inputs: a batch as training will use: a dict of keyword arguments
            (``model(**example_inputs)``), a tuple of positional arguments, or one
            tensor. The loss is ``loss(output)`` with a ``loss`` function, else the
            model's output if a tensor, else its ``loss`` (Hugging Face: pass
            ``labels``), else its first item; a non-scalar loss is backpropagated
            from ones.
        loss: the training step's loss as a function of the model's output
            (``lambda logits: F.cross_entropy(logits.flatten(0, 1), targets.flatten())``
            with example targets), where the model does not return it: the profiled
            step runs it, so the plan counts its memory (a cross-entropy keeps a
            logits-sized log-softmax), as ``CheckpointedSequential``'s ``loss`` does.
        allow: the levers, as for :func:`actsave.plan`: ``"recompute"``,
            ``"selective"`` (a block keeping its linear layers' and attention's
            outputs, recomputing the rest: docs/planner.md), codecs (``"int8"``,
            ``"fp8"``, ...) and, on CUDA only, ``"offload"``. Default: the exact ones
            the device has (recompute, selective, and offload on CUDA): a lossy codec
            is used only if named here.
        min_sqnr_db: leave out codecs whose expected gradient SQNR is below it.

    Raises :class:`~actsave.ConfigError` when no plan fits (stating the smallest
    feasible budget, and the lossy codecs not allowed that would lower it, to what),
    when the blocks do not run once each one after another (one module at several
    places, shared weights, included), and for ``"offload"`` on a
    CPU model (host memory is its memory).
    """
    _check_model(model, "plan_blocks plans the blocks of a model")
    number = None if budget is None else byte_count(budget)
    if number is None:
        raise ConfigError(f"budget={budget!r} must be a positive, finite number of bytes: the peak activation memory of "
                          "one training step")
    budget = number
    if example_inputs is None:
        raise ConfigError("example_inputs is required with budget: a batch as training will use (a dict of the "
                          "model's keyword arguments, a tuple of positional ones, or a tensor), to profile one step")
    if not model.training:  # from_pretrained returns a model in eval mode
        warnings.warn("plan_blocks profiles the model in eval mode (model.training is False): dropout keeps no "
                      "masks there, so a plan made now may exceed its budget in training. Call model.train() "
                      "before planning.", stacklevel=2)
    matches = filter_predicate(filter_fn)
    blocks = matching_blocks(model, matches, Checkpoint)
    if not blocks:
        raise ConfigError(f"{nothing_selected(model, filter_fn, matches)}: there are no blocks to plan")
    shared = next((block for block in blocks if len(block.places) > 1), None)
    if shared is not None:  # NOTE [ Shared blocks ]
        raise ConfigError(f"blocks {[fqn for *_, fqn in shared.places]} are one module (shared weights): a block plan "
                          "chooses for each block on its own, and one module takes one choice. Checkpoint every place "
                          "alike with wrap(model, filter_fn) (compress=, offload= as wanted), without budget")
    wrapped = [block.fqn for block in blocks if block.wrapped]
    if wrapped:
        raise ConfigError(f"blocks {wrapped} are wrapped already: a block plan profiles the plain blocks; plan the "
                          "model before wrapping it")
    plan = plan_block_stack(model, [(block.fqn, block.module) for block in blocks], budget, example_inputs,
                            allow, min_sqnr_db, loss)
    return dataclasses.replace(plan, left_out=tuple(_unnamed_blocks(model, plan.blocks, set(plan.types))))


def _check_model(model, purpose: str) -> None:
    if not isinstance(model, nn.Module):
        raise ConfigError(f"model={model!r} is not an nn.Module instance: {purpose} "
                          "(for a function, use actsave.checkpoint(function, *args))")


def _check_planned_arguments(filter_fn, compress, offload, keep, budget, planning: dict) -> None:
    """``planning``: the planning arguments besides ``budget`` (name -> value)."""
    if isinstance(filter_fn, BlockPlan):
        if budget is not None or any(value is not None for value in planning.values()):
            raise ConfigError("wrap(model, plan) applies a plan made already: give budget, example_inputs, loss, "
                              "allow and min_sqnr_db to plan_blocks, not here")
    elif budget is None:
        raise ConfigError("example_inputs, loss, allow and min_sqnr_db are for planning the blocks: give budget "
                          "(peak activation bytes of one training step) too, or leave them out")
    if compress is not None or offload is not False or keep != "inputs":
        raise ConfigError(f"compress={compress!r}, offload={offload!r}, keep={keep!r}: with a block plan, each "
                          "block's keep option is planned; limit the levers with allow=(...) and min_sqnr_db instead")


def _apply(model: nn.Module, plan: BlockPlan, options: RecomputeOptions) -> None:
    """Wrap the blocks ``plan`` checkpoints, each with its own keep option, and the
    hidden state it was planned for (NOTE [ A block plan's input ])."""
    inputs, warned = dict(zip(map(uncompiled_name, plan.blocks), getattr(plan, "inputs", ()))), [False]
    for block, option in _planned_blocks(model, plan):
        if option is not None and not option.is_plain:
            wrapper = _checkpoint_of(block.module, option, options)
            planned = inputs.get(uncompiled_name(block.fqn))
            wrapper._planned_input = None if planned is None else PlannedInput(*planned[:2], warned, *planned[2:])
            block.replace(wrapper)
    if any(option is not None and option.keep == "inputs" and option.lossy for option in plan.options):
        graph_codecs.watch_root(model)


def _planned_blocks(model: nn.Module, plan: BlockPlan) -> list:
    """(Block, option) of each block of ``plan`` in ``model``: the plan's own modules,
    else (the plan made on another instance of the model: a copy, another rank, a
    pickled plan) the modules at the plan's block names, each of the type it recorded."""
    modules = [ref() for ref in plan.modules]
    # A block deleted since is no block of this model: its plan applies by name.
    planned = {} if None in modules else {id(module): option for module, option in zip(modules, plan.options)}
    blocks = [block for block in matching_blocks(model, lambda module, fqn: id(module) in planned, Checkpoint)
              if id(block.module) in planned]
    if planned and len(blocks) == len(planned) and not any(block.wrapped for block in blocks):
        return [(block, planned[id(block.module)]) for block in blocks]
    # By the names of the eager model: a plan made on a compiled model applies to an eager
    # one, and the other way.
    names = [uncompiled_name(fqn) for fqn in plan.blocks]
    named = dict(zip(names, zip(plan.options, plan.types or (None,) * len(names))))
    found = {uncompiled_name(block.fqn): block for block in matching_blocks(
        model, lambda module, fqn: uncompiled_name(fqn) in named, Checkpoint) if uncompiled_name(block.fqn) in named}
    missing = [fqn for fqn in names if fqn not in found]
    wrapped = [fqn for fqn, block in found.items() if block.wrapped]
    shared = [fqn for fqn, block in found.items() if len(block.places) > 1]
    other = [f"{fqn} is a {type_name(block.module)}, planned as a {named[fqn][1]}" for fqn, block in found.items()
             if named[fqn][1] is not None and not of_type(block.module, named[fqn][1])]
    if missing or wrapped or shared or other:
        why = (f"no block {missing} in this model" if missing else f"blocks {wrapped} are wrapped already" if wrapped
               else f"blocks {shared} are one module at several places" if shared else "; ".join(other))
        raise ConfigError(f"this plan is for other blocks ({why}): apply a plan to the model it was made for, or to "
                          "one built alike (the same block names and types), before wrapping it otherwise")
    _warn_of_unplanned_blocks(model, plan, names)
    return [(found[fqn], named[fqn][0]) for fqn in names]


def _unnamed_blocks(model: nn.Module, names, types: set) -> list:
    """The (eager) names of ``model``'s unwrapped blocks of ``types`` not in ``names``."""
    names = {uncompiled_name(fqn) for fqn in names}
    return [uncompiled_name(block.fqn) for block in matching_blocks(
        model, lambda module, fqn: any(of_type(module, name) for name in types), Checkpoint)
        if uncompiled_name(block.fqn) not in names and not block.wrapped]


def _warn_of_unplanned_blocks(model: nn.Module, plan: BlockPlan, names: list) -> None:
    """Warn where ``model`` has blocks of the planned types that the plan (made on
    another instance) does not name and the planned model did not have: a model with
    more of them than the one planned. They run plain, and the plan's predicted peak
    does not count them."""
    extra = [fqn for fqn in _unnamed_blocks(model, names, set(plan.types)) if fqn not in plan.left_out]
    if extra:
        warnings.warn(f"actsave: this block plan names {len(names)} blocks, and the model has {len(extra)} more of "
                      f"their types ({extra[:4]}{' ...' if len(extra) > 4 else ''}): they run plain, and the plan's "
                      "predicted peak does not count them. Plan this model (actsave.plan_blocks, or wrap(model, "
                      "Block, budget=...))", stacklevel=user_stacklevel())


def _checkpoint_of(module: nn.Module, option: BlockOption, options: RecomputeOptions) -> Checkpoint:
    """``Checkpoint(module)`` with its settings resolved already."""
    wrapper = Checkpoint(module)
    wrapper._option, wrapper._recompute = option, options
    return wrapper
