"""The balanced plans of a CheckpointedSequential (``segments="balanced"``, the
default), planned on meta tensors at the first training call of each input and cached
per input (:class:`BalancedPlans`), with the ``"sqrt"`` fallback where that step
cannot run.

NOTE [ Balanced segments ]
``segments="balanced"`` (the default) chooses where segments start knowing what a kept
input costs under each layer's codec and offload setting: a kept input that a codec
makes 4x cheaper buys about twice as many, shorter segments, and an offloaded one costs
the device almost nothing, so segments can shrink to one layer and the device peak stops
growing with depth. At the first training call for an input (shape, strides, dtype,
device, whether it requires grad, and the layers, their settings, the training modes of
every module under them, and which of their parameters require grad and in which dtype),
each layer runs once on meta tensors (profiler.profile: sizes only, no data, no device
memory, no times) and plans.balanced takes the smallest predicted device peak with at
most one extra forward. The plan is cached per such input, so a new shape plans anew;
once the layers change, the plans made for the old ones go at the next call (no call
would use them again). The cache holds the layers weakly: a layer taken out of the model
goes with it, not at the next training call. What autograd saves depends on which
parameters require grad, so a chain whose frozen prefix is unfrozen (gradual unfreezing)
plans again; so does one whose parameters change dtype (``model.float()`` after
``.half()``: with token ids in, the input's key stays the same while the activations
double), and one where a module inside a layer changes mode (a Dropout or BatchNorm put
in eval while the rest trains saves less). Those flags and dtypes are read at every call
from the modules the layers had at their first call, held weakly (no walk of the module
tree per call), and their own tables of parameters: a parameter replaced is followed at
once, a module replaced once the old one is freed, one a layer gains later is not. The
parameters themselves are not held, not even weakly: ``torch.utils.swap_tensors``, which
``module.to()`` uses under ``torch.__future__.set_swap_module_params_on_conversion``,
refuses a tensor that a weak reference points to. Their devices are not read: the plan
is for one device, the input's. The meta step touches its own model and thread only (step_isolation.py, NOTE [
Steps other threads do not see ]) and leaves every module of it holding what it held
(NOTE [ Module state a step puts back ]: a flag or cache its first forward sets is set
by the real step); the model itself is meta copies while it runs, so a call of the same
model on another thread meanwhile raises.

The last segment of a balanced plan stores autograd's saves exactly, whatever its
first layer's codec: the plan keeps that segment short, and there compressing the
saves costs more in decode temporaries than it frees (docs/results.md, "Other
figures"), and the memory model prices the plain segment as exact. One function
says so to the runtime, the profile and the plan: plans.balanced_last_policy. On a
CPU device host memory is the device's, so offload is planned there as if the inputs
stayed (they do, in the pool: devices.py, NOTE [ Separate host memory ]).

A chain the meta step cannot run (data-dependent operations such as ``.item()``,
sharded parameters, layers that pass something else than one tensor) falls back to
the ``"sqrt"`` split, with a warning that says why, once per model. ``"sqrt"`` is
``checkpoint_sequential``'s even split of round(sqrt(n)) segments. Tools that watch
every module call or operator (MemTracker, FlopCounterMode) see the meta step of a
first call: measure from the second step, as training-step measurements do anyway.
"""
from __future__ import annotations

import operator
import threading
import warnings
import weakref
from typing import Optional

import torch
from torch import nn

from .._torch import is_sharded, own_tensors
from ..errors import ConfigError
from ..meta import device_of
from ..runtime.keep_rules import should_encode
from . import plan_record, plans, profiler
from .segments import split_starts
from .step_isolation import user_stacklevel

_STATE = operator.attrgetter("requires_grad", "dtype")  # of a parameter, in a plan's key
_TRAINING = operator.attrgetter("training")  # of a module under the layers, in a plan's key
_DEREFERENCE = weakref.ref.__call__
_PLANS_KEPT = 16  # balanced plans cached per model, one per distinct input
_UNPLANNED = object()  # no plan for a key yet (None is a plan: the meta step failed, "sqrt")
# Held while a model's plans are marked as being made on a thread (a moment): one for
# every model, so that a model holds no lock (models deep-copy and pickle).
_PLANNING_LOCK = threading.Lock()


