"""Steps that leave no trace: the planner's training steps of a model (profile(),
estimate(), the block planner's example step, a balanced plan's meta step) run inside
:func:`isolated_steps`, which puts back gradients and every module's state (NOTE [
Module state a step puts back ]) and keeps compiled code eager on this thread alone
(NOTE [ Steps other threads do not see ])."""
from __future__ import annotations

import contextlib
import sys
import warnings
from collections import OrderedDict

import torch
from torch import nn

from .._torch import compiled_code_eager, own_tensors, parametrize_cache, parametrize_cache_keys, version
from ..runtime.module_attributes import put_back
from .live_bytes import allocation_bytes


# NOTE [ Steps other threads do not see ]
# The planner's steps (a balanced plan's meta step at a first call, profile(),
# estimate(), the block planner's) change nothing another thread can see, so that
# threads training models of their own, each planning at its first call, get what
# each gets alone:
# 1. Module state: only the model's own modules are touched. Its parameters and
#    buffers are swapped for meta copies (meta.on_meta) and its buffers for copies of
#    them (:class:`ModuleState`), in its modules' own tables, with no hook, and what
#    else its modules hold is put back as it was (NOTE [ Module state a step puts
#    back ]), parametrize.cached()'s entries for its modules included; the max
#    pools the step watches are the chain's own (:func:`measure_memory`). No global
#    module hook: it would see every thread's module calls, and a swap made there
#    would put back another thread's buffers as they were (or leave that thread's
#    model holding meta copies).
# 2. RNG: no generator is forked around a step. Random operators on meta tensors draw nothing (the
#    CPU generator's state is unchanged by dropout, randn, bernoulli_ and attention
#    dropout on meta tensors: tests/planning/test_threads.py), one a layer runs on a
#    real device in a meta step puts back the generators it drew from (NOTE [ A meta
#    step draws nothing ] in meta.py), and a recompute on meta tensors replays no state
#    (runtime/replay.py, ReplayState.capture). A step on a real
#    device (profile() of a real model, the block planner's example step) draws from
#    the generators as a training step does, and advances them: restoring them after
#    (torch.random.fork_rng) would undo whatever another thread drew meanwhile, since
#    the generators are the process's.
# 3. Compiled code runs eagerly on this thread only (_torch.compiled_code_eager,
#    NOTE [ Compiled code run eagerly on one thread ]).
# 4. What must be swapped process-wide is swapped so that other threads get torch's
#    own behaviour: attention while a meta step stands for a device (meta.py reads the
#    simulating thread's device) and storage resizes (NOTE [ Storage resizes ]). One
#    exception: anomaly mode's NaN check, off while any thread runs a meta step, is off
#    for the other threads' backward passes too (NOTE [ Anomaly mode in a meta step ]).
# 5. Caches shared by threads (meta.OUTPUT_METADATA, a model's balanced plans) hold
#    values that depend on their keys alone, so a race costs a recomputation at most.


