"""Offload: keep segment inputs in host memory between the forward and the backward.

An :class:`OffloadedTensor` copies a tensor into a buffer lent by a :class:`HostPool`
(pinned when CUDA is available) through a :class:`CopyEngine`: on CUDA the copies run
on one dedicated copy stream per device, overlapped with compute; on the CPU they are
plain synchronous copies, so the whole schedule runs, and is tested, without a GPU.
A :class:`PrefetchTape` records offloaded items in forward order and, in backward
(reverse order), starts bringing the next ones back while the current one is in use.

Meta tensors (actsave.estimate, meta.py) are offloaded as CPU tensors are, into a pool
of meta buffers: every step of the schedule runs and allocates as it would, without
memory. A tracker of device memory (live_bytes.LiveBytes) leaves the host buffers out:
:func:`is_host_memory` tells them apart.

Limits: CPU and CUDA tensors (and meta ones) only. Pinned buffers come from PyTorch's pinned-memory
allocator, which caches them after this pool drops them: the pool bounds what
actsave keeps (``capacity_bytes``), not what the process has pinned.

NOTE [ Offload stream ordering ]
Memory changes hands between the *compute stream* (the stream current when a copy is
asked for: it produced the source and allocates the fetched tensor) and the engine's
*copy stream*. The rules:

1. Device to host. The copy stream waits for the compute stream (the kernels that
   wrote the source are done), copies into the host buffer and records ``copied_out``.
2. The source's device memory. PyTorch's caching allocator reuses a freed block for
   the next allocation on the stream that owns it, ordered only by that stream, and
   decides in host time. So the last reference to the source is dropped only after the
   owning compute stream has been made to wait on ``copied_out``
   (:meth:`CopyEngine.free_after`): whatever later gets the block is queued behind the
   copy. Not ``record_stream``, nor "keep a reference until the event completes": both
   let the block go only once the host sees the copy finished, and the host usually
   runs ahead of the GPU, so during the forward the allocator would find offloaded
   blocks still taken and allocate new ones: offload would save little memory.
   ``PrefetchTape.segment_starts`` places that wait when the next segment starts
   (``free_source``; ``register`` calls it, and so does a segment that offloads
   nothing), so each copy overlaps one segment of compute, and the compute
   stream stalls only when a copy takes longer than a segment: the back-pressure that
   keeps device memory bounded. ``prefetch`` and ``release`` place it at the latest.
   A segment's decisions (ReLU and max-pool, runtime/store.py) go to the host as one
   group when its forward ends, just before the next segment starts, so their wait
   is placed one segment later (``PrefetchTape.free_later``).
3. Host to device. The fetched tensor is allocated on the compute stream; the copy
   stream waits for the compute stream (earlier kernels that used that block are
   done), copies and records ``copied_in``. The current stream waits on ``copied_in``
   just before use (:meth:`CopyEngine.wait`). A fetched tensor dropped unused is
   dropped after ``free_after(copied_in)``, as in rule 2.
4. The host buffer goes back to the pool with the event of the last copy that touched
   it, and is lent again only once the host sees that event complete
   (``HostPool.release(after=...)``). One copy stream would order the copies anyway,
   but CPU copies and other devices' copy streams are not ordered with it. At its
   capacity the pool waits for those events rather than fail.
5. One engine runs its copies in the order they are asked for (one copy stream per
   device). So ``PrefetchTape.before_use`` asks for the needed item's copy before those
   of the items ahead of it, which would otherwise delay it.
"""
from __future__ import annotations

import contextlib
import queue
import threading
import weakref
from collections import defaultdict
from typing import Optional, Protocol

import torch

from .errors import ActsaveError, ConfigError


