"""Steps that leave no trace: the planner's training steps of a model (profile(),
estimate(), the block planner's example step, a balanced plan's meta step) run inside
:func:`isolated_steps`, which puts back gradients and buffers and keeps compiled code
eager on this thread alone (NOTE [ Steps other threads do not see ])."""
from __future__ import annotations

import contextlib
import warnings

import torch
from torch import nn

from .._torch import compiled_code_eager, own_tensors, version
from .live_bytes import allocation_bytes


# NOTE [ Steps other threads do not see ]
# The planner's steps (a balanced plan's meta step at a first call, profile(),
# estimate(), the block planner's) change nothing another thread can see, so that
# threads training models of their own, each planning at its first call, get what
# each gets alone:
# 1. Module state: only the model's own modules are touched. Its parameters and
#    buffers are swapped for meta copies (meta.on_meta) and its buffers for copies of
#    them (:class:`ModuleState`), in its modules' own tables, with no hook; the max
#    pools the step watches are the chain's own (:func:`measure_memory`). No global
#    module hook: it would see every thread's module calls, and a swap made there
#    would put back another thread's buffers as they were (or leave that thread's
#    model holding meta copies).
# 2. RNG: no generator is forked. Random operators on meta tensors draw nothing (the
#    CPU generator's state is unchanged by dropout, randn, bernoulli_ and attention
#    dropout on meta tensors: tests/planning/test_threads.py), and a recompute on meta
#    tensors replays no state (runtime/replay.py, ReplayState.capture). A step on a real
#    device (profile() of a real model, the block planner's example step) draws from
#    the generators as a training step does, and advances them: restoring them after
#    (torch.random.fork_rng) would undo whatever another thread drew meanwhile, since
#    the generators are the process's. So would a layer that draws on a real device in
#    a meta step (``torch.rand([])`` on the CPU to skip a layer).
# 3. Compiled code runs eagerly on this thread only (_torch.compiled_code_eager,
#    NOTE [ Compiled code run eagerly on one thread ]).
# 4. What must be swapped process-wide is swapped so that other threads get torch's
#    own behaviour: attention while a meta step stands for a device (meta.py reads the
#    simulating thread's device) and storage resizes (NOTE [ Storage resizes ]).
# 5. Caches shared by threads (meta.OUTPUT_METADATA, a model's balanced plans) hold
#    values that depend on their keys alone, so a race costs a recomputation at most.
@contextlib.contextmanager
def isolated_steps(model: nn.Module):
    """While active, training steps of ``model`` leave no trace on it: on exit each
    parameter's gradient is put back as it was, and every buffer is untouched (the
    steps run on copies: :class:`ModuleState`, which it yields), and so is a parameter
    the forward renormalizes (``max_norm``: _ChangingParameters). Inside, every gradient
    starts allocated (zeros), as from the second training step on: each layer's new
    gradients are then transients accumulated into them, not gradient memory kept; and
    compiled code run on this thread runs eagerly, so that a step on meta tensors
    compiles nothing. Nothing another thread sees changes (NOTE [ Steps other threads
    do not see ]), so steps on a real device advance the RNG as training steps do.
    :func:`~actsave.profile` and the block planner (blocks.py) measure their steps
    inside it."""
    grads = [(p, p.grad) for p in model.parameters()]
    for p, _ in grads:
        p.grad = torch.zeros_like(p) if p.requires_grad else None
    changing = _ChangingParameters(model)
    try:
        with ModuleState(model) as state, compiled_code_eager():
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
    named in a warning."""

    def __init__(self, model: nn.Module):
        self._versions = [(name, p, version(p)) for name, p in model.named_parameters()]
        self._copies = {p: p.detach().clone() for module in model.modules()
                        if getattr(module, "max_norm", None) is not None
                        for p in own_tensors(module, "parameters").values() if p is not None}

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
                          "weights you train, or on a copy of the model.", stacklevel=4)


class ModuleState:
    """While active, every buffer of ``model`` is a copy, made as it starts, and the
    originals are put back on exit, so that steps run inside leave the model's state
    (BatchNorm's running statistics, any module's moving averages) as it was, the
    other threads' modules untouched. The copies are state like the buffers they
    stand for, not memory the steps allocate. After the steps, :meth:`mutated_bytes`
    says what a checkpointed occurrence of a layer keeps of the state its forward
    mutated (runtime/state.py, NOTE [ State a forward reads and mutates ])."""

    def __init__(self, model: nn.Module):
        self._model = model
        self._swapped = []  # (table, name, original, copy, the copy's version)

    def __enter__(self) -> "ModuleState":
        for module in self._model.modules():
            table = own_tensors(module, "buffers")
            for name, original in list(table.items()):
                if original is not None:
                    table[name] = original.clone()
                    self._swapped.append((table, name, original, table[name], version(table[name])))
        return self

    def __exit__(self, *exc) -> None:
        for table, name, original, _, _ in reversed(self._swapped):
            table[name] = original

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