# NOTE [ Module state a step puts back ]
# A planning step leaves every module of the model as it found it, by one rule for all
# that a module holds in its ``__dict__``:
# - Buffers: the steps run on copies, set in the module's own table as they start, so
#   that in-place changes (BatchNorm's running statistics) land on the copies
#   (ModuleState.mutated_bytes reads which moved).
# - Every entry is put back by reference as the steps end: one they replaced is set
#   back, one they added is removed. So a Python attribute (a length a rotary embedding
#   grows with its input, an ``initialized`` flag, a tensor cached at the first forward:
#   in a meta step, a meta one) is as it was, and so are the tables of buffers and
#   submodules: a buffer or submodule registered during the steps is gone.
# - The containers held there, of the exact types dict, OrderedDict, list and set (those
#   tables, a cache keyed by shape, a list a forward appends to), get
#   their contents back in place, shallowly, so that what refers to them still does.
# - But its hooks (every entry whose name says hook): a hook registered during the steps
#   stays, as one registered at a first forward does, and one that removed itself is
#   gone. A hook that installs another once, at the first forward, and notes that
#   outside the module would otherwise find it installed and never install it again.
# - And the table of parameters: a sharding framework swaps its entries as part of state
#   it keeps outside the module (FSDP2 leaves the root's unsharded parameters in it after
#   a forward, until its backward; put back alone, the next forward would find sharded
#   ones FSDP2 holds to be unsharded). Its entries are the parameters' copies in a meta
#   step, put back by meta.on_meta; parameters changed in place have their own rule
#   (_ChangingParameters: put back where the module renormalizes them, named in a
#   warning otherwise).
# Nothing is copied deeply: an object an attribute refers to and that the steps change
# inside (a config object; a tensor that is no buffer, changed in place) is not put back.
# The modules are the model's as the steps start; one registered during them goes with
# its parent's table.
# Outside the modules, parametrize.cached()'s cache (each parametrization computed once
# per cached block, keyed by module) is set aside for the model's parametrized tensors
# while the steps run, and the steps' own entries dropped after
# (parametrize_cache_set_aside): the real step would otherwise read a weight the meta
# step computed, or the meta step a real one.
@contextlib.contextmanager
def isolated_steps(model: nn.Module):
    """While active, training steps of ``model`` leave no trace on it: on exit each
    parameter's gradient is put back as it was, every module holds what it held (its
    buffers, Python attributes and tables, that of parameters aside: NOTE [ Module state
    a step puts back ]; the steps run on copies of the buffers: :class:`ModuleState`,
    which it yields), and a parameter the forward renormalizes is as it was
    (``max_norm``: _ChangingParameters). Inside, every gradient starts allocated
    (zeros), as from the second training step on: each layer's new gradients are then
    transients accumulated into them, not gradient memory kept; and compiled code run on
    this thread runs eagerly, so that a step on meta tensors compiles nothing. Nothing
    another thread sees changes (NOTE [ Steps other threads do not see ]), so steps on a
    real device advance the RNG as training steps do. :func:`~actsave.profile` and the
    block planner (blocks.py) measure their steps inside it."""
    grads = [(p, p.grad) for p in model.parameters()]
    for p, _ in grads:
        p.grad = torch.zeros_like(p) if p.requires_grad else None
    changing = _ChangingParameters(model)
    try:
        with ModuleState(model) as state, parametrize_cache_set_aside(model), compiled_code_eager():
            yield state
    finally:
        for p, grad in grads:
            p.grad = grad
        changing.put_back()


class _ChangingParameters:
    """The parameters a model's forward may change in place, copied as the steps start
    and put back as they end: those of a module with ``max_norm`` (nn.Embedding and
    EmbeddingBag renormalize the rows they look up). Other parameters are not copied
    (that would double the model's memory): one the steps changed all the same is
    named in a warning. Meta parameters are left out: in a meta step they are the
    parameters' copies (meta.on_meta), which the step changes and drops, and a model
    of meta tensors has no values to put back."""

    def __init__(self, model: nn.Module):
        self._versions = [(name, p, version(p)) for name, p in model.named_parameters() if not p.is_meta]
        self._copies = {p: p.detach().clone() for module in model.modules()
                        if getattr(module, "max_norm", None) is not None
                        for p in own_tensors(module, "parameters").values() if p is not None and not p.is_meta}

    def put_back(self) -> None:
        changed = [(name, p) for name, p, was in self._versions if version(p) != was]
        with torch.no_grad():
            for _, p in changed:
                if p in self._copies:
                    p.copy_(self._copies[p])
        left = [name for name, p in changed if p not in self._copies]
        if left:
            warnings.warn(f"actsave: the planner's example steps changed parameter(s) {left} in place (the "
                          "model's forward changes them), and they are not put back: plan before loading the "
                          "weights you train, or on a copy of the model.", stacklevel=user_stacklevel())


def user_stacklevel() -> int:
    """The ``stacklevel`` that points a warning at the first frame outside actsave, torch
    and contextlib (the user's call), however deep the call that warns went."""
    frame, level = sys._getframe(1), 1
    while frame.f_back is not None and frame.f_globals.get("__name__", "").split(".")[0] in _LIBRARIES:
        frame, level = frame.f_back, level + 1
    return level


_LIBRARIES = ("actsave", "torch", "contextlib")


def _is_hooks(name: str) -> bool:
    """Whether a module's ``__dict__`` entry ``name`` is its hooks' (``_forward_hooks``,
    ``_is_full_backward_hook``, ...): NOTE [ Module state a step puts back ]."""
    return "hook" in name


