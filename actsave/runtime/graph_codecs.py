"""A codec's kept inputs encoded inside a compiled graph.

NOTE [ Codecs in a compiled graph ]

Under ``torch.compile`` a CheckpointedSequential whose layers keep by a lossy codec
(none on the host) compiles its forward as one graph, and the codec's bits go into
that graph and its backward:

- Each checkpointed segment is torch's checkpoint in the graph (NOTE [ Checkpoints in
  a compiled graph ] in function.py), its region annotated with its codec's name
  (``node.meta["custom"]``); a plain segment that keeps by a codec is annotated as
  stored. The annotation follows the ops into AOTAutograd's graphs and into the
  copies its partitioner recomputes.
- While the graph is compiled and run, actsave's saved-tensor hooks are set, as
  GraphModules that AOTAutograd inlines (NOTE [ Saved-tensor hooks in a compiled
  graph ] in _torch_graphs.py). For each saved intermediate the hook looks at the graphs:
  one whose backward users are a region recomputed under codec C is that segment's
  kept input, encoded by C at the end of the forward graph and decoded at the start
  of the backward one; one made inside a plain segment under C is stored by C, as
  eager actsave stores the last segment's saves (kept_saves.py), but for those it
  leaves exact, those that need no gradient and attention's among them (NOTE
  [ Attention's saves agree ]; which saves: graph_saves.py). Other saves stay as they
  are. AOTAutograd hands no graph input to the hooks (the batch, the parameters): held
  by the caller, encoding them would free nothing (keep_rules.py, should_encode).
- The codec's torch reference is what is traced, whichever backend runs eagerly
  (codecs/backend.py; a Triton launcher cannot run on the fake tensors a trace
  hands it): the specification of its bits, one definition for both devices. Inductor
  generates the kernels from it (on CUDA, Triton ones) and may fuse the decode into
  its consumers. Traced, the references take their general path, in which no branch
  reads a value (triton_kernels.general_path, set by the hooks: torch 2.11 does not
  say it compiles where AOTAutograd traces them).
- The forward's decisions cannot be kept: a recompute in the graph computes each
  ReLU and max pool again from the decoded input (eager actsave restores the
  forward's: relu_signs.py, pool_decisions.py). Where a lossy segment makes such
  decisions, found on fake meta tensors at the first compiled call of each input
  (:func:`~actsave.runtime.decision_probes.decisions_made`; NOTE [ Fake tensors in a probe ] in _torch_graphs.py), the
  forward runs eagerly instead, with one warning: without the decisions a
  conv-BN-ReLU network's BatchNorm gradients lose most of their precision
  (docs/results.md, "Other figures").
- Dynamo does not trace entering saved-tensor hooks (graph break gb0008), AOTAutograd
  inlines the hooks set when it compiles, and each compiled frame is guarded on the
  hooks set when it runs. So the hooks are set outside the frame that is compiled with
  them, and unset after it returns. A CheckpointedSequential does both in one graph
  break, before any compute: its forward calls a function Dynamo does not trace but
  whose callees it compiles (``_torch_graphs.untraced_frame``), which looks up the segments,
  sets the hooks, calls the traced forward, which Dynamo compiles as a frame of its
  own, and unsets them when that returns or raises. One break, one graph.
- A lossy segment's output that an exact plain segment saves (its first layer's
  input) is kept exactly eagerly, as the plain segment's own save. In the graph the
  partitioner would recompute it instead, from the encoded input (it must keep that
  anyway), so that the stored layer's weight gradient would come out lossy too. So
  such a segment's output is copied after its checkpoint by an operator of actsave's
  own (:func:`output_copied`), which no partitioner recomputes; the plain segment's
  backward reads that copy, exactly.
- Blocks that ``wrap`` checkpointed (wrappers.py) do the same from the model's root,
  whose forward is the model's own code: ``wrap`` sets the root's ``forward`` (on the
  instance, as accelerate's hooks do; :class:`RootForward`) to a callable that, under
  torch.compile only, calls the model's forward from such a function: one break, one
  graph. There the model is first probed on meta tensors for the blocks whose decisions
  a graph cannot keep; each of those, and each block that keeps on the host, runs
  eagerly at a break of its own. A wrapped root inside another's forward is traced as
  part of it, with no break: the outer one's probe ran its blocks too. What reads a
  block's output is not known there, so every block's output in the graph is copied so,
  which an exact reader's backward reads exactly. And the block's activation inputs are
  copied before its checkpoint, the copies being the only saves its codec keeps
  (:func:`inputs_copied`): what eager actsave would encode (keep_rules.should_encode; a
  leaf that requires grad too, which eager actsave keeps by reference), and a tensor of
  the graph's own even where Dynamo compiles each block alone (a graph break in the
  model's loop over blocks makes it run that loop eagerly) and the activation arrives as
  a graph input, which AOTAutograd never hands to the hooks. Two copies per block: the
  price of not knowing the model's code.
- Where other saved-tensor hooks are set when the forward starts (an outer
  checkpoint, ``save_on_cpu``, the caller's), the compiled graph would apply ours
  instead of theirs: the forward runs eagerly, as without compile.
- Where a forward left the hooks set all the same, the next call's first break unsets
  them (they are found on top), and :func:`hooks_off` only ever unsets its own.
"""
from __future__ import annotations

