"""Which submodules :func:`actsave.wrap` replaces, and every place where each sits in
the model (wrappers.py replaces them)."""
from __future__ import annotations

from typing import NamedTuple

from torch import nn

from ._torch_graphs import uncompiled


# NOTE [ Shared blocks ]
# A module placed at several positions (weights shared, ``nn.ModuleList([block] * 3)``)
# runs at each. wrap asks the filter about it once, under its first name (as
# ``named_modules()`` names it), and places one Checkpoint of it at every position, so
# that every call is checkpointed: parameters stay shared, and state_dict keys and
# module counts stay those of the plain model. A block plan chooses for each block on
# its own, which one module run at several places cannot take: plan_blocks refuses it.
class Block(NamedTuple):
    """A submodule :func:`wrap` selected: the places where it sits in the model, in
    module order (several for a shared module: NOTE [ Shared blocks ]), and whether it
    is a wrapper already (from an earlier call)."""

    places: list  # (parent, name in parent, fqn)
    module: nn.Module
    wrapped: bool

    @property
    def fqn(self) -> str:
        """Its first place's."""
        return self.places[0][2]

    def replace(self, module: nn.Module) -> None:
        for parent, name, _ in self.places:
            setattr(parent, name, module)


def matching_blocks(model: nn.Module, matches, wrapper: type) -> list:
    """The :class:`Block` s of ``model`` that ``matches(module, fqn)`` selects, in
    module order: never ``model`` itself, nor anything inside a selected module; a
    ``wrapper`` instance counts as selected (by an earlier :func:`wrap`), and nothing
    inside it is asked. A module without a forward of its own (``nn.ModuleList``,
    ``nn.ModuleDict``: a container the model iterates, never calls) is not asked: a
    checkpoint runs a module's forward, so wrapping it would checkpoint nothing and
    hide its items; what it holds is asked instead. ``torch.compile(module)`` is asked as ``module`` and selected
    whole: its compiled forward calls the module it was given, so replacing that
    module inside it would checkpoint nothing. A module at several places is asked
    once and is one Block with all of them (NOTE [ Shared blocks ])."""
    seen = {id(model): None}  # id(module) -> its Block, or None where not selected
    _find_blocks(model, matches, wrapper, "", seen)
    return [block for block in seen.values() if block is not None]


def _find_blocks(parent: nn.Module, matches, wrapper: type, prefix: str, seen: dict) -> None:
    # Every place of a child, not named_children(), which skips a module met before.
    for name, child in parent._modules.items():
        fqn = prefix + name
        if child is not None and id(child) not in seen:
            wrapped = isinstance(child, wrapper)
            selected = wrapped or (_runs(uncompiled(child)) and matches(uncompiled(child), fqn))
            seen[id(child)] = Block([], child, wrapped) if selected else None
            if not selected:
                _find_blocks(child, matches, wrapper, fqn + ".", seen)
        if child is not None and seen[id(child)] is not None:
            seen[id(child)].places.append((parent, name, fqn))


def _runs(module: nn.Module) -> bool:
    """Whether ``module`` runs something when called: a forward of its own (its
    class's, or one set on it), or a ``__call__`` of its class's."""
    kind = type(module)
    return kind.forward is not nn.Module.forward or "forward" in vars(module) or kind.__call__ is not nn.Module.__call__
