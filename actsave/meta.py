"""Running actsave on meta tensors: what a step would allocate on a device, without it.

Meta tensors have shapes, dtypes and strides but no data, so a training step on them
costs no device memory and shows every allocation. actsave uses such steps twice:
:func:`actsave.estimate` predicts a step's peak at real scale, and
``CheckpointedSequential(segments="balanced")`` measures per-layer sizes at its first
training call. Two things make those steps stand for a device:

- :func:`simulating` says which device a meta step stands for. Codecs then allocate
  what that device's implementation allocates (the Triton launchers' outputs for CUDA,
  the torch reference's temporaries for the CPU: codecs/backend.py), and a
  ``CheckpointedSequential`` plans its segments for that device.
- :class:`fast_meta` (and :class:`~actsave.planning.live_bytes.LiveBytes`) replay the output
  metadata of operators already seen with the same input metadata. Several meta
  kernels are Python decompositions (BatchNorm's forward and backward among them),
  slow enough to dominate a deep model's meta step (docs/results.md, "Figures behind
  the code's rules"); a model repeats a few shapes many times, and output shapes,
  strides and dtypes on meta tensors are a function of the inputs' metadata alone.
"""
from __future__ import annotations

import contextlib
import random
import sys
import threading
import warnings
from typing import Optional

import torch
from torch import nn

from ._taps import ATTENTION
from ._torch_graphs import reset_dynamo_after
from ._torch import (
    OpOverload,
    TorchDispatchMode,
    cpu_flash_attention,
    efficient_attention,
    flash_attention,
    fsdp_forward_hooks_paused,
    is_sharded,
    own_tensors,
)
from .devices import fused_attention
from .errors import ActsaveError
from .settings import CountedChange

_local = threading.local()


@contextlib.contextmanager
def simulating(device):
    """Inside the block, meta tensors stand for tensors on ``device``."""
    previous = getattr(_local, "device", None)
    _local.device = torch.device(device)
    try:
        with ATTENTION.handled(_simulated_attention) if fused_attention(_local.device) else contextlib.nullcontext():
            yield
    finally:
        _local.device = previous


# NOTE [ Attention on a simulated device ]
# scaled_dot_product_attention picks its kernel by the tensors' device, and meta
# tensors have none that it knows: they take the math path, which keeps the T x T
# attention weights for backward (a multiple of a long sequence's real peak:
# docs/results.md, "Meta steps"). The fused kernels keep the output and one
# log-sum-exp per row instead. So a meta step that stands for a
# device calls the kernel that device would take, whose meta kernel gives what it
# allocates and keeps (devices.fused_attention says which kernels a device has):
# - CUDA: flash for fp16 and bf16 without a mask, head sizes up to 256; else
#   memory-efficient, a mask as its additive bias; each only where
#   torch.backends.cuda enables it, and for head sizes in multiples of 8.
# - CPU: its flash kernel, masks included, without dropout.
# Else math, as unsimulated; so too for inputs that are not 4-D or whose query, key and
# value differ in head count or head size (grouped queries: an overestimate).
# The choice is made by tapping torch.nn.functional.scaled_dot_product_attention
# while a simulation runs (_taps.ATTENTION, a FunctionTap), since a TorchFunctionMode
# does not reach a checkpoint's recompute, and no dispatch mode sees the choice (it is
# made before dispatch). Code that bound the function under another name before is
# not reached. The tap is the process's while any thread simulates; on every other
# thread it calls torch's function as it is, since its handlers are per thread.
def _simulated_attention(call_next, *args, **kwargs):
    device = simulated_device()
    fused = _fused_attention(fused_attention(device), *args, **kwargs) if device is not None else None
    return call_next(*args, **kwargs) if fused is None else fused


