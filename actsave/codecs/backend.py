"""Which implementation runs a codec: the Triton kernels or their torch references.

``"auto"`` (the default) uses Triton for CUDA tensors and the torch reference for CPU
tensors: both produce the same bits, the reference being the specification. Meta
tensors take the implementation of the device they stand for (meta.py): there the
Triton launchers allocate their outputs and launch nothing, so a simulated CUDA step
allocates what a real one does.
``"triton"`` forces the kernels, on CPU too through Triton's interpreter (how CI tests
them); ``"torch"`` forces the references. Both come from the kernel table of
actsave.triton_kernels, whose kernel modules are imported on first use, so ``import
actsave`` needs no Triton.
"""
from __future__ import annotations

import contextlib
import os
import threading
from typing import Callable

import torch

from ..devices import runs_triton_by_default
from ..errors import ActsaveError, ConfigError
from ..meta import device_of
from ..triton_kernels import Kernel

BACKENDS = ("auto", "triton", "torch")
# The process's choice, not a thread's: a codec call may run on autograd's device
# threads (a recompute's decode on CUDA), which must follow the choice made on the
# thread that trains. What actsave itself forces for a while (a trace of the torch
# references: runtime/graph_codecs.py) is this thread's alone (:func:`forced_here`).
_selected = "auto"


# ``forced``: a backend forced on this thread (forced_here). A plain threading.local read
# by getattr with a default, on which Dynamo guards, were it to trace implementation().
_this_thread = threading.local()
_scopes_lock = threading.Lock()
_scopes = [None, 0]  # the thread whose backend() blocks are open, and how many


def set_backend(name: str) -> None:
    """Choose the codec implementation for every later call, on every thread: one of
    :data:`BACKENDS`. A process setting: choose it before threads train."""
    global _selected
    if name not in BACKENDS:
        raise ConfigError(f"backend {name!r} is not one of {list(BACKENDS)}")
    _selected = name


def get_backend() -> str:
    """The backend chosen now."""
    return _selected


@contextlib.contextmanager
def backend(name: str):
    """Use backend ``name`` inside the ``with`` block and restore the previous one. The
    choice is the process's (:func:`set_backend`), so blocks open on two threads at
    once would each restore what the other chose: the second to open raises
    ConfigError instead."""
    me = threading.get_ident()
    with _scopes_lock:
        if _scopes[1] and _scopes[0] != me:
            raise ConfigError(
                f"actsave.backend({name!r}) was entered on one thread while another thread's backend() block is "
                "open: the backend is the process's setting, and each block would restore the other's choice on "
                "exit. Call actsave.set_backend(...) once, before the threads start")
        _scopes[0], _scopes[1] = me, _scopes[1] + 1
    try:
        previous = _selected
        set_backend(name)
        try:
            yield
        finally:
            set_backend(previous)
    finally:
        with _scopes_lock:
            _scopes[1] -= 1


@contextlib.contextmanager
def forced_here(name: str):
    """Inside the block, codec calls on this thread use backend ``name``, whatever the
    process's choice; other threads keep theirs."""
    previous, _this_thread.forced = getattr(_this_thread, "forced", None), name
    try:
        yield
    finally:
        _this_thread.forced = previous


def implementation(kernel: Kernel, tensor: torch.Tensor) -> Callable:
    """``kernel.launcher`` (Triton) or ``kernel.reference`` (torch), whichever the
    backend chooses for ``tensor``; ``kernel`` is an entry of the kernel table."""
    selected = getattr(_this_thread, "forced", None) or _selected
    use_triton = selected == "triton" or (selected == "auto" and runs_triton_by_default(device_of(tensor)))
    if not use_triton:
        return kernel.reference
    if tensor.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ActsaveError(
            "the 'triton' backend was forced for a CPU tensor, but Triton's interpreter "
            "is off: set the environment variable TRITON_INTERPRET=1 before Python "
            "imports triton (Triton reads it when kernels are defined), or use "
            "actsave.set_backend('auto')"
        )
    return kernel.launcher
