"""The last segment's saves, stored by its codec.

A CheckpointedSequential does not recompute its last segment (backward starts there,
so the recompute would run at once): the segment keeps what autograd saves. At
``segments="sqrt"`` that is about as large as all the kept inputs together (with k =
sqrt(n) segments of a chain of like layers, the last one's n / k layers save about
as much as the k - 1 kept inputs; docs/results.md, "Figures behind the code's
rules"). So a lossy codec set at the last segment's first layer stores those saves
too, as ActNN stores every activation; without it the codec could cut at most the
other half of the peak.

- Stored by the codec: floating-point saves autograd produced. Leaves and views of
  leaves (parameters, ``weight.t()``, the batch, BatchNorm's running and batch
  statistics) are held as they are: encoding them would copy what lives anyway.
- A tensor saved twice (a ReLU output that its ReLU and the next Linear both save, or
  a contiguous view of it) is stored once.
- ReLU outputs made in the segment keep their decisions, one bit per element
  (relu_signs.py): a small positive output that the codec rounds to zero would
  otherwise block its gradient. Every ReLU output is stored on the codec's unsigned
  grid (one more bit of resolution).
- The gradient error does not compound as in a recompute: each save is decoded on
  its own, so its error reaches only the gradients computed from it.
- A max pool's indices (int64, twice the size of its fp32 output) are stored as the
  offset of each window's winner, a few bits each (pool_decisions.py): exactly, as
  the backward needs them. Other integer saves are held as they are.
- Autograd's in-place check holds as without hooks (where hooks are set, autograd
  checks no version): each save records the version of the tensor it saves, and
  unpacking it raises autograd's error if the tensor changed in place since (a weight
  changed between forward and backward). A stored tensor is followed by an alias
  that shares its version counter and none of its storage (_torch.version_counter_of).

The saves are left alone when other saved-tensor hooks are active (an outer
checkpoint, which drops or recomputes them anyway, or the caller's own hooks): the
innermost hooks would otherwise hide the saves from them.
"""
from __future__ import annotations

import weakref
from typing import Callable, Optional

import torch
from torch.autograd.graph import saved_tensors_hooks

from .._torch import saved_tensor_hooks_active, storage_identity, version, version_counter_of
from ..codecs import Codec
from ..errors import RecomputeError
from . import relu_signs
from .layers import known_layers, modules_under
from .pool_decisions import PoolWatch, Window
from .store import account, should_encode


class _Stored:
    """One saved tensor as the codec stores it, shared by every node that saved it."""

    __slots__ = ("codec", "packed", "signs", "__weakref__")

    def __init__(self, codec: Codec, tensor: torch.Tensor, keep_signs: bool):
        self.codec = codec
        self.packed = codec.encode(tensor.detach(), non_negative=relu_signs.known_non_negative(tensor))
        self.signs = relu_signs.pack_signs(tensor) if keep_signs else None
        account(self, self.nbytes)

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes + (0 if self.signs is None else self.signs.numel())

    def restore(self) -> torch.Tensor:
        tensor = self.codec.decode(self.packed)
        if self.signs is not None:
            relu_signs.restore_decisions_(tensor, self.signs)
        return tensor


class _Saved:
    """One save of the forward: what holds its value (the tensor itself, a _Stored,
    a _StoredIndices), its shape, and the tensor's version counter and version then."""

    __slots__ = ("value", "shape", "counter", "version")

    def __init__(self, value, tensor: torch.Tensor, counter: Optional[torch.Tensor]):
        self.value, self.shape, self.counter, self.version = value, tensor.shape, counter, version(tensor)

    def check_unchanged(self) -> None:
        """Raise autograd's error if the saved tensor changed in place since its save."""
        if self.counter is not None and version(self.counter) != self.version:
            raise RecomputeError(
                "one of the variables needed for gradient computation has been modified by an inplace "
                f"operation: a tensor of shape {list(self.shape)} saved by the forward is at version "
                f"{version(self.counter)}; expected version {self.version} instead. Change it after the "
                "backward, or change a copy (nn.Sequential raises the same).")


