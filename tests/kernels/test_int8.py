"""int8 codec: the Triton kernels against their torch reference, bit for bit, and the
reference against the rules it defines (triton_kernels/int8.py, _scale.py, _rounding.py)."""
from functools import partial

import pytest
import torch

from actsave.triton_kernels.int8 import (
    decode_int8,
    decode_int8_ref,
    encode_int8,
    encode_int8_ref,
)

# numpy runs the interpreter's arithmetic and warns about arithmetic on inf and NaN
# (their codes' values times the scale, replaced after) and about casts that overflow
# to inf, all intended.
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter")

KERNEL = (encode_int8, decode_int8)
REFERENCE = (encode_int8_ref, decode_int8_ref)

# Round-trip SQNR floors in dB at the default group size (128), a few dB under what
# was measured on the `signals` fixture (fp32 / bf16 / fp16):
SQNR_FLOORS_DB = {
    "gaussian": 41.0,  # 43.6 / 43.4 / 43.6
    "post_relu": 42.0,  # 44.6 / 44.3 / 44.6
    "student_t3": 35.0,  # heavy tails: 37.3 / 37.2 / 37.3
    "outlier_channels": 30.0,  # 1 channel in 64 is 100x larger: 32.6 / 32.6 / 32.6
}


@pytest.fixture(params=["triton", "reference"])
def codec(request):
    return KERNEL if request.param == "triton" else REFERENCE


def test_kernel_matches_reference(input_case, group_size, assert_matches_reference):
    assert_matches_reference(KERNEL, REFERENCE, input_case, group_size)


def test_kernel_matches_reference_at_dtype_extremes(extreme_input, group_size, assert_matches_reference):
    assert_matches_reference(KERNEL, REFERENCE, extreme_input, group_size)


def test_kernel_matches_reference_at_default_group_size(dtype, assert_matches_reference):
    torch.manual_seed(0)
    x = torch.randn(5, 300)
    x[1, 7], x[3] = float("nan"), 0.0
    assert_matches_reference(KERNEL, REFERENCE, x.to(dtype), 128)


def test_decode_to_any_dtype_matches_reference(out_dtype, group_size, assert_matches_reference):
    """Magnitudes from 1e-12 to 1e6: fp16 outputs overflow to inf and go subnormal."""
    torch.manual_seed(0)
    x = torch.randn(16, 64) * 10 ** torch.empty(16, 1).uniform_(-12, 6)
    assert_matches_reference(KERNEL, REFERENCE, x, group_size, out_dtype)


