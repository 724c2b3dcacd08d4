"""Symmetric per-group int8 codec: 8 bits per element plus one fp32 scale per group.

Format: the tensor is flattened row-major and cut into groups of ``group_size``
elements (a power of two; the last group may be partial). Each group stores
``scale = absmax / 127`` (fp32) and one int8 code per element,
``code = round_half_even(x * (127 / absmax))``, the group's multiplier ``127 / absmax``
taken once (NOTE [ Scale rule ] in ``_scale``: no code passes +-127); the grid is
symmetric. Decoding is ``code * scale`` in fp32, rounded half to even to the
requested dtype. NOTE [ Scale rule ] also keeps a scale near the fp32 maximum from
decoding to inf, and flags, by the scale's sign bit, a group holding inf or NaN:
there ``scale = finite absmax / 126``, finite codes stay within +-126, and 127, -127
and -128 stand for +inf, -inf and NaN (NOTE [ Non-finite groups ]).

The unsigned variant (``unsigned=True``, NOTE [ Unsigned grids ]) is for tensors known
to be non-negative: ``scale = absmax / 255`` and uint8 codes
``round_half_even(max(x * (255 / absmax), 0))``; a group holding inf or NaN keeps the
signed encoding above, its int8 codes stored as their byte.

At ``group_size=128`` that is 8.25 bits per element. ``encode_int8_ref`` /
``decode_int8_ref`` are the specification; the Triton kernels match them bit for bit.
"""
import functools

import torch
import triton
import triton.language as tl

from . import DEFAULT_GROUP_SIZE
from ._channel_means import channel_means, decoded_channel_means, largest_finite
from ._rounding import integer_code_bits, store_rounded
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

# Symmetric absmax rather than asymmetric (scale + zero point). Asymmetric gains most,
# about one bit (6 dB), on one-signed data, which the unsigned grid (NOTE [ Unsigned
# grids ]) covers for ReLU outputs, and less elsewhere; it needs a second fp32 per
# group (6.25% overhead instead of 3.1%) and a decode `code * scale + offset` that GPUs
# may fuse into an FMA and round differently from torch. Symmetric decodes with a
# single correctly rounded multiply, so it is bit-exact everywhere (the SQNR of each:
# docs/results.md, "Figures behind the code's rules").
INT8_MAX = 127
UINT8_MAX = 255  # NOTE [ Unsigned grids ]
# In a group holding inf or NaN, 127 and -127 mean +-inf (the sign stays the code's)
# and -128, unused elsewhere, NaN; finite values keep 126 of their 127 steps (0.07 dB).
NON_FINITE_CODES = NonFiniteCodes(finite_max=126.0, pos_inf=127, neg_inf=-127, nan=-128)

@functools.cache  # built once, not at each launch (shared: read, never changed)
def encode_constexprs(unsigned: bool) -> Constexprs:
    """The encode kernel's format constexprs, for the signed or the unsigned grid."""
    return Constexprs({"CODE_MAX": UINT8_MAX if unsigned else INT8_MAX, "UNSIGNED": unsigned, "SIGNS": False,
                       **NON_FINITE_CODES.encode_constexprs()})


@functools.cache
def decode_constexprs(unsigned: bool) -> Constexprs:
    return Constexprs({"UNSIGNED": unsigned, **NON_FINITE_CODES.decode_constexprs()})


def _code_dtype(unsigned):
    return torch.uint8 if unsigned else torch.int8


@triton.jit
def _encode_int8_general(centered, x, CODE_MAX: tl.constexpr, UNSIGNED: tl.constexpr,
                         NON_FINITE_CODE_MAX: tl.constexpr, POS_INF_CODE: tl.constexpr,
                         NEG_INF_CODE: tl.constexpr, NAN_CODE: tl.constexpr):
    """The scales and code bits of a tile that is not plain (NOTE [ Plain tiles ]): every
    rule of NOTE [ Scale rule ] and NOTE [ Non-finite groups ]."""
    scale, scaled, flagged, _ = group_scale(centered, CODE_MAX, NON_FINITE_CODE_MAX)
    codes = integer_code_bits(scaled, False)
    if UNSIGNED:  # flagged groups keep the signed codes (NOTE [ Unsigned grids ])
        codes = tl.where(flagged, codes, integer_code_bits(scaled, True))
    return scale, with_non_finite_codes(codes, x, POS_INF_CODE, NEG_INF_CODE, NAN_CODE)


