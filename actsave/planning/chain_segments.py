"""Where a CheckpointedSequential's segments come from, one :class:`ChainSegments` per
chain: its ``segments=`` value (``"sqrt"``, a count, a list of starts), a balanced plan
per input (balanced_cache.py), or the plan applied to it (``apply_plan``), whose
segments also say which run plainly and which nest their recompute. And how each
segment keeps what it keeps: the applied plan's option for it, else the settings of the
layer where it starts, except a balanced plan's last segment
(plans.balanced_last_policy).
"""
from __future__ import annotations

import warnings

import torch
from torch import nn

from .._torch_graphs import uncompiled
from ..errors import ConfigError
from ..runtime.keep_rules import KeepPolicy
from . import plan_record, plans
from .balanced_cache import BalancedPlans
from .planned_inputs import element_bytes, larger_than_planned
from .step_isolation import user_stacklevel
from .segments import BALANCED, PLANNED_STRATEGIES, Segment, SegmentsSpec, segments_from, split_starts


class ChainSegments:
    """A chain's ``segments=`` value, or the plan applied to it (module docstring).

    NOTE [ An applied plan ]
    The applied plan is the one source of its segments while it is applied: its
    starts are the ``segments`` value, and which segments run plainly and which nest
    their recompute, and how each keeps what it keeps, are read from it, not held
    beside it. Its options belong to positions, as the planner priced them: a module
    placed twice may keep by two codecs, where per-layer settings, keyed by module,
    hold one. A layer's setting changed after the plan (set_compression, set_offload)
    applies as it says, at every position of that module, and changes only what it
    sets: set_offload leaves each position's codec as the plan has it, set_compression
    each position's offload. The plan is for the layers
    it was applied to: once they change (a layer inserted, deleted or replaced) its
    positions would fall on other layers, so the chain raises until a plan for its
    layers is applied or other segments are set, which drops it."""

    def __init__(self, spec: SegmentsSpec):
        self._spec = spec
        self._hold(None, ())
        self.balanced = BalancedPlans()

    @property
    def spec(self) -> SegmentsSpec:
        return list(self.applied_plan.starts) if self.applied_plan is not None else self._spec

    @spec.setter
    def spec(self, value: SegmentsSpec) -> None:
        if self.applied_plan is not None and isinstance(value, list) and value == list(self.applied_plan.starts):
            return  # the plan's own segments: nothing changes
        self._spec = value
        self._hold(None, ())

    def apply(self, plan: "plan_record.Plan", layers: list) -> None:
        """Run by ``plan``, made for ``layers`` (NOTE [ An applied plan ])."""
        self._hold(plan, layers)
        self._warn_if_unfrozen()

    def _hold(self, plan: "plan_record.Plan | None", layers) -> None:
        """Hold ``plan`` (None: none) as the one applied to ``layers``. The layers, and
        those whose settings change after it, are held strongly until the plan goes:
        copies and pickles of the chain keep them as its layers, and changed layers keep
        the chain raising until the plan goes anyway."""
        self.applied_plan = plan
        self._applied_to = tuple(uncompiled(layer) for layer in layers)
        self._plan_policies = {} if plan is None else {  # segment start -> KeepPolicy
            start: KeepPolicy.resolve(codec) if option is None else option
            for (start, _, option), codec in zip(plan.segments, plan.saves_codecs)}
        self._set_since_plan = {}  # module -> the kinds of its settings set after it ("codec", "offload")
        self._frozen_at_plan = () if plan is None else plan.frozen  # (layer index, parameter name)
        self._planned_shape = None if plan is None else getattr(plan, "input_shape", None)  # None: not recorded
        self._planned_element_size = 0 if plan is None else getattr(plan, "input_element_size", 0)  # 0: likewise

    def settings_changed(self, modules, kind: str) -> None:
        """Note that ``modules``' setting of ``kind`` ("codec" or "offload") changed:
        where a segment starts at one, that setting, not the applied plan, says it."""
        for module in modules:
            self._set_since_plan.setdefault(module, set()).add(kind)

    def plan_keeps(self, lossy: bool = False, offload: bool = False) -> bool:
        """Whether a segment of the applied plan keeps by a lossy codec (``lossy``) or
        on the host (``offload``)."""
        return any((lossy and policy.lossy) or (offload and policy.offload) for policy in self._plan_policies.values())

    def check_current(self, layers: list) -> None:
        """Raise where the applied plan was made for other layers (NOTE [ An applied plan ])."""
        if self.applied_plan is None:
            return
        applied = self._applied_to
        # A layer compiled since (torch.compile(layer)) is the same layer.
        if len(applied) == len(layers) and all(a is uncompiled(b) for a, b in zip(applied, layers)):
            self._warn_if_unfrozen()
            return
        changed = next((i for i, (a, b) in enumerate(zip(applied, layers)) if a is not uncompiled(b)),
                       min(len(applied), len(layers)))
        raise ConfigError(
            f"this CheckpointedSequential changed after its plan was applied (the plan is for {len(applied)} "
            f"layers, the chain has {len(layers)}; the first that differs is layer {changed}): the plan's "
            "segments and options would fall on other layers. Apply a plan made for the chain as it is now "
            "(actsave.plan(actsave.profile(model, (x,)), budget)), or set model.segments to other segments "
            "(\"balanced\", a count or starts other than the plan's), which drops the plan")

    def _warn_if_unfrozen(self) -> None:
        """Warn once where parameters frozen when the plan's chain was profiled require
        grad now (gradual unfreezing): autograd saves more for them than the plan
        priced. A parameter frozen since only lowers the peak."""
        if not self._frozen_at_plan or torch.compiler.is_compiling():
            return
        unfrozen = [(i, name) for i, name in self._frozen_at_plan
                    if i < len(self._applied_to) and _requires_grad(self._applied_to[i], name)]
        if unfrozen:
            self._frozen_at_plan = ()
            warnings.warn(
                "actsave: CheckpointedSequential: parameters frozen when its plan's chain was profiled require "
                f"grad now (layer {unfrozen[0][0]}'s {unfrozen[0][1]!r}{' and others' if len(unfrozen) > 1 else ''}): "
                "autograd saves more for them than the plan priced, so its predicted peak no longer holds. Apply "
                "a plan made for the chain as it is now (actsave.plan(actsave.profile(model, (x,)), budget))",
                stacklevel=user_stacklevel())

    def _warn_if_larger(self, input) -> None:
        """Warn once where the chain runs its plan on an input larger than the one its
        chain was profiled on, in bytes or in some dimension (a batch of another size,
        longer sequences, a wider dtype): the plan's peak grows with it, past its
        budget. A smaller one (an
        epoch's last batch) only lowers the peak (NOTE [ A block plan's input ], whose
        rule this is)."""
        planned, shape = self._planned_shape, tuple(getattr(input, "shape", ()))
        element_size = input.element_size() if isinstance(input, torch.Tensor) else 0
        if not larger_than_planned(shape, planned, element_size, self._planned_element_size):
            return
        self._planned_shape = None  # once
        warnings.warn(
            f"actsave: CheckpointedSequential: its plan was made for an input of shape {list(planned)}"
            f"{element_bytes(self._planned_element_size)}, and it runs on one of shape {list(shape)}"
            f"{element_bytes(element_size)}: the activations grow with it, so the plan's predicted peak (and "
            "budget) no longer holds. Apply a plan profiled on this shape and dtype (segments=\"auto\" with these "
            "example_inputs, or actsave.plan(actsave.profile(model, (x,)), budget))", stacklevel=user_stacklevel())

    def starts_for(self, chain: nn.Module, input, layers: list, policies: tuple) -> list:
        """Where the segments of ``chain``'s call on ``input`` start (a balanced plan is
        made at the first call of each input)."""
        self.check_current(layers)
        if self._planned_shape is not None:
            self._warn_if_larger(input)
        if self.spec != BALANCED:
            return split_starts(layers, self.spec, policies)
        return self.balanced.starts(chain, input, layers, policies)

    def warn_of_unused_settings(self, policies: tuple, layers: list, starts: list, default) -> None:
        """Warn once where a codec or offload set on layers of their own (``policies``:
        each layer's; ``default``: the chain's) is used by no segment of fixed segments
        (an int, a list, "sqrt"), or by the applied plan for those set after it (a plan
        made with them chooses its starts with them; NOTE [ An applied plan ]). A setting
        sets how a segment's first layer keeps its input, and the codec of the last
        segment's saves where that one starts there (it runs plainly: its saves are
        never offloaded). Adjacent layers set alike are one setting (a slice), used
        where a segment starts among them; layers set alike apart are settings of their
        own, and the places of one module are one setting (``layers``: the chain's).
        Only a setting that keeps by a codec or on the host where the chain's default
        does not: one that undoes the default there costs nothing unused."""
        plan = self.applied_plan
        if plan is None and (self.spec == BALANCED or self.spec in PLANNED_STRATEGIES):
            return
        if plan is not None and not self._set_since_plan:
            return  # the plan's own settings, each where one of its segments starts
        starts = set(starts)
        # A plain segment keeps its saves on the device, by its codec: offload is for inputs.
        keeping_inputs = starts - {max(starts)} if plan is None else {
            start for start, _, option in plan.segments if option is not None}
        warned = self.__dict__.setdefault("_warned_unused", set())
        for indices, policy in _settings_of(policies, layers, default):
            codec_unused = policy.lossy and policy.codec != default.codec and starts.isdisjoint(indices)
            offload_unused = policy.offload and not default.offload and keeping_inputs.isdisjoint(indices)
            if (codec_unused or offload_unused) and tuple(indices) not in warned:
                warned.add(tuple(indices))
                unused = " and ".join(kind for kind, flag in (("codec", codec_unused), ("offload", offload_unused))
                                      if flag)
                warnings.warn(
                    f"actsave: CheckpointedSequential: the {unused} set on layers {indices} is not used: it sets "
                    "how a segment's first layer keeps its input, and no segment "
                    f"{'starts' if codec_unused else 'that keeps its input starts'} at those layers (they start at "
                    f"{sorted(starts)}; {_plain_ones(plan)}). {_remedy(plan, indices[0])}",
                    stacklevel=user_stacklevel())

    def segments(self, starts: list, n_layers: int) -> list:
        """The segments from ``starts``, plain and nested as the applied plan says."""
        plan = self.applied_plan
        if plan is None:
            return segments_from(starts, n_layers)
        stored = frozenset(start for start, flag in zip(plan.starts, plan.plain) if flag)
        nested = {start: r for start, r in zip(plan.starts, plan.nested) if r is not None}
        return segments_from(starts, n_layers, stored, nested)

    def policy(self, segment: Segment, layers: list, settings) -> KeepPolicy:
        """How ``segment`` keeps what it keeps: as the applied plan says, but for what its
        first layer's settings set since (NOTE [ An applied plan ]); else by those
        settings, except that a balanced plan's last segment stores autograd's saves as
        they are (planning/balanced_cache.py, NOTE [ Balanced segments ])."""
        first = layers[segment.start]
        if self.applied_plan is not None:
            planned, set_since = self._plan_policies[segment.start], self._set_since_plan.get(first)
            if set_since is None:
                return planned
            own = settings.policy(first)
            return KeepPolicy(own.codec if "codec" in set_since else planned.codec,
                              own.offload if "offload" in set_since else planned.offload)
        if not segment.checkpointed and self.spec == BALANCED:
            return plans.balanced_last_policy()
        return settings.policy(first)

    def last_starts(self, layers: list, policies: tuple) -> tuple:
        """``(a line on the balanced plan or None, the starts of the last training
        call or None before any)``, for describe()."""
        self.check_current(layers)
        if self.spec == BALANCED:
            return self.balanced.describe_last(layers)
        return None, split_starts(layers, self.spec, policies)


