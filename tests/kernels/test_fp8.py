"""fp8 codec (e4m3, e5m2): the Triton kernels against their torch reference, bit for
bit, and the reference against torch's fp8 casts and the rules it defines
(triton_kernels/fp8.py, _scale.py, _rounding.py)."""
from functools import partial

import pytest
import torch

from actsave.triton_kernels.fp8 import (
    FP8_FORMATS,
    UNSIGNED_FP8_FORMATS,
    decode_fp8,
    decode_fp8_ref,
    encode_fp8,
    encode_fp8_ref,
)

# numpy runs the interpreter's arithmetic and warns about arithmetic on inf and NaN
# (their codes' values times the scale, replaced after) and about casts that overflow
# to inf, all intended.
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter")

# Round-trip SQNR floors in dB at the default group size (128), a few dB under what
# was measured on the `signals` fixture (fp32 / bf16 / fp16):
SQNR_FLOORS_DB = {
    "e4m3": {
        "gaussian": 29.0,  # 31.7 / 31.7 / 31.7
        "post_relu": 29.0,  # 31.9 / 31.9 / 31.9
        "student_t3": 30.0,  # heavy tails: 33.2 / 33.2 / 33.2
        "outlier_channels": 36.0,  # 1 channel in 64 is 100x larger: 39.1 / 39.3 / 39.1
    },
    "e5m2": {
        "gaussian": 23.0,  # 25.8 / 25.8 / 25.8
        "post_relu": 23.0,  # 26.0 / 26.1 / 26.0
        "student_t3": 24.0,  # 26.9 / 26.9 / 26.9
        "outlier_channels": 31.0,  # 34.1 / 34.1 / 34.1
    },
}


@pytest.fixture(params=sorted(FP8_FORMATS))
def fmt(request):
    return request.param


@pytest.fixture
def kernel(fmt):
    return partial(encode_fp8, fmt=fmt), partial(decode_fp8, fmt=fmt)


@pytest.fixture
def reference(fmt):
    return partial(encode_fp8_ref, fmt=fmt), partial(decode_fp8_ref, fmt=fmt)


@pytest.fixture(params=["triton", "reference"])
def codec(request, kernel, reference):
    return kernel if request.param == "triton" else reference


def _finite_values(fmt):
    """Every finite fp8 value >= 0, ascending, as fp32."""
    spec = FP8_FORMATS[fmt]
    codes = torch.arange(spec.first_special_code, dtype=torch.uint8)
    return codes.view(spec.torch_dtype).float()


def _encode_at_unit_scale(encode, values, fmt, group_size):
    """Codes of values as the encoder sees them: each group also holds FP8_MAX, which
    makes its scale and its multiplier exactly 1, so each x is coded as itself."""
    per_group = group_size - 1
    padded = torch.nn.functional.pad(values, (0, -values.numel() % per_group))
    groups = padded.view(-1, per_group)
    top = torch.full((groups.shape[0], 1), FP8_FORMATS[fmt].max_value)
    codes, scales = encode(torch.cat([top, groups], dim=1), group_size=group_size)
    assert (scales == 1).all()
    return codes.view(-1, group_size)[:, 1:].reshape(-1)[: values.numel()]


def test_kernel_matches_reference(input_case, group_size, kernel, reference, assert_matches_reference):
    assert_matches_reference(kernel, reference, input_case, group_size)


def test_kernel_matches_reference_at_dtype_extremes(extreme_input, group_size, kernel, reference,
                                                    assert_matches_reference):
    assert_matches_reference(kernel, reference, extreme_input, group_size)


def test_kernel_matches_reference_at_default_group_size(dtype, kernel, reference, assert_matches_reference):
    torch.manual_seed(0)
    x = torch.randn(5, 300)
    x[1, 7], x[3] = float("nan"), 0.0
    assert_matches_reference(kernel, reference, x.to(dtype), 128)


def test_decode_to_any_dtype_matches_reference(out_dtype, group_size, kernel, reference,
                                               assert_matches_reference):
    """Magnitudes from 1e-12 to 1e6: fp16 outputs overflow to inf and go subnormal."""
    torch.manual_seed(0)
    x = torch.randn(16, 64) * 10 ** torch.empty(16, 1).uniform_(-12, 6)
    assert_matches_reference(kernel, reference, x, group_size, out_dtype)


