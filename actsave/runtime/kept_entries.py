"""The forms a kept save takes (kept_saves.py, NOTE [ Kept saves ]): a save as autograd
holds it (:class:`_Saved`), and the entries that keep its elements, by a codec
(:class:`_Encoded`, a max pool's indices :class:`_PoolIndices`) or exactly for offload
(:class:`_ExactStorage`), and one call's entries in host memory (:class:`_HostGroup`)."""
from __future__ import annotations

import threading
from typing import Optional

import torch

from .._torch import version, version_counter_of
from ..codecs import Codec, Packed
from ..errors import RecomputeError
from ..offload import OffloadedTensors
from . import bound_decisions, relu_signs
from .bound_decisions import Bounds
from .pool_decisions import Window
from .store import account


class _Saved:
    """One save of the forward: what holds its value (the tensor itself, or an _Entry
    and the ``layout`` it gives back), its shape, and the tensor's version counter and
    version then."""

    __slots__ = ("value", "layout", "shape", "counter", "version", "__weakref__")

    def __init__(self, value, layout, tensor: torch.Tensor, counter: Optional[torch.Tensor]):
        self.value, self.layout, self.shape = value, layout, tensor.shape
        self.counter, self.version = counter, version(tensor)

    @classmethod
    def held(cls, tensor: torch.Tensor) -> "_Saved":
        """``tensor`` held as it is, with its own version counter."""
        return cls(tensor, None, tensor, tensor)

    def keep(self, entry: "_Entry", tensor: torch.Tensor) -> None:
        """From now on ``entry`` holds the value of ``tensor``, which this save holds."""
        self.value, self.layout, self.counter = entry, entry.layout_of(tensor), version_counter_of(tensor)

    def hold(self, tensor: torch.Tensor) -> None:
        """From now on hold ``tensor``, the one saved (unchanged since), as it is: by a
        detached alias, which shares its storage and version counter."""
        self.value, self.layout = tensor.detach(), None
        self.counter = self.value

    def check_unchanged(self) -> None:
        """Raise autograd's error if the saved tensor changed in place since its save."""
        if self.counter is not None and version(self.counter) != self.version:
            raise RecomputeError(
                "one of the variables needed for gradient computation has been modified by an inplace "
                f"operation: a tensor of shape {list(self.shape)} saved by the forward is at version "
                f"{version(self.counter)}; expected version {self.version} instead. Change it after the "
                "backward, or change a copy (nn.Sequential raises the same).")


class _Entry:
    """Tensors kept for one or more saves: on the device, counted there in
    kept_bytes while they are, until the forward ends; with offload then parts of the
    call's host group (_HostGroup), which counts them. Held only by the saves."""

    __slots__ = ("_tensors", "_group", "_first", "_count", "nbytes", "_counted", "__weakref__")

    def __init__(self, tensors: list):
        self._tensors, self._group, self._first, self._count = tensors, None, 0, len(tensors)
        self.nbytes = sum(t.numel() * t.element_size() for t in tensors)
        self._counted = account(self, self.nbytes) if tensors else None

    def to_host(self) -> list:
        """The device tensors to copy to the host as the forward ends."""
        return self._tensors

    def moved_to(self, group: "_HostGroup", first: int) -> None:
        """From now on the tensors are parts ``first...`` of ``group``, which counts them."""
        self._tensors, self._group, self._first = None, group, first
        if self._counted is not None:
            self._counted()

    def kept(self) -> list:
        """The tensors on the device: fetched back (once for the group) if offloaded."""
        if self._group is None:
            return self._tensors
        return self._group.fetch()[self._first:self._first + self._count]

    def layout_of(self, tensor: torch.Tensor):
        """What :meth:`unpacked` needs of a save of ``tensor``, beside the entry."""
        return tensor.shape

    def unpacked(self, layout) -> torch.Tensor:
        raise NotImplementedError


class _Encoded(_Entry):
    """A saved tensor as the codec stores it (its codes, scales and channel means), with
    its ReLU decisions where it keeps them, and those of each Hardtanh or LeakyReLU that
    saves it (NOTE [ Bound decisions ]); given back decoded, in the save's shape."""

    __slots__ = ("codec", "_names", "_metadata", "_decided")

    def __init__(self, codec: Codec, tensor: torch.Tensor, non_negative: bool, keep_signs: bool,
                 bounds: Optional[Bounds] = None):
        if keep_signs:  # a ReLU output (so non-negative): codes and decisions from one read
            packed, bits = codec.encode_with_signs(tensor.detach())
            signs = [bits]
        else:
            packed, signs = codec.encode(tensor.detach(), non_negative=non_negative), []
        tensors = packed.tensors()
        self.codec, self._names, self._metadata = codec, list(tensors), packed.metadata()
        # Per kept tensor after the codes, what its bits decide: None for ReLU signs, else the bounds.
        self._decided = [None] * len(signs)
        super().__init__([*tensors.values(), *signs])
        if bounds is not None:
            self.add_bounds(tensor, bounds)

    def add_bounds(self, tensor: torch.Tensor, bounds: Bounds) -> None:
        """Keep the decisions of ``bounds`` on ``tensor`` too, the elements stored: a
        clamp's save, whoever saved them first (the decoded tensor is restored to each
        decision kept, for every save of it)."""
        if bounds in self._decided:
            return
        bits = bound_decisions.keep(tensor, bounds)
        self._tensors.append(bits)
        self._decided.append(bounds)
        self._count, self.nbytes = self._count + 1, self.nbytes + bits.numel() * bits.element_size()
        self._counted()
        self._counted = account(self, self.nbytes)

    def unpacked(self, shape) -> torch.Tensor:
        kept = self.kept()
        tensor = self.codec.decode(Packed.assemble(dict(zip(self._names, kept)), self._metadata))
        for decided, bits in zip(self._decided, kept[len(self._names):]):
            if decided is None:
                relu_signs.restore_decisions_(tensor, bits)
            else:
                bound_decisions.restore_(tensor, bits, decided)
        return tensor.view(shape)


