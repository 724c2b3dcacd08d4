"""Training scenarios for tests/test_distributed.py, run two ways.

``train_distributed`` runs a scenario on one rank of a 2-process gloo group, with
DDP or FSDP2 around an actsave model. ``train_reference`` replays the same scenario
in one process on the plain model (no actsave, no parallel wrapper), doing DDP's
arithmetic by hand: each rank's gradients are computed separately (micro-batches
accumulated as autograd accumulates them) and then averaged. DDP and FSDP2 reduce by
summing the ranks' gradients and dividing by the world size (a power of two, so
exact), and a sum of two terms does not depend on order, so with ``compress=None`` in
float64 the two runs agree bit for bit. One backward over the concatenated global
batch would not: the matmul over 8 samples sums in another order than two matmuls
over 4 followed by an all-reduce.

This module is imported by the spawned worker processes, so it must stay importable
without pytest and must not depend on test-module state.
"""
from __future__ import annotations

import contextlib
import functools
import os
import traceback
import warnings
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

import actsave
from support import ResidualBlock, ResidualNet

WORLD_SIZE = 2
WIDTH = 8
PER_RANK = 4  # samples per rank and micro-batch
LR = 0.1


# --- models ------------------------------------------------------------------------

def chain() -> nn.Sequential:
    layers = []
    for _ in range(4):
        layers += [nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Dropout(0.1)]
    return nn.Sequential(*layers)


class Model(nn.Module):
    """``body`` plus, when ``spare``, a parameter the forward never uses (what
    ``find_unused_parameters=True`` exists for)."""

    def __init__(self, body: nn.Module, spare: bool):
        super().__init__()
        self.body = body
        self.spare = nn.Linear(WIDTH, WIDTH) if spare else None

    def forward(self, x):
        return self.body(x)


# --- scenarios ---------------------------------------------------------------------

@dataclass(frozen=True)
class Scenario:
    """One distributed training run.

    ``body``: ``"sequential"`` (a chain made a CheckpointedSequential) or
    ``"wrapped"`` (a residual net whose blocks ``actsave.wrap`` selects).
    ``parallel``: ``"ddp"`` or ``"fsdp"`` (FSDP2 ``fully_shard``: each block, or each
    Linear of the chain, then the root). ``shard_first``: FSDP2 before actsave.
    ``micro_batches`` > 1: gradient accumulation, all but the last under ``no_sync()``.
    ``segments``: the CheckpointedSequential's (``"balanced"``: planned on the first
    call, on meta tensors). ``budget``: the wrapped blocks planned under it
    (``wrap(..., budget=)``, which profiles a real step of the model). ``compiled``:
    the sharded model run through ``torch.compile`` (aot_eager).
    """

    name: str
    body: str
    parallel: str
    compress: Optional[str] = None
    ddp_options: dict = field(default_factory=dict, hash=False)
    spare: bool = False
    micro_batches: int = 1
    shard_first: bool = False
    steps: int = 2  # static_graph=True behaves differently from the second step on
    segments: object = 3
    budget: Optional[int] = None
    compiled: bool = False

    @property
    def dtype(self) -> torch.dtype:
        # Exact comparisons need float64; the 8-bit codecs take at most float32.
        return torch.float64 if self.compress is None else torch.float32


def _ddp(name, body, compress=None, **options) -> Scenario:
    return Scenario(name, body, "ddp", compress, **options)


SCENARIOS = [
    scenario
    for body in ("sequential", "wrapped")
    for compress in (None, "int8")
    for scenario in (
        _ddp(f"ddp-{body}-default-{compress}", body, compress),
        _ddp(f"ddp-{body}-find_unused-{compress}", body, compress,
             ddp_options={"find_unused_parameters": True}, spare=True),
        _ddp(f"ddp-{body}-static_graph-{compress}", body, compress,
             ddp_options={"static_graph": True}),
        _ddp(f"ddp-{body}-no_sync-{compress}", body, compress, micro_batches=3),
        Scenario(f"fsdp-{body}-{compress}", body, "fsdp", compress),
    )
] + [
    Scenario("fsdp-wrapped-shard_first-None", "wrapped", "fsdp", shard_first=True),
    Scenario("fsdp-sequential-balanced-None", "sequential", "fsdp", segments="balanced"),
    Scenario("fsdp-wrapped-shard_first-budget-None", "wrapped", "fsdp", shard_first=True, budget=2**30),
    Scenario("fsdp-sequential-balanced-compiled-None", "sequential", "fsdp", segments="balanced", compiled=True),
    Scenario("fsdp-wrapped-compiled-None", "wrapped", "fsdp", compiled=True),
    # int8 in the compiled graph (NOTE [ Codecs in a compiled graph ]): the chain's
    # Tanh makes no decisions.
    Scenario("fsdp-sequential-balanced-compiled-int8", "sequential", "fsdp", "int8", segments="balanced",
             compiled=True),
    Scenario("fsdp-wrapped-compiled-int8", "wrapped", "fsdp", "int8", compiled=True),
]

BY_NAME = {scenario.name: scenario for scenario in SCENARIOS}


def plain_model(scenario: Scenario) -> Model:
    torch.manual_seed(0)
    body = chain() if scenario.body == "sequential" else ResidualNet(width=WIDTH, dropout=0.1)
    return Model(body, scenario.spare).to(scenario.dtype)


