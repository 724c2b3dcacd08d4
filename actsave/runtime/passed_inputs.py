"""A chain segment's layers as a checkpoint runs them, forward and recompute alike
(function.py): an input that a layer turns out to hand on to in-place layers is left
as it is, as a private copy would leave it (:func:`run_segment`,
:func:`returns_its_input`)."""
from __future__ import annotations

import torch

from ..layouts import copied_in_layout
from .keep_rules import starts_in_place
from .layers import LayerRun


# NOTE [ A layer that turns out to pass its input on ]
# A segment whose layers start by changing its input in place keeps a private copy of
# it (keep_rules.starts_in_place), decided before the forward from the layers' types:
# an in-place layer, after layers known to hand their input on (nn.Identity). A layer
# of the user's own that returns its input (a tap recording a statistic) is known to
# do so only once it has run. So a chain segment without a private copy (LayerRun)
# runs its layers here, forward and recompute alike: while each layer has returned the
# segment's input or a view of it (returns_its_input), and the layers after it start
# in place, they get a copy (copied_in_layout, through autograd) to change instead
# (HandedOn). A nested segment (nested.py) watches so each input it keeps by reference:
# its own in the forward, and in each pass the pass's input and each input it keeps for
# an inner range. One kept as a private copy is watched by no one, here or there: the
# copy is what the recompute starts from, so the layers may change the input itself.
# The segment's input is left as it is: the exact codec keeps it by reference, and a
# restored input that needs a gradient is a leaf, which autograd refuses to change in
# place. Values and gradients are plain PyTorch's (a copy passes its gradient on as it
# is); the copy costs what a private copy does, and the profile prices it so
# (planning/profiler.py, _starts_in_place).
def run_segment(function, args: tuple, kwargs: dict, private_copy: bool, before_last=None):
    """``function(*args, **kwargs)``, as the forward and every recompute run it: NOTE [
    A layer that turns out to pass its input on ]. ``before_last``: called as a chain
    segment's last layer starts, where the layers run here (NOTE [ Decisions at a
    boundary ])."""
    if private_copy or type(function) is not LayerRun or kwargs or len(args) != 1:
        return function(*args, **kwargs)
    watch = HandedOn(function.layers, args[0])
    h = args[0]
    last = len(function.layers) - 1
    for i, layer in enumerate(function.layers):
        if i == last and before_last is not None:
            before_last()
        h = watch.after(i, layer(h))
    return h


class HandedOn:
    """The input of a run of ``layers`` that stays as it is (kept by reference, or
    restored as a leaf), while the layers hand it on: each layer's output, or a copy of
    it for in-place layers after it (:meth:`after`). NOTE [ A layer that turns out to
    pass its input on ]; nested.py watches each range's kept input so."""

    def __init__(self, layers, x):
        self.layers = layers
        self.watch(x)

    def watch(self, x) -> None:
        """Watch ``x`` from here on, in place of the tensor watched so far."""
        self.input, self.passing = x, isinstance(x, torch.Tensor)

    def after(self, i: int, output):
        """``output`` of layer ``i``, or a copy of it (through autograd) where it is the
        input watched, or a view of it, and the layers after ``i`` start in place."""
        if not self.passing:
            return output
        self.passing = returns_its_input(output, self.input)
        if self.passing and starts_in_place(self.layers, i + 1):
            output, self.passing = copied_in_layout(output), False
        if not self.passing:
            self.input = None  # held no longer than a layer holds its argument
        return output


def returns_its_input(output, input: torch.Tensor) -> bool:
    """Whether a layer given ``input`` returned it, or a view of it (or of what it is a
    view of), whose in-place change is ``input``'s: NOTE [ A layer that turns out to pass
    its input on ]."""
    if output is input:
        return True
    base = getattr(output, "_base", None)
    return base is not None and base is (input if input._base is None else input._base)


__all__ = ["run_segment", "HandedOn", "returns_its_input"]
