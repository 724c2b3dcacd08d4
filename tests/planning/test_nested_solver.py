"""The nested dynamic program (planning/nested_solver.py): its table against every
tree of short ranges, the trees it returns against nested_model.py, and the plans the
planner makes with it, applied and trained."""
import dataclasses
import functools
import itertools

import numpy as np
import pytest
import torch
from planning.chains import chain
from support import deep_mlp, mixed_chain, peak_activation_bytes, train_step, twin

import actsave
from actsave import CheckpointedSequential
from actsave.planning import nested_model, plans
from actsave.planning.memory_model import CostModel
from actsave.planning.nested_solver import NestedTable, exact_options
from actsave.planning.solver import smallest_headroom
from actsave.runtime.nested import Range


@functools.lru_cache(maxsize=None)
def mixed_table() -> NestedTable:
    """The table of a 20-layer chain with in-place ReLUs (private copies),
    Dropout, BatchNorm and GELU, at a headroom of 60% of its plain step's peak."""
    layers, x = list(mixed_chain(width=64, repeats=4)), torch.randn(256, 64)
    prof = actsave.profile(CheckpointedSequential(*layers), (x,))
    model = CostModel(prof, plans.keep_options(("recompute",), None, "cpu"))
    return NestedTable(model, 0.6 * model.plain_peaks[0, 0])


def trees(start: int, stop: int, top: bool = True):
    """Every cut of [start, stop) into parts, each stored or recomputed and then cut
    in any way or not at all (a plain checkpoint), the last part stored; at the top,
    two parts or more (what Multi prices)."""
    if not top:
        yield ()
    for cuts in itertools.chain.from_iterable(itertools.combinations(range(start + 1, stop), k)
                                              for k in range(1, stop - start)):
        bounds = list(zip((start, *cuts), (*cuts, stop)))
        choices = [[Range(s, e, recomputed=False)] + ([] if e == stop else
                                                      [Range(s, e, inner=inner) for inner in trees(s, e, top=False)])
                   for s, e in bounds]
        yield from itertools.product(*choices)


def relative(r: Range, origin: int) -> Range:
    return Range(r.start - origin, r.stop - origin, r.recomputed, tuple(relative(p, origin) for p in r.inner))


@pytest.mark.parametrize("start, stop", [(0, 4), (1, 6), (2, 7), (5, 10), (13, 18)])
def test_the_table_is_the_least_time_over_every_cut_the_model_fits_in_m_units(start, stop):
    # The model (nested_model.py) at every m of the grid, up to the table's rounding:
    # most of this chain's terms are whole units (1 KiB), the rest (BatchNorm statistics
    # and their copies, masks: 8-520 B over) round up, at most one unit per part. So the
    # table is never faster than the fastest cut within m units, nor slower than the
    # fastest within m less one unit per layer.
    table = mixed_table()
    model, o = table.model, exact_options(table.model)[0]
    priced = []
    for parts in trees(start, stop):
        top = Range(0, stop - start, inner=tuple(relative(part, start) for part in parts))
        extra = nested_model.seconds(model, o, start, top) - float(model.seconds(o, start, stop))
        priced.append((nested_model._largest_event(model, start, top), extra))

    def fastest_within(units: int) -> float:
        return min((seconds for event, seconds in priced if event <= units * table.unit), default=np.inf)

    slack = stop - start
    for m in range(table.steps + 1):
        found = table.multi[start, stop, table.width + m]
        assert found >= fastest_within(m) - 1e-15, m
        assert found <= fastest_within(m - slack) + 1e-15, m


def test_the_trees_it_returns_fit_the_model_within_their_bytes_and_take_the_time_it_priced():
    table, checked = mixed_table(), 0
    model, o = table.model, exact_options(table.model)[0]
    rng = np.random.default_rng(0)
    for a, b in [(0, 19), (2, 19), (3, 17), (6, 14), (10, 19)]:
        finite = np.nonzero(np.isfinite(table.multi[a, b, table.width:]))[0]
        for m in rng.choice(finite, size=min(8, finite.size), replace=False):
            room = m * table.unit
            top = table.tree(a, b, room)
            assert len(top.inner) >= 2
            assert nested_model._largest_event(model, a, top) <= room
            extra = nested_model.seconds(model, o, a, top) - float(model.seconds(o, a, b))
            assert extra == pytest.approx(table.multi[a, b, table.width + m], rel=1e-12)
            checked += 1
    assert checked >= 20


