"""Module state a recompute must see exactly as the forward saw it (the process's RNG,
autocast and default device are replay.py's).

The buffers the forward mutated in place (BatchNorm's running statistics,
InstanceNorm's, spectral norm's power-iteration vectors, observers' and
``FakeQuantize``'s moving averages, a user's EMA buffer) are mutated once, not again by
the recompute (torch.utils.checkpoint updates them twice), and the recompute reads them
as the forward read them (torch.utils.checkpoint reads the updated values); the
parameters and buffers the forward read without mutating them must not change before
the recompute. See :class:`TouchedState`.
"""
from __future__ import annotations

import contextlib
import threading
import weakref
from typing import Optional

import torch
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

from .._torch import leaf_base, own_tensors, version
from ..errors import RecomputeError
from .buffer_copies import (HookedSharing, Snapshot, copies_keeping_shared_memory, distinct_storage_bytes, own_state,
                            snapshot_of, with_modules_sharing_memory)
from .guarded_parameters import ForwardParameters, GuardedParameters
from .module_attributes import ModuleAttributes, set_modes
from .stale_buffers import StaleReads, changed_buffer, count_buffers, unreplayable
from .swapped_buffers import SwappedBuffers
from .unversioned_buffers import unversioned_updates


# The swaps of a state that notes none: read, never changed.
_NO_SWAPS = SwappedBuffers()


