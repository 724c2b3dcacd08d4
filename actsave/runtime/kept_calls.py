"""What a selective checkpoint's forward records (selective.py, NOTE [ Selective
recompute ]): each outermost kept call (:class:`KeptCall`), the tensor arguments it got
(:class:`CallArgument`), and each save it keeps in its placeholder (:class:`KeptSave`);
read again by its recompute (selective_replay.py)."""
from __future__ import annotations

import contextlib
from typing import Optional

import torch
from torch import nn

from .._torch import in_memory, leaf_base, storage_identity, storage_identity_or_none, version
from ..errors import RecomputeError
from ..layouts import is_dense, reading
from ..meta import meta_step_depth
from .function import detached_or_same
from .module_attributes import ABSENT, assign, holds_data


def keepable_now(meta_depth: int) -> bool:
    """Whether a call made now can be a kept call of a frame opened ``meta_depth`` meta
    steps deep: not in inference mode, whose outputs are inference tensors, which
    autograd never saves and which have no version counter to check; not in a meta step
    opened since (a chain inside the block planning at its first call), whose calls are
    no call of the forward. The forward does not record such a call and the recompute
    does not count it: both run it plainly. (A frame opened in a meta step, a block
    estimated, keeps its calls as a real step would.)"""
    return not torch.is_inference_mode_enabled() and meta_step_depth() == meta_depth


class KeptCall:
    """One outermost kept call of the forward: what it is (a module, or a function's
    name), the placeholders its saves took (``start`` to ``stop``), its tensor
    arguments' storages and offsets, and its output, which the recompute returns in its
    place."""

    __slots__ = ("target", "start", "stop", "arguments", "output", "stored", "version", "requires_grad", "views",
                 "skipped", "mutates", "decided_on", "rng_before", "rng_after", "state", "changed_state",
                 "attributes", "data_set_again", "raised")

    def __init__(self, target, start: int, arguments: list):
        self.target, self.start, self.stop = target, start, start
        # [CallArgument] of the tensor arguments, as the call got them
        self.arguments = arguments
        self.output, self.version, self.requires_grad = None, None, False
        self.stored = None  # the output as its policy stores it (kept_outputs.py), which then holds no output
        # The generators' states around a call that may draw random numbers (attention's
        # dropout), where it did: the recompute skips it, and must leave them as it did.
        self.rng_before = self.rng_after = None
        self.views = {}  # slot index -> (argument position, size, stride, offset from the argument's)
        self.skipped = False  # whether the recompute skips it: set as the forward ends
        self.mutates = False  # whether it changed an argument in place (then it runs again)
        self.state = None  # the module state as the call started (StateMark), until it ends
        self.changed_state = False  # whether it changed a buffer or a parameter (then it runs again)
        # ((module, {name: value as the call left it, or ABSENT}), ...): the attributes that
        # calls of its modules set, which a recompute that skips it sets so (replay_attributes).
        self.attributes = ()
        # Whether it set a tensor attribute of more than one element that another call of
        # its module sets too: that value is not replayed, so the call runs again (attributes_to_replay).
        self.data_set_again = False
        # Whether a later save of its output keeps decisions (a clamp's input, under a
        # lossy codec): it runs again, where the recompute restores them (NOTE [ Bound decisions ]).
        self.decided_on = False
        # Whether it raised (the function caught it): it kept nothing, and a recompute that
        # takes another way without it (the function noted the failure) need not make it.
        self.raised = False

    def kept_output(self) -> torch.Tensor:
        """The forward's output, as kept or stored."""
        return self.output if self.stored is None else self.stored.read()

    @property
    def let_go(self) -> bool:
        """Whether it is skipped and its output not kept: the recompute's early stop
        ends before it returns (NOTE [ Selective recompute ])."""
        return self.skipped and self.output is None and self.stored is None

    def view_of_argument(self, tensor: torch.Tensor) -> Optional[tuple]:
        """``(position, size, stride, relative offset)`` where ``tensor`` reads only
        elements of one of the call's tensor arguments, else None (NOTE [ Selective
        recompute ]). None for a nested or sparse tensor, which has no strides to view it
        by, and for a wrapper (DTensor's kind), whose views ``as_strided`` cannot make."""
        if tensor.is_nested or tensor.layout != torch.strided or not in_memory(tensor):
            return None
        identity, offset = storage_identity(tensor), tensor.storage_offset()
        shape, stride = tuple(tensor.shape), tensor.stride()
        # Only a view that reads the argument's elements as the argument does: one of
        # another dtype (view_as_complex) or with a conjugate or negative bit is not
        # what as_strided of the argument makes again; it is kept as it is.
        sharing = [a for a in self.arguments if a.storage == identity and a.reading == reading(tensor)]
        for a in sharing:  # the argument itself first: q, k and v may be slices of one storage
            if (a.offset, a.shape, a.stride) == (offset, shape, stride):
                return a.position, shape, stride, 0
        first, last = _span(offset, shape, stride)
        for a in sharing:
            if a.holds(first, last):
                return a.position, shape, stride, offset - a.offset
        return None

    def mutated_an_argument(self) -> bool:
        """Whether the call changed one of its tensor arguments in place: it is run
        again in the recompute, where its argument must change again."""
        return any(version(a.tensor) != a.version for a in self.arguments if a.tensor is not None)


