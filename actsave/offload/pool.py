"""The host pool: reusable buffers, pinned when CUDA is available, that offloaded
tensors are copied into between the forward and the backward.

Pinned buffers come from PyTorch's pinned-memory allocator, which caches them after
this pool drops them: the pool bounds what actsave keeps (``capacity_bytes``), not what
the process has pinned. Meta tensors (actsave.estimate, meta.py) get a pool of meta
buffers: every step of the schedule allocates as it would, without memory. A tracker
of device memory (live_bytes.LiveBytes) leaves the host buffers out where the host's
memory is separate (devices.host_is_separate): :func:`is_host_memory` tells them
apart. A buffer is lent again only once the last copy that touched it has finished
(NOTE [ Offload stream ordering ], rule 4, in copy_engines.py), and never where a CUDA
graph captured it (NOTE [ Host buffers of a captured graph ]).

NOTE [ Host buffers of a captured graph ]
A CUDA graph (``torch.cuda.graph``) records each copy with its host address, and every
replay writes and reads those addresses again. So, while the current stream captures:
1. No event is asked whether it finished, nor waited for: CUDA refuses both during a
   capture (PyTorch's own allocators skip their event queries then), and an event
   recorded in a capture cannot be asked afterwards either. So buffers handed back but
   not yet seen finished stay where they are, and nothing is freed to make room.
2. A buffer lent is an idle one (its copies seen finished outside the capture: after
   warm-up steps usually none, the last step's not yet seen), or else a new one,
   allocated inside the capture (PyTorch's pinned allocator serves that from the
   graph's private host pool, and keeps it from other users while the graph lives).
3. Given back, it is the graph's for good: kept by the pool, counted in use, never lent
   again nor freed, since a replay may write it at any later time. So a pool must
   outlive the graphs that use its buffers (the default pool lives as long as the
   process). The pool cannot tell when a graph is gone: a capture that failed part way,
   or a graph deleted, leaves its buffers kept too, about one step's offloaded bytes.
"""
from __future__ import annotations

import contextlib
import queue
import threading
import weakref
from collections import defaultdict
from typing import Optional

import torch

from ..devices import capturing
from ..errors import ActsaveError, ConfigError, OffloadPoolExhausted
from ..settings import undone_on_exit
from ._settings import is_count


# Pinning locks whole pages, so a size class below a page would save no pinned memory.
_SMALLEST_CLASS = 4096