class TouchedState:
    """The parameters and buffers one checkpointed forward touched.

    NOTE [ State a forward reads and mutates ]
    While the forward runs, actsave notes each parameter and buffer of the modules it
    runs, and which of them the forward changed in place; the segment's saved leaves
    (parameters used outside any module, ``weight.t()``) are noted by the pack hook.
    Where the function's layers are known (layers.py, NOTE [ Known layers ]) the
    modules under them are read before and after the forward, with no hook; for any
    other function, global module hooks (of this thread only) watch every module call
    (:class:`_HookedState`). Then:

    - A recompute must see every buffer as the forward saw it, and must not move it
      again: BatchNorm's running statistics, InstanceNorm's, spectral norm's power
      iteration vectors, an observer's or ``FakeQuantize``'s moving averages, a user's
      EMA buffer. A module may read a buffer and then update it (an EMA subtracted,
      a quantization scale taken from the observer it just updated), so the values the
      forward read are gone when the forward ends. So the buffers of the modules a
      forward runs are copied as it starts (one foreach copy per dtype, not a clone per
      buffer), and the copies of those it mutated are kept (a *snapshot*, held from the
      forward to the recompute, as a kept input is); the rest are dropped as it ends.
      The recompute runs on the snapshot in place of the buffers, so it reads the
      values the forward read and its own updates go to the snapshot, and the buffers
      are put back as it ends: updated once, by the forward. A module that runs twice
      in one forward (a block placed twice in a chain) reads in the recompute what it
      read each time in the forward, since both runs move the same snapshot in order.
      (A change Python state keeps the recompute from making again, a flag set by a
      first-batch initialization: NOTE [ Buffers read after the forward changed them ].)
      A recompute that is not the last one (a backward inside the forward, the passes
      of a nested recompute: nested.py) runs on copies of the snapshot, which it leaves
      as it was for the next. The memory model counts one snapshot of each mutated
      buffer per checkpointed segment (planning/memory_model.py, "M").
    - A module whose tensors moved has all of its buffers snapshotted, not the moved
      ones only: BatchNorm's kernel updates its running statistics without moving their
      versions (only ``num_batches_tracked`` moves). Buffers only: a parameter is the
      caller's to change (and a copy of one would take its gradient); one the forward
      changes is checked instead (NOTE [ Parameters a forward changes ]). One rule for
      every module, BatchNorm included; the few whose kernels move no version at all
      are named by type (NOTE [ Buffers a kernel updates unversioned ]).
    - Everything else noted must be unchanged when the recompute starts: a weight
      changed in place between forward and backward (a GAN's optimizer step before
      the other network's backward, an EMA of weights) would be recomputed with its
      new values and give silently wrong gradients, where plain autograd raises. So
      does actsave, with autograd's words. Mutated state is not checked: a second
      forward before this backward (two views of a batch) legitimately moves
      BatchNorm's statistics again, and the recompute reads the snapshot anyway.

    Tensors noted are held by weak reference: noting them keeps nothing alive. The
    snapshot is held strongly, until the last recompute has run (:meth:`release`).
    """

    # NOTE [ Buffers swapped in for a call ]: noted where module calls are watched
    # (_HookedState); no other state notes any.
    _swapped = _NO_SWAPS

    def __init__(self, generators: bool = True):
        self._thread = threading.get_ident()
        self._read = {}  # id -> (weakref, label for _describe): saved leaves (and watched state)
        self._checked = []  # (weakref, version, label) taken at end_forward
        # The module state read, in lists rather than a tuple per tensor (NOTE [ Objects a
        # step leaves to the garbage collector ]): weak references, versions, and what
        # names each in an error (its module, "parameters" or "buffers", its name).
        self._state = ([], [], [], [], [])
        self._snapshot = Snapshot()  # (module, buffer name) -> the buffer's value as the forward started
        self._unreplayable = None  # (module, buffer name) the forward registered or removed: not replayed
        self._moved_parameters = []  # (layer index or None, module, name): parameters the forward changed
        self._modes = {}  # module -> its training flag as the forward ran it (NOTE [ Train and eval in a recompute ])
        self._parameters = ForwardParameters()  # NOTE [ Parameters a recompute reads ]
        self._state_ids = set()  # ids of the module state noted as the forward started (known layers)
        self.reads = StaleReads()  # NOTE [ Buffers read after the forward changed them ]
        # NOTE [ Python attributes a forward sets ]; ``generators``: replay the ones modules hold.
        self.attributes = ModuleAttributes(generators)

    @staticmethod
    def of(layers: Optional[tuple], modules: Optional[list], snapshot: Optional[dict] = None,
           generators: bool = True) -> "TouchedState":
        """The noting that fits a function whose known ``layers`` and the ``modules``
        under them (layers.modules_under) are given, or None (NOTE [ Known layers ]).
        ``snapshot``: the buffers of those modules as the forward will start, taken by
        the caller (chain.ChainState), else taken as it starts. ``generators``: whether
        the recompute replays the generators the modules hold (preserve_rng_state)."""
        if layers is None:
            return _HookedState(generators)
        return _LayerState(layers, modules, snapshot, generators)

    def recording(self):
        """Note what the modules run in the body read and mutate, and snapshot their
        buffers as the body starts."""
        raise NotImplementedError

    def note_saved(self, tensor: torch.Tensor, saves: list) -> None:
        """Note a leaf (or a view of one) that the forward saved for backward, after ``saves``."""
        base = leaf_base(tensor)
        if base is not None and not base.requires_grad:
            self.reads.saved(len(saves), base)
        # Traced with fake tensors, real saves follow.
        if base is not None and id(base) not in self._state_ids and not torch.compiler.is_compiling():
            self._note(base, ("a tensor of shape", list(base.shape)))
            self._parameters.note(base)  # NOTE [ Parameters a recompute reads ]

    def end_forward(self) -> None:
        """Take the versions the recompute must find; keep the snapshot of mutated
        buffers only."""
        raise NotImplementedError

    @property
    def snapshot_bytes(self) -> int:
        """The bytes of the snapshot held for the recompute (after the forward)."""
        if not self._snapshot.shares_memory:
            return sum(t.numel() * t.element_size() for t in self._snapshot.values())
        return distinct_storage_bytes(self._snapshot.values())

    def check_unchanged(self, function_name: str) -> None:
        """Raise, as autograd would, if a tensor the forward read changed in place; and
        if the forward registered or removed a buffer, which the snapshot cannot give
        back as it was."""
        if self._unreplayable is not None:
            raise unreplayable(*self._unreplayable, function_name)
        refs, versions, owners, kinds, names = self._state
        state = ((ref, at, (kind[:-1], name, type(owner)))
                 for ref, at, owner, kind, name in zip(refs, versions, owners, kinds, names))
        for ref, expected, label in (*self._checked, *state):
            tensor = ref()
            if tensor is not None and version(tensor) != expected:
                raise RecomputeError(
                    "one of the variables needed for gradient computation has been "
                    f"modified by an inplace operation: {_describe(label)} is at version "
                    f"{version(tensor)}; expected version {expected} instead. "
                    f"{_when_read(label, function_name)} Change it after the backward (an "
                    "optimizer step, an EMA of weights), or change a copy."
                )

    @contextlib.contextmanager
    def as_in_forward(self, last: bool, layers: Optional[range] = None):
        """While active, the buffers the forward mutated (of the known layers whose
        indices are in ``layers``; all of them by default) hold the values the forward
        started from: the snapshot itself where this is the ``last`` recompute of those
        layers (its updates go to the snapshot, which it then lets go of), else a copy
        of it (one foreach copy per dtype). The buffers are put back as it ends, and a
        parameter the forward changed must be as the forward left it (NOTE [ Parameters
        a forward changes ]). NOTE [ State a forward reads and mutates ]"""
        keys, present = [], []
        last = self.reads.entering(last)  # NOTE [ Buffers read after the forward changed them ]
        stand_ins = self.reads.stand_ins(self._snapshot)
        for module, name in self._mutated_buffers(layers):
            table = own_tensors(module, "buffers")
            if table.get(name) is not None and (module, name) in stand_ins:
                keys.append((module, name))
                present.append((table, name, table[name], stand_ins[(module, name)]))
        values = [snapshot for *_, snapshot in present]
        if not last:
            values, _ = copies_keeping_shared_memory(values)
        for (table, name, _, _), value in zip(present, values):
            table[name] = value
        self.reads.installed(values)
        guarded = GuardedParameters(self._moved_parameters, layers)
        callers = [(module, module.training) for module in self._modes]  # NOTE [ Train and eval in a recompute ]
        set_modes(self._modes.items())
        try:
            try:
                with self._parameters.flags_as_in_forward(), self.attributes.as_in_forward(layers), \
                        self._swapped.stand_ins_installed(keys, values, self._thread):
                    yield
            except RecomputeStop:  # stopped early, as it should: its state is checked as at the end
                guarded.check()
                raise
            guarded.check()
        finally:
            set_modes(callers)
            for table, name, original, _ in present:
                table[name] = original
            if last:
                for key in self._mutated_buffers(layers):
                    self._snapshot.pop(key, None)

    def release(self) -> None:
        """Drop the snapshot and the forward's parameters: no recompute will read them."""
        self._snapshot, self._parameters, self.reads = Snapshot(), ForwardParameters(), StaleReads()
        self.attributes = ModuleAttributes()
        self._swapped = _NO_SWAPS

    def _mutated_buffers(self, layers: Optional[range]) -> list:
        """``[(module, buffer name)]``, each once, that the forward mutated (so far,
        while it runs: a backward inside the forward recomputes too)."""
        raise NotImplementedError

    def _keep_snapshot_of(self, buffers) -> None:
        """Keep the snapshot of ``buffers`` (``(module, name)`` pairs) only."""
        kept = set(buffers)
        self._snapshot = self._snapshot.only(kept)

    def _note(self, tensor: torch.Tensor, label: tuple) -> None:
        # The label is formatted only for an error: this runs for every saved leaf.
        noted = self._read.get(id(tensor))
        if noted is None or noted[0]() is not tensor:  # ids of dead tensors are reused
            self._read[id(tensor)] = (weakref.ref(tensor), label)

    def _take_versions(self, mutated_ids: set, state: list = ()) -> None:
        """What check_unchanged compares: the versions now of every noted tensor
        (``self._read``'s, and those of the module state ``state`` holds, _LayerState's
        entries) not in ``mutated_ids``."""
        checked = []
        for ref, label in self._read.values():
            tensor = ref()
            if tensor is not None and id(tensor) not in mutated_ids:
                checked.append((ref, version(tensor), label))
        self._checked, self._read = checked, {}
        self._state = refs, versions, owners, kinds, names = [], [], [], [], []
        for _, module, kind, name, tensor, _ in state:
            if id(tensor) not in mutated_ids:
                refs.append(weakref.ref(tensor))
                versions.append(version(tensor))
                owners.append(module)
                kinds.append(kind)
                names.append(name)


