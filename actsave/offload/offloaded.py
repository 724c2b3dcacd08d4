"""Offloaded tensors: tensors of one device kept in one host buffer from the forward
until the backward fetches them back (NOTE [ Offload stream ordering ] in
copy_engines.py says when each device and host buffer may be reused).
"""
from __future__ import annotations

import threading
import weakref
from typing import Optional

import torch

from .._torch import outside_transforms
from ..errors import ActsaveError
from ..layouts import is_dense, kept_strides, viewed
from .copy_engines import CopyEngine, copy_engine_for
from .pool import HostPool, host_pool_for


class _Holdings:
    """What an offloaded value holds that must be given back in order. Kept apart from
    it so that its finalizer can give them back without keeping it alive."""

    def __init__(self, pool: HostPool, engine: CopyEngine, buffer: torch.Tensor):
        # Autograd runs one backward thread per device: the tape's lookahead on one may
        # prefetch what another fetches or releases. Each step below reads then sets
        # these fields, so they change under this lock, or two copies back start (the
        # loser's device memory freed under its copy) or a release drops a copy
        # half made.
        self.lock = threading.RLock()
        self.pool = pool
        self.engine = engine
        self.buffer = buffer  # None once back in the pool
        self.host_views = None  # the parts of the buffer as their tensors, while it is lent
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
            self.buffer, self.host_views = None, None

    def release(self) -> None:
        # Each step whatever an earlier one raised (an interrupt inside free_after): the
        # finalizer that calls this runs once, and a buffer not given back is lent for
        # good. The buffer goes back after its copies' events, whichever step failed.
        with self.lock:
            try:
                self.drop_sources()
            finally:
                try:
                    self.drop_device_copies()
                finally:
                    self.return_buffer()


# Where each tensor of a group starts in its host buffer: a multiple of 16 bytes, so
# that the views the copy back makes of one device buffer are aligned for any dtype and
# for the kernels' 16-byte vector accesses.
_PART_ALIGNMENT = 16


class _Part:
    """Where one (dense) tensor of an offloaded group lies in the buffer, and what it
    was: its elements lie there in their memory order, so the part viewed with the
    tensor's strides is a copy of it in its layout (NOTE [ Kept layouts ])."""

    __slots__ = ("offset", "nbytes", "dtype", "shape", "strides")

    def __init__(self, offset: int, tensor: torch.Tensor):
        self.offset, self.nbytes = offset, tensor.numel() * tensor.element_size()
        self.dtype, self.shape = tensor.dtype, tensor.shape
        self.strides = kept_strides(tensor)  # None: contiguous ones

    def view(self, buffer: torch.Tensor) -> torch.Tensor:
        """This part of ``buffer`` (flat uint8), as the tensor it holds (a byte vector,
        such as packed decisions, needs no view beyond the slice)."""
        part = buffer[self.offset: self.offset + self.nbytes]
        if self.dtype != torch.uint8:
            part = part.view(self.dtype)
        if self.strides is not None:
            return part.as_strided(self.shape, self.strides)
        return part if part.shape == self.shape else viewed(part, self.shape)


def _dense(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` itself where it is dense, else a dense copy with its dimensions in
    the same order (NOTE [ Kept layouts ])."""
    return tensor if is_dense(tensor) else tensor.clone()


class OffloadedTensors:
    """Tensors of one device kept together in one host buffer until fetched back.

    Construction starts copying each tensor (detached) into its part of a buffer lent
    by ``pool`` (default: :func:`host_pool_for` their device), through ``engine``
    (default: :func:`copy_engine_for` their device) as one job: one buffer, one wait
    and one event for the group, however many tensors it holds (a kept input's codes,
    scales and channel means; a segment's decisions). They come back in one copy, as
    views of one device buffer. Any dtypes; the bytes come back unchanged. The buffer
    goes back to the pool on :meth:`release`, or when the object is garbage collected.

    Each comes back in its memory layout (NOTE [ Kept layouts ] in actsave/layouts.py):
    a dense tensor (contiguous, channels_last, channels_last_3d, any permutation of its
    dimensions) with exactly its strides, its elements copied in their memory order
    with no copy beyond the offload's own; any other (a strided slice, an expanded
    tensor) is first copied into the layout ``torch.empty_like`` gives it (dense, its
    dimensions in the same order) and comes back in that one.
    """

    def __init__(self, tensors: list, pool: Optional[HostPool] = None, engine: Optional[CopyEngine] = None):
        sources = [_dense(tensor.detach() if tensor.requires_grad else tensor) for tensor in tensors]
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
        with outside_transforms():  # the saves of a forward under jvp or vmap come unwrapped
            self._held = _Holdings(pool, engine, pool.acquire(self._span))
            self._finalizer = weakref.finalize(self, self._held.release)
            # At interpreter exit the process frees everything, and CUDA may be gone already.
            self._finalizer.atexit = False
            # Made once: the copy back of a single tensor reads the same view.
            self._held.host_views = [part.view(self._held.buffer) for part in self._parts]
            try:
                self._held.copied_out = engine.to_host_all(list(zip(sources, self._held.host_views)))
            except BaseException:  # a KeyboardInterrupt too: the copies queued before it may still write
                self._buffer_back_once_copied(engine)
                raise
        # Held until free_source(): the copy may still be reading them (NOTE rule 2).
        self._held.sources = sources

    def _buffer_back_once_copied(self, engine: CopyEngine) -> None:
        """Release after a job that failed half queued: the buffer goes back to the pool
        once the engine's copies have finished, or never where waiting fails too."""
        try:
            engine.synchronize()
        except BaseException:
            self._held.buffer = None  # lent again, it could be written by a copy still running
        self.release()

    @property
    def released(self) -> bool:
        """Whether :meth:`release` has run (or the object was collected)."""
        return not self._finalizer.alive

    def free_source(self) -> None:
        """Let the device memory of the offloaded tensors be reused, in stream order.
        ``PrefetchTape.segment_starts`` calls it when the next segment starts."""
        with self._held.lock:
            self._held.drop_sources()

    def prefetch(self) -> None:
        """Start the copy back to the device, unless it started or :meth:`release` ran."""
        held = self._held
        with held.lock:
            if not self.released and held.device_copies is None:
                self._copy_back(held)

    def _copy_back(self, held: _Holdings) -> None:
        held.drop_sources()  # the backward has begun: the forward's tensors are not needed
        with outside_transforms():
            if len(self._parts) == 1:  # a tensor of its own dtype, not a view of bytes
                copy, held.copied_in = held.engine.to_device(held.host_views[0])
                held.device_copies = [copy]
            else:
                copied, held.copied_in = held.engine.to_device(held.buffer[: self._span])
                held.device_copies = [part.view(copied) for part in self._parts]

    def fetch(self) -> list:
        """The tensors on their device, in order, ready for the current stream to use.
        Prefetches if needed; the host buffer then goes back to the pool (reused once
        the copy has finished). Calling it again returns the same tensors until
        :meth:`release`."""
        held = self._held
        with held.lock:
            if self.released:
                raise ActsaveError(
                    "this offloaded tensor was released already, so it cannot be fetched; "
                    "fetch it before releasing it"
                )
            self.prefetch()
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
