"""Exact decisions of the activations that decide at a bound (Hardtanh, ReLU6,
LeakyReLU, PReLU, Threshold, ELU, SELU, Hardsigmoid) in a lossy recompute.

NOTE [ Bound decisions ]
A Hardtanh's backward passes the gradient where ``min_val < v < max_val`` (a
Hardsigmoid's, scaled by 1/6, where ``-3 < v < 3``); a
LeakyReLU's, a PReLU's, an ELU's (alpha other than 1) and a SELU's change their slope
at ``v <= 0``, a Threshold's passes where ``v > threshold``; ``v`` being the one tensor
each saves first: its input, a clone of it (an in-place Hardtanh) or its output (an
in-place LeakyReLU or ELU, whose signs are its input's). A recompute from a lossy input
computes other values, and where one lies near a bound its decision goes the other way,
as a ReLU's does (relu_signs.py); a codec storing the save itself moves elements across
too (exact zeros decode off 0). BatchNorm puts much of the mass at 0, so MobileNet's
ReLU6, YOLO's LeakyReLU and PReLU networks lost most of their gradient's precision that
way (docs/limits.md, "Other decisions a lossy recompute takes again").

So while a lossy forward runs, the functions that make these decisions are tapped
(:class:`BoundWatch`, ``_taps.CLAMPS``: ``F.hardtanh``, ``F.relu6``, ``F.leaky_relu``,
``F.prelu``, ``F.threshold``, ``F.elu``, ``F.selu``, ``F.hardsigmoid``, which the
modules call, subclasses and a module's own code alike), and the one tensor each saves
first keeps one bit per element, 1 where the decision passes (:func:`keep`; a stored
copy another op's save made first keeps them too: kept_entries.py); the recompute's
save of it, or the decoded save, is moved in place to the forward's side of each bound
before the backward reads it (:func:`restore_`): an element the forward passed to the
nearest value strictly inside, one it blocked that lies inside to the nearest bound.
Values move by less than the codec's error; the backward's mask is the forward's. A
Hardtanh passes NaN (its backward blocks only at or beyond a bound), the others take
their other slope there, as CUDA's backwards do (torch's CPU Hardtanh blocks NaN in its
vectorized loop). One launch each on CUDA (triton_kernels/decisions/bounds.py). The
bits are priced as a ReLU's, the restore's transient apart
(planning/instrumented_step.py). Under torch.compile a block whose modules are these
runs eagerly (graph_codecs.py). RReLU (its saved noise holds the decisions, drawn again
in the recompute), Hardshrink and Softshrink, and the same decisions written as tensor
ops (``abs``, ``clamp``, ``maximum``, ``where``) decide again (limits.md).
"""
from __future__ import annotations

import contextlib
import math
import threading
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from .._taps import CLAMPS
from ..codecs.backend import implementation
from ..triton_kernels import decision_table


@dataclass(frozen=True)
class Bounds:
    """The open interval inside which a call's backward passes its decision: a
    Hardtanh's ``(min_val, max_val)``, a LeakyReLU's ``(0, inf)``."""

    low: float
    high: float


# The bound of the activations whose slope changes at 0 (NOTE [ Bound decisions ]).
SIGN = Bounds(0.0, math.inf)


@dataclass
class BoundBits:
    """A save's decisions: ``bits`` (NOTE [ Bit fields ], row-major), 1 where ``bounds``
    held the element strictly inside."""

    bits: torch.Tensor
    bounds: Bounds


def keep(tensor: torch.Tensor, bounds: Bounds) -> torch.Tensor:
    """The bits of ``tensor``'s decisions under ``bounds`` (uint8, 1 per element, in
    row-major order of its shape, whatever its layout). One kernel launch on CUDA
    (triton_kernels/decisions/bounds.py, which defines the compares: NOTE [ Bounds as
    the backward compares ])."""
    kernel = decision_table()["bounds", "pack"]
    return implementation(kernel, tensor)(tensor, bounds.low, bounds.high)