def _fused_attention(kernels, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                     enable_gqa=False):
    """NOTE [ Attention on a simulated device ]: on meta tensors, the output of the fused
    kernel that a device with ``kernels`` would run; None where it runs the math path."""
    tensors = (query, key, value)
    if kernels is None or not all(isinstance(t, torch.Tensor) and t.device.type == "meta" and t.dim() == 4
                                  for t in tensors):
        return None
    head = query.size(-1)
    if (key.size(-1), value.size(-1)) != (head, head) or not query.size(1) == key.size(1) == value.size(1):
        return None
    if not query.dtype == key.dtype == value.dtype:
        return None
    if kernels == "cpu":
        if dropout_p == 0.0 and query.dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16) \
                and cpu_flash_attention is not None:
            return cpu_flash_attention(query, key, value, 0.0, is_causal, attn_mask=attn_mask, scale=scale)[0]
        return None
    if head % 8:
        return None
    if (attn_mask is None and query.dtype in (torch.float16, torch.bfloat16) and head <= 256
            and flash_attention is not None and torch.backends.cuda.flash_sdp_enabled()):
        return flash_attention(query, key, value, dropout_p, is_causal, False, scale=scale)[0]
    if (query.dtype in (torch.float32, torch.float16, torch.bfloat16) and efficient_attention is not None
            and torch.backends.cuda.mem_efficient_sdp_enabled()):
        bias = attn_mask
        if bias is not None and bias.dtype == torch.bool:  # as torch does: -inf where a position is masked
            bias = torch.zeros(bias.shape, dtype=query.dtype, device=bias.device).masked_fill_(~bias, float("-inf"))
        keeps_lse = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
        return efficient_attention(query, key, value, bias, keeps_lse, dropout_p, is_causal, scale=scale)[0]
    return None


def simulated_device() -> Optional[torch.device]:
    """The device meta tensors stand for now, or None outside :func:`simulating`."""
    return getattr(_local, "device", None)


def plans_at_first_call(module: nn.Module) -> bool:
    """Whether ``module`` or a submodule plans at its first training call on meta
    tensors (a ``CheckpointedSequential(segments="balanced")``): a step measured by a
    tracker must then come after one unmeasured forward, or the tracker sees the plan's
    meta step too."""
    return any(getattr(m, "plans_at_first_call", False) is True for m in module.modules())


def device_of(tensor: torch.Tensor) -> torch.device:
    """Where ``tensor`` lives, or for a meta tensor the device it stands for (the CPU
    outside :func:`simulating`)."""
    if tensor.device.type != "meta":
        return tensor.device
    return simulated_device() or torch.device("cpu")


@contextlib.contextmanager
def on_meta(model: nn.Module):
    """Swap every parameter and buffer of ``model`` for a meta copy (parameters with a meta
    gradient) and yield the copies; put the originals back on exit. Other tensors the
    model holds (plain attributes, lists) stay as they are: an operator of the step that
    meets one beside meta tensors takes a meta copy of it (_OutputMetadata.call), and
    one read for its values (``sizes.tolist()``) reads them. Tied parameters stay tied.
    A parameter FSDP2 sharded becomes a meta copy of the whole parameter, as a forward
    sees it gathered, and FSDP2's forward hooks are paused meanwhile: they would gather
    the real shards over the copies, a collective that a meta step must not make.
    Anomaly mode checks no gradient for NaN meanwhile
    (NOTE [ Anomaly mode in a meta step ])."""
    _warn_of_recurrences(model)
    _meta_steps.depth = getattr(_meta_steps, "depth", 0) + 1  # NOTE [ A meta step draws nothing ]
    try:
        with fsdp_forward_hooks_paused(model), _NAN_CHECKS_OFF.active(), _python_generators_put_back():
            yield from _swapped_for_meta(model)
    except BaseException as error:
        reset_dynamo_after(error)  # NOTE [ A meta step that failed inside Dynamo ]
        raise
    finally:
        _meta_steps.depth -= 1


@contextlib.contextmanager
def _python_generators_put_back():
    """Python's ``random`` and numpy's global generator as the body found them: NOTE [ A
    meta step draws nothing ]."""
    numpy = sys.modules.get("numpy")  # imported by the model's code, or nothing of it draws
    states = random.getstate(), numpy.random.get_state() if numpy is not None else None
    try:
        yield
    finally:
        random.setstate(states[0])
        if states[1] is not None:
            numpy.random.set_state(states[1])


