"""The dynamic programs against brute force over every plan of small chains (their
time on 1,000 layers: bench/planning_time.py)."""
import dataclasses
import itertools
import math
import random

import numpy as np
import pytest
import torch
from planning.chains import chain, with_host_copies
from torch import nn

import actsave
from actsave import CheckpointedSequential
from actsave.planning import nested_solver, pareto, plain_model, plans, solver
from actsave.planning.checkpoint_host import CheckpointHostWork
from actsave.runtime.keep_rules import KeepPolicy

PLAIN = "plain"  # in all_plans' options: a plain (not checkpointed) segment before the last


def plain_kept_by(codec: str) -> tuple:
    """In all_plans' options: a plain segment before the last whose saves ``codec`` keeps."""
    return PLAIN, codec


def all_plans(n: int, options: list):
    """(starts, option of each segment before the last, codec of the last segment's
    saves) of every plan: the last segment may use the lossy codecs of ``options``
    (None: an option that stands for any; PLAIN: a plain middle segment;
    plain_kept_by(codec): one whose saves a lossy codec keeps)."""
    lossy = {o.codec.name for o in options if isinstance(o, KeepPolicy) and o.lossy}
    stored_codecs = ["none", *sorted(lossy)]
    for inner in itertools.chain.from_iterable(itertools.combinations(range(1, n), k) for k in range(n)):
        for chosen in itertools.product(options, repeat=len(inner)):
            for stored in stored_codecs:
                yield [0, *inner], chosen, stored


def predicted(prof, starts: list, chosen: tuple, stored_codec: str):
    """plans.predict of one of all_plans' plans."""
    middle = [o == PLAIN or isinstance(o, tuple) for o in chosen]
    policies = [KeepPolicy.resolve(o[1] if isinstance(o, tuple) else None) if flag else o
                for o, flag in zip(chosen, middle)]
    return plans.predict(prof, starts, [o.codec.name for o in policies], [o.offload for o in policies],
                         saves_codec=stored_codec, plain=middle)


def views_chain() -> list:
    """A ReLU's output (which it saves) passed on through two views: at boundaries 2
    and 3 two plain segments are not one (CostModel.plain_middle_reach)."""
    torch.manual_seed(0)
    return [nn.Linear(32, 64), nn.ReLU(), nn.Unflatten(1, (8, 8)), nn.Flatten(), nn.Tanh(), nn.Linear(64, 32)]


@pytest.fixture(params=["direct", "swept"])
def reading(request, monkeypatch):
    """The time DP reading every label at each b ("direct"), or through its sweeps
    from the first b ("swept"; pareto.Sweep, else used from _SWEPT labels on)."""
    if request.param == "swept":
        monkeypatch.setattr(solver, "_SWEPT", 0)
    return request.param


# Tanh, Sigmoid and ReLU save their outputs: a plain segment ending after one holds the
# next segment's input (memory_model.py, "A tensor at a plain boundary").
@pytest.mark.parametrize("device, n, kinds", [("cpu", 6, ["gelu", "relu", "residual"]),
                                              ("cpu", 6, ["tanh", "sigmoid", "relu"]),
                                              ("cpu", 6, "views"),
                                              ("cuda", 4, ["gelu", "relu", "residual"]),
                                              ("cuda", 4, ["sigmoid", "tanh"])])
