"""Dividing by sizes known at launch inside a kernel, by a multiply and a shift
(NOTE [ Division by an invariant ]): the max-pool kernels find each element's
coordinates so (decisions/max_pool.py), and the codec kernels each element's channel
(_channel_means.py).
"""
from functools import lru_cache

import triton
import triton.language as tl

# Dividends and divisors are int32: below 2**31.
MAX_INT32 = 2 ** 31 - 1


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
    return multiplier_and_shift(d)


def multiplier_and_shift(d: int) -> tuple:
    """:func:`division_constants` for any ``d >= 1`` (the bound holds for every d; a
    caller that divides only below 2**31 may pass larger sizes it never divides by)."""
    shift = (d - 1).bit_length()
    return -(-(1 << (31 + shift)) // d), shift


def int32_bits(multiplier: int) -> int:
    """A uint32 multiplier as the int32 of its bits: the JIT would type an argument of
    2**31 or more int64."""
    return multiplier - (1 << 32) if multiplier > MAX_INT32 else multiplier


@lru_cache(maxsize=1024)
def divisor(name: str, d: int) -> dict:
    """A kernel's arguments for dividing by ``d``: the multiplier as the int32 of its
    bits (an int32 argument: the JIT would type a value of 2**31 or more int64). Cached:
    the dict is read, never changed."""
    multiplier, shift = division_constants(d)
    return {name: d, f"{name}_multiplier": int32_bits(multiplier), f"{name}_shift": shift}


@triton.jit
def divide(n, multiplier, shift):
    """NOTE [ Division by an invariant ]: n // d for int32 0 <= n < 2**31, given d's
    multiplier (the bits of a uint32, passed as an int32) and shift: the high half of
    2n * multiplier, shifted."""
    doubled = (n << 1).to(tl.uint32, bitcast=True)  # 2n < 2**32: exact as a uint32
    high = tl.umulhi(doubled, multiplier.to(tl.uint32, bitcast=True))
    # shift stays as passed: a launch may specialize a shift of 1 into a constexpr.
    return (high >> shift).to(tl.int32, bitcast=True)
