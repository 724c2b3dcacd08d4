"""The bound decision kernels: a Hardtanh's (ReLU6's) or LeakyReLU's decisions on the
one tensor it saves, packed in the forward and restored after the recompute
(actsave/runtime/bound_decisions.py, NOTE [ Bound decisions ]), with their launchers
and torch references.

- ``pack_bounds(v, low, high)``: one bit per element, 1 where the backward passes the
  decision: a Hardtanh's ``not (v <= low or v >= high)`` (NaN passes), a LeakyReLU's
  (``high`` infinite) ``v > low``. Reads ``v`` once, writes the bits.
- ``restore_bounds_(v, bits, low, high)``: ``v`` moved in place to those decisions: an
  element the bits pass that lies on a bound or beyond it, to the nearest value of its
  dtype strictly inside; one they block that lies inside, to the nearest bound (a
  LeakyReLU's only one, ``low``), on the bound's blocked side. Other elements keep
  their bits.

NOTE [ Bounds as the backward compares ]
torch's backwards compare in their op math: a half type's value widened to fp32 against
the bound rounded to fp32 (hardtanh_backward's ``min_val``; ``v <= 0.10002`` in fp16
rounds the bound to fp16 instead, and decides otherwise for the fp16 value just above
it). So each bound is taken as the values of the tensor's dtype on either side of it
(:class:`BoundValues`, worked out once per bounds and dtype): ``v <= low`` is ``v <=
low_at``, the largest value of the dtype at most the fp32 bound, and ``v >= high`` is
``v >= high_at``, the smallest at least it; both are exact compares in the dtype. The
kernels compare those as integers: a float's bits in the order of its values
(:func:`_ordered`), NaN apart, ``-0.0`` and ``+0.0`` equal (a zero bound's key is
chosen per side).
"""
import math
from functools import lru_cache
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .. import _launch, bitfields
from .packed_tiles import (
    LAUNCH_OPTIONS,
    NUM_WARPS,
    check_packed,
    field_positions,
    launchable,
    load_bits,
    pack_fields,
    packed_rows,
    program_rows,
    store_bits,
    unpack_fields,
)
from .relu_signs import relu_constexprs

# The integer a float of each dtype the kernels take is read as.
_AS_BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}
# The float type torch's backwards compare each dtype in (NOTE [ Bounds as the backward
# compares ]); float64 in float64, by the reference only.
_OP_MATH = {torch.float32: torch.float32, torch.bfloat16: torch.float32, torch.float16: torch.float32,
            torch.float64: torch.float64}


class BoundValues(NamedTuple):
    """A call's bounds as values of one dtype (NOTE [ Bounds as the backward compares ]).

    ``low_at``/``high_at``: the blocked values nearest the bounds (``v <= low`` is ``v
    <= low_at``, ``v >= high`` is ``v >= high_at``); ``low_in``/``high_in``: the values
    just inside them; ``middle_at``: below it (``v < middle_at``) an element moved to a
    bound goes to ``low_at``, else to ``high_at``. ``upper``: whether ``high`` is
    finite (a Hardtanh; a LeakyReLU's is not, and its elements all go to ``low_at``)."""

    low_at: float
    high_at: float
    low_in: float
    high_in: float
    middle_at: float
    upper: bool


def _rounded(value: float, dtype: torch.dtype, up: bool) -> torch.Tensor:
    """``value`` as torch's backward compares it (rounded to its op math's type), then
    the nearest value of ``dtype`` at least it (``up``) or at most it (a 0-dim tensor)."""
    compared = torch.tensor(value, dtype=_OP_MATH[dtype])
    nearest = compared.to(dtype)
    widened = nearest.to(compared.dtype)
    if (widened < compared) if up else (widened > compared):
        nearest = torch.nextafter(nearest, torch.tensor(math.inf if up else -math.inf, dtype=dtype))
    return nearest


@lru_cache(maxsize=256)
def bound_values(low: float, high: float, dtype: torch.dtype) -> BoundValues:
    """The values of ``dtype`` that stand for the bounds ``(low, high)`` (:class:`BoundValues`).
    An infinite ``high`` is a LeakyReLU's: its backward passes ``v > low``, +inf included."""
    upper = math.isfinite(high)
    low_at, high_at = _rounded(low, dtype, up=False), _rounded(high, dtype, up=True)
    middle = _rounded((low + high) / 2 if upper else math.inf, dtype, up=True)
    return BoundValues(low_at.item(), high_at.item(), torch.nextafter(low_at, high_at).item(),
                       torch.nextafter(high_at, low_at).item(), middle.item(), upper)


# ----------------------------------------------------------------- kernels

# The kernels' scalar arguments: bounds' keys and values, not specialized by the JIT
# (one of them equal to 1, the smallest subnormal's key, would compile another kernel).
BOUND_SCALARS = ["low_le", "high_ge", "low_at", "middle_ge", "high_at", "low_in", "high_in"]


