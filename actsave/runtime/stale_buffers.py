"""Buffers a checkpointed forward changed and then read, which its recompute must read
changed too (:class:`StaleReads`), and buffers it registered or removed, which no
recompute can give back as the forward found them (:func:`unreplayable`): the module
state of state.py that its snapshot alone does not replay."""
from __future__ import annotations

import weakref
from typing import Callable, Optional

import torch

from .._torch import leaf_base, own_tensors, storage_identity_or_none, version
from ..errors import RecomputeError


class StaleRead(RecomputeError):
    """A recompute read a buffer as the forward found it, where the forward read it
    changed; ``key``: ``(module, buffer name)``; ``reads``: the call's StaleReads."""

    def __init__(self, key: tuple, message: str, reads: "StaleReads"):
        super().__init__(message)
        self.key, self.reads = key, reads


class StaleReads:
    """The saves of one checkpointed call that read a buffer its forward had changed.

    NOTE [ Buffers read after the forward changed them ]
    A recompute runs on the snapshot of the buffers as the forward started (NOTE [ State
    a forward reads and mutates ]): right where it changes them before reading them as
    the forward did, replaying the change (an EMA updated, then used). Not where Python
    state the forward set keeps the recompute from changing them again: a first-batch
    initialization behind a Python flag (ActNorm, data-dependent init), a table regrown
    when a Python int says it is too short. Such state on the module whose buffers it
    guards is found as the forward found it (NOTE [ Python attributes a forward sets ]);
    this is for the rest (a parent's flag, a dict changed in place, a global), and
    the recompute would read the values the
    forward found where the forward read the ones it made, silently (torch's checkpoint,
    which recomputes on the buffers as the forward left them, is right there and wrong
    for an EMA). A read is seen where autograd saves the buffer (``h * self.scale``): a
    leaf, saved by reference. So:

    - As the forward ends, each save of a snapshotted buffer is noted with how the
      forward had changed it by then: not at all, in place (by how many versions), or
      replaced (``self.scale = s``, ``register_buffer`` again: the tensor saved is the
      one the forward set).
    - As a recompute saves the tensor it runs on in that buffer's place (its stand-in,
      a copy of the snapshot), the read is stale if the stand-in has moved fewer
      versions than the forward had moved the buffer, or the forward had replaced it.
    - The backward's recompute then starts over with that buffer as the forward left it
      (a copy), where that is the value every save of it read: none saved it before the
      change, and it has neither moved nor been replaced since (later in the forward, a
      second forward, an optimizer step). Started over, the recompute must read it
      without moving it. Else, and in a recompute that cannot start over (a backward
      inside the forward, a nested recompute's pass), it raises, naming the module and
      the buffer. A call with such a save runs every recompute on copies of the
      snapshot, which a start over needs as the forward started.
    - A read autograd does not save (``x + self.shift``) is not seen: docs/limits.md.
    """

    def __init__(self):
        self.watching = False  # whether a recompute's saves are checked: bool(_reads), read per save
        # id -> (buffer, (module, name), version) of each buffer as its snapshot was taken,
        # for the forward only; made at its first save of a buffer from ``_entries``.
        self._started, self._entries = {}, None
        self._saves = []  # (index, weakref, version, key or None, versions moved) of the leaves saved that need no grad
        self._reads = {}  # save index -> (key, weakref, version, versions moved or None: replaced)
        self._unchanged = set()  # keys of the buffers the forward also saved as it found them
        self._ended = False
        self._installed = {}  # id -> (weakref, version as installed): a recompute's stand-ins
        self._restarted = {}  # key -> the buffer as the forward left it, in place of its snapshot
        self._restarting = False

    def started(self, modules) -> None:
        """Note the buffers of ``modules`` as the forward snapshots them."""
        for module in modules:
            for name, buffer in own_tensors(module, "buffers").items():
                if buffer is not None:
                    self._started[id(buffer)] = (buffer, (module, name), version(buffer))

    def started_from(self, entries: list) -> None:
        """The same from ``entries``, _LayerState's ``(layer index, module, kind, name,
        tensor, version)`` as the forward starts, read only if the forward saves a tensor
        that needs no gradient (most steps save none but BatchNorm's statistics)."""
        self._entries = entries

    def _buffers_started(self) -> dict:
        if self._entries is not None:
            self._started = {id(t): (t, (m, name), at) for _, m, kind, name, t, at in self._entries
                             if kind == "buffers"}
            self._entries = None
        return self._started

    def saved(self, index: int, base: torch.Tensor) -> None:
        """Note the forward's save ``index``, of ``base``, a leaf that needs no gradient
        (the caller skips the others: no buffer needs one). A buffer as the forward
        started is known now (a replaced one may be gone as it ends)."""
        at, started = version(base), self._buffers_started().get(id(base))
        key, was = (started[1], started[2]) if started is not None and started[0] is base else (None, at)
        self._saves.append((index, weakref.ref(base), at, key, at - was))

    def forward_ended(self, replaced: Optional[dict] = None) -> None:
        """As the forward ends; ``replaced``: ``{id: ((module, name), tensor)}``, the
        buffers it set in place of those it started with, where the caller knows them."""
        self._reads, self._unchanged = self._found(replaced)
        self.watching = bool(self._reads)
        self._started, self._entries, self._saves, self._ended = {}, None, [], True

    def entering(self, last: bool) -> bool:
        """As a recompute starts: its ``last`` (state.py: it may use up the snapshot),
        False where a save read a changed buffer, for a start over to find the snapshot."""
        if not self._ended:  # a backward inside the forward: the saves so far
            self._reads, self._unchanged = self._found()
            self.watching = bool(self._reads)
        return last and not self._reads

    def stand_ins(self, snapshot: dict) -> dict:
        """What the recompute runs on in place of each buffer of ``snapshot``: the
        snapshot, but the buffers it starts over with as the forward left them, and with
        them those whose copies share their memory (NOTE [ Buffers that share memory ])."""
        if not self._restarted:
            return snapshot
        restarted = {storage_identity_or_none(snapshot[key]) for key in self._restarted if key in snapshot} - {None}
        sharing = {key: own_tensors(key[0], "buffers").get(key[1]) for key, copy in snapshot.items()
                   if storage_identity_or_none(copy) in restarted}
        return {**snapshot, **{key: now for key, now in sharing.items() if now is not None}, **self._restarted}

    def installed(self, stand_ins: list) -> None:
        """Note the tensors a recompute runs on in place of the buffers, as it starts."""
        if self._reads:
            self._installed.update((id(t), (weakref.ref(t), version(t))) for t in stand_ins)

    def check(self, index: int, tensor: torch.Tensor) -> None:
        """Raise :class:`StaleRead` where the recompute's save ``index`` (``tensor``) reads a
        stand-in with fewer of the forward's changes made than the forward's save read."""
        read = self._reads.get(index)
        if read is None:
            return
        key, _, _, moved = read
        base = leaf_base(tensor)
        noted = self._installed.get(id(base))
        if noted is None or noted[0]() is not base or own_tensors(key[0], "buffers").get(key[1]) is not base:
            return  # the recompute saved a tensor of its own: it made or replaced the buffer, as the forward did
        now = version(base) - noted[1]
        if key in self._restarted:
            stale = now != 0  # it stands for the buffer as the forward left it: read as it is
        else:
            stale = moved is None or now < moved
        if stale:
            why = None if self._restarting else ("This recompute cannot start over (a backward inside the "
                                                 "forward, or a nested recompute's pass).")
            raise StaleRead(key, _stale_message(key, why), self)

    def restarting(self, run: Callable[[], None]) -> None:
        """``run()`` (the backward's recompute), started over with a buffer as the forward
        left it where it read that buffer stale, once per buffer; else raise."""
        self._restarting = True
        try:
            while True:
                try:
                    return run()
                except StaleRead as stale:
                    if stale.reads is not self:  # a checkpoint's inside the function
                        raise
                    why = self._why_not_restartable(stale.key)
                    if why is not None:
                        raise RecomputeError(_stale_message(stale.key, why)) from None
                    self._restarted[stale.key] = own_tensors(stale.key[0], "buffers")[stale.key[1]]
        finally:
            self._restarting = False

    def _why_not_restartable(self, key: tuple) -> Optional[str]:
        """Why the recompute cannot start over with buffer ``key`` as the forward left it, or None."""
        now = own_tensors(key[0], "buffers").get(key[1])
        if key in self._restarted:
            return "Started over with the buffer as the forward left it, the recompute changed it before reading it."
        if key in self._unchanged:
            return "The forward also read it before changing it, so no one value gives both reads."
        if any(ref() is not now or version(now) != at for k, ref, at, _ in self._reads.values() if k == key):
            return ("It changed after the forward read it (later in that forward, or since), so the value the "
                    "forward read is gone.")
        return None

    def _found(self, replaced: Optional[dict] = None) -> tuple:
        """``(reads, unchanged)`` of the saves so far, against the buffers now."""
        if not self._saves:
            return {}, set()
        if replaced is None:
            replaced = self._replaced() if any(key is None for _, _, _, key, _ in self._saves) else {}
        reads, unchanged = {}, set()
        for index, ref, at, key, moved in self._saves:
            if key is None:  # not a buffer as the forward started: one it set?
                key, tensor = replaced.get(id(ref()), (None, None))
                if key is None or tensor is not ref():
                    continue
                moved = None
            if moved == 0:
                unchanged.add(key)
            else:
                reads[index] = (key, ref, at, moved)
        return reads, unchanged

    def _replaced(self) -> dict:
        """``{id: (key, tensor)}``: the buffers the forward set in place of those it started with."""
        replaced = {}
        for started, key, _ in self._buffers_started().values():
            now = own_tensors(key[0], "buffers").get(key[1])
            if now is not None and now is not started:
                replaced[id(now)] = (key, now)
        return replaced


