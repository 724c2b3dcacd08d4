"""What a selective recompute keeps beyond its inputs (selective.py), stored as its
checkpoint's :class:`~actsave.runtime.keep_rules.KeepPolicy` says: by a codec, in host
memory, or both. The entry point: :func:`store_kept`.

NOTE [ Stored kept outputs ]
A selective checkpoint keeps the outputs of its kept calls (linear layers, attention)
and some tensors those calls saved (NOTE [ Selective recompute ]). With ``compress`` or
``offload`` it stores them as ``keep="inputs"`` stores its inputs, once its forward
ends (all of them are made by then):

- By storage. A call's output and the saves that view it (GELU's input is its Linear's
  output; attention's q, k, v are slices of one projection) are one storage, stored
  once; each comes back as the view it was (size, strides, offset), of one decoded or
  fetched tensor, however many read it.
- A lossy codec stores the storages of kept calls' outputs (the activations the matmuls
  made), where every kept tensor of the storage lies inside that output with its
  dtype: encoded as the output, decoded at the first read, and read again from that
  decoding while anyone holds it (the recompute, a node's saves). Every other kept
  tensor stays exact (statistics a call saved: small, and an error in them is not an
  activation's). Attention is not kept under a lossy codec: its decoded output beside
  its exact log-sum-exp and the recompute's decoded q, k, v would not agree (NOTE [
  Attention's saves agree ]).
- With offload, every stored storage goes to the host as one group (kept_entries.py's
  _HostGroup: one copy each way), an item of the forward thread's prefetch tape after
  the block's inputs; the recompute fetches it first, so the tape brings the inputs
  and the blocks before back behind it.
- A storage someone holds anyway is left as it is: the block's inputs (kept by the
  inputs' policy), parameters and their views.
- Versions are checked as when kept exactly: a stored tensor's reader holds an alias
  of its version counter that holds none of its storage (_torch.version_counter_of).
"""
from __future__ import annotations

import weakref
from typing import Optional

import torch

from .._torch import in_memory, storage_identity, version_counter_of
from ..layouts import is_dense
from ..offload import current_tape
from .keep_rules import KeepPolicy, placed
from .kept_entries import _Encoded, _ExactStorage, _HostGroup


class StoredStorage:
    """One storage a selective frame keeps, as its entry stores it, and how a kept
    tensor of it comes back (:meth:`read`)."""

    def __init__(self, entry, base: Optional[torch.Tensor] = None):
        self.entry = entry
        # An encoded output: what it decodes to, a storage read while someone holds it.
        self._shape = None if base is None else base.shape
        self._origin = None if base is None else base.storage_offset()
        self._decoded = _dead_ref

    @property
    def encoded(self) -> bool:
        return self._shape is not None

    def layout_of(self, tensor: torch.Tensor) -> tuple:
        """What :meth:`read` needs to give ``tensor`` back, a tensor of this storage."""
        if not self.encoded:
            return self.entry.layout_of(tensor)
        return tensor.dtype, tuple(tensor.shape), tensor.stride(), tensor.storage_offset() - self._origin

    def read(self, layout: tuple) -> torch.Tensor:
        if not self.encoded:
            return self.entry.unpacked(layout)
        dtype, shape, stride, offset = layout
        storage = self._decoded()
        if storage is None:
            storage = self.entry.unpacked(self._shape).untyped_storage()
            self._decoded = weakref.ref(storage)
        return torch.empty(0, dtype=dtype, device=storage.device).set_(storage, offset, shape, stride)


class StoredTensor:
    """A kept tensor given to its StoredStorage: its layout there, and its version
    counter (an alias that holds no storage, None for a subclass)."""

    __slots__ = ("storage", "layout", "counter")

    def __init__(self, storage: StoredStorage, tensor: torch.Tensor):
        self.storage, self.layout = storage, storage.layout_of(tensor)
        self.counter = version_counter_of(tensor)

    def read(self) -> torch.Tensor:
        return self.storage.read(self.layout)