# NOTE [ A meta step draws nothing ]
# Random operators on meta tensors draw nothing, but a layer may draw on a real device
# whatever its input's: a factory without a device (``torch.rand([])`` to skip itself,
# as Hugging Face's LayerDrop does; ``torch.randperm(n)``), or from a generator it holds
# (``torch.rand(n, generator=g)``). In a meta step (a first call's balanced plan, which
# runs inside the model's first forward, where the user cannot seed after it) those
# draws would move the process's generators, and the first training step would draw
# other numbers than plain PyTorch's. Putting the generators back as the step ends would
# undo what other threads drew meanwhile (NOTE [ Steps other threads do not see ] in
# planning/step_isolation.py). So, on the stepping thread only, each random operator
# (aten's ``nondeterministic_seeded`` tag) that runs on a real device puts back, as it
# returns, the state of the generators it may have drawn from: the CPU's, each
# initialized CUDA device's, and the one passed to it. Checked where every operator of a
# meta step passes already (the dispatch modes that replay output metadata, fast_meta
# and planning's LiveBytes: _OutputMetadata.call), while this thread is in on_meta, not
# in a mode of its own, which would cost every operator of every plan one more Python
# call. A step on a real device draws as a training step does (step_isolation.py). Each
# such draw in the step then reads the same numbers, which no training step sees. A seed
# a layer sets (``torch.manual_seed``, no operator) is the process's and is not put back
# (docs/limits.md, "Threads"). Python's ``random`` and numpy's global generator, which
# no operator draws from (an older LayerDrop's ``random.uniform``), are put back as the
# meta step ends: a draw another thread makes from them meanwhile is undone too.
_meta_steps = threading.local()  # depth: the meta steps (on_meta) open on this thread


def meta_step_depth() -> int:
    """How many meta steps (:func:`on_meta`) this thread is in."""
    return getattr(_meta_steps, "depth", 0)


def _drawn_with_generators_put_back(func, args: tuple, kwargs: dict):
    """``func(*args, **kwargs)``, a random operator on a real device, leaving the
    generators it may draw from as it found them (NOTE [ A meta step draws nothing ])."""
    generator = kwargs.get("generator")
    held = generator.get_state() if generator is not None else None
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
    try:
        with torch.random.fork_rng(devices=devices):
            return func(*args, **kwargs)
    finally:
        if held is not None:
            generator.set_state(held)


def _some_on_meta(args: tuple, kwargs: dict) -> bool:
    return any(isinstance(t, torch.Tensor) and t.is_meta for a in (*args, *kwargs.values())
               for t in (a if isinstance(a, (list, tuple)) else (a,)))


def _all_on_meta(args: tuple, kwargs: dict) -> tuple:
    """``(args, kwargs)`` with a meta copy of each tensor off the meta device (also in a
    list argument, ``torch.cat``'s): a constant the model holds as a plain attribute or in
    a list (not a buffer, which the step swaps), read by an operator of a meta step beside
    its activations, as the real step reads it beside them on its device. Its value is
    not read; an in-place change there is the copy's, but one an operator makes to it
    with no meta tensor is real (docs/limits.md, "The first call plans"). One that
    requires grad is refused: autograd, above this, would hand it a meta gradient."""
    def on_meta(a):
        if isinstance(a, (list, tuple)):
            return type(a)(map(on_meta, a))
        if not isinstance(a, torch.Tensor) or a.is_meta:
            return a
        if a.requires_grad:  # an ActsaveError: Tensor's operators turn a TypeError into NotImplemented
            raise ActsaveError(
                f"a tensor of shape {list(a.shape)} on {a.device} that requires grad is held outside the model's "
                "parameters (a plain attribute, a list), so a step on meta tensors cannot stand for it. Register it "
                "as an nn.Parameter (or a buffer, if it is a constant).")
        return torch.empty_like(a, device="meta")
    return tuple(map(on_meta, args)), {name: on_meta(a) for name, a in kwargs.items()}


def _on_meta(args: tuple, kwargs: dict) -> bool:
    """Whether an operator's tensors (or, for a factory, its device) are meta."""
    tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
    if tensors:
        return all(t.is_meta for t in tensors)
    device = kwargs.get("device")
    return device is not None and torch.device(device).type == "meta"


_warned_recurrences = set()


def _warn_of_recurrences(model: nn.Module) -> None:
    """Warn once per recurrent module type in ``model``: on meta tensors its recurrence
    runs torch's per-step composite, whose saves are not those of the fused kernel a
    device runs (oneDNN's on a CPU, cuDNN's), so the step misstates its memory."""
    for kind in {type(m) for m in model.modules() if isinstance(m, nn.RNNBase)} - _warned_recurrences:
        _warned_recurrences.add(kind)
        warnings.warn(f"actsave: a step on meta tensors runs {kind.__name__} as torch's per-step composite, not "
                      "the fused kernel a device runs, so its memory there is misstated: an estimate or a balanced "
                      "plan of this model may be off (docs/limits.md, 'Meta estimates'). Plan from a measured step "
                      "(segments='auto', budget=, example_inputs=).", stacklevel=4)


