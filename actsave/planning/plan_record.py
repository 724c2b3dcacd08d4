"""What a chain's plan is (:class:`Plan`): where segments start, how each keeps its
input, what it predicts, and how it prints. Made by plans.py's plan(), balanced() and
predict(), applied by CheckpointedSequential.apply_plan."""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Optional

from ..checks import integral
from ..codecs import get_codec
from ..errors import ConfigError, warn_renamed
from ..runtime.nested import Range
from ..runtime.keep_rules import KeepPolicy
from ..text import format_table, mib, ms


@dataclass(frozen=True)
class Plan:
    """Where segments start and how each checkpointed segment keeps its input, with
    the model's predictions. Apply it with ``CheckpointedSequential.apply_plan``.

    ``starts[j]`` is the first layer of segment j (``starts[0] == 0``). The last
    segment is plain (run plainly, never recomputed), and so is segment j < last
    where ``plain[j]``; the others are checkpointed, segment j keeping its input by
    ``codecs[j]`` ("none" = exact) in host memory if ``offload[j]``. A plain segment
    keeps autograd's saves on the device, as they are or by a lossy codec, which
    stores each as runtime/kept_saves.py says: segment j < last by ``codecs[j]`` (its
    offload False), the last by ``saves_codec`` ("none": as they are; both together:
    :attr:`saves_codecs`). ``plain`` defaults
    to no segment but the last (one False per segment before it). The names
    ``stored`` and ``stored_codec`` (constructor keywords, attributes) are deprecated
    spellings of ``plain`` and ``saves_codec``. ``nested[j]``, for
    a checkpointed segment j kept exactly on the device, may cut its recompute into
    checkpoints of its own: a :class:`~actsave.runtime.nested.Range` over its layers
    (indices from 0 at the segment's first layer; NOTE [ Nested recompute ]), or None
    for a plain recompute; ``nested`` defaults to None for every segment before the last.
    ``n_layers`` is the chain's length and ``budget`` the bytes it was planned under
    (None: planned without one). ``predicted_peak_bytes`` is peak activation memory
    (see the module docstring), ``predicted_step_seconds`` the step's time as the
    profile timed its layers (0 for a profile on meta tensors); ``peak_segment`` is the
    segment whose events set the peak. ``frozen`` names the
    parameters that did not require grad when the chain was profiled, as ``(layer,
    name)``: a chain running the plan warns once one of them requires grad.
    ``input_shape`` and ``input_element_size`` are the chain input's shape and bytes an
    element in the profiled step (None and 0: not recorded): a chain running the plan
    warns once on a larger input, in bytes.
    """

    n_layers: int
    starts: tuple
    codecs: tuple
    offload: tuple
    predicted_peak_bytes: int
    predicted_step_seconds: float
    peak_segment: int
    budget: Optional[int] = None
    saves_codec: str = "none"
    plain: tuple = ()
    nested: tuple = ()
    # The profile's frozen parameters (Profile.frozen): a chain running the plan warns
    # once they require grad, as autograd then saves more than the plan priced.
    frozen: tuple = dataclasses.field(default=(), repr=False)
    # The profile's input shape: a chain running the plan warns once on a larger input,
    # for which its predicted peak does not hold.
    input_shape: Optional[tuple] = dataclasses.field(default=None, repr=False, compare=False)
    input_element_size: int = dataclasses.field(default=0, repr=False, compare=False)

    def __post_init__(self):
        n_layers = integral(self.n_layers)
        if n_layers is None or n_layers < 1:
            raise ConfigError(f"plan n_layers={self.n_layers!r} must be a positive integer")
        try:
            starts = [integral(start) for start in self.starts]
        except TypeError:  # not iterable
            starts = [None]
        if None in starts:
            raise ConfigError(f"plan starts={self.starts!r} must be a sequence of layer indices (integers)")
        increasing = all(a < b for a, b in zip(starts, starts[1:]))
        if not starts or starts[0] != 0 or not increasing or starts[-1] >= n_layers:
            raise ConfigError(
                f"plan starts={self.starts!r} must increase from 0 and stay below {self.n_layers}")
        checkpointed = len(starts) - 1
        if not isinstance(self.codecs, (tuple, list)) or not isinstance(self.offload, (tuple, list)):
            raise ConfigError(f"plan codecs={self.codecs!r} and offload={self.offload!r} must be tuples, one "
                              "item per checkpointed segment")
        if len(self.codecs) != checkpointed or len(self.offload) != checkpointed:
            raise ConfigError(
                f"a plan with {len(starts)} segments needs {checkpointed} codecs and offload flags "
                f"(one per checkpointed segment), got {len(self.codecs)} and {len(self.offload)}"
            )
        for codec in (*self.codecs, self.saves_codec):
            get_codec(codec)
        if not all(isinstance(flag, bool) for flag in self.offload):
            raise ConfigError(f"plan offload={self.offload!r} must hold True or False for each checkpointed segment")
        self._check_plain(checkpointed)
        self._check_nested(checkpointed)

    def _check_plain(self, before_last: int) -> None:
        """Validate ``plain`` (one flag per segment before the last; () for none) and
        fill it in: a plain segment's codec keeps its saves, on the device."""
        plain = () if self.plain is None else self.plain
        if not isinstance(plain, (tuple, list)) or not all(isinstance(flag, bool) for flag in plain):
            raise ConfigError(f"plan plain={self.plain!r} must be a tuple of True or False, one per segment "
                              "before the last (True: run it plainly, autograd keeping its saves)")
        if not plain:
            plain = (False,) * before_last
        if len(plain) != before_last:
            raise ConfigError(f"a plan with {before_last + 1} segments needs {before_last} plain flags (one per "
                              f"segment before the last), got {len(plain)}")
        for j, flag in enumerate(plain):
            if flag and self.offload[j]:
                raise ConfigError(
                    f"plan segment {j} is plain (plain[{j}] is True) but has offload True: a plain segment keeps "
                    "autograd's saves on the device (as they are, or by its codec), which its backward reads at "
                    "once, so give it offload False")
        object.__setattr__(self, "plain", tuple(plain))

    def _check_nested(self, before_last: int) -> None:
        """Validate ``nested`` (one Range or None per segment before the last; () for
        none) and fill it in: only an exact checkpointed segment on the device nests."""
        nested = () if self.nested is None else tuple(self.nested)
        if not nested:
            nested = (None,) * before_last
        if len(nested) != before_last or not all(r is None or isinstance(r, Range) for r in nested):
            raise ConfigError(f"plan nested={self.nested!r} must hold one Range or None per segment before the "
                              f"last ({before_last})")
        stops = [*self.starts[1:], self.n_layers]
        for j, r in enumerate(nested):
            if r is None:
                continue
            length = stops[j] - self.starts[j]
            if self.plain[j] or get_codec(self.codecs[j]).name != "none" or self.offload[j]:
                what = "plain" if self.plain[j] else f"kept by codec {self.codecs[j]!r}, offload {self.offload[j]}"
                raise ConfigError(
                    f"plan segment {j} nests checkpoints (nested[{j}] is a Range) but is {what}: only an exact "
                    "checkpointed segment on the device nests; give it codec 'none', offload False and plain "
                    "False, or nested None")
            if r.start != 0 or r.stop != length or not r.recomputed:
                raise ConfigError(f"plan nested[{j}]={r} must be a recomputed Range over the segment's {length} "
                                  f"layers, Range(0, {length}, inner=...)")
        object.__setattr__(self, "nested", nested)

    @property
    def saves_codecs(self) -> tuple:
        """Per segment, the codec name that keeps a plain segment's saves ("none": as
        autograd keeps them), None for a checkpointed one."""
        before_last = (get_codec(c).name if plain else None for c, plain in zip(self.codecs, self.plain))
        return (*before_last, self.saves_codec)

    @property
    def segments(self) -> list:
        """[(start, stop, KeepPolicy of a checkpointed segment, or None for a plain one)]"""
        stops = [*self.starts[1:], self.n_layers]
        options = [None if plain else KeepPolicy.resolve(c, f)
                   for c, f, plain in zip(self.codecs, self.offload, self.plain)] + [None]
        return list(zip(self.starts, stops, options))

    def __str__(self) -> str:
        return self.table()

    def table(self, every_segment: bool = False) -> str:
        """The plan as text: a line of its predictions, then its segments. Runs of
        consecutive segments kept alike print as one row (a deep chain's plan has
        hundreds of segments) unless ``every_segment``; the peak segment has its own."""
        budget = "none" if self.budget is None else f"{mib(self.budget)} MiB"
        # A profile of meta tensors measures no time: its plans predict none.
        step = "no step time (profiled on meta tensors)" if self.predicted_step_seconds == 0 else \
            f"step {ms(self.predicted_step_seconds)} ms"
        header = (f"plan for {self.n_layers} layers: {len(self.starts)} segments; predicted peak activation "
                  f"memory {mib(self.predicted_peak_bytes)} MiB (budget {budget}), {step}")
        rows = [self._segment_row(j) for j in range(len(self.starts))]
        groups = [[row] for row in rows] if every_segment else _runs(rows)
        table = [["segment", "layers", "keeps", "codec", "where", ""]]
        for group in groups:
            first, last = group[0], group[-1]
            segments = first[0] if len(group) == 1 else f"{first[0]}-{last[0]} ({len(group)})"
            table.append([segments, f"{first[1]}-{last[2]}", *first[3:]])
        return header + "\n" + format_table(table)

    def _segment_row(self, j: int) -> tuple:
        """(segment, first layer, last layer, keeps, codec, where, peak marker) of
        segment j, in describe()'s words: a checkpointed segment keeps its ``input``,
        a plain one autograd's ``saves`` (by its codec, on the device)."""
        start, stop, option = self.segments[j]
        nested = j < len(self.nested) and self.nested[j] is not None
        if option is None:
            keeps, codec, where = "saves", self.saves_codecs[j], where_kept(False)
        else:
            keeps, codec, where = "input, nested" if nested else "input", option.codec.name, where_kept(option.offload)
        return (str(j), str(start), str(stop - 1), keeps, codec, where, "<- peak" if j == self.peak_segment else "")