def test_codes_equal_torch_casts_over_the_whole_range(fmt, kernel, reference, group_size):
    """Every fp8 value, every midpoint between neighbours (ties), the fp32 values just
    either side of each midpoint and log-uniform values down to far below the smallest
    subnormal, both signs: the integer encoder and the reference agree with torch."""
    torch.manual_seed(0)
    finite = _finite_values(fmt)
    midpoints = (finite[:-1] + finite[1:]) / 2
    magnitudes = torch.cat([
        finite, midpoints, midpoints.nextafter(torch.tensor(0.0)), midpoints.nextafter(torch.tensor(1e9)),
        torch.pow(2.0, torch.empty(2000).uniform_(-40, 0)) * finite[-1],
    ])
    values = torch.cat([magnitudes, -magnitudes])
    expected = values.to(FP8_FORMATS[fmt].torch_dtype).view(torch.uint8)
    for encode, _ in (kernel, reference):
        assert torch.equal(_encode_at_unit_scale(encode, values, fmt, group_size), expected)


def test_torch_casts_round_ties_to_even(fmt):
    """The reference relies on torch's fp8 cast rounding half to even."""
    finite = _finite_values(fmt)
    midpoints = (finite[:-1] + finite[1:]) / 2
    codes = midpoints.to(FP8_FORMATS[fmt].torch_dtype).view(torch.uint8).long()
    below = torch.arange(len(midpoints))
    assert ((codes == below) | (codes == below + 1)).all()
    assert (codes % 2 == 0).all()