def apply_actsave(model: Model, scenario: Scenario) -> Model:
    if scenario.body == "sequential":
        model.body = actsave.CheckpointedSequential.from_sequential(
            model.body, segments=scenario.segments, compress=scenario.compress)
    elif scenario.budget is not None:
        actsave.wrap(model, ResidualBlock, budget=scenario.budget, example_inputs=batch(scenario, 0, 0, 0))
    else:
        actsave.wrap(model, ResidualBlock, compress=scenario.compress)
    return model


def batch(scenario: Scenario, step: int, rank: int, micro: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    return torch.randn(PER_RANK, WIDTH, generator=generator, dtype=scenario.dtype)


def forward_loss(model: nn.Module, scenario: Scenario, step: int, rank: int, micro: int):
    torch.manual_seed(7 + 1000 * step + 10 * micro + rank)  # each rank its own Dropout masks
    return model(batch(scenario, step, rank, micro)).square().mean()


# --- the two ways to run a scenario ------------------------------------------------

@contextlib.contextmanager
def one_thread():
    """Both ways run single-threaded: kernels such as LayerNorm's backward split their
    reductions by thread count, which would change the bits."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


@one_thread()
def train_reference(scenario: Scenario) -> dict:
    """The scenario in one process, plain model, DDP's reduction done by hand."""
    model = plain_model(scenario)
    params = list(model.parameters())
    optimizer = torch.optim.SGD(params, lr=LR)
    losses, grads = {}, []
    for step in range(scenario.steps):
        per_rank = []
        for rank in range(WORLD_SIZE):
            model.zero_grad(set_to_none=True)
            for micro in range(scenario.micro_batches):
                loss = forward_loss(model, scenario, step, rank, micro)
                (loss / scenario.micro_batches).backward()
                losses[(step, rank, micro)] = loss.item()
            per_rank.append([p.grad for p in params])
        for p, rank_grads in zip(params, zip(*per_rank)):
            unused = all(g is None for g in rank_grads)
            p.grad = None if unused else functools.reduce(torch.add, rank_grads) / WORLD_SIZE
        grads = [None if p.grad is None else p.grad.clone() for p in params]
        optimizer.step()
    return {"losses": losses, "grads": grads, "params": [p.detach().clone() for p in params]}


def _parallelize(model: Model, scenario: Scenario) -> nn.Module:
    if scenario.parallel == "ddp":
        return nn.parallel.DistributedDataParallel(apply_actsave(model, scenario), **scenario.ddp_options)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (WORLD_SIZE,))
    if not scenario.shard_first:
        apply_actsave(model, scenario)
    units = model.body.blocks if scenario.body == "wrapped" else [
        layer for layer in model.body if isinstance(layer, nn.Linear)]
    for unit in units:
        fully_shard(unit, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if scenario.shard_first:
        apply_actsave(model, scenario)
    return model


def _full(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    if t is None:
        return None
    t = t.detach()
    return t.full_tensor() if hasattr(t, "full_tensor") else t.clone()


def train_distributed(scenario: Scenario, rank: int) -> dict:
    """The scenario on this rank; gradients and parameters gathered in full."""
    model = _parallelize(plain_model(scenario), scenario)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    if scenario.compiled:
        model.compile(backend="aot_eager")
    losses, grads = {}, []
    with warnings.catch_warnings(record=True) as raised:
        warnings.simplefilter("always")
        for step in range(scenario.steps):
            optimizer.zero_grad(set_to_none=True)
            for micro in range(scenario.micro_batches):
                last = micro == scenario.micro_batches - 1
                with contextlib.nullcontext() if last else model.no_sync():
                    loss = forward_loss(model, scenario, step, rank, micro)
                    (loss / scenario.micro_batches).backward()
                losses[(step, rank, micro)] = loss.item()
            grads = [_full(p.grad) for p in model.parameters()]
            optimizer.step()
    body = model.module.body if scenario.parallel == "ddp" else model.body
    plan = getattr(body, "balanced_plan", None)
    return {
        "warnings": [str(w.message) for w in raised if "actsave" in str(w.message) or "Checkpointed" in str(w.message)],
        "balanced_starts": None if plan is None else plan.starts,
        "description": body.describe() if isinstance(body, actsave.CheckpointedSequential) else None,
        "losses": losses,
        "grads": grads,
        "params": [_full(p) for p in model.parameters()],
        # FSDP2 registers the sharded DTensors again once a unit is resharded.
        "resharded": all(type(p).__name__ == "DTensor" for p in model.parameters()),
        "kept_bytes": actsave.kept_bytes(),
    }


def worker(rank: int, port: int, names: list, out_dir: str) -> None:
    """Entry point of a spawned rank: runs every scenario in ``names`` and saves
    ``{name: result or {"error": traceback}}`` to ``out_dir/rank<rank>.pt``."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)  # as train_reference does (and no oversubscription)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD_SIZE, timeout=timedelta(seconds=60))
    results = {}
    try:
        for name in names:
            try:
                results[name] = train_distributed(BY_NAME[name], rank)
            except Exception:  # reported by the test of this scenario, not fatal here
                results[name] = {"error": traceback.format_exc()}
            dist.barrier()
    finally:
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.destroy_process_group()
