"""Kept inputs whose memory overlaps (the same tensor twice, a tensor and a view of
it): found among a call's arguments and kept together (:class:`KeptAliases`), so that
the recompute's inputs share memory as the forward's did (store.py keeps each one)."""
from __future__ import annotations

import math
from typing import Callable, Optional

import torch

from .._torch import storage_identity_or_none


class KeptAliases:
    """Tensor inputs whose memory overlaps (the same tensor twice, a tensor and a view
    of it), kept together, so that the recompute's inputs share memory as the
    forward's did: a function that changes one in place changes the others for the
    recompute as for the forward. Kept separately, a private copy or a codec would give
    each its own memory, and the recompute other values. Members of one layout (the
    same view twice) are kept once, as it; others as one span of their storage. The
    recompute gets one object where the forward got one twice, and distinct views where
    it got distinct tensors (a compiled block guards on which). The memory is kept as
    it is stored, without a conjugate or negative bit, and each member's bits are put
    back on its view (``h`` and ``h.conj()``, ``h.imag`` and ``h.conj().imag``)."""

    def __init__(self, members: list, keep: Callable, encodable: Callable):
        self._requires_grad = [m.requires_grad for m in members]
        self._bits = [(m.is_conj(), m.is_neg()) for m in members]
        firsts = {}
        self._same_as = [firsts.setdefault(id(m), i) for i, m in enumerate(members)]  # the first of each object
        layouts = [(m.size(), m.stride(), m.storage_offset()) for m in members]
        self._layouts = None if len(set(layouts)) == 1 else layouts  # None: one layout, kept as it is
        self._start = min(m.storage_offset() for m in members)
        kept = _with_bits(members[0].detach(), *self._bits[0])  # the bits toggled off: as stored
        if self._layouts is not None:
            kept = kept.as_strided((max(_end(m) for m in members) - self._start,), (1,), self._start)
        self.kept = keep(kept, encodable=all(encodable(m) for m in members), requires_grad=any(self._requires_grad))

    def restore(self, again: bool = False) -> list:
        """The members, in order: the restored tensor, or views of the restored span
        (``again``: as _KeptTensor.restore)."""
        restored = self.kept.restore(again)
        if self._layouts is None:
            views = [restored if i == 0 else restored.view_as(restored) for i in range(len(self._same_as))]
        else:
            shift = restored.storage_offset() - self._start
            views = [restored.as_strided(size, stride, offset + shift) for size, stride, offset in self._layouts]
        views = [_with_bits(views[first], *bits) for first, bits in zip(self._same_as, self._bits)]
        return [v.detach() if v.requires_grad and not grad else v for v, grad in zip(views, self._requires_grad)]


class AliasOf:
    """A leaf of the call's arguments that is member ``index`` of ``aliases``."""

    __slots__ = ("aliases", "index")

    def __init__(self, aliases: KeptAliases, index: int):
        self.aliases, self.index = aliases, index


def _with_bits(t: torch.Tensor, conjugate: bool, negative: bool) -> torch.Tensor:
    """``t`` with its conjugate and negative bits toggled where asked: a view."""
    t = t.conj() if conjugate else t
    return torch._neg_view(t) if negative else t


def _end(t: torch.Tensor) -> int:
    """One past the last storage element ``t`` reads."""
    return t.storage_offset() + 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))


def _overlapping(tensors: list) -> list:
    """Lists of the positions in ``tensors`` whose memory overlaps another's (same
    storage, element ranges that meet), each of two or more and of one dtype; dense
    strided tensors only, others are never grouped (a view of another dtype is kept on
    its own: docs/limits.md, "Inputs changed in place")."""
    spans = sorted((storage, t.storage_offset(), _end(t), i) for i, t in enumerate(tensors)
                   if (storage := _storage_of(t)) is not None)
    groups, group_end = [], None
    for storage, start, end, i in spans:
        if groups and storage == groups[-1][0] and start < group_end:
            groups[-1][1].append(i)
            group_end = max(group_end, end)
        else:
            groups.append((storage, [i]))
            group_end = end
    by_dtype = [[i for i in members if tensors[i].dtype == dtype]
                for _, members in groups for dtype in {tensors[i].dtype for i in members}]
    return [members for members in by_dtype if len(members) > 1]