@triton.jit
def _encode_int8_kernel(x_ptr, codes_ptr, scales_ptr, means_ptr, mean_divisor, numel, channel_size, channels,
                        size_magic, size_shift, count_magic, count_shift, signs_ptr,
                        CODE_MAX: tl.constexpr,
                        UNSIGNED: tl.constexpr, SIGNS: tl.constexpr, NON_FINITE_CODE_MAX: tl.constexpr,
                        POS_INF_CODE: tl.constexpr, NEG_INF_CODE: tl.constexpr, NAN_CODE: tl.constexpr,
                        CENTERED: tl.constexpr, RUN_CHANNELS: tl.constexpr, INDEX_64: tl.constexpr,
                        INTERPRETED: tl.constexpr,
                        GROUP_SIZE: tl.constexpr, GROUPS_PER_PROGRAM: tl.constexpr, RUN: tl.constexpr):
    groups, groups_in_bounds, offsets, in_bounds, x, centered, magnitudes, plain = load_encoder_tile(
        x_ptr, means_ptr, mean_divisor, numel, channel_size, channels, size_magic, size_shift, count_magic,
        count_shift, CENTERED, RUN_CHANNELS, INDEX_64, INTERPRETED, GROUP_SIZE, GROUPS_PER_PROGRAM, RUN)
    if plain:
        scale, multiplier = plain_group_scale(magnitudes, CODE_MAX)
        codes = integer_code_bits(centered * multiplier[:, None, None], UNSIGNED)
    else:
        if CENTERED:
            centered = tl.where(in_bounds, centered, 0.0)  # padding stays 0, below every absmax
        scale, codes = _encode_int8_general(centered, x, CODE_MAX, UNSIGNED, NON_FINITE_CODE_MAX,
                                            POS_INF_CODE, NEG_INF_CODE, NAN_CODE)
    # Truncation to 8 bits: a signed code's two's complement byte, or a code 0..255.
    tl.store(codes_ptr + offsets, codes.to(codes_ptr.dtype.element_ty), mask=in_bounds)
    tl.store(scales_ptr + groups, scale, mask=groups_in_bounds)
    if SIGNS:  # NOTE [ Signs from the encoder's read ]
        store_relu_signs(signs_ptr, x, groups, numel, GROUP_SIZE, GROUPS_PER_PROGRAM, RUN)


@triton.jit
def _decode_int8_kernel(codes_ptr, scales_ptr, out_ptr, means_ptr, mean_divisor, numel, channel_size, channels,
                        size_magic, size_shift, count_magic, count_shift,
                        UNSIGNED: tl.constexpr,
                        POS_INF_CODE: tl.constexpr, NEG_INF_CODE: tl.constexpr, NAN_CODE: tl.constexpr,
                        CENTERED: tl.constexpr, RUN_CHANNELS: tl.constexpr, INDEX_64: tl.constexpr,
                        INTERPRETED: tl.constexpr,
                        GROUP_SIZE: tl.constexpr, GROUPS_PER_PROGRAM: tl.constexpr, RUN: tl.constexpr):
    offsets, in_bounds, codes, scale, means = load_decoder_tile(
        codes_ptr, scales_ptr, means_ptr, mean_divisor, numel, channel_size, channels, size_magic, size_shift,
        count_magic, count_shift, CENTERED, RUN_CHANNELS, INDEX_64, GROUP_SIZE, GROUPS_PER_PROGRAM, RUN)
    out_max = largest_finite(out_ptr)
    if none_flagged(scale):  # NOTE [ Plain tiles ]
        y = plain_dequantize(codes.to(tl.float32), scale, means, out_max, CENTERED)
    else:
        signed_codes = codes.to(tl.int32)
        if UNSIGNED:  # a flagged group's bytes are int8 codes
            signed_codes = tl.where(is_flagged(scale) & (signed_codes > 127), signed_codes - 256, signed_codes)
        y = dequantize(signed_codes.to(tl.float32), signed_codes, scale, means, out_max, POS_INF_CODE, NEG_INF_CODE,
                       NAN_CODE, CENTERED)
    store_rounded(out_ptr + offsets, y, in_bounds, INTERPRETED)


