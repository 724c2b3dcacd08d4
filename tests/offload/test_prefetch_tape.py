"""The prefetch tape: items in forward order, brought back ahead in backward."""
import gc
import threading
import weakref

import pytest
import torch

from actsave import ConfigError
from actsave.offload import (
    HostPool,
    OffloadedTensor,
    PrefetchTape,
    current_tape,
    prefetch_depth,
    set_prefetch_depth,
)

from offload.helpers import RecordingEngine


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
