"""What every unsigned grid (NOTE [ Unsigned grids ]: uint8, fp8 ue4m4, ue5m3) shares,
for the Triton kernel and its torch reference alike, read from the kernel table."""
from functools import partial

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx
from actsave.triton_kernels import UNSIGNED_VARIANT, kernel_table, general_path


@pytest.fixture(params=[(fmt, impl) for fmt in UNSIGNED_VARIANT.values() for impl in ("triton", "reference")],
                ids=lambda p: "-".join(p))
def unsigned_codec(request):
    """(encode, decode) of one unsigned format, as the kernel or as its reference."""
    fmt, impl = request.param
    pair = [kernel_table()[fmt, direction] for direction in ("encode", "decode")]
    return tuple(partial(k.launcher if impl == "triton" else k.reference, **k.format_args) for k in pair)


def test_unsigned_non_finite_values_decode_as_they_were(unsigned_codec, non_finite_input, group_size,
                                                        assert_non_finite_kept):
    assert_non_finite_kept(unsigned_codec, non_finite_input.abs(), group_size)


def test_unsigned_all_zero_groups_decode_to_exact_zeros(unsigned_codec, dtype, group_size):
    encode, decode = unsigned_codec
    x = torch.zeros(3 * group_size, dtype=dtype)
    x[:group_size] = torch.rand(group_size)
    x[-1] = -0.0
    codes, scales = encode(x, group_size=group_size)
    assert (scales[1:] == 0).all() and (codes[group_size:] == 0).all()
    zeros = decode(codes, scales, dtype=dtype, group_size=group_size)[group_size:]
    assert (zeros == 0).all() and not zeros.signbit().any()


def _references_and_their_eager_bits(fmt):
    """``fmt``'s torch encode and decode (group size 64), an input of groups from 1e-30
    to 1e3 with an all-zero group, and its eager codes and scales."""
    encode, decode = (partial(kernel_table()[fmt, direction].reference, **kernel_table()[fmt, direction].format_args,
                              group_size=64) for direction in ("encode", "decode"))
    torch.manual_seed(0)
    x = torch.rand(4 * 64) * torch.logspace(-30, 3, 4).repeat_interleave(64)
    x[:64] = 0.0  # an all-zero group
    return encode, decode, x, *encode(x)


def _assert_traced_gives_eager_bits(traced_encode, traced_decode, decode, x, codes, scales):
    traced_codes, traced_scales = traced_encode(x)
    assert torch.equal(traced_codes, codes) and torch.equal(traced_scales, scales)
    assert torch.equal(traced_decode(codes, scales), decode(codes, scales, dtype=torch.float32))


@pytest.mark.parametrize("fmt", list(UNSIGNED_VARIANT.values()))
def test_an_unsigned_reference_traced_whole_gives_the_eager_bits(fmt):
    # Traced into a compiled graph (actsave's graph hooks), no branch may read a value:
    # the references take their general path there (_scale.any_flagged_ref), which
    # must give finite groups the bits of the eager path; fullgraph=True fails on a read.
    encode, decode, x, codes, scales = _references_and_their_eager_bits(fmt)
    traced_encode = torch.compile(encode, backend="aot_eager", fullgraph=True)
    traced_decode = torch.compile(lambda c, s: decode(c, s, dtype=torch.float32), backend="aot_eager",
                                  fullgraph=True)
    torch._dynamo.reset()
    _assert_traced_gives_eager_bits(traced_encode, traced_decode, decode, x, codes, scales)


@pytest.mark.parametrize("fmt", ["int8", *UNSIGNED_VARIANT.values()])
def test_references_on_the_general_path_read_no_value_and_give_the_eager_bits(fmt):
    # actsave's graph hooks run the references under general_path(): torch 2.11 does
    # not say it compiles where AOTAutograd traces them, and a value read there broke
    # the graph. make_fx traces as AOTAutograd does: a read fails it.
    encode, decode, x, codes, scales = _references_and_their_eager_bits(fmt)
    with general_path():
        traced_encode = make_fx(encode, tracing_mode="fake")(x)
        traced_decode = make_fx(lambda c, s: decode(c, s, dtype=torch.float32), tracing_mode="fake")(codes, scales)
    _assert_traced_gives_eager_bits(traced_encode, traced_decode, decode, x, codes, scales)


@pytest.mark.parametrize("fmt", ["int8", *UNSIGNED_VARIANT.values()])
def test_references_read_no_value_while_a_cuda_graph_is_captured(fmt, monkeypatch):
    # A value read back during a capture is a sync the capture refuses: the references
    # take their general path then too (on_general_path). make_fx fails on a read.
    encode, decode, x, codes, scales = _references_and_their_eager_bits(fmt)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    traced_encode = make_fx(encode, tracing_mode="fake")(x)
    traced_decode = make_fx(lambda c, s: decode(c, s, dtype=torch.float32), tracing_mode="fake")(codes, scales)
    monkeypatch.undo()
    _assert_traced_gives_eager_bits(traced_encode, traced_decode, decode, x, codes, scales)
