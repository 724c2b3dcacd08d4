"""Host offload: the pinned pool, the copy engines, offloaded tensors and the prefetch
schedule. Everything but the tests marked ``cuda`` runs on the CPU."""
import gc
import random
import threading
import weakref

import pytest
import torch

from actsave import ActsaveError, ConfigError
from actsave.offload import (
    CudaCopyEngine,
    HostCopyEngine,
    HostPool,
    OffloadedTensor,
    OffloadedTensors,
    OffloadPoolExhausted,
    PrefetchTape,
    copy_engine_for,
    current_tape,
    host_pool,
    host_pool_for,
    is_host_memory,
    prefetch_depth,
    set_host_pool_capacity,
    set_prefetch_depth,
)

from support import DENSE_LAYOUTS, NOT_DENSE

KiB = 1024


class FakeEvent:
    """A copy's event whose completion the test decides."""

    def __init__(self, done=False):
        self.done = done

    def query(self):
        return self.done

    def synchronize(self):
        self.done = True


class RecordingEngine(HostCopyEngine):
    """Copies synchronously, logs what was asked, and keeps the sources it read and the
    events it handed out (which the test may mark unfinished). An offloaded tensor is
    named by its first element."""

    def __init__(self, log):
        self.log = log
        self.sources = []  # weak references
        self.events = []

    def to_host(self, source, host):
        super().to_host(source, host)
        self.sources.append(weakref.ref(source))
        return self._logged("to_host", host)

    def to_device(self, host):
        tensor, _ = super().to_device(host)
        return tensor, self._logged("to_device", host)

    def wait(self, event):
        self.log.append(("wait", event.name))

    def free_after(self, event):
        self.log.append(("free_after", event.name))

    def _logged(self, what, host):
        event = FakeEvent(done=True)
        event.name = int(host.flatten()[0])
        self.log.append((what, event.name))
        self.events.append(event)
        return event


# --------------------------------------------------------------------------- pool


@pytest.mark.parametrize("nbytes, size", [
    (0, 4 * KiB), (1, 4 * KiB), (4 * KiB, 4 * KiB), (4 * KiB + 1, 8 * KiB), (3 << 20, 4 << 20),
])
def test_size_classes_are_powers_of_two_of_at_least_a_page(nbytes, size):
    assert HostPool.size_class(nbytes) == size


def test_released_buffer_is_lent_again_for_the_same_size_class():
    pool = HostPool()
    first = pool.acquire(5000)
    assert first.dtype == torch.uint8 and first.numel() == 8 * KiB
    pool.release(first)
    again = pool.acquire(7000)
    assert again.data_ptr() == first.data_ptr()
    assert pool.allocations == 1 and pool.reserved_bytes == 8 * KiB


def test_steady_state_allocates_nothing_new():
    pool = HostPool()
    rng = random.Random(0)
    classes = [(4 * KiB + 1, 8 * KiB), (8 * KiB + 1, 16 * KiB), (64 * KiB + 1, 128 * KiB)]

    def one_step():
        buffers = [pool.acquire(rng.randint(*bounds)) for bounds in classes for _ in range(2)]
        for buffer in buffers:
            pool.release(buffer)

    one_step()  # warm-up
    allocations, reserved = pool.allocations, pool.reserved_bytes
    for _ in range(1000):
        one_step()
    assert (pool.allocations, pool.reserved_bytes) == (allocations, reserved)
    assert (allocations, reserved) == (6, 2 * (8 + 16 + 128) * KiB)
    assert pool.in_use_bytes == 0


def test_exhaustion_says_what_was_asked_what_is_held_and_what_to_do():
    pool = HostPool(capacity_bytes=12 * KiB)
    held = pool.acquire(8 * KiB)
    with pytest.raises(OffloadPoolExhausted) as error:
        pool.acquire(5000)
    message = str(error.value)
    facts = ("5,000 bytes", "8,192-byte buffer", "reserves 8,192", "12,288-byte capacity",
             "8,192 bytes of them in use", "set_host_pool_capacity", "offload fewer layers")
    for fact in facts:
        assert fact in message
    assert isinstance(error.value, ActsaveError)
    pool.release(held)
    assert pool.acquire(5000).data_ptr() == held.data_ptr()  # its own class still fits


