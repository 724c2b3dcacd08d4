"""The Python attributes of the modules a checkpointed forward ran that its recompute
must find as the forward found them: their ``training`` flags (:func:`set_modes`), and
the attributes (a flag, a length, a count) the forward set on the modules that hold
buffers, found with the buffers, and the states of the generators the modules hold
(:class:`ModuleAttributes`).

NOTE [ Python attributes a forward sets ]
A recompute runs on the buffers as the forward found them (those it changed from the
snapshot: NOTE [ State a forward reads and mutates ]). A module's Python state may
decide whether its forward changes them: a flag set by a first-batch initialization
(ActNorm, data-dependent init), an int a regrown table's length is kept in, a count
that gates an update to every other call. Read as the forward left it, it keeps the
recompute from making the forward's change, or makes it make one the forward did not:
the recompute reads the buffers as the forward did not, silently where no save shows
the read (``x + self.loc``), which NOTE [ Buffers read after the forward changed them ]
cannot see, and changes a buffer the snapshot does not stand in for a second time. So
the attributes of a module that holds buffers are state like its buffers:

- As the forward starts, each module's ``__dict__`` is copied by reference (one shallow
  copy, no value copied); as it ends, the entries the forward set, added or deleted
  on the modules that hold buffers are found by identity. The recompute runs with
  those as the forward found them, and each is put back as it ends to what it was as
  the recompute started (the caller may have set it since the forward).
- Modules without buffers keep their attributes as the forward left them: the
  recompute reads them as they are (as torch.utils.checkpoint does), and state a
  forward hands to its own recompute through an attribute reaches it.
- Which modules are copied: all but torch.nn's own layers (``torch.nn.modules``), whose
  forwards set no attribute; a cost rule, as they are most of a network's modules (a
  ResNet's convolutions and BatchNorms). A subclass of one is the user's and is watched.
- Which entries: all but nn.Module's own (its tables of parameters, buffers,
  submodules and hooks, which a forward fills rather than replaces, and ``training``:
  NOTE [ Train and eval in a recompute ]), and those that held or hold a tensor of more
  than one element (a cache or a record the forward keeps, whose old value would stay
  alive until the backward: register a tensor that decides what the forward computes
  as a buffer). One of one element is a value (Hugging Face's dynamic RoPE keeps the
  length it grew its frequencies for as a 0-d tensor).
- A nested recompute's part (nested.py) finds as the forward found them only the
  attributes of the modules under its layers: those of the layers before it are as
  the earlier part left them, as they were when the forward reached it.
- Not seen: a value changed in place (a list appended to, a dict updated), state in
  another module (a parent's flag) or outside the modules (a global): the recompute reads
  those as the forward left them, and the stale-read check is what sees the reads.

The generators the modules hold are noted with the copies: NOTE [ Generators a module
holds ] in held_generators.py.
"""
from __future__ import annotations

import contextlib
import operator
from typing import Callable, Iterable, Optional

import torch
from torch import nn

from .held_generators import TORCH_LAYERS, HeldGenerators, may_draw_from_its_own

# nn.Module's own entries, set by its __init__ (a table's identity a forward keeps).
_OWN = frozenset(nn.Module().__dict__)
ABSENT = object()  # an attribute not there (one the forward added: deleted while the recompute runs)
_NOTHING = contextlib.nullcontext()  # what most recomputes install (reusable)
_UNWATCHED = TORCH_LAYERS  # torch.nn's own layers, whose forwards set no attribute


