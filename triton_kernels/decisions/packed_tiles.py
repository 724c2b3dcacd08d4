"""What the decision kernels share (relu_signs.py, bounds.py, max_pool.py): the tile of
packed bytes a program owns and the launch options, the fields packed into bytes and
unpacked (NOTE [ Bit fields ] in bitfields.py), a float's bits loaded and stored, the
checks a launcher makes of its inputs, and the byte table of the references (NOTE
[ Cheap references ]).

A program owns ``packed_rows(bits, wide_bytes)`` packed bytes, the rows of its tile;
the ``8 // bits`` fields of row r are those of elements ``r * (8 // bits)`` upward.
"""
from functools import lru_cache
from typing import NamedTuple

import torch
import triton
import triton.language as tl

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
# Compile options of every launch (and of the ahead-of-time builds that check them).
# The kernels are integer-only: nothing for FMA fusion to change.
LAUNCH_OPTIONS = {"num_warps": NUM_WARPS}
# The integer dtype a gather copies the bits of an element of each size as.
BITS_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def packed_bytes_per_thread(bits: int, wide_bytes: int) -> int:
    """Packed bytes a thread owns, for fields of ``bits`` over a wide stream of
    ``wide_bytes`` per element: 16, or fewer where the wide stream would exceed
    WIDE_BYTES_PER_THREAD."""
    per_byte = 8 // bits
    return max(1, min(PACKED_BYTES_PER_THREAD, WIDE_BYTES_PER_THREAD // (per_byte * wide_bytes)))


def packed_rows(bits: int, wide_bytes: int) -> int:
    """Packed bytes per program (a power of two)."""
    return packed_bytes_per_thread(bits, wide_bytes) * 32 * NUM_WARPS


@triton.jit
def load_bits(ptrs, mask):
    """The bits of the floats at ``ptrs`` (fp32, bf16 or fp16) as signed integers of
    their width, 0 where masked off (+0.0's bits). The kernels take the float tensor
    and reinterpret it here, for free: a launcher that viewed it as integers would run
    an operator of the host's at every launch (and a detach where it needs grad)."""
    values = tl.load(ptrs, mask=mask, other=0.0)
    # One branch only is compiled, the test being on a type; code after a return in it
    # would be compiled too.
    if ptrs.dtype.element_ty == tl.float32:
        bits = values.to(tl.int32, bitcast=True)
    else:
        bits = values.to(tl.int16, bitcast=True)
    return bits


@triton.jit
def store_bits(ptrs, bits, mask):
    """Store integer ``bits`` of the width of the floats at ``ptrs`` as those floats."""
    tl.store(ptrs, bits.to(ptrs.dtype.element_ty, bitcast=True), mask=mask)


@triton.jit
def program_rows(ROWS: tl.constexpr):
    """This program's packed bytes, as int64 offsets (no wrap past 2**31 elements)."""
    return tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)


@triton.jit
def field_positions(rows, PER_BYTE: tl.constexpr):
    """[rows, PER_BYTE]: the element each field of each packed byte holds."""
    return rows[:, None] * PER_BYTE + tl.arange(0, PER_BYTE)[None, :]


@triton.jit
def pack_fields(fields, BITS: tl.constexpr):
    """NOTE [ Bit fields ]: [rows, 8 // BITS] fields, each below 2**BITS, as [rows]
    bytes (int32), field j in bits j * BITS upward. The fields' bits are disjoint, so
    their sum is their OR."""
    shifts = tl.arange(0, 8 // BITS) * BITS
    return tl.sum(fields.to(tl.int32) << shifts[None, :], axis=1)


@triton.jit
def unpack_fields(packed, BITS: tl.constexpr):
    """The inverse of pack_fields: [rows] bytes -> [rows, 8 // BITS] fields (int32)."""
    shifts = tl.arange(0, 8 // BITS) * BITS
    return (packed.to(tl.int32)[:, None] >> shifts[None, :]) & ((1 << BITS) - 1)


# ----------------------------------------------------------------- host helpers


def launchable(*tensors) -> bool:
    """Tensors a kernel can take as flat arrays: contiguous, with elements, and holding
    their values in memory (no negative bit: ``torch._neg_view``)."""
    return all(t.is_contiguous() and not t.is_neg() for t in tensors) and tensors[0].numel() > 0


def empty_packed(count: int, bits: int, device) -> torch.Tensor:
    return torch.empty(-(-count * bits // 8), dtype=torch.uint8, device=device)


class Launch(NamedTuple):
    """What a launch of a packing kernel takes besides its tensors, worked out once per
    dtype or pool geometry (the host's time per launch counts: a step launches one per
    ReLU output kept)."""

    bits: int  # per field
    rows: int  # packed bytes per program
    arguments: dict  # the kernel's scalar arguments and constexprs, the launch options


def check_packed(packed: torch.Tensor, count: int, bits: int) -> None:
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
#   the output position, is a small cached table (max_pool.decisions_tables).
# - Tables are made once per device and kept (a tracker of live bytes, LiveBytes or
#   MemTracker, sees them made once: the planner's profile makes them before it
#   measures). Meta tensors hold no data: there the references use no table and make
#   the same allocations, so an estimate does not depend on what ran before it.


@lru_cache(maxsize=None)
def field_table(bits: int, device: torch.device) -> torch.Tensor:
    """[256, 8 // bits] uint8: the fields of each byte value (NOTE [ Bit fields ])."""
    codes = torch.arange(256, device=device)
    return ((codes[:, None] >> torch.arange(0, 8, bits, device=device)) & (2 ** bits - 1)).to(torch.uint8)
