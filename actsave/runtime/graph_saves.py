"""Which saves of a compiled graph a codec keeps (NOTE [ Codecs in a compiled graph ] in
graph_codecs.py): the annotations that mark a segment's ops, read from a saved node and
its backward users (:func:`codec_of`); and, of a plain segment's saves, those that need
no gradient and those an attention call took or made, which stay exact as eager actsave
keeps them (keep_rules.traced_save_stored; NOTE [ Attention's saves agree ] in
keep_rules.py; :func:`attention_holds`).
"""
from __future__ import annotations

import collections
import operator
import weakref
from typing import Optional

import torch

from .. import _taps, _torch
from .keep_rules import compares_with_input_op, traced_save_stored

KEPT = "actsave_kept_by"  # the annotation of a checkpointed segment: its codec's name
STORED = "actsave_stored_by"  # that of a plain segment's ops
# That of a wrapped block's checkpoint: not KEPT, so that no region input of a block
# is encoded as a segment's is; of a block's saves only its input copies are (COPY).
BLOCK = "actsave_block_kept_by"
COPY = "actsave_copy_kept_by"  # that of the copies of a block's inputs, the saves its codec keeps


def codec_of(node, backward) -> Optional[str]:
    """The codec that keeps the saved ``node`` of a forward graph whose backward graph
    is ``backward``, or None: NOTE [ Codecs in a compiled graph ] in graph_codecs.py."""
    made_in = node.meta.get("custom") or {}
    if COPY in made_in:
        return made_in[COPY]
    if STORED in made_in:  # a plain segment's saves, stored as eager kept_saves stores them
        stored = traced_save_stored(node.meta["val"], _made_by(node).target, _needs_grad(node, backward)) \
            and not attention_holds(node) and not compared_by_backward(node, backward)
        return made_in[STORED] if stored else None
    placeholder = next((n for n in backward.find_nodes(op="placeholder") if n.name == node.name), None)
    if placeholder is None:
        return None
    # Its users are the region's recompute and the backward of the region's first ops,
    # which carry the region's annotation too. A save read by regions of two codecs, or
    # also by another op (a plain segment's, which eagerly keeps it exactly), stays exact.
    names = {(user.meta.get("custom") or {}).get(KEPT) for user in placeholder.users}
    return names.pop() if len(names) == 1 else None


# NOTE [ Traced saves that need no gradient ]
# Whether a save needs a gradient (keep_rules.traced_save_stored asks; eager actsave keeps
# a tensor that needs none by reference: it is a leaf). Its traced value does not say
# (under AOTAutograd no fake tensor of the graph requires grad), so the graph tells: the
# save needs one where its value depends, through floating-point tensors (an integer or
# bool one carries no gradient), on a forward input whose gradient the backward returns.
# The backward's outputs are the gradients of the forward's inputs, in their order, None
# for an input that needs none (a buffer: a rotary table's inv_freq; a batch that needs
# none) and for an extra input past them (CUDA's RNG seeds); each gradient has its
# input's shape, and where one does not, they are not taken to line up: every save is
# then taken to need one. So a save the partitioner chose from tensors that need
# none (a Llama block's rotary angles, cos and sin made again from them in the backward)
# stays exact, as eager actsave keeps cos and sin. Ops under no_grad or after a detach
# of an activation leave no mark in the graph: their saves are taken to need a
# gradient, and encoded.
def _needs_grad(node, backward) -> bool:
    """Whether the saved ``node`` of a forward graph whose backward graph is
    ``backward`` needs a gradient: NOTE [ Traced saves that need no gradient ]."""
    with_gradient = _inputs_with_gradients(node.graph, backward)
    if with_gradient is None:
        return True
    seen, pending = {node}, collections.deque([node])
    while pending:  # breadth first: a layer's parameter is a few nodes from its output
        current = pending.popleft()
        if current in with_gradient:
            return True
        for source in current.all_input_nodes:
            if source not in seen and _carries_gradient(source):
                seen.add(source)
                pending.append(source)
    return False


def _inputs_with_gradients(forward, backward) -> Optional[set]:
    """The inputs of ``forward`` whose gradients ``backward`` returns, or None where its
    outputs do not line up with them (NOTE [ Traced saves that need no gradient ])."""
    pairs = [(n, g) for n, g in zip(forward.find_nodes(op="placeholder"), backward.output_node().args[0])
             if isinstance(g, torch.fx.Node)]
    if any(_shape(n) != _shape(g) for n, g in pairs):
        return None
    return {n for n, _ in pairs}


def _shape(node):
    # As text: sizes that are symbols (dynamic shapes) compare so without adding a guard.
    value = node.meta.get("val")
    return tuple(map(str, value.shape)) if isinstance(value, torch.Tensor) else None


def _carries_gradient(node) -> bool:
    value = node.meta.get("val")
    return not isinstance(value, torch.Tensor) or value.is_floating_point() or value.is_complex()


# Attention's saves in a graph (NOTE [ Attention's saves agree ]): eager actsave knows
# them by the call (a tap on F.scaled_dot_product_attention) and by the storages its
# saves hold. A graph has no call, but its nodes remember it: each op traced from
# F.scaled_dot_product_attention carries it as its innermost source (the fused
# kernel of each device, its outputs, and the math path's ops, whose probabilities
# and dropout mask are saved), and the fused kernels are known by their operators
# too. Storages are known by views: a save is held exactly where it, or a tensor it
# is a view of, or another view of that, is made by attention or taken by it (q, k
# and v, views of the projection's output; the output projection's input, a view of
# attention's output). That also holds a save of such a storage made before the call,
# which eager actsave, knowing a storage only once attention saved it, encodes: the
# storage lives anyway.
_FUSED = frozenset(packet for packet in (
    _torch.flash_attention, _torch.efficient_attention, _torch.cpu_flash_attention,
    getattr(torch.ops.aten, "_scaled_dot_product_cudnn_attention", None)) if packet is not None)
