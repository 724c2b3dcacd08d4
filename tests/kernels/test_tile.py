"""The tile a program owns (triton_kernels/_tile.py, NOTE [ Tile ]): a GPU launches in
programs of CUDA_TILE, the interpreter in programs of INTERPRETER_TILE, and the bits
must not depend on which."""
import pytest
import torch

from actsave.triton_kernels import FORMATS, SIGNED_FORMATS, _tile, kernel_table

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
