"""Memory layouts: the strides a tensor kept for its backward comes back with.

NOTE [ Kept layouts ]
A tensor kept by offload (offload/offloaded.py) or by a lossy codec (codecs/__init__.py)
comes back with the strides ``torch.empty_like`` gives it, those ``clone()`` keeps:

- a dense tensor (its elements fill ``numel()`` places of memory, no gap and no
  overlap, in some order of its dimensions: contiguous, channels_last,
  channels_last_3d, a transpose, any permutation) keeps its own strides exactly, those
  of its size-1 dimensions included;
- any other (a strided slice, an expanded tensor) comes back dense, its dimensions in
  the same order of strides (a slice of a channels_last tensor comes back
  channels_last, without its gaps).

A convolution chooses its algorithm, and so its rounding, by its input's memory format:
a recompute given its input in another layout than the forward's would give other
gradients, where exact modes promise bit-identical ones.

A kept segment input is given to its recompute with the strides themselves, gaps
included (:func:`gapped_strides`, :func:`in_strides`; a private copy:
:func:`copied_in_layout`), whatever kept it: ``F.linear`` folds a 3-D strided slice
(``q`` of ``qkv.chunk(3, -1)``) otherwise than its dense copy and saves other tensors,
so a recompute given the dense copy would fill the placeholders with them. The copy
back into the gaps is one device copy more, of the span the slice reads, in the
recompute only. An expanded input comes back expanded too (``F.linear`` folds it
otherwise as well): its first element along each dimension of stride 0, copied and
expanded again (:func:`copied_with_strides`).
"""
from __future__ import annotations

from typing import Optional

import torch


def viewed(t: torch.Tensor, shape) -> torch.Tensor:
    """``t.view(shape)``, ``shape`` (a ``torch.Size``) passed as its sizes: passed whole,
    a Size takes a slower parse of torch's arguments, host work at every decode
    (docs/performance.md, "Rules of the hot path")."""
    return t.view(*shape) if shape else t.view(())


def contiguous_strides(shape) -> tuple:
    """The strides of a contiguous tensor of ``shape``, as ``torch.empty(shape)`` has them."""
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def reading(t: torch.Tensor) -> tuple:
    """How ``t`` reads its storage's elements: its dtype, and its conjugate and negative
    bits, which another view of that storage (``as_strided``) does not carry."""
    return t.dtype, t.is_conj(), t.is_neg()


def is_dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements fill ``t.numel()`` places of memory, with no gap and no
    overlap (in any order of its dimensions)."""
    if t.is_contiguous():
        return True
    expected = 1
    for stride, size in sorted((stride, size) for size, stride in zip(t.shape, t.stride()) if size != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def kept_strides(t: torch.Tensor) -> Optional[tuple]:
    """The strides a copy of ``t`` kept for the backward comes back with (NOTE [ Kept
    layouts ]); None where those are contiguous strides, which a plain view of the
    copy's elements has."""
    if t.is_contiguous() and min(t.shape, default=2) > 1:
        # Every dimension's stride is then the contiguous one (only a size-1 or empty
        # dimension's may be any): the common case, without the loop below (host work
        # in every codec call).
        return None
    strides = t.stride() if is_dense(t) else torch.empty_like(t, device="meta").stride()
    return None if strides == contiguous_strides(t.shape) else strides


def is_expanded(t: torch.Tensor) -> bool:
    """Whether ``t`` repeats elements by a stride of 0 over a dimension of more than one
    element (``expand``, ``broadcast_to``); a size-1 dimension's stride is any."""
    return any(stride == 0 and size > 1 for size, stride in zip(t.shape, t.stride()))


def gapped_strides(t: torch.Tensor) -> Optional[tuple]:
    """``t``'s strides where a dense copy would not have them (a strided slice, an
    expanded tensor), else None (a dense tensor, kept in its layout; a sparse or nested
    one, which has no strides to keep)."""
    if t.layout != torch.strided or t.is_nested or is_dense(t):
        return None
    return t.stride()


def in_strides(t: torch.Tensor, strides: Optional[tuple]) -> torch.Tensor:
    """``t`` with ``strides`` (from :func:`gapped_strides`): itself where it has them or
    they are None, else a copy with them."""
    if strides is None or t.stride() == strides:
        return t
    return copied_with_strides(t, strides)


def copied_in_layout(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` with ``t``'s strides, a gap left where ``t`` has one (its memory
    the span ``t`` reads); a broadcast tensor, whose strides a copy cannot have, is
    copied as ``clone()`` copies it."""
    strides = gapped_strides(t)
    return t.clone() if strides is None or is_expanded(t) else copied_with_strides(t, strides)


def copied_with_strides(t: torch.Tensor, strides: tuple, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """``t``'s values copied into a new tensor with ``strides`` (and ``dtype``, default
    ``t``'s): one copy. Along a dimension of stride 0 (an expanded layout) the copy
    holds ``t``'s first element, expanded: a dense tensor of an expanded one's values
    repeats it there, but for a lossy codec's rounding."""
    if 0 in strides:
        first = t[tuple(slice(0, 1) if stride == 0 else slice(None) for stride in strides)]
        copy = torch.empty_strided(first.shape, strides, dtype=dtype or t.dtype, device=t.device).copy_(first)
        return copy.expand(t.shape)
    return torch.empty_strided(t.shape, strides, dtype=dtype or t.dtype, device=t.device).copy_(t)
