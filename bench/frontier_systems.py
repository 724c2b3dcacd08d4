"""bench/frontier.py's systems: torch's peers (per-block checkpointing on every k-th
block, selective checkpointing with torchtitan's op list, checkpoint_sequential,
torch.compile at its memory budgets) and actsave's planned points (Planner), each a
System, a shell of the case's model sharing its parameters."""
from __future__ import annotations

import collections
import copy
import math
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
from torch import nn
from torch.utils.checkpoint import (CheckpointPolicy, checkpoint, checkpoint_sequential,
                                    create_selective_checkpoint_contexts)

import actsave
from actsave._torch import aten_overloads
from actsave.planning import plans as actsave_plans
from actsave.planning.blocks import BlockPlanner

from frontier_cases import Case

# actsave's planned curves: name -> the levers ``allow`` names. Data, so that a lever
# the planner gains is one more line; a set the planner rejects as unknown is skipped
# with a note. "recompute" is the exact
# set on the device (the planner's default on a CPU; on CUDA the default adds offload).
LEVER_SETS = {
    "recompute": ("recompute",),
    "exact": ("recompute", "selective"),
    "int8": ("recompute", "selective", "int8"),
    "offload": ("recompute", "selective", "offload"),
    "int8+offload": ("recompute", "selective", "int8", "offload"),
}
# Offload moves bytes off the device only where host memory is separate (CUDA); the
# planner refuses it on a CPU model.
CUDA_ONLY = {"offload", "int8+offload"}
# A chain's plans have no selective lever (a block plan's per-op option): there
# "exact" is "recompute".
BLOCK_ONLY_LEVERS = ("selective",)
# The curves drawn by default: per-block checkpointing alone (torch's own choice), the
# exact levers, int8 too, and on CUDA every lever.
DEFAULT_LEVER_SETS = ("recompute", "exact", "int8", "int8+offload")
# actsave at each peer's measured peak plans with these sets: exact (recompute and,
# for blocks, selective), and every lever on the device (the GPU targets).
AT_PEER_LEVERS = ("exact", "int8+offload")

# torch.compile's activation memory budgets (torch._functorch.config: 0 recomputes
# all it can, 1 is plain), as torchtitan's memory_budget mode sets it.
COMPILE_BUDGETS = (0.1, 0.3, 0.5)
# torch per-block checkpointing on every k-th block.
EVERY = (1, 2, 4)


# torch's selective checkpointing as torchtitan applies it (pytorch/torchtitan:
# torchtitan/models/llama3/infra/parallelize.py, _op_sac_save_list, and
# torchtitan/distributed/activation_checkpoint.py, _apply_op_sac, at cfb9326): save the
# outputs of the matmuls and of attention, recompute the rest; with the "every other
# matmul" rule, every second matmul of a block's forward is recomputed too (its count
# kept apart for the forward and the recompute, as torchtitan keys it: one shared
# counter corrupted NeMo's gradients). A policy must name overloads: one naming
# aten.mm (the packet) silently matches nothing, so every SAC system counts what its
# policy saved and the run fails if that is nothing. torchtitan's models have no
# biased linears, so its only matmul is aten.mm; a biased nn.Linear on 2-D or
# contiguous 3-D input dispatches aten.addmm, so addmm and bmm count as matmuls here.
# The CPU's fused attention is _scaled_dot_product_flash_attention_for_cpu; aten.max
# is in torchtitan's list for float8 scales.
SAC_MATMULS = aten_overloads("mm.default", "addmm.default", "bmm.default")
SAC_SAVED_OPS = SAC_MATMULS | aten_overloads(
    "_scaled_dot_product_efficient_attention.default", "_scaled_dot_product_flash_attention.default",
    "_scaled_dot_product_flash_attention_for_cpu.default", "_scaled_dot_product_cudnn_attention.default",
    "_scaled_dot_product_attention_math.default", "_scaled_dot_product_fused_attention_overrideable.default",
    "max.default")


