"""Fused kernels for the decisions a lossy recompute keeps: ReLU signs and max-pool
window offsets (actsave/runtime/relu_signs.py, pool_decisions.py, NOTE [ Max-pool
decisions ]), packed as NOTE [ bit fields ] in bitfields.py says.

- ``pack_relu_signs(y)``: one bit per element of a ReLU output, ``not (y <= 0)``
  (``threshold_backward``'s test: NaN passes). Reads the output once, writes the bits.
- ``restore_relu_signs_(y, bits)``: a recomputed ReLU output corrected in place to
  those decisions: 0 where the forward blocked, ``max(y, finfo.tiny)`` where it passed
  (the smallest positive normal lifts a recomputed zero; NaN stays NaN).
- ``encode_max_pool(indices, input_size, kernel_size, stride, padding, dilation)``: the
  offset of each window's winner within its window (row-major over the window's
  elements), from the int64 ``indices`` max pooling returns (flat per plane over
  ``input_size``), packed in :func:`bitfields.field_bits` bits.
- ``decode_max_pool_(indices, packed, input_size, ...)``: those offsets back into
  ``indices``, in place.
- ``gather_max_pool_(pooled, x, indices, dims)``: ``pooled`` set to ``x`` at
  ``indices``, in place: a max pool's output at those decisions (indices within their
  plane, as a max pool gives them).

The ``*_ref`` functions are the specification in torch; the kernels match them bit for
bit. The kernels touch values only as their bits (a float viewed as the integer of its
width; a gather copies bits), so no float conversion, rounding mode or
flush-to-zero can part kernel, interpreter and reference.

Bytes moved per element (of the ReLU output, of the pooled output), as the launches
read and write them:

=====================  =========================================================
pack_relu_signs        read the output (4 or 2 B), write 1/8 B
restore_relu_signs_    read 1/8 B and the output, write the output (4 + 4 or 2 + 2 B)
encode_max_pool        read 8 B of indices, write bits/8 B (1/8 .. 1)
decode_max_pool_       read bits/8 B, write 8 B of indices
gather_max_pool_       read 8 B of indices and one input element, write the output
=====================  =========================================================

A launcher allocates nothing but its packed output (none for the in-place ones), and
meta tensors get that allocation and no launch (actsave.estimate simulates a CUDA step
on them). An input the kernels cannot take (another dtype or layout, no elements, more
elements than they index) is handed to the reference, never to a kernel that would
give other bits. Every launch goes through ``_launch.launch``.
"""
import math
from functools import lru_cache
from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from . import _launch
from .bitfields import field_bits

# Four warps, and 16 packed bytes per thread: one 16-byte vector store of the packed
# stream per thread, the wide stream (a ReLU output, int64 indices) read or written in
# 16-byte vectors too (test_ptx.py checks both). A ReLU program covers 2048 packed bytes,
# 16384 elements: 128 per thread, 512 bytes of fp32 in flight per thread, and few
# programs for the interpreter, which costs per program. Not tuned: fp32 streams come
# close to a device copy, half types less so (docs/results.md, "Figures behind the
# code's rules").
NUM_WARPS = 4
PACKED_BYTES_PER_THREAD = 16
# A thread's share of a wide stream at most: 1-bit offsets of int64 indices would take
# 1 KiB for 16 packed bytes (256 registers); they get 8 packed bytes per thread.
WIDE_BYTES_PER_THREAD = 512
# The gather of a pooled output: 16 elements per thread, its int64 indices in 8
# vectors, its values in 16-byte vectors (fp32: 4, half: 2).
GATHER_ELEMENTS_PER_THREAD = 16
# Compile options of every launch (and of the ahead-of-time builds that check them).
# The kernels are integer-only: nothing for FMA fusion to change.
LAUNCH_OPTIONS = {"num_warps": NUM_WARPS}

# The float dtypes whose bits the ReLU kernels read, as (integer view, constexprs):
# the magnitude mask, +inf's bits and the smallest positive normal's bits.
_RELU_DTYPES = {
    torch.float32: (torch.int32, {"MAGNITUDE": 0x7FFFFFFF, "INF_BITS": 0x7F800000, "TINY_BITS": 0x00800000}),
    torch.bfloat16: (torch.int16, {"MAGNITUDE": 0x7FFF, "INF_BITS": 0x7F80, "TINY_BITS": 0x0080}),
    torch.float16: (torch.int16, {"MAGNITUDE": 0x7FFF, "INF_BITS": 0x7C00, "TINY_BITS": 0x0400}),
}
# The integer dtype a gather copies the bits of an element of each size as.
_BITS_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
# Positions, plane sizes and in-plane coordinates are int32 in the pool kernels (NOTE
# [ Division by an invariant ]): pooled outputs of 2**31 elements (16 GiB of indices)
# and more go to the references.
MAX_INT32 = 2 ** 31 - 1
MAX_POOL_DIMS = 3


def relu_constexprs(dtype: torch.dtype) -> dict:
    """The ReLU kernels' constexprs for an output of ``dtype`` (fp32, bf16 or fp16)."""
    return dict(_RELU_DTYPES[dtype][1])


