"""Which lossy checkpoints make decisions that a recompute in a compiled graph cannot
keep (NOTE [ Codecs in a compiled graph ] in graph_codecs.py): a chain's segments
(:func:`decisions_made`) and the blocks ``wrap`` checkpointed (:func:`probe_blocks`),
found by running the forward on meta tensors and watching its saves."""
from __future__ import annotations

import contextlib
from typing import Optional

import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks

from .. import _torch, _torch_graphs
from ..meta import on_meta
from . import relu_signs
from .bound_decisions import is_bounded
from .layers import modules_under
from .module_attributes import attributes_put_back
from .pool_decisions import Window
from .store import input_tensors


def decisions_made(segments: list, input: torch.Tensor) -> Optional[str]:
    """What decisions a segment of ``segments`` (``[(layers, policy)]``, in order) that
    keeps by a lossy codec makes, which a compiled recompute cannot keep: its max pools
    whose decisions eager actsave keeps, or the ReLU outputs it saves, found by running
    the forward on meta tensors (no compute, no collective), watching its in-place ReLU
    modules as eager actsave does (NOTE [ In-place ReLUs on views ]); None where it
    makes none.
    A forward that fails on meta tensors is said to, so that eager actsave runs it."""
    lossy = [pair for layers, policy in segments if not policy.codec.lossless for pair in modules_under(tuple(layers))]
    reason = _decisions_of_modules(module for _, module in lossy)
    if reason is not None:
        return reason
    relu_outputs, segment_inputs = [], None  # segment_inputs: None outside a lossy segment

    def pack(t):
        if segment_inputs is not None and relu_signs.made_by_segment_relu(t, segment_inputs):
            relu_outputs.append(t.shape)
        return t
    holder = nn.ModuleList(layer for layers, _ in segments for layer in layers)
    try:
        with _on_meta_watching_saves(holder, pack) as probe_input, relu_signs.InplaceRelus.among(lossy).watching():
            x = probe_input(input)
            if x.is_floating_point():
                x = x.requires_grad_().clone()
            for layers, policy in segments:
                segment_inputs = None if policy.codec.lossless else relu_signs.input_nodes([x])
                for layer in layers:
                    x = layer(x)
    except Exception as error:  # noqa: BLE001 - any failure means: run it as eager actsave does
        return _unknown("its", error)
    return "ReLU decisions" if relu_outputs else None


def _decisions_of_modules(modules) -> Optional[str]:
    """The decisions eager actsave keeps that a module among ``modules`` makes, known
    by its type: a max pool's, a Hardtanh's or LeakyReLU's (NOTE [ Bound decisions ])."""
    modules = list(modules)
    if any(Window.of(module) is not None for module in modules):
        return "max-pool decisions"
    return "Hardtanh or LeakyReLU decisions" if any(map(is_bounded, modules)) else None


