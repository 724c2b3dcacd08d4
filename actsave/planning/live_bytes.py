"""Counting the bytes a stretch of work allocates on a device: :class:`LiveBytes`, a
dispatch mode that adds up every tensor storage created inside it while it is alive,
and the peak; :func:`allocation_bytes`, what one storage occupies on a device.
:func:`~actsave.estimate` counts a step on meta tensors with it; :func:`~actsave.profile`
counts its measured step and codec samples, and the block planner (blocks.py) its
example step.
"""
from __future__ import annotations

import contextlib
import threading
import weakref

import torch

from .._torch import TorchDispatchMode, pytree, sparse_components, storage_identity, storage_resizes_observed
from ..devices import allocation_granule, host_is_separate
from ..meta import OUTPUT_METADATA
from ..offload import is_host_memory


# NOTE [ Sparse tensors' storages ]
# A sparse tensor (nn.Embedding(sparse=True)'s gradient) has no storage of its own:
# its memory is that of its component tensors (COO: indices and values; compressed
# layouts: the compressed and plain indices and the values), each a dense tensor on a
# storage of its own, which may be another tensor's (the indices of an embedding's
# sparse gradient view its input). A sparse tensor is counted by those storages, each
# once, as a device allocates them.


def storages_of(t: torch.Tensor) -> tuple:
    """The storages holding ``t``'s memory: its own, or a sparse tensor's components'
    (NOTE [ Sparse tensors' storages ])."""
    components = sparse_components(t)
    if components is None:
        return (t.untyped_storage(),)
    return tuple(component.untyped_storage() for component in components)