def _plain_ones(plan) -> str:
    """Which segments run plainly, their saves kept on the device: the last one, or
    those ``plan`` (the applied plan, or None) runs plainly."""
    if plan is None:
        return "the last one runs plainly, its saves kept on the device"
    plain = [start for start, _, option in plan.segments if option is None]
    return f"the applied plan runs those at {plain} plainly, their saves kept on the device"


def _remedy(plan, index: int) -> str:
    """How to use a setting at layer ``index`` that no segment uses."""
    if plan is None:
        return (f"Start a segment there (segments=[..., {index}, ...]), or use segments='balanced', which plans "
                "with it")
    return ("The applied plan's segments stay where it put them: plan again with this codec or offload allowed "
            "(actsave.plan(profile, budget, allow=...)), or set it where one of them starts")


def _requires_grad(layer: nn.Module, name: str) -> bool:
    try:
        return layer.get_parameter(name).requires_grad
    except AttributeError:  # gone since
        return False


def _settings_of(policies: tuple, layers: list, default) -> list:
    """``[(indices, policy)]``: the layer settings that keep by a codec or on the host
    where ``default`` does not, one per setting: adjacent layers set alike are one (a
    slice), and so are the places of one module (a setting is its module's)."""
    runs = []
    for index, policy in enumerate(policies):
        if not ((policy.lossy and policy.codec != default.codec) or (policy.offload and not default.offload)):
            continue
        if runs and runs[-1][0][-1] == index - 1 and runs[-1][1] == policy:
            runs[-1][0].append(index)
        else:
            runs.append(([index], policy))
    joined = list(range(len(runs)))  # each run's representative, runs of one module joined

    def representative(run: int) -> int:
        while joined[run] != run:
            run = joined[run]
        return run

    first_run_of = {}  # id(module) -> the first run holding it
    for run, (indices, _) in enumerate(runs):
        for index in indices:
            other = first_run_of.setdefault(id(layers[index]), run)
            joined[representative(run)] = representative(other)
    settings = {}
    for run, (indices, policy) in enumerate(runs):
        settings.setdefault(representative(run), ([], policy))[0].extend(indices)
    return [(sorted(indices), policy) for indices, policy in settings.values()]

__all__ = ["ChainSegments"]