def packed_bytes_per_thread(bits: int, wide_bytes: int) -> int:
    """Packed bytes a thread owns, for fields of ``bits`` over a wide stream of
    ``wide_bytes`` per element: 16, or fewer where the wide stream would exceed
    WIDE_BYTES_PER_THREAD."""
    per_byte = 8 // bits
    return max(1, min(PACKED_BYTES_PER_THREAD, WIDE_BYTES_PER_THREAD // (per_byte * wide_bytes)))


def packed_rows(bits: int, wide_bytes: int) -> int:
    """Packed bytes per program (a power of two)."""
    return packed_bytes_per_thread(bits, wide_bytes) * 32 * NUM_WARPS


GATHER_BLOCK = GATHER_ELEMENTS_PER_THREAD * 32 * NUM_WARPS


# ----------------------------------------------------------------- jit helpers


@triton.jit
def _program_rows(ROWS: tl.constexpr):
    """This program's packed bytes, as int64 offsets (no wrap past 2**31 elements)."""
    return tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)


@triton.jit
def _field_positions(rows, PER_BYTE: tl.constexpr):
    """[rows, PER_BYTE]: the element each field of each packed byte holds."""
    return rows[:, None] * PER_BYTE + tl.arange(0, PER_BYTE)[None, :]


@triton.jit
def _pack_fields(fields, BITS: tl.constexpr):
    """NOTE [ bit fields ]: [rows, 8 // BITS] fields, each below 2**BITS, as [rows]
    bytes (int32), field j in bits j * BITS upward. The fields' bits are disjoint, so
    their sum is their OR."""
    shifts = tl.arange(0, 8 // BITS) * BITS
    return tl.sum(fields.to(tl.int32) << shifts[None, :], axis=1)


@triton.jit
def _unpack_fields(packed, BITS: tl.constexpr):
    """The inverse of _pack_fields: [rows] bytes -> [rows, 8 // BITS] fields (int32)."""
    shifts = tl.arange(0, 8 // BITS) * BITS
    return (packed.to(tl.int32)[:, None] >> shifts[None, :]) & ((1 << BITS) - 1)


@triton.jit
def _passes(bits, MAGNITUDE: tl.constexpr, INF_BITS: tl.constexpr):
    """``not (y <= 0)`` from the bits of y (a signed integer of y's width): y > 0
    (sign clear, not zero: +inf and +NaN included), or NaN of either sign."""
    return (bits > 0) | ((bits & MAGNITUDE) > INF_BITS)


@triton.jit
def _lifted(bits, MAGNITUDE: tl.constexpr, INF_BITS: tl.constexpr, TINY_BITS: tl.constexpr):
    """``max(y, tiny)`` from the bits of y, NaN kept: every y below the smallest
    positive normal (zeros, subnormals, negatives) is below TINY_BITS as a signed
    integer, and a NaN is not lifted."""
    below = (bits < TINY_BITS) & ((bits & MAGNITUDE) <= INF_BITS)
    return tl.where(below, TINY_BITS, bits)


@triton.jit
def _divide(n, multiplier, shift):
    """NOTE [ Division by an invariant ]: n // d for int32 0 <= n < 2**31, given d's
    multiplier (the bits of a uint32, passed as an int32) and shift: the high half of
    2n * multiplier, shifted."""
    doubled = (n << 1).to(tl.uint32, bitcast=True)  # 2n < 2**32: exact as a uint32
    high = tl.umulhi(doubled, multiplier.to(tl.uint32, bitcast=True))
    return (high >> shift.to(tl.uint32)).to(tl.int32, bitcast=True)


@triton.jit
def _coordinates(position, inner_0, inner_0_multiplier, inner_0_shift, inner_1, inner_1_multiplier,
                 inner_1_shift, DIMS: tl.constexpr):
    """(c0, c1, c2) of an int32 flat position in a box of up to three dimensions, the
    last DIMS of them used (the leading ones 0); ``inner_0`` and ``inner_1`` are the
    elements per step along dimensions 0 and 1 (the sizes of what lies inside)."""
    zero = tl.zeros_like(position)
    c0 = zero
    if DIMS == 3:
        c0 = _divide(position, inner_0_multiplier, inner_0_shift)
        position = position - c0 * inner_0
    c1 = zero
    if DIMS >= 2:
        c1 = _divide(position, inner_1_multiplier, inner_1_shift)
        position = position - c1 * inner_1
    return c0, c1, position


@triton.jit
def _window_step(winner, out, STRIDE: tl.constexpr, PADDING: tl.constexpr, DILATION: tl.constexpr):
    """Along one dimension: which of its window's elements the winner is (exact: the
    winner lies on the window's dilated grid)."""
    step = winner - (out * STRIDE - PADDING)
    if DILATION != 1:
        step = step // DILATION
    return step


@triton.jit
def _window_coordinate(out, step, STRIDE: tl.constexpr, PADDING: tl.constexpr, DILATION: tl.constexpr):
    """The inverse of _window_step: the input coordinate of a window's element."""
    return out * STRIDE - PADDING + step * DILATION


# ----------------------------------------------------------------- kernels


@triton.jit
def _pack_relu_signs_kernel(y_ptr, bits_ptr, numel, packed_bytes, MAGNITUDE: tl.constexpr,
                            INF_BITS: tl.constexpr, TINY_BITS: tl.constexpr, ROWS: tl.constexpr):
    rows = _program_rows(ROWS)
    positions = _field_positions(rows, 8)
    y = tl.load(y_ptr + positions, mask=positions < numel, other=0)  # 0 does not pass: padding bits are 0
    packed = _pack_fields(_passes(y, MAGNITUDE, INF_BITS), 1)
    tl.store(bits_ptr + rows, packed.to(tl.uint8), mask=rows < packed_bytes)


@triton.jit
def _restore_relu_signs_kernel(y_ptr, bits_ptr, numel, packed_bytes, MAGNITUDE: tl.constexpr,
                               INF_BITS: tl.constexpr, TINY_BITS: tl.constexpr, ROWS: tl.constexpr):
    rows = _program_rows(ROWS)
    passed = _unpack_fields(tl.load(bits_ptr + rows, mask=rows < packed_bytes, other=0), 1)
    positions = _field_positions(rows, 8)
    in_bounds = positions < numel
    y = tl.load(y_ptr + positions, mask=in_bounds, other=0)
    restored = tl.where(passed != 0, _lifted(y, MAGNITUDE, INF_BITS, TINY_BITS), 0)
    tl.store(y_ptr + positions, restored.to(y.dtype), mask=in_bounds)


# The JIT turns an integer argument equal to 1 into a constexpr; a division's multiplier
# and shift are used as values (bitcast, converted), so they are never specialized.
_DIVISION_CONSTANTS = [f"{name}_{part}" for name in ("plane", "out_inner_0", "out_inner_1", "in_inner_0", "in_inner_1")
                       for part in ("multiplier", "shift")]


@triton.jit(do_not_specialize=_DIVISION_CONSTANTS)
def _encode_max_pool_kernel(indices_ptr, packed_ptr, numel, packed_bytes,
                            plane, plane_multiplier, plane_shift,
                            out_inner_0, out_inner_0_multiplier, out_inner_0_shift,
                            out_inner_1, out_inner_1_multiplier, out_inner_1_shift,
                            in_inner_0, in_inner_0_multiplier, in_inner_0_shift,
                            in_inner_1, in_inner_1_multiplier, in_inner_1_shift,
                            DIMS: tl.constexpr, K1: tl.constexpr, K2: tl.constexpr,
                            S0: tl.constexpr, S1: tl.constexpr, S2: tl.constexpr,
                            P0: tl.constexpr, P1: tl.constexpr, P2: tl.constexpr,
                            D0: tl.constexpr, D1: tl.constexpr, D2: tl.constexpr,
                            BITS: tl.constexpr, ROWS: tl.constexpr):
    rows = _program_rows(ROWS)
    wide_positions = _field_positions(rows, 8 // BITS)
    in_bounds = wide_positions < numel
    winners = tl.load(indices_ptr + wide_positions, mask=in_bounds, other=0).to(tl.int32)
    positions = wide_positions.to(tl.int32)  # numel <= MAX_INT32 (the launcher's check)
    in_plane = positions - _divide(positions, plane_multiplier, plane_shift) * plane
    o0, o1, o2 = _coordinates(in_plane, out_inner_0, out_inner_0_multiplier, out_inner_0_shift,
                              out_inner_1, out_inner_1_multiplier, out_inner_1_shift, DIMS)
    i0, i1, i2 = _coordinates(winners, in_inner_0, in_inner_0_multiplier, in_inner_0_shift,
                              in_inner_1, in_inner_1_multiplier, in_inner_1_shift, DIMS)
    offsets = (_window_step(i0, o0, S0, P0, D0) * (K1 * K2) + _window_step(i1, o1, S1, P1, D1) * K2
               + _window_step(i2, o2, S2, P2, D2))
    packed = _pack_fields(tl.where(in_bounds, offsets, 0), BITS)
    tl.store(packed_ptr + rows, packed.to(tl.uint8), mask=rows < packed_bytes)


@triton.jit(do_not_specialize=_DIVISION_CONSTANTS)
def _decode_max_pool_kernel(indices_ptr, packed_ptr, numel, packed_bytes,
                            plane, plane_multiplier, plane_shift,
                            out_inner_0, out_inner_0_multiplier, out_inner_0_shift,
                            out_inner_1, out_inner_1_multiplier, out_inner_1_shift,
                            in_inner_0, in_inner_0_multiplier, in_inner_0_shift,
                            in_inner_1, in_inner_1_multiplier, in_inner_1_shift,
                            DIMS: tl.constexpr, K1: tl.constexpr, K2: tl.constexpr,
                            S0: tl.constexpr, S1: tl.constexpr, S2: tl.constexpr,
                            P0: tl.constexpr, P1: tl.constexpr, P2: tl.constexpr,
                            D0: tl.constexpr, D1: tl.constexpr, D2: tl.constexpr,
                            BITS: tl.constexpr, ROWS: tl.constexpr):
    rows = _program_rows(ROWS)
    offsets = _unpack_fields(tl.load(packed_ptr + rows, mask=rows < packed_bytes, other=0), BITS)
    wide_positions = _field_positions(rows, 8 // BITS)
    in_bounds = wide_positions < numel
    positions = wide_positions.to(tl.int32)
    in_plane = positions - _divide(positions, plane_multiplier, plane_shift) * plane
    o0, o1, o2 = _coordinates(in_plane, out_inner_0, out_inner_0_multiplier, out_inner_0_shift,
                              out_inner_1, out_inner_1_multiplier, out_inner_1_shift, DIMS)
    i0 = _window_coordinate(o0, offsets // (K1 * K2), S0, P0, D0)
    i1 = _window_coordinate(o1, (offsets // K2) % K1, S1, P1, D1)
    i2 = _window_coordinate(o2, offsets % K2, S2, P2, D2)
    winners = i0 * in_inner_0 + i1 * in_inner_1 + i2
    tl.store(indices_ptr + wide_positions, winners.to(tl.int64), mask=in_bounds)


@triton.jit(do_not_specialize=["plane_multiplier", "plane_shift"])
def _gather_max_pool_kernel(pooled_ptr, x_ptr, indices_ptr, numel, input_plane,
                            plane, plane_multiplier, plane_shift, BLOCK: tl.constexpr):
    wide_positions = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    in_bounds = wide_positions < numel
    winners = tl.load(indices_ptr + wide_positions, mask=in_bounds, other=0)
    # A max pool's indices lie in their plane. Any other value (torch's gather, the
    # reference, raises) is clamped into it, so that no read leaves x; clamping, not
    # masking, keeps the stores whole vectors.
    winners = tl.minimum(tl.maximum(winners, 0), input_plane - 1)
    planes = _divide(wide_positions.to(tl.int32), plane_multiplier, plane_shift)
    values = tl.load(x_ptr + (planes.to(tl.int64) * input_plane + winners), mask=in_bounds)
    tl.store(pooled_ptr + wide_positions, values, mask=in_bounds)


# ----------------------------------------------------------------- host helpers


# NOTE [ Division by an invariant ]
# The pool kernels find each element's coordinates by dividing its int32 position by
# sizes known at launch (elements per plane, per row), not at compile time: a constexpr
# size would compile a kernel per input size (a detector trained at many sizes would
# compile hundreds). An int32 division by a runtime value is tens of instructions; a
# multiply-high and a shift are two (Granlund and Montgomery 1994; CUTLASS's
# FastDivmod does the same).
# For 1 <= d < 2**31 let l = ceil(log2 d) and multiplier = ceil(2**(31 + l) / d). Then
# d * multiplier - 2**(31 + l) < d <= 2**l, the condition for
# floor(n * multiplier / 2**(31 + l)) == n // d for every 0 <= n < 2**31; and
# 2**31 <= multiplier < 2**32 (2**31 where d is a power of two), a uint32. The kernel
# takes the high 32 bits of the 64-bit product 2n * multiplier (2n < 2**32: a uint32
# too), that is floor(n * multiplier / 2**31), and shifts them right by l.
def division_constants(d: int) -> tuple:
    """``(multiplier, shift)`` with ``((2 * n * multiplier) >> 32) >> shift == n // d``
    for every ``0 <= n < 2**31``, the multiplier a uint32 (NOTE [ Division by an
    invariant ])."""
    if not 1 <= d <= MAX_INT32:
        raise ValueError(f"a divisor from 1 to 2**31 - 1, not {d}")
    shift = (d - 1).bit_length()
    return -(-(1 << (31 + shift)) // d), shift


@lru_cache(maxsize=1024)
def _divisor(name: str, d: int) -> dict:
    """A kernel's arguments for dividing by ``d``: the multiplier as the int32 of its
    bits (an int32 argument: the JIT would type a value of 2**31 or more int64). Cached:
    the dict is read, never changed."""
    multiplier, shift = division_constants(d)
    return {name: d, f"{name}_multiplier": multiplier - (1 << 32) if multiplier > MAX_INT32 else multiplier,
            f"{name}_shift": shift}


class PoolGeometry(NamedTuple):
    """A max pool call as its decision kernels see it: per spatial dimension, right
    aligned to three (a leading unused dimension has size 1, kernel 1, stride 1, no
    padding), the sizes of the input and of the output, and the window."""

    dims: int
    input_size: tuple
    output_size: tuple
    kernel_size: tuple
    stride: tuple
    padding: tuple
    dilation: tuple

    @classmethod
    def of(cls, indices_shape, input_size, kernel_size, stride, padding, dilation) -> Optional["PoolGeometry"]:
        """The geometry of a pool whose ``indices`` have ``indices_shape``, or None
        where the kernels cannot take it (then the reference runs); the sizes are
        checked against MAX_INT32 by the launchers."""
        dims = len(kernel_size)
        if not (1 <= dims <= MAX_POOL_DIMS and len(indices_shape) >= dims and len(input_size) == dims
                and all(len(v) == dims for v in (stride, padding, dilation)) and 1 <= math.prod(kernel_size) <= 256):
            return None
        output_size = tuple(indices_shape[-dims:])
        if min(output_size) < 1:
            return None

        def aligned(values, fill):
            return (fill,) * (MAX_POOL_DIMS - dims) + tuple(int(v) for v in values)

        return cls(dims, aligned(input_size, 1), aligned(output_size, 1), aligned(kernel_size, 1),
                   aligned(stride, 1), aligned(padding, 0), aligned(dilation, 1))

    @property
    def bits(self) -> int:
        return field_bits(math.prod(self.kernel_size))

    def arguments(self) -> dict:
        """The runtime arguments of the encode and decode kernels."""
        o, i = self.output_size, self.input_size
        return {**_divisor("plane", math.prod(o)), **_divisor("out_inner_0", o[1] * o[2]),
                **_divisor("out_inner_1", o[2]), **_divisor("in_inner_0", i[1] * i[2]),
                **_divisor("in_inner_1", i[2])}

    def constexprs(self) -> dict:
        """The constexprs of the encode and decode kernels (a kernel per window)."""
        k, s, p, d = self.kernel_size, self.stride, self.padding, self.dilation
        return {"DIMS": self.dims, "K1": k[1], "K2": k[2], "S0": s[0], "S1": s[1], "S2": s[2],
                "P0": p[0], "P1": p[1], "P2": p[2], "D0": d[0], "D1": d[1], "D2": d[2], "BITS": self.bits,
                "ROWS": packed_rows(self.bits, 8)}


def _launchable(*tensors) -> bool:
    """Tensors a kernel can take as flat arrays: contiguous, with elements."""
    return all(t.is_contiguous() for t in tensors) and tensors[0].numel() > 0


def _empty_packed(count: int, bits: int, device) -> torch.Tensor:
    return torch.empty(-(-count * bits // 8), dtype=torch.uint8, device=device)


class _Launch(NamedTuple):
    """What a launch of a packing kernel takes besides its tensors, worked out once per
    dtype or pool geometry (the host's time per launch counts: a step launches one per
    ReLU output kept)."""

    as_bits: Optional[torch.dtype]  # the integer dtype a ReLU output is read as
    bits: int  # per field
    rows: int  # packed bytes per program
    arguments: dict  # the kernel's scalar arguments and constexprs, the launch options


_RELU_LAUNCHES = {dtype: _Launch(view, 1, packed_rows(1, dtype.itemsize),
                                 {**constants, "ROWS": packed_rows(1, dtype.itemsize), **LAUNCH_OPTIONS})
                  for dtype, (view, constants) in _RELU_DTYPES.items()}


@lru_cache(maxsize=256)
def _pool_launch(indices_shape: torch.Size, input_size: tuple, kernel_size: tuple, stride: tuple, padding: tuple,
                 dilation: tuple) -> Optional[_Launch]:
    geometry = PoolGeometry.of(indices_shape, input_size, kernel_size, stride, padding, dilation)
    if geometry is None:
        return None
    constexprs = geometry.constexprs()
    return _Launch(None, geometry.bits, constexprs["ROWS"], {**geometry.arguments(), **constexprs, **LAUNCH_OPTIONS})


def _pool_launch_of(indices: torch.Tensor, input_size, kernel_size, stride, padding, dilation) -> Optional[_Launch]:
    """The pool kernels' launch for these indices, or None where they cannot take them."""
    if indices.dtype != torch.int64 or not _launchable(indices) or indices.numel() > MAX_INT32:
        return None
    try:
        launch = _pool_launch(indices.shape, tuple(input_size), tuple(kernel_size), tuple(stride), tuple(padding),
                              tuple(dilation))
    except TypeError:  # unhashable geometry (lists of lists): not a pool's
        return None
    return launch if launch is not None and math.prod(input_size) <= MAX_INT32 else None


# ----------------------------------------------------------------- launchers


def pack_relu_signs(y: torch.Tensor) -> torch.Tensor:
    """The decisions of a ReLU output ``y``, one bit per element (uint8, 1-D,
    ``ceil(numel / 8)`` bytes): ``not (y <= 0)``, row-major."""
    y = y.detach()
    launch = _RELU_LAUNCHES.get(y.dtype)
    if launch is None or not _launchable(y):
        return pack_relu_signs_ref(y)
    n = y.numel()
    packed_bytes = -(-n // 8)
    bits = torch.empty(packed_bytes, dtype=torch.uint8, device=y.device)
    if y.device.type != "meta":
        _launch.launch(_pack_relu_signs_kernel, (-(-packed_bytes // launch.rows),), y.view(launch.as_bits), bits, n,
                       packed_bytes, **launch.arguments)
    return bits


def restore_relu_signs_(y: torch.Tensor, bits: torch.Tensor) -> None:
    """Correct a recomputed ReLU output ``y`` in place to the decisions ``bits`` (as
    :func:`pack_relu_signs` gives them): 0 where the forward blocked; where it passed,
    ``max(y, torch.finfo(y.dtype).tiny)``, NaN staying NaN."""
    y = y.detach()
    launch = _RELU_LAUNCHES.get(y.dtype)
    if launch is None or bits.dtype != torch.uint8 or not _launchable(y, bits):
        return restore_relu_signs_ref_(y, bits)
    n, packed_bytes = y.numel(), bits.numel()
    _check_packed(bits, n, 1)
    if y.device.type != "meta":
        _launch.launch(_restore_relu_signs_kernel, (-(-packed_bytes // launch.rows),), y.view(launch.as_bits), bits,
                       n, packed_bytes, **launch.arguments)


def encode_max_pool(indices: torch.Tensor, input_size: tuple, kernel_size: tuple, stride: tuple,
                    padding: tuple, dilation: tuple) -> torch.Tensor:
    """The window offset of each of max pooling's ``indices`` (int64, flat per plane
    over the spatial ``input_size``; the last ``len(kernel_size)`` dimensions are the
    pooled ones), packed in :func:`bitfields.field_bits` bits of the window's size
    (uint8, 1-D)."""
    launch = _pool_launch_of(indices, input_size, kernel_size, stride, padding, dilation)
    if launch is None:
        return encode_max_pool_ref(indices, input_size, kernel_size, stride, padding, dilation)
    n = indices.numel()
    packed = _empty_packed(n, launch.bits, indices.device)
    if indices.device.type != "meta":
        _launch.launch(_encode_max_pool_kernel, (-(-packed.numel() // launch.rows),), indices, packed, n,
                       packed.numel(), **launch.arguments)
    return packed


def decode_max_pool_(indices: torch.Tensor, packed: torch.Tensor, input_size: tuple, kernel_size: tuple,
                     stride: tuple, padding: tuple, dilation: tuple) -> None:
    """Overwrite ``indices`` (int64, of the encoded indices' shape) with the decisions
    :func:`encode_max_pool` packed."""
    launch = _pool_launch_of(indices, input_size, kernel_size, stride, padding, dilation)
    if launch is None or packed.dtype != torch.uint8 or not _launchable(packed):
        return decode_max_pool_ref_(indices, packed, input_size, kernel_size, stride, padding, dilation)
    n = indices.numel()
    _check_packed(packed, n, launch.bits)
    if indices.device.type != "meta":
        _launch.launch(_decode_max_pool_kernel, (-(-packed.numel() // launch.rows),), indices, packed, n,
                       packed.numel(), **launch.arguments)


def gather_max_pool_(pooled: torch.Tensor, x: torch.Tensor, indices: torch.Tensor, dims: int) -> None:
    """Set ``pooled`` to ``x`` at ``indices`` (flat over the last ``dims`` dimensions of
    ``x``; ``indices`` shaped like ``pooled``), in place."""
    pooled, x = pooled.detach(), x.detach()
    if (pooled.dtype != x.dtype or x.element_size() not in _BITS_OF_SIZE or indices.dtype != torch.int64
            or not _launchable(pooled, x, indices) or not _gatherable(pooled, x, indices, dims)):
        return gather_max_pool_ref_(pooled, x, indices, dims)
    if pooled.device.type != "meta":
        as_bits, n = _BITS_OF_SIZE[x.element_size()], pooled.numel()
        _launch.launch(_gather_max_pool_kernel, (-(-n // GATHER_BLOCK),), pooled.view(as_bits), x.view(as_bits),
                       indices, n, math.prod(x.shape[-dims:]), **_divisor("plane", math.prod(pooled.shape[-dims:])),
                       BLOCK=GATHER_BLOCK, **LAUNCH_OPTIONS)


def _gatherable(pooled, x, indices, dims) -> bool:
    return (1 <= dims <= x.dim() and pooled.shape == indices.shape and pooled.dim() == x.dim()
            and pooled.shape[:-dims] == x.shape[:-dims] and pooled.numel() <= MAX_INT32
            and math.prod(pooled.shape[-dims:]) > 0)


def _check_packed(packed: torch.Tensor, count: int, bits: int) -> None:
    """Packed decisions of the wrong size would be read past their end: refused."""
    expected = -(-count * bits // 8)
    if packed.numel() != expected:
        raise ValueError(f"{count} decisions of {bits} bits take {expected} bytes, got {packed.numel()}")


# ----------------------------------------------------------------- torch references


# NOTE [ Cheap references ]
# The references are what runs on CPU (and on every device with the torch backend):
# they are written for few aten ops and small temporaries, each step exact in integer
# or IEEE arithmetic, and they work on meta tensors (no data-dependent Python).
# - A group of 8 bytes that are each 0 or 1 is a little-endian int64 w whose byte j is
#   bit j's value b_j. w * 0x0102040810204080 adds b_j * 2**(8j + 56 - 7k) for every j,
#   k: j == k puts b_j at bit 56 + j, every other pair lands at a distinct bit outside
#   56..63 (8j - 7k is never in 0..7 for j != k, and two pairs never share a bit), so
#   nothing carries and byte 7 of the product is the packed byte. The product is taken
#   modulo 2**64: torch's int64 multiply wraps (two's complement) on CPU and CUDA, and
#   the tests hold these bits to a plain packing (bitfields.pack).
# - Unpacking looks each byte up in a 256-entry table of its 8 fields. A ReLU restore
#   zeroes the blocked elements by a bitwise and of their bits, not masked_fill_ (on a
#   CPU, torch's masked_fill_ and where take one element at a time; the and is
#   vectorized).
# - A window offset is linear in the flat index once the index's coordinates are known,
#   and those are a floor division each; the window starts' part, which depends only on
#   the output position, is a small cached table (decisions_tables).
# - Tables are made once per device and kept (a tracker of live bytes, LiveBytes or
#   MemTracker, sees them made once: the planner's profile makes them before it
#   measures). Meta tensors hold no data: there the references use no table and make
#   the same allocations, so an estimate does not depend on what ran before it.
_BYTE_GATHER = 0x0102040810204080


def pack_relu_signs_ref(y: torch.Tensor) -> torch.Tensor:
    """The specification of :func:`pack_relu_signs`."""
    n = y.numel()
    blocked = torch.empty(-(-n // 8) * 8, dtype=torch.bool, device=y.device)
    torch.le(y.detach(), 0, out=blocked[:n].view(y.shape))
    if n % 8:
        blocked[n:].fill_(True)  # blocked padding: its bits come out 0
    gathered = blocked.view(torch.int64).mul_(_BYTE_GATHER)
    return torch.bitwise_not(gathered.view(torch.uint8)[7::8])


def restore_relu_signs_ref_(y: torch.Tensor, bits: torch.Tensor) -> None:
    """The specification of :func:`restore_relu_signs_`."""
    _check_packed(bits, y.numel(), 1)
    codes = bits.to(torch.int32)
    if y.device.type == "meta":  # NOTE [ Cheap references ]: no table, the same allocations
        words = torch.empty(codes.shape, dtype=torch.int64, device=y.device)
    else:
        words = _keep_table(y.device).index_select(0, codes)
    keep = words.view(torch.int8)[:y.numel()].view(y.shape)
    with torch.no_grad():
        # Passing elements are lifted to the smallest positive normal at least (clamp
        # keeps NaN); then every bit of a blocked element is cleared (+0.0, whatever the
        # recompute gave, NaN included) by an and with its keep mask, 0 or -1 widened
        # with its sign to y's width.
        y.clamp_min_(torch.finfo(y.dtype).tiny)
        y.view(_BITS_OF_SIZE[y.element_size()]).bitwise_and_(keep)


@lru_cache(maxsize=None)
def _field_table(bits: int, device: torch.device) -> torch.Tensor:
    """[256, 8 // bits] uint8: the fields of each byte value (NOTE [ bit fields ])."""
    codes = torch.arange(256, device=device)
    return ((codes[:, None] >> torch.arange(0, 8, bits, device=device)) & (2 ** bits - 1)).to(torch.uint8)


@lru_cache(maxsize=None)
def _keep_table(device: torch.device) -> torch.Tensor:
    """[256] int64: for each byte of ReLU decisions, its 8 keep masks (int8: -1 where
    the forward passed, 0 where it blocked) as the bytes of one little-endian int64."""
    return (-_field_table(1, device).to(torch.int8)).view(torch.int64).view(256)


class _PoolPlan(NamedTuple):
    """How the pool references compute a geometry's offsets (decisions_plan)."""

    bits: int  # per offset
    dtype: torch.dtype  # of the offsets being computed: holds every partial sum
    denominator: int  # L: offsets are computed times L, then divided
    inner: tuple  # input elements per step along each spatial dimension
    a: tuple  # L * window_inner[d] / dilation[d]: each coordinate's coefficient
    coefficients: tuple  # of idx // inner[d], per spatial dimension


@lru_cache(maxsize=256)
def decisions_plan(input_size: tuple, kernel_size: tuple, stride: tuple, padding: tuple, dilation: tuple,
                   output_size: tuple) -> _PoolPlan:
    """The arithmetic of :func:`encode_max_pool_ref` for a geometry (no tensors)."""
    dims = len(kernel_size)
    inner = tuple(math.prod(input_size[d + 1:]) for d in range(dims))
    window_inner = [math.prod(kernel_size[d + 1:]) for d in range(dims)]
    # offset = sum_d window_inner[d] * (i_d - start_d) / dilation[d]; times L every
    # coefficient is an integer and every term a multiple of L.
    denominator = math.lcm(*dilation)
    a = tuple(window_inner[d] * denominator // dilation[d] for d in range(dims))
    # With q_d = idx // inner[d], i_d = q_d - input_size[d] * q_{d-1}, so
    # sum_d a_d i_d = sum_d q_d (a_d - a_{d+1} input_size[d+1]) (a_dims = 0).
    coefficients = tuple(a[d] - (a[d + 1] * input_size[d + 1] if d + 1 < dims else 0) for d in range(dims))
    span = (sum(abs(c) for c in coefficients) + sum(a)) * (math.prod(input_size) + 1) + sum(
        a[d] * (output_size[d] * stride[d] + padding[d]) for d in range(dims))
    dtype = torch.int16 if span < 2 ** 15 else torch.int32 if span < 2 ** 31 else torch.int64
    return _PoolPlan(field_bits(math.prod(kernel_size)), dtype, denominator, inner, a, coefficients)


class _PoolTables(NamedTuple):
    """A pool's reference tables on one device (decisions_tables)."""

    starts: torch.Tensor  # L * (window start's part of the offset) per output position
    corner: torch.Tensor  # int64 flat index of each window's first element per output position
    winners: torch.Tensor  # int64 [256, 8 // bits]: the flat index step of each field of a byte
    shifts: torch.Tensor  # of each field of a byte (NOTE [ bit fields ]), in the plan's dtype


@lru_cache(maxsize=64)
def decisions_tables(input_size: tuple, kernel_size: tuple, stride: tuple, padding: tuple, dilation: tuple,
                     output_size: tuple, device: torch.device) -> _PoolTables:
    """What the pool references read of a geometry, made once per device (a few small
    tensors of the output's spatial size); never for meta tensors."""
    plan = decisions_plan(input_size, kernel_size, stride, padding, dilation, output_size)
    dims = len(kernel_size)
    starts = torch.zeros((), dtype=torch.int64, device=device)
    corner = torch.zeros((), dtype=torch.int64, device=device)
    for d in range(dims):
        start = (torch.arange(output_size[d], device=device) * stride[d] - padding[d]).view(
            -1, *([1] * (dims - 1 - d)))
        starts = starts + start * plan.a[d]
        corner = corner + start * plan.inner[d]
    offsets = torch.arange(256, device=device)
    steps = sum(((offsets // math.prod(kernel_size[d + 1:])) % kernel_size[d]) * (dilation[d] * plan.inner[d])
                for d in range(dims))
    bits = plan.bits
    winners = steps[_field_table(bits, device).long()] if bits < 8 else steps.view(256, 1)
    shifts = torch.arange(0, 8, bits, dtype=plan.dtype, device=device)
    return _PoolTables(starts.to(plan.dtype), corner, winners.contiguous(), shifts)


def _geometry_key(indices, input_size, kernel_size, stride, padding, dilation) -> tuple:
    dims = len(kernel_size)
    return (tuple(int(v) for v in input_size), tuple(kernel_size), tuple(stride), tuple(padding), tuple(dilation),
            tuple(indices.shape[-dims:]))


def encode_max_pool_ref(indices: torch.Tensor, input_size: tuple, kernel_size: tuple, stride: tuple,
                        padding: tuple, dilation: tuple) -> torch.Tensor:
    """The specification of :func:`encode_max_pool`: ``offset = sum_d window_inner_d *
    (i_d - start_d) / dilation_d`` over the spatial dimensions d, ``i_d`` the winner's
    coordinate and ``start_d`` its window's first, packed as NOTE [ bit fields ]."""
    key = _geometry_key(indices, input_size, kernel_size, stride, padding, dilation)
    plan = decisions_plan(*key)
    tables = None if indices.device.type == "meta" else decisions_tables(*key, indices.device)
    bits, (*outer, last) = plan.bits, plan.coefficients
    per_byte, n, dims = 8 // bits, indices.numel(), len(kernel_size)
    scaled = torch.empty(-(-n // per_byte) * per_byte, dtype=plan.dtype, device=indices.device)
    offsets = scaled[:n].view(indices.shape)
    if outer:
        torch.div(indices, plan.inner[0], rounding_mode="floor", out=offsets)
        if last == 1:  # the last dilation is the lcm of all (every dilation 1, say): one op
            torch.add(indices, offsets, alpha=outer[0], out=offsets)
        else:
            offsets.mul_(outer[0]).add_(indices, alpha=last)
        if dims == 3:
            middle = torch.div(indices, plan.inner[1], rounding_mode="floor", out=torch.empty_like(offsets))
            offsets.add_(middle, alpha=outer[1])
        if tables is not None:
            offsets.sub_(tables.starts)
    elif tables is not None:  # one dimension: its coefficient L / dilation is 1
        torch.sub(indices, tables.starts, out=offsets)
    if plan.denominator != 1:
        offsets.div_(plan.denominator, rounding_mode="floor")  # exact
    if bits == 8:
        return scaled.to(torch.uint8)
    if n % per_byte:
        scaled[n:].zero_()  # padding fields are 0
    fields = scaled.view(-1, per_byte)
    if tables is not None:
        fields.bitwise_left_shift_(tables.shifts)
    return fields.sum(1, dtype=torch.uint8)


def decode_max_pool_ref_(indices: torch.Tensor, packed: torch.Tensor, input_size: tuple, kernel_size: tuple,
                         stride: tuple, padding: tuple, dilation: tuple) -> None:
    """The specification of :func:`decode_max_pool_`: ``indices`` = the window's first
    element's flat index plus its offset's flat step."""
    key = _geometry_key(indices, input_size, kernel_size, stride, padding, dilation)
    bits = decisions_plan(*key).bits
    per_byte, n = 8 // bits, indices.numel()
    _check_packed(packed, n, bits)
    codes = packed.to(torch.int32)
    if indices.device.type == "meta":  # every step below writes into indices: nothing to allocate
        return
    tables = decisions_tables(*key, indices.device)
    target = indices if indices.is_contiguous() else torch.empty(indices.shape, dtype=torch.int64,
                                                                 device=indices.device)
    flat, whole = target.view(-1), n // per_byte
    with torch.no_grad():
        torch.index_select(tables.winners, 0, codes[:whole], out=flat[:whole * per_byte].view(whole, per_byte))
        if n % per_byte:
            flat[whole * per_byte:] = tables.winners[codes[whole:].long(), :n % per_byte].view(-1)
        target.add_(tables.corner)
        if target is not indices:
            indices.copy_(target)


def gather_max_pool_ref_(pooled: torch.Tensor, x: torch.Tensor, indices: torch.Tensor, dims: int) -> None:
    """The specification of :func:`gather_max_pool_`."""
    with torch.no_grad():  # a correction, not an operation of the graph: nothing saved
        planes = x.detach().flatten(-dims) if dims > 1 else x.detach()
        index = indices.reshape(*planes.shape[:-1], -1)
        pooled = pooled.detach()
        if pooled.is_contiguous() and pooled.dtype == x.dtype:
            torch.gather(planes, -1, index, out=pooled.view(index.shape))
        else:
            pooled.copy_(planes.gather(-1, index).view(pooled.shape))
