"""Per-group fp8 codec (e4m3 or e5m2): 8 bits per element plus one fp32 scale per group.

Format: the tensor is flattened row-major and cut into groups of ``group_size``
elements (a power of two; the last group may be partial). Each group stores
``scale = absmax / FP8_MAX`` (fp32; 448 for e4m3, 57344 for e5m2) and one byte per
element: the bit pattern of ``x * (FP8_MAX / absmax)``, the group's multiplier taken
once (NOTE [ Scale rule ]: no value passes +-FP8_MAX), in ``torch.float8_e4m3fn`` (1 sign,
4 exponent, 3 mantissa bits, no inf) or ``torch.float8_e5m2`` (1, 5, 2), rounded half
to even. Decoding is ``fp8_value(code) * scale`` in fp32,
rounded half to even to the requested dtype. NOTE [ Scale rule ] in ``_scale`` keeps
a scale near the fp32 maximum from decoding to inf, and flags, by the scale's sign
bit, a group holding inf or NaN; there +-inf and NaN take the codes of ``_Fp8Format.non_finite`` (NOTE
[ Non-finite groups ]) and the scale maps the finite absmax onto the largest magnitude
left below them.

Unsigned variants (NOTE [ Unsigned grids ]), for tensors known to be non-negative: "ue4m4"
(4 exponent, 4 mantissa bits, no sign: e4m3's binades, min normal 2**-6, largest 496)
and "ue5m3" (e5m2's binades, min normal 2**-14, largest 122880). Every one of their 256
codes is finite; codes ascend with the value, code ``2**mantissa_bits`` being the
smallest normal. ``scale = absmax / largest``; in a group holding inf or NaN the
signed format's codes (e4m3, e5m2) are stored instead. Doubling an e4m3 (e5m2) code
below its specials gives the ue4m4 (ue5m3) code of the same value.

The scale itself is stored, so that decoding is one multiply; encoding multiplies by
the group's multiplier, one correctly rounded division per group rather than one per
value (NOTE [ Scale rule ]). The kernels encode and decode fp8 on the bits, with
integer arithmetic and exact or half-to-even fp32 adds and multiplies, never an fp8
cast (the interpreter's fp32 -> fp8 cast mis-rounds, NOTE [ Round half to even ]; this
also runs on GPUs without fp8 hardware).
``encode_fp8_ref`` / ``decode_fp8_ref`` are the specification, written with torch's
own fp8 casts; the kernels match them bit for bit.
"""
import functools
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from . import DEFAULT_GROUP_SIZE
from ._channel_means import channel_means, decoded_channel_means, largest_finite
from ._rounding import store_rounded
from ._scale import (
    NonFiniteCodes,
    any_flagged_ref,
    dequantize,
    dequantize_ref,
    group_scale,
    group_scale_ref,
    is_flagged,
    is_flagged_ref,
    none_flagged,
    plain_dequantize,
    plain_group_scale,
    scaled_ref,
    with_non_finite_codes,
    with_non_finite_codes_ref,
)
from ._tile import (
    Constexprs,
    centered_input_ref,
    check_signs,
    empty_encoding,
    empty_signs,
    flat_codes,
    kernel_input,
    launch,
    load_decoder_tile,
    load_encoder_tile,
    store_relu_signs,
    with_signs,
)
from .decisions.relu_signs import pack_relu_signs_ref


@dataclass(frozen=True)
class _Fp8Format:
    """What the kernels need to know of an fp8 format."""

    torch_dtype: torch.dtype
    max_value: float  # largest finite value; the scale maps a group's absmax onto it
    mantissa_bits: int
    min_normal_exponent: int  # log2 of the smallest normal value
    first_special_code: int  # the magnitude codes from here up are inf or NaN
    non_finite: NonFiniteCodes  # NOTE [ Non-finite groups ]

    # Each built once, not at each launch (shared: read, never changed).
    @functools.cache
    def encode_constexprs(self) -> Constexprs:
        return Constexprs({"FP8_MAX": self.max_value, "MANT_BITS": self.mantissa_bits,
                           "MIN_NORMAL_EXP": self.min_normal_exponent, **_signed_grid_only(self), "SIGNS": False,
                           **self.non_finite.encode_constexprs()})

    @functools.cache
    def decode_constexprs(self) -> Constexprs:
        return Constexprs({"MANT_BITS": self.mantissa_bits, "MIN_NORMAL_EXP": self.min_normal_exponent,
                           "FIRST_SPECIAL": self.first_special_code, **_signed_grid_only(self),
                           **self.non_finite.decode_constexprs()})


