"""A lossy checkpoint's ReLU decisions inside a compiled graph.

NOTE [ ReLU decisions in a compiled graph ]

Eagerly, a checkpoint that keeps its input by a lossy codec keeps one bit per element
of each ReLU output its forward saves, and its recompute restores the forward's
decisions (relu_signs.py). In a compiled graph the recompute is the partitioner's
copy of the forward's ops, which would decide again from the decoded input. So the
decisions are made graph values that the forward computes and the backward reads:

- While a lossy segment is traced (:func:`segment_traced`; a wrapped block kept by a
  codec is one), each ReLU it calls through ``torch.nn.functional.relu`` or
  ``torch.relu`` (``nn.ReLU`` included) is traced as ``where(passed, y, 0)``, ``passed`` unpacked from
  ``actsave::relu_decisions(y)``: the forward's decisions, "not (y <= 0)" as
  ``threshold_backward`` tests them (NaN passes), one bit per element packed as
  the eager bits are (triton_kernels/bitfields.py). Its value is the ReLU's (a -0.0
  input gives +0.0), and so is its gradient.
- A checkpointed segment's checkpoint takes a selective policy (``create_selective_
  checkpoint_contexts``): the partitioner must save that op's bytes and recomputes
  every other op, as it does for a plain checkpoint. So the recompute's ReLUs take
  the forward's decisions from those bytes, which are kept from the forward to the
  backward as the eager bits are (plans count them: memory_model.py, S). A stored
  segment's backward reads its decisions without a recompute.
- The two functions are replaced (``_torch.AttributeSwap``) only while a compiled
  forward that holds such a segment is traced and runs, the same at every call, as
  Dynamo guards on them; outside a lossy segment the replacement is the ReLU.
- A ReLU reached another way (``Tensor.relu``, ``torch.relu_``, a function object
  taken before, as ``self.act = F.relu`` in ``__init__``, ``F.relu`` inside a module
  compiled on its own) would decide again. The probe (graph_codecs.decisions_made)
  runs the segments with the replacement active and finds such ReLU outputs among
  the saves: that forward runs eagerly, as one that makes max-pool decisions does.
"""
from __future__ import annotations

import contextlib
import functools

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from .._torch import AttributeSwap
from ..triton_kernels import bitfields

_in_lossy_segment = False  # set while a lossy segment is traced


@torch.library.custom_op("actsave::relu_decisions", mutates_args=())
def _relu_decisions(y: torch.Tensor) -> torch.Tensor:
    return bitfields.pack((~(y <= 0)).reshape(-1).to(torch.uint8), 1)


@_relu_decisions.register_fake
def _(y):
    return y.new_empty(((y.numel() + 7) // 8,), dtype=torch.uint8)


@torch.library.custom_op("actsave::relu_passed", mutates_args=())
def _relu_passed(decisions: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return bitfields.unpack(decisions, 1, like.numel()).view(like.shape).bool()


@_relu_passed.register_fake
def _(decisions, like):
    return torch.empty_like(like, dtype=torch.bool)


def relu_with_forward_decisions(y: torch.Tensor) -> torch.Tensor:
    """``relu(y)``, its decisions a saved graph value the recompute reads (see the NOTE)."""
    passed = _relu_passed(_relu_decisions(y.detach()), y.detach())
    return torch.where(passed, y, 0.0)


def keeps_decisions(node) -> bool:
    """Whether the graph ``node`` is the output of :func:`relu_with_forward_decisions`."""
    condition = node.args[0] if node.target is torch.ops.aten.where.self else None
    return getattr(condition, "target", None) is torch.ops.actsave.relu_passed.default


def _functional_relu(input: torch.Tensor, inplace: bool = False) -> torch.Tensor:
    if not _in_lossy_segment:
        return _functional_swap.original(input, inplace=inplace)
    output = relu_with_forward_decisions(input)
    return input.copy_(output) if inplace else output


def _torch_relu(input: torch.Tensor) -> torch.Tensor:
    return relu_with_forward_decisions(input) if _in_lossy_segment else _torch_swap.original(input)


_functional_swap = AttributeSwap(F, "relu", _functional_relu)
_torch_swap = AttributeSwap(torch, "relu", _torch_relu)


def replace_relus() -> None:
    """From now until :func:`restore_relus`, ``F.relu`` and ``torch.relu`` keep the
    forward's decisions inside a lossy segment being traced (see the NOTE). Two
    calls, not a context: they run where Dynamo does not trace (sequential.py,
    graph_codecs.py)."""
    _functional_swap.enter()
    _torch_swap.enter()


def restore_relus() -> None:
    _torch_swap.exit()
    _functional_swap.exit()


@contextlib.contextmanager
def relus_replaced():
    """:func:`replace_relus` while active."""
    replace_relus()
    try:
        yield
    finally:
        restore_relus()


@contextlib.contextmanager
def segment_traced():
    """While active, a lossy segment is traced: its ReLUs keep their decisions."""
    global _in_lossy_segment
    outer, _in_lossy_segment = _in_lossy_segment, True
    try:
        yield
    finally:
        _in_lossy_segment = outer


def _must_save_decisions(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op is torch.ops.actsave.relu_decisions.default \
        else CheckpointPolicy.PREFER_RECOMPUTE


# Dynamo accepts a selective checkpoint's context_fn as a partial of torch's function.
decisions_saved = functools.partial(create_selective_checkpoint_contexts, _must_save_decisions)
