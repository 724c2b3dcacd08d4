"""Every Triton launch of this package goes through :func:`launch`, one choke point.

- A kernel that fails to compile (or to launch) on the user's GPU raises
  :class:`KernelLaunchError`, which names the kernel and the way around it: the torch
  references of the kernel table give the same bits without Triton
  (``actsave.set_backend("torch")``). The original error is its ``__cause__``.
  Compilation happens inside the first launch of each specialization, so the launch
  is where it fails; every exception of the launch is wrapped (a Triton compile error,
  ptxas, an MLIR pass or the driver alike), chosen by where it happened, not by its text.
- Counting launches: :func:`launch` is looked up on this module at each call (callers
  write ``_launch.launch(...)``), so wrapping ``actsave.triton_kernels._launch.launch``
  (e.g. with ``unittest.mock.patch.object`` or pytest's ``monkeypatch.setattr``) sees
  every kernel launch of the callers that use it, one call per launch. Launchers call
  it only for a real launch: never for meta tensors (they allocate their outputs and
  launch nothing, which is what actsave.estimate simulates) nor for the inputs they
  hand to their torch reference.

Nothing here imports Triton: a launcher that calls this has imported it already.
"""
import torch


class KernelLaunchError(RuntimeError):
    """A Triton kernel of actsave failed to compile or launch; ``kernel`` is its name."""

    def __init__(self, kernel: str, device: torch.device, error: BaseException):
        self.kernel = kernel
        super().__init__(
            f"the Triton kernel {kernel} failed to compile or launch on {device}: "
            f"{type(error).__name__}: {error}. The torch references compute the same bits "
            "without Triton (slower): call actsave.set_backend('torch') (`with "
            "actsave.set_backend('torch'):` for a block) to use them, and please report this "
            "with your GPU, driver, torch and triton versions.")


def kernel_name(kernel) -> str:
    """The Python name of a ``@triton.jit`` function (also under the interpreter)."""
    function = getattr(kernel, "fn", kernel)
    return getattr(function, "__name__", repr(kernel))


def launch(kernel, grid: tuple, *args, **kwargs) -> None:
    """``kernel[grid](*args, **kwargs)`` on the device of the first tensor argument;
    any failure is raised as :class:`KernelLaunchError`."""
    first = next(a for a in args if isinstance(a, torch.Tensor))
    try:
        with torch.cuda.device_of(first):  # a no-op for CPU tensors (the interpreter)
            kernel[grid](*args, **kwargs)
    except Exception as error:  # noqa: BLE001 - re-raised with the kernel's name, chained
        raise KernelLaunchError(kernel_name(kernel), first.device, error) from error
