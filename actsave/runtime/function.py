"""The autograd machinery: keep a segment's input, drop what it saves, recompute in
backward.

NOTE [ Segment checkpoint mechanism ]
A checkpointed call runs its function once, with grad enabled, inside
``torch.autograd.graph.saved_tensors_hooks``. The autograd graph is the real one;
only the tensors its nodes save are swapped for placeholders (placeholders.py). The
segment's inputs are kept by actsave itself (store.py), exact or compressed. When
backward first unpacks a placeholder, or reaches the node of an output that is a view,
the segment runs again from the kept inputs (same RNG, autocast and default device,
state the forward mutated left alone: state.py) and the tensors it saves, in the same
order, fill the placeholders. A view's node may allocate before its first unpack (after
an in-place ReLU on a view: the base's gradient and CopySlices' two copies), where
plans count the output's gradient alone; other nodes unpack first.

Why this and not a custom ``torch.autograd.Function`` per segment: a Function only
sees the tensors passed to it. Gradients of parameters a function closes over would
have to be accumulated by an inner ``backward()`` (so ``torch.autograd.grad(loss,
params)`` would see none) or every parameter passed in explicitly (impossible for
``checkpoint(fn, ...)`` with an arbitrary ``fn``). With hooks the graph is the plain
model's graph, so ``autograd.grad``, gradient accumulation, DDP's reducer (it hooks
the parameters' AccumulateGrad nodes and walks the graph when
``find_unused_parameters=True``), FSDP2's pre/post-backward hooks and nesting work as
they do without actsave. It is also the mechanism of PyTorch's non-reentrant
checkpoint, which torch.compile knows. What is ours: the inputs are not saved through
autograd (so they can be compressed or offloaded, and a segment may start with an
in-place layer), BatchNorm statistics are not updated twice, and the saved tensors are
checked for shape, dtype and device instead of trusted (unless
``determinism_check="none"``: recompute_options.py).

NOTE [ Lifetime of kept inputs ]
- Kept inputs live from the forward until the first recompute of their segment;
  after it the recomputed tensors are held by their placeholders, so the inputs are
  released at once (backward memory of a segment is its recomputed activations only).
- A recomputed tensor waits for its node in a ``WeakKeyDictionary`` keyed by the
  placeholder, and is handed to that node when it unpacks the placeholder:
  - In a backward that frees the graph (the default), the frame lets go of it there.
    The node then owns it alone and frees it as soon as it is done with it, inside
    its backward, as torch's checkpoint does. Held to the end of the node instead, a
    matmul's input outlived its last read on CUDA, where the matmul's backward
    allocates once more after it: one activation more at the peak. A second unpack
    of the same placeholder in that backward (``ctx.saved_tensors`` read twice)
    raises, as torch's checkpoint does.
  - In a backward that keeps the graph (``retain_graph`` or ``create_graph``), the
    frame keeps it as long as the node that saved its placeholder, so a later backward
    finds every tensor still there and needs no second recompute: each layer runs at
    most once more in backward.
- A call whose function saved nothing (no input or parameter needs grad) releases its
  kept inputs before returning. A graph that is dropped without backward frees the
  placeholders, the hooks, the frame and with it the kept inputs; ``weakref.finalize``
  keeps :func:`actsave.kept_bytes` exact in every case.
- With a lossy codec, the forward's ReLU decisions are kept too, one bit per element
  of each ReLU output (relu_signs.py), and its max pools' window decisions, a few bits
  per pooled element (pool_decisions.py), attached to the kept inputs: in the same
  place (offloaded with them), and released with them after the recompute has used them.
- Inputs kept by reference (the exact codec) are version-checked: an in-place change
  after the forward kept them raises instead of recomputing from the wrong values. A
  function that starts with an in-place layer gets a private copy instead
  (``private_copy``, chosen by the callers from the layer's ``inplace`` flag); a chain
  segment whose first layer turns out to hand its input on to one changes a copy
  (NOTE [ A layer that turns out to pass its input on ], passed_inputs.py).

NOTE [ Nested checkpoints ]
A checkpointed call met while an outer recompute is running (a ``Checkpoint`` inside a
checkpointed segment) is a checkpoint like any other, so that a backward the outer
function runs inside itself (``grad(checkpoint(f))`` inside a checkpoint) finds its
tensors. Its saves go to its own placeholders, never to the outer recompute's, so the
outer recompute sees exactly the tensors the outer forward saw. It keeps its inputs
exactly, by reference: it lives only as long as the outer recompute's graph, so a codec
or offload there would cost work and free nothing.

NOTE [ Backward inside a checkpointed forward ]
A function may run a backward of its own before it returns (``autograd.grad`` with
``create_graph=True``: gradient penalties, physics-informed losses, higher-order
derivatives). That backward unpacks placeholders of a forward still running. It gets a
recompute of the prefix saved so far, from the caller's exact inputs (alive while the
forward runs), which releases nothing and is not kept for the real backward: more
placeholders are still to come. Where the function's first layer changed those inputs in
place, it runs on a copy of the private copy kept of them, which the real backward's
recompute then finds as it was kept; one a lossy codec keeps is refused (the forward's
output would come from decoded values). Each tensor of it is handed out once, as
autograd unpacks a saved tensor once per backward. Inside any recompute the function's
own graph holds its saved tensors as they are, so a backward inside the recompute works
as it did in the forward; the saves a backward with ``create_graph=True`` makes are
placeholders like any other.
"""
from __future__ import annotations

