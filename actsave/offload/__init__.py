"""Offload: keep segment inputs in host memory between the forward and the backward.

An :class:`OffloadedTensor` copies a tensor into a buffer lent by a :class:`HostPool`
(pinned when CUDA is available) through a :class:`CopyEngine`: on CUDA the copies run
on one dedicated copy stream per device, overlapped with compute; on the CPU they are
plain synchronous copies, so the whole schedule runs, and is tested, without a GPU.
A :class:`PrefetchTape` records offloaded items in forward order and, in backward
(reverse order), starts bringing the next ones back while the current one is in use.

Limits: CPU and CUDA tensors (and meta ones) only.

- pool.py: the host pool, its capacity, which storages are host memory;
- copy_engines.py: the copies and the streams, NOTE [ Offload stream ordering ];
- offloaded.py: offloaded tensors, alone or as a group in one buffer;
- prefetch_tape.py: the prefetch tape and its depth.
"""
from ..errors import OffloadPoolExhausted
from .copy_engines import CopyEngine, CudaCopyEngine, HostCopyEngine, copy_engine_for  # noqa: F401
from .offloaded import OffloadedTensor, OffloadedTensors  # noqa: F401
from .pool import (HostPool, empty_host_pool, host_pool, host_pool_for, is_host_memory,  # noqa: F401
                   set_host_pool_capacity)
from .prefetch_tape import PrefetchTape, TapeItem, current_tape, prefetch_depth, set_prefetch_depth  # noqa: F401

# What a user calls (docs/api.md); the runtime's names above stay importable from here.
__all__ = [
    "OffloadPoolExhausted",
    "empty_host_pool",
    "prefetch_depth",
    "set_host_pool_capacity",
    "set_prefetch_depth",
]
