"""Offloaded tensors, alone and in groups: bit-exact round trips, layouts, buffers
returned in stream order."""
import gc
import threading

import pytest
import torch

from actsave import ActsaveError, ConfigError
from actsave.offload import (
    HostCopyEngine,
    HostPool,
    OffloadedTensor,
    OffloadedTensors,
    copy_engine_for,
    host_pool,
    host_pool_for,
    is_host_memory,
)

from support import DENSE_LAYOUTS, NOT_DENSE, random_bits, same_bits
from offload.helpers import DTYPES, KiB, RecordingEngine


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(7, 33), (), (0, 3)], ids=["matrix", "scalar", "empty"])
def test_round_trip_is_bit_exact(dtype, shape):
    pool = HostPool()
    x = random_bits(shape, dtype)
    item = OffloadedTensor(x, pool=pool)
    assert item.nbytes == x.numel() * dtype.itemsize
    assert same_bits(item.fetch(), x)


@pytest.mark.parametrize("layout", [*DENSE_LAYOUTS, "transposed"])
def test_a_dense_input_comes_back_with_its_strides_copied_as_it_lies(layout):
    # NOTE [ Kept layouts ]: a recompute's convolution runs in its forward's layout.
    x = DENSE_LAYOUTS[layout]() if layout != "transposed" else torch.randn(6, 9).t()
    engine = RecordingEngine([])
    fetched = OffloadedTensor(x, pool=HostPool(), engine=engine).fetch()
    assert engine.sources[0]() is x  # no copy before the offload's own
    assert fetched.stride() == x.stride() and same_bits(fetched, x)


@pytest.mark.parametrize("layout", DENSE_LAYOUTS)
def test_tensors_of_a_group_come_back_with_their_strides(layout):
    parts = [torch.randn(5), DENSE_LAYOUTS[layout](), torch.arange(7, dtype=torch.int8)]
    back = OffloadedTensors(parts, pool=HostPool()).fetch()
    assert [b.stride() for b in back] == [p.stride() for p in parts]
    assert all(same_bits(b, p) for b, p in zip(back, parts))


@pytest.mark.parametrize("view", NOT_DENSE)
def test_a_tensor_that_is_not_dense_comes_back_as_empty_like_lays_it_out(view):
    x = NOT_DENSE[view]()
    fetched = OffloadedTensor(x, pool=HostPool()).fetch()
    assert fetched.stride() == torch.empty_like(x).stride() and same_bits(fetched, x)


def test_offload_is_a_copy():
    pool = HostPool()
    x = torch.randn(64, requires_grad=True) * 1
    expected = x.detach().clone()
    item = OffloadedTensor(x, pool=pool)
    x.detach().zero_()
    fetched = item.fetch()
    assert not fetched.requires_grad and torch.equal(fetched, expected)
    pool.acquire(x.nbytes).fill_(0)  # the buffer the tensor came back from, reused
    assert torch.equal(fetched, expected)


def test_fetch_returns_the_buffer_and_the_same_tensor_until_release():
    pool = HostPool()
    item = OffloadedTensor(torch.randn(1000), pool=pool)
    assert pool.in_use_bytes == 4 * KiB
    fetched = item.fetch()
    assert pool.in_use_bytes == 0
    assert item.fetch() is fetched
    item.release()
    with pytest.raises(ActsaveError, match="released already"):
        item.fetch()


def test_release_returns_the_buffer_and_is_idempotent():
    pool = HostPool()
    items = [OffloadedTensor(torch.randn(100 * k), pool=pool) for k in range(1, 4)]
    items[0].prefetch()
    for item in items:
        item.release()
        item.release()
        item.prefetch()  # a no-op once released
        assert item.released
    assert pool.in_use_bytes == 0


def test_dropped_offloaded_tensors_return_their_buffers():
    pool = HostPool()
    items = [OffloadedTensor(torch.randn(3000), pool=pool) for _ in range(3)]
    items[1].prefetch()
    items.append(items)  # a reference cycle: only the cycle collector frees these
    del items
    gc.collect()
    assert pool.in_use_bytes == 0


def test_the_source_is_held_until_freed_and_freed_in_stream_order():
    log = []
    engine = RecordingEngine(log)
    x = torch.full((10,), 3.0)
    item = OffloadedTensor(x, pool=HostPool(), engine=engine)
    del x
    [source] = engine.sources
    assert source() is not None  # the copy may still be reading it
    item.free_source()
    assert source() is None
    assert log == [("to_host", 3), ("free_after", 3)]


def test_the_buffer_goes_back_after_the_copy_that_read_it_last():
    pool, engine = HostPool(), RecordingEngine([])
    item = OffloadedTensor(torch.full((10,), 5.0), pool=pool, engine=engine)
    item.prefetch()
    copy_back = engine.events[-1]
    copy_back.done = False  # still running
    item.fetch()
    assert pool.in_use_bytes == 4 * KiB
    copy_back.done = True
    assert pool.in_use_bytes == 0