def test_bfloat16_output_rounds_ties_to_even(group_size, assert_same_bits):
    """Scales whose low 16 bits are half a bf16 ulp, times power-of-two codes: every
    decoded value is an exact tie, which must go to the even neighbour."""
    torch.manual_seed(0)
    scale_bits = (torch.randint(0x3F00, 0x4100, (64,)) << 16) | 0x8000
    scales = scale_bits.to(torch.int32).view(torch.float32)
    codes = torch.tensor([1, -2, 4, -8], dtype=torch.int8).repeat(64 * group_size // 4)
    decoded = decode_int8(codes, scales, torch.bfloat16, group_size)
    assert_same_bits(decoded, decode_int8_ref(codes, scales, torch.bfloat16, group_size))
    assert (decoded.view(torch.int16) & 1 == 0).all()


@pytest.mark.parametrize("encode", [encode_int8, encode_int8_ref], ids=["triton", "reference"])
def test_codes_round_half_to_even(encode):
    # The absmax 127 makes the scale and the multiplier exactly 1: x is coded as itself, the .5s ties.
    x = torch.tensor([127, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 125.5,
                      126.5, -126.5, 0.49999997, 0.50000006, 126.49999, 3.0, -0.0, -127])
    expected = [127, 0, 2, 2, 0, -2, -2, 126, 126, -126, 0, 1, 126, 3, 0, -127]
    codes, scales = encode(x, 16)
    assert scales.tolist() == [1.0]
    assert codes.tolist() == expected


def test_all_zero_groups_decode_to_exact_zeros(codec, dtype, group_size):
    encode, decode = codec
    x = torch.zeros(3 * group_size, dtype=dtype)
    x[:group_size] = torch.randn(group_size)
    x[-1] = -0.0
    codes, scales = encode(x, group_size)
    assert (scales[1:] == 0).all() and (codes[group_size:] == 0).all()
    zeros = decode(codes, scales, dtype, group_size)[group_size:]
    assert (zeros == 0).all() and not zeros.signbit().any()


def test_non_finite_values_decode_as_they_were(codec, non_finite_input, group_size, assert_non_finite_kept):
    assert_non_finite_kept(codec, non_finite_input, group_size)


def test_a_non_finite_group_scales_its_finite_values_onto_126(codec, group_size):
    encode, _ = codec
    x = torch.tensor([126.0, -63.0, 0.5, 1.5, float("-inf"), float("inf"), float("nan"), -126.0] * 2)
    codes, scales = encode(x, group_size=group_size)
    assert scales.tolist() == [-1.0]
    assert codes.tolist() == [126, -63, 0, 2, -127, 127, -128, -126] * 2


def test_finite_values_beside_neg_inf_keep_their_precision(codec, sqnr_beside_neg_inf):
    # 126 steps instead of 127 cost 20*log10(127/126) = 0.07 dB (measured 43.7 / 43.8).
    beside_neg_inf, beside_zero = sqnr_beside_neg_inf(codec)
    assert beside_neg_inf >= beside_zero - 0.1


@pytest.mark.parametrize("beside", [0.0, float("-inf")], ids=["finite_group", "beside_neg_inf"])
def test_dtype_maximum_decodes_finite(codec, dtype, beside, group_size, round_trip):
    # 127 * (float32 max / 127) rounds above the maximum: the scale steps down an ulp.
    finfo = torch.finfo(dtype)
    x = torch.tensor([finfo.max, -finfo.max, finfo.max / 3, beside] * (group_size // 4), dtype=dtype)
    _, decoded = round_trip(codec, x, group_size)
    finite = x.isfinite()
    # Within half a step of the (126-step) grid of a group beside -inf.
    torch.testing.assert_close(decoded[finite].float(), x[finite].float(), rtol=0, atol=finfo.max / 252)


@pytest.mark.parametrize("shape", [(3, 7, 5), (0, 5)])
def test_outputs_have_documented_dtypes_and_shapes(codec, shape):
    encode, decode = codec
    x = torch.randn(shape)
    codes, scales = encode(x, 16)
    assert codes.dtype == torch.int8 and codes.shape == (x.numel(),)
    assert scales.dtype == torch.float32 and scales.shape == (-(-x.numel() // 16),)
    decoded = decode(codes, scales, torch.bfloat16, 16)
    assert decoded.dtype == torch.bfloat16 and decoded.shape == (x.numel(),)


@pytest.mark.parametrize("signal", SQNR_FLOORS_DB)
def test_roundtrip_sqnr_floor(signal, dtype, signals, sqnr):
    x = signals[signal].to(dtype)
    decoded = decode_int8(*encode_int8(x), dtype)
    assert sqnr(x, decoded) >= SQNR_FLOORS_DB[signal]


@pytest.mark.parametrize("encode", [encode_int8, encode_int8_ref], ids=["triton", "reference"])
@pytest.mark.parametrize("x, group_size, message", [
    (torch.arange(4), 16, "got torch.int64; integer and bool tensors are never quantized"),
    (torch.ones(4, dtype=torch.bool), 16, "got torch.bool"),
    (torch.ones(4), 48, "power of two from 8 to 4096, got 48"),
    (torch.ones(4), 4, "got 4"),
    (torch.ones(4), 8192, "got 8192"),
    (torch.ones(4), 16.0, "got 16.0"),
], ids=["int64", "bool", "not_power_of_two", "too_small", "too_large", "float"])
def test_encode_rejects_bad_input(encode, x, group_size, message):
    with pytest.raises(ValueError, match=message):
        encode(x, group_size)


@pytest.mark.parametrize("decode", [decode_int8, decode_int8_ref], ids=["triton", "reference"])
@pytest.mark.parametrize("codes, scales, dtype, message", [
    (torch.zeros(20, dtype=torch.uint8), torch.ones(2), torch.float32, "codes must be torch.int8"),
    (torch.zeros(20, dtype=torch.int8), torch.ones(3), torch.float32, "need 2 float32 scales, got 3"),
    (torch.zeros(20, dtype=torch.int8), torch.ones(2, dtype=torch.float16), torch.float32, "got 2 torch.float16"),
    (torch.zeros(20, dtype=torch.int8), torch.ones(2), torch.int32, "decoded dtype must be one of"),
], ids=["codes_dtype", "scales_count", "scales_dtype", "out_dtype"])
def test_decode_rejects_bad_input(decode, codes, scales, dtype, message):
    with pytest.raises(ValueError, match=message):
        decode(codes, scales, dtype, 16)


@pytest.mark.cuda
def test_cuda_kernel_matches_reference_on_a_large_tensor(large_cuda_input, out_dtype, assert_matches_reference):
    assert_matches_reference(KERNEL, REFERENCE, large_cuda_input, 128, out_dtype)


@pytest.mark.cuda
def test_cuda_kernel_matches_reference_on_every_input_case(input_case, group_size, assert_matches_reference):
    # The interpreter's cases compiled for the GPU: groups with no finite value (a
    # scale of -0.0) are where CUDA and the interpreter once parted.
    assert_matches_reference(KERNEL, REFERENCE, input_case.cuda(), group_size)


@pytest.mark.cuda
def test_cuda_groups_beyond_2_pow_31_elements_match_reference(assert_same_bits):
    """int64 offsets (group_tile is shared with fp8): compare the groups around and past
    element 2**31 with the reference run on them alone."""
    if torch.cuda.get_device_properties(0).total_memory < 24 * 2**30:
        pytest.skip("needs 24 GiB of GPU memory")
    torch.manual_seed(0)
    x = torch.randn(2**31 + 1000, dtype=torch.bfloat16, device="cuda")
    codes, scales = encode_int8(x)
    start = 2**31 - 2 * 128
    ref_codes, ref_scales = encode_int8_ref(x[start:].cpu())
    assert_same_bits(codes[start:].cpu(), ref_codes)
    assert_same_bits(scales[start // 128:].cpu(), ref_scales)
    decoded = decode_int8(codes, scales, torch.bfloat16)
    assert_same_bits(decoded[start:].cpu(), decode_int8_ref(ref_codes, ref_scales, torch.bfloat16))


# ----------------------------------------------------------------- unsigned grid (NOTE [ Unsigned grids ])

UNSIGNED_KERNEL = (partial(encode_int8, unsigned=True), partial(decode_int8, unsigned=True))
UNSIGNED_REFERENCE = (partial(encode_int8_ref, unsigned=True), partial(decode_int8_ref, unsigned=True))


@pytest.fixture(params=["triton", "reference"])
def unsigned_codec(request):
    return UNSIGNED_KERNEL if request.param == "triton" else UNSIGNED_REFERENCE


@pytest.mark.parametrize("sign", ["abs", "as_is"], ids=["non_negative", "negatives_saturate"])
def test_unsigned_kernel_matches_reference(input_case, sign, group_size, assert_matches_reference):
    x = input_case.abs() if sign == "abs" else input_case
    assert_matches_reference(UNSIGNED_KERNEL, UNSIGNED_REFERENCE, x, group_size)


def test_unsigned_kernel_matches_reference_at_dtype_extremes(extreme_input, group_size, assert_matches_reference):
    assert_matches_reference(UNSIGNED_KERNEL, UNSIGNED_REFERENCE, extreme_input.abs(), group_size)


def test_unsigned_decode_to_any_dtype_matches_reference(out_dtype, group_size, assert_matches_reference):
    torch.manual_seed(0)
    x = torch.randn(16, 64).abs() * 10 ** torch.empty(16, 1).uniform_(-12, 6)
    assert_matches_reference(UNSIGNED_KERNEL, UNSIGNED_REFERENCE, x, group_size, out_dtype)


@pytest.mark.cuda
def test_cuda_unsigned_kernel_matches_reference_on_every_input_case(input_case, group_size,
                                                                     assert_matches_reference):
    assert_matches_reference(UNSIGNED_KERNEL, UNSIGNED_REFERENCE, input_case.cuda(), group_size)


def test_unsigned_codes_round_half_to_even_and_saturate_negatives(unsigned_codec):
    # The absmax 255 makes the scale and the multiplier exactly 1: x is coded as itself, the .5s ties.
    x = torch.tensor([255, 0.5, 1.5, 2.5, 127.5, 128.5, 253.5, 254.5,
                      0.49999997, 0.50000006, 128.0, -3.0, -0.0, 254.49998, 3.0, -255])
    expected = [255, 0, 2, 2, 128, 128, 254, 254, 0, 1, 128, 0, 0, 254, 3, 0]
    codes, scales = unsigned_codec[0](x, 16)
    assert scales.tolist() == [1.0] and codes.dtype == torch.uint8
    assert codes.tolist() == expected


def test_unsigned_flagged_group_stores_the_signed_codes(unsigned_codec):
    """NOTE [ Non-finite groups ] is the signed codec's: int8 codes, stored as bytes."""
    x = torch.tensor([126.0, 63.0, float("inf"), float("-inf"), float("nan"), 0.0, 1.0, -2.0] * 2)
    codes, scales = unsigned_codec[0](x, 16)
    signed_codes, signed_scales = encode_int8_ref(x, 16)
    assert scales.tolist() == signed_scales.tolist() == [-1.0]
    assert torch.equal(codes, signed_codes.view(torch.uint8))
    decoded = unsigned_codec[1](codes, scales, torch.float32, 16)
    torch.testing.assert_close(decoded, x, equal_nan=True, rtol=0, atol=0)  # the scale is 1


@pytest.mark.parametrize("beside", [0.0, float("inf")], ids=["finite_group", "beside_inf"])
def test_unsigned_dtype_maximum_decodes_finite(unsigned_codec, dtype, beside, group_size, round_trip):
    finfo = torch.finfo(dtype)
    x = torch.tensor([finfo.max, finfo.max / 3, finfo.max / 7, beside] * (group_size // 4), dtype=dtype)
    _, decoded = round_trip(unsigned_codec, x, group_size)
    finite = x.isfinite()
    assert decoded[finite].isfinite().all()
    error = (decoded[finite].double() - x[finite].double()).abs()
    assert (error <= finfo.max / 255 * 0.51).all()  # half a step, and the dtype's rounding


def test_unsigned_grid_gains_six_db_on_non_negative_data(dtype, signals, sqnr):
    # Measured on post-ReLU Gaussian data (fp32 / bf16 / fp16): signed 44.6 / 44.3 / 44.5,
    # unsigned 50.7 / 50.1 / 50.6.
    x = signals["post_relu"].to(dtype)
    signed = sqnr(x, decode_int8(*encode_int8(x), dtype))
    unsigned = sqnr(x, decode_int8(*encode_int8(x, unsigned=True), dtype, unsigned=True))
    assert unsigned >= 47.0 and unsigned >= signed + 5.0
