"""The selected blocks' calls in a block plan's example step (blocks.py, step 1),
recorded from its forward and checked to run one after another, each then a layer of a
chain (:class:`BlockCall`): :func:`record_calls`."""
from __future__ import annotations

import contextlib
import functools
import inspect
import weakref
from collections.abc import Callable, Sequence
from typing import NamedTuple, Optional

import torch
from torch import nn

from .._torch import pytree
from ..errors import ConfigError
from ..runtime.keep_modes import is_hf_cache
from ..runtime.keep_rules import modifies_input
from ..runtime.replay import autocast_as, autocast_now
from .block_step import hidden_output, run_step, step_inputs
from .instrumented_step import step_input
from .other_outputs import with_gradients_of
from .step_isolation import isolated_steps


class _Call:
    """One recorded call of a block: the block's ``forward``, the leaves of ``(args,
    kwargs)``, how to rebuild them, which leaf is the hidden state, and the
    hidden-state output. ``copied``: copies of its tensor leaves, taken before a block
    that changes its input in place ran (NOTE [ The first block's input as it was ])."""

    def __init__(self, forward: Callable, args: tuple, kwargs: dict, copied: bool = False):
        self.forward = forward
        self.leaves, self.spec = pytree.tree_flatten((args, kwargs))
        self.autocast = autocast_now(_device_type(self.leaves))  # NOTE [ Autocast the blocks ran under ]
        self.copies = {k: step_input(leaf) for k, leaf in enumerate(self.leaves)
                       if copied and isinstance(leaf, torch.Tensor)}
        self.hidden_leaf: int | None = None
        self.output: torch.Tensor | None = None
        self.made = {}  # id -> weak reference, of each tensor of its output: what a later call's argument came from
        # Where each tensor argument sits in the call (an index, or a keyword): NOTE [ A
        # block plan's input ] (planned_inputs.py).
        self.places = {**{id(a): i for i, a in enumerate(args) if isinstance(a, torch.Tensor)},
                       **{id(v): k for k, v in kwargs.items() if isinstance(v, torch.Tensor)}}

    def leaf_index(self, t: torch.Tensor) -> int | None:
        return next((k for k, leaf in enumerate(self.leaves) if leaf is t), None)

    @property
    def hidden(self) -> torch.Tensor:
        return self.leaves[self.hidden_leaf]

    @property
    def hidden_input(self) -> tuple | None:
        """``(place, shape, element size)`` of the hidden state in the call, None where
        it is not an argument itself (NOTE [ A block plan's input ])."""
        place = self.places.get(id(self.hidden))
        return None if place is None else (place, tuple(self.hidden.shape), self.hidden.element_size())


def _device_type(leaves: list) -> str:
    """The accelerator the call's tensors live on, else ``"cpu"``."""
    kinds = [leaf.device.type for leaf in leaves if isinstance(leaf, torch.Tensor) and leaf.device.type != "cpu"]
    return kinds[0] if kinds else "cpu"


# NOTE [ Autocast the blocks ran under ]
# A model may enter autocast in its own forward (accelerate's mixed precision wraps the
# forward in it; a `with torch.autocast` inside it): its blocks run under it in the step,
# but not where a block plan runs them as a chain of its own, its profile and each
# option's measurement, outside the model's forward. So those run under the autocast the
# recorded calls ran under, where every call ran under the same one and it is not the
# planning thread's: the blocks' activations in its dtype, and the weight casts its
# cache holds (the chain's step drops them before its backward, as the region's exit
# does: instrumented_step.backward_from). Priced without it, such plans counted the
# activations in float32 and no cast (docs/limits.md, "Meta estimates", on autocast).
# Where the calls ran under different states (a region of its own around each block,
# enabled for some), no one state prices the chain: under any one, some blocks'
# activations and casts are counted in a dtype they do not run in, and the plans go
# over their budgets (docs/limits.md, "Meta estimates"). They are refused, naming the
# blocks of each state. States that differ in what does not price
# a block (a disabled region's dtype) are one; those that differ in the cache only are
# priced under a state that keeps it, which counts the casts some blocks free.
def as_the_blocks_ran(calls: list):
    """Inside, autocast is as the blocks' recorded calls ran (NOTE [ Autocast the blocks ran under ])."""
    states = {call.autocast for _, _, call in calls}
    if len({_priced(state) for state in states}) > 1:
        raise ConfigError(_mixed_autocast(calls))
    state = max(states, key=lambda state: [one.cache_enabled for one in state])  # the same with its cache
    now = autocast_now(state[-1].device_type)
    disabled_alike = not _priced(state) and not _priced(now)
    if state == now or (len(states) > 1 and disabled_alike):
        return contextlib.nullcontext()
    return autocast_as(state)


def _priced(states: tuple) -> tuple:
    """What of an autocast state prices a block: the dtype of each device's where enabled;
    not a disabled one, its dtype or device (a block on the CPU and one on CUDA, neither
    under autocast, are alike), nor the cache (as_the_blocks_ran)."""
    return tuple((state.device_type, state.dtype) for state in states if state.enabled)


def _mixed_autocast(calls: list) -> str:
    by_state = {}
    for fqn, _, call in calls:
        by_state.setdefault(_priced(call.autocast), (call.autocast, []))[1].append(fqn)
    described = "; ".join(f"{', '.join(fqns)}: {_autocast_text(state)}" for state, fqns in by_state.values())
    return (f"the blocks ran under different autocast states ({described}): a block plan prices its blocks as one "
            "chain under one autocast, which would count some blocks' activations and weight casts in the wrong "
            "dtype and could go over the budget. Run every block under "
            "one autocast (enter it around the model's forward), or checkpoint the blocks by hand "
            "(actsave.wrap(model, Block, keep=...))")


