"""Parameters across a recompute: those a checkpointed forward changed in place, checked
across it (NOTE [ Parameters a forward changes ]), and the requires_grad of every one it
ran with, which the recompute runs with too (NOTE [ Parameters a recompute reads ]);
state.py notes them, and TouchedState guards its recompute with them."""
from __future__ import annotations

import contextlib
import threading
import weakref
from typing import Optional

import torch

from .._torch import own_tensors
from ..devices import capturing
from ..errors import RecomputeError


# NOTE [ Parameters a forward changes ]
# A forward may change a parameter in place under no_grad: Embedding's max_norm
# renormalizes the rows it looks up, a user's block clips its own weight. Parameters are
# not snapshotted (every forward would copy every weight), so the recompute starts from
# a parameter as the forward left it and changes it again. Where that change leaves the
# values as they were (max_norm's rows are already within the norm) the recompute reads
# what the forward read; otherwise it reads other values, and the parameter changes
# twice (torch.utils.checkpoint does both, silently). So the parameters the forward
# changed, and only those, are copied as a recompute starts and compared as it ends (or
# stops early), and put back as the forward left them. Changed by more than 4 units of
# rounding (relative: 4 eps), the recompute raises; by rounding alone it goes on (max_norm
# renormalizes a row whose norm came out an ulp above the limit by an ulp or two again).
# bfloat16's eps is 2^-7, so there a change under 3% passes. Where the layers are
# known the change is seen whichever module made it; under global hooks (a function of
# unknown layers) a change is seen where a module makes it to its own parameters during
# its own call; a parameter replaced (FSDP2 puts gathered ones in place) is not a change.
def _rounding_apart(now: torch.Tensor, then: torch.Tensor) -> bool:
    """Whether ``now`` is ``then`` within 4 units of its dtype's rounding: the change of an
    operation that leaves its result as it is but for rounding (max_norm's renormalization
    of a row whose norm came out one ulp above the limit)."""
    if not now.is_floating_point():
        return False
    return torch.allclose(now, then, rtol=4 * torch.finfo(now.dtype).eps, atol=0.0, equal_nan=True)


class GuardedParameters:
    """The parameters a forward changed in place, as a recompute starts: a recompute
    that changes them again must change them to the same values (``max_norm``'s
    renormalization does), or it read values the forward did not (NOTE [ Parameters a
    forward changes ])."""

    def __init__(self, moved: list, layers: Optional[range]):
        self._entries = []
        for index, module, name in moved:
            parameter = own_tensors(module, "parameters").get(name)
            if parameter is not None and (layers is None or index is None or index in layers):
                self._entries.append((module, name, parameter, parameter.detach().clone()))

    def check(self) -> None:
        """Put each parameter back as the forward left it; raise where the recompute
        changed one by more than rounding. Comparing reads values back, a sync that a
        CUDA graph's capture refuses: there it raises instead, naming the parameter."""
        if self._entries and capturing():
            module, name = self._entries[0][:2]
            raise RecomputeError(
                f"a checkpointed forward changed parameter '{name}' of {type(module).__name__} in place, which its "
                "recompute must compare with what the forward left, reading values back: a CUDA graph's capture "
                "cannot. Change the parameter outside the checkpointed call, or capture without checkpointing "
                "this module.")
        moved = [entry for entry in self._entries if not torch.equal(entry[2], entry[3])]
        changed = [(module, name) for module, name, parameter, value in moved if not _rounding_apart(parameter, value)]
        with torch.no_grad():
            for _, _, parameter, value in moved:
                parameter.copy_(value)
        if not changed:
            return
        module, name = changed[0]
        raise RecomputeError(
            f"a checkpointed forward changed parameter '{name}' of {type(module).__name__} in place, and its "
            "recompute changed it again, to other values: the recompute read values the forward did not, so its "
            "gradients would be wrong (the parameter is put back as the forward left it). Change the parameter "
            "outside the checkpointed call (before its forward, or after the backward), or do not checkpoint "
            "this module.")