def _storage_of(t: torch.Tensor) -> Optional[int]:
    """``t``'s storage (storage_identity) where its memory can be grouped: a dense
    strided tensor with storage (not a vmap or grad transform's wrapper) and no
    negative stride; else None."""
    if t.layout != torch.strided or t.is_nested or t.numel() == 0 or any(n < 0 for n in t.stride()):
        return None
    return storage_identity_or_none(t)  # functorch's wrappers have no storage to read


def _groups_kept_together(members: list) -> list:
    """Of ``members`` (tensors whose element ranges meet), the lists of positions kept
    together (KeptAliases): those that may share an element, transitively. Two columns
    of a wide matrix, or ``x[::2]`` and ``x[1::2]``, share none (:func:`_disjoint`): kept
    apart, as their span would keep every column between them."""
    group_of = list(range(len(members)))

    def root(i):
        while group_of[i] != i:
            i = group_of[i]
        return i
    for i in range(len(members)):
        for j in range(i):
            if not _disjoint(members[i], members[j]):
                group_of[root(i)] = root(j)
    groups = {}
    for i in range(len(members)):
        groups.setdefault(root(i), []).append(i)
    return [group for group in groups.values() if len(group) > 1]


def _disjoint(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` (of one storage) surely share no element: their element
    ranges do not meet; or every element of each lies at its offset modulo the greatest
    common divisor of both's strides, and those offsets differ; or, modulo the greatest
    common divisor ``period`` of their outer strides (all but each one's smallest), each
    one's innermost run lies in an interval the other's misses (``q`` and ``v`` of
    ``qkv.chunk(3, -1)``)."""
    if _end(a) <= b.storage_offset() or _end(b) <= a.storage_offset():
        return True
    step = math.gcd(*(stride for t in (a, b) for size, stride in zip(t.shape, t.stride()) if size > 1))
    if step > 1 and (a.storage_offset() - b.storage_offset()) % step != 0:
        return True
    (inner_a, outer_a), (inner_b, outer_b) = _runs(a), _runs(b)
    period = math.gcd(*outer_a, *outer_b)
    if period == 0 or inner_a > period or inner_b > period:
        return False
    gap = (b.storage_offset() - a.storage_offset()) % period  # where b's run starts, from a's
    return inner_a <= gap <= period - inner_b


def _runs(t: torch.Tensor) -> tuple:
    """``(the extent of t's innermost dimension in elements, its other strides)``, of
    its dimensions of more than one element."""
    dims = sorted((stride, size) for size, stride in zip(t.shape, t.stride()) if size > 1)
    if not dims:
        return 1, ()
    (stride, size), outer = dims[0], dims[1:]
    return (size - 1) * stride + 1, tuple(s for s, _ in outer)


def kept_leaves(leaves: list, keep: Callable, encodable: Callable) -> list:
    """Each leaf of a call's arguments as kept: a tensor by itself, ``keep(tensor)`` (a
    store._KeptTensor), or, where its memory overlaps another's, as a member of their
    group (AliasOf); others as they are. ``keep(tensor, encodable=, requires_grad=)``
    keeps a group's tensor; ``encodable(tensor)``: whether a codec may take a member."""
    kept = list(leaves)
    positions = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
    grouped = set()
    for members in _overlapping([leaves[i] for i in positions]) if len(positions) > 1 else ():
        for group in _groups_kept_together([leaves[positions[m]] for m in members]):
            at = [positions[members[g]] for g in group]
            aliases = KeptAliases([leaves[i] for i in at], keep, encodable)
            for index, i in enumerate(at):
                kept[i] = AliasOf(aliases, index)
            grouped.update(at)
    for i in positions:
        if i not in grouped:
            kept[i] = keep(leaves[i])
    return kept