def test_buffer_is_not_lent_again_before_its_last_copy_finishes():
    pool = HostPool()
    buffer = pool.acquire(4 * KiB)
    copy = FakeEvent(done=False)
    pool.release(buffer, after=copy)
    assert pool.in_use_bytes == 4 * KiB
    assert pool.acquire(4 * KiB).data_ptr() != buffer.data_ptr()
    copy.done = True
    assert pool.acquire(4 * KiB).data_ptr() == buffer.data_ptr()


def test_at_capacity_the_pool_waits_for_copies_instead_of_failing():
    pool = HostPool(capacity_bytes=4 * KiB)
    buffer = pool.acquire(4 * KiB)
    copy = FakeEvent(done=False)
    pool.release(buffer, after=copy)
    assert pool.acquire(4 * KiB).data_ptr() == buffer.data_ptr()
    assert copy.done  # synchronized
    assert pool.allocations == 1


def test_a_finalizer_may_return_a_buffer_while_acquire_holds_the_lock():
    # A garbage collection can start at any allocation inside acquire() and run the
    # finalizer of a dropped OffloadedTensor, which releases its buffer.
    pool = HostPool()
    collected = pool.acquire(4 * KiB)
    copy = FakeEvent(done=False)
    copy.query = lambda: pool.release(collected) or True  # runs inside acquire()
    pool.release(pool.acquire(8 * KiB), after=copy)
    thread = threading.Thread(target=pool.acquire, args=(8 * KiB,), daemon=True)
    thread.start()
    thread.join(timeout=10)
    assert not thread.is_alive(), "acquire() deadlocked on a release from inside it"
    assert pool.in_use_bytes == 8 * KiB and pool.acquire(4 * KiB).data_ptr() == collected.data_ptr()


def test_releasing_a_buffer_twice_or_to_another_pool_is_an_error():
    pool, other = HostPool(), HostPool()
    buffer = pool.acquire(10)
    with pytest.raises(ActsaveError, match="not on loan from this host pool"):
        other.release(buffer)
    pool.release(buffer)
    with pytest.raises(ActsaveError, match="released already"):
        pool.release(buffer)


def test_threads_share_a_pool():
    pool = HostPool()
    errors = []

    def borrow(seed):
        rng = random.Random(seed)
        try:
            for _ in range(200):
                buffers = [pool.acquire(rng.choice([100, 5000, 20000])) for _ in range(3)]
                for buffer in buffers:
                    buffer.fill_(seed)  # a buffer lent twice at once would be caught below
                assert all(bool((buffer == seed).all()) for buffer in buffers)
                for buffer in buffers:
                    pool.release(buffer)
        except BaseException as error:  # noqa: BLE001 - reported by the main thread
            errors.append(error)

    threads = [threading.Thread(target=borrow, args=(seed,)) for seed in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert pool.in_use_bytes == 0
    assert pool.allocations <= 3 * 4 * 3  # classes x threads x buffers a thread holds


@pytest.mark.parametrize("capacity", [-1, 1.5, "1GiB", True])
def test_capacity_must_be_none_or_bytes(capacity):
    with pytest.raises(ConfigError, match="must be None .no limit. or a number of bytes"):
        HostPool(capacity_bytes=capacity)


def test_set_host_pool_capacity_sets_the_default_pool_and_restores_in_a_with():
    before = host_pool().capacity_bytes
    with set_host_pool_capacity(1 << 20):
        assert host_pool().capacity_bytes == 1 << 20
    assert host_pool().capacity_bytes == before
    with pytest.raises(ConfigError):
        set_host_pool_capacity(-5)
    assert host_pool().capacity_bytes == before


# ---------------------------------------------------------------- offloaded tensor


def random_bits(shape, dtype):
    """Every bit pattern is fair game, NaN payloads and negative zeros included."""
    numel = torch.Size(shape).numel()
    raw = torch.randint(0, 256, (numel * dtype.itemsize,), dtype=torch.uint8)
    return raw.view(dtype).view(shape)


def same_bits(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8)
    )


DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int8, torch.uint8, torch.float8_e4m3fn]


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


# ---------------------------------------------------------------- prefetch tape


class Item:
    """A tape item that logs what the tape asks of it."""

    def __init__(self, name, log):
        self.name, self.log = name, log
        self.released = False

    def prefetch(self):
        self.log.append(("prefetch", self.name))

    def free_source(self):
        self.log.append(("free_source", self.name))

    def fetch(self):
        self.log.append(("fetch", self.name))


def backward(tape, items):
    """What the backward does: items in reverse forward order, each announced first."""
    for item in reversed(items):
        tape.before_use(item)
        item.fetch()


