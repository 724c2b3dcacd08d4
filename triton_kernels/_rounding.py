"""Rounding half to even, exact on every backend, and the bit-level helpers it is
written with.

NOTE [ Round half to even ]
Every rounding (int8 codes, fp8 codes, fp32 -> bf16
output) is to nearest, ties to even, and exact on every backend. Triton's interpreter
has no ``rint`` and mis-rounds fp32 -> fp8 / bf16 casts, so the kernels round with
IEEE adds (which round half to even) and integer bits: int8 codes by adding 1.5 *
2**23 (``integer_code_bits``), fp8 codes by rounding fp32's significand on its bits,
and below the smallest normal by an add whose ulp is the step (fp8's
``_fp8_magnitude_code``). fp32 -> bf16 is ``.to`` on CUDA (cvt.rn) and
``float32_to_bfloat16_rne``, on bits, under the interpreter.

Every step of the codecs is a correctly rounded IEEE operation (``div_rn`` once per
group, a single multiply or add per value, no fused multiply-add: ``LAUNCH_OPTIONS`` in
_tile.py), so kernels and references agree bit for bit on CPU, under the interpreter
and on CUDA.
"""
import triton
import triton.language as tl


@triton.jit
def integer_code_bits(scaled, UNSIGNED: tl.constexpr):
    """NOTE [ Round half to even ] of finite values onto the integers, within +-255.5: an
    fp32 add rounds half to even, and adding 1.5 * 2**23 (or 2**23, values >= 0 on
    the unsigned grid, negative ones saturating at 0) leaves the sum in a binade whose
    step is 1, so that its low byte is the code's two's complement byte (or the code
    0..255). Returned as the sum's bits; storing them as 8 bits keeps that byte."""
    if UNSIGNED:
        return (tl.maximum(scaled, 0.0) + 8388608.0).to(tl.int32, bitcast=True)
    return (scaled + 12582912.0).to(tl.int32, bitcast=True)


@triton.jit
def shift_right_rne(m, shift):
    """NOTE [ Round half to even ]: m / 2**shift rounded half to even, for int32 m >= 0,
    1 <= shift <= 31 and m + 2**(shift - 1) < 2**31. Adding one half minus one unit,
    plus the lowest kept bit, carries into the kept bits exactly when the dropped ones
    are above one half, or are one half and the kept value is odd."""
    half_minus_one = (1 << (shift - 1)) - 1
    kept_is_odd = (m >> shift) & 1
    return (m + half_minus_one + kept_is_odd) >> shift


@triton.jit
def magnitude_bits(x):
    """The bits of |x| of an fp32 x, as a non-negative int32 (ordered like |x|)."""
    return x.to(tl.int32, bitcast=True) & 0x7FFFFFFF


@triton.jit
def float32_to_bfloat16_rne(y):
    """bf16 nearest to fp32 y, ties to even (the interpreter's `.to` truncates). bf16
    shares fp32's exponent range, so rounding away the low 16 bits is the whole
    conversion, subnormals and overflow to inf included."""
    abs_bits = magnitude_bits(y)
    is_nan = abs_bits > 0x7F800000
    rounded = shift_right_rne(tl.where(is_nan, 0, abs_bits), 16)
    sign = (y.to(tl.int32, bitcast=True) >> 16) & 0x8000
    bits = sign | tl.where(is_nan, 0x7FC0, rounded)
    return bits.to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def store_rounded(out_ptrs, y, mask, INTERPRETED: tl.constexpr):
    """Store fp32 y converted to the output dtype, rounding half to even. `.to` does on
    CUDA (cvt.rn) and, for fp16, in the interpreter; the interpreter's bf16 `.to`
    truncates, so there it is float32_to_bfloat16_rne."""
    if INTERPRETED:
        if out_ptrs.dtype.element_ty == tl.bfloat16:
            y = float32_to_bfloat16_rne(y)
    tl.store(out_ptrs, y.to(out_ptrs.dtype.element_ty), mask=mask)
