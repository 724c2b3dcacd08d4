"""The layout of the gradient a block plan's example step hands the last block
(:class:`GradientLayout`), which the profile and the options measured for that block
hand it alike.

NOTE [ The output gradient's layout ]
A loss may hand the last block a gradient in another layout than its output's: that of
``F.cross_entropy(out.transpose(1, 2), labels)`` is a transposed view; that of a head on
``torch.cat([features, out], 1)`` views the concatenation's gradient, a larger storage;
that of ``out.sum()`` is one number expanded. The last block's backward copies a
gradient where an op needs it contiguous (a Linear's weight gradient), and a view keeps
its whole storage alive as long as it lives. Profiled with a contiguous gradient of its
own, a plan misses that copy and that storage where the step has them, and counts them
where it has not: plans over their budgets, or budgets refused that fit (docs/limits.md,
"Decoder stacks with cross-attention", gives the measured cases).

So the example step records the gradient's shape, strides, offset and the size of its
storage (:meth:`GradientLayout.of`), and the chain's profiled loss and the options
measured for the last block (block_options.BlockMeasurer) hand it ones laid out alike,
made in the backward as the step's loss makes them (:meth:`GradientLayout.ones`).
A gradient laid out as ``torch.ones_like(out)`` lays one out, alone in its storage,
needs no record (None): the ones are made so, as for the blocks before the last, which
get their output's gradient from the next block's backward; so is one that is no plain
strided tensor (a subclass, a sparse one). Only a recorded layout measures the last
block's options apart from those of blocks like it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .._torch import storage_identity_or_none


@dataclass(frozen=True)
class GradientLayout:
    """The shape, strides and storage offset of a gradient, and its storage's number of
    elements and bytes (NOTE [ The output gradient's layout ])."""

    shape: tuple
    stride: tuple
    offset: int
    storage_numel: int
    storage_bytes: int

    @classmethod
    def of(cls, grad: torch.Tensor, output_strides: tuple) -> Optional["GradientLayout"]:
        """``grad``'s layout, the gradient of an output ``ones_like`` gives
        ``output_strides`` (:func:`ones_like_strides`); None where those stand for it."""
        if type(grad) is not torch.Tensor or grad.layout != torch.strided:
            return None
        if storage_identity_or_none(grad) is None:  # no storage to read (torch.func's wrappers)
            return None
        storage_bytes = grad.untyped_storage().nbytes()
        storage_numel = storage_bytes // grad.element_size()
        if grad.stride() == output_strides and grad.storage_offset() == 0 and storage_numel == grad.numel():
            return None
        return cls(tuple(grad.shape), grad.stride(), grad.storage_offset(), storage_numel, storage_bytes)

    def ones(self, shape: tuple, dtype: torch.dtype, device) -> torch.Tensor:
        """Ones laid out so, in a storage of their own of the recorded size; contiguous
        ones where ``shape`` is not the recorded one."""
        if tuple(shape) != self.shape:
            return torch.ones(shape, dtype=dtype, device=device)
        return torch.ones(self.storage_numel, dtype=dtype, device=device).as_strided(self.shape, self.stride,
                                                                                     self.offset)


def ones_like_strides(t: torch.Tensor) -> tuple:
    """The strides ``torch.ones_like(t)`` gives, without making it (a tensor made here, a
    meta one too, would be counted by the planner's LiveBytes): ``t``'s own where it is
    dense and its elements do not overlap, else dense ones in the order of ``t``'s
    strides, as ATen's ``infer_dense_strides`` lays them out."""
    if t.numel() == 0:  # contiguous whatever its strides, to torch: kept
        return t.stride()
    expected = 1
    for d in sorted((d for d in range(t.dim()) if t.size(d) != 1), key=t.stride):
        if t.stride(d) != expected:
            return _dense_strides_in_order(tuple(t.shape), t.stride())
        expected *= t.size(d)
    return t.stride()


def _dense_strides_in_order(shape: tuple, stride: tuple) -> tuple:
    """ATen's ``infer_dense_strides``: the dimensions ordered innermost first by an
    insertion sort on their strides (a zero stride compares equal to any; equal strides
    put the smaller size inside), then dense strides in that order."""
    order = list(reversed(range(len(shape))))

    def compare(first: int, second: int) -> int:
        if stride[first] == 0 or stride[second] == 0:
            return 0
        if stride[first] != stride[second]:
            return -1 if stride[first] < stride[second] else 1
        return 1 if shape[first] > shape[second] else 0

    for i in range(1, len(order)):
        moving = i
        for before in range(i - 1, -1, -1):
            comparison = compare(order[before], order[moving])
            if comparison > 0:
                order[before], order[moving] = order[moving], order[before]
                moving = before
            elif comparison < 0:
                break
    strides, step = [0] * len(shape), 1
    for d in order:
        strides[d] = step
        step *= shape[d] if shape[d] > 1 else 1
    return tuple(strides)


def ones_like(y: torch.Tensor, layout: Optional[GradientLayout]) -> torch.Tensor:
    """Ones like ``y`` laid out as ``layout`` says (None: as ``torch.ones_like``)."""
    return torch.ones_like(y) if layout is None else layout.ones(tuple(y.shape), y.dtype, y.device)


class LaidOutLoss(torch.autograd.Function):
    """``output.sum()``, whose backward hands ``output`` a gradient of ones laid out as
    ``layout`` says (None: as ``torch.ones_like``), made in the backward as a loss makes
    it (the profile's loss only: its gradient is ones, whatever its own gradient)."""

    @staticmethod
    def forward(ctx, output: torch.Tensor, layout: Optional[GradientLayout]) -> torch.Tensor:
        shape, numel = tuple(output.shape), output.numel()
        ctx.layout = layout or GradientLayout(shape, ones_like_strides(output), 0, numel, numel * output.element_size())
        ctx.made = shape, output.dtype, output.device
        return output.sum()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return ctx.layout.ones(*ctx.made), None
