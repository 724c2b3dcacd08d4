"""Automatic checkpointing plans: choose where segments start and how each keeps its
input, by an exact dynamic program (solver.py) over a stated memory model
(memory_model.py), from a profiled step (profiler.py).

    prof = actsave.profile(model, (x,))            # one measured training step
    print(prof)                                    # per-layer bytes and times
    p = actsave.plan(prof, budget=8 * 2**30)       # the fastest plan within 8 GiB
    print(p)
    model.apply_plan(p)                            # a CheckpointedSequential

or in one line: ``CheckpointedSequential(*layers, segments="auto", budget=...,
example_inputs=(x,))``. Sizes alone, at any scale and without the device, come from a
profile on meta tensors (:func:`profile` with a meta ``x``); :func:`balanced` plans
such a profile with each layer's keep option fixed, which is what
``CheckpointedSequential``'s default ``segments="balanced"`` does at its first call.

Limits: the chain must pass one tensor from layer to layer. Timings come from one
step. The plan is for the batch shape profiled.
"""
from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Optional, Sequence, Union

from ..checks import byte_count, flag, integral, real_number
from ..codecs import EXPECTED_GRADIENT_SQNR_DB, LOSSY_CODECS, available_codecs, get_codec
from ..devices import host_is_separate
from ..errors import ConfigError, InternalError, warn_renamed
from ..runtime.nested import Range
from ..runtime.keep_rules import EXACT, KeepPolicy, kept_as
from ..text import mib
from .memory_model import CostModel
from .profiler import Profile
from .plan_record import Plan
from .planned_segment import PlannedSegment
from .solver import fastest_within, smallest_headroom, smallest_nested_headroom

# Every lossy codec name of codecs.py, aliases included ("fp8" is e4m3), is a lever.
LEVER_CODECS = {name: get_codec(name).name for name in available_codecs() if not get_codec(name).lossless}
LEVERS = ("recompute", *LEVER_CODECS, "offload")
# Exact levers only: a plan changes no gradient unless a codec is asked for by name.
# ("offload" is used where the host is separate: CUDA.)
DEFAULT_ALLOW = ("recompute", "offload")
OBJECTIVES = ("time", "memory")


