"""The ReLU decision kernels: a ReLU output's decisions packed in the forward and
restored after the recompute (actsave/runtime/relu_signs.py), with their launchers and
torch references.

- ``pack_relu_signs(y)``: one bit per element of a ReLU output, ``not (y <= 0)``
  (``threshold_backward``'s test: NaN passes). Reads the output once, writes the bits.
- ``restore_relu_signs_(y, bits)``: a recomputed ReLU output corrected in place to
  those decisions: 0 where the forward blocked, ``max(y, finfo.tiny)`` where it passed
  (the smallest positive normal lifts a recomputed zero; NaN stays NaN).
"""
from functools import lru_cache

import torch
import triton
import triton.language as tl

from .. import _launch
from .packed_tiles import (
    BITS_OF_SIZE,
    LAUNCH_OPTIONS,
    Launch,
    check_packed,
    field_positions,
    field_table,
    launchable,
    load_bits,
    pack_fields,
    packed_rows,
    program_rows,
    store_bits,
    unpack_fields,
)

# The float dtypes whose bits the ReLU kernels read (load_bits), and their constexprs:
# the magnitude mask, +inf's bits and the smallest positive normal's bits.
_RELU_DTYPES = {
    torch.float32: {"MAGNITUDE": 0x7FFFFFFF, "INF_BITS": 0x7F800000, "TINY_BITS": 0x00800000},
    torch.bfloat16: {"MAGNITUDE": 0x7FFF, "INF_BITS": 0x7F80, "TINY_BITS": 0x0080},
    torch.float16: {"MAGNITUDE": 0x7FFF, "INF_BITS": 0x7C00, "TINY_BITS": 0x0400},
}


def relu_constexprs(dtype: torch.dtype) -> dict:
    """The ReLU kernels' constexprs for an output of ``dtype`` (fp32, bf16 or fp16)."""
    return dict(_RELU_DTYPES[dtype])


# ----------------------------------------------------------------- kernels


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
def _pack_relu_signs_kernel(y_ptr, bits_ptr, numel, packed_bytes, MAGNITUDE: tl.constexpr,
                            INF_BITS: tl.constexpr, TINY_BITS: tl.constexpr, ROWS: tl.constexpr):
    rows = program_rows(ROWS)
    positions = field_positions(rows, 8)
    y = load_bits(y_ptr + positions, positions < numel)  # +0.0 does not pass: padding bits are 0
    packed = pack_fields(_passes(y, MAGNITUDE, INF_BITS), 1)
    tl.store(bits_ptr + rows, packed.to(tl.uint8), mask=rows < packed_bytes)


@triton.jit
def _restore_relu_signs_kernel(y_ptr, bits_ptr, numel, packed_bytes, MAGNITUDE: tl.constexpr,
                               INF_BITS: tl.constexpr, TINY_BITS: tl.constexpr, ROWS: tl.constexpr):
    rows = program_rows(ROWS)
    passed = unpack_fields(tl.load(bits_ptr + rows, mask=rows < packed_bytes, other=0), 1)
    positions = field_positions(rows, 8)
    in_bounds = positions < numel
    y = load_bits(y_ptr + positions, in_bounds)
    restored = tl.where(passed != 0, _lifted(y, MAGNITUDE, INF_BITS, TINY_BITS), 0)
    store_bits(y_ptr + positions, restored.to(y.dtype), in_bounds)


# ----------------------------------------------------------------- launchers


_RELU_LAUNCHES = {dtype: Launch(1, packed_rows(1, dtype.itemsize),
                                 {**constants, "ROWS": packed_rows(1, dtype.itemsize), **LAUNCH_OPTIONS})
                  for dtype, constants in _RELU_DTYPES.items()}


def pack_relu_signs(y: torch.Tensor) -> torch.Tensor:
    """The decisions of a ReLU output ``y``, one bit per element (uint8, 1-D,
    ``ceil(numel / 8)`` bytes): ``not (y <= 0)``, row-major. ``y`` may need grad (a
    ReLU output as autograd saves it): the kernel reads its memory, no operator of a
    graph, and the reference reads it detached."""
    launch = _RELU_LAUNCHES.get(y.dtype)
    if launch is None or not launchable(y):
        return pack_relu_signs_ref(y)
    n = y.numel()
    packed_bytes = -(-n // 8)
    bits = torch.empty(packed_bytes, dtype=torch.uint8, device=y.device)
    if y.device.type != "meta":
        _launch.launch(_pack_relu_signs_kernel, (-(-packed_bytes // launch.rows),), y, bits, n,
                       packed_bytes, **launch.arguments)
    return bits


def restore_relu_signs_(y: torch.Tensor, bits: torch.Tensor) -> None:
    """Correct a recomputed ReLU output ``y`` in place to the decisions ``bits`` (as
    :func:`pack_relu_signs` gives them): 0 where the forward blocked; where it passed,
    ``max(y, torch.finfo(y.dtype).tiny)``, NaN staying NaN. ``y`` may need grad: the
    kernel writes its memory, no operator of a graph (nor a version the tensor's
    counter sees), and the reference changes it detached."""
    launch = _RELU_LAUNCHES.get(y.dtype)
    if launch is None or bits.dtype != torch.uint8 or not launchable(y, bits):
        return restore_relu_signs_ref_(y.detach() if y.requires_grad else y, bits)
    n, packed_bytes = y.numel(), bits.numel()
    check_packed(bits, n, 1)
    if y.device.type != "meta":
        _launch.launch(_restore_relu_signs_kernel, (-(-packed_bytes // launch.rows),), y, bits,
                       n, packed_bytes, **launch.arguments)


# ----------------------------------------------------------------- torch references


# The byte gather of NOTE [ Cheap references ] (packed_tiles.py).
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
    check_packed(bits, y.numel(), 1)
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
        y.view(BITS_OF_SIZE[y.element_size()]).bitwise_and_(keep)


@lru_cache(maxsize=None)
def _keep_table(device: torch.device) -> torch.Tensor:
    """[256] int64: for each byte of ReLU decisions, its 8 keep masks (int8: -1 where
    the forward passed, 0 where it blocked) as the bytes of one little-endian int64."""
    return (-field_table(1, device).to(torch.int8)).view(torch.int64).view(256)