import contextlib
import inspect
import threading
import weakref
from typing import Callable, Optional

import torch
from torch import nn

from .. import _torch, _torch_graphs
from ..codecs import Packed, encodable, get_codec
from ..codecs.backend import forced_here
from ..triton_kernels import general_path
from .decision_probes import probe_blocks, probe_key
from .graph_saves import BLOCK, COPY, KEPT, STORED, codec_of
from .keep_rules import KeepPolicy


def missing_pieces() -> Optional[str]:
    """None where this torch can hold codecs in a compiled graph, else why not."""
    missing = _torch_graphs.graph_hooks_missing()
    return None if missing is None else f"this PyTorch ({torch.__version__}) lacks {missing}"


def annotation(policy: KeepPolicy, checkpointed: bool):
    """The context a segment kept by ``policy`` is traced in (see the NOTE): none for
    an exact one, which compiles on a torch without the pieces codecs need too."""
    if policy.codec.lossless:
        return contextlib.nullcontext()
    return _torch_graphs.annotated({KEPT if checkpointed else STORED: policy.codec.name})


def block_annotation(policy: KeepPolicy):
    """The context a wrapped block's checkpoint is traced in."""
    return _torch_graphs.annotated({BLOCK: policy.codec.name})


# The copies are an operator of actsave's own: Inductor removes a clone that nothing
# needs (its graph passes drop no-op copies), and with it the annotation that marks a
# save for the codec, and a partitioner may recompute a clone where it must save a
# copy (output_copied).
@torch.library.custom_op("actsave::copy", mutates_args=())
def _copy(t: torch.Tensor) -> torch.Tensor:
    return t.clone()


@_copy.register_fake
def _(t):
    return torch.empty_like(t)


_copy.register_autograd(lambda ctx, grad: grad)


def output_copied(output):
    """``output`` with each tensor in it copied by actsave's own operator, after the
    checkpoint that made it: no partitioner recomputes that operator, so the copy is
    saved where a backward reads it, exactly, rather than recomputed from the
    checkpoint's encoded input (see the NOTE)."""
    return _torch.pytree.tree_map_only(torch.Tensor, _copy, output)


def _copied(t: torch.Tensor) -> torch.Tensor:
    return _copy(t) if encodable(t) and t.requires_grad else t


def inputs_copied(args: tuple, kwargs: dict, policy: KeepPolicy) -> tuple:
    """``(args, kwargs)`` with each activation among them (a tensor a codec takes that
    requires grad) copied, the copies annotated as kept by ``policy``'s codec: of a wrapped
    block's saves, the hooks encode those only. A copy is the graph's own tensor,
    encoded even where the activation reached the graph as one of its inputs, which the
    hooks are never given (see the NOTE). Unlike keep_rules.should_encode this takes a leaf
    that requires grad too: Dynamo neither tells leaves from other inputs nor guards
    on it."""
    with _torch_graphs.annotated({COPY: policy.codec.name}):
        return _torch.pytree.tree_map_only(torch.Tensor, _copied, (args, kwargs))


@contextlib.contextmanager
def _reference_traced():
    """What the hooks trace, on this thread: the codec's torch reference on its general path (see the NOTE)."""
    with forced_here("torch"), general_path():
        yield