def recorded_forward(tape, count=5):
    log = []
    items = [Item(k, log) for k in range(count)]
    for item in items:
        tape.register(item)
    log.clear()
    return items, log


@pytest.mark.parametrize("depth", [0, 1, 2])
def test_items_ahead_are_prefetched_before_the_current_one_is_fetched(depth):
    tape = PrefetchTape(depth=depth)
    items, log = recorded_forward(tape)
    backward(tape, items)
    for k in range(5):
        fetched_at = log.index(("fetch", k))
        prefetched = {name for what, name in log[:fetched_at] if what == "prefetch"}
        assert prefetched == set(range(max(0, k - depth), 5))


def test_the_needed_item_is_asked_for_before_the_ones_ahead():
    tape = PrefetchTape(depth=2)
    items, log = recorded_forward(tape)
    tape.before_use(items[4])
    assert log == [("prefetch", 4), ("prefetch", 3), ("prefetch", 2)]


def test_register_frees_the_source_of_the_previous_item():
    log = []
    tape = PrefetchTape()
    items = [Item(k, log) for k in range(3)]
    for item in items:
        tape.register(item)
    assert log == [("free_source", 0), ("free_source", 1)]


def test_a_segment_may_start_unless_its_caller_said_so():
    # A kept-saves call marks its start unless its caller just did: twice would free at
    # once what the first start deferred (free_later), its copy covered by no compute.
    log = []
    tape = PrefetchTape()
    first, deferred = Item(0, log), Item("deferred", log)
    tape.register(first)
    tape.free_later(deferred)
    tape.segment_may_start()  # after a register: a start
    assert log == [("free_source", "deferred"), ("free_source", 0)]
    tape.free_later(deferred)
    tape.segment_may_start()  # the start was said: nothing more
    tape.segment_starts()
    tape.segment_may_start()
    assert log[2:] == [("free_source", "deferred"), ("free_source", 0)]


def test_collected_and_released_items_are_skipped():
    tape = PrefetchTape(depth=1)
    items, log = recorded_forward(tape)
    items[2].released = True
    dropped = weakref.ref(items[3])
    del items[3]
    gc.collect()
    assert dropped() is None  # the tape held it weakly
    tape.before_use(items[3])  # forward item 4
    assert log == [("prefetch", 4), ("prefetch", 1)]


def test_the_tape_forgets_items_collected_without_a_backward():
    # Forwards whose graphs are dropped (evaluation under grad, an exception) leave
    # dead references behind the newest items, where the scans from the newest end
    # do not reach: register forgets them once the references double.
    tape, log = PrefetchTape(depth=1), []
    for k in range(1000):
        tape.register(Item(k, log))  # collected at once
    assert len(tape._refs) <= 128
    items, log = recorded_forward(tape)
    backward(tape, items)
    assert [name for what, name in log if what == "fetch"] == [4, 3, 2, 1, 0]


def test_an_item_not_on_the_tape_is_prefetched_alone():
    tape = PrefetchTape(depth=2)
    items, log = recorded_forward(tape)
    stranger = Item("stranger", log)
    tape.before_use(stranger)
    assert log == [("prefetch", "stranger")]


def test_offloaded_tensors_come_back_in_backward_order():
    log = []
    pool, engine, tape = HostPool(), RecordingEngine(log), PrefetchTape(depth=1)
    items = []
    for k in range(4):
        items.append(OffloadedTensor(torch.full((8,), float(k)), pool=pool, engine=engine))
        tape.register(items[-1])
    log.clear()
    for k in reversed(range(4)):
        tape.before_use(items[k])
        assert torch.equal(items[k].fetch(), torch.full((8,), float(k)))
        items[k].release()
    copies_back = [name for what, name in log if what == "to_device"]
    assert copies_back == [3, 2, 1, 0]
    for k in reversed(range(4)):  # each is waited for before its fetch returns
        assert log.index(("to_device", k)) < log.index(("wait", k))
    assert log.index(("to_device", 2)) < log.index(("wait", 3))  # prefetched ahead
    assert pool.in_use_bytes == 0


def test_an_exception_mid_backward_leaves_nothing_held():
    pool, tape = HostPool(), PrefetchTape(depth=2)
    items = []
    for k in range(5):
        items.append(OffloadedTensor(torch.full((2000,), float(k)), pool=pool))
        tape.register(items[-1])
    with pytest.raises(RuntimeError, match="boom"):
        for k in reversed(range(5)):
            tape.before_use(items[k])
            items[k].fetch()
            if k == 2:
                raise RuntimeError("boom")
            items[k].release()
    alive = [weakref.ref(item) for item in items]
    del items
    gc.collect()
    assert all(ref() is None for ref in alive)
    assert pool.in_use_bytes == 0


