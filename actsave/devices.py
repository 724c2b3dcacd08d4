"""What each kind of device does, as far as actsave's rules depend on it.

One function per rule; the runtime, the profiler, the cost model and the benches
ask here instead of testing a device's type themselves, so that a rule changes in
one place (for example, when another accelerator gains separate host memory).
Every ``device`` argument is anything ``torch.device`` takes.
"""
from __future__ import annotations

from typing import Optional

import torch


# NOTE [ Separate host memory ]
# Offload moves bytes off the device only where the host's memory is not the device's:
# on CUDA. On the CPU the pool's buffers are the device's own memory. The runtime
# offloads there all the same (the whole schedule runs, and is tested, without a GPU)
# and counts what it offloaded as "host" in stored_bytes(); the planner and the byte
# counter (planning/live_bytes.py) count those bytes on the device, the planner offers
# no offload lever and times no host copies there.
def host_is_separate(device) -> bool:
    """Whether offload moves bytes off ``device``: NOTE [ Separate host memory ]."""
    return torch.device(device).type == "cuda"


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