def _pack(value: torch.Tensor):
    traced = _torch_graphs.saved_node_being_traced()
    name = codec_of(*traced) if traced is not None and encodable(value) else None
    if name is None:
        return value
    with _reference_traced():
        packed = get_codec(name).encode(value)
    return packed.data, packed.scales, packed.offsets


def _unpack(stored):
    if isinstance(stored, torch.Tensor):
        return stored
    node, backward = _torch_graphs.saved_node_being_traced()
    like = node.meta["val"]
    data, scales, offsets = stored
    with _reference_traced():
        shape = _torch_graphs.traced_shape(like, data)
        return get_codec(codec_of(node, backward)).decode(Packed(data, scales, shape, like.dtype, offsets=offsets))


_hooks = None
_hooks_lock = threading.Lock()


def _the_hooks() -> tuple:
    """actsave's graph hooks, made once: Dynamo guards compiled frames on their identity,
    and a thread unsets the hooks it set by that identity (so made under a lock: two
    threads' first calls must not make two pairs)."""
    global _hooks
    if _hooks is None:
        with _hooks_lock:
            if _hooks is None:
                _hooks = (_torch_graphs.graph_hook(_pack), _torch_graphs.graph_hook(_unpack))
    return _hooks


def _ours_on_top() -> bool:
    return _torch.top_saved_tensor_hooks() == _the_hooks()


def hooks_on() -> bool:
    """Set actsave's graph hooks, first unsetting those a failed forward left on top;
    False (nothing set) where other saved-tensor hooks are set."""
    if _ours_on_top():
        _torch_graphs.pop_saved_tensor_hooks()
    if _torch.saved_tensor_hooks_active():
        return False
    _torch_graphs.push_saved_tensor_hooks(*_the_hooks())
    return True


# Disabled: it is called where Dynamo compiles the callees (the forwards' one break).
@torch.compiler.disable
def hooks_off() -> None:
    """Unset actsave's graph hooks where they are on top."""
    if _ours_on_top():
        _torch_graphs.pop_saved_tensor_hooks()


# --- blocks that wrap() checkpointed: the hooks set and unset around the root's forward ---

# ``set_for_blocks``: set at a root's graph break, read as Dynamo traces its blocks. Per
# thread, as the graph hooks it stands for are: another thread tracing its own blocks
# meanwhile has none set. Read by getattr with a default from a plain threading.local,
# on which Dynamo guards (it took a threading.local subclass's class attribute for a
# constant: torch 2.13).
_this_thread = threading.local()
# Set on the importing thread now: a guard on an attribute that is missing fails once
# it is set, and the root's frame would be traced again at its second call.
_this_thread.set_for_blocks = False
_probed = weakref.WeakKeyDictionary()  # root -> (its submodules, {input key: {checkpoint: why eager}})


def _set_for_blocks() -> bool:
    return getattr(_this_thread, "set_for_blocks", False)


class RootForward:
    """The ``forward`` of a model whose blocks ``wrap`` keeps by a codec: the model's
    own forward, which under torch.compile it calls from one graph break, with
    actsave's graph hooks set around it (see the NOTE). Eagerly it only calls it.

    It is an instance attribute, as Hugging Face's accelerate sets its hooks: the
    class's forward is untouched, and one set on the instance before is called in
    turn. The model's signature is its own (``inspect.signature(model.forward)``), and
    the model deep-copies and pickles with it."""

    def __init__(self, model: nn.Module, previous=None):
        # The model holds this: a strong reference back, a cycle that only a collection frees.
        self._model = weakref.ref(model)
        self.previous = previous  # the instance's forward before, or None: the class's

    @property
    def model(self) -> nn.Module:  # the model whose forward this is
        model = self._model()
        if model is None:
            raise ReferenceError("actsave: this forward's model was freed; hold the model, not its forward alone")
        return model

    def __reduce__(self):  # copied and pickled with the model, around the copy
        return RootForward, (self.model, self.previous)

    @property
    def __code__(self):  # torch.export names a module's forward by its code object
        return (self.previous or type(self.model).forward).__code__

    def __call__(self, *args, **kwargs):
        if torch.compiler.is_compiling() and not torch.compiler.is_exporting() and not _set_for_blocks():
            # not inside a root that set them, nor exported: NOTE [ torch.export ] in compiled_calls.py
            return _forward_with_graph_codecs(self, args, kwargs)
        return self.own_forward(*args, **kwargs)

    def own_forward(self, *args, **kwargs):
        if self.previous is not None:
            return self.previous(*args, **kwargs)
        return type(self.model).forward(self.model, *args, **kwargs)

    @property
    def __signature__(self) -> inspect.Signature:
        own = self.previous if self.previous is not None else type(self.model).forward.__get__(self.model)
        return inspect.signature(own)

    # A wrapper that rebinds a bound method's function to its model (accelerate's mixed
    # precision, its unwrap_model) finds these: a function of the model it is bound to,
    # so that a copy of the model runs its own weights, not this model's. None where an
    # instance forward came before: that one is this model's alone.
    @property
    def __self__(self) -> nn.Module:
        return self.model

    @property
    def __func__(self) -> Callable:
        if self.previous is not None:
            raise AttributeError("__func__: this model's forward before wrap was its own")
        return _root_forward