def shell(module: nn.Module, shared: tuple = ()) -> nn.Module:
    """A copy of ``module``'s tree of modules that shares its parameters, its buffers,
    its leaf modules and every module of the types ``shared`` (the blocks): wrapping
    the copy's blocks, setting its forward or hooks changes nothing in ``module`` or in
    another shell. Each module's own dicts and sets (children, parameters, buffers,
    hooks) are copied, their items shared."""
    if isinstance(module, shared) or not module._modules:
        return module
    clone = copy.copy(module)
    for name, value in vars(clone).items():
        if isinstance(value, (dict, set)):
            vars(clone)[name] = copy.copy(value)
    for name, child in module._modules.items():
        clone._modules[name] = None if child is None else shell(child, shared)
    return clone


class TorchCheckpoint(nn.Module):
    """``torch.utils.checkpoint.checkpoint(block, *args, use_reentrant=False,
    context_fn=...)``: one block checkpointed as torch's users write it, selectively
    where ``context_fn`` is given (SAC)."""

    def __init__(self, block: nn.Module, context_fn: Optional[Callable] = None):
        super().__init__()
        self.block = block
        self.context_fn = context_fn

    def forward(self, *args, **kwargs):
        extra = {} if self.context_fn is None else {"context_fn": self.context_fn}
        return checkpoint(self.block, *args, use_reentrant=False, **extra, **kwargs)


def every_kth_block(model: nn.Module, block: type, k: int, wrapper: Callable) -> nn.Module:
    """``model`` with block i (in module order) replaced by ``wrapper(block)`` where
    (i + 1) % k == 0: torchtitan's layer-selective rule (_apply_layer_sac: its count
    starts at 1), every block for k = 1."""
    found = []

    def visit(parent):
        for name, child in parent.named_children():
            if isinstance(child, block):
                found.append((parent, name, child))
            else:
                visit(child)

    visit(model)
    for i, (parent, name, child) in enumerate(found):
        if (i + 1) % k == 0:
            setattr(parent, name, wrapper(child))
    return model


def sac_context(every_other_matmul: bool, saved: collections.Counter) -> Callable:
    """The ``context_fn`` of one SAC block (see ``SAC_SAVED_OPS``): a fresh matmul count
    per checkpoint call; ``saved`` counts, by op, the outputs the forward saved."""

    def context_fn():
        matmuls = collections.Counter()  # per pass: "forward" and "recompute" apart

        def policy(ctx, func, *args, **kwargs):
            mode = "recompute" if ctx.is_recompute else "forward"
            if func in SAC_MATMULS:
                matmuls[mode] += 1
            save = func in SAC_SAVED_OPS and not (every_other_matmul and func in SAC_MATMULS and matmuls[mode] % 2 == 0)
            if save and not ctx.is_recompute:
                saved[str(func)] += 1
            return CheckpointPolicy.MUST_SAVE if save else CheckpointPolicy.PREFER_RECOMPUTE

        return create_selective_checkpoint_contexts(policy)

    return context_fn


class CheckpointSequential(nn.Module):
    """``checkpoint_sequential(chain, segments, x, use_reentrant=False)``."""

    def __init__(self, chain: nn.Sequential, segments: int):
        super().__init__()
        self.chain, self.segments = chain, segments

    def forward(self, x):
        return checkpoint_sequential(self.chain, self.segments, x, use_reentrant=False)


@dataclass
class System:
    """One point of a curve: ``family`` names the curve, ``point`` the point on it."""

    name: str
    family: str
    point: str
    model: nn.Module
    levers: str = ""
    budget: Optional[int] = None
    pred_peak: Optional[int] = None
    planner_step: Optional[float] = None
    planner_plain_step: Optional[float] = None
    plan: str = ""
    peer: Optional[str] = None  # for actsave at a peer's peak: the peer's name
    compiled_by: Optional[BudgetedBackend] = None  # torch.compile's systems: their backend
    saved: Optional[collections.Counter] = None  # SAC: the outputs its policy saved, by op (counting)
    saved_a_step: Optional[collections.Counter] = None  # SAC: those of the one step measured for its peak
    peak: Optional[int] = None
    times: list = field(default_factory=list)
    pair_times: Optional[tuple] = None  # (this system's, its peer's), from their own rounds: NOTE [ Pair rounds ]
    note: str = ""

    @property
    def is_peer(self) -> bool:
        return self.family.startswith("torch")