# NOTE [ Anomaly mode in a meta step ]
# Under torch.autograd.set_detect_anomaly(True) the backward reads every gradient it
# computes to check it for NaN (``.item()``), which a meta tensor cannot give: a meta
# step would fail there (a balanced plan falling back to "sqrt"). So while a step runs
# on meta tensors, anomaly mode stays on but checks no NaN (set_detect_anomaly(True,
# check_nan=False)): its forward tracebacks are still kept. The mode is the process's,
# not the thread's, so another thread's backward checks no NaN either while any meta
# step is open (counted under a lock, as _torch.AttributeSwap counts); the last to end
# turns the check back on, unless anomaly mode was changed meanwhile.
class _NanChecksOff(CountedChange):
    """NOTE [ Anomaly mode in a meta step ]: the NaN check off while one or more
    :meth:`active` contexts are open, on any threads."""

    def __init__(self):
        super().__init__()
        self._turned_off = False

    def make(self) -> None:
        if torch.is_anomaly_enabled() and torch.is_anomaly_check_nan_enabled():
            torch.autograd.set_detect_anomaly(True, check_nan=False)
            self._turned_off = True

    def undo(self) -> None:
        if self._turned_off:
            self._turned_off = False
            if torch.is_anomaly_enabled() and not torch.is_anomaly_check_nan_enabled():
                torch.autograd.set_detect_anomaly(True, check_nan=True)

_NAN_CHECKS_OFF = _NanChecksOff()


def _swapped_for_meta(model: nn.Module):
    copies, swapped = {}, []
    for module in model.modules():
        for table, make in ((own_tensors(module, "parameters"), _meta_parameter),
                            (own_tensors(module, "buffers"), _meta_tensor)):
            for name, original in table.items():
                if original is None:
                    continue
                if id(original) not in copies:
                    copies[id(original)] = make(original)
                swapped.append((table, name, original))
                table[name] = copies[id(original)]
    try:
        yield [(t, t.grad) for t in copies.values()]
    finally:
        for table, name, original in swapped:
            table[name] = original


def _meta_tensor(t: torch.Tensor) -> torch.Tensor:
    if is_sharded(t):
        return torch.empty(t.shape, dtype=t.dtype, device="meta")
    return torch.empty_like(t, device="meta")


def _meta_parameter(p: nn.Parameter) -> nn.Parameter:
    meta = nn.Parameter(_meta_tensor(p), requires_grad=p.requires_grad)
    if p.requires_grad:
        meta.grad = _meta_tensor(p)
    return meta


# ------------------------------------------------------------- replayed output metadata

# Values an operator's non-tensor arguments take that hash by value. The type is part
# of the key: 1, 1.0 and True are equal in Python but give tensors of other dtypes.
_PLAIN = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format)
_MAX_ENTRIES = 50_000
_NOT_REPLAYABLE = object()


class _OutputMetadata:
    """Output shapes, strides and dtypes of functional operators on meta tensors, by
    the metadata of their arguments."""

    def __init__(self):
        self._entries = {}

    def call(self, func, args: tuple, kwargs: dict):
        """``func(*args, **kwargs)``, replayed from an earlier call where it can be."""
        if torch.Tag.nondeterministic_seeded in func.tags and meta_step_depth() and not _on_meta(args, kwargs):
            if not _some_on_meta(args, kwargs):
                return _drawn_with_generators_put_back(func, args, kwargs)  # NOTE [ A meta step draws nothing ]
            args, kwargs = _all_on_meta(args, kwargs)  # a constant the model holds, beside meta tensors
        if func is _ADD_IN_PLACE and _sparse_into_dense(args):
            # A sparse gradient (nn.Embedding(sparse=True)'s) accumulated into the dense one a
            # meta step gives each parameter: torch has no meta kernel for the coalesce that
            # needs, and on meta tensors the sum is the dense tensor as it is.
            return args[0]
        key = _key(func, args, kwargs)
        if key is None:
            if meta_step_depth() and _some_on_meta(args, kwargs):
                args, kwargs = _all_on_meta(args, kwargs)
            return func(*args, **kwargs)
        entry = self._entries.get(key)
        if entry is not None and entry is not _NOT_REPLAYABLE:
            return _rebuild(entry)
        out = func(*args, **kwargs)
        if entry is None:
            if len(self._entries) >= _MAX_ENTRIES:
                self._entries.clear()
            self._entries[key] = _describe(out, args, kwargs)
        return out