@dataclass(frozen=True)
class _UnsignedFp8Format:
    """An unsigned 8-bit float (NOTE [ Unsigned grids ]): no sign, no inf or NaN code,
    the binades of ``signed``, whose encoding its flagged groups use."""

    mantissa_bits: int
    signed: _Fp8Format

    @property
    def min_normal_exponent(self) -> int:
        return self.signed.min_normal_exponent

    @property
    def max_value(self) -> float:
        """The value of code 255."""
        top_exponent = (255 >> self.mantissa_bits) - 1 + self.min_normal_exponent
        return float((2 ** (self.mantissa_bits + 1) - 1) * 2.0 ** (top_exponent - self.mantissa_bits))

    @functools.cache
    def encode_constexprs(self) -> Constexprs:
        return Constexprs({**self.signed.encode_constexprs(), "FP8_MAX": self.max_value, **self._unsigned()})

    @functools.cache
    def decode_constexprs(self) -> Constexprs:
        return Constexprs({**self.signed.decode_constexprs(), **self._unsigned()})

    def _unsigned(self) -> dict:
        return {"UNSIGNED": True, "U_MANT_BITS": self.mantissa_bits}


def _signed_grid_only(spec) -> dict:
    return {"UNSIGNED": False, "U_MANT_BITS": spec.mantissa_bits}


def _value(code, torch_dtype):
    return torch.tensor(code, dtype=torch.uint8).view(torch_dtype).item()


def _non_finite_codes(torch_dtype, max_code):
    """e5m2 keeps its own inf; e4m3fn has none, so in a flagged group its largest
    magnitude (448) stands for inf and finite values stop one step below (416).
    NaN is torch's NaN pattern (0x7F) in both."""
    first_special = max_code + 1
    inf_code = first_special if math.isinf(_value(first_special, torch_dtype)) else max_code
    nan_code = torch.tensor(math.nan).to(torch_dtype).view(torch.uint8).item()
    return NonFiniteCodes(_value(inf_code - 1, torch_dtype), inf_code, inf_code | 0x80, nan_code)


def _fp8_format(torch_dtype):
    """Read from torch, so that the kernels share torch's definition of the format."""
    finfo = torch.finfo(torch_dtype)
    max_code = torch.tensor(finfo.max).to(torch_dtype).view(torch.uint8).item()
    return _Fp8Format(torch_dtype, finfo.max, -int(math.log2(finfo.eps)),
                      int(math.log2(finfo.tiny)), max_code + 1, _non_finite_codes(torch_dtype, max_code))


# Per-group scales leave e5m2's extra exponent bit little to do, so e4m3's extra
# mantissa bit wins, about 6 dB of round-trip SQNR (docs/results.md, "Figures behind
# the code's rules"). Both are offered, as on GPUs with fp8.
FP8_FORMATS = {"e4m3": _fp8_format(torch.float8_e4m3fn), "e5m2": _fp8_format(torch.float8_e5m2)}
# One more mantissa bit in place of the sign (NOTE [ Unsigned grids ]).
UNSIGNED_FP8_FORMATS = {"ue4m4": _UnsignedFp8Format(4, FP8_FORMATS["e4m3"]),
                        "ue5m3": _UnsignedFp8Format(3, FP8_FORMATS["e5m2"])}


