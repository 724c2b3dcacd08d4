"""A block plan's hidden state, checked where the blocks it wraps run.

NOTE [ A block plan's input ]
A block plan is priced on the example step's shapes and dtypes: a larger batch or
sequence makes every activation larger, and so does a wider dtype (``model.double()``),
and the plan's peak with it, past its budget (docs/planner.md, "Limits of plans"). So
each block a plan wraps holds where its call passed the hidden state in the example step
(a positional index or a keyword), that state's shape and its element size, and a
training call of it on a larger one warns, once per plan. Larger is more bytes, or as
many or a few fewer in a longer dimension: written-out attention grows
with a sequence's square, so the same tokens as fewer, longer sequences outgrow a plan
(docs/planner.md, "Limits of plans"), where fewer tokens as a bit longer sequences
(an epoch's short batches) do not (:func:`larger_than_planned`). A smaller one (an
epoch's last batch) only lowers the peak and says nothing; nor does a call under
no_grad (evaluation), which keeps nothing, nor one that passes the hidden state
elsewhere. Eager calls only: a compiled graph's guards recompile on new shapes and
read no Python warning. A chain's plan checks its input by the same rule
(chain_segments.py).
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Union

import torch

from .step_isolation import user_stacklevel


def larger_than_planned(shape, planned, element_size: int = 0, planned_element_size: int = 0) -> bool:
    """Whether a tensor of ``shape`` and ``element_size`` bytes an element outgrows the
    ``planned`` one (NOTE [ A block plan's input ]): its bytes, times how much its most
    grown dimension grew (a sequence, whose attention grows with its square: its bytes
    times its length), exceed the planned bytes; of another rank, its bytes alone. An
    element size of 0 is not known (a plan made before they were recorded): elements
    alone."""
    shape, planned = tuple(shape), tuple(planned)
    widened = element_size / planned_element_size if element_size and planned_element_size else 1.0
    elements, planned_elements = math.prod(shape) * widened, math.prod(planned)
    if len(shape) != len(planned) or not planned_elements:
        return elements > planned_elements
    growth = max(1.0, *(size / planned_size for size, planned_size in zip(shape, planned) if planned_size))
    return elements * growth > planned_elements


@dataclass(frozen=True)
class PlannedInput:
    """Where a planned block's call passes its hidden state (``place``: an index of its
    positional arguments or a keyword) and the shape and element size it had in the
    example step (0: not recorded); ``warned`` is shared by the blocks of one plan
    (NOTE [ A block plan's input ])."""

    place: Union[int, str]
    shape: tuple
    warned: list
    element_size: int = 0

    def check(self, args: tuple, kwargs: dict) -> None:
        """Warn once per plan where this training call's hidden state is larger than
        planned."""
        if self.warned[0] or not torch.is_grad_enabled():
            return
        place = self.place
        hidden = (args[place] if place < len(args) else None) if isinstance(place, int) else kwargs.get(place)
        if not isinstance(hidden, torch.Tensor) or not larger_than_planned(
                hidden.shape, self.shape, hidden.element_size(), self.element_size):
            return
        self.warned[0] = True
        warnings.warn(
            f"actsave: a block of this block plan runs on a hidden state of shape {list(hidden.shape)}"
            f"{element_bytes(hidden.element_size())}, where the plan was made for {list(self.shape)}"
            f"{element_bytes(self.element_size)}: the activations grow with it, so the plan's predicted peak (and "
            "budget) no longer holds. Plan again with example inputs of this shape and dtype (actsave.plan_blocks, or "
            "wrap(..., budget=..., example_inputs=...))", stacklevel=user_stacklevel())


def element_bytes(element_size: int) -> str:
    """A warning's words for a tensor's element size (0: not recorded, none)."""
    return f" ({element_size} bytes an element)" if element_size else ""


__all__ = ["PlannedInput", "element_bytes", "larger_than_planned"]
