"""Buffers a call swapped in for the forward (``torch.func.functional_call``), found
again in the recompute, where the call swaps them in again.

NOTE [ Buffers swapped in for a call ]
``functional_call(model, (params, buffers), args)`` puts the caller's tensors in the
modules' slots for the call and the modules' own back as it returns. Inside a
checkpointed function, the forward's module calls find the caller's buffers, and
BatchNorm updates them (an EMA reads one, then updates it); the snapshot holds their
values as the forward found them, keyed by module and name, as for every buffer (NOTE
[ State a forward reads and mutates ] in state.py). The recompute installs the snapshot
in those slots before it runs the function, but the function's ``functional_call``
swaps the caller's tensors in over it: the recompute would read the values the forward
left and update them a second time (torch.utils.checkpoint does both). So where a
mutated buffer's slot held, in the forward, a tensor that it no longer holds when the
forward ends, the recompute watches its thread's module calls, and where a slot holds
that tensor again, or the one the forward left there (a module that sets a new
tensor in its slot: ``functional_call`` given one dict, not a pair, writes each slot's
tensor back into it as it returns, so the recompute swaps in what the forward left), it
puts the snapshot's stand-in there for the module call, and what it found back as the
call returns, whatever the call set there: the caller's dict keeps the forward's tensors.
The modules whose buffers a call updates unversioned are never called themselves (NOTE
[ Buffers a kernel updates unversioned ]): their buffers are noted and given their
stand-ins with the calling module's. Updated by the forward, the tensors swapped in
are mutated state, not state read (a second checkpointed call before the backward
updates them again). Where every slot holds the same tensor at both ends (a forward
that swaps nothing), nothing is watched.

Only where the forward watches module calls (a function of unknown layers: state.py's
_HookedState). A module whose own forward calls ``functional_call`` under ``Checkpoint``
or in a chain is read before and after the forward, which do not see the swap
(docs/limits.md, "Parameters replaced before backward").
"""
from __future__ import annotations

import contextlib
import threading
import weakref

from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

from .._torch import own_tensors
from .unversioned_buffers import unversioned_updates


class SwappedBuffers:
    """The buffers of NOTE [ Buffers swapped in for a call ]: noted in the forward,
    given their stand-ins in the recompute."""

    def __init__(self):
        self._found = {}  # (module, name) -> the tensor in the slot as the first call that moved it started
        self._left = {}  # (module, name) -> the tensor in the slot as the last call that moved it ended
        self._swapped = {}  # (module, name) -> weak references to both, where the forward ended with another

    def moved(self, module, held: dict) -> None:
        """Note the buffers of a call of ``module`` that moved its state, as the call
        found them (``held``: ``(kind, name) -> (tensor, version)``) and left them (a
        module may set a new tensor in place of one)."""
        slots = own_tensors(module, "buffers")
        for (kind, name), (tensor, _) in held.items():
            if kind == "buffers":
                self._found.setdefault((module, name), tensor)
                self._left[(module, name)] = slots.get(name)

    def found(self) -> list:
        """The tensors noted so far in this forward: those the calls that moved their
        state found in the slots (the caller's, where swapped in)."""
        return list(self._found.values())

    def forward_ended(self) -> None:
        """Keep the buffers whose slots hold other tensors now: those swapped in."""
        self._swapped = {key: (weakref.ref(tensor), _reference(self._left.get(key)))
                         for key, tensor in self._found.items()
                         if own_tensors(key[0], "buffers").get(key[1]) is not tensor}
        self._found, self._left = {}, {}

    def stand_ins_installed(self, keys: list, values: list, thread: int):
        """A context in which a module call on ``thread`` that finds a swapped-in tensor
        in its slot finds the stand-in ``values`` holds for its ``(module, name)`` in
        ``keys`` there instead; nothing where the forward swapped nothing in."""
        if not self._swapped:
            return contextlib.nullcontext()
        stand_ins, by_module = dict(zip(keys, values)), {}
        for (module, name), swapped in self._swapped.items():
            if (module, name) in stand_ins:
                by_module.setdefault(module, []).append((name, swapped, stand_ins[(module, name)]))
        return _installing(by_module, thread) if by_module else contextlib.nullcontext()


def _reference(tensor):
    """A weak reference to ``tensor``, or a call giving None for none."""
    return (lambda: None) if tensor is None else weakref.ref(tensor)


@contextlib.contextmanager
def _installing(by_module: dict, thread: int):
    """Stand-ins in the slots of a module's swapped-in buffers for each of its calls on
    ``thread`` (with those of the modules whose buffers the call updates unversioned:
    NOTE [ Buffers a kernel updates unversioned ]), and the swapped-in tensors back as
    the call returns: ``functional_call`` given one dict writes each slot's tensor back
    into it as it returns, which must be the caller's, not a copy of actsave's."""
    calls = []  # per module call running: [(slots, name, the tensor it found there)] it replaced

    def before(module, args):
        if threading.get_ident() != thread:
            return
        installed = []
        for owner in unversioned_updates(module) or (module,):
            table = own_tensors(owner, "buffers")
            for name, (found, left), stand_in in by_module.get(owner, ()):
                tensor = table.get(name)
                if tensor is not None and (tensor is found() or tensor is left()):
                    table[name] = stand_in
                    installed.append((table, name, tensor))
        calls.append((module, installed))

    def after(module, args, output):
        if threading.get_ident() != thread:
            return
        while calls:  # a call that raised before its module's own hook ran left its entry
            called, installed = calls.pop()
            if called is module:
                for table, name, tensor in installed:  # whatever the call set there (a new tensor)
                    table[name] = tensor
                return

    pre = register_module_forward_pre_hook(before)
    post = register_module_forward_hook(after, always_call=True)
    try:
        yield
    finally:
        pre.remove()
        post.remove()
