"""The prefetch tape: offloaded items in forward order. In the forward it says when
each item's device memory may go; in backward (reverse order) it starts bringing the
next items back while the current one is in use (NOTE [ Offload stream ordering ],
rules 2 and 5, in copy_engines.py).
"""
from __future__ import annotations

import contextlib
import threading
import weakref
from typing import Optional, Protocol

from ..errors import ConfigError
from ..settings import SetBy
from ._settings import is_count


class TapeItem(Protocol):
    """What :class:`PrefetchTape` needs of an item. :class:`OffloadedTensor` has it, and
    so can a group of them that holds one segment's inputs, or one call's kept saves
    (runtime/kept_saves.py)."""

    released: bool

    def prefetch(self) -> None:
        """Start bringing the item back; idempotent, and a no-op once released."""

    def free_source(self) -> None:
        """Let the item's device memory go, in stream order; idempotent."""


# The process's setting, not a thread's: a tape is used on autograd's device threads
# too (a backward on CUDA), which follow the depth set on the thread that trains.
_prefetch_depth = 1
_set_by = SetBy()


def prefetch_depth() -> int:
    """How many items :meth:`PrefetchTape.before_use` brings back ahead (default 1)."""
    return _prefetch_depth


def set_prefetch_depth(depth: int) -> contextlib.ExitStack:
    """Set how many items :meth:`PrefetchTape.before_use` brings back ahead of the one
    backward needs (0: none) for every tape that has no depth of its own, on every
    thread: a process setting.

    Takes effect at once; ``with set_prefetch_depth(n): ...`` also restores the previous
    depth on exit, and raises ConfigError there instead where another thread set the
    depth meanwhile (restoring would undo its choice). Each item ahead holds its device
    memory early, so depth trades device memory for slack in the copies.
    """
    global _prefetch_depth
    previous, _prefetch_depth = _prefetch_depth, _checked_depth(depth)
    return _set_by.changed(
        lambda: set_prefetch_depth(previous),
        "another thread set the prefetch depth while this thread's `with set_prefetch_depth(...)` block was "
        "open: the depth is the process's setting, and restoring it would undo that thread's choice. Call "
        "set_prefetch_depth(n) once, before the threads start")


def _checked_depth(depth) -> int:
    if not is_count(depth):
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
        self._compact_at = _COMPACT_FROM  # when to forget the dead references of _refs
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
        self.segment_may_start()
        with self._lock:
            self._refs.append(weakref.ref(item))
            self._segment_started = False
            if len(self._refs) >= self._compact_at:
                self._refs = [ref for ref in self._refs if _live(ref()) is not None]
                self._compact_at = max(_COMPACT_FROM, 2 * len(self._refs))

    def segment_starts(self) -> None:
        """Free the source of the newest item: a segment starts, so the forward of the
        one that registered it is over. ``register`` does this; a segment that keeps
        nothing offloaded (a stored one) calls it, or the last offloaded input would
        stay on the device through the rest of the forward and the backward up to its
        own recompute (seen on an H100: one input above the plan's predicted peak)."""
        with self._lock:
            newest = self._newest_live()
            later, self._later = self._later, []
            self._segment_started = True
        for ref in later:
            deferred = ref()
            if deferred is not None:
                deferred.free_source()
        if newest is not None:
            newest.free_source()

    def segment_may_start(self) -> None:
        """:meth:`segment_starts`, unless it ran since the last :meth:`register`: for a
        segment that cannot tell whether its caller said so already (a kept-saves call,
        runtime/kept_saves.py, which a CheckpointedSequential's segment loop or a plain
        caller may run). A second call would free at once what the first deferred
        (:meth:`free_later`), before a segment of compute has covered its copy."""
        with self._lock:
            told = self._segment_started
        if not told:
            self.segment_starts()

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
            ahead = self._live_before(item)
        item.prefetch()  # first: one copy stream runs copies in order (rule 5)
        for each in ahead:
            each.prefetch()

    # The backward uses the newest live item and releases it, and a forward registers
    # after it: both ends of the tape are its newest items. So the scans below start
    # there and forget the dead references they pass; a full pass forgets the others
    # once the references double (items collected without a backward, out of order).
    def _newest_live(self):
        """The newest item neither collected nor released, or None."""
        while self._refs:
            item = _live(self._refs[-1]())
            if item is not None:
                return item
            self._refs.pop()
        return None

    def _live_before(self, item) -> list:
        """The ``depth`` live items registered just before ``item``, newest first ([]
        where it is not on the tape)."""
        self._newest_live()  # forgets the dead newest references first
        ahead, found = [], False
        for ref in reversed(self._refs):
            each = _live(ref())
            if each is None:
                continue
            if found:
                ahead.append(each)
            found = found or each is item
            if found and len(ahead) >= self.depth:
                return ahead
        return ahead if found else []


def _live(item):
    """``item`` unless it was collected (None) or released."""
    return None if item is None or item.released else item


# The fewest references at which register forgets the dead ones.
_COMPACT_FROM = 64


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
