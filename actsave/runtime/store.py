"""Kept segment inputs: what a checkpointed segment holds between its forward and
its recompute, and the ledger behind :func:`actsave.kept_bytes`.

See NOTE [ Lifetime of kept inputs ] in function.py for when entries are released.
"""
from __future__ import annotations

import contextlib
import functools
import threading
import weakref
from typing import Optional

import torch

from .._torch import pytree, version
from ..codecs import Packed
from ..layouts import copied_in_layout, gapped_strides, in_strides, is_expanded
from ..errors import ConfigError, RecomputeError, warn_renamed
from ..offload import OffloadedTensors, current_tape
from .kept_aliases import AliasOf, kept_leaves
from .keep_rules import CallerTensors, KeepPolicy, kept_as, placed, should_encode
from .relu_signs import known_non_negative
from .shared_copies import SHARED, StoredCopy, sharing_key


class _Ledger:
    """Bytes actsave holds for backward, by where they sit, and the peaks of that
    while someone watches. Entries are added and removed from autograd's worker
    threads too, hence the lock."""

    def __init__(self):
        self._lock = threading.Lock()
        self._bytes = {"device": 0, "host": 0}
        self._watchers = []  # peaks dicts, updated on every add

    def add(self, where: str, nbytes: int) -> None:
        nbytes = int(nbytes)  # a size torch.jit.trace records is a tensor: the ledger holds ints
        with self._lock:
            self._bytes[where] += nbytes
            for peaks in self._watchers:
                peaks[where] = max(peaks[where], self._bytes[where])

    def snapshot(self) -> dict:
        with self._lock:
            return dict(self._bytes)

    @contextlib.contextmanager
    def watch(self):
        with self._lock:
            peaks = dict(self._bytes)
            self._watchers.append(peaks)
        try:
            yield peaks
        finally:
            with self._lock:
                self._watchers.remove(peaks)


_LEDGER = _Ledger()


def account(owner, nbytes: int, where: str = "device") -> weakref.finalize:
    """Count ``nbytes`` in :func:`kept_bytes` for as long as ``owner`` lives, or
    until the returned finalizer is called."""
    _LEDGER.add(where, nbytes)
    return weakref.finalize(owner, _LEDGER.add, where, -nbytes)


def kept_bytes() -> dict:
    """Bytes actsave currently holds for backward: ``{"device": int, "host": int}``.

    Counts the kept segment inputs, their ReLU sign bits and max-pool decisions, and
    the saves of calls kept instead of recomputed (the last segment's when a lossy
    codec stores them; runtime/kept_saves.py), as stored: compressed bytes for a lossy
    codec, scales included, and a kept input the caller holds too (the batch, kept by
    reference), which ``describe()`` leaves out. ``"device"`` is memory on the device the
    model runs on (the CPU for a CPU model, offloaded inputs included); ``"host"`` is
    memory offloaded to a separate host. Both are zero after backward and under
    ``torch.no_grad()``.
    """
    return _LEDGER.snapshot()


def stored_bytes() -> dict:
    """Deprecated: :func:`kept_bytes` (actsave's word for "held for backward" is "kept")."""
    warn_renamed("actsave.stored_bytes()", "actsave.kept_bytes()")
    return kept_bytes()


def peak_kept_bytes():
    """Context manager yielding a ``{"device": int, "host": int}`` dict that holds,
    as the block runs and after it, the peaks of :func:`kept_bytes` since it began."""
    return _LEDGER.watch()


class _OnDevice:
    """A packed value kept where it was made."""

    where = "device"

    def __init__(self, packed: Packed):
        self._packed = packed

    def fetch(self) -> Packed:
        return self._packed

    def prefetch(self) -> None:
        pass

    def free_source(self) -> None:
        pass

    def release(self) -> None:
        self._packed = None