@triton.jit
def _float32_to_fp8_bits(scaled, signed_zero, MANT_BITS: tl.constexpr, MIN_NORMAL_EXP: tl.constexpr):
    """fp8 bit pattern of a finite fp32, rounded half to even (NOTE [ Round half to
    even ]); no value passes the largest finite one (NOTE [ Scale rule ]). A zero keeps
    its sign only where ``signed_zero`` (per row: a group whose multiplier is nonzero)."""
    sign = (scaled.to(tl.int32, bitcast=True) >> 24) & tl.where(signed_zero, 0x80, 0)
    return sign | _fp8_magnitude_code(tl.abs(scaled), MANT_BITS, MIN_NORMAL_EXP)


@triton.jit
def _fp8_bits_of_product(x, multiplier, MANT_BITS: tl.constexpr, MIN_NORMAL_EXP: tl.constexpr):
    """_float32_to_fp8_bits of x * multiplier for finite x and a multiplier >= 0 per
    row, [groups, 1, 1]: the magnitude is |x| * multiplier, the same multiply on the
    magnitudes (one instruction, the absolute value an operand modifier), and the sign
    x's own, kept where the multiplier is nonzero."""
    sign = (x.to(tl.int32, bitcast=True) >> 24) & tl.where(multiplier > 0, 0x80, 0)
    return sign | _fp8_magnitude_code(tl.abs(x) * multiplier, MANT_BITS, MIN_NORMAL_EXP)


@triton.jit
def _fp8_magnitude_code(magnitude, MANT_BITS: tl.constexpr, MIN_NORMAL_EXP: tl.constexpr):
    """The sign-less code of a finite fp32 magnitude (>= 0, or -0.0) on a float grid
    of MANT_BITS mantissa bits whose smallest normal is 2**MIN_NORMAL_EXP, rounded half
    to even (NOTE [ Round half to even ]); the magnitude rounds to a value of the grid
    (NOTE [ Scale rule ]). A code is its exponent field (1 for the smallest normal's
    binade, 0 below) over MANT_BITS mantissa bits.

    From the smallest normal up, fp32's significand is rounded to MANT_BITS bits on its
    bits (the carry runs into the exponent) and the exponent rebiased. Below it the
    grid's step is fixed, 2**(MIN_NORMAL_EXP - MANT_BITS): adding 2**(MIN_NORMAL_EXP -
    MANT_BITS + 23), whose ulp that step is, rounds the magnitude to it in one fp32 add
    (half to even), and the sum's low bits count the steps, which is the code (a
    magnitude that rounds up to the smallest normal gets its code, 2**MANT_BITS)."""
    bits = magnitude.to(tl.int32, bitcast=True)
    # Half a unit of the last kept bit, less one, less the exponent's rebias.
    half = (1 << (22 - MANT_BITS)) - 1 - ((126 + MIN_NORMAL_EXP) << 23)
    normal = (bits + half + ((bits >> (23 - MANT_BITS)) & 1)) >> (23 - MANT_BITS)
    steps = (magnitude + 2.0**(MIN_NORMAL_EXP - MANT_BITS + 23)).to(tl.int32, bitcast=True)
    subnormal = steps - ((MIN_NORMAL_EXP - MANT_BITS + 150) << 23)
    return tl.where(magnitude < 2.0**MIN_NORMAL_EXP, subnormal, normal)


@triton.jit
def _fp8_values(codes, MANT_BITS: tl.constexpr, MIN_NORMAL_EXP: tl.constexpr, FIRST_SPECIAL: tl.constexpr):
    """The exact fp32 values of fp8 bit patterns held in int32 (0..255), inf and NaN
    included. The sign goes to fp32's sign bit and the seven others, exponent field
    over mantissa, just below fp32's exponent's lowest bit, so that fp32 reads the value
    divided by 2**(126 + MIN_NORMAL_EXP), normal or subnormal (no flush to zero); one
    exact multiply restores it. An exponent field of all ones (FIRST_SPECIAL up) is
    fp32's: inf for a zero mantissa (e5m2), else NaN."""
    # The sign bit and the seven below fp32's exponent, as an int32 (the sign's copies
    # that the arithmetic shift leaves between them cleared).
    bits = ((codes << 24) >> (MANT_BITS + 1)) & ((0x7F << (23 - MANT_BITS)) - 0x80000000)
    bits = tl.where((codes & 0x7F) >= FIRST_SPECIAL, bits | 0x7F800000, bits)
    return bits.to(tl.float32, bitcast=True) * 2.0**(126 + MIN_NORMAL_EXP)