@triton.jit
def _ordered(bits, MAGNITUDE: tl.constexpr):
    """A float's bits (a signed integer of its width) as an integer in the order of the
    float's values: a negative's magnitude bits flipped, so that a larger magnitude is a
    smaller integer (-0.0 is -1, +0.0 is 0). NaN has a key too, which callers ignore."""
    return tl.where(bits < 0, bits ^ MAGNITUDE, bits)


@triton.jit
def _sides(bits, low_le, high_ge, MAGNITUDE: tl.constexpr, INF_BITS: tl.constexpr):
    """(``v <= low``, ``v >= high``, is NaN) from v's bits and the bounds' keys."""
    nan = (bits & MAGNITUDE) > INF_BITS
    key = _ordered(bits, MAGNITUDE)
    return (key <= low_le) & ~nan, (key >= high_ge) & ~nan, nan


@triton.jit
def _inside(below_low, above_high, nan, UPPER: tl.constexpr):
    """Where the backward passes: a Hardtanh's between its bounds (NaN included), a
    LeakyReLU's above its one (NaN excluded)."""
    if UPPER:
        return ~(below_low | above_high)
    return ~(below_low | nan)


@triton.jit(do_not_specialize=BOUND_SCALARS[:3])
def _pack_bounds_kernel(v_ptr, bits_ptr, numel, packed_bytes, low_le, high_ge, low_at, MAGNITUDE: tl.constexpr,
                        INF_BITS: tl.constexpr, UPPER: tl.constexpr, ROWS: tl.constexpr):
    rows = program_rows(ROWS)
    positions = field_positions(rows, 8)
    # Padding reads the lower bound, which blocks: its bits are 0.
    in_bounds = positions < numel
    v = load_bits(v_ptr + positions, in_bounds)
    v = tl.where(in_bounds, v, low_at.to(v.dtype))
    below_low, above_high, nan = _sides(v, low_le, high_ge, MAGNITUDE, INF_BITS)
    passes = _inside(below_low, above_high, nan, UPPER)
    tl.store(bits_ptr + rows, pack_fields(passes, 1).to(tl.uint8), mask=rows < packed_bytes)


@triton.jit(do_not_specialize=BOUND_SCALARS)
def _restore_bounds_kernel(v_ptr, bits_ptr, numel, packed_bytes, low_le, high_ge, low_at, middle_ge, high_at,
                           low_in, high_in, MAGNITUDE: tl.constexpr, INF_BITS: tl.constexpr,
                           UPPER: tl.constexpr, ROWS: tl.constexpr):
    rows = program_rows(ROWS)
    passed = unpack_fields(tl.load(bits_ptr + rows, mask=rows < packed_bytes, other=0), 1) != 0
    positions = field_positions(rows, 8)
    in_bounds = positions < numel
    v = load_bits(v_ptr + positions, in_bounds)
    below_low, above_high, nan = _sides(v, low_le, high_ge, MAGNITUDE, INF_BITS)
    inside = _inside(below_low, above_high, nan, UPPER)
    # Passed but on a bound or beyond it: just inside. Blocked but inside: the bound.
    out = tl.where(passed & below_low, low_in, v)
    if UPPER:
        out = tl.where(passed & above_high, high_in, out)
        below_middle = (_ordered(v, MAGNITUDE) < middle_ge) & ~nan
        out = tl.where(~passed & inside, tl.where(below_middle, low_at, high_at), out)
    else:
        out = tl.where(~passed & inside, low_at, out)
    store_bits(v_ptr + positions, out.to(v.dtype), in_bounds)


# ----------------------------------------------------------------- launchers

# Packed bytes a restore program owns: 8 a thread, half a ReLU restore's. It holds more
# per element (both bounds' sides, the middle), and at a ReLU's 16 (128 elements a
# thread) ptxas spilled it to the stack where the count is ragged and every load is one
# element wide (test_ptx.py). The pack keeps a ReLU pack's tile.
RESTORE_PACKED_BYTES_PER_THREAD = 8
RESTORE_ROWS = RESTORE_PACKED_BYTES_PER_THREAD * 32 * NUM_WARPS


def _bits_of(value: float, dtype: torch.dtype) -> int:
    """The bits of ``value`` (exactly a value of ``dtype``) as a signed integer."""
    return torch.tensor(value, dtype=dtype).view(_AS_BITS[dtype]).item()


def _key(value: float, dtype: torch.dtype, zero_key: int) -> int:
    """The ordered key of ``value`` (as ``_ordered`` makes it); a zero's is ``zero_key``:
    0 (+0.0's) where ``v <=`` it is asked, -1 (-0.0's) where ``v >=`` it is."""
    if value == 0:
        return zero_key
    bits = _bits_of(value, dtype)
    magnitude = (1 << (8 * dtype.itemsize - 1)) - 1
    return bits ^ magnitude if bits < 0 else bits