def _stale_message(key: tuple, why: Optional[str]) -> str:
    module, name = key
    return (f"{type(module).__name__}'s buffer '{name}' was changed by its checkpointed forward and then read, "
            "but the recompute read it without that change: Python state the forward set (a flag set by a "
            "first-batch initialization, as ActNorm's; an int a regrown table's length is kept in) kept the "
            f"recompute from making the change again, so its gradients would be wrong. {why + ' ' if why else ''}"
            "Keep that state in a buffer (self.register_buffer('initialized', torch.tensor(False))) or in an "
            "attribute of the module whose buffer it guards, which the recompute finds as the forward did, or "
            "initialize before checkpointing (one forward under "
            "torch.no_grad()), or do not checkpoint this module.")


def unreplayable(module: torch.nn.Module, name: str, function_name: str) -> RecomputeError:
    """The error for a buffer ``name`` of ``module`` that the forward registered or removed."""
    return RecomputeError(
        f"the checkpointed {function_name} cannot be recomputed as its forward ran: "
        f"{type(module).__name__} registered or removed buffer '{name}' during the forward, so the "
        "recompute would find its buffers as the forward left them, not as it found them. Register "
        "the buffer in the module's __init__ (or run one forward before checkpointing it), or do not "
        "checkpoint this module.")


def count_buffers(module: torch.nn.Module) -> int:
    return sum(buffer is not None for buffer in own_tensors(module, "buffers").values())


def changed_buffer(module: torch.nn.Module, before: list) -> tuple:
    """``(module, name)`` of a buffer the forward registered (set now, absent or None
    as it started) or removed (the reverse); ``before``: _LayerState's entries."""
    was = {name for _, owner, kind, name, _, _ in before if owner is module and kind == "buffers"}
    now = {name for name, buffer in own_tensors(module, "buffers").items() if buffer is not None}
    return module, next(iter(sorted(was ^ now)), "?")