def plan(profile: Profile, budget: Optional[int] = None, min_sqnr_db: Optional[float] = None,
         allow: Sequence[str] = DEFAULT_ALLOW, objective: str = "time",
         max_checkpointed_layers: Optional[int] = None, compress_saves: bool = True,
         plain_middle: bool = True, **renamed) -> Plan:
    """Choose segments and keep options for the profiled chain.

    Args:
        profile: from :func:`profile`.
        budget: peak activation memory in bytes (module docstring, "Budget");
            None only with ``objective="memory"``.
        min_sqnr_db: codecs whose expected gradient SQNR
            (:data:`EXPECTED_GRADIENT_SQNR_DB`) is below it are not used.
        allow: the levers: "recompute" (checkpoint segments; the others need it),
            "int8", "fp8" (e4m3; "fp8_e4m3", "fp8_e5m2" name one) and "offload"
            (used on CUDA only: on a CPU model host memory is device memory).
            Default :data:`DEFAULT_ALLOW`, the exact levers: a plan makes gradients
            approximate only where a lossy codec is named here.
        objective: "time": the fastest plan whose predicted peak fits ``budget``,
            where a checkpointed segment's recompute may nest checkpoints of its own
            (:attr:`Plan.nested`; exact segments of timed chains of at most
            ``nested_solver.MAX_LAYERS`` layers); "memory": the smallest predicted
            peak (the fastest plan that reaches it), nested where "time" may nest,
            checked against ``budget`` unless it is None.
        max_checkpointed_layers: the most layers one checkpointed segment may hold
            (None: any number). 1 for layers that can only be checkpointed one by one,
            as the blocks of :func:`actsave.plan_blocks` (a checkpoint cannot span
            blocks that the model's own loop calls).
        compress_saves: whether plain segments (never recomputed) may keep
            autograd's saves by one of the lossy codecs ``allow`` and ``min_sqnr_db``
            permit (:attr:`Plan.saves_codecs`), where the profile recorded its saves:
            the last, and with ``plain_middle`` the others. False where they stay as
            autograd keeps them, as the blocks of :func:`actsave.plan_blocks`.
        plain_middle: whether segments before the last may be plain too (run
            plainly, never recomputed: :attr:`Plan.plain`), where that is faster
            within the budget than checkpointing them.
        compress_stored, store_middle: deprecated names of ``compress_saves`` and
            ``plain_middle``.

    Raises :class:`~actsave.ConfigError` when no plan fits, stating the smallest
    budget this search finds a plan within (nested checkpoints included where it
    nests), and for each lossy codec not allowed that lowers it, to what.

    .. warning::
        Predictions are for the profiled step: another batch shape, dtype or device
        needs another profile. The model does not predict allocator fragmentation,
        and on CUDA kernels that save other tensors than the CPU/meta ones (flash
        attention, cuDNN workspaces) shift the peak; keep a margin in ``budget``.
    """
    budget = _check_plan_arguments(profile, budget, objective, max_checkpointed_layers)
    compress_saves, plain_middle = _renamed_keywords(plan, renamed, compress_saves=compress_saves,
                                                     plain_middle=plain_middle)
    flag(compress_saves, "compress_saves")
    flag(plain_middle, "plain_middle")
    keep_options(allow, min_sqnr_db, profile.device)  # checks allow and min_sqnr_db
    longest = max_checkpointed_layers
    # Nested checkpoints are searched where the profile has times (on meta tensors
    # nesting would look free), for either objective, so that "the smallest" is one
    # figure: objective="memory"'s peak is the one an infeasible budget's error states.
    # A chain that runs a module in two layers is not nested: runtime/nested.py.
    search = Search(profile, tuple(allow), min_sqnr_db, longest, compress_saves, plain_middle,
                    nest=profile.timed and not profile.repeats_modules)
    model = search.model()
    found = None
    if objective == "time":
        headroom = budget - model.chain_input
        found = fastest_within(model, headroom, longest, nest=search.nest)
    if found is None:
        # The smallest plan, where it fits: the nested search's grid is the headroom's,
        # so a budget between that plan's peak and the grid point above it reaches it
        # only so.
        smallest, _, found, headroom = search.smallest_plan(model)
        if budget is not None and smallest > budget:
            raise ConfigError(search.infeasible(budget, "plan", model))
    return dataclasses.replace(_plan_of(model, *found, budget, bound=model.chain_input + headroom),
                               frozen=profile.frozen, input_shape=profile.input_shape,
                               input_element_size=profile.input_element_size)


