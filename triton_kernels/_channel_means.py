"""Channel means: one fp32 mean per channel subtracted from the values before an
encoder scales them, and added back by the decoder, in the kernels and in the
references alike.

NOTE [ Channel means ]
An encoder may be given one fp32 mean per channel (dim 1 of an N, C, ... tensor) to
subtract from each value as it is loaded, correctly rounded, before anything else; the
group's scale and codes are those of the centered values, and the non-finite codes mark
the input's own inf and NaN. In place of the means it may be given the channels' fp32
sums (``sums=``): each mean is then its sum divided by the channel's element count
(numel / channels, as an fp32), correctly rounded, as it is loaded, which are the bits
torch.mean gives on a CPU (a sum, then that division). One sum is one operator on the
host, a mean on a CPU two (the sum and the division): the codecs keep sums. A mean that
is not finite (its channel holds an inf or a NaN) or beyond +-MAX_MEAN is taken as 0, as
it is loaded: so the caller passes the means (or sums) as a reduction gives them, with
no pass of its own over them (each a launch on a GPU), and inf and NaN come back as they
went in. MAX_MEAN, 2**100, is below half an ulp of fp32's largest binade (2**103), so
``x - m`` and ``x + m`` stay finite for every finite x. The decoder given the same means
(or sums) adds each back to ``value(code) * |scale|`` in fp32, a second correctly
rounded operation (launches disable Triton's FMA fusion, ``COMPILE_OPTIONS`` in
_tile.py), and saturates the sum at the output dtype's largest finite value: a finite
value near it may come back a rounding step beyond it, which must not become inf. Then
the non-finite codes are decoded, as without means. Doing both in the kernels costs no
copy of the tensor (a centered copy would be live beside it while encoding, a wide one
while decoding to a half type); the references work in place on their own copies, for
the same reason. Element i's channel is ``(i // channel_size) % channels``; with int32
offsets both divisions are a multiply and a shift (``magic_number``: _division.py's NOTE
[ Division by an invariant ], exact below 2**31), worked out once per run where a run
meets at most two channels (channel_size >= RUN; one where channel_size is a multiple of
RUN), else once per element; int64 offsets divide.
"""
import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from . import MAX_MEAN, channel_size
from ._division import divide, int32_bits, multiplier_and_shift

_MAX_MEAN = tl.constexpr(MAX_MEAN)


# ----------------------------------------------------------------- Triton helpers


@triton.jit
def quotient(n, divisor, magic, shift, INDEX_64: tl.constexpr):
    """n // divisor for n >= 0: an int64 division where INDEX_64, else, n being below
    2**31, by the divisor's magic number and shift (NOTE [ Division by an invariant ];
    ``magic`` is its uint32 bit pattern held in an int32)."""
    if INDEX_64:
        return n // divisor
    return divide(n, magic, shift)


@triton.jit
def channel_means_of(runs, offsets, in_bounds, means_ptr, mean_divisor, channel_size, channels, size_magic,
                     size_shift, count_magic, count_shift, RUN_CHANNELS: tl.constexpr, INDEX_64: tl.constexpr):
    """Each element's channel mean (NOTE [ Channel means ]): element i of a contiguous N, C,
    ... tensor is in channel (i // channel_size) % channels, whose mean is its value at
    ``means_ptr`` over ``mean_divisor`` (1 for means, the count for sums). RUN_CHANNELS is how many
    channels one run may span: 1 (channel_size is a multiple of RUN: one mean per run),
    2 (channel_size >= RUN: the run's first channel, then from the element where the
    next one starts, that one), or 0 (more: each element's channel is worked out)."""
    if RUN_CHANNELS == 0:
        samples_and_channels = quotient(offsets, channel_size, size_magic, size_shift, INDEX_64)
        channel = samples_and_channels - quotient(samples_and_channels, channels, count_magic, count_shift,
                                                  INDEX_64) * channels
        means = tl.div_rn(tl.load(means_ptr + channel, mask=in_bounds, other=0.0), mean_divisor)
    else:
        samples_and_channels = quotient(runs, channel_size, size_magic, size_shift, INDEX_64)
        first = samples_and_channels - quotient(samples_and_channels, channels, count_magic, count_shift,
                                                INDEX_64) * channels
        means = tl.div_rn(tl.load(means_ptr + first), mean_divisor)  # [groups, runs, 1]: one per run
        if RUN_CHANNELS == 2:
            into_channel = runs - samples_and_channels * channel_size
            following = tl.where(first + 1 == channels, 0, first + 1)
            in_first = offsets - runs < channel_size - into_channel
            means = tl.where(in_first, means, tl.div_rn(tl.load(means_ptr + following), mean_divisor))
    return tl.where(tl.abs(means) <= _MAX_MEAN, means, 0.0)  # not finite, or too large: 0


@triton.jit
def largest_finite(out_ptrs):
    """The largest finite value of the output pointers' dtype, as fp32."""
    if out_ptrs.dtype.element_ty == tl.float16:
        return 65504.0
    if out_ptrs.dtype.element_ty == tl.bfloat16:
        return 3.3895313892515355e38
    return 3.4028234663852886e38


# ----------------------------------------------------------------- host helpers


