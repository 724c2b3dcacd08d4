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
import threading
from typing import Callable

import torch

from ..devices import runs_triton_by_default
from ..errors import ActsaveError, ConfigError, warn_renamed
from ..meta import device_of
from ..settings import SetBy
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
# Set on the importing thread now: there getattr finds it rather than raising and
# catching an AttributeError, host work at every codec call. Other threads read the default.
_this_thread.forced = None
_set_by = SetBy()


def set_backend(name: str) -> contextlib.ExitStack:
    """Choose the codec implementation for every later call, on every thread: one of
    :data:`BACKENDS`. A process setting: choose it before threads train.

    Takes effect at once; ``with set_backend(name): ...`` also restores the previous
    choice on exit, and raises ConfigError there instead where another thread chose
    meanwhile (restoring would undo its choice), as the offload setters do."""
    global _selected
    if name not in BACKENDS:
        raise ConfigError(f"backend {name!r} is not one of {list(BACKENDS)}")
    previous, _selected = _selected, name
    return _set_by.changed(
        lambda: set_backend(previous),
        "another thread chose the codec backend while this thread's `with set_backend(...)` block was open: the "
        "backend is the process's setting, and restoring it would undo that thread's choice. Call "
        "actsave.set_backend(...) once, before the threads start")


def get_backend() -> str:
    """The backend chosen now."""
    return _selected


def backend(name: str) -> contextlib.ExitStack:
    """Deprecated: ``with actsave.set_backend(name):`` does the same (one way to set the
    backend, returning the handle the offload setters return)."""
    warn_renamed("actsave.backend(name)",
                 "`with actsave.set_backend(name):`, which restores the previous backend on exit")
    return set_backend(name)


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
    if tensor.is_cpu and not kernel.interpreted:
        raise ActsaveError(
            "the 'triton' backend was forced for a CPU tensor, but Triton's interpreter "
            "is off: set the environment variable TRITON_INTERPRET=1 before Python "
            "imports triton (Triton reads it when kernels are defined), or use "
            "actsave.set_backend('auto')"
        )
    return kernel.launcher
