"""Selective recompute: a checkpointed call that keeps the outputs of its expensive
operations (linear layers, attention) and recomputes only the cheap ones (norms,
activations, elementwise), as torchtitan's selective op checkpointing and Megatron's
selective recompute do, with no dispatch mode in the forward.

NOTE [ Selective recompute ]
The forward is a checkpointed call's (function.py, NOTE [ Segment checkpoint
mechanism ]): every save a placeholder, the call's inputs kept. What :class:`KeptOps`
names (module types, ``nn.Linear`` by default, and functions called through their
module, ``F.scaled_dot_product_attention`` by default) is watched as it runs: the
forward of each module of those types under the call's known layers (layers.py), set
on the instance, a tap on the function (_taps.ATTENTION). Of each outermost such *call*
the forward records which placeholders its saves took and its output, which the frame
keeps. A module's call is its forward only, the one the recompute skips: its pre-hooks
and hooks, global (``register_module_forward_hook``) and its own, run around it in the
forward and again in the recompute, on the kept output, once each. Then:

- A save made outside a kept call whose storage is a kept call's output (GELU's input
  is its Linear's output; attention's q, k, v are views of the qkv projection's) is
  kept as it is, the tensor itself in its placeholder: it costs nothing more.
- A save made inside a kept call is kept as it is (attention's output and log-sum-exp,
  a weight's transpose), unless it is a view that reads only elements of one of the
  call's tensor arguments (a Linear's input, attention's q, k, v): then the recompute
  makes the same view of the argument it recomputes, with the same sizes, strides and
  offset. Only of that argument: q, k and v may be slices of one storage, and the
  recomputed (or decoded) argument may come back as a copy of its own elements, so a
  save is matched to the argument it is, else to a dense argument whose span holds it,
  else kept as it is.
- Every other save (a norm's input and statistics, an activation's input that no kept
  call made, a product's factors) is recomputed, as in any checkpoint.

The recompute runs the function again from its kept inputs, with each kept call
skipped: in its place the forward's output comes back (as a tensor that requires grad
where it did, not a leaf: a later in-place op may change it), and its views of its
arguments fill its placeholders. So a transformer block's recompute runs its norms,
rotary embeddings and activations, not its matmuls nor its attention. Calls are
matched in order, by their module or function; another order, or other shapes, raise
as any recompute that does not do the same work does, and so does a save the recompute
makes outside any call where the forward's was inside a skipped one (another branch,
whose save of the same shape would otherwise fill that call's placeholder, and whose
early stop would end the recompute before any call is missed). A recompute stops after its last
recomputed save (the early stop); a call with nothing recomputed is not recomputed at
all, and its kept tensors are read as they are. With the early stop, a skipped call that
ends after that save never returns its output in the recompute (a block's last
projection, whose output only joins the residual): its output is not kept.

Rules that keep it exact:
- A kept call that changed one of its arguments in place (``nn.ReLU(inplace=True)``
  named in KeptOps) is run again: skipped, the argument the recompute made would stay
  unchanged. So is one that changed a buffer of the modules the checkpointed call runs
  (a Linear that keeps a running mean of its output) or a parameter of its own module
  and those under it, in place: the recompute starts from the forward's module state
  (NOTE [ State a forward reads and mutates ]), and the code after the call must read
  what the call left, as the forward did; a parameter changed in place is then checked
  as in any recompute (NOTE [ Parameters a forward changes ]). The Python attributes
  a call sets on its module and those under it (a value it notes for the code after
  it, a flag at its first call) are replayed instead: the recompute that skips the call
  sets them to the values the call left, of every attribute any call of that module set
  (by identity: a call that set one to the object it held left that value too), and
  puts them back as they were when it started as it ends (a call counter counts the
  forward's calls only). A tensor of more than one element an attribute holds (a cache,
  a dequantized weight) is left as the forward left it, as module_attributes.py leaves
  it: replayed, each call's would stay alive until the backward. So calls of one module
  that each set such a tensor (a statistic of each call's input) run again: the code
  after the first read a value the last replaced.
- A kept call that raised (the function caught it: a fused kernel tried first, a
  fallback after it) returned nothing to keep: it runs again in the recompute, if the
  recompute makes it (one that noted the failure may not), and the calls after it are
  matched to theirs. Where the recompute's call of the same module or function returns
  instead, it stands for the fallback's call after it, and runs in full.
- A kept call that drew random numbers in the forward (attention with dropout, a
  module named that holds a Dropout) is skipped in the recompute, which replays the
  forward's RNG: the generators are set as that call left them, so the calls after it
  draw what they drew in the forward (the state around each call that may draw is
  read in the forward).
- A kept output changed in place after its call (``out = proj(x); out += x``) is not
  the value the call returned: that call is not skipped but run again, from its
  recomputed arguments, and what it saved is recomputed. A call run again keeps
  nothing: neither its output nor the saves made of it outside it.
- A kept tensor changed in place before backward raises autograd's error, as
  ``nn.Sequential`` does (its version is checked as it is read); so does a kept output
  changed after the forward returned (its caller's ``out.mul_(2)``), which the
  recompute would otherwise read changed where the call would make it anew.
- Only the backward's recompute skips: a backward inside the forward (NOTE [ Backward
  inside a checkpointed forward ]) recomputes every save, as a checkpoint does.
- Under a ``torch.func`` transform (vmap, jvp) a call's output is the transform's
  wrapper, which names no storage and holds the forward's graph: it is not kept, and
  the call runs again in a recompute, as under ``keep="inputs"``.
- With ``compress`` or ``offload``, its inputs are kept as a checkpoint's are, and the
  rest of what it keeps is stored so as its forward ends (kept_outputs.py, NOTE [
  Stored kept outputs ]): the recompute then runs on decoded values, and the forward's
  ReLU and max-pool decisions are kept as in any lossy recompute. Under a lossy codec
  attention is not kept but run again, from the decoded q, k and v the recompute gives
  it: its backward reads its output and log-sum-exp together with them, and they must
  agree (NOTE [ Attention's saves agree ]). Exact, it is kept.

What it keeps, beside its inputs: every kept call's output (what torchtitan's policy
saves, the outputs of matmuls and attention) but those the early stop never reads
(above), and the tensors its calls saved that are not views of their arguments;
counted in kept_bytes() until the recompute, after which autograd holds them, as it
holds any save, until their node's backward.
"""
from __future__ import annotations

