"""The max-pool decision kernels: each window's winner as its offset within the
window, encoded from and decoded into the int64 indices a max pool returns, and a max
pool's output gathered at those decisions (actsave/runtime/pool_decisions.py, NOTE
[ Max-pool decisions ]), with their launchers and torch references.

- ``encode_max_pool(indices, input_size, kernel_size, stride, padding, dilation)``: the
  offset of each window's winner within its window (row-major over the window's
  elements), from the int64 ``indices`` max pooling returns (flat per plane over
  ``input_size``), packed in :func:`bitfields.field_bits` bits.
- ``decode_max_pool_(indices, packed, input_size, ...)``: those offsets back into
  ``indices``, in place.
- ``gather_max_pool_(pooled, x, indices, dims)``: ``pooled`` set to ``x`` at
  ``indices``, in place: a max pool's output at those decisions (indices within their
  plane, as a max pool gives them).

A kernel sees a pool through its :class:`PoolGeometry`: up to three spatial dimensions,
right aligned; the window's sizes are constexprs (a kernel per window), the sizes of the
input and of the output runtime arguments, divided by a multiply and a shift
(_division.py).
"""
import math
from functools import lru_cache
from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from .. import _launch
from ..bitfields import field_bits
from .._division import MAX_INT32, divide, divisor
from .packed_tiles import (
    BITS_OF_SIZE,
    LAUNCH_OPTIONS,
    NUM_WARPS,
    Launch,
    check_packed,
    empty_packed,
    field_positions,
    field_table,
    launchable,
    pack_fields,
    packed_rows,
    program_rows,
    unpack_fields,
)

# The gather of a pooled output: 16 elements per thread, its int64 indices in 8
# vectors, its values in 16-byte vectors (fp32: 4, half: 2).
GATHER_ELEMENTS_PER_THREAD = 16
GATHER_BLOCK = GATHER_ELEMENTS_PER_THREAD * 32 * NUM_WARPS
# Positions, plane sizes and in-plane coordinates are int32 in the pool kernels (NOTE
# [ Division by an invariant ]): pooled outputs of 2**31 elements (16 GiB of indices)
# and more go to the references. The kernels take pools of one to three spatial
# dimensions.
MAX_POOL_DIMS = 3


# ----------------------------------------------------------------- jit helpers