@triton.jit
def _unsigned_fp8_values(codes, MANT_BITS: tl.constexpr, MIN_NORMAL_EXP: tl.constexpr):
    """The exact fp32 values of an unsigned grid's codes (int32 0..255, all finite), as
    _fp8_values reads a signed format's magnitudes."""
    return (codes << (23 - MANT_BITS)).to(tl.float32, bitcast=True) * 2.0**(126 + MIN_NORMAL_EXP)


@triton.jit
def _encode_fp8_general(centered, x, FP8_MAX: tl.constexpr, NON_FINITE_CODE_MAX: tl.constexpr,
                        MANT_BITS: tl.constexpr, MIN_NORMAL_EXP: tl.constexpr, UNSIGNED: tl.constexpr,
                        U_MANT_BITS: tl.constexpr, POS_INF_CODE: tl.constexpr, NEG_INF_CODE: tl.constexpr,
                        NAN_CODE: tl.constexpr):
    """The scales and codes of a tile that is not plain (NOTE [ Plain tiles ]): every rule
    of NOTE [ Scale rule ] and NOTE [ Non-finite groups ]."""
    scale, scaled, flagged, nonzero = group_scale(centered, FP8_MAX, NON_FINITE_CODE_MAX)
    codes = _float32_to_fp8_bits(scaled, nonzero, MANT_BITS, MIN_NORMAL_EXP)
    if UNSIGNED:  # NOTE [ Unsigned grids ]: flagged groups keep the signed codes
        codes = tl.where(flagged, codes, _fp8_magnitude_code(tl.maximum(scaled, 0.0), U_MANT_BITS, MIN_NORMAL_EXP))
    return scale, with_non_finite_codes(codes, x, POS_INF_CODE, NEG_INF_CODE, NAN_CODE)


@triton.jit
def _encode_fp8_kernel(x_ptr, codes_ptr, scales_ptr, means_ptr, mean_divisor, numel, channel_size, channels,
                       size_magic, size_shift, count_magic, count_shift, signs_ptr,
                       FP8_MAX: tl.constexpr,
                       NON_FINITE_CODE_MAX: tl.constexpr,
                       MANT_BITS: tl.constexpr, MIN_NORMAL_EXP: tl.constexpr,
                       UNSIGNED: tl.constexpr, U_MANT_BITS: tl.constexpr, SIGNS: tl.constexpr,
                       POS_INF_CODE: tl.constexpr, NEG_INF_CODE: tl.constexpr, NAN_CODE: tl.constexpr,
                       CENTERED: tl.constexpr, RUN_CHANNELS: tl.constexpr, INDEX_64: tl.constexpr,
                       INTERPRETED: tl.constexpr,
                       GROUP_SIZE: tl.constexpr, GROUPS_PER_PROGRAM: tl.constexpr, RUN: tl.constexpr):
    groups, groups_in_bounds, offsets, in_bounds, x, centered, magnitudes, plain = load_encoder_tile(
        x_ptr, means_ptr, mean_divisor, numel, channel_size, channels, size_magic, size_shift, count_magic,
        count_shift, CENTERED, RUN_CHANNELS, INDEX_64, INTERPRETED, GROUP_SIZE, GROUPS_PER_PROGRAM, RUN)
    if plain:
        scale, multiplier = plain_group_scale(magnitudes, FP8_MAX)
        if UNSIGNED:
            codes = _fp8_magnitude_code(tl.maximum(centered * multiplier[:, None, None], 0.0), U_MANT_BITS,
                                        MIN_NORMAL_EXP)
        else:
            codes = _fp8_bits_of_product(centered, multiplier[:, None, None], MANT_BITS, MIN_NORMAL_EXP)
    else:
        if CENTERED:
            centered = tl.where(in_bounds, centered, 0.0)  # padding stays 0, below every absmax
        scale, codes = _encode_fp8_general(centered, x, FP8_MAX, NON_FINITE_CODE_MAX, MANT_BITS, MIN_NORMAL_EXP,
                                           UNSIGNED, U_MANT_BITS, POS_INF_CODE, NEG_INF_CODE, NAN_CODE)
    tl.store(codes_ptr + offsets, codes.to(tl.uint8), mask=in_bounds)
    tl.store(scales_ptr + groups, scale, mask=groups_in_bounds)
    if SIGNS:  # NOTE [ Signs from the encoder's read ]
        store_relu_signs(signs_ptr, x, groups, numel, GROUP_SIZE, GROUPS_PER_PROGRAM, RUN)


