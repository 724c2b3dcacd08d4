"""The process settings a ``with`` statement scopes (``set_backend``,
``set_prefetch_depth``, ``set_host_pool_capacity``): each setter takes effect at once
and returns a handle whose ``with`` form restores the previous value on exit; and the
process-wide changes actsave makes while any thread needs them (:class:`CountedChange`)."""
from __future__ import annotations

import contextlib
import threading
from typing import Callable

from .errors import ConfigError


def undone_on_exit(undo: Callable[[], object]) -> contextlib.ExitStack:
    """The handle of a setting changed already: a ``with`` statement around the call
    runs ``undo`` on exit, so that a process setting can be scoped."""
    stack = contextlib.ExitStack()
    stack.callback(undo)
    return stack


class SetBy:
    """Which thread set a process setting last. The settings are the process's (a
    recompute may run on autograd's device threads, which must follow them), so a
    ``with`` block that restored its value over another thread's choice, made while
    the block was open, would undo that choice: it raises instead."""

    __slots__ = ("thread",)

    def __init__(self):
        self.thread = None

    def changed(self, restore: Callable[[], object], conflict: str) -> contextlib.ExitStack:
        """The handle of the setting this thread has just changed: its ``with`` form
        calls ``restore`` on exit, or raises ConfigError(``conflict``) where another
        thread set the setting meanwhile."""
        self.thread = me = threading.get_ident()

        def undo():
            if self.thread != me:
                raise ConfigError(conflict)
            restore()
        return undone_on_exit(undo)


class CountedChange:
    """A process-wide change made while one or more :meth:`active` contexts are open
    (they nest, on any threads): :meth:`make` as the first opens, :meth:`undo` as the
    last closes. The count is kept under a lock, so that two threads opening and closing
    in any order leave the change made while either is open and undone after."""

    def __init__(self):
        self._open = 0
        self._lock = threading.Lock()

    def make(self) -> None:
        raise NotImplementedError

    def undo(self) -> None:
        raise NotImplementedError

    def open(self) -> None:
        """:meth:`active` without a context (a hot path's): :meth:`close` must follow."""
        with self._lock:
            if not self._open:
                self.make()
            self._open += 1

    def close(self) -> None:
        with self._lock:
            self._open -= 1
            if not self._open:
                self.undo()

    @contextlib.contextmanager
    def active(self):
        self.open()
        try:
            yield
        finally:
            self.close()