# NOTE [ Parameters a recompute reads ]
# A recompute reads each module's parameters as they are at backward, where autograd's
# graph holds the tensors the forward read. A parameter frozen or unfrozen in between
# changes what the recompute saves (a Linear saves its input only where its weight needs
# a gradient): torch's checkpoint then saves other tensors, of the same shapes where the
# layers are square, and gives wrong gradients silently. So each parameter's
# requires_grad is noted as the forward ends (as its module is called, where the layers
# are not known), and set so while the recompute runs, then put back; so is that of each
# other leaf the forward saved (a weight closed over, or held as a plain attribute), as
# it saved it. Recomputes in flight, in any thread, hold it together: one that finds it
# otherwise sets it, and the last to end puts back the flag it had before the first
# set it, where it is still as last set. So two threads' recomputes that overlap both
# run with the flag their forwards had (the first to end would otherwise put it back
# under the other); two whose forwards had different flags cannot, but leave it as
# the backwards found it; and code that changes it meanwhile (the recompute freezing
# it again, as its forward did; another thread) keeps its change. Held by weak
# reference, and once per tensor (a weight tied across modules is one tensor: flipped
# twice, it would end as it started). Not seen: a leaf the forward read without saving it, outside the modules it
# knows (``x @ W`` where neither needed a gradient), and a flag the forward itself
# changes after a use, which the recompute starts from as the forward left it
# (docs/limits.md, "Parameters replaced before backward").
# A parameter replaced in between (another tensor, other storage: functional_call over
# the checkpoint, load_state_dict(assign=True), ``p.data = ...``) is not checked: FSDP1
# with use_orig_params, ZeRO-3 style gathering and FSDP2 replace parameters between a
# forward and its recompute as a matter of course, and put the gathered ones back in
# place before each module runs. The recompute reads what the module holds then, as
# torch's checkpoint does (docs/limits.md, "Parameters replaced before backward").
class ForwardParameters:
    """The requires_grad of the parameters (and other leaves) a checkpointed forward ran
    with (NOTE [ Parameters a recompute reads ])."""

    __slots__ = ("_refs", "_needing")

    def __init__(self):
        # A dict of weak references and a set of ids, not a tuple per parameter: what a
        # forward leaves for its backward stays out of the garbage collector's oldest
        # generation (NOTE [ Objects a step leaves to the garbage collector ]).
        self._refs = {}  # id(tensor) -> weak reference to it
        self._needing = set()  # the ids of those that required grad

    def note(self, tensor: torch.Tensor) -> None:
        """Note a leaf as the forward ran with it (its first note counts)."""
        held = self._refs.get(id(tensor))
        if held is None or held() is not tensor:  # new, or another tensor's id reused
            self._note(tensor)

    def note_all(self, tensors) -> None:
        """Note ``tensors``, parameters as the forward ended (each once)."""
        for tensor in tensors:
            self._note(tensor)

    def _note(self, tensor: torch.Tensor) -> None:
        self._refs[id(tensor)] = weakref.ref(tensor)
        if tensor.requires_grad:
            self._needing.add(id(tensor))
        else:
            self._needing.discard(id(tensor))

    @contextlib.contextmanager
    def flags_as_in_forward(self):
        """While active, each noted leaf's requires_grad is the forward's."""
        # One changed in place since is no leaf, and autograd refuses to set its flag.
        leaves = [(tensor, key in self._needing) for key, tensor in ((key, ref()) for key, ref in self._refs.items())
                  if tensor is not None and tensor.is_leaf]
        held = _FLAGS_HELD.hold_all(leaves)
        try:
            yield
        finally:
            _FLAGS_HELD.release_all(held)


class _FlagsHeld:
    """The leaves that recomputes in flight, in any thread, hold at a requires_grad:
    one that is not at the flag a recompute wants is set to it, and the last recompute
    to release it puts back the flag it had before the first set it, where it is still
    as last set (NOTE [ Parameters a recompute reads ])."""

    def __init__(self):
        self._lock = threading.Lock()
        self._held = {}  # id(tensor) -> [weak reference, holders, flag before (None: not set), flag last set]

    def hold_all(self, leaves: list) -> list:
        """Hold each ``(tensor, flag)`` of ``leaves``; returns those held, none where
        every flag is as wanted and no recompute holds any (a step that changed no
        flag pays one comparison a leaf)."""
        with self._lock:
            if not self._held and all(tensor.requires_grad is flag for tensor, flag in leaves):
                return []
            held = []
            try:
                for tensor, flag in leaves:
                    self._hold(tensor, flag)
                    held.append(tensor)
            except BaseException:  # a flag autograd refuses to set: nothing stays held
                for tensor in held:
                    self._release(tensor)
                raise
        return leaves

    def release_all(self, leaves: list) -> None:
        with self._lock:
            for tensor, _ in leaves:
                self._release(tensor)

    def _hold(self, tensor: torch.Tensor, flag: bool) -> None:
        entry = self._held.get(id(tensor))
        if entry is None or entry[0]() is not tensor:  # new, or another tensor's id reused
            entry = [weakref.ref(tensor), 0, None, None]
        if tensor.requires_grad is not flag:
            before = tensor.requires_grad
            tensor.requires_grad_(flag)  # first: where autograd refuses, nothing is held
            entry[2] = before if entry[2] is None else entry[2]
            entry[3] = flag
        entry[1] += 1
        self._held[id(tensor)] = entry

    def _release(self, tensor: torch.Tensor) -> None:
        entry = self._held[id(tensor)]
        entry[1] -= 1
        if entry[1]:
            return
        del self._held[id(tensor)]
        before, last_set = entry[2], entry[3]
        if before is not None and tensor.requires_grad is last_set:  # still as set: not changed since
            tensor.requires_grad_(before)


_FLAGS_HELD = _FlagsHeld()


__all__ = ["GuardedParameters", "ForwardParameters"]
