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
from typing import Callable

import torch

from ..devices import runs_triton_by_default
from ..errors import ActsaveError, ConfigError
from ..meta import device_of
from ..triton_kernels import Kernel

BACKENDS = ("auto", "triton", "torch")
_selected = "auto"


def set_backend(name: str) -> None:
    """Choose the codec implementation for every later call: one of :data:`BACKENDS`."""
    global _selected
    if name not in BACKENDS:
        raise ConfigError(f"backend {name!r} is not one of {list(BACKENDS)}")
    _selected = name


def get_backend() -> str:
    """The backend chosen now."""
    return _selected


@contextlib.contextmanager
def backend(name: str):
    """Use backend ``name`` inside the ``with`` block and restore the previous one."""
    previous = _selected
    set_backend(name)
    try:
        yield
    finally:
        set_backend(previous)


def implementation(kernel: Kernel, tensor: torch.Tensor) -> Callable:
    """``kernel.launcher`` (Triton) or ``kernel.reference`` (torch), whichever the
    backend chooses for ``tensor``; ``kernel`` is an entry of the kernel table."""
    use_triton = _selected == "triton" or (_selected == "auto" and runs_triton_by_default(device_of(tensor)))
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
