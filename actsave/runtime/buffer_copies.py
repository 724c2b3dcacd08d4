"""Copies of module buffers for a recompute (state.py's snapshot, and the copies of it a
recompute that is not the last runs on), made so that buffers sharing memory in the
model share it in the copies too.

NOTE [ Buffers that share memory ]
A module may register a tensor and a view of it as two buffers (``self.scale =
self.packed[:w]``), one tensor under two names or in two modules, or a tensor that
shares another's storage without being an autograd view (``detach()``,
``view(dtype)``). Its forward then reads through one what it changed through the
other. A recompute runs on copies of the buffers (NOTE [ State a forward reads and
mutates ]); copied one by one they would share nothing, and a change the recompute
makes through ``packed`` would not be seen through ``scale``: the recompute would read
values the forward did not, and give silently wrong gradients. So:

- The buffers copied together are grouped by storage. A buffer alone in its storage
  is copied alone, as before (one foreach copy per dtype for all of them: copies_of).
- A group is copied once, through an *anchor*: a member that is not a view and holds
  all the others (``packed``), copied whole, or else the span of bytes the group covers
  (aligned so that each member lies at a whole number of its elements).
  Every member is made on the anchor's copy with its own sizes, strides and offset
  from the anchor: the anchor itself is its copy, a member of its dtype is a view of it
  (``as_strided``: it shares the copy's version counter, as an autograd view does the
  original's, so the stale-read check of stale_buffers.py reads a save of ``scale``
  as a read of ``packed`` in the recompute as in the forward), and one of another dtype
  is set on the copy's storage.
- Copies taken later in the same forward (a module's buffers, under global hooks, as
  its first call starts: state.py's _HookedState) join an earlier copy whose original
  shares their storage: that copy is the memory the recompute changes through the
  earlier buffer. One that does not lie in it (a child's statistics, wider than its
  parent's slice of them, copied as the parent's call started) widens it: one copy of
  the bytes both span, holding the earlier copy's bytes where it lay, which the earlier
  buffers' copies are made on again (HookedSharing.taken).
- Under torch.func's transforms the copies are the transform's wrappers, whose storage
  cannot be read: they are made apart, sharing nothing (docs/limits.md).
"""
from __future__ import annotations

import weakref
from typing import Optional

import torch
from torch.nn.parameter import is_lazy

from .._torch import copies_of, own_tensors, storage_identity_or_none, version
from ..errors import ConfigError


_KINDS = ("parameters", "buffers")


def own_state(module: torch.nn.Module):
    """``(kind, name, tensor)`` of each parameter and buffer of ``module`` that is set.
    Raises for one a lazy module has not initialized: its first forward draws random
    numbers to initialize it that a recompute, from the forward's RNG, would not draw;
    and for a TorchScript module, whose tables are TorchScript's, not dicts a snapshot
    can be swapped into."""
    if isinstance(module, torch.jit.ScriptModule):
        raise ConfigError(
            f"{type(module).__name__} is a TorchScript module (torch.jit.script or torch.jit.trace): a checkpoint "
            "reads and restores the parameters and buffers of the modules it runs through their Python tables, "
            "which a TorchScript module does not have. Checkpoint the eager module (torch.compile keeps "
            "actsave's checkpoints), or run the TorchScript module outside the checkpointed part.")
    for kind in _KINDS:
        for name, tensor in own_tensors(module, kind).items():
            if is_lazy(tensor):
                raise ConfigError(
                    f"{type(module).__name__}'s {kind[:-1]} '{name}' is not initialized yet: a lazy module "
                    "initializes in its first forward, which a checkpoint cannot recompute as it ran (the "
                    "recompute would not draw the random numbers the initialization drew). Run one forward "
                    "of the model before checkpointing it (a batch under torch.no_grad() will do).")
            if tensor is not None:
                yield kind, name, tensor