@dataclass(frozen=True)
class Search:
    """The search :func:`plan` runs for a profile and its levers, for what its error
    says when no plan fits: the smallest budget it finds a plan within, and how much
    lower each lossy codec not allowed would bring it (lossy codecs are opt-in)."""

    profile: Profile
    allow: tuple
    min_sqnr_db: Optional[float]
    longest: Optional[int]
    compress_saves: bool
    plain_middle: bool
    nest: bool  # objective "time": exact segments may nest checkpoints
    suggest_codecs: bool = True  # False where codecs cannot be used (blocks.py)

    def model(self) -> CostModel:
        """The model searched: the levers' keep options for checkpointed segments, and
        for the plain segment's saves the lossy codecs among them where ``compress_saves``."""
        options = keep_options(self.allow, self.min_sqnr_db, self.profile.device)
        stored_codecs = ["none"]
        if self.compress_saves and self.profile.stored_saves is not None:
            stored_codecs += sorted({option.codec.name for option in options if option.lossy})
        return CostModel(self.profile, options, stored_codecs=stored_codecs, plain_middle=self.plain_middle)

    def smallest_budget(self, model: CostModel, start=None) -> tuple:
        """(the smallest budget this search finds a plan within for ``model``, the
        nested table that reaches it or None): :meth:`smallest_plan`'s peak."""
        smallest, table, _, _ = self.smallest_plan(model, start)
        return smallest, table

    def smallest_plan(self, model: CostModel, start=None) -> tuple:
        """(the least predicted peak of a plan this search finds for ``model``, the
        nested table that reaches it or None, that plan as fastest_within gives it, the
        headroom it was found within). The nested search's headroom is a point of its
        byte grid, at or above that plan's peak: what objective="memory" plans, and any
        budget from that peak on plans (plan() falls back to it)."""
        if self.nest:
            headroom, table = smallest_nested_headroom(model, self.longest, start)
        else:
            headroom, table = smallest_headroom(model, self.longest), None
        found = fastest_within(model, headroom, self.longest, nest=self.nest)
        if found is None:  # from ``start``'s table, whose grid plan() does not search: its bound
            return model.chain_input + headroom, table, None, headroom
        peak = _plan_of(model, *found, None, bound=model.chain_input + headroom).predicted_peak_bytes
        return peak, table, found, headroom

    def with_codecs(self, smallest: float, table) -> dict:
        """{codec: the smallest budget with that lossy codec allowed too} for the
        codecs not allowed (and not below ``min_sqnr_db``) that lower ``smallest``."""
        if "recompute" not in self.allow or not self.suggest_codecs:
            return {}
        allowed = {LEVER_CODECS[lever] for lever in self.allow if lever in LEVER_CODECS}
        lower = {}
        for codec in LOSSY_CODECS:
            if codec in allowed or (self.min_sqnr_db is not None and
                                    EXPECTED_GRADIENT_SQNR_DB[codec] < self.min_sqnr_db):
                continue
            model = dataclasses.replace(self, allow=(*self.allow, codec)).model()
            budget, _ = self.smallest_budget(model, (smallest - model.chain_input, table))
            if budget < smallest:
                lower[codec] = budget
        return lower

    def infeasible(self, budget, what: str, model: CostModel, floor: float = 0) -> str:
        """The error for ``budget``: its smallest feasible budget (at least ``floor``,
        what the step needs outside the chain), and the lossy codecs that would fit."""
        searched, table = self.smallest_budget(model)
        smallest = max(searched, floor)
        # Only the levers this device has: offload moves nothing where the host's memory is the device's.
        usable = tuple(lever for lever in self.allow if lever != "offload" or host_is_separate(self.profile.device))
        reach = "nested checkpoints included" if table is not None else "single-level plans"
        lower = {codec: max(b, floor) for codec, b in self.with_codecs(searched, table).items()}
        return infeasible_message(what, budget, usable, self.min_sqnr_db, smallest, reach, lower)


def infeasible_message(what: str, budget, levers: tuple, min_sqnr_db, smallest: float, reach: str,
                       lower: dict, left_out: str = "") -> str:
    """The error of a budget no plan fits: the smallest feasible budget with ``levers``
    (``reach``: how it was searched), and the lossy codecs not allowed that lower it
    (``lower``: codec -> its smallest budget), with the one that fits this budget;
    ``left_out``: a sentence on levers the caller left out, before the advice."""
    named = f"allow={levers}" + ("" if min_sqnr_db is None else f" and min_sqnr_db={min_sqnr_db}")
    # The budget as given: a real number of bytes, a fraction included (never rounded).
    message = (f"no {what} fits budget={budget:,} bytes ({mib(budget)} MiB) with {named}: the smallest "
               f"feasible budget is {int(smallest):,} bytes ({mib(smallest)} MiB) ({reach}).")
    lower = {codec: b for codec, b in lower.items() if b < smallest}
    if lower:
        fitting = [codec for codec, b in lower.items() if b <= budget]
        message += " A lossy codec, which keeps tensors in 8 bits and makes gradients approximate, lowers it: " + \
            ", ".join(f"{codec!r} (expected gradient SQNR {EXPECTED_GRADIENT_SQNR_DB[codec]:g} dB) to "
                      f"{int(b):,} bytes ({mib(b)} MiB)" for codec, b in lower.items()) + "."
        if fitting:
            message += (f" This budget fits with allow={(*levers, fitting[0])}"
                        + (f" (or {', '.join(repr(c) for c in fitting[1:])} in its place)" if fitting[1:] else "")
                        + ".")
    return message + left_out + " Raise the budget, allow more levers, or use a smaller batch."