class HostPool:
    """Reusable host buffers for offloaded tensors, with a free list per size class.

    Size classes are powers of two of at least a page (4 KiB). Powers of two because
    PyTorch's pinned-memory allocator rounds every request up to one: finer classes
    (say, 2 MiB multiples) would pin the same memory while the pool counted less of
    it, and ``capacity_bytes`` would stop bounding what is pinned. A training step
    offloads the same shapes every time, so after the first step every request finds
    a buffer of its class and no new pinned memory is allocated.

    ``capacity_bytes``: the most bytes the pool may reserve (``None``: no limit). At
    it, idle buffers of other classes are freed to make room, the largest first; a freed
    pinned buffer goes back to PyTorch's pinned-memory cache, which may keep it.
    ``pin``: pin the buffers (``None``: when CUDA is available). ``device``: ``"cpu"``,
    or ``"meta"`` for the buffers of simulated steps. Thread-safe: autograd's worker
    threads return buffers while the forward takes them.
    """

    def __init__(self, capacity_bytes: Optional[int] = None, pin: Optional[bool] = None, device="cpu"):
        self.capacity_bytes = capacity_bytes
        self._pin = pin
        self._device = torch.device(device)
        # release() takes no lock: finalizers call it, and a garbage collection may run
        # them inside acquire (it can start at any allocation). So release() only pops
        # from _lent and puts into _returns, each safe there (SimpleQueue.put is
        # reentrant); acquire() takes the returns in under the lock.
        self._lent = {}  # id -> size class of each buffer on loan (meta buffers share data_ptr 0)
        self._returns = queue.SimpleQueue()  # (event, buffer) handed back, not taken in yet
        self._lent_to_graph = {}  # id -> size class of each buffer lent while a capture ran
        self._graphs = []  # those given back: a captured graph's for good (NOTE above)
        self._lock = threading.Lock()  # guards what follows
        self._idle = defaultdict(list)  # size class -> buffers ready to lend
        self._in_copy = []  # (event, buffer): taken back, a copy may still use the buffer
        self._reserved = 0
        self._allocations = 0

    @staticmethod
    def size_class(nbytes: int) -> int:
        """The size of the buffer lent for a request of ``nbytes``."""
        return 1 << (max(nbytes, _SMALLEST_CLASS) - 1).bit_length()

    @property
    def capacity_bytes(self) -> Optional[int]:
        """The most bytes the pool may reserve; ``None``: no limit. Lowered below what
        is reserved, it keeps the buffers it has and refuses to make new ones."""
        return self._capacity

    @capacity_bytes.setter
    def capacity_bytes(self, nbytes: Optional[int]) -> None:
        if nbytes is not None and not is_count(nbytes):
            raise ConfigError(
                f"host pool capacity {nbytes!r} must be None (no limit) or a number of bytes >= 0"
            )
        self._capacity = nbytes

    @property
    def reserved_bytes(self) -> int:
        """Bytes of every buffer the pool owns, lent or not."""
        with self._lock:
            return self._reserved

    @property
    def in_use_bytes(self) -> int:
        """Bytes on loan, plus bytes handed back that a copy may still be using, or
        that a captured CUDA graph keeps."""
        with self._lock:
            if not capturing():
                self._take_back(_has_finished)
            return self._in_use()

    @property
    def allocations(self) -> int:
        """How many buffers the pool has ever allocated (reuses not counted)."""
        with self._lock:
            return self._allocations

    def acquire(self, nbytes: int) -> torch.Tensor:
        """Lend a flat ``uint8`` host buffer of ``size_class(nbytes)`` bytes.

        Raises :class:`OffloadPoolExhausted` when a new buffer would take the pool past
        its capacity, even after waiting for the buffers copies still use (while a CUDA
        graph is captured: without waiting, nor freeing; NOTE [ Host buffers of a
        captured graph ]).
        """
        size = self.size_class(nbytes)
        if capturing():
            return self._acquire_for_graph(size, nbytes)
        with self._lock:
            self._take_back(_has_finished)
            if not self._idle[size] and not self._fits(size):
                # Buffers still used by a copy are free within microseconds: wait, not fail.
                self._take_back(_wait_until_finished)
                if not self._idle[size]:
                    self._free_idle_for(size)
            buffer = self._idle[size].pop() if self._idle[size] else self._allocate(size, nbytes)
            self._lent[id(buffer)] = size
        return buffer

    def _acquire_for_graph(self, size: int, asked: int) -> torch.Tensor:
        """An idle buffer, else a new one, asking no event (NOTE [ Host buffers of a
        captured graph ])."""
        with self._lock:
            idle = self._idle[size]
            buffer = idle.pop() if idle else self._allocate(size, asked, for_graph=True)
            self._lent_to_graph[id(buffer)] = size
        return buffer

    def release(self, buffer: torch.Tensor, after=None) -> None:
        """Take back a buffer lent by :meth:`acquire` (the tensor it returned). Safe to
        call from finalizers.

        ``after``: the event of a copy that may still use the buffer (anything with
        ``query()`` and ``synchronize()``, as ``torch.cuda.Event``); the buffer is lent
        again only once that event has completed. ``None``: reusable at once. A buffer
        lent while a CUDA graph was captured is kept for the graph, never lent again.
        """
        if self._lent_to_graph.pop(id(buffer), None) is not None:
            self._graphs.append(buffer)  # list.append: safe in a finalizer
            return
        if self._lent.pop(id(buffer), None) is None:
            raise ActsaveError(
                "this buffer is not on loan from this host pool: it was released "
                "already, or acquired from another pool. Release each buffer once, "
                "to the pool that lent it."
            )
        self._returns.put((after, buffer))

    def empty(self) -> int:
        """Let go of the idle buffers (those whose copies have finished): the pool keeps
        every size class it lent for the next steps, which a model gone, or shapes that
        no longer come, never ask for again. Returns their bytes. Pinned ones go back to
        PyTorch's pinned-memory cache, which keeps them until
        ``torch.accelerator.empty_host_cache()`` (or reuses them). Buffers on loan, in a
        copy not yet finished or kept for a captured graph stay; during a capture
        nothing is let go."""
        if capturing():
            return 0
        with self._lock:
            self._take_back(_has_finished)
            freed = sum(size_class * len(buffers) for size_class, buffers in self._idle.items())
            self._idle.clear()
            self._reserved -= freed
        return freed

    def _take_back(self, has_finished) -> None:
        """Move the buffers handed back whose last copy has finished to the idle lists."""
        while not self._returns.empty():  # only the lock holder takes from the queue
            self._in_copy.append(self._returns.get())
        still_in_copy = []
        for event, buffer in self._in_copy:
            if has_finished(event):
                self._idle[buffer.numel()].append(buffer)
            else:
                still_in_copy.append((event, buffer))
        self._in_copy = still_in_copy

    def _free_idle_for(self, size: int) -> None:
        """Free idle buffers of other classes, the largest first, until a new buffer of
        ``size`` fits: they were made for other shapes (a larger batch before a smaller
        last one), and counted against the capacity though nothing uses them. Nothing
        is freed where freeing them all would not make room (the request fails)."""
        idle = sum(size_class * len(buffers) for size_class, buffers in self._idle.items() if size_class != size)
        if self._capacity is not None and self._reserved - idle + size > self._capacity:
            return
        for size_class in sorted(self._idle, reverse=True):
            idle = self._idle[size_class] if size_class != size else []
            while idle and not self._fits(size):
                idle.pop()
                self._reserved -= size_class

    def _fits(self, size: int) -> bool:
        return self._capacity is None or self._reserved + size <= self._capacity

    def _allocate(self, size: int, asked: int, for_graph: bool = False) -> torch.Tensor:
        if not self._fits(size):
            raise OffloadPoolExhausted(
                f"the host offload pool cannot lend {asked:,} bytes (a {size:,}-byte "
                f"buffer): it reserves {self._reserved:,} of its {self._capacity:,}-byte "
                f"capacity already, {self._in_use():,} bytes of them in use. Raise the "
                "capacity with actsave.offload.set_host_pool_capacity(nbytes) (None: no "
                "limit), or offload fewer layers."
                + (" A CUDA graph being captured takes buffers of its own, kept for its replays: "
                   "about one step's offloaded bytes beside the eager steps'." if for_graph else "")
            )
        pin = self._device.type == "cpu" and (torch.cuda.is_available() if self._pin is None else self._pin)
        with _allocating_host_memory():
            buffer = torch.empty(size, dtype=torch.uint8, device=self._device, pin_memory=pin)
        _HOST_STORAGES[buffer.untyped_storage()] = True
        self._reserved += size
        self._allocations += 1
        return buffer

    def _in_use(self) -> int:
        # Copies: release() may change them meanwhile.
        lent = sum(self._lent.copy().values()) + sum(self._lent_to_graph.copy().values())
        graphs = sum(buffer.numel() for buffer in list(self._graphs))
        return lent + graphs + sum(buffer.numel() for _, buffer in self._in_copy)