class Snapshot(dict):
    """``{(module, buffer name): a copy}``; ``shares_memory``: whether two of the copies
    share memory (NOTE [ Buffers that share memory ]), where the rules for it apply;
    ``originals``: ``{(module, name): (buffer, its version)}`` as copied, where taken
    before the forward that uses it starts (chain.ChainState)."""

    shares_memory = False
    originals = None

    def as_copied(self, entries: list) -> bool:
        """Whether every buffer of ``entries`` (_LayerState's, as a forward starts) is
        the tensor copied, at the version copied: nothing changed it since."""
        for _, module, kind, name, tensor, at in entries if self.originals is not None else ():
            if kind == "buffers":
                original = self.originals.get((module, name))
                if original is None or original[0] is not tensor or original[1] != at:
                    return False
        return True

    def only(self, keys: set) -> "Snapshot":
        """The copies of ``keys`` only."""
        kept = Snapshot((key, value) for key, value in self.items() if key in keys)
        kept.shares_memory = self.shares_memory
        return kept


def snapshot_of(modules, copied: Optional[dict] = None, early: bool = False) -> Snapshot:
    """The Snapshot of every buffer of ``modules``, made together, those sharing memory
    sharing it (``copied``: copies_keeping_shared_memory's): what a forward starting now
    snapshots; ``early``: taken before that forward starts, noting its originals."""
    entries = [((module, name), buffer) for module in modules
               for kind, name, buffer in own_state(module) if kind == "buffers"]
    copies, shared = copies_keeping_shared_memory([buffer for _, buffer in entries], copied)
    snapshot = Snapshot(zip((key for key, _ in entries), copies))
    snapshot.shares_memory = shared
    if early:
        snapshot.originals = {key: (buffer, version(buffer)) for key, buffer in entries}
    return snapshot


_KINDS = ("parameters", "buffers")


def copies_keeping_shared_memory(tensors: list, copied: Optional[dict] = None) -> tuple:
    """``(copies, shared)``: a copy of each of ``tensors``, in order, where those sharing
    a storage share the copy's (NOTE [ Buffers that share memory ]), and whether any do.
    ``copied``: a table of the copies made before (empty at first) that these join where
    they share an original's storage, and to which these are added."""
    storages = [storage_identity_or_none(tensor) for tensor in tensors]
    if copied is None and len(set(storages)) == len(storages):  # the common case: none shares
        return copies_of(tensors), False
    groups = {}  # storage identity (or the tensor's id, where it has none) -> positions
    for i, storage in enumerate(storages):
        groups.setdefault(("tensor", id(tensors[i])) if storage is None else storage, []).append(i)
    copies, shared = [None] * len(tensors), False
    anchored = []  # (positions, anchor) of each group copied through its anchor
    for key, positions in groups.items():
        pair = _earlier(copied, key)
        shared = shared or pair is not None or len(positions) > 1
        if pair is not None:
            for i in positions:
                copies[i] = _placed(tensors[i], *pair)
            outside = [i for i in positions if copies[i] is None]
            if outside and storage_identity_or_none(pair[1]) is not None:  # widen the earlier copy
                anchor, anchor_copy = _widened([tensors[i] for i in outside], *pair)
                for i in outside:
                    copies[i] = _placed(tensors[i], anchor, anchor_copy)
                # A member's copy stands for the wider one (the anchor's may not outlive this call).
                copied[key] = (tensors[outside[0]], weakref.ref(copies[outside[0]]))
        elif len(positions) > 1:
            anchored.append((positions, _anchor_of([tensors[i] for i in positions])))
    through_anchors = {i for positions, _ in anchored for i in positions}
    alone = [i for i, copy in enumerate(copies) if copy is None and i not in through_anchors]
    made = copies_of([anchor for _, anchor in anchored] + [tensors[i] for i in alone])
    for (positions, anchor), anchor_copy in zip(anchored, made):
        for i in positions:
            copies[i] = _placed(tensors[i], anchor, anchor_copy)
    for i, copy in zip(alone, made[len(anchored):]):
        copies[i] = copy
    # Where one could not be made on its group's copy (one of torch.func's wrappers, whose
    # storage cannot be read; one outside an earlier copy): copied alone, sharing nothing.
    missing = [i for i, copy in enumerate(copies) if copy is None]
    for i, copy in zip(missing, copies_of([tensors[i] for i in missing])):
        copies[i] = copy
    if copied is not None:
        _note_copies(copied, tensors, copies)
    return copies, shared