class RecomputeStop(Exception):
    """Raised inside a recompute to end it early (runtime/function.py): the module state
    is checked as where it runs to the function's end (TouchedState.as_in_forward)."""


class _LayerState(TouchedState):
    """The state under known layers, read before and after the forward (NOTE [ State a
    forward reads and mutates ], NOTE [ Known layers ])."""

    def __init__(self, layers: tuple, modules: list, snapshot: Optional[dict] = None, generators: bool = True):
        super().__init__(generators)
        self._layers = layers
        self._modules = modules
        self._given = snapshot
        self._before = []  # (layer index, module, kind, name, tensor, version) as the forward starts
        self._buffer_counts = []  # (module, its buffers that are set) as the forward starts
        self._mutated = {}  # layer index -> [(module, name)]: buffers the forward mutated
        self._unversioned = []  # (layer index, module): NOTE [ Buffers a kernel updates unversioned ]

    @contextlib.contextmanager
    def recording(self):
        before, owners = [], []
        unversioned = []
        for index, module in self._modules:
            for kind, name, tensor in own_state(module):
                before.append((index, module, kind, name, tensor, version(tensor)))
            if own_tensors(module, "buffers"):
                owners.append(module)
            if unversioned_updates(module):
                unversioned.append((index, module))
        self._unversioned = unversioned
        self._before = before
        self._state_ids = {id(entry[4]) for entry in before}
        given = self._given if self._given is not None and self._given.as_copied(before) else None
        self._snapshot, self._given = (snapshot_of(owners) if given is None else given), None
        self.reads.started_from(before)
        self.attributes.started(self._modules)
        self._buffer_counts = [(module, count_buffers(module)) for _, module in self._modules]
        yield

    def end_forward(self) -> None:
        self._modes = {module: module.training for _, module in self._modules}  # as the forward left them
        moved, self._moved_parameters, replaced = self._changes()
        if self._snapshot.shares_memory:  # NOTE [ Buffers that share memory ]
            moved = with_modules_sharing_memory(moved, self._before)
        mutated = self._mutated_by_layer(moved)
        mutated_ids = {id(own_tensors(module, "buffers")[name]) for buffers in mutated.values()
                       for module, name in buffers}
        held = [entry for entry in self._before if own_tensors(entry[1], entry[2]).get(entry[3]) is entry[4]]
        self._parameters.note_all(entry[4] for entry in held if entry[2] == "parameters")
        self._take_versions(mutated_ids, held)
        self._mutated = mutated
        self._keep_snapshot_of(buffer for buffers in mutated.values() for buffer in buffers)
        self._unreplayable = next((changed_buffer(module, self._before)
                                   for module, count in self._buffer_counts if count_buffers(module) != count), None)
        self.reads.forward_ended(replaced)
        self.attributes.ended({entry[1] for entry in self._before if entry[2] == "buffers"})
        self._before, self._state_ids, self._buffer_counts = [], set(), []

    def _changes(self) -> tuple:
        """``({module: the first layer index it is under}, [(layer index, module,
        parameter name)], {id: ((module, name), buffer)})``: the modules whose state moved
        since the forward started (a tensor changed in place, or replaced), the parameters
        changed in place (one replaced is not the forward's change of it: FSDP2 puts
        gathered ones in place), and the buffers set in place of others (StaleReads)."""
        moved, parameters, replaced = {}, [], {}
        for index, module, kind, name, tensor, was in self._before:
            now = own_tensors(module, kind).get(name)
            in_place = now is tensor and version(now) != was
            if now is not tensor or in_place:
                moved.setdefault(module, index)
                if kind == "parameters" and in_place:
                    parameters.append((index, module, name))
                elif kind == "buffers" and now is not None and not in_place:
                    replaced[id(now)] = ((module, name), now)
        for index, module in self._unversioned:  # NOTE [ Buffers a kernel updates unversioned ]
            for updated in unversioned_updates(module):
                moved.setdefault(updated, index)
        return moved, parameters, replaced

    @staticmethod
    def _mutated_by_layer(moved: dict) -> dict:
        """``{layer index: [(module, buffer name)]}``: every buffer of a moved module
        (NOTE [ State a forward reads and mutates ])."""
        mutated = {}
        for module, index in moved.items():
            for name, buffer in own_tensors(module, "buffers").items():
                if buffer is not None:
                    mutated.setdefault(index, []).append((module, name))
        return mutated

    def _mutated_buffers(self, layers: Optional[range]) -> list:
        return [buffer for index, buffers in self._mutated_now().items() if layers is None or index in layers
                for buffer in buffers]

    def _mutated_now(self) -> dict:
        return self._mutated if not self._before else self._mutated_by_layer(self._changes()[0])