@triton.jit
def _decode_fp8_kernel(codes_ptr, scales_ptr, out_ptr, means_ptr, mean_divisor, numel, channel_size, channels,
                       size_magic, size_shift, count_magic, count_shift,
                       MANT_BITS: tl.constexpr, MIN_NORMAL_EXP: tl.constexpr, FIRST_SPECIAL: tl.constexpr,
                       UNSIGNED: tl.constexpr, U_MANT_BITS: tl.constexpr,
                       POS_INF_CODE: tl.constexpr, NEG_INF_CODE: tl.constexpr, NAN_CODE: tl.constexpr,
                       CENTERED: tl.constexpr, RUN_CHANNELS: tl.constexpr, INDEX_64: tl.constexpr,
                       INTERPRETED: tl.constexpr,
                       GROUP_SIZE: tl.constexpr, GROUPS_PER_PROGRAM: tl.constexpr, RUN: tl.constexpr):
    offsets, in_bounds, codes, scale, means = load_decoder_tile(
        codes_ptr, scales_ptr, means_ptr, mean_divisor, numel, channel_size, channels, size_magic, size_shift,
        count_magic, count_shift, CENTERED, RUN_CHANNELS, INDEX_64, GROUP_SIZE, GROUPS_PER_PROGRAM, RUN)
    codes = codes.to(tl.int32)
    out_max = largest_finite(out_ptr)
    if none_flagged(scale):  # NOTE [ Plain tiles ]
        if UNSIGNED:
            values = _unsigned_fp8_values(codes, U_MANT_BITS, MIN_NORMAL_EXP)
        else:
            values = _fp8_values(codes, MANT_BITS, MIN_NORMAL_EXP, FIRST_SPECIAL)
        y = plain_dequantize(values, scale, means, out_max, CENTERED)
    else:
        values = _fp8_values(codes, MANT_BITS, MIN_NORMAL_EXP, FIRST_SPECIAL)
        if UNSIGNED:  # a flagged group's bytes are the signed format's codes
            values = tl.where(is_flagged(scale), values, _unsigned_fp8_values(codes, U_MANT_BITS, MIN_NORMAL_EXP))
        y = dequantize(values, codes, scale, means, out_max, POS_INF_CODE, NEG_INF_CODE, NAN_CODE, CENTERED)
    store_rounded(out_ptr + offsets, y, in_bounds, INTERPRETED)


_FORMATS = {**FP8_FORMATS, **UNSIGNED_FP8_FORMATS}
# Each format's (encode, decode) constexprs, by name, for its launchers: a lookup by the
# name, where the formats' cached methods would hash the frozen dataclass at each call.
_CONSTEXPRS = {fmt: (spec.encode_constexprs(), spec.decode_constexprs()) for fmt, spec in _FORMATS.items()}


def _format(fmt):
    if fmt not in _FORMATS:
        raise ValueError(f"fmt must be one of {sorted(_FORMATS)}, got {fmt!r}")
    return _FORMATS[fmt]


