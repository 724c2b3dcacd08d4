"""The one launch helper (triton_kernels/_launch.py): a kernel that fails to compile
names itself and the fallback; every launch can be counted by wrapping it."""
import pytest
import torch

from actsave.triton_kernels import _launch, decisions, int8
from actsave.triton_kernels.decisions import relu_signs
from actsave import KernelLaunchError


class CompileFailure(Exception):
    """What Triton raises when ptxas or an MLIR pass fails (its error types vary across
    versions; the helper wraps any)."""


class FailingToCompile:
    """Stands for ``kernel`` on a GPU where its compilation fails (as ptxas would)."""

    def __init__(self, kernel):
        self.fn = kernel.fn

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            raise CompileFailure("ptxas fatal: unsupported architecture")
        return run


def _stand_in_kernel():
    """A stand-in for a @triton.jit function: it has the name the error gives."""


_stand_in_kernel.fn = _stand_in_kernel


def test_the_helper_names_a_kernel_that_fails_to_compile_and_the_fallback():
    with pytest.raises(KernelLaunchError, match=r"_stand_in_kernel failed to compile or launch on cpu: CompileFailure: "
                                                r"ptxas fatal.*actsave.set_backend\('torch'\)"):
        _launch.launch(FailingToCompile(_stand_in_kernel), (1,), torch.zeros(4), 4)


def test_a_launcher_whose_kernel_fails_to_compile_names_it(monkeypatch):
    monkeypatch.setattr(relu_signs, "_pack_relu_signs_kernel", FailingToCompile(relu_signs._pack_relu_signs_kernel))
    with pytest.raises(KernelLaunchError, match=r"_pack_relu_signs_kernel failed to compile or launch on cpu: "
                                                r"CompileFailure: .*actsave.set_backend\('torch'\)") as raised:
        decisions.pack_relu_signs(torch.ones(16))
    assert raised.value.kernel == "_pack_relu_signs_kernel" and isinstance(raised.value.__cause__, CompileFailure)


def test_every_launch_goes_through_the_helper(monkeypatch):
    # The counting hook the benchmarks use: wrap _launch.launch, looked up at each call.
    launched = []
    real = _launch.launch
    monkeypatch.setattr(_launch, "launch", lambda kernel, *a, **k: launched.append(_launch.kernel_name(kernel))
                        or real(kernel, *a, **k))
    y = torch.relu(torch.randn(4, 40))
    bits = decisions.pack_relu_signs(y)
    decisions.restore_relu_signs_(y, bits)
    x = torch.randn(2, 3, 8, 8)
    pooled, indices = torch.nn.functional.max_pool2d(x, 3, 2, 1, return_indices=True)
    geometry = ((3, 3), (2, 2), (1, 1), (1, 1))
    packed = decisions.encode_max_pool(indices, (8, 8), *geometry)
    decisions.decode_max_pool_(indices, packed, (8, 8), *geometry)
    decisions.gather_max_pool_(pooled, x, indices, 2)
    codes, scales = int8.encode_int8(x)
    int8.decode_int8(codes, scales, dtype=torch.float32)
    assert launched == ["_pack_relu_signs_kernel", "_restore_relu_signs_kernel", "_encode_max_pool_kernel",
                        "_decode_max_pool_kernel", "_gather_max_pool_kernel", "_encode_int8_kernel",
                        "_decode_int8_kernel"]


def test_a_codec_whose_kernel_fails_to_compile_names_it(monkeypatch):
    monkeypatch.setattr(int8, "_encode_int8_kernel", FailingToCompile(int8._encode_int8_kernel))
    with pytest.raises(KernelLaunchError, match=r"_encode_int8_kernel failed to compile or launch on cpu: "
                                                r"CompileFailure: .*actsave.set_backend\('torch'\)"):
        int8.encode_int8(torch.randn(256))