import contextlib
import threading
import weakref
from typing import Callable, Optional

import torch
from torch.autograd.graph import saved_tensors_hooks

from .._torch import backward_keeps_graph, forward_ad_on, pytree, version
from .._torch_graphs import eager_hooks
from ..errors import ActsaveError, RecomputeError
from . import compiled_calls
from .compiled_layers import LayerCode
from .forward_decisions import ForwardDecisions
from .layers import known_layers, modules_under
from .passed_inputs import run_segment
from .placeholders import Cursor, Slot, unchanged, weakly
from .recompute_options import DEFAULT_RECOMPUTE, FLAGS_CHANGED, RecomputeOptions, logged, mismatch, other_shapes
from .replay import ReplayState, passed_generators
from .state import RecomputeStop, TouchedState
from .keep_rules import EXACT, CallerTensors, KeepPolicy
from .saved_masks import check_unpacked
from .store import KeptInputs, account, input_tensors

_local = threading.local()


def _recompute_depth() -> int:
    return getattr(_local, "recompute_depth", 0)


def _signature(t: torch.Tensor) -> tuple:
    # A flat tuple of untracked values (a dtype, a device, ints): the garbage collector
    # stops tracking it at its first collection, so the signatures a forward leaves for
    # its backward never count toward a full collection (NOTE [ Objects a step leaves
    # to the garbage collector ]). A torch.Size is always tracked.
    return (t.dtype, t.device, *t.shape)


