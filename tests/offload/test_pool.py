"""The pinned host pool: size classes, reuse, capacity, and buffers held until their
last copy is done."""
import random
import threading

import pytest
import torch
from torch import nn

from actsave import ActsaveError, CheckpointedSequential, ConfigError, devices
from actsave.offload import (
    HostCopyEngine,
    HostPool,
    OffloadPoolExhausted,
    empty_host_pool,
    host_pool,
    set_host_pool_capacity,
)
from actsave.offload import offloaded as offloaded_module
from actsave.offload import pool as pool_module

from offload.helpers import KiB, FakeEvent


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


def test_at_capacity_idle_buffers_of_other_classes_make_room():
    # A smaller last batch after larger ones: its class has no idle buffer, and the idle
    # larger ones, counted against the capacity, are no use to it.
    pool = HostPool(capacity_bytes=48 * KiB)
    for nbytes in (32 * KiB, 16 * KiB):
        pool.release(pool.acquire(nbytes))
    assert pool.reserved_bytes == 48 * KiB and pool.in_use_bytes == 0
    small = pool.acquire(8 * KiB)
    assert small.numel() == 8 * KiB and pool.reserved_bytes == 24 * KiB  # the 32 KiB buffer went
    assert pool.acquire(16 * KiB).numel() == 16 * KiB  # the idle 16 KiB one, lent again
    assert pool.allocations == 3



def test_idle_buffers_stay_where_freeing_them_would_not_make_room():
    pool = HostPool(capacity_bytes=48 * KiB)
    held = pool.acquire(32 * KiB)
    pool.release(pool.acquire(16 * KiB))
    with pytest.raises(OffloadPoolExhausted):
        pool.acquire(32 * KiB)  # 32 lent + 32 new > 48, whatever goes
    assert pool.reserved_bytes == 48 * KiB  # the idle 16 KiB buffer kept for its class
    pool.release(held)


def test_buffer_is_not_lent_again_before_its_last_copy_finishes():
    pool = HostPool()
    buffer = pool.acquire(4 * KiB)
    copy = FakeEvent(done=False)
    pool.release(buffer, after=copy)
    assert pool.in_use_bytes == 4 * KiB
    assert pool.acquire(4 * KiB).data_ptr() != buffer.data_ptr()
    copy.done = True
    assert pool.acquire(4 * KiB).data_ptr() == buffer.data_ptr()


def test_empty_frees_the_idle_buffers_and_keeps_those_on_loan_or_in_a_copy():
    pool = HostPool()
    lent, copied, idle = pool.acquire(4 * KiB), pool.acquire(8 * KiB), pool.acquire(16 * KiB)
    copy = FakeEvent(done=False)
    pool.release(copied, after=copy)
    pool.release(idle)
    assert pool.empty() == 16 * KiB
    assert pool.reserved_bytes == 12 * KiB and pool.in_use_bytes == 12 * KiB
    copy.done = True
    assert pool.empty() == 8 * KiB
    pool.release(lent)
    assert pool.empty() == 4 * KiB and pool.reserved_bytes == 0
    assert pool.acquire(4 * KiB).numel() == 4 * KiB and pool.allocations == 4  # lends anew


def test_empty_host_pool_frees_what_a_gone_models_steps_left_idle():
    empty_host_pool()
    model = CheckpointedSequential(*[nn.Linear(64, 64) for _ in range(4)], segments=4, offload=True)
    with devices.host_tier_simulated():
        model(torch.randn(16, 64)).sum().backward()
    del model
    left = host_pool().reserved_bytes
    assert left > 0 and host_pool().in_use_bytes == 0
    assert empty_host_pool() == left and host_pool().reserved_bytes == 0


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


class RefusedEvent(FakeEvent):
    """An event CUDA may not be asked about: one of a capture, or any during one."""

    def query(self):
        raise AssertionError("an event was asked whether it finished during a capture")

    def synchronize(self):
        raise AssertionError("an event was waited for during a capture")


@pytest.fixture
def capture(monkeypatch):
    """While ``capture[0]`` is true, the pool sees a CUDA graph being captured."""
    state = [False]
    monkeypatch.setattr(pool_module, "capturing", lambda: state[0])
    return state