class _OnHost:
    """A packed value offloaded to host memory (actsave/offload/), payload, scales and means
    alike, as one group (one host enqueue): with a lossy codec only the compressed bytes
    cross the bus."""

    where = "host"

    def __init__(self, packed: Packed):
        self._metadata = packed.metadata()
        tensors = packed.tensors()
        self._names = list(tensors)
        self._group = OffloadedTensors(list(tensors.values()))

    def fetch(self) -> Packed:
        return Packed.assemble(dict(zip(self._names, self._group.fetch())), self._metadata)

    def prefetch(self) -> None:
        self._group.prefetch()

    def free_source(self) -> None:
        self._group.free_source()

    def release(self) -> None:
        self._group.release()


class _KeptTensor:
    """One tensor input, stored by a codec (on the device or the host) until the
    recompute asks for it back: in a stored copy that other live calls keeping the
    same tensor share (NOTE [ One stored copy per kept tensor ])."""

    def __init__(self, tensor: torch.Tensor, policy: KeepPolicy, private_copy: bool,
                 made_by: Optional[CallerTensors] = None, encodable: Optional[bool] = None,
                 requires_grad: Optional[bool] = None, boundary=None):
        self.requires_grad = tensor.requires_grad if requires_grad is None else requires_grad
        encodable = should_encode(tensor, made_by) if encodable is None else encodable
        kept = placed(kept_as(policy, encodable), tensor.device)
        self.codec = kept.codec
        # A tensor that needs no grad is kept as the very object (torch's checkpoint
        # gives the same object back to a custom Function that saved it).
        source = tensor.detach() if tensor.requires_grad else tensor
        if private_copy and self.codec.aliases_input:
            source = copied_in_layout(source)
        self.modified_in_place = private_copy  # by the function's first layer
        # NOTE [ Kept layouts ]: a slice comes back a slice, an expanded tensor expanded, but
        # to a function that changes it in place (a private copy), which needs it dense.
        self._strides = None if private_copy and is_expanded(tensor) else gapped_strides(tensor)
        non_negative = known_non_negative(tensor)
        shared = not (private_copy and self.codec.aliases_input)  # NOTE [ One stored copy per kept tensor ]
        key = sharing_key(tensor, kept, non_negative, self.requires_grad) if shared else None
        self._copy, made = SHARED.held(key, lambda: _claimed_or_stored(boundary, kept, source, tensor, non_negative))
        self.storage = self._copy.storage
        self.nbytes = self._copy.nbytes if made else 0  # what this call adds to kept_bytes()
        # An input changed in place after this point, by a function that did not say it
        # does (private_copy), would be recomputed from the wrong values where it is kept
        # by reference (or copied to the host half changed); kept by a copy, its
        # recompute would change a leaf that requires grad: refuse both. After the
        # forward only the first matters (end_forward).
        self._aliased = self.codec.aliases_input and not private_copy
        self._watched = None if private_copy else source
        self._version = version(source)
        self._release = weakref.finalize(self, SHARED.let_go, self._copy)
        self._release.atexit = False  # at interpreter exit CUDA may be gone before a host copy

    @property
    def lossy(self) -> bool:
        return not self.codec.lossless

    def check_unmodified(self, where: str) -> None:
        if self._watched is not None and version(self._watched) != self._version:
            raise RecomputeError(
                f"a checkpointed input was modified in place {where}, so the segment "
                "cannot be recomputed from it. Do not modify it in place (for an "
                "in-place first layer, set inplace=False or mark it with an "
                "`inplace = True` attribute so actsave keeps a private copy; so too a "
                "first layer of your own that returns its input to an in-place one)."
            )

    def end_forward(self) -> None:
        """From here an offloaded input is a host snapshot, and a copy is the codec's: stop
        watching (and pinning) the device tensor. One kept on the device by reference
        stays watched until its recompute. An input offloaded as it is was the copy's
        source: the compute stream waits for the copy before the caller may change it
        (NOTE [ Offload stream ordering ], rule 2)."""
        if self.storage.where == "host" and self._aliased:
            self.storage.free_source()
        if self.storage.where == "host" or not self._aliased:
            self._watched = None

    def restore(self, again: bool = False) -> torch.Tensor:
        """The input for a recompute; ``again``: another recompute will restore it later."""
        if self._aliased:  # a copy is the codec's, whatever happens to the input
            self.check_unmodified("after the forward that kept it")
        x = in_strides(self.codec.decode(self.storage.fetch()), self._strides)
        if not self.requires_grad:
            # A private copy is changed in place by the function's first layer: one that
            # is restored again must come back as it was kept. An input kept as the very
            # object that has been set to require grad since (a frozen weight passed as an
            # argument, unfrozen before the backward) comes back as it was in the
            # forward, or the recompute would save what the forward did not (NOTE [
            # Parameters a recompute reads ]).
            x = x.detach() if x.requires_grad else x
            return copied_in_layout(x) if again and self.modified_in_place else x
        # A leaf of the recompute's own. The value decoded is ours alone (a decoding,
        # a device copy, or our detached alias of the input), so the first restore of
        # the stored copy takes it as it is; a later one (after a backward inside the
        # forward, or another call's: NOTE [ One stored copy per kept tensor ]) gets a
        # new alias, not the leaf an earlier recompute's graph holds.
        x = x.requires_grad_() if self._copy.first_restore() else x.detach().requires_grad_()
        if self.modified_in_place:
            # A leaf that requires grad cannot be modified in place; a segment that
            # starts with an in-place layer needs a non-leaf input.
            x = copied_in_layout(x)
        return x

    def release(self) -> None:
        self._watched = None
        self._release()


