"""A plan's segment as the solvers hand it to the model (:class:`PlannedSegment`):
where it starts and stops, and which of the memory model's kinds it is, with the index
of its keep option or of its stored codec in the :class:`~actsave.planning.memory_model.CostModel`
it was planned on.

NOTE [ Planned segments ]
    A plan is a list of PlannedSegments covering [0, n) in order. Every one but the
    last is CHECKPOINTED (``option``: an index into CostModel.options) or PLAIN (a
    plain middle segment). The last is PLAIN_LAST. A plain segment's saves are kept
    by ``codec``, an index into CostModel.stored_codecs (0: as autograd keeps them).
    The dynamic programs' label tables hold the kind and option as integers
    (solver.py, _PLAIN); segments are made only where a plan leaves them.
"""
from __future__ import annotations

import enum
from typing import NamedTuple, Optional


class Kind(enum.Enum):
    """Which of the memory model's segments a planned segment is (memory_model.py)."""

    CHECKPOINTED = "checkpointed"
    PLAIN = "plain"  # a plain middle segment
    PLAIN_LAST = "plain_last"


class PlannedSegment(NamedTuple):
    """The layers [start, stop) as one segment of a plan (NOTE [ Planned segments ])."""

    start: int
    stop: int
    kind: Kind
    option: Optional[int] = None  # CHECKPOINTED: its keep option's index
    codec: int = 0  # PLAIN, PLAIN_LAST: its saves' stored codec's index

    @classmethod
    def checkpointed(cls, start: int, stop: int, option: int) -> "PlannedSegment":
        return cls(start, stop, Kind.CHECKPOINTED, option=option)

    @classmethod
    def plain(cls, start: int, stop: int, codec: int = 0) -> "PlannedSegment":
        return cls(start, stop, Kind.PLAIN, codec=codec)

    @classmethod
    def plain_last(cls, start: int, stop: int, codec: int = 0) -> "PlannedSegment":
        return cls(start, stop, Kind.PLAIN_LAST, codec=codec)

    @property
    def is_checkpointed(self) -> bool:
        return self.kind is Kind.CHECKPOINTED

    @property
    def is_plain(self) -> bool:
        """A plain middle segment (not the last)."""
        return self.kind is Kind.PLAIN