def balanced_last_policy() -> KeepPolicy:
    """How a balanced plan's last segment (the plain one) keeps autograd's saves:
    exactly, whatever its first layer's codec (balanced_cache.py, NOTE [ Balanced
    segments ]). The runtime stores it so, and balanced() prices and plans it so."""
    return EXACT


def balanced(profile: Profile, options: Sequence[KeepPolicy]) -> Plan:
    """The plan of ``CheckpointedSequential(segments="balanced")``: where segments
    start when a segment starting at layer i keeps its input as ``options[i]`` says
    (an input the caller holds, or a non-float one, is kept by reference whatever it
    says: runtime/keep_rules.py's kept_as). The smallest predicted peak over single-level plans (each layer recomputed
    at most once), so a codec or offload that makes kept inputs cheaper buys more,
    shorter segments; among the plans with that peak, the fastest, which on a profile
    without times (meta tensors) is the one that recomputes the fewest layers."""
    if not isinstance(profile, Profile):
        raise ConfigError(f"balanced expects a Profile from actsave.profile, got {type(profile).__name__}")
    if len(options) != len(profile.layers) or not all(isinstance(o, KeepPolicy) for o in options):
        raise ConfigError(f"balanced needs one KeepPolicy per layer ({len(profile.layers)}), got {options!r}")
    model = CostModel(profile, [], fixed=options, stored_codecs=(balanced_last_policy().codec.name,))
    headroom = smallest_headroom(model)
    chosen = _plan_of(model, *fastest_within(model, headroom), budget=None, bound=model.chain_input + headroom)
    # The plan says where the runtime keeps each input, as describe() does: an input
    # offloaded on a CPU goes to the host pool there too, though the model prices its
    # bytes as the device's (memory_model.effective_option).
    offload = tuple(kept_as(options[start], profile.layers[start].input_encodable).offload and not stored
                    for start, stored in zip(chosen.starts, chosen.plain))
    return dataclasses.replace(chosen, offload=offload)


def _plan_of(model: CostModel, segments: list, nested: list, budget: Optional[int], bound: float) -> Plan:
    """The Plan of a dynamic program's PlannedSegments and nested Ranges
    (fastest_within), with the model's predictions, which must fit the peak ``bound``
    the program planned for."""
    before_last = [model.options[s.option] if s.is_checkpointed else KeepPolicy.resolve(model.stored_codecs[s.codec])
                   for s in segments[:-1]]
    draft = Plan(model.n, tuple(s.start for s in segments), tuple(o.codec.name for o in before_last),
                 tuple(o.offload for o in before_last), 0, 0.0, 0, budget,
                 saves_codec=model.stored_codecs[segments[-1].codec],
                 plain=tuple(s.is_plain for s in segments[:-1]), nested=tuple(nested))
    plan = _with_predictions(draft, model, segments)
    if not plan.predicted_peak_bytes <= bound:
        raise InternalError(
            f"the planner chose segments starting at {list(plan.starts)} for a peak of at most {int(bound):,} "
            f"bytes, but the memory model predicts {plan.predicted_peak_bytes:,} for them: the dynamic program "
            "and the model disagree")
    return plan


