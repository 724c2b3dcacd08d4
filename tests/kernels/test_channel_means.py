"""NOTE [ Channel means ] (triton_kernels/_channel_means.py): an encoder given one mean per
channel (or the channels' sums) subtracts it as it loads, and the decoder adds it back as
it stores. For every signed format, read from the kernel table: the kernels against
their references bit for bit, and the references against the rule."""
from functools import partial

import pytest
import torch

from actsave.triton_kernels import SIGNED_FORMATS, channel_size, kernel_table
from actsave.triton_kernels import _channel_means, _tile

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter")


def _pair(fmt, impl):
    """(encode, decode) of ``fmt`` as the Triton kernel or as its reference."""
    kernels = [kernel_table()[fmt, direction] for direction in ("encode", "decode")]
    return tuple(partial(k.launcher if impl == "triton" else k.reference, **k.format_args) for k in kernels)


def _channels_input(shape, seed=0):
    """Conv-like activations whose channel means are several times their spread."""
    generator = torch.Generator().manual_seed(seed)
    means = 4 * torch.randn(shape[1], generator=generator).view(1, -1, *[1] * (len(shape) - 2))
    return torch.randn(*shape, generator=generator) + means


def _per_channel(means, rank):
    return means.view(1, -1, *[1] * (rank - 2))


# name -> (x, means); x is cast to the dtype under test. Shapes whose channel size is
# not a multiple of the group put several channels, and a channel's end, in one group.
CASES = {
    "4d": lambda: (_channels_input((2, 3, 5, 7)), 4 * torch.randn(3)),
    "5d": lambda: (_channels_input((2, 4, 3, 3, 3)), 4 * torch.randn(4)),
    "2d": lambda: (torch.randn(9, 20), torch.randn(20)),
    "several_programs": lambda: (_channels_input((4, 8, 16, 16)), torch.randn(8)),
    "non_finite": lambda: (_channels_input((2, 3, 4, 4)).index_put_(
        (torch.tensor([0, 1, 1]), torch.tensor([0, 2, 2]), torch.tensor([1, 3, 0]), torch.tensor([1, 0, 2])),
        torch.tensor([float("inf"), float("nan"), float("-inf")])), torch.randn(3)),
    "zero_means": lambda: (_channels_input((2, 3, 4, 4)), torch.zeros(3)),
    "sliced": lambda: (_channels_input((4, 6, 9, 9))[::2, 1:4, 2:7], torch.randn(3)),
    # A thread's run of 16 (encoding) or 4 to 8 (decoding) elements spans several channels,
    # or lies in one, or crosses into the next (NOTE [ Channel means ]).
    "3x3": lambda: (_channels_input((3, 5, 3, 3)), torch.randn(5)),
    "many_channels_2x2": lambda: (_channels_input((2, 70, 2, 2)), torch.randn(70)),
    "8x8": lambda: (_channels_input((2, 16, 8, 8)), torch.randn(16)),
    # Whole tiles of 4096 values (a partial one is centered on the general path).
    "whole_tiles_6x6": lambda: (_channels_input((8, 128, 6, 6)), torch.randn(128)),
    "whole_tile_2x2": lambda: (_channels_input((16, 64, 2, 2)), torch.randn(64)),
}