import contextlib
import functools
from typing import Callable, Optional

import torch
from torch import nn

from .._torch import sparse_components, storage_identity, storage_identity_or_none, version
from .._torch_graphs import eager_hooks
from ..meta import meta_step_depth
from .function import detached_or_same, CheckpointFrame, eager_checkpointed_call, qualified_name
from .placeholders import Cursor, Slot
from .keep_rules import EXACT, KeepPolicy
from .kept_ops import DEFAULT_KEPT_OPS, TAPPED_FUNCTIONS, KeptOps, may_draw, refuse_unknown_modules
from .kept_outputs import StoredKept, store_kept
from .replay import RandomState, passed_generators
from .held_generators import held_generators
from .kept_calls import CallArgument, KeptCall, KeptSave, StateMark, attributes_to_replay, described, keepable_now
from .kept_nothing import warn_kept_nothing, warn_unmatched
from .forward_dispatch import forward_replaced
from .selective_replay import Skipper
from .store import input_tensors


class SelectiveFrame(CheckpointFrame):
    """A checkpointed call recomputed selectively: NOTE [ Selective recompute ]."""

    def __init__(self, function, kept, *frame_args, ops: KeptOps = DEFAULT_KEPT_OPS):
        self.policy = kept.policy  # what it keeps beside its inputs is stored so
        self.stored = StoredKept([])
        super().__init__(function, kept, *frame_args)
        self.ops = ops
        # NOTE [ Attention's saves agree ]: under a lossy codec attention runs again from its
        # decoded q, k and v, so that its output and log-sum-exp agree with them.
        self.functions = tuple(f for f in ops.functions if not (self.policy.lossy and f in _RECOMPUTED_WHEN_LOSSY))
        refuse_unknown_modules(ops, function, self.layers)
        indexed = not isinstance(function, nn.Module) or type(function) is nn.Sequential  # layers.py's rule
        self._watched = ops.watched(self.layers, self.modules, indexed) if self.modules else []
        self.calls = []  # KeptCall, in forward order
        self._open = None  # the outermost kept call running, in the forward
        self._depth = 0  # kept calls open (nested ones inside the outermost)
        self._pending = []  # (slot, tensor) saved inside the open call
        self._outputs = {}  # storage identity -> the kept call whose output it is
        self._outside = {}  # slot index -> the kept call whose output it saved, outside any call
        self._recomputed = []  # indices of the saves the recompute fills
        self._skipped_saves = {}  # index of a save a skipped call made -> that call
        self._differentiated = False  # a backward of its own ran inside its forward
        self._ran = set()  # the module types and function names of the kept calls that ran, nested ones too
        self._replaying = False  # the forward's recompute for that backward runs
        inputs = input_tensors(*self._forward_inputs)
        self._input_storages = {storage_identity_or_none(t) for t in inputs} - {None}  # kept anyway
        self._transformed = False  # a kept call returned a transform's wrapper, not kept
        self._released = False  # the forward raised: its calls, let go of, say nothing
        self.meta_depth = meta_step_depth()  # the meta steps it runs in (keepable_now)
        self.run_in_place_of = None  # a skipped call the recompute runs in full (selective_replay.py)
        # The modules whose buffers a kept call may change: the call's own modules where
        # the function's modules are not known (functions kept alone need none).
        self._buffer_holders = None if self.modules is None else [m for _, m in self.modules if m._buffers]

    # ------------------------------------------------------------- forward

    @contextlib.contextmanager
    def forward_hooks(self):
        with super().forward_hooks(), self._watching():
            yield

    @contextlib.contextmanager
    def _watching(self):
        with contextlib.ExitStack() as stack:
            for module in self._watched:
                # Its forward itself is wrapped, not hooked: the call is what the recompute's
                # Skipper replaces, the module's forward, whose arguments come after every
                # pre-hook and whose output comes before every hook. nn.Module runs the hooks
                # around it, global ones first, in the forward and again in the recompute.
                stack.enter_context(forward_replaced(module, functools.partial(self._recorded_forward, module)))
            for name in self.functions:
                stack.enter_context(TAPPED_FUNCTIONS[name].handled(self._recorded(name)))
            yield

    def _recorded_forward(self, module: nn.Module, run: Callable) -> Callable:
        """``run``, ``module``'s forward, recording each call of it as a kept call."""
        recorded = self._recorded(module)

        @functools.wraps(run)
        def forward(*args, **kwargs):
            return recorded(run, *args, **kwargs)
        return forward

    def _recorded(self, target) -> Callable:
        """A kept call of ``target`` (a module, or a function's name) that records it."""
        def recorded(call_next, *args, **kwargs):
            if not self.in_forward or self._replaying or not keepable_now(self.meta_depth):  # run plainly
                return call_next(*args, **kwargs)
            self._enter(target, args, kwargs)
            try:
                output = call_next(*args, **kwargs)
            except BaseException:
                # The function may catch it (a fused kernel tried, a fallback after it):
                # the call is recorded as returning nothing, so the recompute runs it
                # again and matches the calls after it to theirs.
                self._exit(None, raised=True)
                raise
            self._exit(output)
            return output
        return recorded

    def _enter(self, target, args: tuple, kwargs: dict) -> None:
        self._depth += 1
        self._ran.add(target if isinstance(target, str) else type(target))
        if self._depth > 1 or not self.in_forward:
            return
        tensors = input_tensors(args, kwargs)
        self._open = KeptCall(target, len(self.slots), [CallArgument(i, t) for i, t in enumerate(tensors)])
        own = [] if not isinstance(target, nn.Module) else list(target.modules()) if target._modules else [target]
        holders = [m for m in own if m._buffers] if self._buffer_holders is None else self._buffer_holders
        self._open.state = StateMark(holders, own)
        # Without preserve_rng_state the recompute draws from the generators as they are
        # (torch's meaning): setting them to a forward-time state would rewind them.
        if self.options.preserve_rng_state and may_draw(target, args, kwargs):
            self._open.rng_before = RandomState.capture(tensors, [*passed_generators(args, kwargs),
                                                                  *held_generators(own)])

    def _exit(self, output, raised: bool = False) -> None:
        self._depth -= 1
        if self._depth > 0 or self._open is None:
            return
        call, self._open = self._open, None
        call.stop, call.raised = len(self.slots), raised
        if call.rng_before is not None:
            after = call.rng_before.again()
            call.rng_after = None if after == call.rng_before else after
            call.rng_before = None
        # A transform's wrapper is not kept (NOTE [ Selective recompute ]): its requires_grad is
        # False where the tensor it wraps has a grad_fn, so detached_or_same would keep it as it is,
        # and with it the forward's graph, whose saved-tensor hooks hold this frame: a cycle.
        wrapper = isinstance(output, torch.Tensor) and storage_identity_or_none(output) is None
        self._transformed |= wrapper
        if isinstance(output, torch.Tensor) and not wrapper:
            call.output, call.version = detached_or_same(output), version(output)
            call.requires_grad = output.requires_grad
            self._outputs[storage_identity(output)] = call
        for slot, tensor in self._pending:
            view = call.view_of_argument(tensor)
            if view is not None and call.output is not None:
                call.views[slot.index] = view
            else:
                slot.kept = KeptSave(tensor)  # a weight's transpose, attention's statistics
        self._pending = []
        call.mutates, call.changed_state = call.mutated_an_argument(), call.state.changed()
        call.attributes, call.state = call.state.attributes_left(), None  # pruned as the forward ends
        for argument in call.arguments:
            argument.tensor = None  # the recompute makes its own; this one is autograd's to free
        self.calls.append(call)

    def pack(self, tensor: torch.Tensor) -> Slot:
        slot = super().pack(tensor)
        if self._open is not None and self.in_forward:
            self._pending.append((slot, tensor))
        elif self.in_forward and (call := self._outputs.get(storage_identity_or_none(tensor))) is not None:
            slot.kept = KeptSave(tensor)  # kept anyway, as the call's output, where the call is skipped
            self._outside[slot.index] = call
            call.decided_on |= slot.bound_decisions is not None or slot.relu_signs is not None
        return slot

    def end_forward(self) -> None:
        super().end_forward()
        attributes_to_replay(self.calls)
        tensorless = bool(self.calls) and all(call.output is None for call in self.calls)
        for call in self.calls:
            # An output changed in place after its call is not what the call returned. A
            # forward that runs a backward of its own runs it again in the recompute,
            # through every call: none may be skipped.
            call.skipped = (not self._differentiated and call.output is not None and not call.mutates
                            and not call.changed_state and not call.data_set_again
                            and not call.decided_on and version(call.output) == call.version)
            if not call.skipped:
                self._recompute_saves_of(call)
        for index, call in self._outside.items():
            slot = self.slots[index]()
            if not call.skipped and slot is not None:
                slot.kept = None  # its call runs again: the recompute makes it anew
        self._recomputed = [i for i, ref in enumerate(self.slots) if _recomputed(ref())]
        if self._recomputed and self.options.early_stop:
            self._release_unread_outputs()
        self._skipped_saves = {i: call for call in self.calls if call.skipped for i in range(call.start, call.stop)}
        kept_none = not any(call.skipped for call in self.calls)
        if self.slots and kept_none and not self._transformed and not self._released:
            decided = any(call.decided_on for call in self.calls)
            reason = "differentiated" if self._differentiated else "tensorless" if tensorless else \
                "decided" if decided else "state" if any(call.changed_state for call in self.calls) else \
                "data set again" if any(call.data_set_again for call in self.calls) else \
                "changed" if self.calls else \
                "none ran" if self.ops.modules or self.functions else "lossy attention"
            warn_kept_nothing(self.ops, qualified_name(self.function), reason)
        elif self.slots and not kept_none and self.ops != DEFAULT_KEPT_OPS and (unmatched := self._unmatched()):
            warn_unmatched(self.ops, qualified_name(self.function), unmatched)
        if not self._recomputed:  # nothing to recompute: no recompute reads the outputs
            self.calls = []
        self._outputs, self._outside = {}, {}
        if self.policy != EXACT:
            self._store()

    def _unmatched(self) -> list:
        """The module types and functions a user's KeptOps names that no call of this
        forward matched (names in module_names that match no module raise instead)."""
        ran = [kind for kind in self._ran if isinstance(kind, type)]
        modules = self.ops.modules if self.ops.module_names is None else ()
        return ([m.__name__ for m in modules if not any(issubclass(kind, m) for kind in ran)]
                + [f for f in self.functions if f not in self._ran])

    def _release_unread_outputs(self) -> None:
        """Let go of the outputs of the skipped calls that end after the last save the
        recompute would fill: the early stop ends it there, before it reaches them or
        inside the views they fill, before they return (NOTE [ Selective recompute ]).
        A save autograd freed already counts as one it fills: whether the function's
        caller or the function itself drops an output (a block plan's example step drops
        a block's other outputs inside its checkpoint, the model's step after it), the
        same calls let go, and the plan's bytes are the step's."""
        last = max(i for i, ref in enumerate(self.slots) if (slot := ref()) is None or slot.kept is None)
        for call in self.calls:
            if call.skipped and call.stop > last:
                call.output = None

    def _store(self) -> None:
        """Store what it keeps as its policy says: NOTE [ Stored kept outputs ]."""
        calls = [call for call in self.calls if call.skipped and call.output is not None]
        slots = [ref() for ref in self.slots]
        kept = [slot.kept for slot in slots if slot is not None and slot.kept is not None and not slot.kept.held]
        self.stored = store_kept(self.policy, [call.output for call in calls], [k.tensor for k in kept],
                                 self._input_storages)
        for call, stored in zip(calls, self.stored.tensors):
            if stored is not None:
                call.stored, call.output = stored, None
        for k, stored in zip(kept, self.stored.tensors[len(calls):]):
            if stored is not None:
                k.store(stored)

    def _lossy_recompute(self, kept) -> bool:
        return kept.lossy or self.policy.lossy

    def _recompute_saves_of(self, call: KeptCall) -> None:
        """A call run again in the recompute saves its own tensors anew, and its output
        is not kept."""
        call.views, call.output = {}, None
        for index in range(call.start, call.stop):
            slot = self.slots[index]()
            if slot is not None:
                slot.kept = None

    def account_kept(self) -> int:
        return super().account_kept() + self.stored.nbytes  # the stored entries count themselves

    def _kept_besides(self) -> int:
        """The bytes of the tensors and outputs kept as they are, each storage once,
        beyond the inputs (kept by the inputs' policy) and what others hold (parameters)."""
        kept = [call.output for call in self.calls if call.output is not None]
        slots = [ref() for ref in self.slots]
        kept += [slot.kept.tensor for slot in slots if slot is not None and slot.kept is not None
                 and slot.kept.tensor is not None and not slot.kept.held]
        seen, total = set(self._input_storages), 0
        for t in (dense for t in kept for dense in sparse_components(t) or (t,)):
            identity = storage_identity(t)
            if identity not in seen:
                seen.add(identity)
                total += t.untyped_storage().nbytes()
        return total

    # ------------------------------------------------------------ backward

    def unpack(self, slot: Slot) -> torch.Tensor:
        if self.in_forward:  # NOTE [ Backward inside a checkpointed forward ]
            self._differentiated = True
        if slot.kept is not None:
            return slot.kept.read()
        return super().unpack(slot)

    def _unpack_in_forward(self, slot: Slot) -> torch.Tensor:
        self._replaying = True
        try:
            return super()._unpack_in_forward(slot)
        finally:
            self._replaying = False

    def _recompute(self) -> None:
        self.stored.fetch()  # first: the tape then prefetches the inputs and the blocks before behind it
        super()._recompute()

    def _recomputed_saves(self) -> tuple:
        # The early stop: after the last save the recompute fills.
        return self._recomputed[-1] + 1, False

    def _fill(self, index: int, tensor: torch.Tensor, into, count: int, lossy: bool) -> torch.Tensor:
        call = self._skipped_saves.get(index)
        if call is not None and call is not self.run_in_place_of:
            raise self._mismatch(
                f"the recompute of {qualified_name(self.function)} saved a tensor outside any kept call where the "
                f"forward's save {index} was made inside {described(call.target)}, which the recompute skips: the "
                "function took another path (a Python flag or random draw that changed since the forward). Make it "
                "deterministic or do not checkpoint it.")
        return super()._fill(index, tensor, into, count, lossy)

    def fill_view(self, index: int, tensor: torch.Tensor, into, count: int) -> None:
        """Fill a skipped call's save ``index``, a view of its argument made again of the
        recomputed one (selective_replay.py)."""
        super()._fill(index, tensor, into, count, lossy=False)

    def _skipping(self, cursor: Cursor, into, count: int, last: bool):
        if not last or not self.calls:
            return contextlib.nullcontext()
        return Skipper(self, cursor, into, count).active()

    def release(self) -> None:
        super().release()
        self._released = True
        self.calls = []  # the outputs: autograd holds what its nodes still need
        self._skipped_saves = {}  # which refer to the calls, and so their outputs
        self.stored = StoredKept([])  # the kept saves hold what they store


