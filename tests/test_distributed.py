"""actsave under DDP and FSDP2: 2 CPU processes, gloo backend.

Every scenario (tests/dist_scenarios.py) trains two SGD steps on 2 ranks and is
compared with the same training replayed in this process on the plain model, DDP's
gradient averaging done by hand: bit for bit with ``compress=None`` (float64), by
gradient SQNR for the lossy codecs. Both ranks run every scenario in ONE spawn (a
process that imports torch costs seconds), see the ``outcomes`` fixture.

What the scenarios show: actsave's recompute leaves the autograd graph the plain
model's (DDP's reducer hooks and its graph walk under ``find_unused_parameters=True``
see every parameter, ``static_graph=True`` sees the same graph each step, ``no_sync``
accumulation works), and FSDP2 composes with actsave whichever is applied first.
"""
import dataclasses
import socket
import time

import pytest
import torch
import torch.multiprocessing as mp
from torch import nn

import actsave
from actsave.planning import plans
from actsave.planning.fsdp_gathers import with_plain_step_gathers
from support import sqnr_db
from dist_scenarios import (SCENARIOS, WORLD_SIZE, Scenario, apply_actsave, batch, forward_loss, plain_model,
                            train_reference, worker)

INT8_SQNR_FLOOR_DB = 30.0
SPAWN_TIMEOUT_S = 240


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory) -> list:
    """``[rank0_results, rank1_results]``: every runnable scenario, one spawn."""
    names = [s.name for s in SCENARIOS]
    out_dir = tmp_path_factory.mktemp("distributed")
    context = mp.get_context("spawn")
    port = _free_port()
    ranks = [context.Process(target=worker, args=(rank, port, names, str(out_dir)))
             for rank in range(WORLD_SIZE)]
    for process in ranks:
        process.start()
    deadline = time.monotonic() + SPAWN_TIMEOUT_S
    for process in ranks:
        process.join(max(0.0, deadline - time.monotonic()))
    hung = [rank for rank, process in enumerate(ranks) if process.is_alive()]
    for rank in hung:
        ranks[rank].kill()
    assert not hung, f"ranks {hung} did not finish within {SPAWN_TIMEOUT_S} s"
    assert [p.exitcode for p in ranks] == [0] * WORLD_SIZE, "a rank crashed; see its stderr above"
    return [torch.load(out_dir / f"rank{rank}.pt") for rank in range(WORLD_SIZE)]


def _flat(tensors) -> torch.Tensor:
    return torch.cat([t.flatten() for t in tensors if t is not None])


def results_of(outcomes: list, scenario: Scenario) -> list:
    """The scenario's result on each rank; fails with the rank's traceback if the
    scenario raised there."""
    results = [rank_outcomes[scenario.name] for rank_outcomes in outcomes]
    for rank, result in enumerate(results):
        if "error" in result:
            pytest.fail(f"rank {rank} raised:\n{result['error']}")
    return results


def assert_matches_reference(scenario: Scenario, results: list) -> None:
    reference = train_reference(scenario)
    for rank, result in enumerate(results):
        assert result["kept_bytes"] == {"device": 0, "host": 0}, f"rank {rank} kept inputs alive"
        grads = result["grads"]
        assert [g is None for g in grads] == [g is None for g in reference["grads"]]
        if scenario.compress is None:
            assert result["losses"] == {k: v for k, v in reference["losses"].items() if k[1] == rank}
            for i, (got, expected) in enumerate(zip(grads, reference["grads"])):
                assert got is None or torch.equal(got, expected), f"rank {rank}, grad of parameter {i}"
            for i, (got, expected) in enumerate(zip(result["params"], reference["params"])):
                assert torch.equal(got, expected), f"rank {rank}, parameter {i} after the steps"
        else:
            quality = sqnr_db(_flat(reference["grads"]), _flat(grads))
            assert quality >= INT8_SQNR_FLOOR_DB, f"rank {rank}: gradient SQNR {quality:.1f} dB"


def _cases(predicate) -> list:
    return [pytest.param(s, id=s.name) for s in SCENARIOS if predicate(s)]