class BalancedPlans:
    """The balanced plans of one CheckpointedSequential, by input (NOTE [ Balanced
    segments ]): the last few, and the one used last, for describe()."""

    def __init__(self):
        self._plans = {}  # key -> Plan, or None where the meta step failed ("sqrt"), for self._layers
        # Weak references to the layers of the last call, which the plans are for: a layer
        # removed from the model goes with it, not at the next training call.
        self._layers = ()
        self._modules = None  # weak references to every module under them, made at a call
        self._last = None  # (the input as text, its plan), of the last call
        self._warned = False
        self._planning = None  # the thread running this model's meta step, if any

    def starts(self, model: nn.Module, input, layers: list, policies: tuple) -> list:
        self.check_not_planning_elsewhere(model)
        if not self._for(layers):
            self._plans, self._layers, self._modules = {}, tuple(map(weakref.ref, layers)), None
        if self._modules is None:
            self._modules = _module_refs(layers)
        if not isinstance(input, torch.Tensor):
            self._warn_once(f"its input is a {type(input).__name__}; the planner follows one tensor")
            self._last = (type(input).__name__, None)
            return split_starts(layers, "sqrt", policies)
        states = self._parameter_states()
        if not input.requires_grad and not any(requires_grad for requires_grad, _ in states):
            # Nothing the call computes needs a gradient (a frozen teacher under grad mode):
            # no backward will run, so there is nothing to plan for, nor to warn of.
            return split_starts(layers, "sqrt", policies)
        device = device_of(input)
        key = (_plan_key(input, device, policies), states, self._training_modes())
        plan = self._plans.get(key, _UNPLANNED)
        if plan is _UNPLANNED:
            if len(self._plans) >= _PLANS_KEPT:
                del self._plans[next(iter(self._plans))]
            plan = self._plans[key] = self._planned_here(model, input, device, policies)
        self._last = (f"{tuple(input.shape)} {input.dtype} on {device}", plan)
        return list(plan.starts) if plan is not None else split_starts(layers, "sqrt", policies)

    def __getstate__(self) -> dict:
        # Weak references neither pickle nor deep-copy (a copy's would read the
        # original's modules): the layers go as themselves (a copy's, its own) and
        # the modules' are made again from them at the next call.
        return {**self.__dict__, "_layers": tuple(ref() for ref in self._layers), "_modules": None}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._layers = tuple(weakref.ref(layer) for layer in self._layers if layer is not None)

    def _for(self, layers: list) -> bool:
        """Whether the plans are for ``layers``: the last call's, element by element."""
        return len(self._layers) == len(layers) and all(ref() is layer for ref, layer in zip(self._layers, layers))

    def _parameter_states(self) -> tuple:
        """Whether each parameter of the layers requires grad, and its dtype (NOTE [
        Balanced segments ])."""
        try:
            return tuple(map(_STATE, _own_parameters(map(_DEREFERENCE, self._modules))))
        except AttributeError:  # None._parameters: a module was replaced and freed
            self._modules = _module_refs(ref() for ref in self._layers)
            return self._parameter_states()

    def _training_modes(self) -> tuple:
        """The training flag of every module under the layers (NOTE [ Balanced segments ])."""
        try:
            return tuple(map(_TRAINING, map(_DEREFERENCE, self._modules)))
        except AttributeError:  # None.training: a module was replaced and freed
            self._modules = _module_refs(ref() for ref in self._layers)
            return self._training_modes()

    def check_not_planning_elsewhere(self, model: nn.Module) -> None:
        """Raise where another thread is in this model's meta step: the model's
        parameters and buffers are meta copies until it ends (meta.on_meta), and one
        model trained on two threads at once is not supported (docs/limits.md,
        "Threads")."""
        planning = self._planning
        if planning is not None and planning != threading.get_ident():
            raise ConfigError(
                f"{type(model).__name__} was called on one thread while another thread plans its segments on meta "
                "tensors (its parameters and buffers are meta copies until that ends): one model trained on two "
                "threads at once is not supported. Give each thread a model of its own (copy.deepcopy)")

    def _planned_here(self, model: nn.Module, input: torch.Tensor, device, policies: tuple):
        """:meth:`_plan`, marked as this thread's while it runs."""
        with _PLANNING_LOCK:
            self.check_not_planning_elsewhere(model)
            self._planning = threading.get_ident()
        try:
            return self._plan(model, input, device, policies)
        finally:
            self._planning = None

    def _plan(self, model: nn.Module, input: torch.Tensor, device, policies: tuple) -> Optional["plan_record.Plan"]:
        try:
            _check_simulable(model)
            # Stored saves are priced by codec only where the last segment's policy is lossy.
            profile = profiler.profile(model, (_meta_stand_in(input),), device=device,
                                       stored_saves=plans.balanced_last_policy().lossy)
            return plans.balanced(profile, list(policies))
        except Exception as error:  # anything the meta step cannot run: NOTE [ Balanced segments ]
            self._warn_once(f"it could not run its layers on meta tensors ({type(error).__name__}: {error})")
            return None

    def _warn_once(self, why: str) -> None:
        if not self._warned:
            self._warned = True
            warnings.warn(
                f"CheckpointedSequential(segments='balanced') uses the 'sqrt' split: {why}. Pass "
                "segments='sqrt', an int or a list of starts to choose the split yourself and silence "
                "this warning.", stacklevel=user_stacklevel())

    @property
    def last_plan(self) -> Optional["plan_record.Plan"]:
        return None if self._last is None else self._last[1]

    def describe_last(self, layers: list) -> tuple:
        """(a line on the last balanced plan, its starts or None before any call, or
        where ``layers`` are no longer those of the last call)."""
        if self._last is None:
            return "segments='balanced': chosen at the first training call", None
        input, plan = self._last
        if not self._for(layers):
            return "segments='balanced': chosen at the next training call (the layers changed since the last)", None
        if plan is None:
            return f"segments='balanced' fell back to 'sqrt' for input {input}", None
        return (f"segments='balanced' for input {input}: predicted peak activation memory "
                f"{plan.predicted_peak_bytes / 2**20:.2f} MiB", list(plan.starts))