def _format_constexprs(fmt):
    """``(encode, decode)`` constexprs of ``fmt``, checked as :func:`_format` checks it."""
    return _CONSTEXPRS[fmt] if fmt in _CONSTEXPRS else _format(fmt)


def encode_fp8(x, fmt, group_size=DEFAULT_GROUP_SIZE, means=None, sums=None, signs=False):
    """Encode a float tensor of any shape and layout (fp32, bf16 or fp16, CPU under
    TRITON_INTERPRET=1 or CUDA) into (uint8 fp8 bit patterns of shape (numel,), fp32
    scales of shape (n_groups,)); fmt is "e4m3" or "e5m2", or "ue4m4" or "ue5m3" for
    a non-negative tensor (NOTE [ Unsigned grids ]). ``means``, fp32 of shape
    (x.shape[1],), are subtracted per channel first, or the means of ``sums``, the
    channels' sums (NOTE [ Channel means ]). ``signs`` (unsigned formats only): also
    x's ReLU decisions, ``(codes, scales, bits)``, from the same read (NOTE [ Signs from
    the encoder's read ]). Raises ValueError for other formats, dtypes, group sizes,
    means or sums."""
    constexprs, _ = _format_constexprs(fmt)
    source = kernel_input(x, group_size)
    numel = source.numel()
    codes, scales = empty_encoding(numel, source.device, group_size, torch.uint8)
    bits = None
    if signs:
        check_signs(constexprs["UNSIGNED"], means, sums)
        constexprs, bits = with_signs(constexprs), empty_signs(numel, source.device)
    launch(_encode_fp8_kernel, numel, group_size, torch.uint8, channel_means(x, means, scales, sums), constexprs,
           source, codes, scales, signs_ptr=codes if bits is None else bits)
    return (codes, scales) if bits is None else (codes, scales, bits)


def decode_fp8(codes, scales, fmt, dtype, group_size=DEFAULT_GROUP_SIZE, means=None, channel_size=1,
               sums=None):
    """Decode ``encode_fp8``'s output into a 1-D tensor of ``dtype``; reshape it to
    the original shape. ``means`` (or ``sums``), those the encoder took, are added
    back, the tensor's channels holding ``channel_size`` elements per sample (NOTE
    [ Channel means ])."""
    _, constexprs = _format_constexprs(fmt)
    codes, scales = flat_codes(codes, scales, torch.uint8, dtype, group_size)
    out = torch.empty(codes.numel(), dtype=dtype, device=codes.device)
    launch(_decode_fp8_kernel, codes.numel(), group_size, dtype,
           decoded_channel_means(codes, means, channel_size, scales, sums), constexprs, codes, scales, out)
    return out


def encode_fp8_ref(x, fmt, group_size=DEFAULT_GROUP_SIZE, means=None, sums=None, signs=False):
    """The specification of ``encode_fp8``, in torch. torch's fp8 casts round half to
    even; clamping first makes the saturation explicit, since their handling of values
    beyond the largest finite one differs between formats and versions (torch 2.13 on
    CPU: e4m3fn saturates, e5m2 overflows to inf). The unsigned grids, which torch
    lacks, are written on the bits (``_unsigned_codes_ref``)."""
    spec = _format(fmt)
    if signs:  # NOTE [ Signs from the encoder's read ]
        check_signs(isinstance(spec, _UnsignedFp8Format), means, sums)
        return (*encode_fp8_ref(x, fmt, group_size), pack_relu_signs_ref(x))
    signed = getattr(spec, "signed", spec)
    source, flat = centered_input_ref(x, group_size, means, sums)
    scales, multipliers, prescales = group_scale_ref(flat, group_size, spec.max_value, signed.non_finite)
    # |scaled| <= code_max * (1 + 2**-23): rounding never passes code_max (NOTE [ Scale rule ]).
    scaled = scaled_ref(flat, multipliers, prescales, group_size, in_place=flat is not source)  # flat: not read again
    if spec is signed or any_flagged_ref(scales):
        codes = scaled.to(signed.torch_dtype).view(torch.uint8)
    if spec is not signed:
        unsigned_codes = _unsigned_codes_ref_(scaled, spec)
        # Flagged groups keep the signed codes (NOTE [ Unsigned grids ]).
        codes = torch.where(is_flagged_ref(scales, group_size, source.numel()), codes, unsigned_codes) \
            if any_flagged_ref(scales) else unsigned_codes
    return with_non_finite_codes_ref(codes, source, signed.non_finite), scales