def test_backward_on_another_thread_uses_the_forward_tape():
    tape = current_tape()
    items, log = recorded_forward(tape, count=3)
    seen = {}

    def backward_thread():
        seen["tape"] = current_tape()
        backward(tape, items)

    thread = threading.Thread(target=backward_thread)
    thread.start()
    thread.join()
    assert current_tape() is tape and seen["tape"] is not tape
    assert ("prefetch", 1) in log[: log.index(("fetch", 2))]


def test_set_prefetch_depth_applies_to_tapes_without_their_own():
    tape, own = PrefetchTape(), PrefetchTape(depth=3)
    with set_prefetch_depth(2):
        assert prefetch_depth() == tape.depth == 2 and own.depth == 3
    assert prefetch_depth() == tape.depth == 1


def test_a_prefetch_depth_block_refuses_to_restore_over_another_threads_choice():
    # The depth is the process's: restoring 1 on exit would undo the other thread's 3.
    block = set_prefetch_depth(2)
    thread = threading.Thread(target=lambda: set_prefetch_depth(3))
    thread.start()
    thread.join()
    with pytest.raises(ConfigError, match="another thread set the prefetch depth"):
        with block:
            pass
    assert prefetch_depth() == 3
    set_prefetch_depth(1)


@pytest.mark.parametrize("depth", [-1, 1.5, None, True])
def test_prefetch_depth_must_be_a_non_negative_int(depth):
    with pytest.raises(ConfigError, match=r"prefetch depth .* must be an int >= 0"):
        set_prefetch_depth(depth)
    with pytest.raises(ConfigError, match=r"prefetch depth .* must be an int >= 0"):
        PrefetchTape(depth=-1)
    assert prefetch_depth() == 1


# ---------------------------------------------------------------- CUDA

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


# --- end to end: offloaded checkpoints ------------------------------------------------

import copy  # noqa: E402

import actsave  # noqa: E402
from actsave import CheckpointedSequential  # noqa: E402


def dropout_chain():
    torch.manual_seed(0)
    return torch.nn.Sequential(*[m for _ in range(6) for m in (
        torch.nn.Linear(16, 16), torch.nn.ReLU(inplace=True), torch.nn.Dropout(0.2))])


def step(model, seed=1):
    torch.manual_seed(seed)
    x = torch.randn(8, 16, requires_grad=True)
    out = model(x * 1)
    kept = actsave.stored_bytes()
    out.square().sum().backward()
    return kept, x.grad


def test_offloaded_training_is_bit_identical_and_leaves_nothing():
    plain = dropout_chain()
    model = CheckpointedSequential.from_sequential(copy.deepcopy(plain), segments=6, offload=True)
    _, grad_plain = step(plain)
    kept, grad = step(model)
    assert kept == {"device": 0, "host": 5 * 8 * 16 * 4}  # 5 checkpointed segments of 6
    assert torch.equal(grad, grad_plain)
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(plain.parameters(), model.parameters()))
    assert actsave.stored_bytes() == {"device": 0, "host": 0}
    assert host_pool().in_use_bytes == 0


def test_the_last_offloaded_input_leaves_the_device_when_the_stored_segment_starts():
    # Seen on an H100: nothing registered after the last offloaded segment, so its
    # input stayed on the device until its recompute, one input above the plan.
    model = CheckpointedSequential(*dropout_chain(), segments=6, offload=True)  # 0..12 offloaded, 15.. stored
    inputs = []

    def note_input(_, args):
        inputs.append(weakref.ref(args[0].untyped_storage()))

    model[12].register_forward_pre_hook(note_input)
    out = model(torch.randn(8, 16, requires_grad=True) * 1)
    try:
        assert inputs[0]() is None
    finally:
        out.sum().backward()  # gives the host buffers back, pass or fail


