"""The casts autocast caches in a profiled step: what a checkpointed segment keeps
beside its input under autocast with its cache on, to the end of the autocast region
(NOTE [ Casts autocast caches ] in runtime/replay.py)."""
from __future__ import annotations

import torch

from .._torch import TorchDispatchMode
from .live_bytes import allocation_bytes

_CAST = torch.ops.aten._to_copy.default


def autocast_depth() -> int:
    """How many autocast regions are open on this thread, enabled or not: the cache is
    dropped only where the outermost exits."""
    depth = torch.autocast_increment_nesting() - 1
    torch.autocast_decrement_nesting()  # back to ``depth``; dropping the cache is autocast's exit's
    return depth


class CastWatch(TorchDispatchMode):
    """The casts of leaves that need a gradient (the layers' weights and biases) a layer's
    forward makes with autocast's cache on, counted for that layer where an autocast
    region is still open as it ends, which holds them to its exit, saved or not (a layer
    entering autocast itself inside a region, even a disabled one, included; where it
    exits the outermost, its casts are dropped there). Each storage once. A cast the
    caller wrote (``w.to(torch.bfloat16)``) there reads as one too: counted as kept, it
    errs on the safe side."""

    def __init__(self, device: torch.device):
        super().__init__()
        self.device = device
        self.layer = None  # the layer whose forward runs now
        self._made = []  # (id(storage), bytes) cast by it so far
        self._first = {}  # id(storage) -> (bytes, layer)

    def layer_starts(self, layer: int) -> None:
        self.layer, self._made = layer, []

    def layer_ends(self) -> None:
        if self._made and autocast_depth() > 0:
            for key, nbytes in self._made:
                self._first.setdefault(key, (nbytes, self.layer))
        self.layer, self._made = None, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if (func is _CAST and self.layer is not None and args[0].is_leaf and args[0].requires_grad
                and self.device.type != "meta" and torch.is_autocast_cache_enabled()):
            storage = out.untyped_storage()
            self._made.append((id(storage), allocation_bytes(storage.nbytes(), self.device)))
        return out

    def bytes_by_layer(self, n: int) -> list:
        counted = [0] * n
        for nbytes, layer in self._first.values():
            counted[layer] += nbytes
        return counted