def _with_predictions(draft: Plan, model: CostModel, segments: list) -> Plan:
    """``draft`` with the model's predictions for ``segments`` (its PlannedSegments:
    CostModel.predict)."""
    peak, seconds, peak_segment = model.predict(segments, draft.nested)
    return dataclasses.replace(draft, predicted_peak_bytes=int(peak), predicted_step_seconds=float(seconds),
                               peak_segment=peak_segment)


def keep_options(allow: Sequence[str], min_sqnr_db: Optional[float], device: str, more_levers: tuple = ()) -> list:
    """The KeepPolicys ``allow`` and ``min_sqnr_db`` permit on ``device`` (empty:
    nothing may be checkpointed). ``more_levers``: those a caller's planner takes besides
    :data:`LEVERS` (the block planner's), left out of ``allow`` already and named in
    its errors."""
    if min_sqnr_db is not None and not real_number(min_sqnr_db):
        raise ConfigError(f"min_sqnr_db={min_sqnr_db!r} must be a number of dB or None")
    valid = [*LEVERS, *more_levers]
    if isinstance(allow, str) or not isinstance(allow, Iterable) or not all(isinstance(lever, str) for lever in allow):
        raise ConfigError(f"allow={allow!r} must be a tuple of lever names, some of {valid}")
    unknown = [lever for lever in allow if lever not in LEVERS]
    if unknown:
        raise ConfigError(f"allow names unknown levers {unknown}; use some of {valid}")
    if "recompute" not in allow:
        if allow:
            raise ConfigError(
                f"allow={tuple(allow)!r}: codecs and offload act on the inputs of checkpointed "
                "segments, so they need 'recompute' in allow too"
            )
        return []
    codecs = ["none"] + sorted({LEVER_CODECS[lever] for lever in allow if lever in LEVER_CODECS})
    codecs = [c for c in codecs if min_sqnr_db is None or EXPECTED_GRADIENT_SQNR_DB[c] >= min_sqnr_db]
    places = [False, True] if "offload" in allow and host_is_separate(device) else [False]
    return [KeepPolicy.resolve(codec, offload) for codec in codecs for offload in places]


def _check_plan_arguments(profile, budget, objective, max_checkpointed_layers=None) -> Union[int, float, None]:
    if not isinstance(profile, Profile):
        raise ConfigError(f"profile={profile!r}: plan expects a Profile from actsave.profile(model, "
                          f"example_inputs), got {type(profile).__name__}")
    if max_checkpointed_layers is not None and (integral(max_checkpointed_layers) or 0) < 1:
        raise ConfigError(f"max_checkpointed_layers={max_checkpointed_layers!r} must be None (any number) or an "
                          "integer >= 1: the most layers one checkpointed segment may hold")
    if objective not in OBJECTIVES:
        raise ConfigError(f"objective={objective!r} must be one of {list(OBJECTIVES)}")
    if objective == "time" and not profile.timed:
        raise ConfigError("this profile was measured on meta tensors and has no times, so it has no fastest "
                          "plan; plan it with objective='memory', or profile on the device for times")
    if budget is None:
        if objective == "time":
            raise ConfigError("budget (peak activation bytes) is required for the fastest plan; pass "
                              "objective='memory' for the smallest peak without a budget")
        return None
    number = byte_count(budget)
    if number is None:
        raise ConfigError(f"budget={budget!r} must be a positive, finite number of bytes (peak activation memory)")
    return number