@pytest.mark.parametrize("scenario", _cases(lambda s: s.parallel == "ddp" and s.micro_batches == 1))
def test_ddp_gradients_equal_single_process_gradients_on_the_global_batch(outcomes, scenario):
    """Default, find_unused_parameters=True (with a parameter the forward never uses,
    and parameters used only inside recomputed segments) and static_graph=True."""
    assert_matches_reference(scenario, results_of(outcomes, scenario))


@pytest.mark.parametrize("scenario", _cases(lambda s: s.micro_batches > 1))
def test_ddp_no_sync_gradient_accumulation_equals_single_process_accumulation(outcomes, scenario):
    assert_matches_reference(scenario, results_of(outcomes, scenario))


@pytest.mark.parametrize("scenario", _cases(lambda s: s.parallel == "fsdp" and not s.shard_first))
def test_fsdp2_wrap_then_shard_trains_as_the_unsharded_model(outcomes, scenario):
    """actsave first, then ``fully_shard`` per block (per Linear for the chain) and
    at the root; parameters end resharded after each backward."""
    results = results_of(outcomes, scenario)
    assert all(result["resharded"] for result in results)
    assert_matches_reference(scenario, results)


@pytest.mark.parametrize("scenario", _cases(lambda s: s.shard_first))
def test_fsdp2_shard_then_wrap_also_trains_as_the_unsharded_model(outcomes, scenario):
    """The other order works too: FSDP2's pre-forward hook does nothing while its
    module is in backward (the state a recompute runs in), so the recompute of a
    sharded block uses the parameters its pre-backward hook gathered."""
    results = results_of(outcomes, scenario)
    assert all(result["resharded"] for result in results)
    assert_matches_reference(scenario, results)


def balanced_starts_unsharded(scenario: Scenario) -> tuple:
    """The default segments of the scenario's chain, unsharded, in one process, planned
    as for the sharded chain: each Linear (an FSDP2 unit there) with the whole
    parameters FSDP2 gathers for it (NOTE [ Gathered parameters ]); and whether the
    unsharded describe() has the line for FSDP2-sharded parameters."""
    model = apply_actsave(plain_model(scenario), scenario)
    forward_loss(model, scenario, 0, 0, 0).backward()
    body, x = model.body, batch(scenario, 0, 0, 0)
    profile = actsave.profile(body, (torch.empty_like(x, device="meta").requires_grad_(x.requires_grad),))
    gathered = [sum(p.numel() * p.element_size() for p in layer.parameters()) if isinstance(layer, nn.Linear) else 0
                for layer in body]
    profile = dataclasses.replace(profile, layers=tuple(with_plain_step_gathers(
        [dataclasses.replace(layer, gathered_bytes=g) for layer, g in zip(profile.layers, gathered)])))
    plan = plans.balanced(profile, list(body._settings.policies(list(body))))
    return plan.starts, FSDP2_LINE in body.describe()


FSDP2_LINE = "The parameters are FSDP2-sharded"


@pytest.mark.parametrize("scenario", _cases(lambda s: s.budget is not None))
def test_fsdp2_blocks_planned_under_a_budget_train_as_the_unsharded_model(outcomes, scenario):
    """plan_blocks records the blocks' calls before FSDP2's pre-forward hook hands
    each block new tensor objects, so it finds them chained."""
    assert_matches_reference(scenario, results_of(outcomes, scenario))


@pytest.mark.parametrize("scenario", _cases(lambda s: s.segments == "balanced"))
def test_fsdp2_default_segments_are_the_unsharded_models_plan(outcomes, scenario):
    """The balanced plan's meta step sees FSDP2's sharded parameters whole, as the
    forward does once they are gathered, with FSDP2's hooks paused (meta.on_meta):
    every rank plans on the unsharded model's shapes, adding the parameters each unit
    gathers, no fallback to "sqrt", and training as the unsharded model trains.
    describe() says what of FSDP2's bytes the plan counts, where (only where) the
    parameters are sharded."""
    results = results_of(outcomes, scenario)
    expected, unsharded_has_line = balanced_starts_unsharded(scenario)
    assert len(expected) >= 2 and not unsharded_has_line
    for rank, result in enumerate(results):
        assert (result["balanced_starts"], result["warnings"]) == (expected, []), f"rank {rank}"
        assert FSDP2_LINE in result["description"], f"rank {rank}"
    assert_matches_reference(scenario, results)