def test_a_capture_asks_no_event_and_lends_an_idle_buffer_or_a_new_one(capture):
    # NOTE [ Host buffers of a captured graph ], rules 1 and 2: a buffer whose copy may
    # still run is passed over, no event asked; an idle one is lent, then a new one.
    pool = HostPool(capacity_bytes=3 * 4 * KiB)
    idle, copying = pool.acquire(4 * KiB), pool.acquire(4 * KiB)
    pool.release(idle)
    # Reading in_use_bytes outside the capture sees the first one finished: it is idle
    # from here, as a buffer an eager acquire took back is.
    assert pool.in_use_bytes == 4 * KiB
    pool.release(copying, after=RefusedEvent())
    capture[0] = True
    assert pool.acquire(4 * KiB).data_ptr() == idle.data_ptr()
    assert pool.acquire(4 * KiB).data_ptr() not in {idle.data_ptr(), copying.data_ptr()}
    with pytest.raises(OffloadPoolExhausted, match="CUDA graph being captured takes buffers of its own"):
        pool.acquire(4 * KiB)  # at capacity: no waiting for the copy, no freeing


def test_a_buffer_a_capture_took_is_the_graphs_for_good(capture):
    # Rule 3: every replay writes it, so it is never lent again, nor its event asked.
    pool = HostPool()
    capture[0] = True
    captured = pool.acquire(4 * KiB)
    pool.release(captured, after=RefusedEvent())
    capture[0] = False
    assert pool.in_use_bytes == 4 * KiB
    later = [pool.acquire(4 * KiB) for _ in range(3)]
    assert captured.data_ptr() not in {buffer.data_ptr() for buffer in later}
    for buffer in later:
        pool.release(buffer)
    assert pool.in_use_bytes == 4 * KiB and pool.reserved_bytes == 4 * 4 * KiB
    with pytest.raises(ActsaveError, match="not on loan"):
        pool.release(captured)


class _CaptureEvent(FakeEvent):
    """A finished copy's event, which may not be asked about during a capture, nor
    afterwards where a capture recorded it (as CUDA's)."""

    def __init__(self, capture):
        super().__init__(done=True)
        self.capture, self.recorded_in_capture = capture, capture[0]

    def query(self):
        assert not self.capture[0], "an event was asked whether it finished during a capture"
        assert not self.recorded_in_capture, "an event a capture recorded was asked whether it finished"
        return True

    def synchronize(self):
        assert not (self.capture[0] or self.recorded_in_capture), "an event was waited for where CUDA refuses it"


class _CaptureEngine(HostCopyEngine):
    def __init__(self, capture):
        self.capture = capture

    def to_host(self, source, host):
        super().to_host(source, host)
        return _CaptureEvent(self.capture)

    def to_device(self, host):
        return super().to_device(host)[0], _CaptureEvent(self.capture)


def test_an_offloaded_step_captured_between_eager_steps_asks_no_event_of_the_capture(capture, monkeypatch):
    # A whole int8 + offload training step as a capture runs it, between eager steps:
    # the pool asks no event during it, nor later one it recorded, keeps its buffers
    # out of circulation, and every step computes the same gradients.
    pool = HostPool()
    monkeypatch.setattr(offloaded_module, "copy_engine_for", lambda device: _CaptureEngine(capture))
    monkeypatch.setattr(offloaded_module, "host_pool_for", lambda device: pool)
    torch.manual_seed(0)
    model = CheckpointedSequential(*[layer for _ in range(4) for layer in (nn.Linear(32, 32), nn.ReLU())],
                                   segments=[0, 2, 4, 6], compress="int8", offload=True)
    x = torch.randn(8, 32)

    def step():
        model.zero_grad(set_to_none=True)
        model(x).square().sum().backward()
        return [parameter.grad for parameter in model.parameters()]

    eager = step()
    step()
    capture[0] = True
    captured = step()
    capture[0] = False
    held = pool.in_use_bytes
    after = [step() for _ in range(2)]
    for grads in (captured, *after):
        assert all(torch.equal(a, b) for a, b in zip(eager, grads))
    assert held > 0 and pool.in_use_bytes == held  # the graph's buffers, kept