class StateMark:
    """The module state a kept call may change, as it starts: the buffers of
    ``holders`` (the modules under the checkpointed call that hold any), and the
    parameters and Python attributes of the modules under the call's own module
    (NOTE [ Selective recompute ]: a call that changed a buffer or a parameter runs
    again; the attributes calls set are replayed where they are skipped)."""

    __slots__ = ("buffers", "parameters", "attributes")

    def __init__(self, holders, own_modules):
        self.buffers = tuple((holder, name, buffer, version(buffer)) for holder in holders
                             for name, buffer in holder._buffers.items() if buffer is not None)
        self.parameters = tuple((p, version(p)) for m in own_modules for p in m._parameters.values() if p is not None)
        self.attributes = tuple((m, dict(m.__dict__)) for m in own_modules)

    def changed(self) -> bool:
        """Whether a buffer was changed, replaced or removed, or a parameter changed in
        place, since."""
        return (any(holder._buffers.get(name) is not buffer or version(buffer) != seen
                    for holder, name, buffer, seen in self.buffers)
                or any(version(p) != seen for p, seen in self.parameters))

    def attributes_left(self) -> tuple:
        """``((module, attributes now, names set, added or deleted since, names of those
        set to a tensor of more than one element), ...)``: by identity, so a value set to
        the object it held (a small int that repeats) is not seen set;
        :func:`attributes_to_replay` covers it. Tensors of more than one element are not
        replayed, as module_attributes leaves them (a cache the call makes, a dequantized
        weight: held until the backward, each call's would stay alive)."""
        return tuple((m, {name: DATA if holds_data(value) else value for name, value in m.__dict__.items()},
                      _moved(m.__dict__, before), _data_set(m.__dict__, before)) for m, before in self.attributes)


def _moved(now: dict, before: dict) -> frozenset:
    return frozenset(name for name in now.keys() | before.keys()
                     if now.get(name, ABSENT) is not before.get(name, ABSENT)
                     and not holds_data(now.get(name)) and not holds_data(before.get(name)))


def _data_set(now: dict, before: dict) -> frozenset:
    """The names set (or deleted) since, from or to a tensor of more than one element."""
    return frozenset(name for name in now.keys() | before.keys()
                     if now.get(name, ABSENT) is not before.get(name, ABSENT)
                     and (holds_data(now.get(name)) or holds_data(before.get(name))))


def attributes_to_replay(calls: list) -> None:
    """Set each call's ``attributes`` to the values it left of every attribute that any
    call of the same module set: a call that set one to the object it already held (a
    row count that repeats) left the value the code after it read, though it moved
    nothing, where a later call of the module moved it. An attribute that two calls of a
    module set, one of them from or to a tensor of more than one element (a statistic of
    each call's input), holds the last one's as the recompute runs, not what the code
    after each call read: those calls run again (``data_set_again``), each setting its own."""
    moved, setters, data = {}, {}, set()
    for call in calls:
        for module, _, names, data_names in call.attributes:
            moved[module] = moved.get(module, frozenset()) | names
            data.update((module, name) for name in data_names)
            for name in names | data_names:
                setters[module, name] = setters.get((module, name), 0) + 1
    for call in calls:
        call.data_set_again = any((module, name) in data and setters[module, name] > 1
                                  for module, _, names, data_names in call.attributes for name in names | data_names)
        call.attributes = tuple((module, {name: left.get(name, ABSENT) for name in moved[module]})
                                for module, left, _, _ in call.attributes if moved[module])


