"""A codec's kept inputs encoded inside a compiled graph.

NOTE [ Codecs in a compiled graph ]

Under ``torch.compile`` a CheckpointedSequential whose layers keep by a lossy codec
(none on the host) compiles its forward as one graph, and the codec's bits go into
that graph and its backward:

- Each checkpointed segment is torch's checkpoint in the graph (NOTE [ Checkpoints in
  a compiled graph ] in function.py), its region annotated with its codec's name
  (``node.meta["custom"]``); a stored segment that keeps by a codec is annotated as
  stored. The annotation follows the ops into AOTAutograd's graphs and into the
  copies its partitioner recomputes.
- While the graph is compiled and run, actsave's saved-tensor hooks are set, as
  GraphModules that AOTAutograd inlines (NOTE [ Saved-tensor hooks in a compiled
  graph ] in _torch.py). For each saved intermediate the hook looks at the graphs:
  one whose backward users are a region recomputed under codec C is that segment's
  kept input, encoded by C at the end of the forward graph and decoded at the start
  of the backward one; one made inside a stored segment under C is stored by C, as
  eager actsave stores the last segment's saves (compressed_saves.py). Other saves
  stay as they are. AOTAutograd hands no graph input to the hooks (the batch, the
  parameters): held by the caller, encoding them would free nothing (store.py,
  should_encode).
- The codec's torch reference is what is traced: the specification of its bits, one
  definition for both devices. Inductor generates the kernels from it (on CUDA, Triton
  ones) and may fuse the decode into its consumers. Traced, the references take their
  general path: no branch reads a value (triton_kernels/_scale.py).
- The forward's decisions cannot be kept: a recompute in the graph computes each
  ReLU and max pool again from the decoded input (eager actsave restores the
  forward's: relu_signs.py, pool_decisions.py). Where a lossy segment makes such
  decisions, found on meta tensors at the first compiled call of each input
  (:func:`decisions_made`), the forward runs eagerly instead, with one warning;
  without the decisions the worst gradient of a compiled ResNet fell to 3 dB
  (docs/results.md, "torch.compile").
- Dynamo does not trace entering saved-tensor hooks (graph break gb0008), AOTAutograd
  inlines the hooks set when it compiles, and each compiled frame is guarded on the
  hooks set when it runs. So the hooks are set at the forward's first graph break
  (where the plan is looked up, before any compute) and unset at a second, after the
  last: two breaks, one graph between them.
- A lossy segment's output that an exact stored segment saves (its first layer's
  input) is kept exactly eagerly, as the stored segment's own save. In the graph the
  partitioner would recompute it instead, from the encoded input (it must keep that
  anyway), so that the stored layer's weight gradient came out lossy too (a GELU
  chain's fell from exact to 71.6 dB). So such a segment ends in a copy of its output
  that its checkpoint must save (:func:`ending_in_a_saved_copy`, selective
  checkpointing); the stored segment's backward reads that copy, exactly.
- Where other saved-tensor hooks are set when the forward starts (an outer
  checkpoint, ``save_on_cpu``, the caller's), the compiled graph would apply ours
  instead of theirs: the forward runs eagerly, as without compile.
- A forward that raises between the two breaks leaves the hooks set: the next call's
  first break unsets them (they are found on top), and :func:`hooks_off` only ever
  unsets its own.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from .. import _torch
from ..codecs import Packed, get_codec
from ..devices import forked_rng_devices
from ..meta import on_meta
from . import relu_signs
from .layers import modules_under
from .pool_decisions import Window
from .store import KeepPolicy

_KEPT = "actsave_kept_by"  # the annotation of a checkpointed region: its codec's name
_STORED = "actsave_stored_by"  # that of a stored segment's ops


def missing_pieces() -> Optional[str]:
    """None where this torch can hold codecs in a compiled graph, else why not."""
    missing = _torch.graph_hooks_missing()
    return None if missing is None else f"this PyTorch ({torch.__version__}) lacks {missing}"


def annotation(policy: KeepPolicy, checkpointed: bool):
    """The context a segment kept by ``policy`` is traced in (see the NOTE)."""
    if policy.codec.lossless:
        return _torch.annotated({})
    return _torch.annotated({_KEPT if checkpointed else _STORED: policy.codec.name})


def _saving_copies(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op is torch.ops.aten.clone.default else CheckpointPolicy.PREFER_RECOMPUTE


def _saved_copy_context():
    return create_selective_checkpoint_contexts(_saving_copies)


class _EndingInACopy:
    def __init__(self, function):
        self.function = function

    def __call__(self, *args, **kwargs):
        return self.function(*args, **kwargs).clone()


def ending_in_a_saved_copy(function) -> tuple:
    """``(function that returns a copy of function's output, context_fn)``: checkpointed
    in a compiled graph with that ``context_fn``, the copy is saved, not recomputed
    (see the NOTE)."""
    return _EndingInACopy(function), _saved_copy_context


def _codec_of(node, backward) -> Optional[str]:
    """The codec that keeps the saved ``node``, or None: see the NOTE."""
    made_in = node.meta.get("custom") or {}
    if _STORED in made_in:
        return made_in[_STORED]
    placeholder = next((n for n in backward.find_nodes(op="placeholder") if n.name == node.name), None)
    if placeholder is None:
        return None
    # Its users are the region's recompute and the backward of the region's first ops,
    # which carry the region's annotation too. A save read by regions of two codecs, or
    # also by another op (a stored segment's, which eagerly keeps it exactly), stays exact.
    names = {(user.meta.get("custom") or {}).get(_KEPT) for user in placeholder.users}
    return names.pop() if len(names) == 1 else None


def _pack(value: torch.Tensor):
    traced = _torch.saved_node_being_traced()
    name = _codec_of(*traced) if traced is not None and value.is_floating_point() else None
    if name is None:
        return value
    packed = get_codec(name).encode(value)
    return packed.data, packed.scales, packed.offsets


def _unpack(stored):
    if isinstance(stored, torch.Tensor):
        return stored
    node, backward = _torch.saved_node_being_traced()
    like = node.meta["val"]
    data, scales, offsets = stored
    return get_codec(_codec_of(node, backward)).decode(Packed(data, scales, like.shape, like.dtype, offsets=offsets))


_hooks = None


def _the_hooks() -> tuple:
    """actsave's graph hooks, made once: Dynamo guards compiled frames on their identity."""
    global _hooks
    if _hooks is None:
        _hooks = (_torch.graph_hook(_pack), _torch.graph_hook(_unpack))
    return _hooks


def hooks_on() -> bool:
    """Set actsave's graph hooks, first unsetting those a failed forward left on top;
    False (nothing set) where other saved-tensor hooks are set."""
    if _torch.top_saved_tensor_hooks() == _the_hooks():
        _torch.pop_saved_tensor_hooks()
    if _torch.saved_tensor_hooks_active():
        return False
    _torch.push_saved_tensor_hooks(*_the_hooks())
    return True


def hooks_off() -> None:
    """Unset actsave's graph hooks where they are on top."""
    if _torch.top_saved_tensor_hooks() == _the_hooks():
        _torch.pop_saved_tensor_hooks()


def decisions_made(segments: list, input: torch.Tensor) -> Optional[str]:
    """What decisions a segment of ``segments`` (``[(layers, policy)]``, in order) that
    keeps by a lossy codec makes, which a compiled recompute cannot keep: its max pools
    whose decisions eager actsave keeps, or the ReLU outputs it saves, found by running
    the forward on meta tensors (no compute, no collective); None where it makes none.
    A forward that fails on meta tensors is said to, so that eager actsave runs it."""
    lossy = [layers for layers, policy in segments if not policy.codec.lossless]
    if any(Window.of(module) is not None for layers in lossy for _, module in modules_under(tuple(layers))):
        return "max-pool decisions"
    relu_outputs, segment_inputs = [], None  # segment_inputs: None outside a lossy segment

    def pack(t):
        if segment_inputs is not None and relu_signs.made_by_segment_relu(t, segment_inputs):
            relu_outputs.append(t.shape)
        return t
    holder = nn.ModuleList(layer for layers, _ in segments for layer in layers)
    # As the planner's meta steps (planning/instrumented_step.py): the caller's RNG
    # does not move, and compiled layers run their eager code, compiling nothing.
    try:
        with on_meta(holder), saved_tensors_hooks(pack, lambda t: t), torch.enable_grad(), \
                torch.random.fork_rng(devices=forked_rng_devices(input.device)), \
                torch.compiler.set_stance("force_eager"):
            x = torch.empty_strided(input.shape, input.stride(), dtype=input.dtype, device="meta")
            if x.is_floating_point():
                x = x.requires_grad_().clone()
            for layers, policy in segments:
                segment_inputs = None if policy.codec.lossless else relu_signs.input_nodes([x])
                for layer in layers:
                    x = layer(x)
    except Exception as error:  # noqa: BLE001 - any failure means: run it as eager actsave does
        return f"decisions unknown: its forward failed on meta tensors ({type(error).__name__}: {error})"
    return "ReLU decisions" if relu_outputs else None
