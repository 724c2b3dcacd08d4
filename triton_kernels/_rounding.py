"""Numerics shared by the int8 and fp8 codecs, each rule written once.

Both codecs cut a flattened tensor into contiguous groups of ``group_size`` elements
(the last one may be partial) and store one fp32 scale per group. This module holds
what they have in common:

- NOTE [tile]: each program owns GROUPS_PER_PROGRAM whole groups (ELEMENTS_PER_PROGRAM
  elements) as a ``[groups, GROUP_SIZE // RUN, RUN]`` block and reduces along its rows. A
  run is RUN contiguous elements that one thread owns: one 16-byte vector of codes when
  encoding (16 codes), of values when decoding (4 fp32 or 8 halves, whose codes are
  then one 4- or 8-byte load, as coalesced). Triton gives each memory access a layout of
  at most 16 bytes per thread for a store; one run size for both streams is one layout,
  with no conversion through shared memory between them. What depends on the run only
  (a channel, NOTE [channel means]) is worked out once per thread. Offsets are int32
  where every offset of the launch is below 2**31 (``needs_int64``), else int64;
- NOTE [scale rule]: ``scale = absmax / code_max`` over the group's finite values,
  divided correctly rounded. Where ``code_max * scale`` would overflow (an absmax next
  to the fp32 maximum), the scale steps one ulp toward zero so that no finite input
  decodes to inf: the division errs by at most half an ulp, so one step is enough, and
  every other scale is left as it is. A group of finite values stores that scale
  (>= +0); a group holding +-inf or NaN stores it negated, so its sign bit flags the
  group without adding a byte. Decoding is ``value(code) * |scale|``. Encoding
  multiplies rather than divides: a value x is coded as ``t = x * multiplier``, one
  correctly rounded multiply by its group's ``multiplier = code_max / absmax`` (divided
  correctly rounded, once per group). t lies within about an ulp of ``x / scale``, which
  moves a code only where that quotient is as close to a rounding boundary: a few
  codes in millions, no change to the round-trip SQNR (docs/results.md, "Figures
  behind the code's rules"). As ``|x| <= absmax``, ``|t| <= code_max * (1 +
  2**-23)``, which rounds to code_max at most: no code saturates. Where 0 < absmax <
  2**-64 the multiplier could pass fp32's range (code_max is up to 122880), so both are
  taken after a scaling by 2**64, exact on both sides: ``t = (x * 2**64) * (code_max /
  (absmax * 2**64))``. Only finite values are multiplied; a group whose finite absmax is
  0 has multiplier 0 and codes +0 (for -0.0 too), so an all-zero group decodes to exact
  zeros;
- NOTE [non-finite groups]: ``-inf`` is a legitimate activation (causal and vocabulary
  masks), so it must neither become finite garbage nor spoil its group, and NaN must
  stay NaN (AMP loss scalers look for it). In a flagged group each codec reserves three
  codes (``NonFiniteCodes``) that decode to exactly +inf, -inf and NaN; the group's
  finite values are scaled onto the codes one step below them and keep their
  precision, the scale coming from them alone (int8 gives up its 127th step: 0.07 dB).
  Unflagged groups never give these codes those meanings, so their bits are those of
  the plain rule (NOTE [scale rule]), and no byte is added;
- NOTE [unsigned grids]: a tensor the caller knows to be non-negative (a ReLU output)
  can spend the sign bit on precision: each codec has an unsigned variant (int8 codes
  0..255, fp8 e4m3 -> ue4m4, e5m2 -> ue5m3) whose scale maps the absmax onto the
  unsigned grid's top, one more bit of resolution (about 6 dB of round-trip SQNR).
  The grid is the caller's choice, recorded beside the codes, never detected from the
  data (that would need a device sync or a per-group flag). A negative value given to
  an unsigned variant saturates to 0. A flagged group (NOTE [non-finite groups]) is
  encoded exactly as by the signed codec, its codes stored as their byte, so the
  non-finite rule is written once; decoding reads the flag first;
- NOTE [round half to even]: every rounding (int8 codes, fp8 codes, fp32 -> bf16
  output) is to nearest, ties to even, and exact on every backend. Triton's interpreter
  has no ``rint`` and mis-rounds fp32 -> fp8 / bf16 casts, so the kernels round with
  IEEE adds (which round half to even) and integer bits: int8 codes by adding 1.5 *
  2**23 (``integer_code_bits``), fp8 codes by rounding fp32's significand on its bits,
  and below the smallest normal by an add whose ulp is the step (fp8's
  ``_fp8_magnitude_code``). fp32 -> bf16 is ``.to`` on CUDA (cvt.rn) and
  ``float32_to_bfloat16_rne``, on bits, under the interpreter;
- NOTE [plain tiles]: most tiles hold only groups whose values are finite, with an
  absmax below 2**127 and either 0 or at least 2**-64 (and, for an encoder that
  subtracts channel means, lie wholly inside the tensor, a partial tile's padding being
  centered too). There NOTE [scale rule] needs no step, no pre-scale and no flag, and
  NOTE [non-finite groups] no code, so the kernels take a path without them: an
  encoder decides from its rows' magnitudes (``row_magnitudes``, ``plain_tile``), a
  decoder from its scales' signs (``none_flagged``), once per program, by a branch on a
  reduction over the tile; every other tile takes the general path. Both give the
  references' bits, and a plain tile pays for the rules it does not need with that
  reduction alone;
- NOTE [channel means]: an encoder may be given one fp32 mean per channel (dim 1 of
  an N, C, ... tensor) to subtract from each value as it is loaded, correctly rounded,
  before anything else; the group's scale and codes are those of the centered values,
  and the non-finite codes mark the input's own inf and NaN (a mean that takes a
  finite value past fp32's range, which actsave never passes, leaves it a code of 0 in
  a flagged group, in kernel and reference alike). The decoder given the same means
  adds each back to ``value(code) * |scale|`` in fp32, a second correctly rounded
  operation (launches disable Triton's FMA fusion, ``LAUNCH_OPTIONS``), and saturates
  the sum at the output dtype's largest finite value: a finite value near it may come
  back a rounding step beyond it, which must not become inf. Then the non-finite codes
  are decoded, as without means. Doing both in the kernels costs no copy of the
  tensor (a centered copy would be live beside it while encoding, a wide one while
  decoding to a half type); the references work in place on their own copies, for
  the same reason. Element i's channel is ``(i // channel_size) % channels``; with
  int32 offsets both divisions are a multiply by the divisor's magic number
  (``magic_number``, exact below 2**31), worked out once per run where a run meets at
  most two channels (channel_size >= RUN; one where channel_size is a multiple of
  RUN), else once per element; int64 offsets divide;
- the host-side checks and launch grid, and the torch references of the rules above.

Every step is a correctly rounded IEEE operation (``div_rn`` once per group, a single
multiply or add per value, no fused multiply-add: ``LAUNCH_OPTIONS``), so kernels and
references agree bit for bit on CPU, under the interpreter and on CUDA.
"""
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from . import SUPPORTED_DTYPES, _launch, channel_size