def test_only_cpu_cuda_and_meta_tensors_can_be_offloaded():
    with pytest.raises(ConfigError, match="offload supports cpu, cuda and meta tensors, not mps"):
        copy_engine_for("mps")
    assert isinstance(copy_engine_for("cpu"), HostCopyEngine)


def test_meta_tensors_are_offloaded_into_meta_buffers():
    # What actsave.estimate simulates: the schedule runs, a fetch allocates on the device.
    x = torch.empty(3, 1000, dtype=torch.bfloat16, device="meta")
    real_pool_bytes = host_pool().reserved_bytes
    offloaded = OffloadedTensor(x)
    assert offloaded._held.buffer.device.type == "meta"
    assert is_host_memory(offloaded._held.buffer.untyped_storage())
    back = offloaded.fetch()
    assert (back.device.type, back.shape, back.dtype) == ("meta", x.shape, x.dtype)
    assert not is_host_memory(back.untyped_storage())
    offloaded.release()
    assert host_pool_for("meta").in_use_bytes == 0 and host_pool().reserved_bytes == real_pool_bytes


class _HeldCopyBack(HostCopyEngine):
    """Holds the first copy back until ``proceed`` is set, having set ``entered``."""

    def __init__(self):
        self.entered, self.proceed = threading.Event(), threading.Event()
        self.copies_back = 0

    def to_device(self, host):
        self.copies_back += 1
        self.entered.set()
        self.proceed.wait(timeout=5)
        return super().to_device(host)


@pytest.mark.parametrize("second", ["prefetch", "release"])
def test_a_second_thread_waits_for_a_copy_back_in_progress(second):
    # Autograd's device threads share a tape: one's lookahead may prefetch what another
    # prefetches or releases. Two copies back of one item, or a release between a copy
    # back's start and its end, would free device memory under a copy.
    engine = _HeldCopyBack()
    offloaded = OffloadedTensors([torch.arange(64.0)], pool=HostPool(), engine=engine)
    first = threading.Thread(target=offloaded.prefetch)
    first.start()
    assert engine.entered.wait(timeout=5)
    other = threading.Thread(target=getattr(offloaded, second))
    other.start()
    other.join(timeout=0.2)
    assert other.is_alive()  # waiting for the copy back, not beside it
    engine.proceed.set()
    first.join(), other.join()
    assert engine.copies_back == 1
    if second == "prefetch":
        assert torch.equal(offloaded.fetch()[0], torch.arange(64.0))
    else:
        assert offloaded.released and offloaded._held.device_copies is None


class _FailsHalfQueued(HostCopyEngine):
    """Queues the first copy of a job, then fails; logs its waits."""

    def __init__(self, log, wait_fails=False):
        self.log, self.wait_fails = log, wait_fails

    def to_host_all(self, pairs):
        self.to_host(*pairs[0])
        raise KeyboardInterrupt

    def synchronize(self):
        self.log.append("synchronize")
        if self.wait_fails:
            raise RuntimeError("the device is gone")


class _LoggedPool(HostPool):
    def __init__(self, log):
        super().__init__()
        self.log = log

    def release(self, buffer, after=None):
        self.log.append("buffer back")
        super().release(buffer, after)


@pytest.mark.parametrize("wait_fails", [False, True])
def test_a_job_that_fails_half_queued_gives_its_buffer_back_only_once_its_copies_finished(wait_fails):
    # An interrupt (a notebook's) between two copies of one job leaves no event for the
    # first: lent again at once, the buffer could be written under the next owner.
    log = []
    pool = _LoggedPool(log)
    with pytest.raises(KeyboardInterrupt):
        OffloadedTensors([torch.ones(8), torch.ones(8)], pool=pool, engine=_FailsHalfQueued(log, wait_fails))
    assert log == (["synchronize"] if wait_fails else ["synchronize", "buffer back"])


class _FreeAfterInterrupted(HostCopyEngine):
    """Copies synchronously; its first ``free_after`` is interrupted."""

    def __init__(self):
        self.interrupted = False

    def free_after(self, event):
        if not self.interrupted:
            self.interrupted = True
            raise KeyboardInterrupt


def test_a_release_interrupted_in_free_after_still_gives_its_buffer_back():
    # The finalizer that releases runs once: a buffer it did not give back stayed lent
    # for good, one per interrupt, whatever later steps did.
    pool = HostPool()
    offloaded = OffloadedTensors([torch.ones(8), torch.ones(8)], pool=pool, engine=_FreeAfterInterrupted())
    with pytest.raises(KeyboardInterrupt):
        offloaded.release()
    assert offloaded.released and pool.in_use_bytes == 0