def test_every_code_decodes_like_torch(fmt, kernel, assert_same_bits):
    """All 256 bit patterns at unit scale, the inf and NaN ones included."""
    _, decode = kernel
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    decoded = decode(codes, torch.ones(256 // 16), dtype=torch.float32, group_size=16)
    assert_same_bits(decoded, codes.view(FP8_FORMATS[fmt].torch_dtype).float())


def test_all_zero_groups_decode_to_exact_zeros(codec, dtype, group_size):
    encode, decode = codec
    x = torch.zeros(3 * group_size, dtype=dtype)
    x[:group_size] = torch.randn(group_size)
    x[-1] = -0.0
    codes, scales = encode(x, group_size=group_size)
    assert (scales[1:] == 0).all() and (codes[group_size:] == 0).all()
    zeros = decode(codes, scales, dtype=dtype, group_size=group_size)[group_size:]
    assert (zeros == 0).all() and not zeros.signbit().any()


def test_non_finite_values_decode_as_they_were(codec, non_finite_input, group_size, assert_non_finite_kept):
    assert_non_finite_kept(codec, non_finite_input, group_size)


def test_non_finite_codes_in_a_flagged_group(fmt, codec, group_size):
    """e4m3fn has no inf: its 448 codes stand for +-inf and finite values saturate at
    416, onto which the scale maps their absmax. e5m2 keeps its own inf and 57344."""
    encode, _ = codec
    top = {"e4m3": 416.0, "e5m2": 57344.0}[fmt]
    x = torch.tensor([top, -top / 2, float("-inf"), float("inf"), float("nan"), 0.0, 1.0, 2.0] * 2)
    codes, scales = encode(x, group_size=group_size)
    assert scales.tolist() == [-1.0]
    codes = codes.view(-1, 8)[0].tolist()
    inf_code = {"e4m3": 0x7E, "e5m2": 0x7C}[fmt]
    assert codes[2:5] == [inf_code | 0x80, inf_code, 0x7F]
    expected = torch.tensor([top, -top / 2, 0.0, 1.0, 2.0]).to(FP8_FORMATS[fmt].torch_dtype)
    assert codes[:2] + codes[5:] == expected.view(torch.uint8).tolist()


def test_finite_values_beside_neg_inf_keep_their_precision(fmt, codec, sqnr_beside_neg_inf):
    # Measured (beside -inf / beside 0): e4m3 31.8 / 31.8, e5m2 25.8 / 25.8.
    beside_neg_inf, beside_zero = sqnr_beside_neg_inf(codec)
    assert beside_neg_inf >= beside_zero - 0.1


@pytest.mark.parametrize("beside", [0.0, float("-inf")], ids=["finite_group", "beside_neg_inf"])
def test_dtype_maximum_decodes_finite(fmt, codec, dtype, beside, group_size, round_trip):
    # FP8_MAX * (float32 max / FP8_MAX) could round above the maximum (NOTE [ Scale rule ]).
    finfo = torch.finfo(dtype)
    x = torch.tensor([finfo.max, -finfo.max, finfo.max / 3, beside] * (group_size // 4), dtype=dtype)
    _, decoded = round_trip(codec, x, group_size)
    finite = x.isfinite()
    # Within half an fp8 ulp: 2**-4 relative for e4m3, 2**-3 for e5m2.
    rtol = 2.0 ** -FP8_FORMATS[fmt].mantissa_bits / 2
    torch.testing.assert_close(decoded[finite].float(), x[finite].float(), rtol=rtol, atol=0)


@pytest.mark.parametrize("shape", [(3, 7, 5), (0, 5)])
def test_outputs_have_documented_dtypes_and_shapes(codec, shape):
    encode, decode = codec
    x = torch.randn(shape)
    codes, scales = encode(x, group_size=16)
    assert codes.dtype == torch.uint8 and codes.shape == (x.numel(),)
    assert scales.dtype == torch.float32 and scales.shape == (-(-x.numel() // 16),)
    decoded = decode(codes, scales, dtype=torch.bfloat16, group_size=16)
    assert decoded.dtype == torch.bfloat16 and decoded.shape == (x.numel(),)


@pytest.mark.parametrize("signal", SQNR_FLOORS_DB["e4m3"])
def test_roundtrip_sqnr_floor(fmt, signal, dtype, signals, sqnr):
    x = signals[signal].to(dtype)
    decoded = decode_fp8(*encode_fp8(x, fmt), fmt, dtype)
    assert sqnr(x, decoded) >= SQNR_FLOORS_DB[fmt][signal]


@pytest.mark.parametrize("encode", [encode_fp8, encode_fp8_ref], ids=["triton", "reference"])
@pytest.mark.parametrize("x, fmt, group_size, message", [
    (torch.ones(4), "e3m4", 16, "fmt must be one of \\['e4m3', 'e5m2', 'ue4m4', 'ue5m3'\\], got 'e3m4'"),
    (torch.arange(4), "e4m3", 16, "got torch.int64; integer and bool tensors are never quantized"),
    (torch.ones(4), "e5m2", 24, "power of two from 8 to 4096, got 24"),
], ids=["fmt", "int64", "group_size"])
def test_encode_rejects_bad_input(encode, x, fmt, group_size, message):
    with pytest.raises(ValueError, match=message):
        encode(x, fmt, group_size)


@pytest.mark.parametrize("decode", [decode_fp8, decode_fp8_ref], ids=["triton", "reference"])
@pytest.mark.parametrize("codes, scales, dtype, message", [
    (torch.zeros(20, dtype=torch.int8), torch.ones(2), torch.float32, "codes must be torch.uint8"),
    (torch.zeros(20, dtype=torch.uint8), torch.ones(1), torch.float32, "need 2 float32 scales, got 1"),
    (torch.zeros(20, dtype=torch.uint8), torch.ones(2), torch.float64, "decoded dtype must be one of"),
], ids=["codes_dtype", "scales_count", "out_dtype"])
def test_decode_rejects_bad_input(decode, codes, scales, dtype, message):
    with pytest.raises(ValueError, match=message):
        decode(codes, scales, "e4m3", dtype, 16)


@pytest.mark.cuda
def test_cuda_kernel_matches_reference_on_a_large_tensor(large_cuda_input, out_dtype, kernel, reference,
                                                         assert_matches_reference):
    assert_matches_reference(kernel, reference, large_cuda_input, 128, out_dtype)


@pytest.mark.cuda
def test_cuda_kernel_matches_reference_on_every_input_case(input_case, group_size, kernel, reference,
                                                            assert_matches_reference):
    # The interpreter's cases compiled for the GPU: signed zeros and groups with no
    # finite value (a scale of -0.0) are where CUDA and the interpreter once parted.
    assert_matches_reference(kernel, reference, input_case.cuda(), group_size)


# ----------------------------------------------------------------- unsigned grids (NOTE [ Unsigned grids ])


@pytest.fixture(params=sorted(UNSIGNED_FP8_FORMATS))
def ufmt(request):
    return request.param


@pytest.fixture
def unsigned_kernel(ufmt):
    return partial(encode_fp8, fmt=ufmt), partial(decode_fp8, fmt=ufmt)


@pytest.fixture
def unsigned_reference(ufmt):
    return partial(encode_fp8_ref, fmt=ufmt), partial(decode_fp8_ref, fmt=ufmt)


@pytest.fixture(params=["triton", "reference"])
def unsigned_codec(request, unsigned_kernel, unsigned_reference):
    return unsigned_kernel if request.param == "triton" else unsigned_reference


def _unsigned_values(codec, ufmt):
    """The values of all 256 codes at unit scale, as a decoder gives them."""
    _, decode = codec
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    return decode(codes, torch.ones(256 // 16), dtype=torch.float32, group_size=16)


@pytest.mark.parametrize("sign", ["abs", "as_is"], ids=["non_negative", "negatives_saturate"])
def test_unsigned_kernel_matches_reference(input_case, sign, group_size, unsigned_kernel, unsigned_reference,
                                           assert_matches_reference):
    x = input_case.abs() if sign == "abs" else input_case
    assert_matches_reference(unsigned_kernel, unsigned_reference, x, group_size)


def test_unsigned_kernel_matches_reference_at_dtype_extremes(extreme_input, group_size, unsigned_kernel,
                                                             unsigned_reference, assert_matches_reference):
    assert_matches_reference(unsigned_kernel, unsigned_reference, extreme_input.abs(), group_size)


def test_unsigned_decode_to_any_dtype_matches_reference(out_dtype, group_size, unsigned_kernel, unsigned_reference,
                                                        assert_matches_reference):
    torch.manual_seed(0)
    x = torch.randn(16, 64).abs() * 10 ** torch.empty(16, 1).uniform_(-12, 6)
    assert_matches_reference(unsigned_kernel, unsigned_reference, x, group_size, out_dtype)


@pytest.mark.cuda
def test_cuda_unsigned_kernel_matches_reference_on_every_input_case(input_case, group_size, unsigned_kernel,
                                                                     unsigned_reference, assert_matches_reference):
    assert_matches_reference(unsigned_kernel, unsigned_reference, input_case.cuda(), group_size)


def test_unsigned_codes_ascend_and_extend_the_signed_grid(ufmt, unsigned_codec):
    """All 256 codes are finite and ascend from 0 to the format's largest value; code
    2c is the value of the signed format's code c, for every finite c >= 0."""
    spec = UNSIGNED_FP8_FORMATS[ufmt]
    values = _unsigned_values(unsigned_codec, ufmt)
    assert values[0] == 0 and values[-1] == spec.max_value and (values[1:] > values[:-1]).all()
    signed = _finite_values({"ue4m4": "e4m3", "ue5m3": "e5m2"}[ufmt])
    assert torch.equal(values[::2][: len(signed)], signed)
    # Subnormals are evenly spaced up to the smallest normal, code 2**mantissa_bits.
    subnormal_step = 2.0 ** (spec.min_normal_exponent - spec.mantissa_bits)
    first_normal = 1 << spec.mantissa_bits
    assert torch.equal(values[: first_normal + 1], torch.arange(first_normal + 1) * subnormal_step)


def test_unsigned_encoding_rounds_to_nearest_even_code(ufmt, unsigned_codec, group_size):
    """At unit scale: every value encodes to its code, a midpoint to the even one of
    its two codes, the fp32 values either side of it to the nearer code; negative
    values saturate to 0 and values far below the smallest subnormal round to 0."""
    spec = UNSIGNED_FP8_FORMATS[ufmt]
    values = _unsigned_values(UNSIGNED_REFERENCE_DECODERS[ufmt], ufmt)
    midpoints = (values[:-1] + values[1:]) / 2
    below = torch.arange(255)
    cases = [
        (values, torch.arange(256)),
        (midpoints, below + below % 2),
        (midpoints.nextafter(torch.tensor(0.0)), below),
        (midpoints.nextafter(torch.tensor(1e9)), below + 1),
        (-values, torch.zeros(256, dtype=torch.long)),
        (torch.tensor([2.0 ** (spec.min_normal_exponent - spec.mantissa_bits - 2)]), torch.tensor([0])),
    ]
    encode, _ = unsigned_codec
    per_group = group_size - 1
    for x, expected in cases:
        padded = torch.nn.functional.pad(x, (0, -x.numel() % per_group)).view(-1, per_group)
        top = torch.full((padded.shape[0], 1), spec.max_value)  # makes each scale exactly 1
        codes, scales = encode(torch.cat([top, padded], dim=1), group_size=group_size)
        assert (scales == 1).all()
        codes = codes.view(-1, group_size)[:, 1:].reshape(-1)[: x.numel()]
        assert torch.equal(codes.long(), expected)


UNSIGNED_REFERENCE_DECODERS = {fmt: (None, partial(decode_fp8_ref, fmt=fmt)) for fmt in UNSIGNED_FP8_FORMATS}


def test_unsigned_flagged_group_stores_the_signed_codes(ufmt, unsigned_codec, group_size):
    signed_fmt = {"ue4m4": "e4m3", "ue5m3": "e5m2"}[ufmt]
    x = torch.tensor([1.0, 0.5, float("inf"), float("nan"), 0.0, 3.0, float("-inf"), 2.0] * 2)
    codes, scales = unsigned_codec[0](x, group_size=group_size)
    signed_codes, signed_scales = encode_fp8_ref(x, signed_fmt, group_size)
    assert torch.equal(scales, signed_scales) and scales.signbit().all()
    assert torch.equal(codes, signed_codes)
    decoded = unsigned_codec[1](codes, scales, dtype=torch.float32, group_size=group_size)
    assert torch.equal(decoded.isnan(), x.isnan()) and torch.equal(decoded.isinf(), x.isinf())


@pytest.mark.parametrize("beside", [0.0, float("inf")], ids=["finite_group", "beside_inf"])
def test_unsigned_dtype_maximum_decodes_finite(ufmt, unsigned_codec, dtype, beside, group_size, round_trip):
    finfo = torch.finfo(dtype)
    x = torch.tensor([finfo.max, finfo.max / 3, finfo.max / 7, beside] * (group_size // 4), dtype=dtype)
    _, decoded = round_trip(unsigned_codec, x, group_size)
    finite = x.isfinite()
    # Within half an ulp of the grid (of the signed grid in a flagged group).
    rtol = 2.0 ** -UNSIGNED_FP8_FORMATS[ufmt].signed.mantissa_bits / 2
    torch.testing.assert_close(decoded[finite].float(), x[finite].float(), rtol=rtol, atol=0)


# Post-ReLU Gaussian data, round-trip SQNR in dB (fp32 / bf16 / fp16), signed -> unsigned:
# e4m3 -> ue4m4 31.9 / 31.9 / 31.9 -> 38.3 / 38.2 / 38.3; e5m2 -> ue5m3 26.0 / 26.1 / 26.0
# -> 32.2 / 32.2 / 32.2.
UNSIGNED_SQNR_FLOORS_DB = {"ue4m4": 35.0, "ue5m3": 29.0}


def test_unsigned_grid_gains_six_db_on_non_negative_data(ufmt, dtype, signals, sqnr):
    x = signals["post_relu"].to(dtype)
    signed_fmt = {"ue4m4": "e4m3", "ue5m3": "e5m2"}[ufmt]
    signed = sqnr(x, decode_fp8(*encode_fp8(x, signed_fmt), signed_fmt, dtype))
    unsigned = sqnr(x, decode_fp8(*encode_fp8(x, ufmt), ufmt, dtype))
    assert unsigned >= UNSIGNED_SQNR_FLOORS_DB[ufmt] and unsigned >= signed + 5.0
