"""Global state a recompute must see exactly as the forward saw it.

- RNG: the CPU generator and those of every accelerator the inputs live on are
  captured before the forward and replayed in the recompute (same Dropout masks),
  inside ``fork_rng`` so the caller's generators do not move. With
  ``preserve_rng_state=False`` (recompute_options.py) neither happens, as in torch.
- Autocast: whether it was on, its dtype and cache setting, for the CPU and for the
  inputs' device types. Backward may run outside the ``autocast`` block; the
  recompute re-enters the forward's state.
- BatchNorm running statistics: the recompute must not update them a second time
  (torch.utils.checkpoint does). See :func:`batchnorm_stats_frozen`.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Optional

import torch
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.module import register_module_forward_pre_hook

_BN_STATS = ("running_mean", "running_var", "num_batches_tracked")


@dataclass(frozen=True)
class _AutocastState:
    device_type: str
    enabled: bool
    dtype: torch.dtype
    cache_enabled: bool

    @classmethod
    def capture(cls, device_type: str) -> "_AutocastState":
        return cls(
            device_type,
            torch.is_autocast_enabled(device_type),
            torch.get_autocast_dtype(device_type),
            torch.is_autocast_cache_enabled(),
        )

    def context(self):
        return torch.autocast(
            self.device_type, dtype=self.dtype, enabled=self.enabled, cache_enabled=self.cache_enabled
        )


@dataclass(frozen=True)
class ReplayState:
    """RNG and autocast state at the start of a checkpointed forward."""

    cpu_rng: Optional[torch.Tensor]  # None: preserve_rng_state=False, no RNG replay
    device_type: str  # the inputs' accelerator type, or "cpu" when there is none
    devices: tuple  # indices of the accelerators the inputs live on
    device_rngs: tuple
    autocast: tuple

    @classmethod
    def capture(cls, tensors, preserve_rng_state: bool = True) -> "ReplayState":
        accelerators = sorted({(t.device.type, t.device.index or 0) for t in tensors
                               if t.device.type not in ("cpu", "meta")})
        device_type = accelerators[0][0] if accelerators else "cpu"
        devices = tuple(index for kind, index in accelerators if kind == device_type)
        module = torch.get_device_module(device_type) if devices else None
        autocast_types = ("cpu",) if device_type == "cpu" else ("cpu", device_type)
        return cls(
            cpu_rng=torch.get_rng_state() if preserve_rng_state else None,
            device_type=device_type,
            devices=devices,
            device_rngs=tuple(module.get_rng_state(i) for i in devices) if module and preserve_rng_state else (),
            autocast=tuple(_AutocastState.capture(kind) for kind in autocast_types),
        )

    @contextlib.contextmanager
    def replayed(self):
        """Run the body with the captured RNG and autocast state; the caller's RNG
        state is restored afterwards. Without a captured RNG state
        (``preserve_rng_state=False``) the body draws from the caller's generators and
        advances them, as torch's checkpoint does."""
        replays_rng = self.cpu_rng is not None
        with torch.random.fork_rng(devices=list(self.devices), device_type=self.device_type, enabled=replays_rng):
            if replays_rng:
                torch.set_rng_state(self.cpu_rng)
            if self.devices and replays_rng:
                module = torch.get_device_module(self.device_type)
                for index, state in zip(self.devices, self.device_rngs):
                    module.set_rng_state(state, index)
            with contextlib.ExitStack() as stack:
                for autocast in self.autocast:
                    stack.enter_context(autocast.context())
                yield


@contextlib.contextmanager
def batchnorm_stats_frozen():
    """While active, every BatchNorm that runs in training mode updates scratch copies
    of its running statistics, and the originals are put back on exit.

    Turning ``track_running_stats`` off instead would change which tensors autograd
    saves (the running stats are saved only when tracked), and the recompute must save
    exactly what the forward saved. A global pre-hook reaches BatchNorms anywhere in
    the recomputed code, including inside arbitrary functions given to ``checkpoint``.
    """
    swapped = []

    def use_scratch_stats(module, args):
        if isinstance(module, _BatchNorm) and module.training and module.track_running_stats:
            for name in _BN_STATS:
                original = module._buffers.get(name)
                if original is not None:
                    swapped.append((module, name, original))
                    module._buffers[name] = original.clone()

    handle = register_module_forward_pre_hook(use_scratch_stats)
    try:
        yield
    finally:
        handle.remove()
        # Reversed, so a module run twice gets its first original back.
        for module, name, original in reversed(swapped):
            module._buffers[name] = original