def encode_int8(x, group_size=DEFAULT_GROUP_SIZE, unsigned=False, means=None, sums=None, signs=False):
    """Encode a float tensor of any shape and layout (fp32, bf16 or fp16, CPU under
    TRITON_INTERPRET=1 or CUDA) into (codes of shape (numel,), fp32 scales of shape
    (n_groups,)): int8 codes, or uint8 ones on the unsigned grid. ``means``, fp32 of
    shape (x.shape[1],), are subtracted per channel first, or the means of ``sums``,
    the channels' sums (NOTE [ Channel means ]). ``signs`` (unsigned grid only):
    also x's ReLU decisions, ``(codes, scales, bits)``, from the same read (NOTE
    [ Signs from the encoder's read ]).
    Raises ValueError for other dtypes, group sizes, means or sums."""
    source = kernel_input(x, group_size)
    numel, code_dtype = source.numel(), _code_dtype(unsigned)
    codes, scales = empty_encoding(numel, source.device, group_size, code_dtype)
    constexprs, bits = encode_constexprs(unsigned), None
    if signs:
        check_signs(unsigned, means, sums)
        constexprs, bits = with_signs(constexprs), empty_signs(numel, source.device)
    launch(_encode_int8_kernel, numel, group_size, code_dtype, channel_means(x, means, scales, sums), constexprs,
           source, codes, scales, signs_ptr=codes if bits is None else bits)
    return (codes, scales) if bits is None else (codes, scales, bits)


def decode_int8(codes, scales, dtype, group_size=DEFAULT_GROUP_SIZE, unsigned=False, means=None,
                channel_size=1, sums=None):
    """Decode ``encode_int8``'s output (same ``unsigned``) into a 1-D tensor of
    ``dtype``; reshape it to the original shape. ``means`` (or ``sums``), those the
    encoder took, are added back, the tensor's channels holding ``channel_size``
    elements per sample (NOTE [ Channel means ])."""
    codes, scales = flat_codes(codes, scales, _code_dtype(unsigned), dtype, group_size)
    out = torch.empty(codes.numel(), dtype=dtype, device=codes.device)
    launch(_decode_int8_kernel, codes.numel(), group_size, dtype,
           decoded_channel_means(codes, means, channel_size, scales, sums), decode_constexprs(unsigned), codes,
           scales, out)
    return out


def encode_int8_ref(x, group_size=DEFAULT_GROUP_SIZE, unsigned=False, means=None, sums=None, signs=False):
    """The specification of ``encode_int8``, in torch (torch.round ties to even)."""
    if signs:  # NOTE [ Signs from the encoder's read ]
        check_signs(unsigned, means, sums)
        return (*encode_int8_ref(x, group_size, unsigned), pack_relu_signs_ref(x))
    source, flat = centered_input_ref(x, group_size, means, sums)
    scales, multipliers, prescales = group_scale_ref(flat, group_size, UINT8_MAX if unsigned else INT8_MAX,
                                                     NON_FINITE_CODES)
    # |scaled| <= code_max * (1 + 2**-23): rounding never passes code_max (NOTE [ Scale rule ]).
    scaled = scaled_ref(flat, multipliers, prescales, group_size, in_place=flat is not source)  # flat: not read again
    if not unsigned:
        codes = scaled.round_().to(torch.int8)
        return with_non_finite_codes_ref(codes, source, NON_FINITE_CODES), scales
    if not any_flagged_ref(scales):
        # No group is flagged: every code is unsigned. In place, so that encoding a
        # non-negative tensor allocates no more than the signed path (the planner
        # profiles that one).
        return scaled.clamp_min_(0).round_().to(torch.uint8), scales
    lowest = torch.where(is_flagged_ref(scales, group_size, source.numel()), float("-inf"), 0.0)
    codes = with_non_finite_codes_ref(scaled.clamp_min_(lowest).round_(), source, NON_FINITE_CODES)
    # A flagged group's int8 codes, stored as their byte.
    return codes.add_(codes < 0, alpha=256).to(torch.uint8), scales


def decode_int8_ref(codes, scales, dtype, group_size=DEFAULT_GROUP_SIZE, unsigned=False, means=None,
                    channel_size=1, sums=None):
    """The specification of ``decode_int8``, in torch."""
    codes, scales = flat_codes(codes, scales, _code_dtype(unsigned), dtype, group_size)
    means = decoded_channel_means(codes, means, channel_size, scales, sums)
    values = codes.to(torch.float32)
    if unsigned and any_flagged_ref(scales):  # a flagged group's bytes are int8 codes
        values.add_(is_flagged_ref(scales, group_size, codes.numel()) & (codes > INT8_MAX), alpha=-256)
        codes = values
    return dequantize_ref(values, codes, scales, NON_FINITE_CODES, dtype, group_size, means)
