"""The placeholders of a checkpointed call (function.py, NOTE [ Segment checkpoint
mechanism ]): what autograd stores in place of each tensor the forward saved
(:class:`Slot`), and which of those saves a recompute's next save fills
(:class:`Cursor`)."""
from __future__ import annotations


class Slot:
    """What autograd stores in place of a tensor the segment saved. When the recompute
    is lossy, ``relu_signs`` hold the forward's ReLU decisions (relu_signs.py),
    ``pool_decisions`` a max pool's (pool_decisions.py) and ``bound_decisions`` a
    Hardtanh's or LeakyReLU's (bound_decisions.py), attached to the kept inputs
    (store.py). ``kept``: the tensor itself, where the frame keeps it instead of
    recomputing it (selective.py), with the version it was saved at."""

    __slots__ = ("index", "relu_signs", "pool_decisions", "bound_decisions", "kept", "handed_out", "filled_at",
                 "__weakref__")

    def __init__(self, index: int):
        self.index = index
        self.relu_signs = None
        self.pool_decisions = None
        self.bound_decisions = None
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
