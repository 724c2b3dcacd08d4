"""Launching a compiled Triton kernel again without Triton's per-call work.

NOTE [ Direct launches ]

``kernel[grid](...)`` costs the host about 17 us a launch on an H200 with Triton 3.6,
where calling the compiled kernel's launcher costs about 5 (bench/results/
nvidia-h200-launch.txt): each call binds the arguments, works out their
specialization and the cache key, reads the current device and stream, checks the
kernel's globals and builds launch metadata. actsave launches a few hundred small
kernels a step (two per ReLU and per kept input of a lossy segment), so that is
milliseconds of a host-bound step. The rules:

1. The first launch of each specialization goes through Triton, which compiles it
   and returns its ``CompiledKernel``; later launches of the same specialization call
   that kernel's launcher as ``JITFunction.run`` does (the same arguments in the same
   order: the grid, the stream, the function, its packed metadata, no launch hooks,
   then every parameter in the kernel's order, constexprs and defaults included).
2. The key of a specialization is finer than Triton's, so it never reuses a kernel
   Triton would have compiled anew: a tensor by its dtype and 16-byte alignment; an
   integer by whether it is 1, divisible by 16 and which of int32, int64 or beyond
   holds it; a constexpr parameter and each launch option (``num_warps``...) by its
   value; the device by its index.
3. Where Triton could see something the key does not, every launch goes through
   Triton: launch hooks set (profilers such as proton), Triton's debug mode, an
   argument of another type (a float, None), a kernel without the parameter table
   this reads (``JITFunction.params``). So does the interpreter (CPU tensors).
4. ``ACTSAVE_DIRECT_LAUNCH=0`` in the environment turns direct launches off, for
   measuring them against Triton's path or ruling them out.
"""
from __future__ import annotations

import os
from typing import Callable, Optional

import torch

# Rule 4: read once, when the first kernel is launched.
ENABLED = os.environ.get("ACTSAVE_DIRECT_LAUNCH", "1") != "0"

_INT32 = range(-2**31, 2**31)
_INT64 = range(-2**63, 2**63)


class _Unkeyable(Exception):
    """An argument the key does not describe (rule 3)."""


def _argument_key(value):
    if isinstance(value, torch.Tensor):
        return value.dtype, value.data_ptr() % 16 == 0
    if isinstance(value, bool):
        return value
    if isinstance(value, int):
        return value == 1, value % 16 == 0, value in _INT32, value in _INT64
    raise _Unkeyable


class _Kernel:
    """What a direct launch of one ``@triton.jit`` function needs: its parameters'
    names, which are constexprs, their defaults, and the kernels compiled by key."""

    def __init__(self, jit):
        params = jit.params
        self.names = tuple(p.name for p in params)
        self.known = frozenset(self.names)
        self.constexpr = tuple(p.is_constexpr for p in params)
        self.defaults = {p.name: p.default for p in params if p.has_default}
        self.compiled: dict = {}  # key -> CompiledKernel, or None: launched through Triton

    def bound(self, args: tuple, kwargs: dict) -> Optional[tuple]:
        """``(arguments in the kernel's order, key)``, or None (rule 3)."""
        values = list(args)
        for name in self.names[len(args):]:
            if name in kwargs:
                values.append(kwargs[name])
            elif name in self.defaults:
                values.append(self.defaults[name])
            else:
                return None
        # Launch options in the caller's order: another order is another key, a
        # launch through Triton more, never a wrong kernel.
        options = tuple((name, value) for name, value in kwargs.items() if name not in self.known)
        try:
            key = (tuple(value if constexpr else _argument_key(value)
                         for value, constexpr in zip(values, self.constexpr)), options)
            hash(key)
        except (_Unkeyable, TypeError):  # TypeError: an unhashable constexpr or option
            return None
        return values, key


_kernels: dict = {}
_knobs = None  # triton.knobs, imported at the first launch
_stream_of: Optional[Callable] = None  # Triton's current-stream query, likewise


def _kernel(jit) -> Optional[_Kernel]:
    found = _kernels.get(jit)
    if found is None and jit not in _kernels:
        try:
            found = _Kernel(jit)
        except AttributeError:  # no parameter table (rule 3)
            found = None
        _kernels[jit] = found
    return found


def _triton_may_see_more() -> bool:
    global _knobs, _stream_of
    if _knobs is None:
        try:
            from triton import knobs
            from triton.runtime import driver
        except ImportError:  # a Triton without knobs: rule 3 for every launch
            knobs, driver = False, None
        _knobs, _stream_of = knobs, driver and driver.active.get_current_stream
    if _knobs is False:
        return True
    runtime = _knobs.runtime
    return runtime.launch_enter_hook is not None or runtime.launch_exit_hook is not None or runtime.debug


def _launchable(compiled) -> bool:
    """Whether Triton's launch returned a kernel this can call as rule 1 says."""
    return all(hasattr(compiled, name) for name in ("run", "function", "packed_metadata"))


def launch(jit, grid: tuple, device: torch.device, args: tuple, kwargs: dict) -> None:
    """``jit[grid](*args, **kwargs)`` on the CUDA ``device`` (current), directly where
    the NOTE's rules allow."""
    kernel = _kernel(jit) if ENABLED else None
    bound = None if kernel is None or _triton_may_see_more() else kernel.bound(args, kwargs)
    if bound is None:
        jit[grid](*args, **kwargs)
        return
    values, key = bound
    key = (device.index, key)
    compiled = kernel.compiled.get(key)
    if compiled is None:
        compiled = jit[grid](*args, **kwargs)  # rule 1: compiles and launches
        if key not in kernel.compiled:
            kernel.compiled[key] = compiled if _launchable(compiled) else None
        return
    grid_1 = grid[1] if len(grid) > 1 else 1
    grid_2 = grid[2] if len(grid) > 2 else 1
    compiled.run(grid[0], grid_1, grid_2, _stream_of(device.index), compiled.function, compiled.packed_metadata,
                 None, None, None, *values)
