"""A kept input's stored copy, shared by every live call that keeps the very same
tensor (an encoder's output that each decoder block takes): one encoding, one host
copy, one entry in kept_bytes(). store.py keeps each input through it
(:data:`SHARED`, :class:`StoredCopy`, :func:`sharing_key`)."""
from __future__ import annotations

import threading
import weakref
from typing import Callable, Optional

import torch

from .._torch import storage_identity, storage_identity_or_none, version
from .keep_rules import KeepPolicy

# NOTE [ One stored copy per kept tensor ]
# Calls that keep the same tensor share what is stored of it: kept by reference, the
# one tensor is counted once in kept_bytes(); by a codec or on the host, it is encoded
# and copied once, and held until the last call that keeps it is recomputed (or its
# graph dropped). Offloaded, its copy back to the device is made once too, and stays
# there until that last call. The same tensor is:
# - the same elements of one storage in one geometry (offset, sizes, strides, dtype,
#   negative and conjugate bits): each call restores, bit for bit, what a copy of its
#   own would give it;
# - at the same version: a tensor changed in place between two calls holds other
#   values at the second, which a copy stored at the first must not stand for;
# - kept by the same placed policy (codec and place), on the same grid (a ReLU output
#   or not), requiring grad alike;
# - not a private copy (a function that starts in place changes its own copy).
# A storage is named by its identity, which is unique while it lives: a copy by
# reference holds it; one by a codec or on the host does not, and is shared only while
# the tensor object it was made from lives (and still has that storage). Each restore
# after the first gets a leaf of its own (store._KeptTensor.restore).


class StoredCopy:
    """What a policy stored of one tensor: ``storage`` (store.py's _OnDevice or
    _OnHost) of ``nbytes``, held by ``holders`` live calls. ``source``: the tensor it
    was made from, or None where ``storage`` holds it (a copy by reference)."""

    def __init__(self, storage, nbytes: int, source: Optional[torch.Tensor]):
        self.storage, self.nbytes = storage, nbytes
        self.settle = None  # its entry in kept_bytes(): a finalizer, set by the maker
        self.holders, self.key = 0, None
        self._source = None if source is None else weakref.ref(source)
        self._handed_out = False

    def first_restore(self) -> bool:
        """True the first time any holder restores the value, then False."""
        first, self._handed_out = not self._handed_out, True
        return first

    def stands_for(self, key: tuple) -> bool:
        """Whether the storage ``key`` names is still the one this copy was made from
        (NOTE [ One stored copy per kept tensor ])."""
        if self._source is None:
            return True
        source = self._source()
        return source is not None and storage_identity(source) == key[0]


class _SharedCopies:
    """The live stored copies by :func:`sharing_key`. Calls keep and release from
    autograd's worker threads too, hence the lock."""

    def __init__(self):
        self._lock = threading.Lock()
        self._live = weakref.WeakValueDictionary()

    def held(self, key: Optional[tuple], make: Callable[[], StoredCopy]) -> tuple:
        """``(copy, made)``: the live copy stored under ``key`` (``made`` False), else a
        new one, ``make()`` (True); one holder more either way. A None key is never
        shared."""
        if key is not None:
            with self._lock:
                copy = self._live.get(key)
                if copy is not None and copy.holders and copy.stands_for(key):
                    copy.holders += 1
                    return copy, False
        copy = make()
        copy.holders, copy.key = 1, key
        if key is not None:
            with self._lock:
                self._live[key] = copy
        return copy, True

    def let_go(self, copy: StoredCopy) -> None:
        """One holder fewer; the last releases the stored value and its kept_bytes()."""
        with self._lock:
            copy.holders -= 1
            last = copy.holders == 0
            if last and copy.key is not None and self._live.get(copy.key) is copy:
                del self._live[copy.key]
        if last:
            copy.storage.release()
            copy.settle()


SHARED = _SharedCopies()


def sharing_key(tensor: torch.Tensor, policy: KeepPolicy, non_negative: bool, requires_grad: bool) -> Optional[tuple]:
    """What calls that share a stored copy of ``tensor`` have equal (NOTE [ One stored
    copy per kept tensor ]): its storage first; None for a tensor not shared (a
    subclass, or one without a storage to name: vmap's, functorch's)."""
    if type(tensor) not in (torch.Tensor, torch.nn.Parameter) or tensor.layout != torch.strided:
        return None
    storage = storage_identity_or_none(tensor)
    if storage is None:
        return None
    return (storage, tensor.storage_offset(), tensor.shape, tensor.stride(), tensor.dtype, version(tensor),
            tensor.is_neg(), tensor.is_conj(), policy, non_negative, requires_grad)


__all__ = ["SHARED", "StoredCopy", "sharing_key"]