class StoredKept:
    """What :func:`store_kept` stored: ``tensors``, for each tensor it was given (by
    position) a :class:`StoredTensor` or None where it stays as it is; ``nbytes``, the
    bytes stored (as the codec stores them; with offload, on the host)."""

    def __init__(self, tensors: list, nbytes: int = 0, group: Optional[_HostGroup] = None):
        self.tensors, self.nbytes, self._group = tensors, nbytes, group

    def fetch(self) -> None:
        """Bring the host group back now (the tape prefetches what comes before it)."""
        if self._group is not None:
            self._group.fetch()


def store_kept(policy: KeepPolicy, outputs: list, tensors: list, left: set) -> StoredKept:
    """Store what a selective frame keeps (NOTE [ Stored kept outputs ]): ``outputs``,
    the kept calls' outputs its recompute reads; ``tensors``, the other tensors it
    keeps; ``left``, the identities of the storages held anyway (its inputs')."""
    kept = [*outputs, *tensors]
    if not kept:
        return StoredKept([])
    policy = placed(policy, kept[0].device)  # offload only where it moves them off the device
    groups = {}  # storage identity -> positions of the tensors of it
    for position, tensor in enumerate(kept):
        identity = storage_identity(tensor)
        if identity not in left and in_memory(tensor):  # else held as it is: nothing to copy
            groups.setdefault(identity, []).append(position)
    stored, entries = [None] * len(kept), []
    for positions in groups.values():
        storage = _stored_storage(policy, [kept[p] for p in positions],
                                  [kept[p] for p in positions if p < len(outputs)])
        if storage is None:
            continue
        entries.append(storage.entry)
        for position in positions:
            stored[position] = StoredTensor(storage, kept[position])
    if not entries:
        return StoredKept(stored)
    if policy.offload:
        group = _HostGroup(entries, current_tape())
        return StoredKept(stored, group.nbytes, group)
    return StoredKept(stored, sum(entry.nbytes for entry in entries))


def _stored_storage(policy: KeepPolicy, tensors: list, outputs: list) -> Optional[StoredStorage]:
    """How one storage's kept ``tensors`` (``outputs`` among them) are stored: encoded
    as the output they all lie in, exactly for the host, or not at all (None)."""
    if policy.lossy:
        base = next((_base(o) for o in outputs if _encodable(o, tensors)), None)
        if base is not None:
            return StoredStorage(_Encoded(policy.codec, base, non_negative=False, keep_signs=False), base)
    if not policy.offload:
        return None
    entry = _ExactStorage(tensors[0])
    for tensor in tensors[1:]:
        entry.add(tensor)
    return StoredStorage(entry)


def _encodable(output: torch.Tensor, tensors: list) -> bool:
    """Whether a lossy codec may store ``output`` and give every one of ``tensors`` back
    as a view of its decoding: it is dense (in any order of its dimensions: attention's
    output is transposed) and floating-point (a call's output, made in the block: nobody
    else holds it), and each of them has its dtype and lies inside it."""
    if not (is_dense(output) and output.is_floating_point() and output.numel()):
        return False
    first, end = output.storage_offset(), output.storage_offset() + output.numel()
    return all(t.dtype == output.dtype and first <= t.storage_offset() and _last(t) < end for t in tensors)


def _base(output: torch.Tensor) -> torch.Tensor:
    """What the codec encodes of a dense output: the output, or the elements it fills
    in memory order where it is not contiguous."""
    if output.is_contiguous():
        return output
    return output.as_strided((output.numel(),), (1,), output.storage_offset())


def _last(tensor: torch.Tensor) -> int:
    """The storage offset of the last element ``tensor`` covers."""
    return tensor.storage_offset() + sum((n - 1) * s for n, s in zip(tensor.shape, tensor.stride()))


def _dead_ref():
    return None


__all__ = ["StoredKept", "StoredStorage", "StoredTensor", "store_kept"]