class CheckpointFrame:
    """One checkpointed call: its kept inputs, the placeholders its forward handed to
    autograd, and (after backward asks) the recomputed tensors behind them."""

    def __init__(self, function: Callable, kept: KeptInputs, replay: ReplayState, args: tuple, kwargs: dict,
                 options: RecomputeOptions = DEFAULT_RECOMPUTE, inputs: Optional[list] = None,
                 prepared: Optional[tuple] = None):
        self.function = function
        self.operators = {}  # debug=True: "forward"/"recompute" -> operator names (OperatorLog)
        self.kept = kept
        self.replay = replay
        self.forward_ad = forward_ad_on()  # named by a mismatch's error, should the backward run after the level
        # Built as the forward starts: the modules under known layers are read now,
        # unless the caller walked them and snapshotted their state (``prepared``: chain.ChainState).
        layers = known_layers(function)  # NOTE [ Known layers ]
        if prepared is not None:
            modules, snapshot = prepared
        else:
            modules, snapshot = (None if layers is None else modules_under(layers)), None
        self.layers, self.modules = layers, modules  # None where the function's layers are not known
        self.options = options.for_modules(modules)
        self.touched = TouchedState.of(layers, modules, snapshot, self.options.preserve_rng_state)  # state.py's NOTE
        lossy = self._lossy_recompute(kept)
        self.code = LayerCode(function, layers, modules, lossy)  # NOTE [ Decisions in compiled layers ]
        self.slots = []  # weak references, in the order the forward saved
        self.signatures = []
        self.recomputed = weakref.WeakKeyDictionary()
        self.is_recomputed = False
        self.keeps_decisions = lossy  # once: pack runs for every saved tensor
        # Only a lossy recompute takes decisions from the forward. ``inputs``: the tensors
        # among the arguments, where the caller has them.
        self.decisions = ForwardDecisions(modules, input_tensors(args, kwargs) if inputs is None else inputs) \
            if lossy else None
        # The caller's inputs, held only while the forward runs (the caller holds them
        # then anyway): a backward inside the forward recomputes from them, exactly
        # (NOTE [ Backward inside a checkpointed forward ]).
        self._forward_inputs = (args, kwargs)
        self._recomputed_in_forward = weakref.WeakKeyDictionary()
        self._state_account = None  # the entry in kept_bytes of what account_kept counted

    def _lossy_recompute(self, kept: KeptInputs) -> bool:
        """Whether the recompute runs on values other than the forward's: inputs kept by
        a lossy codec (and in selective.py, outputs)."""
        return kept.lossy

    @property
    def in_forward(self) -> bool:
        return self._forward_inputs is not None

    def pack(self, tensor: torch.Tensor) -> Slot:
        self.touched.note_saved(tensor, self.slots)
        slot = Slot(len(self.slots))
        if self.keeps_decisions:
            self.decisions.keep(tensor, slot, self.kept)
        self.slots.append(weakref.ref(slot))
        self.signatures.append(_signature(tensor))
        return slot

    @property
    def decision_bytes(self) -> int:
        return 0 if self.decisions is None else self.decisions.nbytes

    @contextlib.contextmanager
    def forward_hooks(self):
        """The hooks the forward runs under: saves, module state, max pools and in-place ReLUs (lossy)."""
        decisions = self.decisions.forward_watching() if self.keeps_decisions else contextlib.nullcontext()
        with self.code.running(), self.touched.recording(), saved_tensors_hooks(self.pack, self.unpack), decisions, \
                self.logged("forward"):
            yield

    def end_forward(self) -> None:
        self.touched.end_forward()
        self._forward_inputs = None
        self._recomputed_in_forward = weakref.WeakKeyDictionary()
        if self.keeps_decisions:
            self.decisions.end_forward()

    def unpack(self, slot: Slot) -> torch.Tensor:
        if self.in_forward:
            return self._unpack_in_forward(slot)
        if not self.is_recomputed:
            self._recompute()
        return self.hand_out(slot)

    def hand_out(self, slot: Slot) -> torch.Tensor:
        """The recomputed tensor behind ``slot``, for the node unpacking it: kept or let go
        of as NOTE [ Lifetime of kept inputs ] says, checked as autograd checks a save."""
        if backward_keeps_graph():
            tensor = self.recomputed[slot]
        else:
            tensor = self.recomputed.pop(slot, None)
            if tensor is None:
                raise RecomputeError(
                    f"a tensor that {qualified_name(self.function)} saved for backward was unpacked a second time "
                    "in a backward that frees the graph, after the first unpack had handed it over (as "
                    "torch's checkpoint does, so that it is freed as soon as its node is done with it). "
                    "Read ctx.saved_tensors once per backward, or backward with retain_graph=True.")
            slot.handed_out = True
        if slot.filled_at is not None and version(tensor) != slot.filled_at:
            raise self._changed(slot, tensor)
        if slot.recounted is not None:
            check_unpacked(slot, self._mismatch, qualified_name(self.function))
        return tensor

    def _changed(self, slot: Slot, tensor: torch.Tensor) -> RecomputeError:
        """``tensor``, saved by the recompute for ``slot``, changed in place since: the forward's
        change (the recompute runs its code), where autograd raises, which placeholders bypass."""
        return RecomputeError(
            "one of the variables needed for gradient computation has been modified by an inplace operation: "
            f"{qualified_name(self.function)} changed a tensor of shape {list(tensor.shape)} in place after saving it "
            f"for backward (version {version(tensor)}; expected version {slot.filled_at}), as plain autograd raises (a "
            "checkpoint's saves bypass allow_mutation_on_saved_tensors()). Change a copy (y = y * 2, not y.mul_(2)).")

    def _recompute(self) -> None:
        try:
            self.touched.check_unchanged(qualified_name(self.function))
            count, exact = self._recomputed_saves()
            self.touched.reads.restarting(lambda: self._replay(self.kept.restore, self.recomputed, count, last=True,
                                                               lossy=self.keeps_decisions, exact_count=exact))
        except Exception as error:  # the function's own, raised in a backward: name the recompute
            if not isinstance(error, ActsaveError):
                error.add_note(f"actsave: raised while recomputing {qualified_name(self.function)} in the backward, "
                               "from inputs of its own: leaves that hold the inputs' values (docs/limits.md, "
                               "\"What a recompute's input is\")")
            raise
        finally:
            self.release()
        self.is_recomputed = True

    def _recomputed_saves(self) -> tuple:
        """``(count, exact)``: the backward's recompute fills the first ``count`` saves;
        ``exact``: a recompute run to its end saves exactly that many."""
        return len(self.slots), True

    def release(self) -> None:
        """Let go of what the recompute needed: the kept inputs (and what they hold
        attached) and the snapshot of mutated module state; decisions held back to be
        packed are dropped (NOTE [ Decisions at a boundary ])."""
        if self.decisions is not None:
            self.decisions.drop_held()
        self.kept.release()
        self.touched.release()
        if self._state_account is not None:
            self._state_account()

    def account_kept(self) -> int:
        """As the forward ends: count what the frame keeps beyond its inputs and their
        decisions in kept_bytes, until released, and return its bytes: the snapshot
        of the module state the forward mutated (NOTE [ State a forward reads and
        mutates ]), and what a subclass keeps besides (selective.py: kept outputs)."""
        nbytes = self.touched.snapshot_bytes + self._kept_besides()
        if nbytes:
            self._state_account = account(self, nbytes)
        return nbytes

    def _kept_besides(self) -> int:
        return 0

    def _unpack_in_forward(self, slot: Slot) -> torch.Tensor:
        # See NOTE [ Backward inside a checkpointed forward ].
        # The function runs a backward of its own (``autograd.grad`` for a gradient
        # penalty, higher-order derivatives) through what it saved so far. Recompute
        # that prefix, exactly, from the caller's inputs; keep nothing of it for the
        # real backward (more slots are still to come) and release no kept input.
        # Each recomputed tensor is handed out once, as autograd unpacks a saved
        # tensor once per backward; a later backward recomputes again.
        tensor = self._recomputed_in_forward.pop(slot, None)
        if tensor is None:
            self._recomputed_in_forward = weakref.WeakKeyDictionary()
            self._replay(self._inputs_for_recompute_in_forward, self._recomputed_in_forward,
                         len(self.slots), lossy=False, last=False)
            tensor = self._recomputed_in_forward.pop(slot)
        return tensor

    def _inputs_for_recompute_in_forward(self) -> tuple:
        if self.kept.private_copy:  # the caller's inputs changed: use the copies
            return self.kept.restore_before_the_recompute(qualified_name(self.function))
        args, kwargs = self._forward_inputs
        return pytree.tree_map_only(torch.Tensor, _recompute_input, (args, kwargs))

    def _replay(self, inputs: Callable, into: weakref.WeakKeyDictionary, count: int, lossy: bool,
                last: bool, exact_count: bool = False) -> None:
        """Run the function again from ``inputs()`` and put the first ``count`` tensors
        it saves into ``into``, by slot; ``lossy`` applies the forward's ReLU decisions;
        ``last``: no recompute follows, so it may use up the module state's snapshot.
        ``exact_count``: the forward is over, so a recompute run to its end
        (``early_stop=False``) must save exactly ``count`` tensors."""
        cursor = Cursor()

        def fill(tensor):
            # The recompute's own graph holds the tensor as it is too, for a backward the
            # function runs inside itself (NOTE [ Backward inside a checkpointed forward ]).
            return self._fill(cursor.take(), tensor, into, count, lossy)

        pools = self.decisions.recompute_watching() if lossy and self.keeps_decisions else contextlib.nullcontext()
        try:
            with self.replaying(self.replay, fill, self.touched.as_in_forward(last)), pools, \
                    self._skipping(cursor, into, count, last):
                args, kwargs = inputs()  # under enable_grad: see KeptInputs.restore()
                with self.logged("recompute"):
                    run_segment(self.function, args, kwargs, self.kept.private_copy)
        except _AllSlotsFilled:
            pass
        produced = cursor.position
        if produced < count or (exact_count and produced != count):
            raise self._mismatch(
                f"the recompute saved {produced} tensors for backward where the forward "
                f"saved {count}: the checkpointed function {qualified_name(self.function)} "
                "does not do the same work twice. Make it deterministic (same branches, "
                "same shapes) or do not checkpoint it." + FLAGS_CHANGED
            )
        if lossy and self.keeps_decisions:
            self.decisions.masks.mark_differing()

    def _skipping(self, cursor: Cursor, into, count: int, last: bool):
        """What a recompute skips, filling the saves of what it skips itself: nothing
        here (selective.py skips the calls whose outputs it kept)."""
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def replaying(self, replay: ReplayState, fill: Callable, state):
        """What every recompute runs under: grad on, ``replay``'s RNG and autocast state,
        ``state`` (the module state as the forward saw it: TouchedState.as_in_forward,
        or a caller's context that sets it part by part), ``fill`` taking each save."""
        with _recomputing(), torch.enable_grad(), replay.replayed(), state, self.code.running(), \
                saved_tensors_hooks(weakly(fill), unchanged):
            yield

    def _fill(self, index: int, tensor: torch.Tensor, into, count: int, lossy: bool) -> torch.Tensor:
        """Put the recompute's ``index``-th save into ``into`` for its placeholder;
        return it detached, as both graphs hold it."""
        if self.touched.reads.watching:  # NOTE [ Buffers read after the forward changed them ]
            self.touched.reads.check(index, tensor)
        if self.options.checks_saves and index < count and _signature(tensor) != self.signatures[index]:
            raise self._mismatch(other_shapes(qualified_name(self.function), _shown(_signature(tensor)),
                                              _shown(self.signatures[index]), lossy))
        slot = self.slots[index]() if index < count else None
        detached = detached_or_same(tensor)
        # No slot: autograd freed the node that saved it; a kept one: the frame holds the
        # tensor itself (selective.py), which the recompute does not replace.
        if slot is not None and slot.kept is None:
            if lossy:
                self.decisions.restore(tensor, slot, self._mismatch)
            into[slot], slot.filled_at = detached, None if torch.compiler.is_compiling() else version(detached)
        if index == count - 1 and self.options.early_stop:
            # Early stop: what runs after the last saved tensor (at least the output of
            # the op that saved it) is not needed. Saves time and one activation of
            # peak memory, as torch's non-reentrant checkpoint does.
            raise _AllSlotsFilled
        return detached

    def logged(self, stage: str):
        return logged(self.options, self.operators, stage)

    def _mismatch(self, message: str) -> RecomputeError:
        message += compiled_calls.compiled_modules_advice(self.function, self.modules)
        return mismatch(self.options, self.operators, message, self.forward_ad)


