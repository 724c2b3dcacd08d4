"""Exact decisions of Hardtanh (ReLU6) and LeakyReLU modules in a lossy recompute.

NOTE [ Bound decisions ]
A Hardtanh's backward passes the gradient where ``min_val < v < max_val``, and a
LeakyReLU's scales it by its slope where ``v <= 0``, ``v`` being the one tensor each
saves: its input, a clone of it (an in-place Hardtanh) or its output (an in-place
LeakyReLU, whose signs are its input's). A recompute from a lossy input computes other
values, and where one lies near a bound its decision goes the other way, as a ReLU's
does (relu_signs.py); a codec storing the save itself moves elements across too (exact
zeros decode off 0). BatchNorm puts much of the mass at 0, so MobileNet's ReLU6 and
YOLO's LeakyReLU lost most of their gradient's precision that way (docs/limits.md,
"Other decisions a lossy recompute takes again").

So while a lossy forward runs a module of these (:class:`BoundWatch`; modules only: a
module's own code calling ``F.relu6`` is not seen, as an unwrapped max pool is not),
its save keeps one bit per element, 1 where the decision passes (:func:`keep`); and
the recompute's save of it, or the decoded save, is moved in place to the forward's
side of each bound before the backward reads it (:func:`restore_`): an element the
forward passed to the nearest value strictly inside, one it blocked that lies inside
to the nearest bound. Values move by less than the codec's error; the backward's mask
is the forward's. The bits are priced as a ReLU's (planning/instrumented_step.py).
Hardswish, Hardsigmoid, RReLU and threshold decide again (limits.md).
"""
from __future__ import annotations

import contextlib
import math
import threading
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from ..triton_kernels import bitfields
from .layers import module_hooks, modules_among


@dataclass(frozen=True)
class Bounds:
    """The open interval inside which a module's backward passes its decision: a
    Hardtanh's ``(min_val, max_val)``, a LeakyReLU's ``(0, inf)``."""

    low: float
    high: float

    @classmethod
    def of(cls, module: nn.Module) -> Optional["Bounds"]:
        if isinstance(module, nn.Hardtanh):
            return cls(float(module.min_val), float(module.max_val))
        if isinstance(module, nn.LeakyReLU):
            return cls(0.0, math.inf)
        return None


@dataclass
class BoundBits:
    """A save's decisions: ``bits`` (NOTE [ Bit fields ], row-major), 1 where ``bounds``
    held the element strictly inside."""

    bits: torch.Tensor
    bounds: Bounds


def keep(tensor: torch.Tensor, bounds: Bounds) -> torch.Tensor:
    """The bits of ``tensor``'s decisions under ``bounds`` (uint8, 1 per element)."""
    return bitfields.pack(_inside(tensor.detach().reshape(-1), bounds).view(torch.uint8), 1)


def restore_(tensor: torch.Tensor, bits: torch.Tensor, bounds: Bounds) -> None:
    """Move ``tensor`` (not tracked by autograd: a recompute's ``.data``, a decoded
    save) in place to the decisions of ``bits``: NOTE [ Bound decisions ]."""
    v = tensor.view(-1)
    passed = bitfields.unpack(bits, 1, v.numel()).view(torch.bool)
    low, high = _inner(bounds, v.dtype)
    inside = _inside(v, bounds)
    # Passed but not inside (on a bound, beyond it, NaN): the nearest value inside.
    moved = passed & ~inside
    v.masked_fill_(moved & (v <= bounds.low), low)
    v.masked_fill_(moved & (v >= bounds.high), high)
    # Blocked but inside: the nearest bound (a LeakyReLU's only one is 0).
    moved = inside.logical_and_(passed.logical_not_())
    below_middle = v < (bounds.low + bounds.high) / 2 if math.isfinite(bounds.high) else moved
    v.masked_fill_(moved & below_middle, bounds.low)
    v.masked_fill_(moved & ~below_middle, bounds.high)


def _inside(v: torch.Tensor, bounds: Bounds) -> torch.Tensor:
    """Where ``v`` lies strictly inside ``bounds`` (an infinite bound: every value above the other)."""
    above = v > bounds.low
    return above if math.isinf(bounds.high) else above.logical_and_(v < bounds.high)


def _inner(bounds: Bounds, dtype: torch.dtype) -> tuple:
    """The values of ``dtype`` just inside ``bounds``."""
    low, high = torch.tensor([bounds.low, bounds.high], dtype=dtype, device="cpu")
    inf = torch.tensor(math.inf, dtype=dtype, device="cpu")
    return torch.nextafter(low, inf).item(), torch.nextafter(high, -inf).item()


_RUNNING = threading.local()


def _running() -> list:
    """This thread's watched modules running now, innermost last, each with its saves' count."""
    if not hasattr(_RUNNING, "modules"):
        _RUNNING.modules = []
    return _RUNNING.modules


def is_bounded(module: nn.Module) -> bool:
    """Whether ``module`` is a Hardtanh or LeakyReLU whose save keeps bound decisions."""
    return Bounds.of(module) is not None and type(module).forward in (nn.Hardtanh.forward, nn.LeakyReLU.forward)


class BoundWatch:
    """Follows the Hardtanh and LeakyReLU modules that run on this thread while
    :meth:`watching`, so that :meth:`bounds_of_save` knows their save (NOTE [ Bound
    decisions ]). ``modules``: those the watched function can run, where its layers
    are known (layers.py, NOTE [ Known layers ]), hooked alone; None: global hooks."""

    def __init__(self, modules: Optional[list]):
        self._modules = modules
        self._thread = threading.get_ident()

    @classmethod
    def among(cls, modules) -> "BoundWatch":
        return cls(modules_among(modules, is_bounded))

    @contextlib.contextmanager
    def watching(self):
        if self._modules == []:
            yield self
            return
        self._thread = threading.get_ident()
        running = _running()
        depth = len(running)
        try:
            with module_hooks(self._modules, self._before, self._after):
                yield self
        finally:
            del running[depth:]  # a module that raised

    @staticmethod
    def bounds_of_save() -> Optional[Bounds]:
        """The bounds of the watched module whose save this is, or None: its first save
        only (a module saves one tensor; later saves are of ops it did not run)."""
        running = getattr(_RUNNING, "modules", None)
        if not running or running[-1][1]:
            return None
        running[-1][1] = True
        return running[-1][0]

    def _before(self, module, args) -> None:
        if threading.get_ident() == self._thread and is_bounded(module):
            _running().append([Bounds.of(module), False])

    def _after(self, module, args, output) -> None:
        if threading.get_ident() == self._thread and is_bounded(module):
            running = _running()
            if running:
                running.pop()