def test_compressed_bytes_are_what_travel():
    model = CheckpointedSequential(*dropout_chain(), segments=6, compress="int8", offload=True)
    kept, _ = step(model)
    # Per segment: int8 codes, one fp32 scale, and the ReLU's decisions (1 bit per element).
    assert kept["host"] == 5 * (8 * 16 + 4 + 8 * 16 // 8)


def test_thousand_steps_keep_the_pool_constant():
    model = CheckpointedSequential(*dropout_chain(), segments=6, compress="int8", offload=True)
    step(model)
    reserved, allocations = host_pool().reserved_bytes, host_pool().allocations
    for seed in range(1000):
        step(model, seed)
    assert (host_pool().reserved_bytes, host_pool().allocations) == (reserved, allocations)
    assert host_pool().in_use_bytes == 0


def test_per_layer_offload():
    model = CheckpointedSequential(*dropout_chain(), segments=[0, 3, 6, 9], offload={3: True})
    model.set_offload(slice(6, 7), True)
    kept, _ = step(model)
    assert kept["host"] == 2 * 8 * 16 * 4
    where = [line.split()[6:8] for line in model.describe().splitlines()[1:] if "input" in line]
    assert where == [["device", str(8 * 16 * 4)], ["host", str(8 * 16 * 4)], ["host", str(8 * 16 * 4)]]


class LayoutNotingConv(torch.nn.Conv2d):
    """A convolution that notes, at each call, whether its input is channels_last."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.channels_last_inputs = []

    def forward(self, x):
        self.channels_last_inputs.append(x.is_contiguous(memory_format=torch.channels_last))
        return super().forward(x)


def channels_last_conv_chain():
    torch.manual_seed(0)
    layers = [m for _ in range(3) for m in (LayoutNotingConv(8, 8, 3, padding=1), torch.nn.BatchNorm2d(8),
                                            torch.nn.ReLU())]
    return torch.nn.Sequential(*layers).to(memory_format=torch.channels_last)


def test_offloaded_channels_last_inputs_are_recomputed_channels_last_with_identical_gradients():
    # NOTE [ Kept layouts ]: a convolution recomputed on a contiguous copy of its
    # channels_last input runs other kernels, and its gradients may differ.
    plain = channels_last_conv_chain()
    model = CheckpointedSequential(*copy.deepcopy(plain), segments=[0, 3, 6], offload=True)
    x = torch.randn(4, 8, 6, 6).to(memory_format=torch.channels_last)
    grads, kept = [], []
    for net in (plain, model):
        leaf = x.clone().requires_grad_(True)
        out = net(leaf * 1)
        kept.append(actsave.stored_bytes())
        out.square().sum().backward()
        grads.append(leaf.grad)
    assert kept[1]["host"] == 2 * 4 * 8 * 6 * 6 * 4  # the inputs of the two checkpointed segments
    # Each checkpointed segment's convolution: its forward, then its recompute.
    assert model[0].channels_last_inputs == model[3].channels_last_inputs == [True, True]
    assert torch.equal(*grads)
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(plain.parameters(), model.parameters()))


class Boom(torch.nn.Module):
    def __init__(self, when):
        super().__init__()
        self.when, self.calls = when, 0

    def forward(self, x):
        self.calls += 1
        if self.calls == self.when:
            raise ValueError("boom")
        return x * 2


@pytest.mark.parametrize("when", [1, 2], ids=["in forward", "in backward"])
def test_an_exception_leaves_no_buffer_claimed(when):
    model = CheckpointedSequential(*dropout_chain()[:6], Boom(when), *dropout_chain()[:6],
                                   segments=[0, 3, 6, 9], offload=True)
    with pytest.raises(ValueError, match="boom"):
        step(model)
    gc.collect()  # the traceback held the partial graph
    assert host_pool().in_use_bytes == 0
    assert actsave.stored_bytes() == {"device": 0, "host": 0}


def test_offloaded_input_modified_in_place_during_forward_is_refused():
    def add_one_(t):
        return t.add_(1).sin()

    with pytest.raises(actsave.RecomputeError, match="modified in place by .*add_one_ during its forward"):
        actsave.checkpoint(add_one_, torch.randn(3, 4, requires_grad=True).tanh(), offload=True)
    assert host_pool().in_use_bytes == 0


def relu_chain():
    torch.manual_seed(0)
    return [m for _ in range(4) for m in (torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16),
                                          torch.nn.ReLU())]


class CountingPool(HostPool):
    """A host pool that counts its loans: one per host enqueue of an offloaded group."""

    def __init__(self):
        super().__init__()
        self.loans = 0

    def acquire(self, nbytes):
        self.loans += 1
        return super().acquire(nbytes)


def test_a_kept_input_and_a_segments_decisions_each_go_to_the_host_as_one_group(monkeypatch):
    # int8 keeps codes and scales; each segment's forward keeps two ReLU decisions.
    pool = CountingPool()
    monkeypatch.setattr(actsave.offload.pool, "_DEFAULT_POOL", pool)
    model = CheckpointedSequential(*relu_chain(), segments=4, compress="int8", offload=True)
    plain = CheckpointedSequential(*relu_chain(), segments=4, compress="int8")
    x = torch.randn(8, 16, requires_grad=True)
    out = model(x * 1)
    assert pool.loans == 2 * 3  # 3 checkpointed segments; the first's input is x * 1
    out.square().sum().backward()
    plain(x * 1).square().sum().backward()
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(plain.parameters(), model.parameters()))
    assert pool.in_use_bytes == 0


def test_offloaded_tensors_come_back_as_views_of_one_copy():
    log = []
    engine, pool = RecordingEngine(log), HostPool()
    parts = [torch.full((5,), 1.0), torch.arange(3, dtype=torch.int8), torch.ones((), dtype=torch.float64)]
    group = OffloadedTensors(parts, pool=pool, engine=engine)
    assert group.nbytes == 5 * 4 + 3 + 8
    back = group.fetch()
    assert [what for what, _ in log] == ["to_host", "to_host", "to_host", "free_after", "to_device", "wait"]
    assert all(b.dtype == p.dtype and torch.equal(b, p) for b, p in zip(back, parts))
    assert len({b.untyped_storage().data_ptr() for b in back}) == 1  # one buffer, aligned parts
    assert all(b.data_ptr() % 16 == 0 for b in back)
    group.release()
    assert pool.in_use_bytes == 0


def test_a_group_is_on_one_device():
    with pytest.raises(ActsaveError, match="one or more tensors, all on one device"):
        OffloadedTensors([])
    with pytest.raises(ActsaveError, match="one or more tensors, all on one device"):
        OffloadedTensors([torch.ones(2), torch.ones(2, device="meta")])


# --- the runtime and the planner on one rule ------------------------------------------

from actsave.devices import host_is_separate  # noqa: E402
from actsave.planning.memory_model import effective_option  # noqa: E402
from actsave.planning.plans import keep_options  # noqa: E402
from actsave.codecs import IDENTITY  # noqa: E402
from actsave.runtime.keep_rules import EXACT, KeepPolicy  # noqa: E402


def wide_relu_chain():
    torch.manual_seed(0)
    return [m for _ in range(6) for m in (torch.nn.Linear(64, 64), torch.nn.ReLU())]


@pytest.mark.parametrize("device", ["cpu", "cuda", "meta"], ids=["cpu", "simulated_gpu", "meta"])  # no GPU needed
def test_runtime_and_planner_agree_on_whether_host_memory_is_separate(device):
    # NOTE [ Separate host memory ]: the runtime offloads on every device and counts it
    # as host memory; those bytes leave the device, for the planner as for a step's
    # simulation (estimate), only where host_is_separate says so.
    separate = host_is_separate(device)
    assert separate == (device == "cuda")  # meta stands for no device: no host apart
    shape = (32, 64)
    exact = actsave.estimate(CheckpointedSequential(*wide_relu_chain(), segments=6), shape, device=device)
    offloaded = actsave.estimate(CheckpointedSequential(*wide_relu_chain(), segments=6, offload=True), shape, device=device)
    assert offloaded.host_peak_bytes >= 4 * 32 * 64 * 4  # four middle segments' inputs, on every device
    assert (offloaded.activation_peak_bytes < exact.activation_peak_bytes) == separate
    assert [option.offload for option in keep_options(("recompute", "offload"), None, device)] == \
        ([False, True] if separate else [False])
    layer = actsave.profile(torch.nn.Sequential(*wide_relu_chain()), torch.randn(shape)).layers[2]
    assert effective_option(KeepPolicy(IDENTITY, True), layer, device).offload == separate


def test_a_cpu_step_offloads_what_the_planner_counts_on_the_device():
    model = CheckpointedSequential(*wide_relu_chain(), segments=6, offload=True)
    x = torch.randn(32, 64, requires_grad=True)
    out = model(x * 1)
    assert actsave.stored_bytes() == {"device": 0, "host": 5 * 32 * 64 * 4}
    out.sum().backward()
    assert not host_is_separate(x.device)
    layer = actsave.profile(torch.nn.Sequential(*wide_relu_chain()), x.detach()).layers[2]
    assert layer.to_host_s == {} and effective_option(KeepPolicy(IDENTITY, True), layer, "cpu") == EXACT