def _assert_kernel_matches_reference(fmt, case, dtype, group_size, device, assert_same_bits, given="means"):
    """Codes, scales and the decoded values at every output dtype, means added back;
    ``given="sums"`` passes the case's means times each channel's count as ``sums``,
    which the kernels divide back, rounding (NOTE [ Channel means ])."""
    torch.manual_seed(0)
    x, means = CASES[case]()
    x = x.to(dtype)
    offsets = {given: means if given == "means" else means * (x.numel() // means.numel())}
    on_device = {given: offsets[given].to(device)}
    (encode, decode), (encode_ref, decode_ref) = _pair(fmt, "triton"), _pair(fmt, "reference")
    codes, scales = encode(x.to(device), group_size=group_size, **on_device)
    ref_codes, ref_scales = encode_ref(x, group_size=group_size, **offsets)
    assert_same_bits(codes.cpu(), ref_codes)
    assert_same_bits(scales.cpu(), ref_scales)
    for out_dtype in (torch.float32, torch.bfloat16, torch.float16):
        decoded = decode(codes, scales, dtype=out_dtype, group_size=group_size, channel_size=channel_size(x.shape),
                         **on_device)
        expected = decode_ref(ref_codes, ref_scales, dtype=out_dtype, group_size=group_size,
                              channel_size=channel_size(x.shape), **offsets)
        assert_same_bits(decoded.cpu(), expected)


@pytest.mark.parametrize("fmt", SIGNED_FORMATS)
@pytest.mark.parametrize("case", sorted(CASES))
def test_kernel_matches_reference(fmt, case, dtype, group_size, assert_same_bits):
    _assert_kernel_matches_reference(fmt, case, dtype, group_size, "cpu", assert_same_bits)


@pytest.mark.parametrize("fmt", SIGNED_FORMATS)
@pytest.mark.parametrize("case", sorted(CASES))
def test_kernel_matches_reference_given_sums(fmt, case, dtype, group_size, assert_same_bits):
    _assert_kernel_matches_reference(fmt, case, dtype, group_size, "cpu", assert_same_bits, given="sums")


@pytest.mark.cuda
@pytest.mark.parametrize("fmt", SIGNED_FORMATS)
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("given", ["means", "sums"])
def test_cuda_kernel_matches_reference(fmt, case, dtype, group_size, assert_same_bits, given):
    _assert_kernel_matches_reference(fmt, case, dtype, group_size, "cuda", assert_same_bits, given)


@pytest.mark.parametrize("fmt", SIGNED_FORMATS)
@pytest.mark.parametrize("impl", ["triton", "reference"])
@pytest.mark.parametrize("case", ["4d", "5d", "3x3", "non_finite"])
def test_sums_give_the_bits_of_torchs_means(fmt, impl, case, group_size, assert_same_bits):
    """Each sum over its channel's count, correctly rounded: torch.mean's bits on a CPU,
    the channel's count not a power of two here (70, 54, 27; 32 beside inf and NaN)."""
    x, _ = CASES[case]()
    dims = (0, *range(2, x.dim()))
    sums, means = torch.sum(x, dims, dtype=torch.float32), torch.mean(x, dims, dtype=torch.float32)
    encode, decode = _pair(fmt, impl)
    codes, scales = encode(x, group_size=group_size, sums=sums)
    expected_codes, expected_scales = encode(x, group_size=group_size, means=means)
    assert_same_bits(codes, expected_codes)
    assert_same_bits(scales, expected_scales)
    assert_same_bits(decode(codes, scales, dtype=torch.float32, group_size=group_size, sums=sums,
                            channel_size=channel_size(x.shape)),
                     decode(codes, scales, dtype=torch.float32, group_size=group_size, means=means,
                            channel_size=channel_size(x.shape)))


@pytest.mark.parametrize("fmt", SIGNED_FORMATS)
@pytest.mark.parametrize("impl", ["triton", "reference"])
def test_the_codec_of_the_centered_tensor_with_the_means_added_back(fmt, impl, group_size, assert_same_bits):
    x, means = CASES["several_programs"]()
    encode, decode = _pair(fmt, impl)
    codes, scales = encode(x, group_size=group_size, means=means)
    plain_codes, plain_scales = encode(x - _per_channel(means, x.dim()), group_size=group_size)
    assert_same_bits(codes, plain_codes)
    assert_same_bits(scales, plain_scales)
    decoded = decode(codes, scales, dtype=torch.float32, group_size=group_size, means=means,
                     channel_size=channel_size(x.shape))
    centered = decode(codes, scales, dtype=torch.float32, group_size=group_size).view(x.shape)
    assert_same_bits(decoded, (centered + _per_channel(means, x.dim())).view(-1))


@pytest.mark.parametrize("fmt", SIGNED_FORMATS)
@pytest.mark.parametrize("impl", ["triton", "reference"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_finite_values_at_the_dtype_maximum_come_back_finite(fmt, impl, dtype, group_size):
    # A mean may carry a value a rounding step past the dtype's largest finite one;
    # decoding saturates there instead of returning inf.
    largest = torch.finfo(dtype).max
    x = torch.full((2, 2, 4, 4), largest, dtype=dtype)
    x[:, 1] = -largest
    x[0, 0, 0, :2] = largest / 3  # a spread, so that the centered values are not all 0
    means = torch.tensor([largest * 0.9, -largest * 0.9], dtype=torch.float32)
    encode, decode = _pair(fmt, impl)
    codes, scales = encode(x, group_size=group_size, means=means)
    decoded = decode(codes, scales, dtype=dtype, group_size=group_size, means=means, channel_size=16)
    assert decoded.isfinite().all()


@pytest.mark.parametrize("fmt", SIGNED_FORMATS)
@pytest.mark.parametrize("impl", ["triton", "reference"])
def test_non_finite_values_keep_their_codes_and_flag_their_groups(fmt, impl, group_size):
    x, means = CASES["non_finite"]()
    encode, decode = _pair(fmt, impl)
    codes, scales = encode(x, group_size=group_size, means=means)
    decoded = decode(codes, scales, dtype=torch.float32, group_size=group_size, means=means,
                     channel_size=channel_size(x.shape)).view(x.shape)
    assert torch.equal(decoded.isnan(), x.isnan())
    assert torch.equal(decoded.isposinf(), x.isposinf()) and torch.equal(decoded.isneginf(), x.isneginf())
    assert torch.equal(scales.signbit(), ~torch.nn.functional.pad(
        x.isfinite().reshape(-1), (0, -x.numel() % group_size), value=True).view(-1, group_size).all(dim=1))


@pytest.mark.parametrize("impl", ["triton", "reference"])
@pytest.mark.parametrize("means, message", [
    (torch.zeros(4, dtype=torch.float64), "float32"),
    (torch.zeros(3), r"shape \(x.shape\[1\],\) = \(4,\)"),
    (torch.zeros(4, 1), r"got shape \(4, 1\)"),
])
def test_encode_rejects_means_that_do_not_fit(impl, means, message):
    encode, _ = _pair("int8", impl)
    with pytest.raises(ValueError, match=message):
        encode(torch.randn(2, 4, 3, 3), group_size=16, means=means)
    with pytest.raises(ValueError, match=message.replace("means", "sums")):
        encode(torch.randn(2, 4, 3, 3), group_size=16, sums=means)


@pytest.mark.parametrize("impl", ["triton", "reference"])
def test_means_and_sums_together_are_refused(impl):
    encode, decode = _pair("int8", impl)
    x, offsets = torch.randn(2, 4, 3, 3), torch.zeros(4)
    with pytest.raises(ValueError, match="means or their sums, not both"):
        encode(x, group_size=16, means=offsets, sums=offsets)
    codes, scales = encode(x, group_size=16)
    with pytest.raises(ValueError, match="means or their sums, not both"):
        decode(codes, scales, dtype=torch.float32, group_size=16, means=offsets, sums=offsets, channel_size=9)


@pytest.mark.parametrize("impl", ["triton", "reference"])
def test_sums_of_no_channels_fit_only_an_empty_tensor(impl):
    encode, decode = _pair("int8", impl)
    codes, scales = encode(torch.randn(2, 0, 3, 3), group_size=16, sums=torch.zeros(0))
    assert codes.numel() == scales.numel() == 0
    assert decode(codes, scales, dtype=torch.float32, group_size=16, sums=torch.zeros(0)).numel() == 0
    codes, scales = encode(torch.randn(16), group_size=16)
    with pytest.raises(ValueError, match="not whole samples of 0 channels"):
        decode(codes, scales, dtype=torch.float32, group_size=16, sums=torch.zeros(0))


@pytest.mark.parametrize("fmt", SIGNED_FORMATS)
def test_arguments_whose_memory_holds_their_negation_are_read_by_their_values(fmt, assert_same_bits):
    # torch._neg_view: the values are the negation of what memory holds, which a kernel reads.
    x = _channels_input((2, 4, 4, 4))
    sums = torch.sum(x, (0, 2, 3), dtype=torch.float32)
    negated = torch._neg_view(-sums)
    codes, scales = _pair(fmt, "reference")[0](x, group_size=16, sums=sums)
    for impl in ("triton", "reference"):
        encode, decode = _pair(fmt, impl)
        for got, expected in zip(encode(x, group_size=16, sums=negated), (codes, scales)):
            assert_same_bits(got, expected)
        expected = decode(codes, scales, dtype=torch.float32, group_size=16, sums=sums, channel_size=16)
        for arguments in ((torch._neg_view(-codes), scales, sums), (codes, torch._neg_view(-scales), sums),
                          (codes, scales, negated)):
            got = decode(*arguments[:2], dtype=torch.float32, group_size=16, sums=arguments[2], channel_size=16)
            assert_same_bits(got, expected)


@pytest.mark.parametrize("impl", ["triton", "reference"])
@pytest.mark.parametrize("means, channel_size, message", [
    (torch.zeros(4, dtype=torch.float64), 9, "1-D float32"),
    (torch.zeros(4, 1), 9, "1-D float32"),
    (torch.zeros(4), 7, "not whole samples of 4 channels of channel_size=7"),
    (torch.zeros(4), 0, "channel_size=0"),
])
def test_decode_rejects_means_that_do_not_fit(impl, means, channel_size, message):
    encode, decode = _pair("int8", impl)
    codes, scales = encode(torch.randn(2, 4, 3, 3), group_size=16)
    with pytest.raises(ValueError, match=message):
        decode(codes, scales, dtype=torch.float32, group_size=16, means=means, channel_size=channel_size)


def test_magic_numbers_divide_exactly_below_2_pow_31():
    """The kernels' channel index (int32 offsets) divides by a multiply: exact for every
    n < 2**31 (checked at random n, and around the multiples of the divisor near 2**31)."""
    generator = torch.Generator().manual_seed(0)
    for divisor in [*range(1, 1100), 2**20 - 1, 2**20 + 7, 3 * 2**28, 2**30 + 3, 2**31 - 1, 2**31]:
        magic, shift = _channel_means.magic_number(divisor)
        multiplier = magic % 2**32
        top = (2**31 - 1) // divisor * divisor
        n = torch.cat([torch.randint(0, 2**31, (2000,), generator=generator), torch.arange(min(divisor * 3, 5000)),
                       torch.tensor([top - 1, top, top + 1, 2**31 - 1])]).clamp(0, 2**31 - 1)
        # (2n * m) >> (32 + shift) without overflowing int64: m in 16-bit halves.
        high, low = multiplier >> 16, multiplier & 0xFFFF
        quotient = ((2 * n * high) + ((2 * n * low) >> 16)) >> (16 + shift)
        assert torch.equal(quotient, n // divisor), divisor


@pytest.mark.parametrize("fmt", SIGNED_FORMATS)
@pytest.mark.parametrize("case", ["4d", "3x3", "several_programs"])
def test_int64_offsets_match_reference(fmt, case, group_size, assert_same_bits, monkeypatch):
    """Tensors of 2**31 elements and more index in int64 (needs_int64); forced here on
    small ones, with and without means, so that the interpreter checks that path."""
    monkeypatch.setattr(_tile, "needs_int64", lambda numel: True)
    for dtype in (torch.float32, torch.bfloat16):
        _assert_kernel_matches_reference(fmt, case, dtype, group_size, "cpu", assert_same_bits)
        x, _ = CASES[case]()
        encode, decode = _pair(fmt, "triton")
        encode_ref, decode_ref = _pair(fmt, "reference")
        codes, scales = encode(x.to(dtype), group_size=group_size)
        ref_codes, ref_scales = encode_ref(x.to(dtype), group_size=group_size)
        assert_same_bits(codes, ref_codes)
        assert_same_bits(scales, ref_scales)
        assert_same_bits(decode(codes, scales, dtype=dtype, group_size=group_size),
                         decode_ref(ref_codes, ref_scales, dtype=dtype, group_size=group_size))