def _shown(signature: tuple) -> tuple:
    dtype, device, *shape = signature
    return (tuple(shape), dtype, device)


def detached_or_same(tensor: torch.Tensor) -> torch.Tensor:
    # As torch's checkpoint: a tensor that needs no grad is handed back as the same
    # object (a custom Function that saved an input finds ``ctx.saved_tensors[0] is b``).
    return tensor.detach() if tensor.requires_grad else tensor


def _recompute_input(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().requires_grad_() if tensor.requires_grad else tensor


eager_hooks(CheckpointFrame.pack, CheckpointFrame.unpack)  # NOTE [ Eager hooks Dynamo leaves alone ]


class _AllSlotsFilled(RecomputeStop):
    """Raised inside the recompute to stop it once every placeholder is filled."""


class _recomputing:
    def __enter__(self):
        _local.recompute_depth = _recompute_depth() + 1

    def __exit__(self, *exc):
        _local.recompute_depth -= 1


def qualified_name(function) -> str:
    return getattr(function, "__qualname__", None) or type(function).__name__


def checkpointed_call(function: Callable, args: tuple, kwargs: dict, policy: KeepPolicy, private_copy: bool = False,
                      options: RecomputeOptions = DEFAULT_RECOMPUTE, made_by: Optional[CallerTensors] = None,
                      eager_because: Optional[str] = None, prepared: Optional[tuple] = None, boundaries=(None, None)
                      ) -> tuple:
    """Run ``function(*args, **kwargs)`` keeping only its inputs for backward.

    Returns ``(output, kept_bytes)``: the function's output, untouched, and the bytes
    kept for its backward (inputs and ReLU sign bits; 0 when nothing needs a backward;
    None inside a compiled graph, which keeps what it chooses: NOTE [ Checkpoints in a
    compiled graph ]). ``private_copy`` makes the kept inputs private copies, for
    functions that modify their inputs in place. ``options`` say how to recompute
    (recompute_options.py). ``made_by``: the inputs are a chain's activations, made by
    its layers before (keep_rules.should_encode). ``eager_because``: why a call Dynamo
    meets runs eagerly, for its warning. ``prepared``: the modules under the function's layers
    and their state as the forward starts, from chain.ChainState (eager calls only): NOTE [
    Segment checkpoint mechanism ]. ``boundaries``: the chain's Boundary before this
    segment and after it, or None (eager calls only): NOTE [ Decisions at a boundary ]."""
    if not torch.is_grad_enabled():
        return function(*args, **kwargs), 0
    if torch.compiler.is_compiling():  # NOTE [ torch.compile ] in compiled_calls.py
        if compiled_calls.compiles_in_graph(policy):
            return compiled_calls.checkpoint_in_graph(function, args, kwargs, options,
                                                      eager_call=eager_checkpointed_call,
                                                      eager_args=(policy, private_copy, options, made_by)), None
        return compiled_calls.checkpointed_call_under_compile(eager_checkpointed_call, function, args, kwargs, policy,
                                                              private_copy, options, made_by, eager_because)
    return compiled_calls.out_of_dynamo(eager_checkpointed_call)(function, args, kwargs, policy, private_copy, options,
                                                            made_by, prepared, boundaries=boundaries)


def eager_checkpointed_call(function, args, kwargs, policy, private_copy, options, made_by=None, prepared=None,
                       make_frame: Callable = None, boundaries=(None, None)):
    """The eager checkpointed call; ``make_frame``: the frame's constructor, CheckpointFrame's
    arguments (a subclass of CheckpointFrame: selective.py's)."""
    if _recompute_depth() > 0:  # NOTE [ Nested checkpoints ]
        policy = EXACT
    inputs = input_tensors(args, kwargs)
    replay = ReplayState.capture(inputs, options.preserve_rng_state, passed_generators(args, kwargs))
    before, after = boundaries
    kept = KeptInputs(args, kwargs, policy, private_copy, made_by, before)
    frame = (make_frame or CheckpointFrame)(function, kept, replay, args, kwargs, options, inputs, prepared)
    after = after if frame.keeps_decisions else None
    try:
        with frame.forward_hooks():
            output = run_segment(function, args, kwargs, private_copy,
                                 None if after is None else frame.decisions.hold_relu_saves)
        if after is not None:
            frame.decisions.hand_off(output, after)
    except BaseException:
        frame.release()  # now, not when the traceback that holds it is dropped
        raise
    finally:
        frame.end_forward()
    frame.code.forward_ended(frame.decision_bytes > 0)  # a forward that raised found out nothing
    kept.end_forward(qualified_name(function))
    if not frame.slots:  # nothing to backprop through: nothing to keep
        frame.release()
        return output, 0
    if make_frame is None:  # nested and selective frames recompute by rules of their own
        _recompute_on_entry(frame, output, inputs)
    return output, kept.nbytes + frame.decision_bytes + frame.account_kept()


def _recompute_on_entry(frame: CheckpointFrame, output, inputs) -> None:
    """Recompute ``frame`` as backward reaches the node of an output that is a view, but
    an input handed on (NOTE [ Segment checkpoint mechanism ]); weakly held."""
    leaves = (output,) if isinstance(output, torch.Tensor) else pytree.tree_leaves(output)
    views = [t for t in leaves if isinstance(t, torch.Tensor) and t._is_view()]
    handed_on = [t.grad_fn for t in inputs] if views else ()
    ref = weakref.ref(frame)

    def entered(grad_outputs):
        live = ref()
        if live is not None and not live.in_forward and not live.is_recomputed:
            live._recompute()

    for t in views:
        if t.grad_fn is not None and all(t.grad_fn is not n for n in handed_on):
            t.grad_fn.register_prehook(entered)
