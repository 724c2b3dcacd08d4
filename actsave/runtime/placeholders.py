"""The placeholders of a checkpointed call (function.py, NOTE [ Segment checkpoint
mechanism ]): what autograd stores in place of each tensor the forward saved
(:class:`Slot`), which of those saves a recompute's next save fills
(:class:`Cursor`), and the hooks of the recompute that fills them (:func:`weakly`).

NOTE [ Objects a step leaves to the garbage collector ]
What a checkpointed forward leaves alive for its backward outlives the garbage
collector's young collections, and each tracked object that survives one is moved to
its oldest generation. When those moves add up to a quarter of the process's
long-lived objects, the next collection walks every object of the process: a pause
that grows with the program, not with the model, paid every few steps in proportion to
what each step moved (docs/performance.md, "Objects left to the garbage collector").
PyTorch's checkpoint leaves four such objects per save. So:

- Per save, two: the Slot autograd holds and the frame's weak reference to it, by
  which the recompute learns that autograd freed the save.
- A record that must outlive the forward is a flat tuple of untracked values (ints, a
  dtype, a device: a save's signature), which the collector stops tracking at its
  first pass, or one list, dict or set per kind of record (the versions of the module
  state read, the parameters' requires_grad), not a tuple per tensor. A torch.Size is
  always tracked; so is a tuple holding a module, a weak reference or a type. What is
  left per tensor is what must be: a weak reference to each parameter, and for each
  buffer the forward mutated, its snapshot's copy and key (NOTE [ State a forward reads
  and mutates ]).

tests/runtime/test_placeholders.py counts what a forward leaves against
torch.utils.checkpoint, a count that does not vary from run to run.
"""
from __future__ import annotations

import functools
import weakref
from typing import Callable

from .._torch_graphs import eager_hooks


class Slot:
    """What autograd stores in place of a tensor the segment saved. When the recompute
    is lossy, ``relu_signs`` hold the forward's ReLU decisions (relu_signs.py),
    ``pool_decisions`` a max pool's (pool_decisions.py) and ``bound_decisions`` a
    Hardtanh's or LeakyReLU's (bound_decisions.py), attached to the kept inputs
    (store.py), ``mask_bits`` a mask's elements, one bit each (saved_masks.py), and
    ``parameter`` the id of the parameter the save views, which the recompute's must
    view too (forward_decisions.py).
    ``kept``: the tensor itself, where the frame keeps it instead of
    recomputing it (selective.py), with the version it was saved at."""

    __slots__ = ("index", "relu_signs", "pool_decisions", "bound_decisions", "mask_bits", "recounted", "parameter",
                 "kept", "handed_out", "filled_at", "__weakref__")

    def __init__(self, index: int):
        self.index = index
        self.relu_signs = None
        self.pool_decisions = None
        self.bound_decisions = None
        self.mask_bits = None
        self.parameter = None
        self.recounted = None  # (forward's, recompute's) counts of True where the masks differ
        self.kept = None
        self.handed_out = False  # the frame let go of its recomputed tensor (function.py: CheckpointFrame.hand_out)
        self.filled_at = None  # its recomputed tensor's version as saved (None: traced, as Dynamo's are)


class Cursor:
    """Which save of the forward a recompute's next save stands for; a selective
    recompute moves it past the saves of a call it skips (selective.py)."""

    __slots__ = ("position",)

    def __init__(self):
        self.position = 0

    def take(self) -> int:
        self.position += 1
        return self.position - 1

def unchanged(tensor):
    return tensor


def weakly(fill: Callable) -> Callable:
    """A hook that calls ``fill`` (a recompute's: it fills the placeholders) held
    weakly. The recompute's graph holds its pack hook as long as its nodes live, and
    state the function appends to (a Hugging Face cache) may hold them past the
    backward; a hook that held the frame would close a cycle through autograd's graph,
    which Python's collector does not see. So, as torch's checkpoint: weakly."""
    ref = weakref.WeakMethod(fill) if hasattr(fill, "__self__") else weakref.ref(fill)
    return functools.partial(_weakly_called, ref)


def _weakly_called(ref, tensor):
    return ref()(tensor)


eager_hooks(unchanged, _weakly_called)  # NOTE [ Eager hooks Dynamo leaves alone ]