class _PoolIndices(_Entry):
    """A max pool's indices stored as its window decisions: decoded exactly."""

    __slots__ = ("window", "input_size", "shape")

    def __init__(self, indices: torch.Tensor, window: Window, input_size: tuple):
        self.window, self.input_size, self.shape = window, input_size, indices.shape
        super().__init__([window.encode(indices, input_size)])

    def unpacked(self, shape) -> torch.Tensor:
        [packed] = self.kept()
        indices = torch.empty(self.shape, dtype=torch.int64, device=packed.device)
        self.window.decode_into_(indices, packed, self.input_size)
        return indices


# Where an exact storage's span starts: a multiple of 16 bytes below its first saved
# byte, so that every view's offset from it is a whole number of its elements (element
# sizes divide 16), in the host group's parts (aligned to 16) as in the storage.
_SPAN_ALIGNMENT = 16


class _ExactStorage(_Entry):
    """The saved views of one storage, kept exactly for offload: the span of bytes they
    cover, copied to the host once as the forward ends. Counted with the group only:
    until then the storage is the forward's own, as autograd's saves would be."""

    __slots__ = ("_storage", "_start", "_end")

    def __init__(self, tensor: torch.Tensor):
        super().__init__([])
        self._storage = tensor.untyped_storage()
        self._start, self._end = _byte_span(tensor)

    def add(self, tensor: torch.Tensor) -> None:
        """Cover the bytes of ``tensor`` too, a view of the same storage."""
        start, end = _byte_span(tensor)
        self._start, self._end = min(self._start, start), max(self._end, end)

    def layout_of(self, tensor: torch.Tensor) -> tuple:
        return tensor.dtype, tensor.shape, tensor.stride(), tensor.storage_offset() * tensor.element_size()

    def to_host(self) -> list:
        self._start -= self._start % _SPAN_ALIGNMENT
        span = torch.empty(0, dtype=torch.uint8, device=self._storage.device)
        span.set_(self._storage, self._start, (self._end - self._start,), (1,))
        self._count, self.nbytes = 1, self._end - self._start
        return [span]

    def moved_to(self, group: "_HostGroup", first: int) -> None:
        super().moved_to(group, first)
        self._storage = None

    def unpacked(self, layout: tuple) -> torch.Tensor:
        dtype, shape, stride, byte_offset = layout
        if self._group is None:  # in the forward (a backward inside it): the storage itself
            storage, base = self._storage, byte_offset
        else:
            [span] = self.kept()
            storage, base = span.untyped_storage(), span.storage_offset() + byte_offset - self._start
        view = torch.empty(0, dtype=dtype, device=storage.device)
        return view.set_(storage, base // view.element_size(), shape, stride)


def _byte_span(tensor: torch.Tensor) -> tuple:
    """``(first, end)``: the bytes of its storage that ``tensor`` (not empty) covers."""
    size = tensor.element_size()
    last = sum((n - 1) * s for n, s in zip(tensor.shape, tensor.stride()))
    first = tensor.storage_offset() * size
    return first, first + (last + 1) * size


class _HostGroup:
    """The kept saves of one call in host memory: one OffloadedTensors, one item of
    the tape of the thread that ran the forward (a TapeItem). NOTE [ Kept saves ]."""

    def __init__(self, entries: list, tape):
        parts, firsts = [], []
        for entry in entries:
            firsts.append(len(parts))
            parts.extend(entry.to_host())
        self._offloaded = OffloadedTensors(parts)
        self.nbytes = self._offloaded.nbytes
        self._tape, self._fetched, self._lock = tape, None, threading.Lock()
        self._counted = account(self, self.nbytes, "host")
        for entry, first in zip(entries, firsts):
            entry.moved_to(self, first)
        tape.register(self)

    @property
    def released(self) -> bool:
        return self._offloaded.released

    def prefetch(self) -> None:
        self._offloaded.prefetch()

    def free_source(self) -> None:
        # Copied as the forward ended, just before the next block started: the wait goes
        # one block later, so that the copy overlaps a block of compute (rule 2).
        self._tape.free_later(self._offloaded)

    def fetch(self) -> list:
        """The parts on the device: copied back at the first call, the tape prefetching
        the items before this one; from then on counted on the device."""
        with self._lock:
            if self._fetched is None:
                self._tape.before_use(self)
                self._fetched = self._offloaded.fetch()
                self._counted()
                self._counted = account(self, self.nbytes, "device")
            return self._fetched
