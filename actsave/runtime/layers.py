"""Which modules a checkpointed function runs, where actsave can tell without watching
every module call.

NOTE [ Known layers ]
A checkpointed forward must note the parameters and buffers it reads, and which it
mutates (state.py), and a lossy one the plain max pools it runs (pool_decisions.py).
Global module hooks see every module call, but any global hook sends every module
call of every thread down the slow path of ``nn.Module._call_impl``, which costs more
host time than a small layer's own work (docs/performance.md); actsave's act on their
own thread's calls only (state.py, pool_decisions.py). So where the function
says which modules it runs, actsave reads them from the modules instead, once per
forward, and hooks nothing:

- a :class:`LayerChain` (a CheckpointedSequential segment, a nested segment): its
  ``layers``;
- a plain ``nn.Sequential``: its children;
- any other ``nn.Module`` (``Checkpoint``, ``wrap``), or its ``forward`` called bound:
  the module itself;
- a ``functools.partial`` of one of these: as that one, where it binds only tensors,
  plain values and torch's functions (a module bound as an argument, or an object or
  function that may hold one, is outside the tree: watched by hooks, it stays exact).

Their *layers* are the top-level modules; the modules the function runs are taken to
be every submodule of them (``Module.modules()``), whether or not a given forward
calls it. A module the function reaches otherwise (held outside its tree, in a
plain list or a global) is not seen: checkpoint such a function as a plain callable.
A module's bound ``forward`` (``checkpoint(block.forward, x)``, ``checkpoint(super().forward,
x)`` inside a subclass's forward) is the module because it runs the module without
calling it: no hook would see the module's own state read or changed (an EMA buffer
updated in ``forward``). It is told by its name and by the function (_is_a_forward_of):
an instance's own ``forward`` set with another name, or a class's ``forward = _run``,
is the module's forward too, and hooks would never see the module. Any other callable (a lambda, a function closing over modules,
another method of a module) has no known layers, and global hooks watch the modules it
runs: a method such as ``checkpoint(self._attend, q, k)`` may read a part of its
module's state that the code after it changes, which a check of the whole module's
would refuse.
"""
from __future__ import annotations

import contextlib
import enum
import functools
import numbers
import types
from typing import Optional

import torch
from torch import nn
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

from .._torch import children_of, pytree