def _autocast_text(states: tuple) -> str:
    on = [f"{state.dtype} on {state.device_type}" + ("" if state.cache_enabled else " without its cache")
          for state in states if state.enabled]
    return "autocast " + " and ".join(on) if on else "no autocast"


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
        call = self.calls[fqn][-1]
        call.output = hidden_output(output, fqn)
        call.made = {id(t): weakref.ref(t) for t in pytree.tree_leaves(output) if isinstance(t, torch.Tensor)}

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
        call.hidden_leaf = next((k for k, leaf in enumerate(call.leaves) if _passes_on(leaf, previous.output)), None)
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


def _passes_on(leaf, output: torch.Tensor) -> bool:
    """Whether ``leaf`` is ``output`` as the block's caller got it: the tensor itself,
    or the alias that a full backward hook on the block (or on a module returning its
    output) hands the caller instead: torch's BackwardHook runs the output through
    BackwardHookFunction after the forward hooks, which recorded it; the alias shares
    its data, and its grad_fn leads back to the output's through such nodes only."""
    if leaf is output:
        return True
    if not isinstance(leaf, torch.Tensor) or leaf.grad_fn is None or output.grad_fn is None:
        return False
    node, nr = leaf.grad_fn, leaf.output_nr
    while node is not None and node.name() == "BackwardHookFunctionBackward":
        node, nr = node.next_functions[nr]
        if node is output.grad_fn and nr == output.output_nr:
            return True
    return False


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
# block's output, or the alias a full backward hook hands its caller: _passes_on), and in
# the chain each block runs on what the block before returns.


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
    this module (not in its state dict, :func:`_held_argument`), so that the profile
    counts them as held by the caller, as the model's own loop holds them. It returns
    the hidden state alone; its backward gives zeros as the gradients of the block's
    other outputs whose leaves ``other_gradients`` names, as the model's step gives
    them gradients (NOTE [ Outputs the caller holds ], other_outputs.py)."""

    def __init__(self, block: nn.Module, call: _Call, other_gradients: tuple = ()):
        super().__init__()
        self.block = block
        self.other_gradients = other_gradients
        self.inplace = modifies_input(block)  # a segment starting here keeps a copy, as Checkpoint(block) does
        self.__qualname__ = type(block).__qualname__  # the name a checkpoint's messages give it
        self._spec, self._hidden_leaf = call.spec, call.hidden_leaf
        # Per argument leaf: the largest storage a gradient its backward gave it holds
        # (NOTE [ Gradients of the blocks' arguments ]).
        self.argument_gradient_bytes = _GradientBytes()
        self._leaves = []
        for k, leaf in enumerate(call.leaves):
            if isinstance(leaf, torch.Tensor) and k != call.hidden_leaf:
                self.register_buffer(f"argument_{k}", _held_argument(leaf, self.argument_gradient_bytes, k),
                                     persistent=False)
                leaf = _Argument(f"argument_{k}")
            self._leaves.append(leaf)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        leaves = [hidden if k == self._hidden_leaf else
                  self._buffers[leaf.buffer] if isinstance(leaf, _Argument) else leaf
                  for k, leaf in enumerate(self._leaves)]
        args, kwargs = pytree.tree_unflatten(leaves, self._spec)
        output = self.block(*args, **kwargs)
        hidden = hidden_output(output, type(self.block).__name__)
        return with_gradients_of(hidden, output, self.other_gradients) if self.other_gradients else hidden


class _GradientBytes(dict):
    """Argument leaf -> the largest storage a gradient of it held, in bytes: one dict
    for a BlockCall and every copy the planner makes of it (each planning step runs on
    its own), which the hooks of all their arguments fill; not a reference to the
    module, which its buffers' hooks would hold in a cycle."""

    def __deepcopy__(self, memo):
        return self


def _held_argument(leaf: torch.Tensor, gradient_bytes: _GradientBytes, k: int) -> torch.Tensor:
    """A block's argument as its :class:`BlockCall` holds it for the profile: the same
    values, detached from the example step's graph; needing a gradient where the
    argument does, so that the profiled block saves what that gradient needs (``q *
    pos`` saves ``q`` only then), and dropping each gradient as it comes, as the step
    hands it on (argument_grads.py counts the sum autograd keeps of them: NOTE
    [ Gradients of the blocks' arguments ]), having noted in ``gradient_bytes[k]`` the
    storage it holds."""
    held = leaf.detach()
    if leaf.requires_grad:
        held.requires_grad_()
        held.register_hook(functools.partial(_note_storage, gradient_bytes, k))
        held.register_post_accumulate_grad_hook(_drop_gradient)
    return held


def _note_storage(gradient_bytes: _GradientBytes, k: int, gradient: torch.Tensor) -> None:
    """Note the bytes of ``gradient``'s storage: a view (``torch.cat``'s backward hands
    each input a slice of one buffer) holds all of it."""
    gradient_bytes[k] = max(gradient_bytes.get(k, 0), gradient.untyped_storage().nbytes())


def _drop_gradient(tensor: torch.Tensor) -> None:
    tensor.grad = None