# Below 8 elements the fp32 scale is at least a third of what is stored, which defeats
# compression; above 4096 a single group outgrows a program's tile (below).
MIN_GROUP_SIZE, MAX_GROUP_SIZE = 8, 4096
# 4096 elements per program, 16 per thread with 8 warps: in the range Triton's
# tutorials use for memory-bound kernels, and it amortises the interpreter's cost per
# program, which dominates small launches there (docs/results.md, "Figures behind the
# code's rules"). Not tuned on a GPU.
ELEMENTS_PER_PROGRAM, NUM_WARPS = 4096, 8
# Compile options of every launch (and of the ahead-of-time builds that check them).
# No FMA fusion: a decoder's add of a channel mean after its multiply (NOTE [channel
# means]) must round twice, as torch does.
LAUNCH_OPTIONS = {"num_warps": NUM_WARPS, "enable_fp_fusion": False}
# The widest global load and store a thread issues (ld/st.global.v4.b32).
VECTOR_BYTES = 16
# NOTE [scale rule]: below this absmax, the multiplier is taken after scaling by PRESCALE.
TINY_ABSMAX = tl.constexpr(2.0**-64)
PRESCALE = tl.constexpr(2.0**64)
# NOTE [plain tiles]: below this absmax no scale needs the scale rule's step.
PLAIN_ABSMAX_LIMIT = tl.constexpr(2.0**127)


class NonFiniteCodes(NamedTuple):
    """A codec's NOTE [non-finite groups]: the largest finite code magnitude in a
    flagged group, and the codes of +inf, -inf and NaN there."""

    finite_max: float
    pos_inf: int
    neg_inf: int
    nan: int

    def decode_constexprs(self) -> dict:
        return {"POS_INF_CODE": self.pos_inf, "NEG_INF_CODE": self.neg_inf, "NAN_CODE": self.nan}

    def encode_constexprs(self) -> dict:
        return {"NON_FINITE_CODE_MAX": self.finite_max, **self.decode_constexprs()}


# ----------------------------------------------------------------- Triton helpers


