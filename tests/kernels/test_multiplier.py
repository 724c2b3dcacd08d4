"""NOTE [ Scale rule ] (triton_kernels/_scale.py): encoding multiplies each value by its
group's multiplier, code_max / absmax, taken once per group (after a scaling by 2**64
where absmax < 2**-64). For every format of the kernel table, the Triton kernel and its
reference alike."""
from functools import partial

import pytest
import torch

from actsave.triton_kernels import FORMATS, UNSIGNED_VARIANT, kernel_table

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter")


def _pair(fmt, impl):
    kernels = [kernel_table()[fmt, direction] for direction in ("encode", "decode")]
    return tuple(partial(k.launcher if impl == "triton" else k.reference, **k.format_args) for k in kernels)


def _code_max(fmt):
    constexprs = kernel_table()[fmt, "encode"].constexprs
    return constexprs["CODE_MAX"] if "CODE_MAX" in constexprs else constexprs["FP8_MAX"]


def _groups_across_the_exponent_range(fmt, group_size, dtype):
    """A tile of groups (4096 values) per binade: magnitudes in [2**e, 2**(e + 1)), e
    from the dtype's smallest subnormal to its largest binade, so that the tiles fall
    on both sides of 2**-64 (the pre-scale) and of 2**127 (NOTE [ Plain tiles ]); signs
    random, none for the unsigned grids."""
    finfo = torch.finfo(dtype)
    smallest, largest = int(torch.tensor(finfo.smallest_normal * finfo.eps).log2()), int(torch.tensor(finfo.max).log2())
    binades = sorted({smallest, smallest + 5, -127, -100, -66, -65, -64, -63, -20, 0, 20, 100, 126, 127, largest}
                     & set(range(smallest, largest + 1)))
    generator = torch.Generator().manual_seed(0)
    magnitudes = torch.rand(len(binades), 4096, generator=generator).add_(1) * torch.tensor(binades).exp2()[:, None]
    signs = torch.randint(0, 2, magnitudes.shape, generator=generator) * 2 - 1
    x = magnitudes if fmt in UNSIGNED_VARIANT.values() else magnitudes * signs
    return x.clamp(-finfo.max, finfo.max).to(dtype).view(-1, group_size)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("impl", ["triton", "reference"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_each_groups_largest_value_codes_to_the_top_and_none_passes_it(fmt, impl, dtype, group_size):
    """|x * multiplier| <= code_max * (1 + 2**-23) rounds to code_max at most, and the
    group's largest value rounds to it."""
    x = _groups_across_the_exponent_range(fmt, group_size, dtype)
    encode, decode = _pair(fmt, impl)
    codes, scales = encode(x, group_size=group_size)
    values = decode(codes, torch.ones_like(scales), dtype=torch.float32, group_size=group_size).view(x.shape)
    top = x.float().abs().argmax(dim=1, keepdim=True)
    nonzero = x.float().abs().amax(dim=1) > 0
    assert (values.gather(1, top).abs()[nonzero] == _code_max(fmt)).all()
    assert (values.abs() <= _code_max(fmt)).all()


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_kernel_matches_reference_across_the_exponent_range(fmt, dtype, group_size, assert_matches_reference):
    x = _groups_across_the_exponent_range(fmt, group_size, dtype)
    assert_matches_reference(_pair(fmt, "triton"), _pair(fmt, "reference"), x, group_size)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_a_nan_decodes_to_the_same_bits_from_the_kernel_and_its_reference(fmt, dtype):
    # NOTE [ Non-finite groups ]: the NaN code decodes to the dtype's quiet NaN in both (a
    # CPU cast of fp32's NaN to bfloat16 gives 0xFFFF, which the reference must not use).
    x = torch.tensor([1.0, float("nan"), 2.0, 0.5] * 32, dtype=dtype)
    bits = {2: torch.int16, 4: torch.int32}[x.element_size()]
    decoded = {}
    for impl in ("triton", "reference"):
        encode, decode = _pair(fmt, impl)
        codes, scales = encode(x, group_size=128)
        decoded[impl] = decode(codes, scales, dtype=dtype, group_size=128).view(bits)
    assert torch.equal(decoded["triton"], decoded["reference"])
