"""Where a CheckpointedSequential's segments come from, one :class:`ChainSegments` per
chain: its ``segments=`` value (``"sqrt"``, a count, a list of starts), a balanced plan
per input (balanced_cache.py), or the plan applied to it (``apply_plan``), whose
segments also say which run plainly and which nest their recompute. And how each
segment keeps what it keeps: the settings of the layer where it starts, except a
balanced plan's last segment (plans.balanced_last_policy).
"""
from __future__ import annotations

from torch import nn

from ..runtime.keep_rules import KeepPolicy
from . import plan_record, plans
from .balanced_cache import BalancedPlans
from .segments import BALANCED, Segment, SegmentsSpec, segments_from, split_starts


class ChainSegments:
    """A chain's ``segments=`` value, or the plan applied to it (module docstring).

    The applied plan is the one source of its segments while it is applied: its
    starts are the ``segments`` value, and which segments run plainly and which nest
    their recompute are read from it, not held beside it. Setting other segments drops
    it. Per-layer codecs and offload are the chain's settings (apply_plan sets them
    from the plan), so a layer's setting changed after the plan applies as it says."""

    def __init__(self, spec: SegmentsSpec):
        self._spec = spec
        self.applied_plan = None  # per-layer changes made after it are not in it
        self.balanced = BalancedPlans()

    @property
    def spec(self) -> SegmentsSpec:
        return list(self.applied_plan.starts) if self.applied_plan is not None else self._spec

    @spec.setter
    def spec(self, value: SegmentsSpec) -> None:
        if self.applied_plan is not None and isinstance(value, list) and value == list(self.applied_plan.starts):
            return  # the plan's own segments: nothing changes
        self.applied_plan, self._spec = None, value

    def apply(self, plan: "plan_record.Plan") -> None:
        self.applied_plan = plan

    def starts_for(self, chain: nn.Module, input, layers: list, policies: tuple) -> list:
        """Where the segments of ``chain``'s call on ``input`` start (a balanced plan is
        made at the first call of each input)."""
        if self.spec != BALANCED:
            return split_starts(layers, self.spec, policies)
        return self.balanced.starts(chain, input, layers, policies)

    def segments(self, starts: list, n_layers: int) -> list:
        """The segments from ``starts``, plain and nested as the applied plan says."""
        plan = self.applied_plan
        if plan is None:
            return segments_from(starts, n_layers)
        stored = frozenset(start for start, flag in zip(plan.starts, plan.plain) if flag)
        nested = {start: r for start, r in zip(plan.starts, plan.nested) if r is not None}
        return segments_from(starts, n_layers, stored, nested)

    def policy(self, segment: Segment, layers: list, settings) -> KeepPolicy:
        """How ``segment`` keeps what it keeps: its first layer's settings, except that
        a balanced plan's last segment stores autograd's saves as they are
        (planning/balanced_cache.py, NOTE [ Balanced segments ])."""
        if not segment.checkpointed and self.spec == BALANCED:
            return plans.balanced_last_policy()
        return settings.policy(layers[segment.start])

    def last_starts(self, layers: list, policies: tuple) -> tuple:
        """``(a line on the balanced plan or None, the starts of the last training
        call or None before any)``, for describe()."""
        if self.spec == BALANCED:
            return self.balanced.describe_last()
        return None, split_starts(layers, self.spec, policies)


__all__ = ["ChainSegments"]