def _plan_key(input: torch.Tensor, device, policies: tuple) -> tuple:
    """What a balanced plan depends on, apart from its layers' parameters and modes (NOTE [
    Balanced segments ])."""
    autocast = torch.is_autocast_enabled(device.type), torch.get_autocast_dtype(device.type)
    return (tuple(input.shape), input.stride(), input.dtype, input.requires_grad, should_encode(input), device,
            _compact(policies), autocast)


def _compact(policies: tuple) -> tuple:
    """``policies`` as a plan's key holds them: one and a count where every layer's is
    the same object (the default's: LayerSettings.policy), which hashes once, not once
    a layer, at every training call."""
    if policies and policies.count(policies[0]) == len(policies):
        return policies[0], len(policies)
    return policies


def _own_parameters(modules):
    """The parameters in the own tables of ``modules``, each as often as a table holds it."""
    return (parameter for module in modules for parameter in own_tensors(module, "parameters").values()
            if parameter is not None)


def _module_refs(layers) -> tuple:
    return tuple(weakref.ref(m) for layer in layers for m in layer.modules())


def _meta_stand_in(x: torch.Tensor) -> torch.Tensor:
    """A meta tensor that actsave treats as it treats ``x``: same shape, strides and
    dtype; a leaf unless a codec would encode ``x`` (keep_rules.should_encode)."""
    stand_in = torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta")
    if not should_encode(x):
        return stand_in.requires_grad_(x.requires_grad)
    return stand_in.requires_grad_().clone()


def _check_simulable(model: nn.Module) -> None:
    """Raise where the meta step cannot stand for the real one."""
    held = [*model.parameters(), *model.buffers()]
    # An FSDP2-sharded parameter stands as the whole one (meta.on_meta).
    other = [type(t).__name__ for t in held if type(t) not in (torch.Tensor, nn.Parameter) and not is_sharded(t)]
    if other:
        raise ConfigError(f"parameters of type {other[0]} cannot be swapped for meta copies")


__all__ = ["BalancedPlans"]