@triton.jit
def group_tile(numel, GROUP_SIZE: tl.constexpr, GROUPS_PER_PROGRAM: tl.constexpr, RUN: tl.constexpr,
               INDEX_64: tl.constexpr):
    """This program's groups and their mask; the first element of each run of its groups,
    as [groups, GROUP_SIZE // RUN, 1]; the element offsets, [groups, GROUP_SIZE // RUN, RUN],
    and their mask. A run is RUN contiguous elements that one thread owns (NOTE [tile]).
    Offsets are int64 where INDEX_64, else int32 (the launch knows which fit)."""
    program = tl.program_id(0)
    if INDEX_64:
        program = program.to(tl.int64)
    groups = program * GROUPS_PER_PROGRAM + tl.arange(0, GROUPS_PER_PROGRAM)
    runs = groups[:, None] * GROUP_SIZE + tl.arange(0, GROUP_SIZE // RUN)[None, :] * RUN
    offsets = runs[:, :, None] + tl.arange(0, RUN)[None, None, :]
    return groups, groups * GROUP_SIZE < numel, runs[:, :, None], offsets, offsets < numel


@triton.jit
def tile_is_whole(numel, GROUP_SIZE: tl.constexpr, GROUPS_PER_PROGRAM: tl.constexpr, INDEX_64: tl.constexpr):
    """Whether every element of this program's tile is in bounds (a scalar)."""
    program = tl.program_id(0)
    if INDEX_64:
        program = program.to(tl.int64)
    return (program + 1) * (GROUPS_PER_PROGRAM * GROUP_SIZE) <= numel


@triton.jit
def load_as_float32(ptrs, mask):
    """Load fp32, bf16 or fp16 values and widen them exactly to fp32. bf16 is widened
    on its bits: the interpreter's bf16 -> fp32 cast turns subnormals into wrong values."""
    x = tl.load(ptrs, mask=mask, other=0.0)
    if ptrs.dtype.element_ty == tl.bfloat16:
        return (x.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    return x.to(tl.float32)


@triton.jit
def quotient(n, divisor, magic, shift, INDEX_64: tl.constexpr):
    """n // divisor for n >= 0: an int64 division where INDEX_64, else, n being below
    2**31, the high half of 2n times the divisor's magic number, shifted (NOTE [channel
    means]; ``magic`` is its uint32 bit pattern held in an int32)."""
    if INDEX_64:
        return n // divisor
    doubled = (n << 1).to(tl.uint32, bitcast=True)
    high = tl.umulhi(doubled, magic.to(tl.uint32, bitcast=True))
    return (high >> shift).to(tl.int32, bitcast=True)


@triton.jit
def channel_means_of(runs, offsets, in_bounds, means_ptr, channel_size, channels, size_magic, size_shift,
                     count_magic, count_shift, RUN_CHANNELS: tl.constexpr, INDEX_64: tl.constexpr):
    """Each element's channel mean (NOTE [channel means]): element i of a contiguous N, C,
    ... tensor is in channel (i // channel_size) % channels. RUN_CHANNELS is how many
    channels one run may span: 1 (channel_size is a multiple of RUN: one mean per run),
    2 (channel_size >= RUN: the run's first channel, then from the element where the
    next one starts, that one), or 0 (more: each element's channel is worked out)."""
    if RUN_CHANNELS == 0:
        samples_and_channels = quotient(offsets, channel_size, size_magic, size_shift, INDEX_64)
        channel = samples_and_channels - quotient(samples_and_channels, channels, count_magic, count_shift,
                                                  INDEX_64) * channels
        means = tl.load(means_ptr + channel, mask=in_bounds, other=0.0)
    else:
        samples_and_channels = quotient(runs, channel_size, size_magic, size_shift, INDEX_64)
        first = samples_and_channels - quotient(samples_and_channels, channels, count_magic, count_shift,
                                                INDEX_64) * channels
        means = tl.load(means_ptr + first)  # [groups, runs, 1]: one per run
        if RUN_CHANNELS == 2:
            into_channel = runs - samples_and_channels * channel_size
            following = tl.where(first + 1 == channels, 0, first + 1)
            in_first = offsets - runs < channel_size - into_channel
            means = tl.where(in_first, means, tl.load(means_ptr + following))
    return means


@triton.jit
def largest_finite(out_ptrs):
    """The largest finite value of the output pointers' dtype, as fp32."""
    if out_ptrs.dtype.element_ty == tl.float16:
        return 65504.0
    if out_ptrs.dtype.element_ty == tl.bfloat16:
        return 3.3895313892515355e38
    return 3.4028234663852886e38


@triton.jit
def _max_keeping_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def row_magnitudes(x, INTERPRETED: tl.constexpr):
    """Per row of a [groups, runs, RUN] fp32 block, as [groups]: the largest |x|, NaN
    where the row holds a NaN, +inf where it holds an infinity and no NaN. On a GPU a
    NaN-keeping maximum is one instruction a value; the interpreter's reductions skip
    NaN (numpy's nanmax) and its custom ones run in Python, so there the magnitudes'
    bits are compared as integers, an order that puts NaN above +inf above every
    finite value."""
    if INTERPRETED:
        bits = tl.max(tl.max(x.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=2), axis=1)
        return bits.to(tl.float32, bitcast=True)
    return tl.reduce(tl.reduce(tl.abs(x), 2, _max_keeping_nan), 1, _max_keeping_nan)


@triton.jit
def plain_tile(magnitudes):
    """NOTE [plain tiles]: whether every row of the tile, given its row_magnitudes, is
    finite with an absmax below 2**127 and either 0 or at least 2**-64 (a scalar)."""
    plain = (magnitudes < PLAIN_ABSMAX_LIMIT) & ((magnitudes >= TINY_ABSMAX) | (magnitudes == 0.0))
    return tl.min(plain.to(tl.int32), axis=0) > 0


@triton.jit
def load_encoder_tile(x_ptr, means_ptr, numel, channel_size, channels, size_magic, size_shift, count_magic,
                      count_shift, CENTERED: tl.constexpr, RUN_CHANNELS: tl.constexpr, INDEX_64: tl.constexpr,
                      INTERPRETED: tl.constexpr, GROUP_SIZE: tl.constexpr, GROUPS_PER_PROGRAM: tl.constexpr,
                      RUN: tl.constexpr):
    """What every encoder starts with, for this program's tile: ``(groups, their mask,
    offsets, their mask, x as fp32, x less its channel means where CENTERED (NOTE
    [channel means]), each row's magnitudes, whether the tile is plain: NOTE [plain
    tiles])``. A partial tile's padding is centered too, so a centered tile is plain
    only when it is whole."""
    groups, groups_in_bounds, runs, offsets, in_bounds = group_tile(numel, GROUP_SIZE, GROUPS_PER_PROGRAM, RUN,
                                                                    INDEX_64)
    x = load_as_float32(x_ptr + offsets, in_bounds)
    centered = x
    if CENTERED:
        centered = x - channel_means_of(runs, offsets, in_bounds, means_ptr, channel_size, channels, size_magic,
                                        size_shift, count_magic, count_shift, RUN_CHANNELS, INDEX_64)
    magnitudes = row_magnitudes(centered, INTERPRETED)
    plain = plain_tile(magnitudes)
    if CENTERED:
        plain = plain & tile_is_whole(numel, GROUP_SIZE, GROUPS_PER_PROGRAM, INDEX_64)
    return groups, groups_in_bounds, offsets, in_bounds, x, centered, magnitudes, plain


@triton.jit
def load_decoder_tile(codes_ptr, scales_ptr, means_ptr, numel, channel_size, channels, size_magic, size_shift,
                      count_magic, count_shift, CENTERED: tl.constexpr, RUN_CHANNELS: tl.constexpr,
                      INDEX_64: tl.constexpr, GROUP_SIZE: tl.constexpr, GROUPS_PER_PROGRAM: tl.constexpr,
                      RUN: tl.constexpr):
    """What every decoder starts with, for this program's tile: ``(offsets, their
    mask, the codes as stored, each row's scale, each element's channel mean where
    CENTERED, else 0)``."""
    groups, groups_in_bounds, runs, offsets, in_bounds = group_tile(numel, GROUP_SIZE, GROUPS_PER_PROGRAM, RUN,
                                                                    INDEX_64)
    codes = tl.load(codes_ptr + offsets, mask=in_bounds, other=0)
    scale = tl.load(scales_ptr + groups, mask=groups_in_bounds, other=0.0)
    means = 0.0
    if CENTERED:
        means = channel_means_of(runs, offsets, in_bounds, means_ptr, channel_size, channels, size_magic,
                                 size_shift, count_magic, count_shift, RUN_CHANNELS, INDEX_64)
    return offsets, in_bounds, codes, scale, means


@triton.jit
def plain_group_scale(magnitudes, CODE_MAX: tl.constexpr):
    """NOTE [scale rule] for the rows of a plain tile (NOTE [plain tiles]), [groups]: the
    scale and the multiplier, the bits of group_scale's without its step, pre-scale
    and flag, none of which applies."""
    code_max = tl.full(magnitudes.shape, CODE_MAX, tl.float32)
    return tl.div_rn(magnitudes, code_max), tl.where(magnitudes > 0, tl.div_rn(code_max, magnitudes), 0.0)


@triton.jit
def none_flagged(scale):
    """Whether no group of the tile, given its [groups] scales, is flagged (NOTE
    [non-finite groups]; a scalar)."""
    return tl.min(scale.to(tl.int32, bitcast=True), axis=0) >= 0


@triton.jit
def group_scale(x, CODE_MAX, NON_FINITE_CODE_MAX):
    """NOTE [scale rule] per row of a [groups, runs, RUN] fp32 block: the signed scale,
    [groups]; the block's finite values times their row's multiplier, 0 elsewhere; and
    per row, [groups, 1, 1], whether it is flagged and whether its multiplier is nonzero."""
    finite = tl.abs(x) < float("inf")
    absmax = tl.max(tl.max(tl.where(finite, tl.abs(x), 0.0), axis=2), axis=1)
    non_finite = tl.max(tl.max((finite == 0).to(tl.int32), axis=2), axis=1) > 0
    code_max = tl.where(non_finite, tl.full(absmax.shape, NON_FINITE_CODE_MAX, tl.float32),
                        tl.full(absmax.shape, CODE_MAX, tl.float32))
    scale = tl.div_rn(absmax, code_max)
    one_ulp_less = (scale.to(tl.int32, bitcast=True) - 1).to(tl.float32, bitcast=True)
    scale = tl.where(scale * code_max == float("inf"), one_ulp_less, scale)
    prescale = tl.where((absmax > 0) & (absmax < TINY_ABSMAX), PRESCALE, 1.0)
    multiplier = tl.where(absmax > 0, tl.div_rn(code_max, absmax * prescale), 0.0)
    scaled = tl.where(finite, (x * prescale[:, None, None]) * multiplier[:, None, None], 0.0)
    return (tl.where(non_finite, negated(scale), scale), scaled, non_finite[:, None, None],
            (absmax > 0)[:, None, None])


@triton.jit
def negated(x):
    """fp32 x with its sign bit flipped: -x, and -0.0 for +0.0 on every backend. On an
    H100 (Triton 3.6) a float ``-x`` gave +0.0 for +0.0 (as 0 - x would): fp8 codes of
    -0.0 decoded to +0.0, and a flagged group whose scale is 0 (no finite value) would
    lose its flag."""
    return (x.to(tl.uint32, bitcast=True) ^ 0x80000000).to(tl.float32, bitcast=True)


@triton.jit
def is_flagged(scale):
    """Per row of a [groups] scale, as [groups, 1, 1]: whether the group holds inf or NaN
    (NOTE [non-finite groups]: the sign bit of its scale)."""
    return (scale.to(tl.int32, bitcast=True) < 0)[:, None, None]


@triton.jit
def with_non_finite_codes(codes, x, POS_INF_CODE, NEG_INF_CODE, NAN_CODE):
    """codes with those of NOTE [non-finite groups] where x is +inf, -inf or NaN."""
    codes = tl.where(x == float("inf"), POS_INF_CODE, codes)
    codes = tl.where(x == float("-inf"), NEG_INF_CODE, codes)
    return tl.where(x != x, NAN_CODE, codes)


@triton.jit
def integer_code_bits(scaled, UNSIGNED: tl.constexpr):
    """NOTE [round half to even] of finite values onto the integers, within +-255.5: an
    fp32 add rounds half to even, and adding 1.5 * 2**23 (or 2**23, values >= 0 on
    the unsigned grid, negative ones saturating at 0) leaves the sum in a binade whose
    step is 1, so that its low byte is the code's two's complement byte (or the code
    0..255). Returned as the sum's bits; storing them as 8 bits keeps that byte."""
    if UNSIGNED:
        return (tl.maximum(scaled, 0.0) + 8388608.0).to(tl.int32, bitcast=True)
    return (scaled + 12582912.0).to(tl.int32, bitcast=True)


@triton.jit
def shift_right_rne(m, shift):
    """NOTE [round half to even]: m / 2**shift rounded half to even, for int32 m >= 0,
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
def plain_dequantize(values, scale, means, out_max, CENTERED: tl.constexpr):
    """values * scale per row, where no row is flagged (none_flagged), plus ``means``
    saturated at +-out_max where CENTERED: dequantize's bits where it has no non-finite
    code to decode."""
    y = values * scale[:, None, None]
    if CENTERED:
        y = tl.minimum(tl.maximum(y + means, -out_max), out_max)
    return y


@triton.jit
def dequantize(values, codes, scale, means, out_max, POS_INF_CODE, NEG_INF_CODE, NAN_CODE,
               CENTERED: tl.constexpr):
    """values * |scale| per row in fp32, plus ``means`` (each element's channel mean)
    saturated at +-out_max where CENTERED (NOTE [channel means]), and in flagged rows
    the non-finite codes' values (NOTE [non-finite groups])."""
    y = values * tl.abs(scale)[:, None, None]
    if CENTERED:
        y = tl.minimum(tl.maximum(y + means, -out_max), out_max)
    flagged = is_flagged(scale)
    y = tl.where(flagged & (codes == POS_INF_CODE), float("inf"), y)
    y = tl.where(flagged & (codes == NEG_INF_CODE), float("-inf"), y)
    return tl.where(flagged & (codes == NAN_CODE), float("nan"), y)


@triton.jit
def store_rounded(out_ptrs, y, mask, INTERPRETED: tl.constexpr):
    """Store fp32 y converted to the output dtype, rounding half to even. `.to` does on
    CUDA (cvt.rn) and, for fp16, in the interpreter; the interpreter's bf16 `.to`
    truncates, so there it is float32_to_bfloat16_rne."""
    if INTERPRETED:
        if out_ptrs.dtype.element_ty == tl.bfloat16:
            y = float32_to_bfloat16_rne(y)
    tl.store(out_ptrs, y.to(out_ptrs.dtype.element_ty), mask=mask)


# ----------------------------------------------------------------- host helpers


def check_group_size(group_size):
    if not (isinstance(group_size, int) and MIN_GROUP_SIZE <= group_size <= MAX_GROUP_SIZE
            and group_size & (group_size - 1) == 0):
        raise ValueError(
            f"group_size must be a power of two from {MIN_GROUP_SIZE} to {MAX_GROUP_SIZE}, "
            f"got {group_size!r}")


def check_float_dtype(dtype, what):
    if dtype not in SUPPORTED_DTYPES:
        allowed = ", ".join(str(d) for d in SUPPORTED_DTYPES)
        raise ValueError(f"{what} must be one of {allowed}, got {dtype}; integer and bool "
                         "tensors are never quantized: keep them as they are")


def flat_input(x, group_size):
    """x checked and flattened row-major into a contiguous 1-D tensor."""
    check_group_size(group_size)
    check_float_dtype(x.dtype, "the tensor to encode")
    return x.reshape(-1).contiguous()


class ChannelMeans(NamedTuple):
    """A kernel's NOTE [channel means] arguments, checked: the means (fp32, one per
    channel; a stand-in, unread, where there are none), the elements per channel of
    one sample, the channel count, and whether there are means at all."""

    means: torch.Tensor
    channel_size: int
    channels: int
    centered: bool

    def kernel_arguments(self, run) -> dict:
        """For a kernel whose threads own runs of ``run`` elements (NOTE [tile])."""
        size_magic, size_shift = magic_number(self.channel_size)
        count_magic, count_shift = magic_number(self.channels)
        return {"means_ptr": self.means, "channel_size": self.channel_size, "channels": self.channels,
                "size_magic": size_magic, "size_shift": size_shift, "count_magic": count_magic,
                "count_shift": count_shift, "CENTERED": self.centered,
                "RUN_CHANNELS": 1 if self.channel_size % run == 0 else 2 if self.channel_size >= run else 0}


def magic_number(divisor):
    """``(magic, shift)`` such that ``n // divisor == (2n * m) >> (32 + shift)`` for every
    0 <= n < 2**31, ``m`` being ``magic``'s uint32 bit pattern (NOTE [channel means]):
    m = ceil(2**(31 + l) / divisor) with l = ceil(log2(divisor)), which is below 2**32,
    and m * divisor - 2**(31 + l) < 2**l, the bound under which the quotient is exact
    (Granlund and Montgomery, "Division by invariant integers using multiplication", 1994).
    ``magic`` is returned as the int32 of that bit pattern."""
    shift = (divisor - 1).bit_length()
    multiplier = -(-(1 << (31 + shift)) // divisor)
    assert 1 << 31 <= multiplier < 1 << 32, (divisor, multiplier)
    return multiplier - (1 << 32), shift


def channel_means(x, means, stand_in):
    """``means`` for encoding ``x``, checked against it; None subtracts none, and then
    ``stand_in`` (any fp32 tensor on x's device) fills the pointer the kernel never reads."""
    if means is None:
        return ChannelMeans(stand_in, 1, 1, False)
    channels = x.shape[1] if x.dim() >= 2 else 0
    if means.shape != (channels,):
        raise ValueError(f"means must have shape (x.shape[1],) = ({channels},), one per channel of an "
                         f"N, C, ... tensor; got shape {tuple(means.shape)}")
    return _checked_means(means, channel_size(x.shape), x.numel(), x.device)


def decoded_channel_means(codes, means, channel_size, stand_in):
    """``means`` for decoding ``codes`` of a tensor whose channels hold ``channel_size``
    elements per sample, checked; None adds none (``stand_in`` as for channel_means)."""
    if means is None:
        return ChannelMeans(stand_in, 1, 1, False)
    return _checked_means(means, channel_size, codes.numel(), codes.device)


def _checked_means(means, channel_size, numel, device):
    if means.dtype != torch.float32 or means.dim() != 1 or means.device != device:
        raise ValueError(f"means must be a 1-D float32 tensor on {device}, one per channel; got "
                         f"{means.dtype} of shape {tuple(means.shape)} on {means.device}")
    if not (isinstance(channel_size, int) and channel_size >= 1) or numel % (means.numel() * channel_size):
        raise ValueError(f"{numel} elements are not whole samples of {means.numel()} channels of "
                         f"channel_size={channel_size!r} elements")
    return ChannelMeans(means.contiguous(), channel_size, means.numel(), True)


def flat_codes(codes, scales, code_dtype, dtype, group_size):
    """codes checked against their scales and flattened for decoding."""
    check_group_size(group_size)
    check_float_dtype(dtype, "the decoded dtype")
    if codes.dtype != code_dtype:
        raise ValueError(f"codes must be {code_dtype}, got {codes.dtype}")
    n_groups = triton.cdiv(codes.numel(), group_size)
    if scales.dtype != torch.float32 or scales.numel() != n_groups:
        raise ValueError(f"{codes.numel()} codes in groups of {group_size} need {n_groups} "
                         f"float32 scales, got {scales.numel()} {scales.dtype} scales")
    return codes.reshape(-1).contiguous(), scales.reshape(-1).contiguous()


def empty_encoding(flat, group_size, code_dtype):
    """Uninitialised codes (one byte per element, unpadded) and per-group scales."""
    codes = torch.empty(flat.numel(), dtype=code_dtype, device=flat.device)
    scales = torch.empty(triton.cdiv(flat.numel(), group_size), dtype=torch.float32, device=flat.device)
    return codes, scales


def launch(kernel, numel, group_size, run, means, *tensors, **arguments):
    """One launch of a group kernel over numel elements, on its tensors' device; none
    for an empty tensor, nor for meta tensors: they hold no data, and the launcher's
    allocations are what actsave.estimate simulates a CUDA step by. ``run`` is the
    elements each thread owns contiguously (NOTE [tile]), ``means`` the kernel's
    :class:`ChannelMeans`, ``arguments`` its other arguments by name."""
    if numel == 0 or tensors[0].device.type == "meta":
        return
    groups_per_program = max(1, ELEMENTS_PER_PROGRAM // group_size)
    run = min(run, group_size)
    grid = (triton.cdiv(triton.cdiv(numel, group_size), groups_per_program),)
    # Through the package's one launch helper: a kernel that fails to compile on the
    # user's GPU raises an error naming it and the fallback (_launch.py).
    _launch.launch(kernel, grid, *tensors, numel=numel, **means.kernel_arguments(run), GROUP_SIZE=group_size,
                   GROUPS_PER_PROGRAM=groups_per_program, RUN=run, INDEX_64=needs_int64(numel),
                   INTERPRETED=tensors[0].device.type == "cpu", **LAUNCH_OPTIONS, **arguments)


def needs_int64(numel):
    """Whether a launch over numel elements indexes in int64: where an offset in its last
    program's tile could reach 2**31 (the magic-number quotients of NOTE [channel means]
    need offsets below it too)."""
    return numel + ELEMENTS_PER_PROGRAM > 2**31


def run_elements(dtype):
    """Elements per thread run for a stream of ``dtype`` values: one 16-byte vector."""
    return VECTOR_BYTES // dtype.itemsize


# ----------------------------------------------------------------- torch references


def _per_channel_ref(flat, means):
    """flat viewed as (samples, channels, channel_size) and the means to broadcast on it."""
    return flat.view(-1, means.channels, means.channel_size), means.means.view(1, -1, 1)


def centered_input_ref(x, group_size, means):
    """``(source, centered)``: ``x`` flat in fp32, and those values less their channel's
    mean (NOTE [channel means]; ``means`` as :func:`channel_means` takes it). Where no
    mean is subtracted ``centered`` is ``source`` itself; otherwise it is a new tensor,
    the reference's own, which it may overwrite."""
    source = flat_input(x, group_size).to(torch.float32)
    checked = channel_means(x, means, source)
    if not checked.centered or source.numel() == 0:
        return source, source
    values, channel_means_ = _per_channel_ref(source, checked)
    return source, (values - channel_means_).view(-1)


def _per_element(scales, group_size, numel):
    return scales.repeat_interleave(group_size)[:numel]


def group_scale_ref(flat, group_size, code_max, non_finite):
    """NOTE [scale rule] for a flat fp32 tensor: per group, the signed scale, the
    multiplier (NaN where the finite absmax is 0: see scaled_ref) and the pre-scale
    (None where no group needs one). Zero padding is finite and leaves the absmax
    unchanged. One per-element temporary, so that the encoders' peak is their
    multiply's (scaled_ref), with or without a centered copy."""
    padding = -flat.numel() % group_size
    grouped = torch.nn.functional.pad(flat, (0, padding)) if padding else flat
    magnitude = grouped.view(-1, group_size).abs()
    flagged = magnitude.amax(dim=1).le(torch.finfo(torch.float32).max).logical_not_()  # amax propagates NaN
    absmax = magnitude.nan_to_num_(nan=0.0, posinf=0.0).amax(dim=1)
    del grouped, magnitude
    limit = torch.where(flagged, non_finite.finite_max, float(code_max))
    scales = absmax / limit
    scales = torch.where((scales * limit).isinf(), scales.nextafter(torch.zeros_like(scales)), scales)
    # An all-zero group needs no pre-scale (its multiplier is 0): ReLU outputs hold
    # many, and the meta tensors the planner profiles with hold none.
    tiny = (absmax > 0) & (absmax < TINY_ABSMAX.value)
    prescales = torch.where(tiny, PRESCALE.value, 1.0) if flat.device.type != "meta" and tiny.any() else None
    multipliers = limit / (absmax if prescales is None else absmax * prescales)
    multipliers = torch.where(absmax > 0, multipliers, float("nan"))
    return torch.where(flagged, -scales, scales), multipliers, prescales


def is_flagged_ref(scales, group_size, numel):
    """Per element: whether its group holds inf or NaN (the sign bit of the scale)."""
    return _per_element(scales, group_size, numel).signbit()


def any_flagged_ref(scales):
    """Whether some group holds inf or NaN, for references that take a cheaper path
    when none does. Meta tensors hold no data: they take the path of finite data,
    which is what actsave.estimate simulates."""
    return scales.device.type != "meta" and bool(scales.signbit().any())


def scaled_ref(flat, multipliers, prescales, group_size, in_place=False):
    """NOTE [scale rule]: each finite value times its group's pre-scale (if any) and then
    its multiplier, and +0 for the others and throughout a group whose finite absmax is
    0; ``in_place`` overwrites ``flat`` (a reference's own copy) and allocates no more
    than one per-element factor at a time."""
    if prescales is not None:
        factor = _per_element(prescales, group_size, flat.numel())
        flat = flat.mul_(factor) if in_place else flat * factor
        in_place = True
        del factor
    factor = _per_element(multipliers, group_size, flat.numel())
    scaled = flat.mul_(factor) if in_place else flat * factor
    # The same bits as masking: a finite value times a finite multiplier stays finite
    # (|t| <= code_max * (1 + 2**-23)); inf and NaN values, and every value of a group
    # whose multiplier is NaN (absmax 0), become +0.
    return scaled.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)


def with_non_finite_codes_ref(codes, flat, non_finite):
    codes = torch.where(flat == float("inf"), non_finite.pos_inf, codes)
    codes = torch.where(flat == float("-inf"), non_finite.neg_inf, codes)
    return torch.where(flat.isnan(), non_finite.nan, codes)


def _add_channel_means_(y, means, largest):
    """y plus its channel means, saturated at +-largest, in place (no view of y outlives
    the call, so that the callers' replacements of y free it)."""
    samples, channel_means_ = _per_channel_ref(y, means)
    samples.add_(channel_means_).clamp_(-largest, largest)


def dequantize_ref(values, codes, scales, non_finite, dtype, group_size, means):
    """values * |their group's scale| in fp32, plus their channel's mean saturated at
    dtype's largest finite value where ``means`` (a :class:`ChannelMeans`) has them
    (NOTE [channel means]), the non-finite codes of flagged groups decoded (NOTE
    [non-finite groups]), then rounded half to even to dtype."""
    y = values * _per_element(scales, group_size, values.numel()).abs()
    if means.centered and y.numel():
        _add_channel_means_(y, means, torch.finfo(dtype).max)
    flagged = is_flagged_ref(scales, group_size, values.numel())
    y = torch.where(flagged & (codes == non_finite.pos_inf), float("inf"), y)
    y = torch.where(flagged & (codes == non_finite.neg_inf), float("-inf"), y)
    y = torch.where(flagged & (codes == non_finite.nan), float("nan"), y)
    return y.to(dtype)