_CONTAINERS = (dict, OrderedDict, list, set)  # exact types: NOTE [ Module state a step puts back ]


class ModuleState:
    """While active, every buffer of ``model`` is a copy, made as it starts, and on exit
    every module of it holds what it held as it started (NOTE [ Module state a step puts
    back ]): its buffers, Python attributes and tables, that of parameters aside, so that
    steps run inside leave the model's state (BatchNorm's running statistics, any
    module's moving averages, a cache a forward fills) as it was, the other threads'
    modules untouched. The copies are state like the buffers they stand for, not memory
    the steps allocate. After the steps, :meth:`mutated_bytes` says what a checkpointed
    occurrence of a layer keeps of the state its forward mutated (runtime/state.py, NOTE
    [ State a forward reads and mutates ])."""

    def __init__(self, model: nn.Module):
        self._model = model
        self._swapped = []  # (table, name, original, copy, the copy's version)
        self._entries = []  # (a module's __dict__, a shallow copy of it as the steps start)
        self._contents = []  # (a container it holds, a shallow copy of it as the steps start)
        self._empty = []  # the containers it holds that are empty as the steps start (most hook tables)

    def __enter__(self) -> "ModuleState":
        for module in self._model.modules():
            entries = vars(module)
            self._entries.append((entries, {n: v for n, v in entries.items() if not _is_hooks(n)}))
            parameters = own_tensors(module, "parameters")
            for name, value in entries.items():
                if type(value) in _CONTAINERS and value is not parameters and not _is_hooks(name):
                    if value:
                        self._contents.append((value, _shallow_copy(value)))
                    else:
                        self._empty.append(value)
            table = own_tensors(module, "buffers")
            for name, original in list(table.items()):
                if original is not None:
                    table[name] = original.clone()
                    self._swapped.append((table, name, original, table[name], version(table[name])))
        return self

    def __exit__(self, *exc) -> None:
        for container in self._empty:
            if container:
                container.clear()
        for container, contents in self._contents:
            _refill(container, contents)
        for entries, saved in self._entries:
            put_back(entries, saved, kept=_is_hooks)

    def mutated_bytes(self, layer: nn.Module, device) -> int:
        """The bytes of a snapshot of the buffers that ``layer``'s forward mutated in
        the steps run so far: every buffer of each module under it whose buffers moved
        (changed in place or replaced), as the runtime snapshots them, each an
        allocation of its own on ``device``."""
        moved = {id(table) for table, name, _, copy, was in self._swapped
                 if table.get(name) is not copy or version(copy) != was}
        total = 0
        for module in layer.modules():
            table = own_tensors(module, "buffers")
            if id(table) in moved:
                total += sum(allocation_bytes(b.numel() * b.element_size(), device)
                             for b in table.values() if b is not None)
        return total


def _shallow_copy(container):
    """What :func:`_refill` puts back into ``container``: its items (a list, a set, a
    dict of its entries in order)."""
    kind = type(container)
    return list(container) if kind is list else set(container) if kind is set else dict(container)


def _refill(container, contents) -> None:
    if isinstance(container, list):
        container[:] = contents
    else:
        container.clear()
        container.update(contents)


@contextlib.contextmanager
def parametrize_cache_set_aside(model: nn.Module):
    """While active, parametrize.cached()'s cache holds no entry that ``model``'s
    parametrized tensors read but those the steps make, and on exit those are dropped
    and the ones it held put back (NOTE [ Module state a step puts back ]). An entry is
    keyed by the module its parametrization was registered on, which a deep copy shares
    (_torch.parametrize_cache_keys). Other entries, another thread's own, stay as they
    are. The cache is a private global of torch.nn.utils.parametrize; where it is not a
    dict, nothing is set aside. Outside cached() it stays empty, and nothing is read."""
    cache = parametrize_cache()
    if cache is None:
        yield
        return
    keys = set().union(*(parametrize_cache_keys(m) for m in model.modules()))
    aside = {key: cache.pop(key) for key in keys if key in cache}
    try:
        yield
    finally:
        now = parametrize_cache()  # cached() makes a new one as its last block ends
        if now is not None:
            for key in keys:
                now.pop(key, None)
        if now is cache:
            cache.update(aside)