def _key(func, args: tuple, kwargs: dict) -> Optional[tuple]:
    """What a functional operator's output metadata depends on, or None when the call
    may not be replayed: a mutating or aliasing operator, a tensor off the meta
    device, an argument that does not hash by value."""
    if not _functional(func):
        return None
    try:
        arguments = _argument_key(args), _argument_key(kwargs)
    except _NotPlain:
        return None
    # Factory operators without a dtype argument use the default dtype.
    return func, arguments, torch.get_default_dtype()


_ADD_IN_PLACE = torch.ops.aten.add_.Tensor


def _sparse_into_dense(args: tuple) -> bool:
    """Whether ``add_``'s arguments add a sparse tensor to a dense one (not a number:
    BatchNorm's ``num_batches_tracked.add_(1)``)."""
    other = args[1]
    return isinstance(other, torch.Tensor) and other.layout != torch.strided and args[0].layout == torch.strided


class _NotPlain(Exception):
    """An argument the key cannot describe by value."""


def _argument_key(value):
    # Runs for every argument of every operator of a meta step: kept lean.
    if isinstance(value, torch.Tensor):
        if not value.is_meta or value.layout != torch.strided:  # a sparse one: no strides to key
            raise _NotPlain
        return value.shape, value.stride(), value.storage_offset(), value.dtype
    kind = type(value)
    if kind is tuple or kind is list:
        return kind, tuple([_argument_key(item) for item in value])
    if kind is dict:
        return kind, tuple([(name, _argument_key(item)) for name, item in value.items()])
    if isinstance(value, _PLAIN):
        return kind, value
    raise _NotPlain


_FUNCTIONAL = {}


def _functional(func) -> bool:
    """Whether ``func`` is an operator that neither mutates nor returns an alias."""
    functional = _FUNCTIONAL.get(func)
    if functional is None:
        schema = getattr(func, "_schema", None)
        functional = _FUNCTIONAL[func] = (
            isinstance(func, OpOverload) and not schema.is_mutable
            and not any(r.alias_info is not None for r in schema.returns))
    return functional


def _describe(out, args: tuple, kwargs: dict):
    """How to rebuild ``out`` (a tensor, a plain value, or a tuple or list of them):
    fresh, densely allocated meta tensors and plain values; else _NOT_REPLAYABLE."""
    inputs = {id(t.untyped_storage()) for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)}
    seen = set()

    def describe(value):
        if isinstance(value, (tuple, list)):
            return type(value), tuple(describe(item) for item in value)
        if isinstance(value, torch.Tensor):
            if value.layout != torch.strided:
                raise _NotPlain
            storage = value.untyped_storage()
            fresh = id(storage) not in inputs and id(storage) not in seen
            if (value.device.type != "meta" or not fresh or value.storage_offset() != 0
                    or storage.nbytes() != _dense_nbytes(value)):
                raise _NotPlain
            seen.add(id(storage))
            return torch.Tensor, (tuple(value.shape), value.stride(), value.dtype)
        if isinstance(value, _PLAIN):
            return None, value
        raise _NotPlain

    try:
        return describe(out)
    except _NotPlain:
        return _NOT_REPLAYABLE


def _dense_nbytes(t: torch.Tensor) -> int:
    """The storage ``torch.empty_strided`` allocates for ``t``'s shape and strides."""
    if t.numel() == 0:
        return 0
    return (1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))) * t.element_size()


def _rebuild(entry):
    kind, value = entry
    if kind is torch.Tensor:
        return torch.empty_strided(value[0], value[1], dtype=value[2], device="meta")
    if kind is None:
        return value
    return kind(_rebuild(item) for item in value)


OUTPUT_METADATA = _OutputMetadata()


class fast_meta(TorchDispatchMode):
    """Run meta operators through the shared output-metadata cache (module docstring);
    operators on other devices run as usual."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return OUTPUT_METADATA.call(func, args, kwargs or {})


__all__ = ["simulating", "simulated_device", "device_of", "plans_at_first_call", "on_meta", "fast_meta", "OUTPUT_METADATA"]