class OffloadPoolExhausted(ActsaveError):
    """The host pool would have to exceed its capacity to lend a buffer."""


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

    ``capacity_bytes``: the most bytes the pool may reserve (``None``: no limit).
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
        if nbytes is not None and not _is_count(nbytes):
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
        """Bytes on loan, plus bytes handed back that a copy may still be using."""
        with self._lock:
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
        its capacity, even after waiting for the buffers copies still use.
        """
        size = self.size_class(nbytes)
        with self._lock:
            self._take_back(_has_finished)
            if not self._idle[size] and not self._fits(size):
                # Buffers still used by a copy are free within microseconds: wait, not fail.
                self._take_back(_wait_until_finished)
            buffer = self._idle[size].pop() if self._idle[size] else self._allocate(size, nbytes)
            self._lent[id(buffer)] = size
        return buffer

    def release(self, buffer: torch.Tensor, after=None) -> None:
        """Take back a buffer lent by :meth:`acquire` (the tensor it returned). Safe to
        call from finalizers.

        ``after``: the event of a copy that may still use the buffer (anything with
        ``query()`` and ``synchronize()``, as ``torch.cuda.Event``); the buffer is lent
        again only once that event has completed. ``None``: reusable at once.
        """
        if self._lent.pop(id(buffer), None) is None:
            raise ActsaveError(
                "this buffer is not on loan from this host pool: it was released "
                "already, or acquired from another pool. Release each buffer once, "
                "to the pool that lent it."
            )
        self._returns.put((after, buffer))

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

    def _fits(self, size: int) -> bool:
        return self._capacity is None or self._reserved + size <= self._capacity

    def _allocate(self, size: int, asked: int) -> torch.Tensor:
        if not self._fits(size):
            raise OffloadPoolExhausted(
                f"the host offload pool cannot lend {asked:,} bytes (a {size:,}-byte "
                f"buffer): it reserves {self._reserved:,} of its {self._capacity:,}-byte "
                f"capacity already, {self._in_use():,} bytes of them in use. Raise the "
                "capacity with actsave.offload.set_host_pool_capacity(nbytes) (None: no "
                "limit), or offload fewer layers."
            )
        pin = self._device.type == "cpu" and (torch.cuda.is_available() if self._pin is None else self._pin)
        with _allocating_host_memory():
            buffer = torch.empty(size, dtype=torch.uint8, device=self._device, pin_memory=pin)
        _HOST_STORAGES[buffer.untyped_storage()] = True
        self._reserved += size
        self._allocations += 1
        return buffer

    def _in_use(self) -> int:
        lent = sum(self._lent.copy().values())  # a copy: release() may change it meanwhile
        return lent + sum(buffer.numel() for _, buffer in self._in_copy)


def _has_finished(event) -> bool:
    return event is None or event.query()


def _wait_until_finished(event) -> bool:
    if event is not None:
        event.synchronize()
    return True


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


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


def set_host_pool_capacity(nbytes: Optional[int]) -> contextlib.ExitStack:
    """Cap the bytes the default host pool may reserve (``None``: no limit).

    Takes effect at once; ``with set_host_pool_capacity(n): ...`` also restores the
    previous capacity on exit.
    """
    previous = host_pool().capacity_bytes
    host_pool().capacity_bytes = nbytes
    return _undone_on_exit(lambda: set_host_pool_capacity(previous))


def _undone_on_exit(undo) -> contextlib.ExitStack:
    # The setting has taken effect already; a with-statement around the call undoes it
    # on exit, so that global switches can be scoped (docs/architecture.md).
    stack = contextlib.ExitStack()
    stack.callback(undo)
    return stack


class CopyEngine:
    """Copies tensors between one device and host buffers, and orders the streams that
    use them (NOTE [ Offload stream ordering ]).

    The event a copy returns is ``None`` when the copy has finished already, or an
    object with ``query()`` and ``synchronize()`` (what :meth:`HostPool.release` takes).
    """

    def to_host(self, source: torch.Tensor, host: torch.Tensor):
        """Start copying ``source`` (contiguous, on this engine's device) into ``host``
        (same shape and dtype); return the copy's event."""
        raise NotImplementedError

    def to_host_all(self, pairs: list):
        """Start the copies of ``[(source, host)]`` as :meth:`to_host` does, in order;
        return one event, of the last (an engine runs its copies in order: rule 5).
        Engines override it to enqueue them as one job."""
        event = None
        for source, host in pairs:
            event = self.to_host(source, host)
        return event

    def to_device(self, host: torch.Tensor) -> tuple:
        """Start copying ``host`` into a new tensor on this engine's device; return
        ``(tensor, event)``. The tensor must not be read before ``wait(event)``."""
        raise NotImplementedError

    def wait(self, event) -> None:
        """Make the current stream wait for ``event`` before what is queued on it next."""
        raise NotImplementedError

    def free_after(self, event) -> None:
        """Let the device memory a copy used be reused only after the copy: call it
        just before dropping the last reference to the copy's source or target."""
        raise NotImplementedError


class HostCopyEngine(CopyEngine):
    """Copies for CPU and meta tensors: synchronous, so every event is ``None`` (finished)."""

    def to_host(self, source: torch.Tensor, host: torch.Tensor):
        host.copy_(source)
        return None

    def to_device(self, host: torch.Tensor) -> tuple:
        return host.clone(), None

    def wait(self, event) -> None:
        """Nothing to wait for: a copy has finished when it returns."""

    def free_after(self, event) -> None:
        """Nothing to order: a copy has finished when it returns."""


class _CudaCopy:
    """The event of a copy on a copy stream, and the compute stream that owns the
    device memory the copy uses."""

    __slots__ = ("done", "owner")

    def __init__(self, owner: "torch.cuda.Stream"):
        self.done = torch.cuda.Event()
        self.owner = owner

    def query(self) -> bool:
        return self.done.query()

    def synchronize(self) -> None:
        self.done.synchronize()


class CudaCopyEngine(CopyEngine):
    """Copies on a dedicated copy stream, overlapped with the compute stream.

    Get one through :func:`copy_engine_for`, so that a device has one copy stream and
    its copies run in the order they were asked for (rule 5 of the NOTE).
    """

    def __init__(self, device):
        device = torch.device(device)
        index = torch.cuda.current_device() if device.index is None else device.index
        self.device = torch.device("cuda", index)
        self.copy_stream = torch.cuda.Stream(self.device)

    def to_host(self, source: torch.Tensor, host: torch.Tensor) -> _CudaCopy:
        return self._copy([(source, host)])

    def to_host_all(self, pairs: list) -> _CudaCopy:
        # One wait, one switch to the copy stream and one event for all of them.
        return self._copy(pairs)

    def to_device(self, host: torch.Tensor) -> tuple:
        # Allocated on the compute stream, which owns it and frees it in its own order.
        target = torch.empty_like(host, device=self.device)
        return target, self._copy([(host, target)])

    def _copy(self, pairs: list) -> _CudaCopy:
        """Copy each ``(source, into)`` pair on the copy stream, after the compute
        stream's work so far (rules 1 and 3)."""
        copy = _CudaCopy(owner=torch.cuda.current_stream(self.device))
        self.copy_stream.wait_stream(copy.owner)
        with torch.cuda.stream(self.copy_stream):
            for source, into in pairs:
                into.copy_(source, non_blocking=True)
        copy.done.record(self.copy_stream)
        return copy

    def wait(self, event: _CudaCopy) -> None:
        torch.cuda.current_stream(self.device).wait_event(event.done)

    def free_after(self, event: _CudaCopy) -> None:
        event.owner.wait_event(event.done)


_HOST_ENGINE = HostCopyEngine()
_CUDA_ENGINES = {}  # device index -> CudaCopyEngine
_CUDA_ENGINES_LOCK = threading.Lock()


def copy_engine_for(device) -> CopyEngine:
    """The engine an :class:`OffloadedTensor` on ``device`` uses when given none: one
    per CUDA device, shared, and a synchronous one for the CPU and meta tensors."""
    device = torch.device(device)
    if device.type in ("cpu", "meta"):
        return _HOST_ENGINE
    if device.type != "cuda":
        raise ConfigError(
            f"offload supports cpu, cuda and meta tensors, not {device.type} ones; do not "
            f"offload the layers whose inputs live on {device}"
        )
    index = torch.cuda.current_device() if device.index is None else device.index
    with _CUDA_ENGINES_LOCK:
        if index not in _CUDA_ENGINES:
            _CUDA_ENGINES[index] = CudaCopyEngine(torch.device("cuda", index))
        return _CUDA_ENGINES[index]


class _Holdings:
    """What an offloaded value holds that must be given back in order. Kept apart from
    it so that its finalizer can give them back without keeping it alive."""

    def __init__(self, pool: HostPool, engine: CopyEngine, buffer: torch.Tensor):
        self.pool = pool
        self.engine = engine
        self.buffer = buffer  # None once back in the pool
        self.sources = None  # device tensors read by the copy to the host
        self.copied_out = None
        self.device_copies = None  # device tensors written by the copy back
        self.copied_in = None

    def drop_sources(self) -> None:
        if self.sources is not None:
            self.engine.free_after(self.copied_out)
            self.sources = None

    def drop_device_copies(self) -> None:
        if self.device_copies is not None:
            self.engine.free_after(self.copied_in)
            self.device_copies = None

    def return_buffer(self) -> None:
        if self.buffer is not None:
            last_copy = self.copied_out if self.copied_in is None else self.copied_in
            self.pool.release(self.buffer, after=last_copy)
            self.buffer = None

    def release(self) -> None:
        self.drop_sources()
        self.drop_device_copies()
        self.return_buffer()


# Where each tensor of a group starts in its host buffer: a multiple of 16 bytes, so
# that the views the copy back makes of one device buffer are aligned for any dtype and
# for the kernels' 16-byte vector accesses.
_PART_ALIGNMENT = 16


class _Part:
    """Where one tensor of an offloaded group lies in the buffer, and what it was."""

    __slots__ = ("offset", "nbytes", "dtype", "shape")

    def __init__(self, offset: int, tensor: torch.Tensor):
        self.offset, self.nbytes = offset, tensor.numel() * tensor.element_size()
        self.dtype, self.shape = tensor.dtype, tensor.shape

    def view(self, buffer: torch.Tensor) -> torch.Tensor:
        """This part of ``buffer`` (flat uint8), as the tensor it holds (a byte vector,
        such as packed decisions, needs no view beyond the slice)."""
        part = buffer[self.offset: self.offset + self.nbytes]
        if self.dtype != torch.uint8:
            part = part.view(self.dtype)
        return part if part.shape == self.shape else part.view(self.shape)


class OffloadedTensors:
    """Tensors of one device kept together in one host buffer until fetched back.

    Construction starts copying each tensor (detached; made contiguous first) into its
    part of a buffer lent by ``pool`` (default: :func:`host_pool_for` their device),
    through ``engine`` (default: :func:`copy_engine_for` their device) as one job: one
    buffer, one wait and one event for the group, however many tensors it holds (a kept
    input's codes, scales and channel means; a segment's decisions). They come back in
    one copy, as views of one device buffer. Any dtypes; the bytes come back unchanged.
    The buffer goes back to the pool on :meth:`release`, or when the object is garbage
    collected.
    """

    def __init__(self, tensors: list, pool: Optional[HostPool] = None, engine: Optional[CopyEngine] = None):
        sources = [(tensor.detach() if tensor.requires_grad else tensor).contiguous() for tensor in tensors]
        if not sources or any(source.device != sources[0].device for source in sources):
            raise ActsaveError("OffloadedTensors takes one or more tensors, all on one device")
        self.device = sources[0].device
        self._parts, offset = [], 0
        for source in sources:
            self._parts.append(_Part(offset, source))
            offset += -(-self._parts[-1].nbytes // _PART_ALIGNMENT) * _PART_ALIGNMENT
        self.nbytes = sum(part.nbytes for part in self._parts)
        self._span = self._parts[-1].offset + self._parts[-1].nbytes  # the bytes a copy back moves
        pool = host_pool_for(self.device) if pool is None else pool
        engine = copy_engine_for(self.device) if engine is None else engine
        self._held = _Holdings(pool, engine, pool.acquire(self._span))
        self._finalizer = weakref.finalize(self, self._held.release)
        # At interpreter exit the process frees everything, and CUDA may be gone already.
        self._finalizer.atexit = False
        try:
            self._held.copied_out = engine.to_host_all(
                [(source, part.view(self._held.buffer)) for source, part in zip(sources, self._parts)])
        except BaseException:
            self.release()
            raise
        # Held until free_source(): the copy may still be reading them (NOTE rule 2).
        self._held.sources = sources

    @property
    def released(self) -> bool:
        """Whether :meth:`release` has run (or the object was collected)."""
        return not self._finalizer.alive

    def free_source(self) -> None:
        """Let the device memory of the offloaded tensors be reused, in stream order.
        ``PrefetchTape.segment_starts`` calls it when the next segment starts."""
        self._held.drop_sources()

    def prefetch(self) -> None:
        """Start the copy back to the device, unless it started or :meth:`release` ran."""
        held = self._held
        if self.released or held.device_copies is not None:
            return
        held.drop_sources()  # the backward has begun: the forward's tensors are not needed
        if len(self._parts) == 1:  # a tensor of its own dtype, not a view of bytes
            copy, held.copied_in = held.engine.to_device(self._parts[0].view(held.buffer))
            held.device_copies = [copy]
        else:
            copied, held.copied_in = held.engine.to_device(held.buffer[: self._span])
            held.device_copies = [part.view(copied) for part in self._parts]

    def fetch(self) -> list:
        """The tensors on their device, in order, ready for the current stream to use.
        Prefetches if needed; the host buffer then goes back to the pool (reused once
        the copy has finished). Calling it again returns the same tensors until
        :meth:`release`."""
        if self.released:
            raise ActsaveError(
                "this offloaded tensor was released already, so it cannot be fetched; "
                "fetch it before releasing it"
            )
        self.prefetch()
        held = self._held
        held.engine.wait(held.copied_in)
        held.return_buffer()
        return held.device_copies

    def release(self) -> None:
        """Give the host buffer back to the pool and drop the device copies. Idempotent."""
        self._finalizer()


class OffloadedTensor:
    """A tensor kept in a host buffer until it is fetched back to its device: an
    :class:`OffloadedTensors` of one, whose :meth:`fetch` gives the tensor.
    ``device``, ``dtype``, ``shape`` and ``nbytes`` describe it."""

    def __init__(self, tensor: torch.Tensor, pool: Optional[HostPool] = None,
                 engine: Optional[CopyEngine] = None):
        self._group = OffloadedTensors([tensor], pool, engine)
        self.device, self.nbytes = self._group.device, self._group.nbytes
        self.dtype, self.shape = tensor.dtype, tensor.shape

    @property
    def released(self) -> bool:
        """Whether :meth:`release` has run (or the object was collected)."""
        return self._group.released

    @property
    def _held(self) -> _Holdings:
        return self._group._held

    def free_source(self) -> None:
        """As :meth:`OffloadedTensors.free_source`."""
        self._group.free_source()

    def prefetch(self) -> None:
        """As :meth:`OffloadedTensors.prefetch`."""
        self._group.prefetch()

    def fetch(self) -> torch.Tensor:
        """The tensor on its device (:meth:`OffloadedTensors.fetch`)."""
        return self._group.fetch()[0]

    def release(self) -> None:
        """As :meth:`OffloadedTensors.release`."""
        self._group.release()


class TapeItem(Protocol):
    """What :class:`PrefetchTape` needs of an item. :class:`OffloadedTensor` has it, and
    so can a group of them that holds one segment's inputs."""

    released: bool

    def prefetch(self) -> None:
        """Start bringing the item back; idempotent, and a no-op once released."""

    def free_source(self) -> None:
        """Let the item's device memory go, in stream order; idempotent."""


_prefetch_depth = 1


def prefetch_depth() -> int:
    """How many items :meth:`PrefetchTape.before_use` brings back ahead (default 1)."""
    return _prefetch_depth


def set_prefetch_depth(depth: int) -> contextlib.ExitStack:
    """Set how many items :meth:`PrefetchTape.before_use` brings back ahead of the one
    backward needs (0: none) for every tape that has no depth of its own.

    Takes effect at once; ``with set_prefetch_depth(n): ...`` also restores the previous
    depth on exit. Each item ahead holds its device memory early, so depth trades
    device memory for slack in the copies.
    """
    global _prefetch_depth
    previous, _prefetch_depth = _prefetch_depth, _checked_depth(depth)
    return _undone_on_exit(lambda: set_prefetch_depth(previous))


def _checked_depth(depth) -> int:
    if not _is_count(depth):
        raise ConfigError(
            f"prefetch depth {depth!r} must be an int >= 0: how many offloaded items to "
            "bring back ahead of the one backward needs (0: none, default 1)"
        )
    return depth


class PrefetchTape:
    """Offloaded items in forward order, brought back ahead of the backward.

    Register one item per segment (an :class:`OffloadedTensor`, or a group holding all
    of a segment's offloaded tensors, data and scales alike): ``register`` marks where a
    segment starts, and ``depth`` counts items. Items are weakly referenced, so the tape
    never keeps memory alive; collected and released items drop off it.

    ``depth``: items to bring back ahead; ``None`` follows :func:`set_prefetch_depth`.
    Thread-safe: the backward may run on another thread than the forward.
    """

    def __init__(self, depth: Optional[int] = None):
        self._depth = None if depth is None else _checked_depth(depth)
        self._lock = threading.Lock()
        self._refs = []  # weak references to the items, in forward order
        self._later = []  # weak references to what free_later deferred
        self._segment_started = False  # segment_starts ran since the last register

    @property
    def depth(self) -> int:
        """Items :meth:`before_use` brings back ahead of the one backward needs."""
        return _prefetch_depth if self._depth is None else self._depth

    def register(self, item: TapeItem) -> None:
        """Record ``item`` as the newest, and free the source of the one registered
        before it: that segment's forward is over (NOTE [ Offload stream ordering ]).
        Where the caller has just said so (:meth:`segment_starts`, as
        CheckpointedSequential does for each segment), the start is not counted twice."""
        with self._lock:
            told = self._segment_started
        if not told:
            self.segment_starts()
        with self._lock:
            self._refs.append(weakref.ref(item))
            self._segment_started = False

    def segment_starts(self) -> None:
        """Free the source of the newest item: a segment starts, so the forward of the
        one that registered it is over. ``register`` does this; a segment that keeps
        nothing offloaded (a stored one) calls it, or the last offloaded input would
        stay on the device through the rest of the forward and the backward up to its
        own recompute (seen on an H100: one input above the plan's predicted peak)."""
        with self._lock:
            items = self._live_items()
            later, self._later = self._later, []
            self._segment_started = True
        for ref in later:
            deferred = ref()
            if deferred is not None:
                deferred.free_source()
        if items:
            items[-1].free_source()

    def free_later(self, item) -> None:
        """Free ``item``'s source (anything with ``free_source()``) at the next
        :meth:`segment_starts`, not now: for a copy asked for just before this one, so
        that it too overlaps a segment of compute (NOTE [ Offload stream ordering ],
        rule 2). Held weakly."""
        with self._lock:
            self._later.append(weakref.ref(item))

    def before_use(self, item: TapeItem) -> None:
        """Call when the backward is about to need ``item``: starts its copy back, then
        those of the ``depth`` live items registered just before it, which the backward
        needs next. An item not on the tape gets no lookahead."""
        with self._lock:
            items = self._live_items()
        position = next((i for i, each in enumerate(items) if each is item), 0)  # 0: none ahead
        item.prefetch()  # first: one copy stream runs copies in order (rule 5)
        for ahead in reversed(items[max(0, position - self.depth) : position]):
            ahead.prefetch()

    def _live_items(self) -> list:
        """The items neither collected nor released, in forward order; forgets the rest."""
        pairs = [(ref, ref()) for ref in self._refs]
        live = [(ref, item) for ref, item in pairs if item is not None and not item.released]
        self._refs = [ref for ref, _ in live]
        return [item for _, item in live]


_local = threading.local()


def current_tape() -> PrefetchTape:
    """This thread's default tape.

    The backward may run on another thread (on CUDA, autograd's device threads do), so
    keep the tape an item was registered with and call ``before_use`` on that one.
    """
    tape = getattr(_local, "tape", None)
    if tape is None:
        tape = _local.tape = PrefetchTape()
    return tape


__all__ = [
    "CopyEngine",
    "CudaCopyEngine",
    "HostCopyEngine",
    "HostPool",
    "OffloadPoolExhausted",
    "OffloadedTensor",
    "OffloadedTensors",
    "PrefetchTape",
    "TapeItem",
    "copy_engine_for",
    "current_tape",
    "host_pool",
    "host_pool_for",
    "is_host_memory",
    "prefetch_depth",
    "set_host_pool_capacity",
    "set_prefetch_depth",
]