def _has_finished(event) -> bool:
    return event is None or event.query()


def _wait_until_finished(event) -> bool:
    if event is not None:
        event.synchronize()
    return True


_HOST_STORAGES = weakref.WeakKeyDictionary()  # the storages of every pool's buffers
_host_allocations = threading.local()


@contextlib.contextmanager
def _allocating_host_memory():
    _host_allocations.active = True
    try:
        yield
    finally:
        _host_allocations.active = False


def is_host_memory(storage) -> bool:
    """Whether ``storage`` is host memory of a pool: a buffer, or one this thread is
    allocating now (before the pool has it). Trackers of device memory leave it out."""
    return getattr(_host_allocations, "active", False) or storage in _HOST_STORAGES


_DEFAULT_POOL = HostPool()
_META_POOL = HostPool(device="meta")


def host_pool() -> HostPool:
    """The pool :class:`OffloadedTensor` uses when given none."""
    return _DEFAULT_POOL


def host_pool_for(device) -> HostPool:
    """The pool for tensors on ``device``: :func:`host_pool`, or for meta tensors a
    pool of meta buffers."""
    return _META_POOL if torch.device(device).type == "meta" else _DEFAULT_POOL


def empty_host_pool() -> int:
    """Let go of the default host pool's idle buffers (:meth:`HostPool.empty`);
    returns their bytes. The pool keeps them for later steps until then."""
    return host_pool().empty()


def set_host_pool_capacity(nbytes: Optional[int]) -> contextlib.ExitStack:
    """Cap the bytes the default host pool may reserve (``None``: no limit).

    Takes effect at once; ``with set_host_pool_capacity(n): ...`` also restores the
    previous capacity on exit.
    """
    previous = host_pool().capacity_bytes
    host_pool().capacity_bytes = nbytes
    return undone_on_exit(lambda: set_host_pool_capacity(previous))
