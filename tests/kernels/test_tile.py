"""The tile a program owns (triton_kernels/_tile.py, NOTE [ Tile ]): a GPU launches in
programs of CUDA_TILE, the interpreter in programs of INTERPRETER_TILE, and the bits
must not depend on which."""
import pytest
import torch

from actsave.triton_kernels import FORMATS, SIGNED_FORMATS, _launch, _tile, kernel_table

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter")


def _coded(fmt, x, means):
    encode, decode = (kernel_table()[fmt, direction] for direction in ("encode", "decode"))
    codes, scales = encode.launcher(x, **encode.format_args, means=means)
    decoded = decode.launcher(codes, scales, **decode.format_args, dtype=x.dtype, means=means,
                              channel_size=x[0, 0].numel())
    return codes, scales.view(torch.int32), decoded.view(torch.int16)


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_gpus_tile_codes_the_bits_of_the_interpreters(fmt, monkeypatch):
    """Programs of either tile over almost 4 interpreter tiles of a conv activation (bf16,
    14x14 channels that groups straddle, a NaN and an inf): the same codes, scales and
    decoded values."""
    assert _tile.CUDA_TILE != _tile.INTERPRETER_TILE
    torch.manual_seed(0)
    x = torch.randn(5, 16, 14, 14) + 4 * torch.randn(1, 16, 1, 1)
    x[1, 2, 3, 4], x[3, 0, 0, 0] = float("nan"), float("inf")
    x = x.to(torch.bfloat16)
    signed = fmt in SIGNED_FORMATS
    x = x if signed else x.relu()
    means = x.float().mean(dim=(0, 2, 3)).nan_to_num(posinf=0.0) if signed else None
    interpreted = _coded(fmt, x, means)
    monkeypatch.setattr(_tile, "INTERPRETER_TILE", _tile.CUDA_TILE)
    for on_gpus_tile, on_interpreters in zip(_coded(fmt, x, means), interpreted):
        assert torch.equal(on_gpus_tile, on_interpreters)


def _launched(tile, fmt, x, group_size, channels):
    """Encode ``x`` in format ``fmt`` and decode it, in programs of ``tile``."""
    _tile.INTERPRETER_TILE = tile
    encode, decode = (kernel_table()[fmt, direction] for direction in ("encode", "decode"))
    codes, scales = encode.launcher(x, **encode.format_args, group_size=group_size, **channels)
    decode.launcher(codes, scales, **decode.format_args, dtype=x.dtype, group_size=group_size,
                    channel_size=x[0, 0].numel() if channels else 1, **channels)


def _sums(x):
    return x.sum((0, *range(2, x.dim())))


# Each case differs from another in one thing alone that a launch's arguments depend
# on: the format, the dtype, the element count, the channel count or size, the layout,
# means or sums or neither, the group size, the tile.
_X = torch.randn(2, 16, 4, 4)
_TILE = _tile.INTERPRETER_TILE
_LAUNCH_CASES = (
    (_TILE, "int8", _X, 128, {"sums": _sums(_X)}),
    (_TILE, "uint8", _X.relu(), 128, {}),
    (_TILE, "int8", _X, 128, {}),
    (_TILE, "int8", _X[:1], 128, {}),
    (_TILE, "int8", _X, 128, {"means": _X.mean((0, 2, 3))}),
    (_TILE, "int8", _X.view(4, 8, 4, 4), 128, {"means": _X.view(4, 8, 4, 4).mean((0, 2, 3))}),
    (_TILE, "int8", _X.view(1, 16, 8, 4), 128, {"sums": _sums(_X.view(1, 16, 8, 4))}),
    (_TILE, "int8", _X.view(512, 1), 128, {"means": _X.view(512, 1).mean(0)}),
    (_TILE, "int8", _X.view(512, 1), 128, {}),
    (_TILE, "int8", _X.bfloat16(), 128, {"sums": _sums(_X)}),
    (_TILE, "int8", _X.to(memory_format=torch.channels_last), 128, {"sums": _sums(_X)}),
    (_TILE, "int8", _X[:, :, :3], 128, {"sums": _sums(_X[:, :, :3])}),
    (_TILE, "int8", _X, 64, {"sums": _sums(_X)}),
    (_tile.CUDA_TILE, "int8", _X, 64, {"sums": _sums(_X)}),
    (_TILE, "fp8_e4m3", _X, 128, {"sums": _sums(_X)}),
    (_TILE, "fp8_ue4m4", _X.relu(), 128, {}),
    (_TILE, "fp8_e5m2", _X.half(), 128, {"sums": _sums(_X)}),
)


def test_a_launch_has_the_arguments_of_its_own_shape_dtype_layout_and_format(monkeypatch):
    """The launch arguments are cached by shape and format (_tile._launch_arguments): a
    run that mixes the cases launches each with the arguments a cold cache gives it,
    on contiguous tensors of its own dtypes."""
    launched = []
    def described(t):
        return (t.dtype, t.numel(), t.is_contiguous()) if isinstance(t, torch.Tensor) else t

    monkeypatch.setattr(_launch, "launch", lambda kernel, grid, *tensors, **arguments: launched.append(
        (_launch.kernel_name(kernel), grid, [described(t) for t in tensors],
         {name: described(value) for name, value in arguments.items()})))
    monkeypatch.setattr(_tile, "INTERPRETER_TILE", _TILE)

    def launches_of(case):
        launched.clear()
        _launched(*case)
        return list(launched)

    cold = []
    for case in _LAUNCH_CASES:
        _tile._launch_arguments.cache_clear()
        cold.append(launches_of(case))
    for _ in range(2):  # the second round from a warm cache only
        assert [launches_of(case) for case in _LAUNCH_CASES] == cold
    # What the arguments hold, where the cases differ.
    (_, _, encoded, encoding), (_, _, decoded, decoding) = cold[0]
    assert encoded == [(torch.float32, 512, True), (torch.int8, 512, True), (torch.float32, 4, True),
                       (torch.float32, 16, True)]
    assert (encoding["CODE_MAX"], encoding["mean_divisor"], encoding["channels"], encoding["channel_size"],
            encoding["RUN"], encoding["CENTERED"]) == (127, 32.0, 16, 16, 16, True)
    assert (decoding["RUN"], decoding["mean_divisor"]) == (4, 32.0)
    assert cold[1][0][3]["CODE_MAX"] == 255 and not cold[1][0][3]["CENTERED"]
    assert cold[3][0][3]["numel"] == 256 and cold[4][0][3]["mean_divisor"] == 1.0
    assert (cold[5][0][3]["channels"], cold[6][0][3]["channel_size"], cold[7][0][3]["CENTERED"]) == (8, 32, True)
    assert cold[9][1][3]["RUN"] == 8 and cold[12][0][1] == (1,) and cold[12][0][3]["GROUP_SIZE"] == 64
    assert cold[13][0][3]["num_warps"] == _tile.CUDA_TILE.warps != _TILE.warps