@contextlib.contextmanager
def _on_meta_watching_saves(model: nn.Module, pack):
    """While active, ``model`` runs on meta tensors with grad, its saves handed to
    ``pack``; as the planner's meta steps (NOTE [ Steps other threads do not see ] in
    planning/step_isolation.py), compiled layers run their eager code on this thread
    and no generator is forked: random operators on fake meta tensors draw nothing.
    Yields the function that makes the model's inputs from real tensors (their shapes,
    strides and dtypes): fake meta tensors (NOTE [ Fake tensors in a probe ]). The
    modules' attributes are put back as it ends (a tensor a layer caches at its first
    forward would be a meta one)."""
    with attributes_put_back(model.modules()), on_meta(model), saved_tensors_hooks(pack, lambda t: t), \
            torch.inference_mode(False), torch.enable_grad(), \
            _torch.compiled_code_eager(), _torch_graphs.fake_tensors() as fake:
        yield lambda t: fake(torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta"))


def _unknown(whose: str, error: Exception) -> str:
    return f"decisions unknown: {whose} forward failed on meta tensors ({type(error).__name__}: {error})"


def probe_key(args, kwargs, model, checkpoints: list) -> tuple:
    """What a probe's answer depends on: the inputs (whether they require grad too), the
    other arguments' types (their values may change at every call: a step, a noise
    level; a block that a value leaves out of the probe is run eagerly, probe_blocks),
    the training mode, and which of the blocks' parameters require grad (a frozen block
    fed no grad saves nothing). Not the grad mode: a probe runs with grad."""
    leaves = _torch.pytree.tree_leaves((args, kwargs))
    return (tuple(map(_leaf_key, leaves)), model.training,
            tuple(p.requires_grad for c in checkpoints for p in c._wrapped.parameters()))


def _leaf_key(leaf) -> tuple:
    if isinstance(leaf, torch.Tensor):
        return tuple(leaf.shape), leaf.dtype, leaf.device, leaf.requires_grad
    return (type(leaf),)


def probe_blocks(model, checkpoints: list, args, kwargs) -> dict:
    """``{checkpoint: why it runs eagerly}`` for the blocks among ``checkpoints`` that
    make decisions a compiled recompute cannot keep (:func:`decisions_made`'s
    reasons): the model's forward on meta tensors, its checkpointed blocks run plainly.
    A block the probe's call does not run (an argument leaves it out) is said to make
    decisions unknown: another call may run it under the same key (probe_key)."""
    why = {c: reason for c in checkpoints if (reason := _decisions_of_modules(c._wrapped.modules())) is not None}
    running, ran = [], set()  # (checkpoint, its inputs' autograd nodes); the checkpoints run

    def pack(t):
        if running and relu_signs.made_by_segment_relu(t, running[-1][1]):
            why.setdefault(running[-1][0], "ReLU decisions")
        return t
    handles = [hook for c in checkpoints for hook in _block_watch(c, running, ran)]
    # NOTE [ In-place ReLUs on views ]: the probe sees those outputs as eager actsave does.
    relus = relu_signs.InplaceRelus.among([(0, m) for c in checkpoints for m in c._wrapped.modules()])
    try:
        with _on_meta_watching_saves(model, pack) as probe_input, _run_plainly(checkpoints), relus.watching():
            probed = lambda t: probe_input(t).requires_grad_(t.requires_grad and t.is_floating_point())  # noqa: E731
            probe_args, probe_kwargs = _torch.pytree.tree_map_only(torch.Tensor, probed, (args, kwargs))
            model(*probe_args, **probe_kwargs)
    except Exception as error:  # noqa: BLE001 - any failure means: run them as eager actsave does
        return {c: _unknown("the model's", error) for c in checkpoints}
    finally:
        for handle in handles:
            handle.remove()
    for checkpoint in checkpoints:
        if checkpoint not in ran:
            why.setdefault(checkpoint, "decisions unknown: the block did not run when its model was probed")
    return {c: f"a block kept by a codec makes {reason}, which a recompute in the graph cannot keep"
            if not reason.startswith("decisions unknown") else reason for c, reason in why.items()}


@contextlib.contextmanager
def _run_plainly(checkpoints: list):
    """While active, each of ``checkpoints`` calls its block plainly, so that the probe
    sees the block's own saves (an instance attribute ``forward`` comes before the
    class's method and is not registered as a submodule)."""
    for checkpoint in checkpoints:
        object.__setattr__(checkpoint, "forward", checkpoint._wrapped)
    try:
        yield
    finally:
        for checkpoint in checkpoints:
            object.__delattr__(checkpoint, "forward")


def _block_watch(checkpoint, running: list, ran: set) -> tuple:
    def enter(module, args, kwargs):
        ran.add(checkpoint)
        running.append((checkpoint, relu_signs.input_nodes(input_tensors(args, kwargs))))

    def leave(module, args, kwargs, output):
        running.pop()
    return (checkpoint._wrapped.register_forward_pre_hook(enter, with_kwargs=True),
            checkpoint._wrapped.register_forward_hook(leave, with_kwargs=True, always_call=True))