@triton.jit
def _coordinates(position, inner_0, inner_0_multiplier, inner_0_shift, inner_1, inner_1_multiplier,
                 inner_1_shift, DIMS: tl.constexpr):
    """(c0, c1, c2) of an int32 flat position in a box of up to three dimensions, the
    last DIMS of them used (the leading ones 0); ``inner_0`` and ``inner_1`` are the
    elements per step along dimensions 0 and 1 (the sizes of what lies inside)."""
    zero = tl.zeros_like(position)
    c0 = zero
    if DIMS == 3:
        c0 = divide(position, inner_0_multiplier, inner_0_shift)
        position = position - c0 * inner_0
    c1 = zero
    if DIMS >= 2:
        c1 = divide(position, inner_1_multiplier, inner_1_shift)
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
    rows = program_rows(ROWS)
    wide_positions = field_positions(rows, 8 // BITS)
    in_bounds = wide_positions < numel
    winners = tl.load(indices_ptr + wide_positions, mask=in_bounds, other=0).to(tl.int32)
    positions = wide_positions.to(tl.int32)  # numel <= MAX_INT32 (the launcher's check)
    in_plane = positions - divide(positions, plane_multiplier, plane_shift) * plane
    o0, o1, o2 = _coordinates(in_plane, out_inner_0, out_inner_0_multiplier, out_inner_0_shift,
                              out_inner_1, out_inner_1_multiplier, out_inner_1_shift, DIMS)
    i0, i1, i2 = _coordinates(winners, in_inner_0, in_inner_0_multiplier, in_inner_0_shift,
                              in_inner_1, in_inner_1_multiplier, in_inner_1_shift, DIMS)
    offsets = (_window_step(i0, o0, S0, P0, D0) * (K1 * K2) + _window_step(i1, o1, S1, P1, D1) * K2
               + _window_step(i2, o2, S2, P2, D2))
    packed = pack_fields(tl.where(in_bounds, offsets, 0), BITS)
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
    rows = program_rows(ROWS)
    offsets = unpack_fields(tl.load(packed_ptr + rows, mask=rows < packed_bytes, other=0), BITS)
    wide_positions = field_positions(rows, 8 // BITS)
    in_bounds = wide_positions < numel
    positions = wide_positions.to(tl.int32)
    in_plane = positions - divide(positions, plane_multiplier, plane_shift) * plane
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
    planes = divide(wide_positions.to(tl.int32), plane_multiplier, plane_shift)
    values = tl.load(x_ptr + (planes.to(tl.int64) * input_plane + winners), mask=in_bounds)
    tl.store(pooled_ptr + wide_positions, values, mask=in_bounds)


# ----------------------------------------------------------------- host helpers


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
        return {**divisor("plane", math.prod(o)), **divisor("out_inner_0", o[1] * o[2]),
                **divisor("out_inner_1", o[2]), **divisor("in_inner_0", i[1] * i[2]),
                **divisor("in_inner_1", i[2])}

    def constexprs(self) -> dict:
        """The constexprs of the encode and decode kernels (a kernel per window)."""
        k, s, p, d = self.kernel_size, self.stride, self.padding, self.dilation
        return {"DIMS": self.dims, "K1": k[1], "K2": k[2], "S0": s[0], "S1": s[1], "S2": s[2],
                "P0": p[0], "P1": p[1], "P2": p[2], "D0": d[0], "D1": d[1], "D2": d[2], "BITS": self.bits,
                "ROWS": packed_rows(self.bits, 8)}


@lru_cache(maxsize=256)
def _pool_launch(indices_shape: torch.Size, input_size: tuple, kernel_size: tuple, stride: tuple, padding: tuple,
                 dilation: tuple) -> Optional[Launch]:
    geometry = PoolGeometry.of(indices_shape, input_size, kernel_size, stride, padding, dilation)
    if geometry is None:
        return None
    constexprs = geometry.constexprs()
    return Launch(geometry.bits, constexprs["ROWS"], {**geometry.arguments(), **constexprs, **LAUNCH_OPTIONS})


def _pool_launch_of(indices: torch.Tensor, input_size, kernel_size, stride, padding, dilation) -> Optional[Launch]:
    """The pool kernels' launch for these indices, or None where they cannot take them."""
    if indices.dtype != torch.int64 or not launchable(indices) or indices.numel() > MAX_INT32:
        return None
    try:
        launch = _pool_launch(indices.shape, tuple(input_size), tuple(kernel_size), tuple(stride), tuple(padding),
                              tuple(dilation))
    except TypeError:  # unhashable geometry (lists of lists): not a pool's
        return None
    return launch if launch is not None and math.prod(input_size) <= MAX_INT32 else None


# ----------------------------------------------------------------- launchers


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
    packed = empty_packed(n, launch.bits, indices.device)
    if indices.device.type != "meta":
        _launch.launch(_encode_max_pool_kernel, (-(-packed.numel() // launch.rows),), indices, packed, n,
                       packed.numel(), **launch.arguments)
    return packed


def decode_max_pool_(indices: torch.Tensor, packed: torch.Tensor, input_size: tuple, kernel_size: tuple,
                     stride: tuple, padding: tuple, dilation: tuple) -> None:
    """Overwrite ``indices`` (int64, of the encoded indices' shape) with the decisions
    :func:`encode_max_pool` packed."""
    launch = _pool_launch_of(indices, input_size, kernel_size, stride, padding, dilation)
    if launch is None or packed.dtype != torch.uint8 or not launchable(packed):
        return decode_max_pool_ref_(indices, packed, input_size, kernel_size, stride, padding, dilation)
    n = indices.numel()
    check_packed(packed, n, launch.bits)
    if indices.device.type != "meta":
        _launch.launch(_decode_max_pool_kernel, (-(-packed.numel() // launch.rows),), indices, packed, n,
                       packed.numel(), **launch.arguments)


def gather_max_pool_(pooled: torch.Tensor, x: torch.Tensor, indices: torch.Tensor, dims: int) -> None:
    """Set ``pooled`` to ``x`` at ``indices`` (flat over the last ``dims`` dimensions of
    ``x``; ``indices`` shaped like ``pooled``), in place."""
    pooled, x = pooled.detach(), x.detach()
    if (pooled.dtype != x.dtype or x.element_size() not in BITS_OF_SIZE or indices.dtype != torch.int64
            or not launchable(pooled, x, indices) or not _gatherable(pooled, x, indices, dims)):
        return gather_max_pool_ref_(pooled, x, indices, dims)
    if pooled.device.type != "meta":
        as_bits, n = BITS_OF_SIZE[x.element_size()], pooled.numel()
        _launch.launch(_gather_max_pool_kernel, (-(-n // GATHER_BLOCK),), pooled.view(as_bits), x.view(as_bits),
                       indices, n, math.prod(x.shape[-dims:]), **divisor("plane", math.prod(pooled.shape[-dims:])),
                       BLOCK=GATHER_BLOCK, **LAUNCH_OPTIONS)


def _gatherable(pooled, x, indices, dims) -> bool:
    return (1 <= dims <= x.dim() and pooled.shape == indices.shape and pooled.dim() == x.dim()
            and pooled.shape[:-dims] == x.shape[:-dims] and pooled.numel() <= MAX_INT32
            and math.prod(pooled.shape[-dims:]) > 0)


# ----------------------------------------------------------------- torch references


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
    shifts: torch.Tensor  # of each field of a byte (NOTE [ Bit fields ]), in the plan's dtype


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
    winners = steps[field_table(bits, device).long()] if bits < 8 else steps.view(256, 1)
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
    coordinate and ``start_d`` its window's first, packed as NOTE [ Bit fields ]."""
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
    check_packed(packed, n, bits)
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