@contextlib.contextmanager
def attributes_put_back_after(calls: list):
    """While open (a recompute), the attributes the calls replay may be set; as it
    closes, each is put back as it was when it opened: the recompute sets them for the
    code it runs again, not for the steps after it (two forwards before their
    backwards, or a recompute that stops early, would leave an earlier call's value)."""
    held = {(id(module), name): (module, name, module.__dict__.get(name, ABSENT))
            for call in calls for module, values in call.attributes for name, value in values.items()
            if value is not DATA}
    try:
        yield
    finally:
        assign(held.values())


def replay_attributes(call: KeptCall) -> None:
    """Set the attributes a skipped call left (:func:`attributes_to_replay`), on the
    module's ``__dict__`` as the call's own assignments put them."""
    assign([(module, name, value) for module, values in call.attributes for name, value in values.items()
            if value is not DATA])


DATA = object()  # a tensor of more than one element there, left as it is (attributes_left)


class CallArgument:
    """A kept call's tensor argument as the call got it: its position among the
    call's tensors, storage, offset, shape, strides and version (with the tensor, until
    the call ends)."""

    __slots__ = ("position", "storage", "offset", "shape", "stride", "reading", "tensor", "version")

    def __init__(self, position: int, tensor: torch.Tensor):
        self.position, self.offset = position, tensor.storage_offset()
        self.storage = storage_identity_or_none(tensor)  # None: a torch.func transform's wrapper
        self.shape, self.stride, self.reading = tuple(tensor.shape), tensor.stride(), reading(tensor)
        self.tensor, self.version = tensor, version(tensor)

    def holds(self, first: int, last: int) -> bool:
        """Whether the storage elements ``first`` to ``last`` are all the argument's own
        (asked while the call runs, with the tensor)."""
        return is_dense(self.tensor) and self.offset <= first and last < self.offset + self.tensor.numel()


def _span(offset: int, shape: tuple, stride: tuple) -> tuple:
    """The first and last storage elements a view reads (last < first when empty)."""
    if 0 in shape:
        return offset, offset - 1
    low = sum((n - 1) * s for n, s in zip(shape, stride) if s < 0)
    high = sum((n - 1) * s for n, s in zip(shape, stride) if s > 0)
    return offset + low, offset + high


class KeptSave:
    """A save kept in its placeholder: the tensor itself, or as its policy stored it
    (``stored``, kept_outputs.py); with the version it was saved at and the autograd
    node that made it (for the error); ``held``: whether someone else holds it anyway
    (a parameter or a view of one)."""

    __slots__ = ("tensor", "stored", "version", "held", "made_by", "shape")

    def __init__(self, tensor: torch.Tensor):
        self.tensor, self.version, self.held = detached_or_same(tensor), version(tensor), held_elsewhere(tensor)
        self.stored, self.shape = None, tensor.shape
        self.made_by = type(tensor.grad_fn).__name__ if tensor.grad_fn is not None else "a leaf"

    def store(self, stored) -> None:
        """From now on ``stored`` (a kept_outputs.StoredTensor) stands for the tensor."""
        self.stored, self.tensor = stored, None

    def read(self) -> torch.Tensor:
        counter = self.tensor if self.stored is None else self.stored.counter
        if counter is not None and version(counter) != self.version:
            raise RecomputeError(
                "one of the variables needed for gradient computation has been modified by an inplace "
                f"operation: a tensor of shape {list(self.shape)} made by {self.made_by}, which a selective "
                f"checkpoint kept, is at version {version(counter)}; expected version {self.version} instead. "
                "Change it after the backward, or change a copy (nn.Sequential raises the same).")
        return self.tensor if self.stored is None else self.stored.read()


def held_elsewhere(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is, or is a view of, a tensor its owner holds anyway: a
    parameter (a leaf that requires grad; ``weight.t()`` a Linear saves)."""
    base = leaf_base(tensor)
    return base is not None and (base.requires_grad or isinstance(base, nn.Parameter))



def described(target) -> str:
    return target if isinstance(target, str) else type(target).__name__


__all__ = ["CallArgument", "KeptCall", "KeptSave", "StateMark", "attributes_put_back_after", "attributes_to_replay",
           "described", "held_elsewhere", "keepable_now", "replay_attributes"]