class _StoredIndices:
    """A max pool's indices stored as its window decisions: decoded exactly."""

    __slots__ = ("window", "input_size", "shape", "packed", "__weakref__")

    def __init__(self, indices: torch.Tensor, window: Window, input_size: tuple):
        self.window, self.input_size, self.shape = window, input_size, indices.shape
        self.packed = window.encode(indices, input_size)
        account(self, self.nbytes)

    @property
    def nbytes(self) -> int:
        return self.packed.numel()

    def restore(self) -> torch.Tensor:
        indices = torch.empty(self.shape, dtype=torch.int64, device=self.packed.device)
        self.window.decode_into_(indices, self.packed, self.input_size)
        return indices


class _SavesStore:
    """The pack and unpack hooks of one forward of a segment, and the bytes stored."""

    def __init__(self, codec: Codec, inputs: list, pools: PoolWatch):
        self.codec = codec
        self.nbytes = 0
        self._input_nodes = relu_signs.input_nodes(inputs)
        self.pools = pools
        # (storage, offset, numel, dtype) of a contiguous save -> (a weak reference to
        # it, its _Stored). The reference must still be alive: then the storage is
        # too, and its address cannot belong to another storage.
        self._seen = {}

    def end_forward(self) -> None:
        # The hooks outlive the forward (autograd holds unpack): hold no _Stored here,
        # so each is freed with the last node that saved it.
        self._seen, self._input_nodes = {}, {}

    def pack(self, tensor: torch.Tensor) -> _Saved:
        pool = self.pools.window_of(tensor)  # also notes a pool's input: called for every save
        if pool is not None:
            stored = _StoredIndices(tensor, *pool)
            self.nbytes += stored.nbytes
            return _Saved(stored, tensor, version_counter_of(tensor))
        if not should_encode(tensor):
            return _Saved(tensor, tensor, tensor)  # held: its own counter
        stored = self._seen_before(tensor)
        if stored is None:
            stored = _Stored(self.codec, tensor, relu_signs.keeps_decisions(tensor, self._input_nodes))
            self.nbytes += stored.nbytes
            key = stored_once_key(tensor)
            if key is not None:
                self._seen[key] = (weakref.ref(tensor), stored)
        return _Saved(stored, tensor, version_counter_of(tensor))

    def unpack(self, saved: _Saved) -> torch.Tensor:
        saved.check_unchanged()
        if isinstance(saved.value, torch.Tensor):
            return saved.value
        return saved.value.restore().view(saved.shape)

    def _seen_before(self, tensor: torch.Tensor):
        key = stored_once_key(tensor)
        if key is None:
            return None
        ref, stored = self._seen.get(key, (_dead_ref, None))
        return stored if ref() is not None else None


def stored_once_key(tensor: torch.Tensor):
    """What makes saves of one forward share one stored copy: equal keys (the same
    elements of one storage, contiguous: a tensor saved twice, or a contiguous view of
    it); None for a non-contiguous tensor, stored anew at each save. The planner's
    profile counts a stored segment's saves by it (planning/instrumented_step.py)."""
    if not tensor.is_contiguous():
        return None
    # The storage object's address, not its data pointer: meta tensors (actsave.estimate)
    # all have data pointer 0.
    return (storage_identity(tensor), tensor.storage_offset(), tensor.numel(), tensor.dtype)


def _dead_ref():
    return None


@torch.compiler.disable  # saved-tensor hooks are a graph break; see NOTE [ torch.compile ]
def call_with_compressed_saves(function: Callable, x, codec: Codec) -> tuple:
    """Run ``function(x)`` with every save that autograd makes stored by ``codec``
    (lossy). Returns ``(output, stored_bytes)``; ``stored_bytes`` is None when other
    saved-tensor hooks are active and the saves are left to them."""
    if saved_tensor_hooks_active():
        return function(x), None
    layers = known_layers(function)  # NOTE [ Known layers ]
    pools = PoolWatch.among(None if layers is None else modules_under(layers))
    store = _SavesStore(codec, [x] if isinstance(x, torch.Tensor) else [], pools)
    try:
        with saved_tensors_hooks(store.pack, store.unpack), store.pools.watching():
            output = function(x)
    finally:
        store.end_forward()
    return output, store.nbytes


__all__ = ["call_with_compressed_saves", "stored_once_key"]