class _HookedState(TouchedState):
    """The state a function of unknown layers touches, watched by global module hooks
    on this thread while its forward runs (NOTE [ Known layers ]). A module's buffers
    are snapshotted as its first call in the forward starts, and the snapshot dropped
    as a call that moved nothing ends, unless an earlier call moved them."""

    def __init__(self, generators: bool = True):
        super().__init__(generators)
        self._swapped = SwappedBuffers()
        self._mutated = {}  # (module, kind, name) -> None: state changed by its module
        self._moved_modules = set()  # ids of the modules whose calls moved their state
        self._calls = []  # (module, {(kind, name): (tensor, version)}) of module calls running
        self._sharing = HookedSharing()  # NOTE [ Buffers that share memory ]

    @contextlib.contextmanager
    def recording(self):
        pre = register_module_forward_pre_hook(self._before_module)
        post = register_module_forward_hook(self._after_module)
        try:
            yield
        finally:
            pre.remove()
            post.remove()

    def end_forward(self) -> None:
        for module, kind, name in list(self._mutated):  # with every buffer sharing their memory
            for key in self._sharing.sharers(module, name):
                self._mutated[(key[0], "buffers", key[1])] = None
        mutated = {id(own_tensors(module, kind)[name]) for module, kind, name in self._mutated
                   if own_tensors(module, kind).get(name) is not None}
        mutated |= {id(tensor) for tensor in self._swapped.found()}  # mutated where swapped in, not read
        self._take_versions(mutated)
        self._keep_snapshot_of((module, name) for module, _, name in self._mutated)
        self._calls, self._sharing = [], HookedSharing()
        self.reads.forward_ended()
        self._swapped.forward_ended()
        self.attributes.ended({module for module in self._modes if own_tensors(module, "buffers")})

    def _mutated_buffers(self, layers: Optional[range]) -> list:
        return [(module, name) for module, _, name in self._mutated]

    def _snapshotted(self, module) -> bool:
        """Whether ``module``'s buffers are in the snapshot (a call of it is running, or
        moved them); True for a module without buffers: nothing to take."""
        return all((module, name) in self._snapshot for name, buffer in own_tensors(module, "buffers").items()
                   if buffer is not None)

    def _take_snapshot(self, modules) -> None:
        """Copy the buffers of ``modules`` into the snapshot, together, joining copies
        taken before that share their memory, and taking back, on these copies, those
        dropped before of buffers that share it (NOTE [ Buffers that share memory ])."""
        taken = snapshot_of(modules, self._sharing.copied)
        self._snapshot.update(taken)
        self._snapshot.shares_memory |= taken.shares_memory
        self._sharing.taken(taken, self._snapshot)
        self.reads.started(modules)

    def _before_module(self, module, args) -> None:
        if threading.get_ident() != self._thread:
            return
        held = {}
        for kind, name, tensor in own_state(module):
            held[(kind, name)] = (tensor, version(tensor))
            self._note(tensor, (kind[:-1], name, type(module)))
            if kind == "parameters":
                self._parameters.note(tensor)
        if id(module) not in self._moved_modules:
            # With the modules whose buffers it updates unversioned (NOTE [ Buffers a kernel
            # updates unversioned ]), never called themselves.
            taken = [m for m in unversioned_updates(module) or (module,) if not self._snapshotted(m)]
            if taken:
                self._take_snapshot(taken)
        if module not in self._modes:  # its first call
            self._modes[module] = module.training
            self.attributes.add(module)
        self._calls.append((module, held))

    def _after_module(self, module, args, output) -> None:
        if threading.get_ident() != self._thread:
            return
        while self._calls:  # a module that raised left its entry behind
            called, held = self._calls.pop()
            if called is module:
                break
        else:
            return
        updated = unversioned_updates(module)
        if self._moved(module, held) or updated:
            # All of the module's buffers: NOTE [ State a forward reads and mutates ].
            self._swapped.moved(module, held)
            for other in updated[1:]:  # never called: their slots as the call found them, updated in place
                self._swapped.moved(other, {("buffers", name): (tensor, None)
                                            for name, tensor in own_tensors(other, "buffers").items()})
            for moved in updated or (module,):
                self._moved_modules.add(id(moved))
                for name in own_tensors(moved, "buffers"):
                    self._mutated[(moved, "buffers", name)] = None
        elif id(module) not in self._moved_modules and not any(called is module for called, _ in self._calls):
            # Its values are as they were: a later call snapshots them again (those
            # sharing memory with another buffer are kept, for a call that moves it).
            for name in own_tensors(module, "buffers"):
                if len(self._sharing.sharers(module, name)) < 2:
                    self._snapshot.pop((module, name), None)

    def _moved(self, module, held: dict) -> bool:
        """Whether the call that found ``module``'s state ``held`` changed it in place or
        replaced a buffer (``self.mean = ...``: a new tensor's version is no change), as
        _LayerState._changes reads it; notes the parameters changed in place."""
        moved = False
        for (kind, name), (tensor, was) in held.items():
            now = own_tensors(module, kind).get(name)
            in_place = now is tensor and version(now) != was
            replaced = kind == "buffers" and now is not tensor
            if kind == "parameters" and in_place and (None, module, name) not in self._moved_parameters:
                self._moved_parameters.append((None, module, name))
            if replaced:  # the recompute reads the snapshot of it, not it: nothing to check
                self._forget(tensor)
            moved = moved or in_place or replaced
        return moved

    def _forget(self, tensor: torch.Tensor) -> None:
        noted = self._read.get(id(tensor))
        if noted is not None and noted[0]() is tensor:
            del self._read[id(tensor)]


def _when_read(label: tuple, function_name: str) -> str:
    """Why a change of ``label``'s tensor before the recompute is refused."""
    if len(label) == 2:  # a leaf autograd saved: read
        return (f"The checkpointed {function_name} read it in its forward and its recompute would read "
                "the new values, so its gradients would be wrong.")
    return (f"It changed between the forward of the checkpointed {function_name}, which ran the module "
            "holding it, and its recompute, which would read the new values wherever the forward read "
            "them, so its gradients would be wrong (which state a forward reads is not known: the state of "
            "every module it runs is checked; a statistic a backward hook keeps belongs outside them).")


def _describe(label: tuple) -> str:
    """``("a tensor of shape", shape)`` or ``(kind, name, module type)`` as text."""
    if len(label) == 2:
        return f"{label[0]} {label[1]}"
    kind, name, module_type = label
    return f"{kind} '{name}' of {module_type.__name__}"