@lru_cache(maxsize=256)
def _launch_arguments(low: float, high: float, dtype: torch.dtype) -> tuple:
    """(pack's, restore's) scalar arguments and constexprs for these bounds and dtype."""
    values = bound_values(low, high, dtype)
    float_bits = relu_constexprs(dtype)
    constants = {"MAGNITUDE": float_bits["MAGNITUDE"], "INF_BITS": float_bits["INF_BITS"], "UPPER": values.upper,
                 **LAUNCH_OPTIONS}
    pack = {"low_le": _key(values.low_at, dtype, 0), "high_ge": _key(values.high_at, dtype, -1),
            "low_at": _bits_of(values.low_at, dtype)}
    restore = {**pack, "middle_ge": _key(values.middle_at, dtype, -1),
               **{name: _bits_of(getattr(values, name), dtype) for name in ("high_at", "low_in", "high_in")}}
    return ({**pack, **constants, "ROWS": packed_rows(1, dtype.itemsize)},
            {**restore, **constants, "ROWS": RESTORE_ROWS})


def pack_bounds(v: torch.Tensor, low: float, high: float) -> torch.Tensor:
    """The decisions of a Hardtanh (``low < high``, finite) or LeakyReLU (``high``
    infinite) on its save ``v``, one bit per element (uint8, 1-D, ``ceil(numel / 8)``
    bytes, row-major): 1 where its backward passes. ``v`` may need grad (a save as
    autograd holds it): the kernel reads its memory, the reference reads it detached."""
    if v.dtype not in _AS_BITS or not launchable(v):
        return pack_bounds_ref(v, low, high)
    n = v.numel()
    packed_bytes = -(-n // 8)
    bits = torch.empty(packed_bytes, dtype=torch.uint8, device=v.device)
    if v.device.type != "meta":
        arguments = _launch_arguments(low, high, v.dtype)[0]
        _launch.launch(_pack_bounds_kernel, (-(-packed_bytes // arguments["ROWS"]),), v, bits, n, packed_bytes,
                       **arguments)
    return bits


def restore_bounds_(v: torch.Tensor, bits: torch.Tensor, low: float, high: float) -> None:
    """Move ``v`` in place to the decisions ``bits`` (as :func:`pack_bounds` gives them).
    ``v`` may need grad: the kernel writes its memory, no operator of a graph, and the
    reference changes it detached."""
    if v.dtype not in _AS_BITS or bits.dtype != torch.uint8 or not launchable(v, bits):
        return restore_bounds_ref_(v.detach() if v.requires_grad else v, bits, low, high)
    n, packed_bytes = v.numel(), bits.numel()
    check_packed(bits, n, 1)
    if v.device.type != "meta":
        arguments = _launch_arguments(low, high, v.dtype)[1]
        _launch.launch(_restore_bounds_kernel, (-(-packed_bytes // arguments["ROWS"]),), v, bits, n, packed_bytes,
                       **arguments)


# ----------------------------------------------------------------- torch references


def _passes_ref(v: torch.Tensor, values: BoundValues) -> torch.Tensor:
    """Where the backward passes (bool, ``v``'s shape)."""
    if not values.upper:
        return v > values.low_at
    return (v <= values.low_at).logical_or_(v >= values.high_at).logical_not_()


def pack_bounds_ref(v: torch.Tensor, low: float, high: float) -> torch.Tensor:
    """The specification of :func:`pack_bounds`."""
    passes = _passes_ref(v.detach(), bound_values(low, high, v.dtype))
    return bitfields.pack(passes.reshape(-1).view(torch.uint8), 1)


def restore_bounds_ref_(v: torch.Tensor, bits: torch.Tensor, low: float, high: float) -> None:
    """The specification of :func:`restore_bounds_`."""
    check_packed(bits, v.numel(), 1)
    values = bound_values(low, high, v.dtype)
    passed = bitfields.unpack(bits, 1, v.numel()).view(torch.bool).view(v.shape)
    with torch.no_grad():
        inside = _passes_ref(v, values)
        moved = passed & ~inside  # passed, on a bound or beyond it
        # Both masks from the recomputed values, as the kernel's choice reads them: where
        # the dtype holds nothing between the bounds, low_in is high_at.
        to_low = moved & (v <= values.low_at)
        to_high = moved & (v >= values.high_at) if values.upper else None
        v.masked_fill_(to_low, values.low_in)
        if to_high is not None:
            v.masked_fill_(to_high, values.high_in)
        moved = inside.logical_and_(passed.logical_not_())  # blocked, inside
        if not values.upper:
            v.masked_fill_(moved, values.low_at)
            return
        below_middle = v < values.middle_at
        v.masked_fill_(moved & below_middle, values.low_at)
        v.masked_fill_(moved & ~below_middle, values.high_at)
