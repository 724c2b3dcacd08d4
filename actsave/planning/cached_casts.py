"""The casts autocast caches in a profiled step: what a checkpointed segment keeps
beside its input under autocast with its cache on, to the end of the autocast region
(NOTE [ Casts autocast caches ] in runtime/replay.py)."""
from __future__ import annotations

import torch

from .._torch import TorchDispatchMode
from .live_bytes import allocation_bytes

_CAST = torch.ops.aten._to_copy.default


def caches_casts(device: torch.device) -> bool:
    """Whether a forward running now on ``device`` has autocast cache its casts (autocast
    on for the device type, its cache on). Asked as a layer starts: below autocast, in a
    dispatch mode or a saved-tensor hook, autocast reads as off."""
    return device.type != "meta" and torch.is_autocast_enabled(device.type) and torch.is_autocast_cache_enabled()


class CastWatch(TorchDispatchMode):
    """The casts of leaves that need a gradient (the layers' weights and biases) made in
    each layer's forward while autocast caches: what autocast holds to its region's
    end, saved or not. Each storage is counted once, for the layer that cast it. A cast
    the caller wrote (``w.to(torch.bfloat16)``) there reads as one too: counted as kept,
    it errs on the safe side."""

    def __init__(self, device: torch.device):
        super().__init__()
        self.device = device
        self.layer = None  # the layer whose forward runs now while autocast caches, else None
        self._first = {}  # id(storage) -> (bytes, layer)

    def layer_starts(self, layer: int) -> None:
        self.layer = layer if caches_casts(self.device) else None

    def layer_ends(self) -> None:
        self.layer = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is _CAST and self.layer is not None and args[0].is_leaf and args[0].requires_grad:
            storage = out.untyped_storage()
            self._first.setdefault(id(storage), (allocation_bytes(storage.nbytes(), self.device), self.layer))
        return out

    def bytes_by_layer(self, n: int) -> list:
        counted = [0] * n
        for nbytes, layer in self._first.values():
            counted[layer] += nbytes
        return counted
