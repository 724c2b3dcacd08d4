"""The memory model's events that no keep option changes (memory_model.py, module
docstring): for a segment starting at a, each layer's forward, recompute, backward
and loss events from the profile's per-layer terms, and the largest of them up to
each end, where a recompute stops at its last save.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np


class Events(NamedTuple):
    """The option-independent events of the layers i = a .. n-1 of a segment starting
    at a, one array each (index i - a), in the terms of memory_model.py's docstring."""

    saved: np.ndarray  # Saved(a, i): a stored middle segment [a, i+1) keeps these
    stored_forward: np.ndarray  # Saved(a, i-1) + U(i) + [x_a] + fwd_i: a stored segment's forward
    caller_held: np.ndarray  # [x_a]: the segment's input, held by the caller and no save
    loss: float  # Saved(a, n-1) + U(n) + L: the stored segment's loss
    backward: np.ndarray  # O + Saved(a, i) + g_{i+1} + bwd_i
    recompute: np.ndarray  # Saved'(a, i-1) + U(i) + fwd_i: the option adds its held bytes
    recompute_to_last_save: np.ndarray  # the same, the layer's rise up to its last save

    @property
    def stored_peak(self) -> float:
        """W_stored(a): the largest event of the stored segment [a, n)."""
        return float(max(self.stored_forward.max(), self.loss, self.backward.max()))

    def without_input(self, first: float, saved: float) -> "Events":
        """The stored segment's events when the stored middle segment before holds x_a:
        ``first`` (x_a) off its first forward event (U(a)) and those where the caller
        holds it ([x_a]), ``saved`` (x_a where Saved(a, .) counts it, else 0) off Saved
        and every other event counting it."""
        forward = self.stored_forward - np.where(self.caller_held > 0, first, saved)
        forward[0] = self.stored_forward[0] - first
        return self._replace(saved=self.saved - saved, stored_forward=forward, loss=self.loss - saved,
                             backward=self.backward - saved)


def until_last_save(full: np.ndarray, truncated: np.ndarray, last: np.ndarray) -> np.ndarray:
    """For each segment end, the largest recompute event: layers before the segment's
    last saving layer (``last``, relative to the start) run whole (``full``), that
    layer up to its last save (``truncated``: the early stop), the rest not at all;
    -inf when no layer saves."""
    running = np.maximum.accumulate(full)
    whole = np.where(last > 0, running[np.maximum(last - 1, 0)], -np.inf)
    return np.where(last >= 0, np.maximum(whole, truncated[np.maximum(last, 0)]), -np.inf)
