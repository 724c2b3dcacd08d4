"""Argument checks shared by the public functions: numbers as users pass them, the
callables they pass (a ``loss``, a ``filter_fn``), modules and their classes.

Integral numbers are accepted whatever their type (``int``, ``numpy.int64``, a 0-d
integer tensor: anything with ``__index__``, as Python's own indexing does), except
``bool`` (a bool tensor too), which is never meant as a count or an index.
"""
from __future__ import annotations

import inspect
import math
import numbers
import operator
from typing import Callable, Optional, Union

import torch
from torch import nn

from .errors import ConfigError


def integral(value) -> Optional[int]:
    """``value`` as an ``int`` if it is an integral number other than a bool, else None."""
    if isinstance(value, bool) or (isinstance(value, torch.Tensor) and value.dtype == torch.bool):
        return None
    try:
        return operator.index(value)
    except (TypeError, RuntimeError):  # RuntimeError: a meta tensor, which has no value
        return None


def byte_count(value) -> Union[int, float, None]:
    """``value`` as a Python ``int`` (or a ``float`` where it has a fraction) if it can
    be a budget, a real number of bytes above 0 and finite, else None. A budget is
    compared with and subtracted from sums of sizes, so it is made a Python number
    whatever type it came in: numpy's unsigned integers wrap around below zero, and a
    ``Fraction`` does not format as a size. A 0-d floating tensor is taken as its value,
    as a 0-d integer one is."""
    if isinstance(value, torch.Tensor) and value.dim() == 0 and value.dtype.is_floating_point \
            and value.device.type != "meta":  # a meta tensor has no value: refused below
        value = value.item()
    whole = integral(value)  # a 0-d integer tensor too, as wherever an integer is taken
    if not real_number(value if whole is None else whole) or not 0 < float(value) < math.inf:
        return None
    return float(value) if whole is None else whole


def real_number(value) -> bool:
    """Whether ``value`` is a real number other than a bool and NaN (``numpy`` scalars
    included) that a float holds (an ``int`` beyond 1.8e308 is refused)."""
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        return False
    try:
        return not math.isnan(float(value))
    except OverflowError:
        return False


def flag(value, name: str) -> bool:
    """``value`` if it is a bool, else a ConfigError naming the argument ``name``."""
    if not isinstance(value, bool):
        raise ConfigError(f"{name}={value!r} must be True or False")
    return value


def refuse_module_class(value, argument: str, purpose: str) -> None:
    """Refuse an ``nn.Module`` subclass given where an instance is meant: called, the
    class would build a new, untrained module. ``purpose`` says what the argument is
    for."""
    if isinstance(value, type) and issubclass(value, nn.Module):
        raise ConfigError(f"{argument}={value!r} is a type, an nn.Module class: {purpose}; pass an nn.Module "
                          f"instance ({value.__name__}(...))")


def takes_positional(function: Callable, count: int) -> bool:
    """Whether ``function`` can be called with ``count`` positional arguments (a module
    by its ``forward``); True where Python cannot tell (a builtin)."""
    try:
        signature = inspect.signature(function.forward if isinstance(function, nn.Module) else function)
    except (TypeError, ValueError):
        return True
    try:
        signature.bind(*range(count))
    except TypeError:
        return False
    return True


# What a training step's loss is, wherever one is passed (profile, estimate, plan_blocks).
LOSS_RULE = ("it must return a one-element tensor that requires grad, computed from the output (e.g. lambda out: "
             "F.cross_entropy(out, torch.zeros(out.shape[0], dtype=torch.long, device=out.device)))")


def check_loss_function(loss) -> None:
    """Refuse a ``loss`` that is not None or a function of one argument, the output
    (its value is checked where it runs: planning/instrumented_step.checked_loss)."""
    if loss is None:
        return
    if isinstance(loss, type):
        wrong = "a class"
    elif not callable(loss):
        wrong = "not callable"
    elif not takes_positional(loss, 1):
        wrong = "not callable with the output alone (a loss module such as nn.MSELoss() takes the targets too)"
    else:
        return
    raise ConfigError(f"loss={loss!r} is {wrong}: loss is a function of the model's output, and {LOSS_RULE}")


def filter_predicate(filter_fn) -> Callable:
    """``filter_fn`` of :func:`actsave.wrap` as ``matches(module, fqn) -> bool``: a
    class or tuple of classes matches their instances; a callable is called so."""
    classes = filter_fn if isinstance(filter_fn, tuple) else (filter_fn,)
    if classes and all(isinstance(c, type) and issubclass(c, nn.Module) for c in classes):
        return lambda module, fqn: isinstance(module, classes)
    if not callable(filter_fn) or isinstance(filter_fn, (type, tuple, nn.Module)):
        raise ConfigError(f"filter_fn={filter_fn!r} must be callable(module, fqn) -> bool, an nn.Module subclass "
                          "(the class, not an instance), or a non-empty tuple of nn.Module subclasses")
    if not takes_positional(filter_fn, 2):
        raise ConfigError(f"filter_fn={filter_fn!r} cannot take two arguments: it is called as filter_fn(module, "
                          "fqn), the submodule and its fully qualified name; use lambda module, fqn: ... or pass "
                          "the block class")
    return filter_fn


def nothing_selected(model: nn.Module, filter_fn, matches: Callable) -> str:
    """What to say when ``filter_fn`` selects no submodule of ``model``: where it selects
    ``model`` itself, that wrap never replaces it."""
    said = f"filter_fn={filter_fn!r} selected no submodule of the {type(model).__name__}"
    if _selects(matches, model):
        return (f"{said}, only the model itself, which wrap never replaces: to checkpoint the whole model, "
                "use actsave.Checkpoint(model)")
    return f"{said}; check the class or predicate (it is called with each submodule and its fully qualified name)"


def _selects(matches: Callable, model: nn.Module) -> bool:
    """Whether ``matches`` selects ``model`` as the root (fqn ""); a predicate written
    for submodules only may fail on it, which only means it does not."""
    try:
        return bool(matches(model, ""))
    except Exception:  # noqa: BLE001 - any failure of the user's predicate on the root
        return False
