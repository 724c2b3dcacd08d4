"""The ``torch.Generator`` s a checkpointed forward's modules hold, which its recompute
draws from in the states the forward found them in (:class:`HeldGenerators`).

NOTE [ Generators a module holds ]
A module may draw from a ``torch.Generator`` it holds (``torch.randn(shape,
generator=self.g)``: a noise layer, a dropout of its own, a forward hook that adds
noise). The recompute must draw the forward's numbers, as it does from the process's
generators and from those passed to the call (replay.py); drawing anew gives other
noise, silently where the shapes match, and leaves the generator a draw further than
plain's. So:

- As the forward starts (a module's first call, under global hooks), the generators
  each module holds as attributes are noted, with their holders and, once per
  generator, its state. Which modules: the user's (module_attributes.py's watched
  ones), and torch.nn's own layers where they run code of their own (a forward hook, a
  forward set on the instance): torch's forwards draw from no attribute.
- The recompute runs with each holder holding the generator the forward found there,
  in the state the forward found it in, and puts back both (the holder's attribute, the
  generator's state) as it ends: a generator replaced or reseeded since the forward
  leaves the recompute's draws alone, and the caller's generator as the caller left it.
- A nested recompute's passes (nested.py) replay them as they replay the process's
  generators: each pass from their states where the forward reached its range's start,
  so that a generator two parts draw from gives each part its own numbers.
- A call ``keep="selective"`` skips in the recompute (selective.py) leaves the
  generators its modules hold, as those passed to it, where the forward's call left
  them.
- ``preserve_rng_state=False``: none of this, as for the process's generators.

The check is by type (``type(value) is torch.Generator``), in C over each module's
entries. Not seen: a generator held elsewhere (a global, in a list or a
``functools.partial`` attribute), one a function checkpointed whole
(``actsave.checkpoint(fn, x)``) draws from before the first call of the module holding
it, and Python's ``random`` or numpy's global generator, whose states are too costly to
read at every checkpointed call (docs/limits.md, "The recompute check").
"""
from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from .replay import generators_replayed

# torch.nn's own layer types (subclasses are the user's): their forwards set no
# attribute and draw from none (module_attributes.py reads the set too).
TORCH_LAYERS = frozenset(cls for cls in vars(nn).values() if isinstance(cls, type) and issubclass(cls, nn.Module)
                         and cls.__module__.startswith("torch.nn.modules."))


class HeldGenerators:
    """The generators the modules of one checkpointed forward hold, as the forward found
    them (NOTE [ Generators a module holds ])."""

    __slots__ = ("_holders", "_states")

    def __init__(self):
        self._holders = []  # (module, attribute name, generator)
        self._states = []  # (generator, its state as the forward first found it), each generator once

    def note(self, module: nn.Module, entries: dict) -> None:
        """Note the generators of ``entries`` (``module``'s ``__dict__`` as the forward
        finds it, or a copy of it)."""
        for name, generator in _generators_in(entries):
            self._holders.append((module, name, generator))
            if all(generator is not noted for noted, _ in self._states):
                self._states.append((generator, generator.get_state()))

    def __bool__(self) -> bool:
        return bool(self._holders)

    @property
    def generators(self) -> tuple:
        return tuple(generator for generator, _ in self._states)

    @property
    def holders(self) -> list:
        """``[(module, attribute name, the generator the forward found there)]``."""
        return self._holders

    def replayed(self):
        """A context in which each generator is in the state the forward found it in, and
        in the caller's afterwards (the holders are module_attributes.py's to set)."""
        return generators_replayed(self._states)


def may_draw_from_its_own(module: nn.Module) -> bool:
    """Whether ``module`` may draw from a generator it holds: not one of torch.nn's own
    layers, or one of them running code of its own (a hook, a forward on the instance)."""
    return type(module) not in TORCH_LAYERS or bool(
        module._forward_hooks or module._forward_pre_hooks or "forward" in module.__dict__)


def held_generators(modules: Iterable[nn.Module]) -> tuple:
    """The generators that ``modules`` hold as attributes, each once (of those that
    :func:`may_draw_from_its_own`)."""
    held = HeldGenerators()
    for module in modules:
        if may_draw_from_its_own(module):
            held.note(module, module.__dict__)
    return held.generators


def _generators_in(entries: dict) -> list:
    """``[(name, generator)]`` of ``entries``: a check in C where there are none, as in
    almost every module."""
    if torch.Generator not in map(type, entries.values()):
        return []
    return [(name, value) for name, value in entries.items() if type(value) is torch.Generator]