def torch_systems(case: Case, compile_backend: Optional[str]) -> list:
    """plain, plain again, and torch's systems (the peers) of ``case``."""
    plain = case.plain
    systems = [System("plain", "plain", "", shell(plain, _shared(case))),
               System("plain, again", "again", "noise floor", shell(plain, _shared(case)))]
    if case.block is None:
        n = len(plain)
        for k in sorted({2, 4, round(math.sqrt(n)), n // 4} - {0, 1}):
            systems.append(System(f"checkpoint_sequential k={k}", "torch checkpoint_sequential", f"k={k}",
                                  CheckpointSequential(nn.Sequential(*plain), k)))
        return systems
    for k in EVERY:
        point = "every block" if k == 1 else f"every {_ordinal(k)} block"
        model = every_kth_block(shell(plain, (case.block,)), case.block, k, TorchCheckpoint)
        systems.append(System(f"torch checkpoint, {point}", "torch checkpoint per block", point, model))
    for every_other in (False, True):
        saved = collections.Counter()
        point = "matmuls and attention" + (", every other matmul" if every_other else "")
        model = every_kth_block(shell(plain, (case.block,)), case.block, 1,
                                lambda block: TorchCheckpoint(block, sac_context(every_other, saved)))
        systems.append(System(f"torch SAC, {point}", "torch SAC (torchtitan's ops)", point, model, saved=saved))
    if compile_backend is not None:
        for budget in COMPILE_BUDGETS:
            backend = BudgetedBackend(compile_backend, budget)
            model = torch.compile(shell(plain, (case.block,)), backend=backend)
            systems.append(System(f"torch.compile, memory budget {budget}", "torch.compile memory budget",
                                  f"budget {budget}", model, compiled_by=backend, note=f"backend {compile_backend}"))
    return systems


class BudgetedBackend:
    """torch.compile's backend ``name``, run with ``activation_memory_budget`` set while
    it compiles (AOTAutograd's partitioner reads it then). One object per budget:
    Dynamo guards on the backend, so each budget's shell compiles a graph of its own.
    With one backend for all, shells of one class share Dynamo's cache (the inlined
    modules are guarded by their structure, not their identity): the second and third
    budgets would run the first's graph.
    ``compiles`` counts the graphs it compiled."""

    def __init__(self, name: str, budget: float):
        self.name, self.budget, self.compiles = name, budget, 0

    def __call__(self, graph, example_inputs):
        self.compiles += 1
        with torch._functorch.config.patch(activation_memory_budget=self.budget):
            return torch._dynamo.lookup_backend(self.name)(graph, example_inputs)


def _shared(case: Case) -> tuple:
    return () if case.block is None else (case.block,)


def _ordinal(k: int) -> str:
    return {2: "2nd", 3: "3rd"}.get(k, f"{k}th")


class Planner:
    """actsave's plans for ``case`` at any budget and lever set: a chain's from one
    profile (what segments="auto" does, its times read once for every budget), a
    block stack's from ``actsave.plan_blocks`` on a shell never wrapped (a plan applies
    to any shell: it names the shared blocks)."""

    def __init__(self, case: Case):
        self.case = case
        if case.block is None:
            profiled = actsave.CheckpointedSequential(*case.plain, segments=1)
            self.profile = actsave.profile(profiled, case.inputs, loss=case.chain_loss)
            plain = actsave_plans.predict(self.profile, [0])
            self.plain_peak, self.plain_step = plain.predicted_peak_bytes, plain.predicted_step_seconds
        else:
            self.planning_shell = shell(case.plain, (case.block,))
            self._block_planners = {}  # lever set -> BlockPlanner: one profile for every budget

    def plan(self, budget: int, allow: tuple):
        """The plan within ``budget``; raises actsave.ConfigError where none fits."""
        if self.case.block is None:
            return actsave.plan(self.profile, budget, allow=_chain_levers(allow))
        return self._block_planner(allow).plan(budget)

    def _block_planner(self, allow: tuple) -> BlockPlanner:
        if allow not in self._block_planners:
            blocks = [(name, module) for name, module in self.planning_shell.named_modules()
                      if isinstance(module, self.case.block)]
            self._block_planners[allow] = BlockPlanner(self.planning_shell, blocks, self.case.inputs, allow)
        return self._block_planners[allow]

    def extremes(self, allow: tuple) -> tuple:
        """(smallest feasible peak, plain's peak) the planner predicts under ``allow``;
        raises actsave.ConfigError for a lever set it rejects."""
        if self.case.block is None:
            actsave.plan(self.profile, 2**62, allow=_chain_levers(allow))  # checks the levers
            smallest = actsave.plan(self.profile, None, objective="memory", allow=_chain_levers(allow))
            return smallest.predicted_peak_bytes, self.plain_peak
        planner = self._block_planner(allow)
        return planner.smallest_peak_bytes, planner.plain_peak_bytes

    def system(self, name: str, family: str, point: str, budget: int, allow: tuple, lever_name: str) -> System:
        plan = self.plan(budget, allow)
        if self.case.block is None:
            model = actsave.CheckpointedSequential(*self.case.plain)
            model.apply_plan(plan)
            planner_plain = self.plain_step
        else:
            model = actsave.wrap(shell(self.case.plain, (self.case.block,)), plan)
            planner_plain = plan.plain_step_seconds
        return System(name, family, point, model, levers=lever_name, budget=int(budget),
                      pred_peak=plan.predicted_peak_bytes, planner_step=plan.predicted_step_seconds,
                      planner_plain_step=planner_plain, plan=describe_plan(plan))


def compiled_at_peer(planner: Planner, peer: System, device: torch.device, backend_name: str) -> System:
    """actsave's exact plan within a compiled peer's measured peak, compiled by the
    peer's backend: the plan, not a memory budget, chooses what each block keeps (the
    backend runs at compile's default budget, 1.0; one backend object per system, as
    for the peers)."""
    [(lever_name, allow)] = lever_sets(device, ("exact",)).items()
    system = planner.system(f"actsave {lever_name}, compiled, at {peer.name}'s peak",
                            f"actsave {lever_name} compiled at a compiled peer's peak", peer.name, peer.peak, allow,
                            f"{lever_name}, compiled")
    system.compiled_by = BudgetedBackend(backend_name, 1.0)
    system.model = torch.compile(system.model, backend=system.compiled_by)
    system.peer = peer.name
    system.note = f"backend {backend_name}"
    return system


def _chain_levers(allow: tuple) -> tuple:
    return tuple(lever for lever in allow if lever not in BLOCK_ONLY_LEVERS)


def describe_plan(plan) -> str:
    """A plan in a few words: what each block or segment keeps, and how."""
    if isinstance(plan, actsave.BlockPlan):
        kept = collections.Counter("plain" if option is None else option.describe() for option in plan.options)
        return ", ".join(f"{way} {count}" for way, count in sorted(kept.items()))
    checkpointed = [option for _, _, option in plan.segments if option is not None]
    kept = collections.Counter(option.codec.name + (" on host" if option.offload else "") for option in checkpointed)
    ways = ", ".join(f"{way} {count}" for way, count in sorted(kept.items()))
    nested = sum(r is not None for r in plan.nested)
    coded = collections.Counter(codec for codec in plan.saves_codecs[:-1] if codec not in (None, "none"))
    return (f"{len(plan.starts)} segments, {len(checkpointed)} checkpointed" + (f" ({ways})" if ways else "")
            + (f", {nested} nested" if nested else "")
            + "".join(f", {count} plain saves {codec}" for codec, count in sorted(coded.items()))
            + (f", last saves {plan.saves_codec}" if plan.saves_codec != "none" else ""))


def lever_sets(device: torch.device, names) -> dict:
    return {name: LEVER_SETS[name] for name in names if device.type == "cuda" or name not in CUDA_ONLY}