class ChannelMeans(NamedTuple):
    """A kernel's NOTE [ Channel means ] arguments, checked: the means, or the sums they
    are worked out from (fp32, one per channel; a stand-in, unread, where there are
    none), the elements per channel of one sample, the channel count, whether there are
    means at all, and what divides each value into its mean (1, or for sums the
    channel's element count)."""

    means: torch.Tensor
    channel_size: int
    channels: int
    centered: bool
    divisor: float = 1.0


def channel_arguments(channel_size: int, channels: int, centered: bool, run: int, divisor: float) -> dict:
    """A kernel's NOTE [ Channel means ] arguments but the means themselves, for a
    kernel whose threads own runs of ``run`` elements (NOTE [ Tile ])."""
    size_magic, size_shift = magic_number(channel_size)
    count_magic, count_shift = magic_number(channels)
    return {"mean_divisor": divisor, "channel_size": channel_size, "channels": channels, "size_magic": size_magic,
            "size_shift": size_shift, "count_magic": count_magic, "count_shift": count_shift, "CENTERED": centered,
            "RUN_CHANNELS": 1 if channel_size % run == 0 else 2 if channel_size >= run else 0}


@functools.lru_cache(maxsize=1024)  # a few sizes a model: each worked out once, not twice a launch
def magic_number(divisor):
    """``(magic, shift)`` such that ``n // divisor == (2n * m) >> (32 + shift)`` for every
    0 <= n < 2**31, ``m`` being ``magic``'s uint32 bit pattern, returned as the int32 of
    those bits (_division.py, NOTE [ Division by an invariant ]). Any divisor: a size
    of 2**31 or more is passed, and never divided by (its offsets are int64)."""
    multiplier, shift = multiplier_and_shift(divisor)
    assert 1 << 31 <= multiplier < 1 << 32, (divisor, multiplier)
    return int32_bits(multiplier), shift


def channel_means(x, means, stand_in, sums=None):
    """``means`` (or ``sums``, one of them) for encoding ``x``, checked against it; neither
    subtracts none, and then ``stand_in`` (any fp32 tensor on x's device) fills the
    pointer the kernel never reads."""
    if means is None and sums is None:
        return ChannelMeans(stand_in, 1, 1, False)
    given, name = _given(means, sums)
    shape = x.shape
    channels = shape[1] if len(shape) >= 2 else 0
    if given.shape != (channels,):
        raise ValueError(f"{name} must have shape (x.shape[1],) = ({channels},), one per channel of an "
                         f"N, C, ... tensor; got shape {tuple(given.shape)}")
    return _checked_means(given, name, channel_size(shape), x.numel(), x.device)


def decoded_channel_means(codes, means, channel_size, stand_in, sums=None):
    """``means`` (or ``sums``) for decoding ``codes`` of a tensor whose channels hold
    ``channel_size`` elements per sample, checked; neither adds none (``stand_in`` as
    for channel_means)."""
    if means is None and sums is None:
        return ChannelMeans(stand_in, 1, 1, False)
    given, name = _given(means, sums)
    return _checked_means(given, name, channel_size, codes.numel(), codes.device)


def _given(means, sums):
    """``(tensor, its argument's name)`` of whichever of the two is given (one is)."""
    if sums is None:
        return means, "means"
    if means is not None:
        raise ValueError("pass the channels' means or their sums, not both")
    return sums, "sums"


def _checked_means(values, name, channel_size, numel, device):
    if values.dtype != torch.float32 or values.dim() != 1 or values.device != device:
        raise ValueError(f"{name} must be a 1-D float32 tensor on {device}, one per channel; got "
                         f"{values.dtype} of shape {tuple(values.shape)} on {values.device}")
    channels = values.numel()
    if not (isinstance(channel_size, int) and channel_size >= 1) or (
            numel % (channels * channel_size) if channels else numel):
        raise ValueError(f"{numel} elements are not whole samples of {channels} channels of "
                         f"channel_size={channel_size!r} elements")
    if not channels:  # an empty tensor of no channels: nothing to subtract, nothing launched
        return ChannelMeans(values, 1, 1, False)
    # A sum's channel holds numel / channels elements; a mean is its own (NOTE [ Channel means ]).
    divisor = float(numel // channels) if name == "sums" else 1.0
    # Resolved: a kernel reads memory, which for torch._neg_view holds the negated values.
    return ChannelMeans(values.resolve_neg().contiguous(), channel_size, channels, True, divisor)


# ----------------------------------------------------------------- torch references


def per_channel_ref(flat, means):
    """flat viewed as (samples, channels, channel_size) and the means to broadcast on it
    (sums divided by their count), each taken as 0 where not finite or beyond MAX_MEAN
    (NOTE [ Channel means ])."""
    values = means.means
    if means.divisor != 1.0:  # sums: each over its channel's count, correctly rounded
        # By a tensor on their device: CUDA divides by a Python number's reciprocal.
        values = values / values.new_full((), means.divisor)
    taken = torch.where(values.abs() <= MAX_MEAN, values, 0.0)
    return flat.view(-1, means.channels, means.channel_size), taken.view(1, -1, 1)


def add_channel_means_ref_(y, means, largest):
    """y plus its channel means, saturated at +-largest, in place (no view of y outlives
    the call, so that the callers' replacements of y free it)."""
    samples, channel_means_ = per_channel_ref(y, means)
    samples.add_(channel_means_).clamp_(-largest, largest)
