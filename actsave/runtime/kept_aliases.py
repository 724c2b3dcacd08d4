"""Kept inputs whose memory overlaps (the same tensor twice, a tensor and a view of
it): found among a call's arguments and kept together (:class:`KeptAliases`), so that
the recompute's inputs share memory as the forward's did (store.py keeps each one)."""
from __future__ import annotations

from typing import Callable, Optional

import torch

from .._torch import storage_identity


class KeptAliases:
    """Tensor inputs whose memory overlaps (the same tensor twice, a tensor and a view
    of it), kept together, so that the recompute's inputs share memory as the
    forward's did: a function that changes one in place changes the others for the
    recompute as for the forward. Kept separately, a private copy or a codec would give
    each its own memory, and the recompute other values. Members of one layout (the
    same view twice) are kept once, as it; others as one span of their storage, which
    _groups_kept_together takes only where it is not much larger than they are."""

    def __init__(self, members: list, keep: Callable, encodable: Callable):
        self._requires_grad = [m.requires_grad for m in members]
        layouts = [(m.size(), m.stride(), m.storage_offset()) for m in members]
        self._layouts = None if len(set(layouts)) == 1 else layouts  # None: one layout, kept as it is
        self._start = min(m.storage_offset() for m in members)
        kept = members[0].detach()
        if self._layouts is not None:
            kept = kept.as_strided((max(_end(m) for m in members) - self._start,), (1,), self._start)
        self.kept = keep(kept, encodable=all(encodable(m) for m in members), requires_grad=any(self._requires_grad))

    def restore(self) -> list:
        """The members, in order: the restored tensor, or views of the restored span."""
        restored = self.kept.restore()
        if self._layouts is None:
            views = [restored] * len(self._requires_grad)
        else:
            shift = restored.storage_offset() - self._start
            views = [restored.as_strided(size, stride, offset + shift) for size, stride, offset in self._layouts]
        return [v.detach() if v.requires_grad and not grad else v for v, grad in zip(views, self._requires_grad)]


class AliasOf:
    """A leaf of the call's arguments that is member ``index`` of ``aliases``."""

    __slots__ = ("aliases", "index")

    def __init__(self, aliases: KeptAliases, index: int):
        self.aliases, self.index = aliases, index


def _end(t: torch.Tensor) -> int:
    """One past the last storage element ``t`` reads."""
    return t.storage_offset() + 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))


def _overlapping(tensors: list) -> list:
    """Lists of the positions in ``tensors`` whose memory overlaps another's (same
    storage, element ranges that meet), each of two or more; dense strided tensors
    of one dtype only, others are never grouped."""
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
    return [members for _, members in groups
            if len(members) > 1 and len({tensors[i].dtype for i in members}) == 1]


def _storage_of(t: torch.Tensor) -> Optional[int]:
    """``t``'s storage (storage_identity) where its memory can be grouped: a dense
    strided tensor with storage (not a vmap or grad transform's wrapper) and no
    negative stride; else None."""
    if t.layout != torch.strided or t.is_nested or t.numel() == 0 or any(n < 0 for n in t.stride()):
        return None
    try:
        return storage_identity(t)
    except (NotImplementedError, RuntimeError):  # functorch's wrappers have no storage to read
        return None


def _groups_kept_together(members: list) -> list:
    """Of ``members`` (tensors whose element ranges meet), the lists of positions kept
    together (KeptAliases): all, where the span of storage they cover is at most twice
    their elements (slices of one tensor, a tensor and its view); else those of one
    layout (the same view twice): two columns of a wide matrix share no element, and
    their span would keep every column between them."""
    span = max(_end(m) for m in members) - min(m.storage_offset() for m in members)
    if span <= 2 * sum(m.numel() for m in members):
        return [list(range(len(members)))]
    layouts = {}
    for i, m in enumerate(members):
        layouts.setdefault((m.storage_offset(), tuple(m.shape), m.stride()), []).append(i)
    return [group for group in layouts.values() if len(group) > 1]


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
