"""An unsigned encoder that also stores the tensor's ReLU decisions from the same read
(triton_kernels/_tile.py, NOTE [ Signs from the encoder's read ]): its codes and scales
are the plain encoder's, its bits pack_relu_signs', bit for bit, kernel and reference."""
import pytest
import torch

from actsave.triton_kernels import UNSIGNED_VARIANT, _launch, _tile, kernel_table
from actsave.triton_kernels.decisions import pack_relu_signs_ref

UNSIGNED_FORMATS = list(UNSIGNED_VARIANT.values())


def _encoders(fmt):
    kernel = kernel_table()[fmt, "encode"]
    return [lambda x, impl=impl, **kw: impl(x, **kernel.format_args, **kw) for impl in (kernel.launcher,
                                                                                       kernel.reference)]


@pytest.mark.parametrize("fmt", UNSIGNED_FORMATS)
def test_codes_scales_and_bits_are_the_separate_calls_bits(fmt, input_case, group_size, assert_same_bits):
    # Every input case, negatives, zeros of both signs, inf and NaN included: NaN passes
    # (threshold_backward's test), -0.0 blocks, and a padded byte's spare bits are 0.
    expected_codes, expected_scales = _encoders(fmt)[1](input_case, group_size=group_size)
    expected_bits = pack_relu_signs_ref(input_case)
    for encode in _encoders(fmt):
        codes, scales, bits = encode(input_case, group_size=group_size, signs=True)
        assert_same_bits(codes, expected_codes)
        assert_same_bits(scales, expected_scales)
        assert_same_bits(bits, expected_bits)


@pytest.mark.parametrize("fmt", UNSIGNED_FORMATS)
@pytest.mark.parametrize("group_size", [8, 128])
def test_either_tile_and_group_size_gives_the_bits(fmt, group_size, monkeypatch):
    # Runs of 8 elements (groups of 8: one byte of decisions a run) and of 16 (two), in
    # programs of either tile (NOTE [ Tile ]), over a ReLU output of several programs.
    torch.manual_seed(0)
    x = torch.randn(3, 16, 9, 11).relu_().to(torch.bfloat16)
    expected = pack_relu_signs_ref(x)
    launcher = _encoders(fmt)[0]
    for tile in (_tile.INTERPRETER_TILE, _tile.CUDA_TILE):
        monkeypatch.setattr(_tile, "INTERPRETER_TILE", tile)
        assert torch.equal(launcher(x, group_size=group_size, signs=True)[2], expected)


@pytest.mark.parametrize("fmt", UNSIGNED_FORMATS)
def test_one_launch_encodes_and_packs(fmt, monkeypatch):
    launches = []
    original = _launch.launch
    monkeypatch.setattr(_launch, "launch", lambda kernel, *a, **kw: (launches.append(kernel), original(kernel, *a,
                                                                                                        **kw)))
    _encoders(fmt)[0](torch.rand(1000), signs=True)
    assert len(launches) == 1


@pytest.mark.parametrize("fmt", UNSIGNED_FORMATS)
def test_on_meta_tensors_the_outputs_are_allocated_and_nothing_launched(fmt, monkeypatch):
    monkeypatch.setattr(_launch, "launch", lambda *a, **kw: pytest.fail("a launch on meta tensors"))
    codes, scales, bits = _encoders(fmt)[0](torch.empty(1001, device="meta"), group_size=128, signs=True)
    assert (codes.numel(), scales.numel(), bits.numel(), bits.dtype) == (1001, 8, 126, torch.uint8)


@pytest.mark.parametrize("encode", [pytest.param(lambda: kernel_table()["int8", "encode"], id="signed int8"),
                                    pytest.param(lambda: kernel_table()["fp8_e4m3", "encode"], id="signed fp8")])
@pytest.mark.parametrize("impl", ["launcher", "reference"])
def test_a_signed_grid_refuses_signs(encode, impl):
    kernel = encode()
    with pytest.raises(ValueError, match="unsigned grid"):
        getattr(kernel, impl)(torch.rand(64), **kernel.format_args, signs=True)


@pytest.mark.parametrize("impl", ["launcher", "reference"])
def test_channel_means_refuse_signs(impl):
    kernel = kernel_table()["uint8", "encode"]
    with pytest.raises(ValueError, match="no channel means"):
        getattr(kernel, impl)(torch.rand(2, 4, 4, 4), **kernel.format_args, sums=torch.ones(4), signs=True)


@pytest.mark.parametrize("fmt", UNSIGNED_FORMATS)
def test_a_tensor_whose_memory_holds_its_negation_is_encoded_as_its_values(fmt):
    # torch._neg_view: the kernels read memory, so the launcher reads the values first.
    torch.manual_seed(0)
    x = torch._neg_view(-torch.randn(3, 50).relu())
    launcher, reference = _encoders(fmt)
    for got, expected in zip(launcher(x, signs=True), reference(x.resolve_neg(), signs=True)):
        assert torch.equal(got, expected)


@pytest.mark.cuda
@pytest.mark.parametrize("fmt", UNSIGNED_FORMATS)
def test_cuda_codes_scales_and_bits_are_the_references(fmt, input_case, group_size, assert_same_bits):
    # Compiled for the GPU, the decisions come from a float compare (x <= 0) where the
    # ReLU kernels read bits: NaN and -0.0 among the input cases.
    launcher, reference = _encoders(fmt)
    for got, expected in zip(launcher(input_case.cuda(), group_size=group_size, signs=True),
                             reference(input_case, group_size=group_size, signs=True)):
        assert_same_bits(got.cpu(), expected)
