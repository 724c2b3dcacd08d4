"""Channel centering (actsave/codecs/centering.py, NOTE [ Channel centering ]): which
tensors a lossy codec stores minus their channel means, what that buys, and that
non-finite and extreme values come back as the codecs promise."""
import pytest
import torch

from actsave import set_backend
from actsave.triton_kernels import _launch
from actsave.codecs import GROUP_SIZE, LOSSY_CODECS, Packed, get_codec, sqnr_db
from actsave.codecs.centering import channel_sums
from actsave.triton_kernels import MAX_MEAN as MAX_OFFSET
from actsave.planning.live_bytes import LiveBytes
from support import OpCounter


def offset_channels(*shape, seed=0):
    """Conv-like activations whose channel means are four times their spread."""
    generator = torch.Generator().manual_seed(seed)
    means = 4 * torch.randn(shape[1], generator=generator).view(1, -1, *[1] * (len(shape) - 2))
    return torch.randn(*shape, generator=generator) + means


def kept_means(packed: Packed) -> torch.Tensor:
    """The channel means a packed value was stored minus: its kept sums, each over its
    channel's element count, as the kernels work them out (NOTE [ Channel means ])."""
    count = torch.Size(packed.shape).numel() // packed.offsets.numel()
    return packed.offsets / torch.tensor(float(count))


def spread_sqnr_db(x, y) -> float:
    """SQNR against each channel's spread: what a BatchNorm after it sees."""
    centered = x - x.mean(dim=[0, *range(2, x.dim())], keepdim=True)
    return sqnr_db(centered, centered + (y - x))


@pytest.mark.parametrize("codec", LOSSY_CODECS)
@pytest.mark.parametrize("shape", [(4, 8, 16, 16), (2, 4, 4, 8, 8)])
def test_conv_activations_are_stored_minus_their_channel_means(codec, shape):
    x = offset_channels(*shape)
    packed = get_codec(codec).encode(x)
    dims = [0, *range(2, x.dim())]
    # Kept as the channels' sums; the means they give are torch.mean's, bit for bit.
    assert torch.equal(packed.offsets, x.sum(dim=dims)) and torch.equal(kept_means(packed), x.mean(dim=dims))
    # The same codes without the offsets are what the codec stores of the centered tensor.
    plain = get_codec(codec).encode((x - x.mean(dim=dims).view(1, -1, *[1] * (x.dim() - 2))).reshape(-1))
    assert torch.equal(packed.data, plain.data) and torch.equal(packed.scales, plain.scales)


@pytest.mark.parametrize("codec", LOSSY_CODECS)
def test_a_centered_encode_runs_one_sum_and_its_outputs_on_the_host(codec, monkeypatch):
    # What the host does before a kernel's launch (stubbed here): the channels' sums, one
    # operator (a mean is two on a CPU: the sum and a division, which the kernels do:
    # NOTE [ Channel means ]), and the codes and scales allocated; no view of the input.
    monkeypatch.setattr(_launch, "launch", lambda *args, **kwargs: None)
    x = offset_channels(2, 4, 8, 8)
    with set_backend("triton"):
        get_codec(codec).encode(x)  # the first call imports the kernels, which run operators
        with OpCounter() as ops:
            get_codec(codec).encode(x)
    assert ops.counts == {"aten.sum.dim_IntList": 1, "aten.empty.memory_format": 2}


def encode_rise(codec, x) -> int:
    """How far the live bytes rise while ``x`` is encoded (codes and scales included)."""
    tracker = LiveBytes("cpu", known=[x])
    with tracker, tracker.span() as rise:
        get_codec(codec).encode(x)
    return rise[0]


def decode_rise(codec, x) -> int:
    """How far the live bytes rise while ``x``'s encoding is decoded (output included)."""
    packed = get_codec(codec).encode(x)
    tracker = LiveBytes("cpu", known=[x, *packed.tensors().values()])
    with tracker, tracker.span() as rise:
        get_codec(codec).decode(packed)
    return rise[0]