def allocation_bytes(nbytes: int, device) -> int:
    """Bytes a storage of ``nbytes`` occupies on ``device``: rounded up to its
    allocator's granule (devices.allocation_granule)."""
    granule = allocation_granule(device)
    return -(-nbytes // granule) * granule


# NOTE [ What a step's loss holds ]
# ``loss = criterion(out); loss.backward()`` holds the loss through the backward (the
# caller's name for it), and ``backward()`` its gradient of 1, made before the engine
# starts and dropped when it returns: live at every backward event beside the output
# (layer_events.py's held_in_backward). Each has one element, but the loss holds its
# storage, which may be larger: on a CPU ``mse_loss`` and ``smooth_l1_loss`` return a
# view of their elementwise buffer, as large as the output. A loss that views the
# output itself (``out[0, 0]``) holds nothing the output does not. The loss's own rise,
# up to the output's gradient, is Profile.loss_rise.
def loss_held_bytes(loss: torch.Tensor, output: torch.Tensor, device) -> int:
    """What a step's loss holds through the backward beside ``output`` (NOTE [ What a
    step's loss holds ]): its storage, unless the output's, and its gradient of 1."""
    storage = 0 if storage_identity(loss) == storage_identity(output) else \
        allocation_bytes(loss.untyped_storage().nbytes(), device)
    return storage + allocation_bytes(loss.element_size(), device)


class LiveBytes(TorchDispatchMode):
    """Counts the bytes of tensor storages that operations create inside the context
    and that are still alive, and the peak of that count.

    A storage is counted once, from the first operation that returns it until it is
    freed. Storages that existed before (``known``: parameters, gradients, buffers,
    inputs) are never counted, even when an in-place operation returns them. The host
    buffers of offload (offload.is_host_memory) are device memory where the host's
    memory is not separate (devices.host_is_separate: the CPU, and meta tensors that
    stand for no device), counted from the first operation that touches them, as
    MemTracker counts them; on CUDA they are not device memory. A counted storage
    resized in place (``storage.resize_``, as FSDP2 frees and refills its gathered
    parameters) is counted at its new size from then on (NOTE [ Storage resizes ]).
    A sparse tensor is counted by its components' storages (NOTE [ Sparse tensors'
    storages ]). ``device`` sets the allocation rounding (:func:`allocation_bytes`).
    :meth:`span` measures the peak of one stretch of work.
    """

    def __init__(self, device="cpu", known=()):
        super().__init__()
        self.device = torch.device(device)
        self.live = 0
        self.peak = 0
        self._marks = []  # one-item lists: the highest count since each was set (mark)
        self._lock = threading.Lock()  # storages may die on autograd's worker threads
        # storage -> [the bytes it is counted at], or None where it is not counted
        self._seen = weakref.WeakKeyDictionary()
        self._resizes = contextlib.ExitStack()
        self._before_next = []  # callbacks for the next operator (before_next_op)
        for t in pytree.tree_leaves(known):
            if isinstance(t, torch.Tensor):
                for storage in storages_of(t):
                    self._seen[storage] = None

    def __enter__(self):
        self._resizes.enter_context(storage_resizes_observed(self._resized))
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._resizes.close()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self._before_next:
            callbacks, self._before_next = self._before_next, []
            for callback in callbacks:
                callback()
        out = OUTPUT_METADATA.call(func, args, kwargs or {})  # fast on meta tensors: meta.py
        self._track_all(out)
        return out

    def before_next_op(self, callback) -> None:
        """Calls ``callback()`` as the next operator is dispatched, before it runs: the
        count it reads then leaves out what the code between dropped (a module's
        forward hook runs while its arguments are still held, which its caller may drop
        as the module returns)."""
        self._before_next.append(callback)

    def _track_all(self, out) -> None:
        if isinstance(out, torch.Tensor):
            self._track(out)
        elif isinstance(out, (tuple, list)):  # operator outputs nest no deeper
            for item in out:
                self._track_all(item)

    def _track(self, t: torch.Tensor) -> None:
        for storage in storages_of(t):
            self._track_storage(storage)

    def _track_storage(self, storage) -> None:
        if storage in self._seen:
            return
        if host_is_separate(self.device) and is_host_memory(storage):  # an offload buffer, off the device
            self._seen[storage] = None
            return
        counted = self._seen[storage] = [allocation_bytes(storage.nbytes(), self.device)]
        weakref.finalize(storage, self._uncount, counted)
        self._add(counted[0])

    def _uncount(self, counted: list) -> None:
        self._add(-counted[0])
        counted[0] = 0  # gone from the count: counted_bytes reads it so

    def counted_bytes(self, storage) -> list:
        """A one-item list holding the bytes ``storage`` is counted at, 0 once it is
        gone from the count (or where it is not counted)."""
        counted = self._seen.get(storage)
        return counted if counted is not None else [0]

    def live_counts(self) -> list:
        """The one-item lists of :meth:`counted_bytes` of every storage counted now."""
        with self._lock:
            return [counted for counted in list(self._seen.values()) if counted is not None and counted[0] > 0]

    def _resized(self, storage, before: int, after: int) -> None:
        counted = self._seen.get(storage)
        if counted is not None:
            now = allocation_bytes(after, self.device)
            delta, counted[0] = now - counted[0], now
            self._add(delta)

    def _add(self, nbytes: int) -> None:
        with self._lock:
            self.live += nbytes
            self.peak = max(self.peak, self.live)
            for mark in self._marks:
                mark[0] = max(mark[0], self.live)

    def mark(self, less: int = 0) -> list:
        """A one-item list that holds the highest count from now (less ``less``
        bytes about to go) until :meth:`unmark`: a stretch's peak where stretches need
        not nest, as :meth:`span`'s do."""
        with self._lock:
            mark = [self.live - less]
            self._marks.append(mark)
        return mark

    def unmark(self, mark: list) -> None:
        with self._lock:
            self._marks.remove(mark)

    @contextlib.contextmanager
    def span(self):
        """Yields a one-item list that holds, on exit, how far the count rose above its
        value at entry (the peak inside, minus the bytes live at entry)."""
        with self._lock:
            start, outer_peak = self.live, self.peak
            self.peak = self.live
        rise = [0]
        try:
            yield rise
        finally:
            with self._lock:
                rise[0] = self.peak - start
                self.peak = max(self.peak, outer_peak)