def _claimed_or_stored(boundary, kept: KeepPolicy, source: torch.Tensor, tensor: torch.Tensor,
                       non_negative: bool) -> StoredCopy:
    """The copy the segment before made of ``tensor`` with its decisions, where it did
    (``boundary``: NOTE [ Decisions at a boundary ]), else a new one (_stored_copy)."""
    claimed = None if boundary is None else boundary.claim(tensor, kept, non_negative)
    return _stored_copy(kept, source, tensor, non_negative) if claimed is None else claimed


def _stored_copy(kept: KeepPolicy, source: torch.Tensor, tensor: torch.Tensor, non_negative: bool) -> StoredCopy:
    """``source`` (``tensor`` as kept, or a private copy of it) stored by the placed
    policy ``kept``, counted in kept_bytes() until released."""
    return stored_copy(kept, tensor, kept.codec.encode(source, non_negative=non_negative))


def stored_copy(kept: KeepPolicy, tensor: torch.Tensor, packed: Packed) -> StoredCopy:
    """``packed``, ``tensor`` as the placed policy ``kept`` encoded it, in its storage
    (on the device, or on its way to the host), counted in kept_bytes() until released."""
    storage = _OnHost(packed) if kept.offload else _OnDevice(packed)
    by_reference = kept.codec.aliases_input and not kept.offload  # the storage holds the tensor
    nbytes = _referenced_bytes(packed.data, packed.nbytes) if by_reference else packed.nbytes
    copy = StoredCopy(storage, nbytes, None if by_reference else tensor)
    copy.settle = account(copy, copy.nbytes, storage.where)
    return copy


def _referenced_bytes(tensor: torch.Tensor, nbytes: int) -> int:
    """The bytes a tensor held by reference (the caller's, or a private copy) counts:
    its elements', no more than its storage's (an expanded tensor's storage is one row
    of it; a slice counts as its dense copy). A tensor with no storage to read
    (torch.func's wrappers) counts its elements."""
    try:
        return min(nbytes, tensor.untyped_storage().nbytes())
    except (NotImplementedError, RuntimeError):
        return nbytes


class _Attached:
    """A tensor made during a segment's forward and needed by its recompute only (the
    forward's ReLU or max-pool decisions), kept beside the segment's inputs, where they
    are: on the host when they are offloaded, where all of a segment's decisions go
    as one group when its forward ends (:meth:`KeptInputs.end_forward`)."""

    def __init__(self, tensor: torch.Tensor):
        self._tensor = tensor.detach() if tensor.requires_grad else tensor
        self.nbytes = self._tensor.numel() * self._tensor.element_size()
        self._group, self._index = None, None  # where it went on the host

    @property
    def tensor(self) -> torch.Tensor:
        """The tensor, on the device (before it goes to the host)."""
        return self._tensor

    def moved_to(self, group: OffloadedTensors, index: int) -> None:
        """From now on the tensor is part ``index`` of ``group``."""
        self._tensor, self._group, self._index = None, group, index

    def fetch(self) -> torch.Tensor:
        return self._tensor if self._group is None else self._group.fetch()[self._index]

    def release(self) -> None:
        self._tensor = self._group = None