# The names Plan had for ``plain`` and ``saves_codec``, which said "stored" for "run
# plainly", where actsave's word for "held for backward" is "kept": accepted, with a
# DeprecationWarning, for one release (constructor keywords and attributes alike).
_RENAMED = {"stored": "plain", "stored_codec": "saves_codec"}
_fields_init = Plan.__init__


@functools.wraps(_fields_init)
def _init_taking_old_names(self, *args, **kwargs):
    for old, new in _RENAMED.items():
        if old in kwargs:
            if new in kwargs:
                raise ConfigError(f"Plan got both {old}= and {new}=: {old} is the deprecated name of {new}; pass {new}")
            warn_renamed(f"Plan({old}=...)", f"Plan({new}=...)")
            kwargs[new] = kwargs.pop(old)
    _fields_init(self, *args, **kwargs)


def _renamed_attribute(old: str, new: str) -> property:
    def read(self):
        warn_renamed(f"Plan.{old}", f"Plan.{new}")
        return getattr(self, new)
    return property(read, doc=f"Deprecated: :attr:`{new}`.")


Plan.__init__ = _init_taking_old_names
for _old, _new in _RENAMED.items():
    setattr(Plan, _old, _renamed_attribute(_old, _new))


def where_kept(offload: bool) -> str:
    """The word for where a kept input lives, in plans and ``describe()`` alike."""
    return "host" if offload else "device"


def _runs(rows: list) -> list:
    """``rows`` (from Plan._segment_row) in runs of consecutive rows kept alike, the
    peak's row alone."""
    runs = []
    for row in rows:
        if runs and not row[6] and not runs[-1][-1][6] and runs[-1][-1][3:6] == row[3:6]:
            runs[-1].append(row)
        else:
            runs.append([row])
    return runs
