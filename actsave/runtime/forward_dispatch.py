"""A module's ``forward`` replaced for one thread's calls while the others run it as
they did (:func:`forward_replaced`): how a selective checkpoint records its kept calls
in the forward and skips them in the recompute (selective.py, selective_replay.py)."""
from __future__ import annotations

import contextlib
import copy
import functools
import threading
from typing import Callable

from torch import nn

# NOTE [ Forwards replaced per thread ]
# A selective checkpoint runs each kept module's forward through its own function, in
# the forward (which records the call) and in the recompute (which skips it): it sets a
# dispatcher as the instance's ``forward`` while any thread needs one, and each thread's
# calls go to that thread's innermost function, which calls the one it replaced (an
# enclosing checkpoint's, or the module's own forward). A thread with none runs the
# module's own forward. So another thread running the same model meanwhile (an
# evaluation, against docs/limits.md's advice) neither records into nor skips in this
# thread's frame, and the instance holds what it held before once the last thread is
# done, whatever order the threads finish in.
_dispatch_lock = threading.Lock()


class _ForwardDispatch:
    """The instance ``forward`` of a module while threads replace it. It reads as the
    forward it stands for (name, signature: ``inspect.signature`` follows
    ``__wrapped__``), which a block may inspect to choose how to call it."""

    def __init__(self, module: nn.Module):
        self.had = "forward" in vars(module)
        self.previous = vars(module).get("forward")
        self.own = module.forward  # the instance's, or its class's bound to it
        self.by_thread = {}  # thread id -> [its functions, innermost last]
        self.active = 0
        functools.update_wrapper(self, self.own)

    def __call__(self, *args, **kwargs):
        functions = self.by_thread.get(threading.get_ident())
        return (functions[-1] if functions else self.own)(*args, **kwargs)

    def __deepcopy__(self, memo):
        # A copy of the model taken meanwhile (by another thread, or a hook inside the
        # block) runs its own module's forward, as the instance held it before.
        return copy.deepcopy(self.previous if self.had else self.own, memo)


@contextlib.contextmanager
def forward_replaced(module: nn.Module, make: Callable[[Callable], Callable]):
    """While active, this thread's calls of ``module.forward`` go to ``make(run)``, where
    ``run`` is what they went to before; other threads' go where they went (NOTE [
    Forwards replaced per thread ]). As the last thread's ends, the instance holds what
    it held before (its class's forward, or one set on it), also where the body set
    another."""
    thread = threading.get_ident()
    with _dispatch_lock:
        dispatch = vars(module).get("forward")
        if not isinstance(dispatch, _ForwardDispatch):
            dispatch = _ForwardDispatch(module)
            module.forward = dispatch
        functions = dispatch.by_thread.setdefault(thread, [])
        functions.append(make(functions[-1] if functions else dispatch.own))
        dispatch.active += 1
    try:
        yield
    finally:
        with _dispatch_lock:
            functions.pop()
            if not functions:
                del dispatch.by_thread[thread]
            dispatch.active -= 1
            if not dispatch.active:
                if dispatch.had:
                    module.forward = dispatch.previous
                else:
                    vars(module).pop("forward", None)


def forward_set_on(module: nn.Module) -> bool:
    """Whether a forward was set on the ``module`` instance, by its code: not a
    dispatcher standing for its class's."""
    forward = vars(module).get("forward")
    return forward is not None and (forward.had if isinstance(forward, _ForwardDispatch) else True)


def runs_its_class_forward(module: nn.Module) -> bool:
    """Whether ``module``'s calls run its class's ``forward``: none is set on the
    instance, or what is set says it wraps that one (``functools.wraps`` of the bound
    method, as accelerate's hooks and profilers set), through any number of such
    wrappers and dispatchers (:func:`forward_replaced`'s). What else is set may do
    anything. A wrapper that says so is trusted to call it and change nothing in place
    (docs/limits.md, "ReLU decisions")."""
    forward, own = vars(module).get("forward"), type(module).forward
    if forward is None:
        return True
    for _ in range(_MOST_WRAPPERS):
        if isinstance(forward, _ForwardDispatch):
            if not forward.had:
                return True
            forward = forward.previous
        elif _attribute(forward, "__func__") is own and _attribute(forward, "__self__") is module:
            return True
        else:
            forward = _attribute(forward, "__wrapped__")
    return False


def _attribute(forward, name: str):
    # A user's callable may raise anything from __getattr__: it then says nothing.
    try:
        return getattr(forward, name, None)
    except Exception:
        return None


_MOST_WRAPPERS = 16  # a __wrapped__ chain is followed this far (it may loop)


__all__ = ["forward_replaced", "forward_set_on", "runs_its_class_forward"]