class ModuleAttributes:
    """The attributes one checkpointed forward set on the modules it ran (NOTE [ Python
    attributes a forward sets ])."""

    def __init__(self, generators: bool = True):
        self._found = []  # (module, a shallow copy of its __dict__) as the forward started
        self._set = []  # (module, name, value as the forward found it, or ABSENT)
        self._replays_generators = generators  # False: preserve_rng_state=False
        self.generators = HeldGenerators()  # NOTE [ Generators a module holds ]

    def started(self, modules: Iterable[tuple]) -> None:
        """Note the attributes of ``modules`` (``(layer index, module)`` pairs:
        layers.modules_under's) as the forward starts, and the generators they hold."""
        self._found, self.generators = [], HeldGenerators()
        for index, module in modules:
            self._note(index, module)

    def add(self, module: nn.Module) -> None:
        """Note ``module``'s attributes, and the generators it holds, as its first call in
        the forward starts."""
        self._note(None, module)

    def _note(self, index: Optional[int], module: nn.Module) -> None:
        if type(module) not in _UNWATCHED:
            entries = dict(module.__dict__)
            self._found.append((index, module, entries))
            if self._replays_generators:
                self.generators.note(module, entries)
        elif self._replays_generators and may_draw_from_its_own(module):
            self.generators.note(module, module.__dict__)

    def ended(self, holders) -> None:
        """Find the attributes the forward set, added or deleted, as it ends, on the
        modules of ``holders`` (a collection of the modules that hold buffers)."""
        changed = []
        for index, module, found in self._found if holders else ():
            if module not in holders:
                continue
            now = module.__dict__
            if len(now) == len(found) and all(map(operator.is_, found.values(), now.values())) \
                    and found.keys() == now.keys():
                continue
            for name in found.keys() | now.keys():
                was, value = found.get(name, ABSENT), now.get(name, ABSENT)
                if name not in _OWN and value is not was and not holds_data(was, value):
                    changed.append((index, module, name, was))
        self._found, self._set = [], changed

    def as_in_forward(self, layers: Optional[range] = None):
        """A context in which the attributes the forward set on the modules under
        ``layers`` (layer indices; all by default) are as it found them: a nested
        recompute's part finds those the layers before it set as they left them. The
        generators the modules hold too, for the whole function's recompute only: a
        nested pass replays them itself (NOTE [ Generators a module holds ])."""
        generators = self.generators if layers is None else None
        return self._installed(layers, generators) if self._set or generators else _NOTHING

    @contextlib.contextmanager
    def _installed(self, layers: Optional[range], generators: Optional[HeldGenerators]):
        found = [(module, name, was) for index, module, name, was in self._set
                 if layers is None or index is None or index in layers]
        if generators:  # each holder holds the generator the forward found there
            found += generators.holders
        current = [(module, name, module.__dict__.get(name, ABSENT)) for module, name, _ in found]
        with generators.replayed() if generators else _NOTHING:
            assign(found)
            try:
                yield
            finally:
                assign(current)


# NOTE [ Train and eval in a recompute ]
# A module's ``training`` flag decides what its forward does (Dropout draws or not,
# BatchNorm uses the batch's statistics or its running ones, a block branches on it),
# and a caller may switch it between the forward and the backward (``model.eval()`` for
# an evaluation between the two). The recompute must do the forward's work, so each
# module it runs has the flag the forward ran it with, and every module the forward ran
# gets the caller's flag back as the recompute ends, or stops early before the code that
# would have set it back (torch.utils.checkpoint recomputes in the new mode: wrong
# gradients, or an error where the saves' shapes change). Under global hooks the flag is
# noted as each module's first call starts. Under known layers, read without hooks, it
# is the flag the forward left: the one it ran with, unless the forward itself changed it
# after running the module (used in train mode, then put in eval), where the recompute
# runs it in the mode set after (docs/limits.md, "The in-place check").

def set_modes(modes) -> None:
    """Give each module of ``modes`` (``(module, training)`` pairs) its flag, writing
    only those that differ: nn.Module's __setattr__ is slow, and a recompute's modules
    mostly have their flag already."""
    for module, training in modes:
        if module.training is not training:
            module.training = training


@contextlib.contextmanager
def attributes_put_back(modules: Iterable[nn.Module]):
    """While active, a step on a stand-in input may set the attributes of ``modules``; as
    it ends, every ``__dict__`` entry it set, added or deleted is as it was, by reference
    (graph_codecs.py's probe on meta tensors: a tensor a layer caches at its first forward
    would be a meta one). Not what it changed inside a value (a list appended to)."""
    found = [(vars(module), dict(vars(module))) for module in modules]
    try:
        yield
    finally:
        for entries, was in found:
            put_back(entries, was)


def put_back(entries: dict, found: dict, kept: Optional[Callable[[str], bool]] = None) -> None:
    """Set ``entries`` (a module's ``__dict__``) back to ``found`` (a shallow copy of it,
    less the names ``kept`` says to leave) by reference: an entry set since is set back,
    one added is removed (unless ``kept``), one deleted is added back."""
    for name in [name for name in entries if name not in found and not (kept and kept(name))]:
        del entries[name]
    for name, value in found.items():
        if entries.get(name, ABSENT) is not value:
            entries[name] = value


def holds_data(*values) -> bool:
    """Whether one of ``values`` is a tensor of more than one element: one an attribute
    holds is the forward's cache or record (an attention map kept for a plot), which
    holding as the forward found it until the backward would keep its memory alive; it
    stays as the forward left it (docs/limits.md)."""
    return any(isinstance(value, torch.Tensor) and value.numel() > 1 for value in values)


def assign(values: list) -> None:
    """Set each ``(module, name, value)`` in the module's ``__dict__`` (plain attributes:
    no nn.Module table holds them), deleting those ABSENT: as an assignment in a forward
    sets them."""
    for module, name, value in values:
        if value is ABSENT:
            module.__dict__.pop(name, None)
        else:
            module.__dict__[name] = value

