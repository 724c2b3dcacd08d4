"""A plain segment's saves as a lossy codec would store them, followed through the
byte-counting step (instrumented_step.py's ledger runs :class:`SavesAsStored` beside
it); stored_saves.py prices what it finds under each codec."""
from __future__ import annotations

import dataclasses
import weakref
from typing import Optional

import torch

from .._torch import current_autograd_node
from ..runtime import relu_signs
from ..runtime.keep_rules import AttentionSaves, compared_inputs, lossy_codec_stores, stored_once_key
from .live_bytes import LiveBytes, allocation_bytes
from .tensor_specs import PoolSample, TensorSpec


class StoredEntry:
    """A tensor as a plain segment's codec would store it: what it is, whether the
    codec encodes it, whether it is a ReLU output, a max pool's indices (``pool``,
    stored as its window decisions: runtime/kept_saves.py), the first and last
    layer saving it."""

    __slots__ = ("first", "last", "pool", "relu", "bounded", "spec")

    def __init__(self, t: torch.Tensor, layer: int, pool: Optional[PoolSample] = None, encoded: bool = False,
                 bounded: bool = False):
        # Encodable: whether a lossy codec keeping saves encodes it (else it holds it as it is).
        self.spec = dataclasses.replace(TensorSpec.of(t), encodable=encoded)
        # Its decisions: a ReLU output's, or a Hardtanh's or LeakyReLU's save's (NOTE [ Bound decisions ]).
        self.bounded, self.pool = bounded, pool
        self.relu = not bounded and relu_signs.keeps_decisions(t, {})
        self.first = self.last = layer

    @property
    def coded(self) -> bool:
        """Whether a lossy codec stores it other than as it is (decoded in backward)."""
        return self.spec.encodable or self.pool is not None