def with_modules_sharing_memory(moved: dict, entries: list) -> dict:
    """``moved`` (``{module: layer index}``: the modules whose state a forward changed)
    with the modules whose buffers share memory with a moved module's, which a change to
    it may have changed unseen; ``entries``: state.py's _LayerState's, as it started."""
    owners = {}  # storage identity -> [(module, layer index)]
    for index, module, kind, _, tensor, _ in entries if moved else ():
        if kind == "buffers":
            owners.setdefault(storage_identity_or_none(tensor), []).append((module, index))
    for storage, sharers in owners.items():
        if storage is not None and len(sharers) > 1 and any(module in moved for module, _ in sharers):
            for module, index in sharers:
                moved.setdefault(module, index)
    return moved


class HookedSharing:
    """The buffers a forward under global hooks has snapshotted, by the memory they share
    (state.py's _HookedState: each module's buffers are snapshotted as its first call
    starts, and dropped as a call that moved nothing ends)."""

    def __init__(self):
        self.copied = {}  # copies_keeping_shared_memory's table of the copies taken
        self._keys = {}  # storage identity -> [(module, name)] of the buffers snapshotted

    def taken(self, taken: dict, snapshot) -> None:
        """Note the copies ``taken`` (``{(module, name): copy}``) into ``snapshot`` (a
        state.py Snapshot, marked where its copies come to share memory), and
        put back into it, made on them, the copies dropped before of the buffers sharing
        their memory: those buffers' values are as they were when dropped, since a call
        that changed that memory would have kept its own copy, which these would join."""
        for key, copy in taken.items():
            buffer = own_tensors(key[0], "buffers")[key[1]]
            storage = storage_identity_or_none(buffer)
            sharers = self._keys.setdefault(storage, []) if storage is not None else []
            current = _earlier(self.copied, storage)  # what this storage's copies are made on now
            for other in sharers:
                now = own_tensors(other[0], "buffers").get(other[1])
                if now is None or storage_identity_or_none(now) != storage:
                    continue
                if other not in snapshot:  # dropped: it was as it is until this call
                    placed = _placed(now, buffer, copy)
                    snapshot[other] = placed if placed is not None else copies_of([now])[0]
                    snapshot.shares_memory = True
                elif current is not None and _widens(snapshot[other], current[1]):
                    placed = _placed(now, *current)  # its copy was widened: made on the wider one
                    snapshot[other] = placed if placed is not None else snapshot[other]
            sharers.append(key)

    def sharers(self, module, name: str):
        """The buffers snapshotted that share the memory of ``module``'s buffer ``name``."""
        buffer = own_tensors(module, "buffers").get(name)
        return self._keys.get(storage_identity_or_none(buffer), ()) if buffer is not None else ()


def distinct_storage_bytes(tensors) -> int:
    """The bytes of the storages of ``tensors``, each storage counted once: what copies
    made by :func:`copies_keeping_shared_memory` hold."""
    seen, total = set(), 0
    for tensor in tensors:
        storage = storage_identity_or_none(tensor)
        if storage is None:
            total += tensor.numel() * tensor.element_size()
        elif storage not in seen:
            seen.add(storage)
            total += tensor.untyped_storage().nbytes()
    return total


def shared_between(groups: list) -> bool:
    """Whether buffers of modules in two of ``groups`` (lists of modules) share a storage."""
    owner = {}
    for i, modules in enumerate(groups):
        for module in modules:
            for buffer in own_tensors(module, "buffers").values():
                storage = None if buffer is None or is_lazy(buffer) else storage_identity_or_none(buffer)
                if storage is not None and owner.setdefault(storage, i) != i:
                    return True
    return False


def _note_copies(copied: dict, tensors: list, copies: list) -> None:
    """Add ``(original, weak reference to its copy)`` to ``copied`` by the original's
    storage: a copy the caller drops (state.py drops those of buffers a call left as they
    were) is not joined."""
    for tensor, copy in zip(tensors, copies):
        storage = storage_identity_or_none(tensor)
        # Only a copy laid out as its tensor (a gapped view is copied dense) places others.
        if storage is not None and _earlier(copied, storage) is None and copy.stride() == tensor.stride():
            copied[storage] = (tensor, weakref.ref(copy))


