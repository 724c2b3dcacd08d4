"""Functions code calls through their modules, tapped while actsave needs to see their
calls (:class:`FunctionTap`: each thread's handlers run around the original), and the
taps actsave sets: attention, the activations that decide at a bound, torch's
checkpoint. Public functions, swapped by _torch.py's AttributeSwap."""
from __future__ import annotations

import contextlib
import functools
import importlib
import threading

import torch

from ._torch import _TORCH_CHECKPOINT, AttributeSwap


class FunctionTap:
    """``owner.name`` (a function code calls through its module: ``F.scaled_dot_product_
    attention``) replaced, while any thread has a handler pushed (:meth:`handled`), by
    a trampoline that runs the calling thread's handlers, innermost first, each as
    ``handler(call_next, *args, **kwargs)``, down to the original. Several users of
    one function (a meta step's simulated attention, selective recompute's record and
    skip) so compose in the order they were entered, and a thread without handlers
    calls the original. Code that bound the function under another name before is not
    reached."""

    def __init__(self, owner, name: str):
        def trampoline(*args, **kwargs):
            return self._call(len(self._stack()) - 1, args, kwargs)

        # Code that reads the tapped function (its name in a trace, inspect.signature)
        # finds the original's name, docstring and signature.
        self._swap = AttributeSwap(owner, name, functools.update_wrapper(trampoline, getattr(owner, name)))
        self._local = threading.local()

    @property
    def original(self):
        return self._swap.original

    def push(self, handler) -> None:
        """:meth:`handled` without a context (a hot path's): :meth:`pop` must follow.
        The swap opens first, so a push that raises leaves no handler to pop."""
        self._swap.open()
        self._stack().append(handler)

    def pop(self) -> None:
        self._swap.close()
        self._stack().pop()

    @contextlib.contextmanager
    def handled(self, handler):
        """While active, calls of the function on this thread run ``handler`` first."""
        self.push(handler)
        try:
            yield
        finally:
            self.pop()

    def _stack(self) -> list:
        stack = getattr(self._local, "handlers", None)
        if stack is None:
            stack = self._local.handlers = []
        return stack

    def _call(self, depth: int, args: tuple, kwargs: dict):
        if depth < 0:
            return self._swap.original(*args, **kwargs)
        handler = self._stack()[depth]
        return handler(lambda *a, **k: self._call(depth - 1, a, k), *args, **kwargs)


# Attention as code calls it (torch.nn.functional.scaled_dot_product_attention): what a
# meta step that stands for a device runs (meta.py), and what selective recompute
# records and skips (runtime/selective.py).
ATTENTION = FunctionTap(torch.nn.functional, "scaled_dot_product_attention")
# The activations deciding at a bound, as modules call them (runtime/bound_decisions.py).
CLAMPS = {name: FunctionTap(torch.nn.functional, name) for name in ("hardtanh", "relu6", "leaky_relu", "prelu",
                                                                     "threshold", "elu", "selu", "hardsigmoid")}
# torch's checkpoint as code calls it: a lossy forward warns of one inside it (runtime/forward_decisions.py).
TORCH_CHECKPOINT = FunctionTap(importlib.import_module(_TORCH_CHECKPOINT), "checkpoint")