def restore_(tensor: torch.Tensor, bits: torch.Tensor, bounds: Bounds) -> None:
    """Move ``tensor`` (not tracked by autograd: a recompute's ``.data``, a decoded
    save; any layout) in place to the decisions of ``bits``: NOTE [ Bound decisions ].
    One kernel launch on CUDA."""
    kernel = decision_table()["bounds", "restore"]
    implementation(kernel, tensor)(tensor, bits, bounds.low, bounds.high)


_RUNNING = threading.local()


def _running() -> list:
    """This thread's tapped calls running now, innermost last: [bounds, saved yet]."""
    if not hasattr(_RUNNING, "calls"):
        _RUNNING.calls = []
    return _RUNNING.calls


def is_bounded(module: nn.Module) -> bool:
    """Whether ``module`` is an activation (a subclass included) whose decisions a lossy
    forward keeps: NOTE [ Bound decisions ]."""
    return isinstance(module, (nn.Hardtanh, nn.LeakyReLU, nn.PReLU, nn.Threshold, nn.ELU, nn.SELU, nn.Hardsigmoid))


def _called(bounds: Bounds, call_next, *args, **kwargs):
    """``call_next(*args, **kwargs)`` with ``bounds`` open for its save (:meth:`BoundWatch.bounds_of_save`)."""
    calls = _running()
    calls.append([bounds, False])
    try:
        return call_next(*args, **kwargs)
    finally:
        calls.pop()


def _hardtanh(call_next, input, min_val=-1.0, max_val=1.0, inplace=False):
    return _called(Bounds(float(min_val), float(max_val)), call_next, input, min_val, max_val, inplace)


def _relu6(call_next, input, inplace=False):
    return _called(Bounds(0.0, 6.0), call_next, input, inplace)


def _hardsigmoid(call_next, input, inplace=False):
    return _called(Bounds(-3.0, 3.0), call_next, input, inplace)


def _threshold(call_next, input, threshold, value, inplace=False):
    return _called(Bounds(float(threshold), math.inf), call_next, input, threshold, value, inplace)


def _elu(call_next, input, alpha=1.0, inplace=False):
    if alpha == 1.0:  # its slope is 1 on both sides of 0: nothing to decide
        return call_next(input, alpha, inplace)
    return _called(SIGN, call_next, input, alpha, inplace)


def _signed(call_next, *args, **kwargs):
    """A LeakyReLU's, a PReLU's, a SELU's: their slope changes at 0."""
    return _called(SIGN, call_next, *args, **kwargs)


_HANDLERS = {"hardtanh": _hardtanh, "relu6": _relu6, "leaky_relu": _signed, "prelu": _signed, "threshold": _threshold,
             "elu": _elu, "selu": _signed, "hardsigmoid": _hardsigmoid}
_TAPPED = [(CLAMPS[name], handler) for name, handler in _HANDLERS.items()]


class BoundWatch:
    """While :meth:`watching`, the calls of the functions ``_taps.CLAMPS`` taps on this
    thread are followed, so that :meth:`bounds_of_save` knows the first tensor each
    saves (NOTE [ Bound decisions ]);
    an inactive watch (an exact forward's) follows nothing."""

    def __init__(self, active: bool = True):
        self.active = active

    @contextlib.contextmanager
    def watching(self):
        if not self.active:
            yield self
            return
        running = _running()
        depth = len(running)
        pushed = []  # popped on the way out, however far the pushes got
        try:
            for tap, handler in _TAPPED:  # pushed, not entered: a context each cost more host time than the taps
                tap.push(handler)
                pushed.append(tap)
            yield self
        finally:
            for tap in reversed(pushed):
                tap.pop()
            del running[depth:]

    @staticmethod
    def bounds_of_save() -> Optional[Bounds]:
        """The bounds of the tapped call whose save this is, or None: its first save
        only (the op saves one tensor)."""
        running = getattr(_RUNNING, "calls", None)
        if not running or running[-1][1]:
            return None
        running[-1][1] = True
        return running[-1][0]