def test_dynamic_program_agrees_with_brute_force(device, n, kinds, reading):
    layers = views_chain() if kinds == "views" else chain(kinds, [64, 32, 64])
    model = CheckpointedSequential(*layers[:n])
    prof = actsave.profile(model, (torch.randn(32, 32) * 1,))
    if device == "cuda":
        prof = with_host_copies(prof)
    options = [*plans.keep_options(plans.DEFAULT_ALLOW, None, device), PLAIN]
    every_plan = [predicted(prof, starts, chosen, stored) for starts, chosen, stored in all_plans(n, options)]
    assert any(any(p.plain) for p in every_plan if p.predicted_step_seconds == min(
        q.predicted_step_seconds for q in every_plan if q.predicted_peak_bytes <= p.predicted_peak_bytes))
    smallest = min(p.predicted_peak_bytes for p in every_plan)
    assert actsave.plan(prof, None, objective="memory").predicted_peak_bytes == smallest
    peaks = sorted({p.predicted_peak_bytes for p in every_plan})
    for budget in (peaks[0], peaks[len(peaks) // 3], peaks[len(peaks) // 2], peaks[-1]):
        fastest = min(p.predicted_step_seconds for p in every_plan if p.predicted_peak_bytes <= budget)
        planned = actsave.plan(prof, budget)
        assert planned.predicted_peak_bytes <= budget
        assert math.isclose(planned.predicted_step_seconds, fastest, rel_tol=1e-9)


def test_dynamic_program_with_the_checkpoints_host_work_agrees_with_brute_force(reading):
    # A call's and a save's host work far above the layers' times (checkpoint_host.py):
    # the terms of the end (saves before b) and of the start go through the sweeps too.
    model = CheckpointedSequential(*chain(["gelu", "relu", "residual"], [64, 32, 64])[:6])
    prof = dataclasses.replace(actsave.profile(model, (torch.randn(32, 32) * 1,)),
                               checkpoint_host=CheckpointHostWork(call_s=0.05, save_s=0.002))
    options = [*plans.keep_options(plans.DEFAULT_ALLOW, None, "cpu"), PLAIN]
    every_plan = [predicted(prof, starts, chosen, stored) for starts, chosen, stored in all_plans(6, options)]
    peaks = sorted({p.predicted_peak_bytes for p in every_plan})
    for budget in peaks[::max(1, len(peaks) // 8)]:
        fastest = min(p.predicted_step_seconds for p in every_plan if p.predicted_peak_bytes <= budget)
        planned = actsave.plan(prof, budget)
        assert planned.predicted_peak_bytes <= budget
        assert math.isclose(planned.predicted_step_seconds, fastest, rel_tol=1e-9)


@pytest.mark.parametrize("kinds", [["gelu", "relu", "tanh"], ["gelu", "residual", "relu"]])
def test_dynamic_program_with_plain_saves_kept_by_a_codec_agrees_with_brute_force(kinds, reading):
    # A plain segment before the last may keep its saves by the codec too: wide layers
    # first, whose saves int8 keeps for a few microseconds where recomputing them
    # takes the layers' forward time.
    n = 5
    model = CheckpointedSequential(*chain(kinds, [512, 512, 16])[:n])
    rng = random.Random(0)
    prof = with_fixed_codec_times(with_fixed_times(actsave.profile(model, (torch.randn(64, 32) * 1,)), rng), rng)
    # Single-level plans, which the brute force enumerates: a bound on checkpointed
    # segments' length (here none) turns nesting off.
    levers = {"allow": ("recompute", "int8"), "max_checkpointed_layers": n}
    options = [*plans.keep_options(levers["allow"], None, "cpu"), PLAIN, plain_kept_by("int8")]
    every_plan = [predicted(prof, starts, chosen, stored) for starts, chosen, stored in all_plans(n, options)]
    coded_middle = [p for p in every_plan if "int8" in p.saves_codecs[:-1]]
    others = [p for p in every_plan if "int8" not in p.saves_codecs[:-1]]
    smallest = min(p.predicted_peak_bytes for p in every_plan)
    assert actsave.plan(prof, None, objective="memory", **levers).predicted_peak_bytes == smallest

    def fastest(plans_, budget):
        return min((p.predicted_step_seconds for p in plans_ if p.predicted_peak_bytes <= budget), default=math.inf)

    peaks = sorted({p.predicted_peak_bytes for p in every_plan})
    # The budgets where only a plan keeping a middle segment's saves by int8 is the
    # fastest (or fits at all), and a few others.
    needing = [b for b in peaks if fastest(coded_middle, b) < fastest(others, b)]
    assert needing
    for budget in {*needing[:: max(1, len(needing) // 8)], peaks[0], peaks[len(peaks) // 2], peaks[-1]}:
        planned = actsave.plan(prof, budget, **levers)
        assert planned.predicted_peak_bytes <= budget
        assert math.isclose(planned.predicted_step_seconds, fastest(every_plan, budget), rel_tol=1e-9)


def test_the_frontier_keeps_a_held_label_that_an_unheld_one_beats_by_less_than_the_held_input():
    # A held label (its plain segment holds the next input, 4 bytes) needs up to 4
    # bytes less headroom from here than an unheld label of the same P.
    p = np.array([10.0, 12.0, 15.0, 13.0, 14.0])
    t = np.array([1.0, 1.0, 1.0, 2.0, 1.0])
    held = np.array([False, True, True, False, True])
    kept = sorted(pareto.held_pareto(p, t, held, reused=4.0).tolist())
    # (12, 1) stays: it may fit where (10, 1) does not; (13, 2) goes, beaten by (12, 1)
    # held; (15, 1) and (14, 1) need no less than (10, 1), and one of (14, 1) held and
    # (10, 1) unheld, which need the same, stays.
    assert kept == [0, 1]


@pytest.mark.parametrize("longest", [1, 2])
def test_dynamic_program_with_short_checkpointed_segments_agrees_with_brute_force(longest, reading):
    # Blocks that the model's own loop calls can only be checkpointed one by one.
    n = 6
    model = CheckpointedSequential(*chain(["gelu", "relu", "residual"], [64, 32, 64])[:n])
    prof = actsave.profile(model, (torch.randn(32, 32) * 1,))
    options = [*plans.keep_options(plans.DEFAULT_ALLOW, None, "cpu"), PLAIN]
    # A plain segment before the last may hold any number of layers.
    every_plan = [predicted(prof, starts, chosen, stored) for starts, chosen, stored in all_plans(n, options)
                  if all(b - a <= longest or o == PLAIN for a, b, o in zip(starts[:-1], starts[1:], chosen))]
    smallest = actsave.plan(prof, None, objective="memory", max_checkpointed_layers=longest)
    assert smallest.predicted_peak_bytes == min(p.predicted_peak_bytes for p in every_plan)
    assert smallest.predicted_peak_bytes > actsave.plan(prof, None, objective="memory").predicted_peak_bytes
    peaks = sorted({p.predicted_peak_bytes for p in every_plan})
    for budget in (peaks[0], peaks[len(peaks) // 3], peaks[len(peaks) // 2], peaks[-1]):
        fastest = min(p.predicted_step_seconds for p in every_plan if p.predicted_peak_bytes <= budget)
        planned = actsave.plan(prof, budget, max_checkpointed_layers=longest)
        assert all(stop - start <= longest for start, stop, option in planned.segments if option is not None)
        assert planned.predicted_peak_bytes <= budget
        assert math.isclose(planned.predicted_step_seconds, fastest, rel_tol=1e-9)


@pytest.mark.parametrize("device, n", [("cpu", 6), ("cuda", 5)])
def test_balanced_agrees_with_brute_force_over_fixed_options(device, n):
    model = CheckpointedSequential(*chain(["gelu", "relu", "residual"], [64, 32, 64])[:n])
    prof = actsave.profile(model, (torch.empty(32, 32, device="meta").requires_grad_().clone(),), device=device)
    rng = random.Random(n)
    options = [KeepPolicy.resolve(rng.choice(["none", "int8", "fp8_e5m2"]), rng.random() < 0.5) for _ in range(n)]
    effective = [o if device == "cuda" else KeepPolicy(o.codec, False) for o in options]
    every_plan = [plans.predict(prof, starts, [effective[a].codec.name for a in starts[:-1]],
                                [effective[a].offload for a in starts[:-1]])
                  for starts, _, _ in all_plans(n, [None])]
    planned = plans.balanced(prof, options)
    assert planned.predicted_peak_bytes == min(p.predicted_peak_bytes for p in every_plan)
    assert [planned.codecs, planned.offload] == [tuple(effective[a].codec.name for a in planned.starts[:-1]),
                                                tuple(effective[a].offload for a in planned.starts[:-1])]
    # The fewest layers recomputed among the smallest-peak plans (a meta profile has no times).
    fewest = min(p.starts[-1] for p in every_plan if p.predicted_peak_bytes == planned.predicted_peak_bytes)
    assert planned.starts[-1] == fewest


def with_fixed_times(prof: actsave.Profile, rng: random.Random) -> actsave.Profile:
    """The profile with every time drawn from ``rng`` (10 us to 1 ms, in 10 us steps)."""
    def seconds():
        return 1e-5 * rng.randint(1, 100)
    return dataclasses.replace(prof, layers=tuple(
        dataclasses.replace(layer, forward_s=seconds(), backward_s=seconds(),
                            encode_s={c: seconds() for c in layer.encode_s},
                            decode_s={c: seconds() for c in layer.decode_s})
        for layer in prof.layers))


def with_fixed_codec_times(prof: actsave.Profile, rng: random.Random) -> actsave.Profile:
    """The profile with the times of its plain segments' codecs drawn from ``rng``
    (1 to 10 us, in 1 us steps: a GPU's, below the layers' of with_fixed_times)."""
    def seconds():
        return 1e-6 * rng.randint(1, 10)
    stored = prof.stored_saves
    tensors = tuple(dataclasses.replace(t, encode_s={c: seconds() for c in t.encode_s}) for t in stored.tensors)
    decode_s = tuple({c: seconds() for c in layer} for layer in stored.decode_s)
    return dataclasses.replace(prof, stored_saves=dataclasses.replace(stored, tensors=tensors, decode_s=decode_s))


def test_sweeps_find_the_plans_that_reading_every_label_finds(monkeypatch):
    # 130 layers of every kind (Flatten-free, so that every segment keeps its input;
    # views_chain covers the others above; more than nested_solver.MAX_LAYERS, so
    # single-level), lossy options and plain middle segments: at each budget the
    # sweeps read a few labels, and the plan is as fast. The times are fixed, not
    # measured: which labels the sweeps read, and so whether any b falls back to
    # one pass over every label, depends on them.
    kinds = ["relu", "gelu", "tanh", "sigmoid", "dropout", "layernorm", "residual"]
    torch.manual_seed(0)
    widths = [16, 64, 32, 128, 48]
    layers = chain([kinds[i % len(kinds)] for i in range(65)], [widths[i % len(widths)] for i in range(65)])
    prof = with_fixed_times(actsave.profile(nn.Sequential(*layers), (torch.randn(16, 32),)), random.Random(0))
    assert len(prof.layers) > nested_solver.MAX_LAYERS
    lossy = ("recompute", "int8", "fp8")
    everything = plans.predict(prof, [0]).predicted_peak_bytes
    smallest = actsave.plan(prof, None, objective="memory", allow=lossy).predicted_peak_bytes
    read = {"labels": 0}
    undominated = pareto.Sweep.undominated

    def counting(sweep, ok, times):
        read["labels"] += ok.size
        return undominated(sweep, ok, times)

    for share in (1.0, 0.5, 0.2, 0.05, 0.0):
        budget = int(smallest + share * (everything - smallest))
        monkeypatch.setattr(solver, "_SWEPT", 10**9)
        direct = actsave.plan(prof, budget, allow=lossy)
        monkeypatch.setattr(solver, "_SWEPT", 0)
        monkeypatch.setattr(pareto.Sweep, "undominated", counting)
        swept = actsave.plan(prof, budget, allow=lossy)
        # Plans of equal time may differ: codecs cost the same for saves of the same
        # shape, so plain segments kept by one cost alike wherever they fall.
        assert swept.predicted_peak_bytes <= budget
        assert swept.predicted_step_seconds == direct.predicted_step_seconds
    assert read["labels"] > 0  # some b fell back to one pass over every label


def test_coded_sweeps_read_the_labels_they_cannot_order_directly(monkeypatch):
    # Where a coded plain segment's R is not its sweep's key plus its end's
    # (CostModel.coded_middle_separable), its labels are read outside the sweep. Taken
    # as not separable at every other start, the sweeps must find as fast a plan as
    # reading every label.
    model = CheckpointedSequential(*chain(["gelu", "relu", "tanh"] * 4, [512, 512, 16] * 4))
    rng = random.Random(1)
    prof = with_fixed_codec_times(with_fixed_times(actsave.profile(model, (torch.randn(64, 32) * 1,)), rng), rng)
    separable = plain_model.PlainTerms.coded_middle_separable

    def every_other(terms):
        mask = separable.func(terms).copy()
        mask[..., 1::2] = False
        return mask
    monkeypatch.setattr(plain_model.PlainTerms, "coded_middle_separable", property(every_other))
    levers = {"allow": ("recompute", "int8"), "max_checkpointed_layers": len(model)}
    everything = plans.predict(prof, [0]).predicted_peak_bytes
    smallest = actsave.plan(prof, None, objective="memory", **levers).predicted_peak_bytes
    coded = 0
    for share in (0.0, 0.1, 0.3, 0.6):
        budget = int(smallest + share * (everything - smallest))
        monkeypatch.setattr(solver, "_SWEPT", 10**9)
        direct = actsave.plan(prof, budget, **levers)
        monkeypatch.setattr(solver, "_SWEPT", 0)
        swept = actsave.plan(prof, budget, **levers)
        assert swept.predicted_peak_bytes <= budget
        assert math.isclose(swept.predicted_step_seconds, direct.predicted_step_seconds, rel_tol=1e-12)
        coded += "int8" in direct.saves_codecs[:-1]
    assert coded  # plans keep middle segments by int8 here
