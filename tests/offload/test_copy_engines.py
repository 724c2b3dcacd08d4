"""CUDA copy streams and pinned buffers (the tests marked ``cuda``)."""
import pytest
import torch

from actsave.offload import (
    CudaCopyEngine,
    HostPool,
    OffloadedTensor,
    PrefetchTape,
    copy_engine_for,
)

from support import random_bits, same_bits
from offload.helpers import DTYPES


# Long enough (about 0.1 s) for the test to look at the streams while the copy waits.
SLEEP_CYCLES = 200_000_000


def sleeping_engine():
    """A fresh engine whose copy stream is busy for a while before any copy starts."""
    engine = CudaCopyEngine("cuda")
    with torch.cuda.stream(engine.copy_stream):
        torch.cuda._sleep(SLEEP_CYCLES)
    return engine


def warm_pool(nbytes):
    """A pinned pool holding a buffer of nbytes' class, so no allocation interferes."""
    pool = HostPool()
    pool.release(pool.acquire(nbytes))
    return pool


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cuda_round_trip_is_bit_exact(dtype):
    x = random_bits((257, 129), dtype).cuda()
    item = OffloadedTensor(x)
    assert isinstance(copy_engine_for(x.device), CudaCopyEngine)
    fetched = item.fetch()
    assert fetched.device == x.device and same_bits(fetched, x)
    item.release()


@pytest.mark.cuda
def test_cuda_compute_stream_does_not_wait_for_the_copy_until_fetch():
    x = torch.randn(1 << 20, device="cuda")
    pool = warm_pool(x.nbytes)
    torch.cuda.synchronize()
    engine = sleeping_engine()
    item = OffloadedTensor(x, pool=pool, engine=engine)
    compute_done = torch.cuda.Event()
    compute_done.record()
    compute_done.synchronize()
    assert not engine.copy_stream.query()  # the compute stream ran on while the copy waits
    fetched = item.fetch()
    torch.cuda.current_stream().synchronize()
    assert torch.equal(fetched, x)


@pytest.mark.cuda
def test_cuda_source_memory_is_not_reused_while_the_copy_reads_it():
    numel = 16 << 20
    x = torch.full((numel,), 7.0, device="cuda")
    pool = warm_pool(x.nbytes)
    torch.cuda.synchronize()
    item = OffloadedTensor(x, pool=pool, engine=sleeping_engine())
    del x
    for _ in range(4):  # would land on x's block, if it were free, before the copy reads it
        torch.full((numel,), -1.0, device="cuda")
    item.free_source()
    for _ in range(4):  # may land there now, queued behind the copy
        torch.full((numel,), -2.0, device="cuda")
    assert torch.equal(item.fetch(), torch.full((numel,), 7.0, device="cuda"))


@pytest.mark.cuda
def test_cuda_pinned_buffers_are_reused_after_warm_up():
    pool = HostPool()
    tape = PrefetchTape()

    def training_step():
        items = []
        inputs = [torch.full((1000 * (k + 1),), float(k), device="cuda") for k in range(4)]
        for x in inputs:
            items.append(OffloadedTensor(x, pool=pool))
            tape.register(items[-1])
        for k in reversed(range(4)):
            tape.before_use(items[k])
            assert torch.equal(items[k].fetch(), inputs[k])
            items[k].release()
        torch.cuda.synchronize()

    training_step()
    allocations = pool.allocations
    for _ in range(5):
        training_step()
    assert pool.allocations == allocations
    assert pool.in_use_bytes == 0
    assert pool.acquire(1).is_pinned()