@pytest.mark.parametrize("implementation", ["torch", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("codec", LOSSY_CODECS)
def test_centering_makes_no_copy_of_the_tensor(codec, dtype, implementation):
    # The kernels subtract the means as they load and add them as they store (NOTE
    # [channel means]); a centered copy made first rose the encode's peak by the
    # tensor's size (131 KB here), and a view of the reference's output that outlived
    # its replacement the decode's by as much.
    x = offset_channels(8, 16, 16, 16).to(dtype)
    flat = x.reshape(-1)  # 1-D: not centered
    with set_backend(implementation):
        assert encode_rise(codec, x) <= encode_rise(codec, flat) + 4 * 16
        assert decode_rise(codec, x) <= decode_rise(codec, flat)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("codec, gain_db", [("int8", 5.0), ("fp8_e4m3", 10.0), ("fp8_e5m2", 10.0)])
def test_centering_buys_resolution_where_channel_means_dominate(codec, gain_db, dtype):
    # Channel means about 4x the spread. Measured against the spread, centered / as is,
    # float32: int8 43.8 / 37.4 dB (its step follows the group's largest magnitude),
    # e4m3 31.8 / 19.8, e5m2 25.8 / 13.8 (their error follows each value's magnitude);
    # within 0.1 dB in float16, and in bfloat16 but int8's 44.3 / 36.0.
    x = offset_channels(8, 16, 16, 16).to(dtype)
    centered = get_codec(codec).decode(get_codec(codec).encode(x))
    as_is = get_codec(codec).decode(get_codec(codec).encode(x.reshape(-1))).view(x.shape)  # 1-D: not centered
    assert centered.dtype == dtype
    x, centered, as_is = x.float(), centered.float(), as_is.float()
    assert spread_sqnr_db(x, centered) >= spread_sqnr_db(x, as_is) + gain_db


@pytest.mark.parametrize("make", [
    lambda: torch.randn(8, 16),                                      # a Linear's activation
    lambda: torch.randn(2, 8, 16),                                   # (batch, tokens, features): no channel dim 1
    lambda: torch.empty(0, 4, 8, 8),
], ids=["2d", "3d", "empty"])
def test_other_tensors_are_stored_as_they_are(make):
    assert get_codec("int8").encode(make()).offsets is None


def test_non_negative_tensors_go_on_the_unsigned_grid_uncentered():
    x = offset_channels(2, 4, 8, 8).abs()
    packed = get_codec("fp8_e4m3").encode(x, non_negative=True)
    assert packed.offsets is None and packed.unsigned


@pytest.mark.parametrize("codec", LOSSY_CODECS)
def test_float64_is_centered_through_float32(codec):
    x = offset_channels(2, 4, 8, 8).double()
    packed = get_codec(codec).encode(x)
    y = get_codec(codec).decode(packed)
    assert packed.offsets.dtype == torch.float32 and y.dtype == torch.float64
    assert spread_sqnr_db(x, y) >= {"int8": 38.0, "fp8_e4m3": 28.0, "fp8_e5m2": 22.0}[codec]


def test_bytes_count_one_float32_offset_per_channel():
    x = offset_channels(2, 8, 8, 8)
    packed = get_codec("int8").encode(x)
    groups = -(-x.numel() // GROUP_SIZE)
    assert packed.nbytes == x.numel() + 4 * groups + 4 * 8


@pytest.mark.parametrize("codec", LOSSY_CODECS)
def test_inf_and_nan_come_back_and_spoil_only_their_channel_mean(codec):
    x = offset_channels(2, 4, 8, 8)
    x[0, 1, 0, 0], x[1, 2, 3, 3], x[1, 2, 3, 4] = float("inf"), float("nan"), -float("inf")
    packed = get_codec(codec).encode(x)
    # Their means are kept as the reduction gives them, not finite; the kernels take
    # them as 0 (NOTE [ Channel means ]).
    assert not packed.offsets[[1, 2]].isfinite().any() and (packed.offsets[[0, 3]] != 0).all()
    y = get_codec(codec).decode(packed)
    assert y[0, 1, 0, 0] == float("inf") and y[1, 2, 3, 3].isnan() and y[1, 2, 3, 4] == -float("inf")
    finite = torch.isfinite(x)
    assert torch.isfinite(y[finite]).all()


@pytest.mark.parametrize("codec", LOSSY_CODECS)
def test_finite_float16_values_stay_finite_at_the_edge_of_their_range(codec):
    # The mean carries some decoded values past the largest finite one: decoding
    # saturates there (NOTE [ Channel means ]).
    largest = torch.finfo(torch.float16).max
    x = torch.full((2, 2, 4, 4), largest, dtype=torch.float16)
    x[:, 1], x[0, 0, 0, :2] = -largest, largest / 3
    packed = get_codec(codec).encode(x)
    assert (kept_means(packed).abs() > largest / 2).all()
    assert torch.isfinite(get_codec(codec).decode(packed)).all()


@pytest.mark.parametrize("codec", LOSSY_CODECS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_finite_values_stay_finite_at_the_edge_of_float32s_range(codec, dtype):
    largest = torch.finfo(dtype).max
    x = torch.full((2, 3, 4, 4), MAX_OFFSET, dtype=dtype)
    x[:, 0] = largest  # its mean is beyond MAX_OFFSET: not centered
    x[0, 1], x[1, 1] = largest, -largest  # both ends of the range in one channel
    packed = get_codec(codec).encode(x)
    # Kept as the reduction gives it (inf here); the kernels take it as 0 (NOTE [ Channel means ]).
    means = kept_means(packed)
    assert not means[0].abs() <= MAX_OFFSET and means[2] == MAX_OFFSET
    assert torch.isfinite(get_codec(codec).decode(packed)).all()


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_no_allowed_mean_takes_a_finite_value_past_float32(sign):
    # The guard's arithmetic (NOTE [ Channel centering ]): |x| at the largest float32 and
    # a mean of MAX_OFFSET either way, subtracted (encode) and added back (decode).
    largest = torch.finfo(torch.float32).max
    x = torch.tensor([largest, -largest]).view(1, 1, 2, 1)
    offsets = torch.tensor([sign * MAX_OFFSET])
    assert torch.isfinite(x - offsets.view(1, -1, 1, 1)).all()
    assert torch.isfinite(x + offsets.view(1, -1, 1, 1)).all()


def test_channel_sums_read_nothing_back_on_meta_tensors():
    offsets = channel_sums(torch.empty(2, 5, 4, 4, device="meta"))
    assert offsets.shape == (5,) and offsets.device.type == "meta"


def test_a_packed_value_taken_apart_and_assembled_is_the_same():
    packed = get_codec("int8").encode(offset_channels(2, 4, 8, 8))
    again = Packed.assemble(packed.tensors(), packed.metadata())
    assert set(packed.tensors()) == {"data", "scales", "offsets"}
    assert all(again.tensors()[name] is t for name, t in packed.tensors().items())
    assert again.metadata() == packed.metadata()