def single_level_smallest(prof) -> float:
    """The least peak of a single-level plan by exact recompute."""
    model = plans.Search(prof, ("recompute",), None, None, True, True, nest=False).model()
    return model.chain_input + smallest_headroom(model)


def test_plans_below_the_smallest_single_level_peak_nest_fit_and_train_exactly():
    layers, x = deep_mlp(16, 64), torch.randn(256, 64)
    model = CheckpointedSequential(*layers)
    prof = actsave.profile(model, (x,))
    budget = int(0.85 * single_level_smallest(prof))
    plan = actsave.plan(prof, budget, allow=("recompute",))
    assert any(r is not None and any(part.recomputed for part in r.inner) for r in plan.nested), plan
    assert plan.predicted_peak_bytes <= budget
    plain = twin(model)
    model.apply_plan(plan)
    assert peak_activation_bytes(model, x) <= budget
    assert all(torch.equal(mine, theirs) for mine, theirs in zip(train_step(model, x), train_step(plain, x)))


def test_a_limit_on_checkpointed_layers_plans_single_level():
    timed = actsave.profile(CheckpointedSequential(*deep_mlp(16, 64)), (torch.randn(256, 64),))
    with pytest.raises(actsave.ConfigError, match="no plan fits"):
        actsave.plan(timed, int(0.85 * single_level_smallest(timed)), allow=("recompute",), max_checkpointed_layers=8)


def test_a_nested_segment_after_a_stored_one_that_holds_its_input_counts_it_once():
    # A plain middle segment whose saves hold the next segment's input keeps it to its
    # backward (memory_model.py, "A tensor at a plain boundary"); a nested segment
    # there keeps that storage as K, and its first part's saves hold it again.
    layers = chain(["layernorm", "sigmoid", "sigmoid", "gelu", "tanh", "relu", "residual", "layernorm"],
                   [64, 32, 16, 128, 64, 128, 32, 64])
    model, x = CheckpointedSequential(*layers), torch.randn(64, 32)
    prof = actsave.profile(model, (x,))
    nested = Range(0, 3, inner=(Range(0, 2, inner=()), Range(2, 3, recomputed=False)))
    plan = plans.predict(prof, [0, 3, 6, 9], plain=[False, True, False], nested=[None, None, nested])
    model.apply_plan(plan)
    # Counted twice, x_6 (64 x 16 floats) made the prediction 4,096 B too high. The
    # prediction may run a few hundred bytes high: the model frees a layer's recomputed
    # saves after the layer's backward, and the runtime hands them to it (NOTE [ Lifetime
    # of kept inputs ]), so that one can die inside that backward, before its last allocation.
    measured = peak_activation_bytes(model, x)
    assert 0 <= plan.predicted_peak_bytes - measured < 4096


def test_the_planner_nests_after_stored_segments_that_hold_the_input_and_its_plans_measure_as_predicted():
    layers = chain(["relu", "batchnorm", "batchnorm", "batchnorm", "batchnorm"], [16, 64, 64, 64, 16])
    model, x = CheckpointedSequential(*layers), torch.randn(64, 32)
    prof = actsave.profile(model, (x,))
    prof = dataclasses.replace(prof, layers=tuple(  # fixed times: the same plans every run
        dataclasses.replace(layer, forward_s=1e-3 * (1 + i % 3), backward_s=2e-3) for i, layer in
        enumerate(prof.layers)))
    smallest = actsave.plan(prof, None, objective="memory", allow=("recompute",)).predicted_peak_bytes
    ratios = []
    for budget in np.linspace(0.6 * smallest, plans.predict(prof, [0]).predicted_peak_bytes, 60).astype(int):
        try:
            plan = actsave.plan(prof, int(budget), allow=("recompute",))  # raises InternalError above budget
        except actsave.ConfigError:
            continue
        if any(stored and nested is not None for stored, nested in zip(plan.plain, plan.nested[1:])):
            model.apply_plan(plan)
            ratios.append(peak_activation_bytes(model, x) / plan.predicted_peak_bytes)
    assert ratios and all(0.97 <= ratio <= 1.0 for ratio in ratios), ratios
