"""Copy engines: copies between a device and host buffers, and the order of the
streams that use them. On CUDA the copies run on one dedicated copy stream per device,
overlapped with compute; for CPU and meta tensors they are plain synchronous copies, so
the whole schedule runs, and is tested, without a GPU.

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
   A checkpoint's input offloaded as it is (no codec between it and the copy) is the
   copy's source itself, which the caller may change in place once the call returns
   and nothing would order after the copy: its wait is placed as the call's forward
   ends (runtime/store.py, ``_KeptTensor.end_forward``), so that copy overlaps the
   call's own forward.
   A segment's decisions (ReLU and max-pool, runtime/store.py) go to the host as one
   group when its forward ends, just before the next segment starts, so their wait
   is placed one segment later (``PrefetchTape.free_later``); so do the saves of a
   call kept instead of recomputed (runtime/kept_saves.py), which marks its own start
   (``PrefetchTape.segment_may_start``) unless its caller did.
3. Host to device. The fetched tensor is allocated on the compute stream; the copy
   stream waits for the compute stream (earlier kernels that used that block are
   done), copies and records ``copied_in``. The current stream waits on ``copied_in``
   just before use (:meth:`CopyEngine.wait`). A fetched tensor dropped unused is
   dropped after ``free_after(copied_in)``, as in rule 2.
4. The host buffer goes back to the pool with the event of the last copy that touched
   it, and is lent again only once the host sees that event complete
   (``HostPool.release(after=...)``). One copy stream would order the copies anyway,
   but CPU copies and other devices' copy streams are not ordered with it. At its
   capacity the pool waits for those events rather than fail. A job that fails half
   queued (an interrupt between two copies) leaves no event: its buffer goes back once
   the host has waited for the engine's copies (``CopyEngine.synchronize``), or, where
   that wait fails too (the device is gone), never: the pool counts it lent for good.
5. One engine runs its copies in the order they are asked for (one copy stream per
   device). So ``PrefetchTape.before_use`` asks for the needed item's copy before those
   of the items ahead of it, which would otherwise delay it.
"""
from __future__ import annotations

import threading

import torch

from ..devices import host_is_separate
from ..errors import ConfigError


class CopyEngine:
    """Copies tensors between one device and host buffers, and orders the streams that
    use them (NOTE [ Offload stream ordering ]).

    The event a copy returns is ``None`` when the copy has finished already, or an
    object with ``query()`` and ``synchronize()`` (what :meth:`HostPool.release` takes).
    """

    def to_host(self, source: torch.Tensor, host: torch.Tensor):
        """Start copying ``source`` (dense, on this engine's device) into ``host`` (same
        shape, strides and dtype: one run of bytes); return the copy's event."""
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
        """Start copying ``host`` (dense) into a new tensor on this engine's device, of the
        same strides; return ``(tensor, event)``. The tensor must not be read before
        ``wait(event)``."""
        raise NotImplementedError

    def wait(self, event) -> None:
        """Make the current stream wait for ``event`` before what is queued on it next."""
        raise NotImplementedError

    def free_after(self, event) -> None:
        """Let the device memory a copy used be reused only after the copy: call it
        just before dropping the last reference to the copy's source or target."""
        raise NotImplementedError

    def synchronize(self) -> None:
        """Wait, on the host, until every copy asked of this engine has finished: what a
        job that failed half queued leaves no event for."""


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

    def synchronize(self) -> None:
        self.copy_stream.synchronize()


_HOST_ENGINE = HostCopyEngine()
_CUDA_ENGINES = {}  # device index -> CudaCopyEngine
_CUDA_ENGINES_LOCK = threading.Lock()


def copy_engine_for(device) -> CopyEngine:
    """The engine an :class:`OffloadedTensor` on ``device`` uses when given none: one
    per CUDA device, shared, and a synchronous one for the CPU and meta tensors."""
    device = torch.device(device)
    if device.type in ("cpu", "meta"):
        return _HOST_ENGINE
    if not host_is_separate(device):  # copy streams exist only where the host is apart: CUDA
        raise ConfigError(
            f"offload supports cpu, cuda and meta tensors, not {device.type} ones; do not "
            f"offload the layers whose inputs live on {device}"
        )
    index = torch.cuda.current_device() if device.index is None else device.index
    with _CUDA_ENGINES_LOCK:
        if index not in _CUDA_ENGINES:
            _CUDA_ENGINES[index] = CudaCopyEngine(torch.device("cuda", index))
        return _CUDA_ENGINES[index]