# The functions whose outputs a selective recompute under a lossy codec does not keep
# but runs again (NOTE [ Attention's saves agree ]).
_RECOMPUTED_WHEN_LOSSY = frozenset({"scaled_dot_product_attention"})


def _recomputed(slot) -> bool:
    """Whether the recompute fills this save (a live one not kept)."""
    return slot is not None and slot.kept is None


def selective_call(function: Callable, args: tuple, kwargs: dict, ops: KeptOps, options, private_copy: bool = False,
                   prepared: Optional[tuple] = None, policy: KeepPolicy = EXACT) -> tuple:
    """Run ``function(*args, **kwargs)`` checkpointed, recomputed selectively: keep its
    inputs and the outputs of the calls ``ops`` names, exactly or as ``policy`` stores
    them (NOTE [ Selective recompute ], NOTE [ Stored kept outputs ]). Returns
    ``(output, kept_bytes)`` as :func:`~actsave.runtime.function.checkpointed_call`
    does."""
    if not torch.is_grad_enabled():
        return function(*args, **kwargs), 0
    return eager_checkpointed_call(function, args, kwargs, policy, private_copy, options, prepared=prepared,
                              make_frame=functools.partial(SelectiveFrame, ops=ops))

eager_hooks(SelectiveFrame.pack, SelectiveFrame.unpack)  # NOTE [ Eager hooks Dynamo leaves alone ]


__all__ = ["SelectiveFrame", "selective_call"]
