"""CheckpointedSequential: an ``nn.Sequential`` cut into segments that keep only
their input and recompute the rest in backward.

Segments are planned from ``segments`` each time the chain runs, so ``append`` and
friends need no bookkeeping. As in ``torch.utils.checkpoint.checkpoint_sequential``,
the last segment is not checkpointed: backward starts there, so its activations are
needed at once. An applied plan (:meth:`CheckpointedSequential.apply_plan`) may store
other segments too (``Plan.plain``): they run plainly, autograd keeping their saves
until their backward, where that is faster within the budget. Per-layer options
(``compress``, ``offload``; layer_settings.py) apply to what a segment keeps, so they
act on the layers where segments start: a checkpointed segment keeps its input; the last keeps what autograd saves,
which a lossy codec stores too (runtime/kept_saves.py; offload does not apply there).
``describe()`` shows which. Where segments start, for each value of ``segments``, is
planning/segments.py's (under a lossy codec an even split's boundaries move onto ReLU
outputs: NOTE [ Boundaries on ReLU outputs ] there). ``segments="balanced"`` (the
default) is planned on meta tensors per input and cached by planning/balanced_cache.py
(NOTE [ Balanced segments ] there).

``segments="auto"``, ``"memory"`` and ``"speed"`` plan the segments and per-segment
options from a profiled step (planning/plans.py): ``"auto"`` and ``"speed"`` (the same: the
name of OpenAI gradient-checkpointing's fast mode) take the fastest plan whose peak
activation memory fits ``budget``; ``"memory"`` the plan with the smallest peak.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Optional

import torch
from torch import nn

from .planning import plan_record, plans, profiler
from .planning.chain_segments import ChainSegments
from .planning.segments import BALANCED, PLANNED_STRATEGIES, Segment, SegmentsSpec, normalized_segments, segment_starts
from ._torch import is_sharded, named_children_of
from .layer_settings import LayerSettings, modules_named
from .errors import ConfigError, not_scriptable
from .runtime import compiled_chain
from .runtime.chain import ChainCall, run_eagerly, segments_and_policies, starts_for_call
from .runtime.keep_rules import KeepPolicy
from .text import format_table


class CheckpointedSequential(nn.Sequential):
    """Drop-in ``nn.Sequential`` that trades recompute (and, per layer, compression or
    host offload of what it keeps) for activation memory.

    Args:
        *modules: the layers, or one ``OrderedDict`` of them, as for ``nn.Sequential``.
        segments: ``"balanced"`` (default): the segments with the smallest predicted
            device peak for at most one extra forward, chosen from per-layer sizes
            under each layer's ``compress`` and ``offload`` at the first training call
            of each input shape (planning/balanced_cache.py, NOTE [ Balanced
            segments ]). ``"sqrt"``: ``round(sqrt(n))`` segments split as
            ``torch.utils.checkpoint.checkpoint_sequential`` does (O(sqrt(n))
            activation memory for one extra forward; under a lossy codec a boundary
            that falls on BatchNorm and ReLU layers moves past them onto the ReLU's
            output, where the codec stores it with one more bit, and the segment
            before it grows by the layers passed: planning/segments.py, NOTE
            [ Boundaries on ReLU outputs ]). An integer ``k`` (split likewise; any integral type,
            ``numpy.int64`` too, but not a bool), or a sorted list of the layer
            indices where segments start (0 is implied). The last segment
            is not checkpointed. ``"auto"`` (alias ``"speed"``): the fastest plan whose
            predicted peak activation memory fits ``budget``; ``"memory"``: the plan
            with the smallest predicted peak (checked against ``budget`` if given).
            Both profile one step on ``example_inputs`` when the model is built and
            choose each segment's keep option among the levers ``allow`` names
            (:func:`actsave.plan`): by default exact ones (recompute, and offload on
            CUDA), so gradients stay bit-identical; a lossy codec only if named.
        compress: codec of what segments keep (their inputs, and what the last
            segment saves, but under ``segments="balanced"``, whose last segment
            keeps autograd's saves exactly): ``None`` (exact), a codec name, or
            ``{layer: codec}`` with ``layer`` an index or child name (the rest exact).
        offload: keep segment inputs in host memory: a bool, or ``{layer: bool}``
            (not the last segment's saves: backward needs them at once).
        budget: peak activation memory in bytes for the planned strategies: what a
            training step allocates beyond parameters, buffers, gradients and
            optimizer state (planning/memory_model.py, "Budget").
        example_inputs: ``(x,)``, a batch like those of training, for the planned
            strategies.
        loss: for the planned strategies only (``"auto"``, ``"speed"``, ``"memory"``;
            with the others it raises: ``"balanced"`` plans on meta tensors, without
            a step to run it in), the training step's loss as a function of
            the chain's output (``lambda logits: F.cross_entropy(logits, targets)``
            with example targets): the profiled step runs it, so the plan counts its
            memory (a cross-entropy keeps a logits-sized log-softmax and its backward
            makes two more). Without it the plan counts only the output's gradient.
        allow: for the planned strategies, the levers the plan may use, as for
            :func:`actsave.plan`: ``"recompute"``, ``"offload"`` (CUDA) and lossy
            codecs (``"int8"``, ``"fp8"``, ...). Default ``("recompute",
            "offload")``: exact. A budget no exact plan fits raises an error that
            names the codecs that would fit it and from what budget.
        min_sqnr_db: for the planned strategies, leave out the codecs of ``allow``
            whose expected gradient SQNR is below it, as for :func:`actsave.plan`.

    Indexing, ``len``, iteration, ``append`` and ``state_dict`` keys are those of the
    ``nn.Sequential`` built from the same modules; ``chain + other`` and ``chain * k``
    are ``nn.Sequential``'s own and build a plain ``nn.Sequential`` (for a
    CheckpointedSequential, ``extend`` or ``CheckpointedSequential(*chain, *other)``).
    Per-layer options follow their module
    through ``insert``, ``append``, deletion and slicing (a slice keeps its layers'
    options and the defaults; explicit segments, which are indices of this chain, become
    ``"balanced"`` there). With ``compress=None`` outputs and
    gradients are bit-identical to the plain ``nn.Sequential``. Under
    ``torch.no_grad()`` it runs as a plain ``nn.Sequential`` and keeps nothing.
    Segments recompute with the defaults of :func:`actsave.checkpoint` (RNG state
    replayed, recomputed saves checked); for other recompute options, wrap layers in
    :class:`actsave.Checkpoint` instead.

    .. warning::
        With ``segments="balanced"`` the first training call of each input shape also
        runs the layers once on meta tensors to plan; tools that watch every module
        call or operator see it (measure from the second step). A layer that changes
        its input in place must say so with ``inplace = True``, or a segment starting
        with it raises. Weights changed in place between forward and backward raise.
        Lossy codecs give approximate gradients.
    """

    def __init__(self, *modules, segments: SegmentsSpec = BALANCED, compress=None, offload=False,
                 budget=None, example_inputs=None, loss=None, allow=None, min_sqnr_db=None):
        _check_modules(modules)
        super().__init__(*modules)
        segments = normalized_segments(segments)
        planned = isinstance(segments, str) and segments in PLANNED_STRATEGIES
        _check_planning_arguments(segments, planned, budget, example_inputs, loss, compress, offload, allow,
                                  min_sqnr_db)
        if not planned and segments != BALANCED:
            segment_starts(len(self), segments)  # validate now, not at the first forward
        self._segment_source = ChainSegments(segments)
        default_compress, layer_compress = _split_per_layer(compress, default=None)
        default_offload, layer_offload = _split_per_layer(offload, default=False)
        self._settings = LayerSettings(KeepPolicy.resolve(default_compress, default_offload))
        for layer, codec in layer_compress.items():
            self.set_compression(layer, codec)
        for layer, flag in layer_offload.items():
            self.set_offload(layer, flag)
        self._last_call = ChainCall()  # what the last training call kept (describe())
        self._decisions_by_input = ((), {})  # decision_probes.decisions_made, per input and plan: compiled_chain.py
        if planned:
            self.apply_plan(_planned(self, segments, budget, example_inputs, loss, allow, min_sqnr_db))

    @classmethod
    def from_sequential(cls, sequential: nn.Sequential, **options) -> "CheckpointedSequential":
        """A CheckpointedSequential over the same module objects (no copies). From a
        CheckpointedSequential, its options (segments, compress, offload, per-layer
        settings) carry over unless ``options`` sets them."""
        if not isinstance(sequential, nn.Sequential):
            raise ConfigError(
                f"sequential={sequential!r}: from_sequential expects an nn.Sequential, got "
                f"{type(sequential).__name__}"
            )
        # Every position, a module placed twice included (named_children() yields it once).
        layers = OrderedDict(named_children_of(sequential))
        if isinstance(sequential, CheckpointedSequential):
            return _with_options(sequential, layers, cls, **options)
        return cls(layers, **options)

    def __getitem__(self, index):
        if isinstance(index, slice):  # the slice's layers keep their options
            return _with_options(self, OrderedDict(list(self._modules.items())[index]), type(self))
        return super().__getitem__(index)

    def __setitem__(self, index, module: nn.Module) -> None:
        super().__setitem__(index, module)
        self._settings.keep_only(set(self))  # the replaced module's settings go

    def __delitem__(self, index) -> None:
        super().__delitem__(index)
        self._settings.keep_only(set(self))  # the deleted modules' settings go

    def __prepare_scriptable__(self):
        raise not_scriptable(self)

    def forward(self, input):
        if torch.jit.is_tracing():  # NOTE [ torch.export ] in compiled_calls.py
            return super().forward(input)
        if not torch.is_grad_enabled():
            # Another thread's meta step holds meta copies of the parameters meanwhile.
            self._segment_source.balanced.check_not_planning_elsewhere(self)
            return super().forward(input)
        layers = list(self)
        if torch.compiler.is_compiling():  # NOTE [ Checkpoints in a compiled graph ]
            if torch.compiler.is_exporting():  # NOTE [ torch.export ] in compiled_calls.py
                return super().forward(input)
            # Each compiler-disabled function called here is one graph break
            # (tests/compile count them).
            source = self._segment_source
            if self._settings.keeps_on_host(layers) or source.plan_keeps(offload=True):
                return compiled_chain.eager_forward_under_compile(self, input, layers)
            if not (self._settings.keeps_by_codec(layers) or source.plan_keeps(lossy=True)):
                return compiled_chain.traced_forward(self, input, layers, starts_for_call(self, input, layers))
            return compiled_chain.forward_with_graph_codecs(self, input, layers)
        return run_eagerly(self, input, layers, starts_for_call(self, input, layers))

    @property
    def segments(self) -> SegmentsSpec:
        """The ``segments=`` value the chain runs by: an applied plan's starts while it
        is applied. Setting other segments re-cuts the chain and drops the plan (its
        plain and nested segments with it; ``applied_plan`` is None again)."""
        return self._segment_source.spec

    @segments.setter
    def segments(self, value: SegmentsSpec) -> None:
        value = normalized_segments(value)
        if isinstance(value, str) and value in PLANNED_STRATEGIES:
            raise ConfigError(
                f"segments={value!r} plans from a profiled step, which setting the attribute cannot run: build "
                f"the chain with segments={value!r}, budget= and example_inputs=, or apply a plan "
                "(model.apply_plan(actsave.plan(actsave.profile(model, (x,)), budget)))")
        if value != BALANCED:
            segment_starts(len(self), value)  # validate now, not at the next forward
        self._segment_source.spec = value

    @property
    def applied_plan(self) -> Optional["plan_record.Plan"]:
        """The plan :meth:`apply_plan` applied, the source of the segments while it is
        (None before, and after ``segments`` is set to others); per-layer changes made
        after it are not in it."""
        return self._segment_source.applied_plan

    @property
    def balanced_plan(self) -> Optional["plan_record.Plan"]:
        """With ``segments="balanced"``: the :class:`~actsave.Plan` behind the segments
        of the last training call (its predicted peak included); None before the first
        call, or when that input fell back to ``"sqrt"``."""
        return self._segment_source.balanced.last_plan

    @property
    def plans_at_first_call(self) -> bool:
        """Whether the first training call of an input plans the segments (on meta
        tensors): tools that measure a step run one before (actsave.estimate does)."""
        return self.segments == BALANCED

    def set_compression(self, layer, codec) -> None:
        """Set the codec of what is kept at ``layer`` (an index, child name or slice):
        the segment input there, or the last segment's saves when it starts there
        (but under ``segments="balanced"``, whose last segment keeps them exactly)."""
        modules = modules_named(self, layer)
        self._settings.set_codec(modules, KeepPolicy.resolve(compress=codec).codec)
        self._segment_source.settings_changed(modules, "codec")

    def set_offload(self, layer, flag: bool) -> None:
        """Keep the input at ``layer`` (an index, child name or slice) on the host or not."""
        modules = modules_named(self, layer)
        self._settings.set_offload(modules, KeepPolicy.resolve(offload=flag).offload)
        self._segment_source.settings_changed(modules, "offload")

    def apply_plan(self, plan: "plan_record.Plan") -> None:
        """Run as ``plan`` (from :func:`actsave.plan`) says: its segments, for each
        checkpointed segment its codec and offload, and for each plain one the codec
        of its saves, by position (a module placed twice may keep by two codecs).
        Replaces the segments and every per-layer option set before. The plan is for
        the layers as they are now: once one is inserted, deleted or replaced, the
        chain raises at its next call until a plan for its layers is applied or other
        ``segments`` are set (NOTE [ An applied plan ])."""
        if not isinstance(plan, plan_record.Plan):
            raise ConfigError(
                f"plan={plan!r}: apply_plan expects an actsave Plan (from actsave.plan), got {type(plan).__name__}")
        if plan.n_layers != len(self):
            raise ConfigError(
                f"the plan is for {plan.n_layers} layers and this CheckpointedSequential has "
                f"{len(self)}; profile and plan this model"
            )
        self.set_compression(slice(None), None)
        self.set_offload(slice(None), False)
        for (start, _, option), saves_codec in zip(plan.segments, plan.saves_codecs):
            if option is None:  # a plain segment: the codec of its saves
                self.set_compression(start, saves_codec)
            else:
                self.set_compression(start, option.codec)
                self.set_offload(start, option.offload)
        self._segment_source.apply(plan, list(self))

    def describe(self) -> str:
        """A per-layer table: segment, what it keeps (a checkpointed segment its
        ``input``, a plain one what autograd ``saves``), codec, where, and the bytes
        actsave kept at the last training call, as :func:`actsave.kept_bytes`
        counts them (with ReLU and max-pool decisions; none when an exact plain
        segment's saves are autograd's own).

        Codec and where are how the segment starting at the layer kept, in the words
        of a printed :class:`~actsave.Plan`: its settings (``device``, or ``host`` with
        offload), but for a balanced plan's last segment, which keeps autograd's saves
        exactly whatever its first layer sets. An input its
        caller holds (the batch at layer 0, a leaf) was kept ``by reference`` at the
        last training call whatever they say: exactly, and not counted in its bytes
        (a number there is the snapshot of module state the segment keeps, such as
        BatchNorm statistics).
        With ``segments="balanced"`` the segments are those of the last training
        call, and a first line says for which input and what peak the plan predicted.
        A last call under ``torch.compile`` reports no bytes (a last line says why, and
        that a plan's predicted peak is the eager code's).
        FSDP2-sharded parameters get a last line too: what of FSDP2's own bytes the
        plan counts, and what it does not."""
        rows = [("layer", "name", "type", "segment", "keeps", "codec", "where", "kept bytes")]
        names = list(self._modules)
        layers = list(self)
        header, starts = self._segment_source.last_starts(layers, self._settings.policies(layers))
        if starts is None:
            return header
        for number, (segment, policy) in enumerate(zip(*segments_and_policies(self, starts, layers))):
            keeps = ("input, nested" if segment.nested else "input") if segment.checkpointed else "saves"
            for i in range(segment.start, segment.stop):
                row = (str(i), names[i], type(self[i]).__name__, str(number))
                if i == segment.start:
                    row += (keeps, *_kept_columns(self._last_call, segment, policy))
                rows.append(row + ("",) * (len(rows[0]) - len(row)))
        lines = [header, format_table(rows)] if header is not None else [format_table(rows)]
        if self._last_call.traced:
            codecs = " (those set to keep by a codec encoded in it)" if self._settings.keeps_by_codec(layers) else ""
            lines.append(f"The last training call ran in a compiled graph, which chose what each segment "
                         f"saves{codecs}: no kept bytes (NOTE [ Checkpoints in a compiled graph ]). A plan "
                         "predicts the eager code's peak; a compiled backward may hold more at once: "
                         "docs/limits.md, \"torch.compile\".")
        if any(is_sharded(p) for p in self.parameters()):
            lines.append("The parameters are FSDP2-sharded: a balanced plan counts the parameters FSDP2 gathers "
                         "for each layer, which a recompute keeps gathered until the layer's backward, and one "
                         "reduce-scatter input; not those of a unit over several layers (the root's) nor FSDP2's "
                         "staging buffers (NOTE [ Gathered parameters ]): docs/limits.md, \"FSDP2 and DDP\".")
        return "\n".join(lines)

    def extra_repr(self) -> str:
        return f"segments={self.segments!r}"


def _kept_columns(call: ChainCall, segment: Segment, policy: KeepPolicy) -> tuple:
    """(codec, where, kept bytes) of describe()'s row for ``segment``, kept by ``policy``
    at the last training call, ``call``."""
    kept = call.kept.get(segment.start)
    if segment.start in call.by_reference:
        # The caller's tensor itself: only the decisions kept beside it are actsave's
        # (none at all where the segment saved nothing: it kept no input either).
        return "none", "by reference", str(max(kept - call.by_reference[segment.start], 0))
    # A plain segment's saves stay on the device: its backward reads them at once.
    where = plan_record.where_kept(policy.offload and segment.checkpointed)
    return policy.codec.name, where, "" if kept is None else str(kept)


def _with_options(chain: CheckpointedSequential, layers: OrderedDict, cls, **options) -> CheckpointedSequential:
    """``cls`` over ``layers`` (modules of ``chain``) with its options; those
    given in ``options`` replace them (``compress`` or ``offload`` given: no
    per-layer setting of that kind carries over). Explicit segments (a list or a
    count) belong to ``chain``, so a new chain gets the default then."""
    strategy = chain.segments if chain.segments in (BALANCED, "sqrt") else BALANCED
    default = chain._settings.default
    built = cls(layers, **{"segments": strategy, "compress": default.codec, "offload": default.offload,
                           **options})
    chain._settings.carry_to(built._settings, set(built), "compress" not in options, "offload" not in options)
    return built


def _check_modules(modules: tuple) -> None:
    if len(modules) == 1 and isinstance(modules[0], (nn.Sequential, nn.ModuleList)):
        # One container would be one layer: the chain's only segment is its last, which
        # is never checkpointed, so nothing would be saved, silently. Unpacking it here
        # instead would give other state_dict keys than nn.Sequential(container) has.
        kind = type(modules[0]).__name__
        if isinstance(modules[0], nn.Sequential):
            fix = ("CheckpointedSequential(*seq), or CheckpointedSequential.from_sequential(seq), which also keeps "
                   "its child names (state_dict keys)")
        else:
            fix = "CheckpointedSequential(*module_list)"
        raise ConfigError(
            f"CheckpointedSequential got one {kind} as its only layer: it would run as one segment, which is "
            f"never checkpointed, so no memory would be saved. Pass its layers instead: {fix}")
    layers = modules[0].values() if len(modules) == 1 and isinstance(modules[0], OrderedDict) else modules
    for i, layer in enumerate(layers):
        if not isinstance(layer, nn.Module):
            raise ConfigError(
                f"layer {i} is {layer!r} of type {type(layer).__name__}, not an nn.Module; "
                "CheckpointedSequential takes modules as nn.Sequential does: wrap a "
                "function in a small nn.Module"
            )


def _check_planning_arguments(segments, planned: bool, budget, example_inputs, loss, compress, offload,
                              allow, min_sqnr_db) -> None:
    if not planned:
        given = [name for name, value in (("budget", budget), ("example_inputs", example_inputs), ("loss", loss),
                                          ("allow", allow), ("min_sqnr_db", min_sqnr_db)) if value is not None]
        if given:
            # segments="balanced" plans on meta tensors, with no step to run a loss in;
            # fixed segments plan nothing: these would change nothing, silently.
            raise ConfigError(
                f"{', '.join(name + '=' for name in given)} plan a profiled training step, which only "
                f"segments={list(PLANNED_STRATEGIES)} run, not segments={segments!r}: for the fastest "
                "segments within a budget pass segments='auto', budget= and example_inputs= (and loss= to count "
                "the loss's memory), or leave them out"
            )
        return
    if example_inputs is None:
        raise ConfigError(f"segments={segments!r} profiles one training step: pass example_inputs=(x,), "
                          "a batch like those of training")
    if budget is None and segments != "memory":
        raise ConfigError(f"segments={segments!r} needs budget=, the peak activation memory in bytes; "
                          "segments='memory' needs none")
    if compress is not None or offload is not False:
        raise ConfigError(
            f"segments={segments!r} chooses codecs and offload itself: leave compress and offload unset, and "
            "name the levers it may use in allow= (a lossy codec only if named: allow=('recompute', 'int8'))"
        )


def _planned(model: "CheckpointedSequential", strategy: str, budget, example_inputs, loss, allow,
             min_sqnr_db) -> "plan_record.Plan":
    if any(is_sharded(p) for p in model.parameters()):
        # Each rank would plan from its own measured times, and a segment's recompute
        # gathers its units (collectives): two ranks with other segments gather in
        # other orders and hang. The measured step also runs the layers outside the
        # root's FSDP2 hooks, which FSDP2 refuses afterwards.
        raise ConfigError(
            f"segments={strategy!r} plans from a measured step, which is not supported on sharded (DTensor) "
            "layers such as FSDP2 makes: "
            "each rank would measure its own times and could choose other segments, whose recomputes gather "
            "parameters in another order. Use the default segments='balanced' (planned on meta tensors alike on "
            "every rank, FSDP2's gathered parameters counted), or plan before sharding and apply_plan on every "
            "rank the plan made on one (docs/limits.md, \"FSDP2 and DDP\")")
    objective = "memory" if strategy == "memory" else "time"
    levers = plans.DEFAULT_ALLOW if allow is None else allow
    return plans.plan(profiler.profile(model, example_inputs, loss=loss), budget, min_sqnr_db=min_sqnr_db,
                      objective=objective, allow=levers)


def _split_per_layer(value, default) -> tuple:
    """``(global value, {layer: value})`` from a global value or a per-layer dict."""
    if isinstance(value, dict):
        return default, dict(value)
    return value, {}


__all__ = ["CheckpointedSequential"]