def _earlier(copied: Optional[dict], storage) -> Optional[tuple]:
    """``(original, copy)`` made before of the ``storage``, if ``copied`` has one alive."""
    entry = None if copied is None else copied.get(storage)
    copy = None if entry is None else entry[1]()
    return None if copy is None else (entry[0], copy)


def _anchor_of(members: list) -> torch.Tensor:
    """The tensor a group sharing one storage is copied through: a member that is not a
    view, is contiguous and holds every other at whole numbers of their elements, else
    the bytes the group spans."""
    spans = [_byte_span(member) for member in members]
    lo, hi = min(start for start, _ in spans), max(end for _, end in spans)
    for member, (start, end) in zip(members, spans):
        if start == lo and end == hi and not member._is_view() and member.is_contiguous() \
                and all((other - lo) % m.element_size() == 0 for m, (other, _) in zip(members, spans)):
            return member
    return _bytes_of(members[0], lo, hi, max(member.element_size() for member in members))


def _bytes_of(tensor: torch.Tensor, lo: int, hi: int, align: int) -> torch.Tensor:
    """The bytes ``[lo, hi)`` of ``tensor``'s storage as a flat uint8 tensor, ``lo`` moved
    down to a multiple of ``align`` (so that each member lies at a whole number of its
    elements from it)."""
    lo -= lo % align
    flat = torch.empty((0,), dtype=torch.uint8, device=tensor.device)
    return flat.set_(tensor.untyped_storage(), lo, (hi - lo,), (1,))


def _widened(members: list, original: torch.Tensor, earlier: torch.Tensor) -> tuple:
    """``(anchor, its copy)``: the bytes ``members`` and ``earlier`` (a copy of
    ``original``, made before, whose storage they share but outside it) span together:
    the members' bytes as they are now, the earlier copy's as it holds them, which the
    recompute changes through the earlier buffers (HookedSharing: a child's buffer wider
    than its parent's slice of it, copied as the parent's call started)."""
    start = original.storage_offset() * original.element_size() - earlier.storage_offset() * earlier.element_size()
    end = start + earlier.untyped_storage().nbytes()  # the earlier copy's bytes, where they lie in the storage
    spans = [_byte_span(member) for member in members]
    lo, hi = min(start, *(s for s, _ in spans)), max(end, *(e for _, e in spans))
    anchor = _bytes_of(original, lo, hi, max(m.element_size() for m in (*members, original, earlier)))
    (anchor_copy,) = copies_of([anchor])
    offset = start - anchor.storage_offset()
    anchor_copy[offset:offset + end - start].copy_(_bytes_of(earlier, 0, end - start, 1))
    return anchor, anchor_copy


def _widens(copy: torch.Tensor, anchor_copy: torch.Tensor) -> bool:
    """Whether ``anchor_copy`` (a widened copy) stands for ``copy``, made before on another storage."""
    return storage_identity_or_none(copy) != storage_identity_or_none(anchor_copy)


def _byte_span(tensor: torch.Tensor) -> tuple:
    """``(first byte, byte after the last)`` of ``tensor`` in its storage."""
    start = tensor.storage_offset() * tensor.element_size()
    if tensor.numel() == 0:
        return start, start
    extent = 1 + sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()))
    return start, start + extent * tensor.element_size()


def _placed(member: torch.Tensor, original: torch.Tensor, copy: torch.Tensor) -> Optional[torch.Tensor]:
    """``member`` made on ``copy`` as it lies on ``original`` (whose storage it shares),
    or None where it does not lie in ``copy``'s storage."""
    if member is original:
        return copy
    if storage_identity_or_none(copy) is None:  # torch.func's wrapper: no storage to make it on
        return None
    offset = (copy.storage_offset() * copy.element_size() + member.storage_offset() * member.element_size()
              - original.storage_offset() * original.element_size())
    start, end = _byte_span(member)
    size = member.element_size()
    if offset < 0 or offset % size or offset + (end - start) > copy.untyped_storage().nbytes():
        return None
    if member.dtype == copy.dtype:
        return copy.as_strided(member.shape, member.stride(), offset // size)
    made = torch.empty((0,), dtype=member.dtype, device=copy.device)
    return made.set_(copy.untyped_storage(), offset // size, member.shape, member.stride())
