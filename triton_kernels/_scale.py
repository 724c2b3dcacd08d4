"""A group's scale: how a group's values map onto a codec's codes and back, the groups
that hold inf or NaN, and the unsigned grids of non-negative tensors.

NOTE [ Scale rule ]
``scale = absmax / code_max`` over the group's finite values,
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
zeros.

NOTE [ Non-finite groups ]
``-inf`` is a legitimate activation (causal and vocabulary
masks), so it must neither become finite garbage nor spoil its group, and NaN must
stay NaN (AMP loss scalers look for it). In a flagged group each codec reserves three
codes (``NonFiniteCodes``) that decode to exactly +inf, -inf and NaN; the group's
finite values are scaled onto the codes one step below them and keep their
precision, the scale coming from them alone (int8 gives up its 127th step: 0.07 dB).
Unflagged groups never give these codes those meanings, so their bits are those of
the plain rule (NOTE [ Scale rule ]), and no byte is added.

NOTE [ Unsigned grids ]
A tensor the caller knows to be non-negative (a ReLU output)
can spend the sign bit on precision: each codec has an unsigned variant (int8 codes
0..255, fp8 e4m3 -> ue4m4, e5m2 -> ue5m3) whose scale maps the absmax onto the
unsigned grid's top, one more bit of resolution (about 6 dB of round-trip SQNR).
The grid is the caller's choice, recorded beside the codes, never detected from the
data (that would need a device sync or a per-group flag). A negative value given to
an unsigned variant saturates to 0. A flagged group (NOTE [ Non-finite groups ]) is
encoded exactly as by the signed codec, its codes stored as their byte, so the
non-finite rule is written once; decoding reads the flag first.
"""
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from . import on_general_path
from ._channel_means import add_channel_means_ref_

# NOTE [ Scale rule ]: below this absmax, the multiplier is taken after scaling by PRESCALE.
TINY_ABSMAX = tl.constexpr(2.0**-64)
PRESCALE = tl.constexpr(2.0**64)


class NonFiniteCodes(NamedTuple):
    """A codec's NOTE [ Non-finite groups ]: the largest finite code magnitude in a
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
def plain_group_scale(magnitudes, CODE_MAX: tl.constexpr):
    """NOTE [ Scale rule ] for the rows of a plain tile (NOTE [ Plain tiles ]), [groups]: the
    scale and the multiplier, the bits of group_scale's without its step, pre-scale
    and flag, none of which applies."""
    code_max = tl.full(magnitudes.shape, CODE_MAX, tl.float32)
    return tl.div_rn(magnitudes, code_max), tl.where(magnitudes > 0, tl.div_rn(code_max, magnitudes), 0.0)


@triton.jit
def none_flagged(scale):
    """Whether no group of the tile, given its [groups] scales, is flagged (NOTE
    [ Non-finite groups ]; a scalar)."""
    return tl.min(scale.to(tl.int32, bitcast=True), axis=0) >= 0


@triton.jit
def group_scale(x, CODE_MAX, NON_FINITE_CODE_MAX):
    """NOTE [ Scale rule ] per row of a [groups, runs, RUN] fp32 block: the signed scale,
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
    (NOTE [ Non-finite groups ]: the sign bit of its scale)."""
    return (scale.to(tl.int32, bitcast=True) < 0)[:, None, None]


@triton.jit
def with_non_finite_codes(codes, x, POS_INF_CODE, NEG_INF_CODE, NAN_CODE):
    """codes with those of NOTE [ Non-finite groups ] where x is +inf, -inf or NaN."""
    codes = tl.where(x == float("inf"), POS_INF_CODE, codes)
    codes = tl.where(x == float("-inf"), NEG_INF_CODE, codes)
    return tl.where(x != x, NAN_CODE, codes)


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
    saturated at +-out_max where CENTERED (NOTE [ Channel means ]), and in flagged rows
    the non-finite codes' values (NOTE [ Non-finite groups ])."""
    y = values * tl.abs(scale)[:, None, None]
    if CENTERED:
        y = tl.minimum(tl.maximum(y + means, -out_max), out_max)
    flagged = is_flagged(scale)
    y = tl.where(flagged & (codes == POS_INF_CODE), float("inf"), y)
    y = tl.where(flagged & (codes == NEG_INF_CODE), float("-inf"), y)
    return tl.where(flagged & (codes == NAN_CODE), float("nan"), y)


# ----------------------------------------------------------------- torch references


def _per_element(scales, group_size, numel):
    return scales.repeat_interleave(group_size)[:numel]


def group_scale_ref(flat, group_size, code_max, non_finite):
    """NOTE [ Scale rule ] for a flat fp32 tensor: per group, the signed scale, the
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
    # Traced into a compiled graph, no branch may read a value: every group takes the
    # pre-scale path there, which multiplies the others by 1.0, giving the same bits.
    tiny = (absmax > 0) & (absmax < TINY_ABSMAX.value)
    pre_scaled = flat.device.type != "meta" and (on_general_path() or bool(tiny.any()))
    prescales = torch.where(tiny, PRESCALE.value, 1.0) if pre_scaled else None
    multipliers = limit / (absmax if prescales is None else absmax * prescales)
    multipliers = torch.where(absmax > 0, multipliers, float("nan"))
    return torch.where(flagged, -scales, scales), multipliers, prescales


def is_flagged_ref(scales, group_size, numel):
    """Per element: whether its group holds inf or NaN (the sign bit of the scale)."""
    return _per_element(scales, group_size, numel).signbit()


def any_flagged_ref(scales):
    """Whether some group holds inf or NaN, for references that take a cheaper path
    when none does. Meta tensors hold no data: they take the path of finite data,
    which is what actsave.estimate simulates. Traced into a compiled graph, no branch
    may read a value: there every reference takes the general path, which gives
    unflagged groups the same bits."""
    return scales.device.type != "meta" and (on_general_path() or bool(scales.signbit().any()))


def scaled_ref(flat, multipliers, prescales, group_size, in_place=False):
    """NOTE [ Scale rule ]: each finite value times its group's pre-scale (if any) and then
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


def dequantize_ref(values, codes, scales, non_finite, dtype, group_size, means):
    """values * |their group's scale| in fp32, plus their channel's mean saturated at
    dtype's largest finite value where ``means`` (a :class:`ChannelMeans`) has them
    (NOTE [ Channel means ]), the non-finite codes of flagged groups decoded (NOTE
    [ Non-finite groups ]), then rounded half to even to dtype."""
    y = values * _per_element(scales, group_size, values.numel()).abs()
    if means.centered and y.numel():
        add_channel_means_ref_(y, means, torch.finfo(dtype).max)
    flagged = is_flagged_ref(scales, group_size, values.numel())
    # Set in dtype, after the rounding: torch's CPU cast of fp32's NaN to bfloat16 gives
    # 0xFFFF, where the kernels store bfloat16's own quiet NaN, 0x7FC0.
    y = y.to(dtype)
    y = torch.where(flagged & (codes == non_finite.pos_inf), float("inf"), y)
    y = torch.where(flagged & (codes == non_finite.neg_inf), float("-inf"), y)
    return torch.where(flagged & (codes == non_finite.nan), float("nan"), y)