# Operators whose output shares its input's storage that the schema does not call views.
_ALIASING = frozenset({torch.ops.aten._unsafe_view.default})


def attention_holds(node) -> bool:
    """Whether the saved ``node`` shares its storage with a tensor an attention call
    took or made, so that a lossy codec keeps it exactly (see above)."""
    return any(_attention(n) or any(_attention(user) for user in n.users) for n in _views_of(_base(node)))


def compared_by_backward(node, backward) -> bool:
    """Whether the saved ``node`` is the result of a reduction whose backward compares it
    with its input, or a tensor the forward made that input from (the input itself
    included), which a lossy codec keeps exactly (NOTE [ Saves a backward compares ] in
    keep_rules.py); only where the ``backward`` graph reads the result (a softmax
    decomposed into an amax does not: its backward reads the softmax's output). Not
    only the input: the partitioner may save the result and an earlier tensor, and
    recompute the input from that one in the backward (a GELU's output from its input),
    where the comparison then reads it. Asked of the whole storage (every view of it),
    as attention_holds is: its saves are stored alike. Only the plain segment's own ops
    are followed (STORED): not the codecs' ops that the hooks add to the graph between a
    save's encoding and its decoding, which would change the answer. A result of a
    reduction that makes several (``aminmax``'s, a ``getitem``) is asked as that reduction."""
    reaches = _reaching_compared(node.graph, backward)
    made = _made_by(node)
    start = made if made is not node and compares_with_input_op(made) else node
    return _compared_walk(_views_of(_base(start)), reaches, backward)


# The forward and backward graphs whose saves' codecs are being chosen (weakly), and by
# the name of each forward node whether it reaches, through plain-segment ops (STORED),
# a compared reduction whose result the backward reads: worked out once, in one pass
# over the graph, not a walk per save (quadratic in the graph). The codecs' hooks then
# add nodes to the forward graph, none of them STORED: those of the pass keep their answer.
# One tuple, read and replaced whole: threads that compile at once each find their own.
_REACHING = (lambda: None, lambda: None, {})


def _reaching_compared(forward, backward) -> dict:
    global _REACHING
    cached = _REACHING
    if cached[0]() is forward and cached[1]() is backward:
        return cached[2]
    saved = _saved_names(backward)
    reaches = {}
    for made in reversed(forward.nodes):  # users after the nodes they use
        reaches[made.name] = _compared(made, saved) or any(
            reaches.get(user.name, False) for user in made.users if STORED in (user.meta.get("custom") or {}))
    _REACHING = (weakref.ref(forward), weakref.ref(backward), reaches)
    return reaches


def _compared_walk(views: list, reaches: dict, backward) -> bool:
    """Whether a plain-segment op path leads from ``views`` to a compared reduction: the
    pass's answer for its nodes, a walk from a node the codecs' hooks added since."""
    seen, reached, saved = set(), list(views), None
    while reached:
        made = reached.pop()
        known = reaches.get(made.name)
        if known is not None:
            if known:
                return True
            continue
        saved = _saved_names(backward) if saved is None else saved
        if _compared(made, saved):
            return True
        for user in made.users:
            if user not in seen and STORED in (user.meta.get("custom") or {}):
                seen.add(user)
                reached.append(user)
    return False


def _compared(made, saved: set) -> bool:
    """Whether ``made`` is a reduction that compares its input with its result, a view of
    which the backward reads (``saved``: its placeholders' names)."""
    return compares_with_input_op(made) and any(view.name in saved for view in _views_of(made))


def _saved_names(backward) -> set:
    return {placeholder.name for placeholder in backward.find_nodes(op="placeholder")}


def _attention(node) -> bool:
    """Whether ``node`` is an op traced from F.scaled_dot_product_attention."""
    if node.op != "call_function":
        return False
    if getattr(node.target, "overloadpacket", None) in _FUSED:
        return True
    if node.target is operator.getitem and isinstance(node.args[0], torch.fx.Node) and _attention(node.args[0]):
        return True
    sources = node.meta.get("source_fn_stack") or ()
    return bool(sources) and sources[-1][1] is _taps.ATTENTION.original


def _is_view(node) -> bool:
    target = node.target
    return node.op == "call_function" and bool(node.args) and isinstance(node.args[0], torch.fx.Node) and (
        getattr(target, "is_view", False) or target in _ALIASING)


def _base(node):
    """The node whose storage ``node`` views (itself where it is no view)."""
    while _is_view(node):
        node = node.args[0]
    return node


def _made_by(node):
    """The op that made ``node``: the op itself, or for an output of one that makes
    several (``getitem``: eigh's, aminmax's), that op."""
    if node.op == "call_function" and node.target is operator.getitem and isinstance(node.args[0], torch.fx.Node):
        return node.args[0]
    return node


def _views_of(base) -> list:
    """``base`` and every view of it, views of views included; of an op that makes
    several outputs, each output (``getitem``) and its views."""
    found, pending = [base], [base]
    while pending:
        for user in pending.pop().users:
            if (_is_view(user) or _made_by(user) is not user) and user.args[0] in found and user not in found:
                found.append(user)
                pending.append(user)
    return found


__all__ = ["KEPT", "STORED", "BLOCK", "COPY", "codec_of", "attention_holds"]