class LayerChain:
    """A function that runs ``layers`` one after another, each on the output of the
    one before: what a CheckpointedSequential segment and a nested segment recompute.
    Subclasses declare their layers (NOTE [ Known layers ])."""

    layers: list

    def __call__(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


class LayerRun(LayerChain):
    """Calls a run of layers in order: the function a CheckpointedSequential's segment
    runs and recomputes, named by its layers' types (in errors)."""

    def __init__(self, layers: list):
        self.layers = layers
        self.__qualname__ = "segment(" + ", ".join(type(m).__name__ for m in layers) + ")"


# The child a checkpoint wrapper holds its module as (Checkpoint's, as torch's own
# checkpoint_wrapper names it): torch.distributed.checkpoint's state-dict helpers, and
# Checkpoint's state_dict, leave it out of fully qualified names.
WRAPPED_CHILD = "_checkpoint_wrapped_module"


# What a functools.partial may bind and keep its function's layers: values that hold no
# module (NOTE [ Known layers ]); and torch's own functions (F.gelu, F.silu), told by
# _holds_no_module.
PLAIN_VALUES = (torch.Tensor, numbers.Number, str, bytes, type(None), slice, type(Ellipsis), torch.dtype,
                torch.device, torch.layout, torch.memory_format, torch.Generator)


def _holds_no_module(value) -> bool:
    """Whether ``value`` can reach no module: a plain value, an enum member of one, a
    builtin function of a Python module (not a bound method: ``[bn].__getitem__``), or a
    function of torch's own that wraps nothing and closes over nothing (a decorated
    module, ``torch.no_grad()(bn)``, takes its ``__module__`` from the module's class)."""
    if isinstance(value, PLAIN_VALUES):
        return True
    if isinstance(value, enum.Enum):
        return _holds_no_module(value.value)
    if isinstance(value, types.BuiltinFunctionType):
        return value.__self__ is None or isinstance(value.__self__, types.ModuleType)
    return (isinstance(value, types.FunctionType) and value.__module__.split(".")[0] == "torch"
            and value.__closure__ is None and not hasattr(value, "__wrapped__"))


def known_layers(function) -> Optional[tuple]:
    """The top-level modules ``function`` runs, or None where actsave cannot tell
    (NOTE [ Known layers ])."""
    if isinstance(function, LayerChain):
        return tuple(function.layers)
    if type(function) is nn.Sequential:  # a subclass's forward may run its children otherwise
        return tuple(function)
    if isinstance(function, nn.Module):
        return (function,)
    if isinstance(function, functools.partial):
        bound = pytree.tree_leaves((function.args, function.keywords))
        return known_layers(function.func) if all(map(_holds_no_module, bound)) else None
    owner = getattr(function, "__self__", None)
    if isinstance(owner, nn.Module) and _is_a_forward_of(owner, getattr(function, "__func__", None)):
        return (owner,)
    return None


def _is_a_forward_of(owner: nn.Module, func) -> bool:
    """Whether ``func`` is a forward of ``owner``: one named ``forward`` (another class's
    bound to it too), or the one set on the instance (``block.forward = MethodType(f,
    block)``) or a class's ``forward`` (an alias ``forward = _run``), whatever their
    names (NOTE [ Known layers ])."""
    if func is None:
        return False
    if getattr(func, "__name__", None) == "forward":
        return True
    own = vars(owner).get("forward")
    if own is not None and getattr(own, "__func__", own) is func:
        return True
    return any(vars(klass).get("forward") is func for klass in type(owner).__mro__)


def modules_under(layers: tuple, first_only: bool = True) -> list:
    """``[(layer index, module)]`` of every module under ``layers``, each once (a
    module shared by two layers belongs to the first; ``first_only=False``: once per
    layer it is under), in ``Module.modules()``'s order. Walked here rather than by
    ``modules()``, which builds every module's name: this runs at every checkpointed
    forward."""
    seen, found = set(), []
    for index, layer in enumerate(layers):
        stack = [layer]
        if not first_only:
            seen = set()
        while stack:
            module = stack.pop()
            if id(module) in seen:
                continue
            seen.add(id(module))
            found.append((index, module))
            stack.extend(child for child in reversed(children_of(module)) if child is not None)
    return found


def repeated_modules(layers) -> list:
    """The modules that are, or are under, more than one of ``layers`` (a block placed
    twice in a chain, a layer shared by two blocks), each once, in the order found."""
    owner, repeated = {}, {}
    for index, module in modules_under(tuple(layers), first_only=False):
        if owner.setdefault(id(module), index) != index:
            repeated[id(module)] = module
    return list(repeated.values())


def modules_among(modules: Optional[list], kind) -> Optional[list]:
    """The modules of ``modules`` (``(layer index, module)`` pairs, as modules_under gives
    them) for which ``kind(module)`` holds, for :func:`module_hooks`; None (every module)
    where ``modules`` is None, the function's layers not being known."""
    return None if modules is None else [module for _, module in modules if kind(module)]


@contextlib.contextmanager
def module_hooks(modules: Optional[list], before, after):
    """``before`` and ``after`` as forward pre- and post-hooks, for the body, on each of
    ``modules`` (first among their hooks), or where they are None (a function whose
    layers are not known: NOTE [ Known layers ]) on every module call."""
    if modules is None:
        handles = [register_module_forward_pre_hook(before), register_module_forward_hook(after)]
    else:
        handles = [hook for module in modules for hook in (module.register_forward_pre_hook(before, prepend=True),
                                                          module.register_forward_hook(after, prepend=True))]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


__all__ = ["WRAPPED_CHILD", "LayerChain", "LayerRun", "known_layers", "modules_under", "repeated_modules",
           "modules_among", "module_hooks"]