class SavesAsStored:
    """Follows the byte-counting step's saves as runtime/kept_saves.py would store
    them under a lossy codec (an attention call's saves exact where the step runs under
    :meth:`watching`): one entry per stored tensor (stored_saves.py,
    ``StoredTensor``), each save's entry, layer and the layer's rise of live bytes as
    it was saved, and in backward the saves that each autograd node unpacks, which a
    codec decodes together, with the layer's backward rise as the node starts.

    The step's backward rises are net of the saves it frees as their nodes finish,
    whole; a codec frees only their encodings there. So the storages of the saves a
    codec would encode are followed to their end too (``freed``: in the order the
    step freed them), and each layer's backward is cut into stretches, at its start,
    at each node that unpacks saves and after each such storage is freed, each with
    the saves its node unpacks, those freed in the layer's backward before it began,
    its rise as it begins and the highest in it (stored_saves.py adds back what the
    encodings would not have freed)."""

    def __init__(self, ignored: set, tracker: LiveBytes):
        self.entries = {}  # key -> StoredEntry, in the order first saved
        self.saves = []  # per save: (its entry's key, the saving layer, the layer's rise then)
        self.stretches = []  # of _Stretch, in the order they ran
        self.freed = []  # (allocation bytes, entry keys) of each followed storage, as the step freed it
        self._ignored, self._tracker = ignored, tracker
        self._node = None
        self._open = None  # (the stretch running, its tracker mark)
        self._backward_base = {}  # layer -> live bytes as its backward starts
        self._layer_freed_from = {}  # layer -> len(freed) as its backward (or its first stretch) starts
        self._followed = {}  # id(storage) -> the keys of the entries stored from it
        self._handles = []
        self.attention = AttentionSaves()  # NOTE [ Attention's saves agree ]
        self._last = ((_dead_ref, None),) * 2  # the last two saves: each tensor, weakly, and its index

    def watching(self):
        """Active around the step's forward: the saves its attention calls make, which a
        lossy codec leaves exact, are known by the calls."""
        return self.attention.watching()

    def watch_backward(self, layer: int, output: torch.Tensor) -> None:
        """Call right after ``layer`` ran: its backward starts at its output's node
        (before the byte count's own hook there: the stretch ends first)."""
        if output.grad_fn is not None:
            self._handles.append(output.grad_fn.register_prehook(lambda grads, i=layer: self._backward_started(i)))

    def _backward_started(self, layer: int) -> None:
        self._backward_base[layer] = self._tracker.live
        self._node = None
        self._begin(layer, 0)

    def _begin(self, layer: int, rise: Optional[int], continued: Optional[_Stretch] = None, less: int = 0) -> None:
        """Begin a stretch of ``layer``'s backward at a rise of ``rise``: a node's,
        or the rest of ``continued``'s after a free (its node's saves still alive),
        ``less`` bytes about to go."""
        self._end()
        # The frees that count for a layer's stretches are those since its backward began.
        since = self._layer_freed_from.setdefault(layer, len(self.freed))
        stretch = _Stretch(layer, rise, (since, len(self.freed)), continued)
        self._open = stretch, self._tracker.mark(less)

    def _end(self) -> None:
        if self._open is not None:
            stretch, mark = self._open
            self._tracker.unmark(mark)
            base = self._backward_base.get(stretch.layer)
            stretch.end(None if base is None else mark[0] - base)
            self.stretches.append(stretch)
            self._open = None

    def finish(self) -> None:
        """Call as the step's backward ends."""
        self._end()
        self.attention.forget()
        for handle in self._handles:
            handle.remove()

    def pack(self, t: torch.Tensor, layer: int, rise: int, pool: Optional[PoolSample] = None,
             bounded: bool = False) -> Optional[int]:
        """Note one save of ``t`` by ``layer``, the layer's live bytes having risen by
        ``rise``; returns its index (None: held elsewhere, as the batch). ``pool``: ``t``
        is that max pool's indices, stored anew at each save; ``bounded``: a Hardtanh's
        or LeakyReLU's save, which keeps bound decisions."""
        recent, self._last = self._last, ((_dead_ref, None),) * 2
        before = [ref() for ref, _ in recent]
        for i in compared_inputs(t, before):  # NOTE [ Saves a backward compares ]
            if recent[i][1] is not None:
                self._held_as_it_is(recent[i][1], before[i])
        index = self._pack(t, layer, rise, pool, bounded)
        self._last = (recent[1], (weakref.ref(t), index))
        return index

    def _held_as_it_is(self, position: int, t: torch.Tensor) -> None:
        """The save at ``position``, of ``t``, held as it is: its entry,
        where no other save shares it, else an entry of its own."""
        key, layer, rise = self.saves[position]
        entry = self.entries[key]
        if not entry.coded:
            return
        if sum(saved_key == key for saved_key, _, _ in self.saves) == 1:
            entry.spec = dataclasses.replace(entry.spec, encodable=False)
            return
        own = ("as it is", id(t.untyped_storage()))
        self.entries.setdefault(own, StoredEntry(t, layer)).last = layer
        self.saves[position] = (own, layer, rise)

    def _pack(self, t: torch.Tensor, layer: int, rise: int, pool: Optional[PoolSample], bounded: bool) -> Optional[int]:
        encoded = pool is None and lossy_codec_stores(t) and not self.attention.holds(t)
        if pool is not None:
            key = ("pool indices", len(self.saves))
        elif encoded:
            key = stored_once_key(t) or ("stored anew", len(self.saves))
        elif id(t.untyped_storage()) in self._ignored:
            return None
        else:
            key = ("as it is", id(t.untyped_storage()))
        entry = self.entries.get(key)
        if entry is None:
            entry = self.entries[key] = StoredEntry(t, layer, pool, encoded, bounded)
            if entry.coded:
                self._follow(t.untyped_storage(), key)
        elif bounded and encoded:  # a clamp's save of elements another op saved first keeps its bits there
            entry.bounded, entry.relu = True, False
        entry.last = layer
        self.saves.append((key, layer, rise))
        return len(self.saves) - 1

    def _follow(self, storage, key) -> None:
        """Note in ``freed`` when ``storage``, which entry ``key`` is stored from, dies."""
        keys = self._followed.get(id(storage))
        if keys is None:
            keys = self._followed[id(storage)] = []
            weakref.finalize(storage, self._died, id(storage), allocation_bytes(storage.nbytes(), self._tracker.device),
                             keys, self._tracker.counted_bytes(storage))
        keys.append(key)

    def _died(self, storage_id: int, nbytes: int, keys: list, counted: list) -> None:
        """``counted``: what the tracker still counts of the storage (its own
        finalizer may run after this one)."""
        self._followed.pop(storage_id, None)
        self.freed.append((nbytes, tuple(keys)))
        if self._open is not None:  # from here on, the layer's rise is lower by it
            stretch = self._open[0]
            start = None if stretch.started_at is None else self._rise_now(stretch.layer) - counted[0]
            self._begin(stretch.layer, start, continued=stretch, less=counted[0])

    def _rise_now(self, layer: int) -> Optional[int]:
        base = self._backward_base.get(layer)
        return None if base is None else self._tracker.live - base

    def unpack(self, save: Optional[int]) -> None:
        if save is None:
            return
        node = current_autograd_node()
        if node is None or node is not self._node:
            layer = self.saves[save][1]  # a node's saves are its own layer's
            self._begin(layer, self._rise_now(layer))
            self._node = node
        self._open[0].saves.append(save)


class _Stretch:
    """A stretch of a layer's backward (SavesAsStored): the saves its node unpacks,
    alive in it (none in the stretch from the layer's start), whether it decodes them
    (not where it continues a stretch after a free), the layer's backward rise as it
    begins and the highest in it (None where the layer's start was not seen), and the
    followed storages the step had freed in the layer's backward as it began (a range
    of SavesAsStored.freed)."""

    __slots__ = ("layer", "saves", "decodes", "started_at", "highest", "freed_before")

    def __init__(self, layer: int, started_at: Optional[int], freed_before: tuple,
                 continued: Optional[_Stretch] = None):
        self.layer, self.started_at, self.freed_before = layer, started_at, freed_before
        self.saves = [] if continued is None else continued.saves  # one node's, growing as it unpacks
        self.decodes = continued is None
        self.highest = None

    def end(self, highest: Optional[int]) -> None:
        self.highest = highest


def _dead_ref():
    return None


__all__ = ["SavesAsStored", "StoredEntry"]
