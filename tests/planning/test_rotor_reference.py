"""The rotor reference solver (rotor_reference.py) against its own simulator and a
brute force over every plan of short chains: the reference must be right before
actsave's planner is measured against it."""
import numpy as np
import pytest

from planning.rotor_reference import RotorTable, all_plans, brute_force, count_plans, random_chain, simulate


@pytest.mark.parametrize("held", [False, True], ids=["paper", "held"])
@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("n", [1, 2, 3, 4, 5])
def test_table_is_the_brute_force_optimum_at_every_budget(seed, n, held):
    chain = random_chain(np.random.default_rng(seed * 10 + n), n, held=held)
    top = sum(chain.saved) + 3 * max(chain.act) + chain.held + 6
    table = RotorTable(chain, top)
    for budget in range(top + 1):
        expected = brute_force(chain, budget)
        assert table.step_time(budget) == expected, budget


@pytest.mark.parametrize("seed", range(20))
def test_each_plan_simulates_to_the_time_it_claims_within_its_budget(seed):
    rng = np.random.default_rng(seed)
    chain = random_chain(rng, int(rng.integers(4, 12)), held=seed % 2 == 1)
    top = sum(chain.saved) + 3 * max(chain.act) + chain.held + 6
    table = RotorTable(chain, top)
    for budget in range(top + 1):
        plan = table.plan(budget)
        if plan is None:
            assert not np.isfinite(table.step_time(budget))
            continue
        time, peak = simulate(chain, plan)
        assert time == table.step_time(budget) and peak <= budget


def test_tight_budgets_recompute_some_stages_more_than_once():
    """Multi-level plans are what the reference is for: a long uniform chain at a budget
    just above the smallest takes nested checkpoints."""
    from planning.rotor_reference import RotorChain
    n = 12
    chain = RotorChain((1.0,) * n, (2.0,) * n, (1,) * (n + 1), (2,) * n, (0,) * n, (0,) * n)
    table = RotorTable(chain, 40)
    smallest = next(b for b in range(41) if np.isfinite(table.step_time(b)))
    plan = table.plan(smallest)

    def depth(children):
        return max((1 + depth(inner) for _, _, inner in children if inner is not None), default=0)
    assert depth(plan) >= 2
    assert table.step_time(smallest) > sum(chain.fwd_time) * 2 + sum(chain.bwd_time)


@pytest.mark.parametrize("stored_anywhere", [False, True])
@pytest.mark.parametrize("seed", range(12))
def test_single_level_table_is_the_brute_force_optimum_over_single_level_plans(seed, stored_anywhere):
    rng = np.random.default_rng(seed)
    chain = random_chain(rng, int(rng.integers(1, 6)), held=seed % 2 == 1)
    top = sum(chain.saved) + 3 * max(chain.act) + chain.held + 6
    table = RotorTable(chain, top, single_level=True, stored_anywhere=stored_anywhere)
    single_level = [plan for plan in all_plans(0, chain.n) if _single_level(plan, stored_anywhere)]
    for budget in range(top + 1):
        runs = [simulate(chain, plan) for plan in single_level]
        assert table.step_time(budget) == min((t for t, peak in runs if peak <= budget), default=np.inf)
        plan = table.plan(budget)
        if plan is not None:
            seconds, peak = simulate(chain, plan)
            assert _single_level(plan, stored_anywhere) and seconds == table.step_time(budget) and peak <= budget


def _single_level(plan, stored_anywhere: bool = False) -> bool:
    """Whether actsave can express ``plan``: checkpointed runs storing their whole
    recompute, the last run stored, and with ``stored_anywhere`` stored runs between."""
    *before_last, (_, _, last) = plan
    return last is None and all((inner is None and stored_anywhere)
                                or (inner is not None and len(inner) == 1 and inner[0][2] is None)
                                for _, _, inner in before_last)


def test_plans_are_enumerated_once_each():
    plans = list(all_plans(0, 5))
    assert len(plans) == len(set(plans)) == count_plans(5)
