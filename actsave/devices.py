"""What each kind of device does, as far as actsave's rules depend on it.

One function per rule; the runtime, the profiler, the cost model and the benches
ask here instead of testing a device's type themselves, so that a rule changes in
one place (for example, when another accelerator gains separate host memory).
Every ``device`` argument is anything ``torch.device`` takes.
"""
from __future__ import annotations

import contextlib
from typing import Optional

import torch


# NOTE [ Separate host memory ]
# Offload moves bytes off the device only where the host's memory is not the device's:
# on CUDA. On the CPU the pool's buffers would be the device's own memory: a copy there
# frees nothing and costs a copy each way. So there offload=True keeps tensors where
# they are, as without it, and the first such call warns (keep_rules.placed); the
# planner offers no offload lever and times no host copies there.
# The tests run the whole offload schedule on CPU tensors all the same, with the pool
# standing for a host tier (host_tier_simulated): what it offloads is counted as "host"
# in kept_bytes(), while the byte counter (planning/live_bytes.py) counts it on the
# device, where it is.
_host_tier_simulated = [False]  # one flag for every thread, as a test's threads share it


def host_is_separate(device) -> bool:
    """Whether offload moves bytes off ``device``: NOTE [ Separate host memory ]."""
    return torch.device(device).type == "cuda"


def offloads_from(device) -> bool:
    """Whether offload=True copies tensors of ``device`` to the host pool: where the host
    is separate, for meta tensors (to meta buffers: they stand for no memory), and on
    any device while the tests simulate a host tier."""
    return host_is_separate(device) or torch.device(device).type == "meta" or _host_tier_simulated[0]


@contextlib.contextmanager
def host_tier_simulated(on: bool = True):
    """For tests: while open, offload=True copies CPU tensors to the host pool as it
    does CUDA ones (``on=False``: as a user's CPU model does not). NOTE [ Separate host
    memory ]."""
    before, _host_tier_simulated[0] = _host_tier_simulated[0], on
    try:
        yield
    finally:
        _host_tier_simulated[0] = before


# The CUDA caching allocator hands out multiples of 512 bytes (MemTracker uses the same
# constant); other devices are counted as asked.
_CUDA_ALLOCATION_GRANULE = 512


def allocation_granule(device) -> int:
    """The multiple of bytes ``device``'s allocator hands out."""
    return _CUDA_ALLOCATION_GRANULE if torch.device(device).type == "cuda" else 1


def synchronize(device) -> None:
    """Wait for the work queued on ``device``: CUDA runs kernels after the host has
    queued them, so a host clock read without this measures the queueing only.
    Elsewhere the work is done when the call returns."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def capturing() -> bool:
    """Whether this thread's current CUDA stream is capturing a CUDA graph
    (``torch.cuda.graph``): then nothing may wait for the device, nor ask it whether
    work is done (offload/pool.py, NOTE [ Host buffers of a captured graph ]). False
    without CUDA."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def convolution_workspaces(device) -> bool:
    """Whether convolutions on ``device`` take workspaces from its allocator that no
    tensor holds (cuDNN's), which meta kernels do not ask for: NOTE [ Workspaces an
    estimate leaves out ] in planning/estimate.py."""
    return torch.device(device).type == "cuda"


def allocator_statistics(device) -> bool:
    """Whether a measured step reads the allocator's own count of ``device``'s bytes
    (torch.cuda's statistics): NOTE [ Allocator rises ] in planning/allocator_rises.py."""
    return torch.device(device).type == "cuda"


def runs_triton_by_default(device) -> bool:
    """Whether backend "auto" runs the Triton kernels for tensors on ``device``
    (elsewhere the torch references run; codecs/backend.py)."""
    return torch.device(device).type == "cuda"


def fused_attention(device) -> Optional[str]:
    """Which fused kernels scaled_dot_product_attention may run on ``device`` where meta
    tensors run the math path: "cuda" (flash, memory-efficient), "cpu" (the CPU's
    flash), or None (NOTE [ Attention on a simulated device ] in meta.py)."""
    kind = torch.device(device).type
    return kind if kind in ("cuda", "cpu") else None