class _GrowingAccount:
    """Bytes counted in :func:`kept_bytes` that come one by one (a segment's
    decisions, as its forward makes them) and go all at once: on :meth:`settle`, or
    when ``owner`` is collected. One ledger entry for all of them."""

    def __init__(self, owner, where: str):
        self._where, self._nbytes = where, 0
        self.settle = weakref.finalize(owner, self._give_back)

    def add(self, nbytes: int) -> None:
        _LEDGER.add(self._where, nbytes)
        self._nbytes += nbytes

    def _give_back(self) -> None:
        _LEDGER.add(self._where, -self._nbytes)
        self._nbytes = 0


class KeptInputs:
    """All inputs of one segment call: tensors stored by the policy, anything else
    (ints, strings, None) held as it is; and what the forward :meth:`attach` es.

    With offload it is one item of a :class:`~actsave.offload.PrefetchTape`, the one of
    the thread that ran the forward (the backward may run on another).

    ``made_by``: the inputs were made by the layers of a chain before them, whose
    caller holds these tensors (:func:`should_encode`). ``boundary``: the chain's
    Boundary before the segment, whose copy of its input it claims or lets go of
    (boundaries.py, NOTE [ Decisions at a boundary ]).
    """

    def __init__(self, args: tuple, kwargs: dict, policy: KeepPolicy, private_copy: bool,
                 made_by: Optional[CallerTensors] = None, boundary=None):
        leaves, self._spec = flatten_inputs(args, kwargs)
        self.policy = policy
        keep = functools.partial(_KeptTensor, policy=policy, private_copy=private_copy, made_by=made_by,
                                 boundary=boundary)
        self._leaves = kept_leaves(leaves, keep, lambda t: should_encode(t, made_by))
        self._tensors = [leaf for leaf in self._leaves if isinstance(leaf, _KeptTensor)]
        self._tensors += list({id(a.aliases): a.aliases.kept for a in self._leaves if isinstance(a, AliasOf)}.values())
        if boundary is not None:
            boundary.discard()  # a copy no input claimed, let go before the segment's forward
        self._attached = []
        self._attached_bytes = None  # their _GrowingAccount, from the first attach
        self._decisions = None  # the attached tensors once on the host, one group
        self.private_copy = private_copy
        self.released = False
        self._tape = None
        if any(t.storage.where == "host" for t in self.tensors):
            self._tape = current_tape()
            self._tape.register(self)

    @property
    def tensors(self) -> list:
        """The tensor inputs, as kept."""
        return self._tensors

    def attach(self, tensor: torch.Tensor) -> _Attached:
        """Keep ``tensor`` with the inputs until the recompute releases them: on the
        host when they are offloaded (so that nothing a segment keeps grows device
        memory with depth), fetched back with them. ``fetch()`` gives it back."""
        attached = _Attached(tensor)
        if self._attached_bytes is None:
            self._attached_bytes = _GrowingAccount(self, "host" if self._tape is not None else "device")
        self._attached_bytes.add(attached.nbytes)
        self._attached.append(attached)
        return attached

    def _storages(self) -> list:
        storages = [t.storage for t in self.tensors]
        return storages if self._decisions is None else [*storages, self._decisions]

    @property
    def nbytes(self) -> int:
        """What keeping the inputs added to kept_bytes(): a stored copy another live
        call shares is that call's (NOTE [ One stored copy per kept tensor ])."""
        return sum(t.nbytes for t in self.tensors)

    @property
    def lossy(self) -> bool:
        """Whether a recompute from these inputs differs from the forward."""
        return any(t.lossy for t in self.tensors)

    def end_forward(self, function_name: str) -> None:
        """Refuse inputs the function modified in place; then stop watching offloaded
        ones, and send what the forward attached to the host with them, as one group."""
        for t in self.tensors:
            t.check_unmodified(f"by {function_name} during its forward")
            t.end_forward()
        if self._tape is not None and self._attached:
            self._decisions = OffloadedTensors([a.tensor for a in self._attached])
            for index, attached in enumerate(self._attached):
                attached.moved_to(self._decisions, index)

    def prefetch(self) -> None:
        """Start bringing offloaded inputs back to their device."""
        for storage in self._storages():
            storage.prefetch()

    def free_source(self) -> None:
        """Let the device memory of offloaded inputs go, in stream order; that of the
        decisions, copied only as the forward ended, at the next segment's start
        (NOTE [ Offload stream ordering ], rule 2)."""
        for t in self.tensors:
            t.storage.free_source()
        if self._decisions is not None:
            self._tape.free_later(self._decisions)

    def restore(self, again: bool = False) -> tuple:
        """``(args, kwargs)`` for the recompute: detached tensors that require grad
        as the originals did. Offloaded inputs are fetched, and the next segments'
        (in backward order) prefetched. ``again``: a later recompute restores them too
        (this one runs for a backward inside the forward)."""
        if self.released:
            raise RecomputeError(
                "the kept inputs of this checkpoint were already released (an earlier "
                "recompute of it failed, or its graph was freed); run the forward again"
            )
        if self._tape is not None:
            self._tape.before_use(self)
        restored = {}  # each group of aliases restored once: KeptAliases -> its members

        def restore(leaf):
            if isinstance(leaf, AliasOf):
                if leaf.aliases not in restored:
                    restored[leaf.aliases] = leaf.aliases.restore(again)
                return restored[leaf.aliases][leaf.index]
            return leaf.restore(again) if isinstance(leaf, _KeptTensor) else leaf

        return unflatten_inputs([restore(leaf) for leaf in self._leaves], self._spec)

    def restore_before_the_recompute(self, function_name: str) -> tuple:
        """:meth:`restore` for a backward inside the forward (NOTE [ Backward inside a
        checkpointed forward ]) of a function whose first layer changes its inputs in
        place: the private copies stay as they were kept, for the backward's recompute.
        Refused where a lossy codec keeps them: the forward would run on decoded values."""
        if self.lossy:
            raise ConfigError(
                f"{function_name} starts with a layer that changes its input in place and runs a backward inside "
                "its forward (autograd.grad): that backward needs the input as it was, which this checkpoint keeps "
                "only by a lossy codec, so the forward's output would be computed from decoded values. Give its "
                "first layer inplace=False, or keep its inputs exactly (no compress for this call or layer).")
        return self.restore(again=True)

    def release(self) -> None:
        for t in (*self.tensors, *self._attached):
            t.release()
        if self._decisions is not None:
            self._decisions.release()
        if self._attached_bytes is not None:
            self._attached_bytes.settle()
        self.released = True


def flatten_inputs(args: tuple, kwargs: dict) -> tuple:
    """``(leaves, spec)`` of a call's arguments, for :func:`unflatten_inputs`. The spec
    is None for positional tensors alone (a segment's input), which need no pytree walk."""
    if not kwargs and all(isinstance(arg, torch.Tensor) for arg in args):
        return list(args), None
    return pytree.tree_flatten((args, kwargs))


def unflatten_inputs(leaves: list, spec) -> tuple:
    """``(args, kwargs)`` from :func:`flatten_inputs`' leaves (or replacements) and spec."""
    return (tuple(leaves), {}) if spec is None else pytree.tree_unflatten(leaves, spec)


def input_tensors(args: tuple, kwargs: dict) -> list:
    """The tensors among ``args`` and ``kwargs``, at any nesting depth."""
    leaves, _ = flatten_inputs(args, kwargs)
    return [x for x in leaves if isinstance(x, torch.Tensor)]


__all__ = ["KeptInputs", "kept_bytes", "stored_bytes", "peak_kept_bytes", "account", "input_tensors"]