def _unsigned_codes_ref_(scaled, spec):
    """Codes of finite fp32 values on an unsigned grid, saturated at 0 (none passes the
    grid's top: NOTE [ Scale rule ]), rounded half to even; ``scaled`` is overwritten (in
    place, and the one temporary freed before the codes are made, so that encoding
    allocates no more than the signed path, which the planner profiles). The exponent e
    of a value (that of its leading bit, at least the smallest normal's) sets the step
    2**(e - mantissa_bits); the multiple k of that step comes after the
    (e - min_normal_exponent) binades of 2**mantissa_bits codes below it, the implicit
    one of k supplying a normal's offset and a k that rounds up to the next power of
    two carrying into the next binade."""
    magnitude = scaled.clamp_min_(0.0)
    # The exponent of each value's leading bit, at least the smallest normal's (fp32
    # subnormals and 0 lie far below it).
    exponent = (magnitude.view(torch.int32) >> 23).sub_(127).clamp_min_(spec.min_normal_exponent)
    # k = magnitude / 2**(e - mantissa_bits), exact: the power of two is built on its
    # bits, over the exponent's storage; e is read back from them after.
    inverse_step = _pow2_ref(exponent.neg_().add_(spec.mantissa_bits))
    k = magnitude.mul_(inverse_step).round_()
    exponent = inverse_step.view(torch.int32).bitwise_right_shift_(23).sub_(127 + spec.mantissa_bits).neg_()
    codes = k.add_(exponent.sub_(spec.min_normal_exponent).bitwise_left_shift_(spec.mantissa_bits))
    del exponent, inverse_step
    return codes.to(torch.uint8)


def _unsigned_values_ref(codes, spec):
    """The values of an unsigned grid's codes, as fp32: k * 2**(max(field, 1) - 1 +
    min_normal_exponent - mantissa_bits), k carrying the implicit one of a normal."""
    k = codes.to(torch.int32)
    exponent_field = k >> spec.mantissa_bits
    k.bitwise_and_((1 << spec.mantissa_bits) - 1).add_(exponent_field > 0, alpha=1 << spec.mantissa_bits)
    exponent = exponent_field.clamp_min_(1).add_(spec.min_normal_exponent - spec.mantissa_bits - 1)
    return k.to(torch.float32).mul_(_pow2_ref(exponent))


def _pow2_ref(exponent):
    """2.0**exponent as fp32, exactly, for an int32 tensor in fp32's normal range;
    ``exponent`` is overwritten."""
    return exponent.add_(127).bitwise_left_shift_(23).view(torch.float32)


def decode_fp8_ref(codes, scales, fmt, dtype, group_size=DEFAULT_GROUP_SIZE, means=None, channel_size=1,
                   sums=None):
    """The specification of ``decode_fp8``, in torch."""
    spec = _format(fmt)
    signed = getattr(spec, "signed", spec)
    codes, scales = flat_codes(codes, scales, torch.uint8, dtype, group_size)
    means = decoded_channel_means(codes, means, channel_size, scales, sums)
    if spec is signed:
        values = codes.view(signed.torch_dtype).to(torch.float32)
    else:
        values = _unsigned_values_ref(codes, spec)
        if any_flagged_ref(scales):  # flagged groups hold the signed codes
            flagged = is_flagged_ref(scales, group_size, codes.numel())
            values = torch.where(flagged, codes.view(signed.torch_dtype).to(torch.float32), values)
    return dequantize_ref(values, codes, scales, signed.non_finite, dtype, group_size, means)
