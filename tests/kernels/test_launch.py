"""The one launch helper (triton_kernels/_launch.py): a kernel that fails to compile
names itself and the fallback."""
import pytest
import torch

from actsave.triton_kernels import _launch
from actsave.triton_kernels._launch import KernelLaunchError


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