def _root_forward(model: nn.Module, *args, **kwargs):
    """:class:`RootForward`'s call as a function of its model (``RootForward.__func__``)."""
    return RootForward(model)(*args, **kwargs)


def watch_root(model: nn.Module) -> None:
    """Make ``model``, whose blocks ``wrap`` keeps by a codec, call its forward with
    actsave's graph hooks set under torch.compile (:class:`RootForward`); once."""
    previous = model.__dict__.get("forward")
    if not isinstance(previous, RootForward):
        model.forward = RootForward(model, previous)


def blocks_in_graph(policy: KeepPolicy, eager_because: Optional[str]) -> bool:
    """Whether a wrapped block kept by ``policy`` is traced with its codec in the graph."""
    return _set_for_blocks() and policy.lossy and not policy.offload and eager_because is None


@_torch_graphs.untraced_frame  # the root's one graph break (see the NOTE)
def _forward_with_graph_codecs(root: RootForward, args: tuple, kwargs: dict):
    set_here = _blocks_on(root.model, args, kwargs)
    try:
        return root.own_forward(*args, **kwargs)
    finally:
        if set_here:
            _blocks_off()


@torch.compiler.disable  # probing runs eagerly
def _blocks_on(model, args, kwargs) -> bool:
    """Probe ``model``'s lossy blocks for decisions (once per input) and set the graph
    hooks; whether this call set them."""
    modules = tuple(model.modules())[1:]  # not the root: _probed's key, which its value must not hold
    checkpoints = [m for m in modules if _keeps_by_codec(m)]
    if not checkpoints:
        return False
    why = missing_pieces()
    if why is None:
        key = probe_key(args, kwargs, model, checkpoints)
        probed_for, known = _probed.get(model, ((), {}))
        if probed_for != modules:  # a module added, replaced or removed: probe again
            known = {}
            _probed[model] = (modules, known)
        if key not in known:
            known[key] = probe_blocks(model, checkpoints, args, kwargs)
        _set_eager_because(checkpoints, known[key].get)
        if len(known[key]) == len(checkpoints):
            return False  # every one runs eagerly: nothing to set
        if hooks_on():
            _this_thread.set_for_blocks = True
            return True
        why = "other saved-tensor hooks are set, which the compiled graph would not apply"
    _set_eager_because(checkpoints, lambda checkpoint: why)
    return False


def _set_eager_because(checkpoints: list, why) -> None:
    # Only where it changes: Dynamo guards on what the traced blocks read.
    for checkpoint in checkpoints:
        if checkpoint._eager_because != why(checkpoint):
            checkpoint._eager_because = why(checkpoint)


@torch.compiler.disable
def _blocks_off() -> None:
    hooks_off()
    _this_thread.set_for_blocks = False


@contextlib.contextmanager
def hooks_paused():
    """While active, actsave's graph hooks are unset where they are set: a block that
    runs eagerly between the root's breaks keeps by actsave's eager hooks, which must
    not see ours (they would take them for a caller's: kept_saves.py)."""
    paused = _ours_on_top()
    if paused:
        _torch_graphs.pop_saved_tensor_hooks()
    try:
        yield
    finally:
        if paused:
            _torch_graphs.push_saved_tensor_hooks(*_the_hooks())


def _keeps_by_codec(module: nn.Module) -> bool:
    """Whether ``module`` is a wrapped block that keeps its inputs by a lossy codec."""
    policy = getattr(module, "_kept_inputs_policy", None)
    return isinstance(policy, KeepPolicy) and hasattr(module, "_eager_because") and policy.lossy