def predict(profile: Profile, starts: Sequence[int], codecs: Optional[Sequence[str]] = None,
            offload: Optional[Sequence[bool]] = None, budget: Optional[int] = None,
            saves_codec: str = "none", plain: Optional[Sequence[bool]] = None,
            nested: Optional[Sequence[Optional[Range]]] = None, **renamed) -> Plan:
    """The :class:`Plan` for given segment starts (and per segment before the last its
    codec and offload, default exact, on the device, and whether it is plain, default
    not, and the Range that nests its recompute's checkpoints, default None; the codec
    of the last segment's saves, default as they are), with the model's
    predictions (``stored_codec`` and ``stored``: deprecated names of ``saves_codec``
    and ``plain``): to
    compare any segmentation, "sqrt"'s say, with a planned one. Each segment is
    evaluated from its own layers' events (CostModel.predict), not from the tables the
    dynamic programs read."""
    saves_codec, plain = _renamed_keywords(predict, renamed, saves_codec=saves_codec, plain=plain)
    starts = list(starts)
    checkpointed = len(starts) - 1
    codecs = ["none"] * checkpointed if codecs is None else [get_codec(c).name for c in codecs]
    offload = [False] * checkpointed if offload is None else list(offload)
    draft = Plan(len(profile.layers), tuple(starts), tuple(codecs), tuple(offload), 0, 0.0, 0, budget,
                 saves_codec=get_codec(saves_codec).name, plain=() if plain is None else tuple(plain),
                 nested=() if nested is None else tuple(nested))
    saves_codecs = draft.saves_codecs
    if set(saves_codecs) - {None, "none"} and profile.stored_saves is None:
        raise ConfigError(f"saves codecs {saves_codecs!r}: this profile records no saves of a plain segment "
                          "(profiled with stored_saves=False), so they can only be predicted exact; pass "
                          "saves_codec='none' (and codec 'none' for each plain segment), or profile with "
                          "stored_saves=True")
    policies = [None if option is None else kept_as(option, profile.layers[a].input_encodable)
                for a, _, option in draft.segments[:-1]]
    options = sorted(set(policies) - {None}, key=lambda option: (option.codec.name, option.offload))
    stored_codecs = ["none", *sorted(set(saves_codecs) - {None, "none"})]
    segments = [PlannedSegment.plain(a, b, stored_codecs.index(codec)) if policy is None
                else PlannedSegment.checkpointed(a, b, options.index(policy))
                for (a, b, _), policy, codec in zip(draft.segments, policies, saves_codecs)]
    model = CostModel(profile, options, stored_codecs=stored_codecs)
    last = PlannedSegment.plain_last(draft.starts[-1], draft.n_layers, stored_codecs.index(draft.saves_codec))
    return dataclasses.replace(_with_predictions(draft, model, [*segments, last]), frozen=profile.frozen,
                               input_shape=profile.input_shape,
                               input_element_size=profile.input_element_size)


# Keywords renamed so that "plain" names a segment run plainly and "stored" what is held
# for backward: the old names work, with a DeprecationWarning, for one release.
_RENAMED_KEYWORDS = {"compress_stored": "compress_saves", "store_middle": "plain_middle",
                     "stored_codec": "saves_codec", "stored": "plain"}


def _renamed_keywords(function, given: dict, **values) -> tuple:
    """``values`` (the new keywords' values of ``function``'s call, by name, in order),
    each replaced by its old name's value where ``given`` (the call's other keywords)
    holds that; any other keyword in ``given`` is refused as Python refuses an unknown
    one. An old name and its new one given other values is refused: which one was meant
    is unknown (a new one left at its default is taken as not given)."""
    name, defaults = function.__name__, inspect.signature(function).parameters
    for old, value in given.items():
        new = _RENAMED_KEYWORDS.get(old)
        if new not in values:
            raise TypeError(f"{name}() got an unexpected keyword argument {old!r}")
        if values[new] != defaults[new].default and values[new] != value:
            raise ConfigError(f"{name}() got both {old}={value!r} and {new}={values[new]!r}: {old} is the "
                              f"deprecated name of {new}; pass {new} alone")
        warn_renamed(f"{name}({old}=...)", f"{name}({new}=...)", stacklevel=4)
        values[new] = value
    return tuple(values.values())


__all__ = ["plan", "balanced", "predict", "keep_options", "Plan", "EXPECTED_GRADIENT_SQNR_DB", "DEFAULT_ALLOW",
           "LEVERS"]
