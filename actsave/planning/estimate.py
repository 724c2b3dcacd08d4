"""Peak training memory of a model, predicted without the device it will train on.

    >>> est = actsave.estimate(model, (128, 3, 32, 32), device="cuda", optimizer="sgd")
    >>> est.total_peak_bytes <= 80 * 10**9     # does one training step fit an 80 GB GPU?

:func:`estimate` runs the model's own forward and backward (so actsave's recompute,
kept inputs, codecs, offload and ReLU and max-pool decisions run too) on *meta* tensors: shapes,
dtypes and storages but no data, so it takes no device memory and little time.
Parameters and buffers are swapped for meta copies for the duration (the model is left
as it was), and a :class:`LiveBytes` tracker adds up every storage the step allocates
and frees on the device. The meta tensors stand for tensors on ``device`` (meta.py):
codecs allocate what that device's implementation allocates, and
``CheckpointedSequential(segments="balanced")`` plans for it. On CPU the result equals
``torch.distributed._tools.mem_tracker.MemTracker``'s peak of a real step
(tests/test_estimate.py).

The step is: forward, then backward from a full-size gradient of the output (what a
loss such as cross-entropy hands back; the loss's own memory is not counted), with
every parameter gradient already allocated, as from the second step of training on.
One forward runs before it, unmeasured, so that modules that plan at their first
training call (``segments="balanced"``) do so outside the measured step.

Offload is simulated: an offloaded input leaves the device when the next segment
starts and comes back when the backward prefetches it, as on a GPU; host memory is
reported apart (``host_peak_bytes``).

Limits:
- Device-specific kernels are not simulated: the step runs the CPU/meta kernels, so a
  CUDA step that saves different tensors (flash attention saves log-sum-exp rows
  instead of the attention matrix) or needs workspaces (cuDNN) differs: a CUDA
  estimate of a model with convolutions states the workspaces' rough size apart
  (``workspace_bytes_left_out``). CUDA's 512-byte allocation granularity is applied;
  allocator fragmentation (reserved but unallocated memory) is not predicted.
- Data-dependent operations (``.item()``, ``nonzero``) cannot run on meta tensors.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import nn

from .._torch import pytree
from ..checks import check_loss_function, integral
from ..devices import convolution_workspaces
from ..errors import ActsaveError, ConfigError
from ..meta import fast_meta, on_meta, plans_at_first_call, simulating
from ..runtime.store import peak_kept_bytes
from .instrumented_step import backward_from, checked_loss
from .live_bytes import LiveBytes, allocation_bytes
from .step_isolation import ModuleState, parametrize_cache_set_aside

# Parameter-shaped state tensors each optimizer keeps per trained parameter.
OPTIMIZER_STATES = {None: 0, "sgd": 0, "momentum": 1, "adam": 2, "adamw": 2}


@dataclass(frozen=True)
class MemoryEstimate:
    """Predicted peak memory of one training step, in bytes.

    ``activation_peak_bytes`` is the device peak that actsave's planner calls the
    budget: the step's peak on the device beyond parameters, buffers, gradients and
    optimizer state (the input batch included). ``total_peak_bytes`` adds those, all
    resident for the whole step. ``host_peak_bytes`` is the peak of what actsave holds
    in host memory (offloaded inputs and their ReLU and max-pool decisions, as
    :func:`actsave.kept_bytes` counts them; the pinned pool rounds each buffer up to
    a power of two); none of it is on the device. ``workspace_bytes_left_out``: on
    CUDA, for a model that runs convolutions, the rough size of cuDNN's workspaces, which
    no peak here counts (NOTE [ Workspaces an estimate leaves out ]); 0 elsewhere.
    """

    activation_peak_bytes: int
    parameter_bytes: int  # parameters and buffers
    gradient_bytes: int
    optimizer_bytes: int
    device: str
    host_peak_bytes: int = 0
    # Not in the peaks: NOTE [ Workspaces an estimate leaves out ].
    workspace_bytes_left_out: int = 0

    @property
    def total_peak_bytes(self) -> int:
        """The step's peak on the device: the activation peak plus parameters, buffers,
        gradients and optimizer state, all resident for the whole step."""
        return self.activation_peak_bytes + self.parameter_bytes + self.gradient_bytes + self.optimizer_bytes

    def __str__(self) -> str:
        rows = [("activations (peak)", self.activation_peak_bytes),
                ("parameters + buffers", self.parameter_bytes),
                ("gradients", self.gradient_bytes),
                ("optimizer state", self.optimizer_bytes),
                ("total (peak)", self.total_peak_bytes),
                ("host memory, offloaded (peak)", self.host_peak_bytes)]
        if self.workspace_bytes_left_out:
            rows.append(("not counted: cuDNN workspaces, about", self.workspace_bytes_left_out))
        width = max(len(name) for name, _ in rows)
        lines = [f"estimated training-step memory on {self.device}"]
        lines += [f"  {name.ljust(width)}  {value / 2**20:12.1f} MiB" for name, value in rows]
        return "\n".join(lines)


# NOTE [ Workspaces an estimate leaves out ]
# cuDNN's convolutions take workspaces from the caching allocator: memory no tensor
# holds, which meta kernels do not ask for, so the estimate cannot count it. The gap a
# GPU measured scales with the largest tensor a convolution reads or writes (the
# factor and the runs behind it: docs/limits.md, "Meta estimates"). An estimate for
# CUDA of a model that runs convolutions states that factor times that tensor as left
# out: a rough figure beside the peaks, not added to them, since it is not this step's
# measurement.
_WORKSPACE_PER_CONVOLUTION_TENSOR = 3.4


def estimate(model: nn.Module, input_shapes, device="cuda", optimizer: Optional[str] = None,
             loss: Optional[Callable] = None) -> MemoryEstimate:
    """Predict the peak memory of one training step of ``model`` on ``device``.

    Args:
        model: any module (an ``nn.Module`` instance); its forward runs for real, on
            meta tensors.
        input_shapes: the shape of the one input (``(128, 3, 32, 32)``; sizes are
            integers, numpy's too), or a non-empty list of them for several inputs.
            Each may also be a tensor (a meta tensor is enough) to give the dtype too,
            e.g. ``torch.empty(8, 1024, dtype=torch.long, device="meta")`` for token
            ids. Shapes alone get the dtype of the model's first floating-point
            parameter.
        device: the device to predict for (default "cuda"); sets the allocation
            granularity, and on CUDA makes offload a lever.
        optimizer: ``None``/``"sgd"`` (no state), ``"momentum"`` (one buffer per
            parameter) or ``"adam"``/``"adamw"`` (two), counted in ``optimizer_bytes``.
        loss: the training step's loss, a function of the model's output returning a
            scalar (it runs on meta tensors: make any targets on ``output.device``), as
            ``profile``'s ``loss=``. Without it the backward starts from a gradient of
            ones, which holds none of a loss's own buffers (a cross-entropy keeps its
            log-softmax, a large one over a vocabulary).
    """
    if not isinstance(model, nn.Module):
        raise ConfigError(f"model={model!r} is not an nn.Module instance: estimate runs the model's own "
                          f"forward and backward, so pass the model (got a {type(model).__name__})")
    device = _checked_device(device)
    if not (optimizer is None or isinstance(optimizer, str)) or optimizer not in OPTIMIZER_STATES:
        raise ConfigError(f"optimizer={optimizer!r} is not one of {list(OPTIMIZER_STATES)}")
    check_loss_function(loss)
    specs = _input_specs(input_shapes, _default_dtype(model))
    # Inside on_meta: the model's attributes are put back as the step found them (a
    # tensor cached at the first forward would stay a meta one), on its meta buffers.
    with _meta_step_errors(), on_meta(model) as state, ModuleState(model), parametrize_cache_set_aside(model), \
            simulating(device):
        inputs = [torch.empty(shape, dtype=dtype, device="meta") for shape, dtype in specs]
        if plans_at_first_call(model):
            with fast_meta(), torch.enable_grad():
                model(*inputs)  # outside the measured step (module docstring)
        tracker = LiveBytes(device, known=(state, inputs, list(model.buffers())))  # ModuleState's copies too
        convolutions = _LargestConvolutionTensor(model, watched=convolution_workspaces(device))
        with tracker, peak_kept_bytes() as stored, convolutions:
            host_before = stored["host"]
            outputs = model(*inputs)
            if loss is None:
                _backward_from_full_gradient(outputs)
            else:
                _backward_from_loss(loss, outputs)
    trained = [p for p in model.parameters() if p.requires_grad]
    return MemoryEstimate(
        activation_peak_bytes=tracker.peak + sum(_bytes(t, device) for t in inputs),
        parameter_bytes=sum(_bytes(t, device) for t in (*model.parameters(), *model.buffers())),
        gradient_bytes=sum(_bytes(p, device) for p in trained),
        optimizer_bytes=OPTIMIZER_STATES[optimizer] * sum(_bytes(p, device) for p in trained),
        device=str(device),
        host_peak_bytes=stored["host"] - host_before,
        workspace_bytes_left_out=int(_WORKSPACE_PER_CONVOLUTION_TENSOR * convolutions.largest),
    )


@contextlib.contextmanager
def _meta_step_errors():
    """An error of the model's step on meta tensors raised as one that says so; an
    actsave error, and a TypeError or ValueError (the arguments' own: a wrong number
    of input shapes), pass as they are."""
    try:
        yield
    except (ActsaveError, TypeError, ValueError):
        raise
    except Exception as error:
        raise ActsaveError(
            f"actsave.estimate ran one training step of the model on meta tensors, and it raised: "
            f"{type(error).__name__}: {error}. Where the model runs on its device with these input shapes, an "
            "operator of it cannot run on meta tensors: one with no meta kernel (torch's error names it), a value "
            "read on the host (.item(), a tensor of lengths that must be on the CPU), torch.cond. Measure such a "
            "model on its device instead (actsave.profile, or CheckpointedSequential(segments='auto'), which "
            "profile it).") from error


class _LargestConvolutionTensor:
    """While open: the bytes of the largest tensor a convolution of ``model`` reads or
    writes (``largest``), from hooks on its convolution modules; 0 unless ``watched``."""

    def __init__(self, model: nn.Module, watched: bool):
        self._convolutions = [m for m in model.modules() if isinstance(m, nn.modules.conv._ConvNd)] if watched else []
        self.largest = 0

    def __enter__(self):
        self._handles = [m.register_forward_hook(self._saw) for m in self._convolutions]
        return self

    def __exit__(self, *exc):
        for handle in self._handles:
            handle.remove()

    def _saw(self, module, args, output) -> None:
        for t in (*args, output):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel() * t.element_size())


def _checked_device(device) -> torch.device:
    try:
        return torch.device(device)
    except (RuntimeError, TypeError) as error:
        raise ConfigError(f"device={device!r} is not a torch device ('cuda', 'cuda:1', 'cpu')") from error


def _default_dtype(model: nn.Module) -> torch.dtype:
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)


def _input_specs(input_shapes, dtype: torch.dtype) -> list:
    """[(shape, dtype)] from one shape, a tensor, or a list of either."""
    if isinstance(input_shapes, (tuple, list)) and not input_shapes:
        raise ConfigError(f"input_shapes={input_shapes!r} is empty: give the input's shape such as "
                          "(128, 3, 32, 32), or for a 0-d input a tensor: torch.empty((), device='meta')")
    if isinstance(input_shapes, torch.Tensor) or _is_shape(input_shapes):
        input_shapes = [input_shapes]
    if not isinstance(input_shapes, (list, tuple)) or not input_shapes:
        raise ConfigError(_bad_shapes(input_shapes))
    specs = []
    for item in input_shapes:
        if isinstance(item, torch.Tensor):
            specs.append((tuple(item.shape), item.dtype))
        elif _is_shape(item):
            specs.append((tuple(integral(d) for d in item), dtype))
        else:
            raise ConfigError(_bad_shapes(input_shapes))
    return specs


def _is_shape(value) -> bool:
    return (isinstance(value, (tuple, list, torch.Size))
            and all(integral(d) is not None and integral(d) >= 0 for d in value))


def _bad_shapes(value) -> str:
    return (f"input_shapes={value!r} must be one shape such as (128, 3, 32, 32), a tensor "
            "(a meta tensor is enough) for shape and dtype, or a list of those for a model "
            "with several inputs")


def _bytes(t: torch.Tensor, device) -> int:
    return allocation_bytes(t.numel() * t.element_size(), device)


def _backward_from_loss(loss: Callable, outputs) -> None:
    backward_from(checked_loss(loss, outputs))


def _backward_from_full_gradient(outputs) -> None:
    tensors = [t for t in pytree.tree_leaves(outputs) if isinstance(t, torch.Tensor) and t.requires_grad]
    if not tensors:
        raise ConfigError("the model's output does not require grad: there is no backward to estimate")
    torch.autograd.backward(tensors, [torch.ones_like(t) for t in tensors])


__all__ = ["MemoryEstimate", "estimate", "LiveBytes", "allocation_bytes", "OPTIMIZER_STATES"]
