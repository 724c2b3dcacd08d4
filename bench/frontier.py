"""The time-memory frontier: step time against measured activation
peak, one curve per system, so that a user can read off, for the memory they have,
which system runs their step fastest.

Cases (``--cases``; sizes per device in ``SIZES``):

- ``resnet``: ResNet-164 (bench/models.py cifar_resnet), a flat chain: plain
  ``nn.Sequential``; ``torch.utils.checkpoint.checkpoint_sequential`` (use_reentrant=False)
  at k in {2, 4, round(sqrt(n)), n // 4} segments; actsave's default
  ``CheckpointedSequential``; actsave planned: what ``CheckpointedSequential(segments=
  "auto", budget=B, example_inputs=(x,), loss=...)`` does (profile the chain, plan,
  apply the plan; the profile made once, so that every budget reads the same times),
  at ``--points`` budgets from its smallest feasible peak to plain's, per lever set.
- ``gpt``, ``llama``: stacks of GPT blocks (bench/models.py gpt) and of Llama-style
  blocks (models.llama: RMSNorm, rotary, SwiGLU, SDPA), and ``hf_llama``: a Hugging
  Face Llama built from a ``LlamaConfig`` (use_cache=False, SDPA attention), each a
  training step from token ids to a next-token cross-entropy: plain;
  ``torch.utils.checkpoint.checkpoint(block, ..., use_reentrant=False)`` on every block,
  every 2nd and every 4th (torchtitan's layer-selective rule: block i when (i + 1) % k
  == 0); torch's selective checkpointing (SAC) on every block with torchtitan's op
  list, and with its "every other matmul" rule (``SAC_SAVED_OPS``); with
  ``--compile``, ``torch.compile`` (Inductor unless ``--compile-backend``) with
  ``torch._functorch.config.activation_memory_budget`` at 0.1, 0.3 and 0.5 (a compile
  that fails is skipped with a note); actsave planned: ``actsave.plan_blocks(model,
  Block, budget, example_inputs, allow=...)`` then ``actsave.wrap(model, plan)``, at
  ``--points`` budgets from its smallest feasible peak to plain's, per lever set.

Lever sets (``LEVER_SETS``, data that grows with the planner's levers): exact
recompute, int8 allowed and, on CUDA only, offload allowed; a set the planner rejects
(a lever it does not know) is skipped with a note. Then, for each peer point (every
torch system but plain), actsave planned (``AT_PEER_LEVERS``) with the peer's measured
peak as its budget, and with half of plain's peak (its peer: plain): its measured peak
and its step against the peer's, in the main rounds and in ``--pair-rounds`` rounds of
the two alone (NOTE [ Pair rounds ]).

What is measured, per system, in one process:

- step: forward, loss and backward; parameter gradients allocated before (from the
  warm-up) and zeroed in place in each step. All systems share one set of parameters
  (each wraps the same modules in containers of its own: ``shell``), so they train
  the same weights and the parameters are allocated once, as on a GPU they must be.
- time: ``--warmup`` steps each (plans, compiles, the default's balanced plan), then
  ``--rounds`` interleaved rounds of one step of every system, each round's order
  rotated by one; process CPU time on a CPU (one intra-op thread unless --threads),
  wall time synchronized on CUDA. Reported: the median step, and the median over
  rounds of the ratio to plain's step of the same round. A second copy of plain
  ("plain, again") is timed in the same rounds: its ratio to plain is the run's noise
  floor, which a difference must exceed to mean anything.
- peak: activation bytes as actsave's budgets count them: how far the allocator's
  bytes rise above their value at the step's start (CPU: torch.profiler's memory
  events, harness.allocator_peak; CUDA: max_memory_allocated less memory_allocated at
  the start), plus the bytes of the inputs the planner counts (the chain's input, or
  every tensor of the blocks' example inputs). One step each, after the warm-up.
- predicted, for each actsave planned point: the plan's predicted peak, and its
  predicted step: plain's measured step plus what the planner predicts the plan adds
  to plain's (``pred_step_s``; the planner's own figures are ``planner_step_s`` and
  ``planner_plain_step_s``: a block plan's cover only the blocks' part of the step,
  BlockPlan.predicted_step_seconds, so only their difference compares to a whole step).

Output: a table per case on stdout, the at-peer comparison and its summary; a CSV,
``<device>-frontier.csv``, one row per system (``COLUMNS``; rows of other cases in the
file are kept), and ``<device>-frontier.png`` beside it: per case, step time over
plain's against measured peak, one line per system family, each actsave point's
prediction as a hollow marker joined to its measurement. In bench/results/local/
unless ``--record`` (bench/results/) or ``--out``. ``--replot`` draws the PNG again
from the CSV.

Default sizes on a CPU: ResNet-164 b8 32x32; 8 blocks of width 256, 4 heads, batch 4
of 256 tokens, vocabulary 1024 (256 tokens rather than 512: a GPT step is host-bound
on a CPU and its time grows with them, so every case at 512 would take about twice as
long).
On CUDA, the GPU speed stage's sizes (bench/gpu_speed.py): ResNet-164 b512 32x32 fp32
and 16 GPT blocks of width 2048, sequence 2048, batch 4, bf16; ``--cases`` adds the
Llamas at the GPT's size. The CPU's numbers are host-bound and say nothing about a
GPU's absolute times.

The torch.compile systems each compile with a backend of their own
(``BudgetedBackend``): with one backend, Dynamo reused the first budget's graph for
the others.

    python bench/frontier.py                          # CPU, every case (its time: docs/results.md)
    python bench/frontier.py --cases gpt --compile    # + torch.compile's memory budgets
    python bench/frontier.py --device cuda            # the GPU stage (gpu_check.py --only frontier)
    python bench/frontier.py --smoke                  # tiny, for the tests
"""
from __future__ import annotations

import argparse
import collections
import copy
import csv
import gc
import json
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernels are defined (codecs run references on CPU)

sys.path.insert(0, str(Path(__file__).resolve().parent))
import actsave  # noqa: E402
from actsave._torch import aten_overloads  # noqa: E402
from actsave.planning import plans as actsave_plans  # noqa: E402
from actsave.planning.block_step import run_step  # noqa: E402
from actsave.planning.blocks import BlockPlanner  # noqa: E402
from actsave.text import format_table  # noqa: E402
from torch.utils.checkpoint import (CheckpointPolicy, checkpoint, checkpoint_sequential,  # noqa: E402
                                    create_selective_checkpoint_contexts)

import harness  # noqa: E402
from host_overhead import interleaved_times, paired_ratio  # noqa: E402
from models import LlamaBlock, TransformerBlock, cifar_resnet, gpt, llama, swiglu_width  # noqa: E402

BENCH = "frontier"
MiB = 2**20

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

SIZES = {  # profile -> the cases' sizes, the cases run by default, points, rounds, warm-up steps, pair rounds
    "cpu": {"resnet": {"depth": 164, "batch": 8, "image": 32},
            "blocks": {"blocks": 8, "width": 256, "heads": 4, "vocab": 1024, "seq_len": 256, "batch": 4,
                       "dtype": "float32"},
            "cases": ("resnet", "gpt", "llama", "hf_llama"), "points": 8, "rounds": 5, "warmup": 2,
            "pair_rounds": 7},
    "cuda": {"resnet": {"depth": 164, "batch": 512, "image": 32},
             "blocks": {"blocks": 16, "width": 2048, "heads": 16, "vocab": 8192, "seq_len": 2048, "batch": 4,
                        "dtype": "bfloat16"},
             "cases": ("resnet", "gpt"), "points": 8, "rounds": 5, "warmup": 2, "pair_rounds": 5},
    "smoke": {"resnet": {"depth": 11, "batch": 2, "image": 8},
              "blocks": {"blocks": 2, "width": 32, "heads": 2, "vocab": 64, "seq_len": 16, "batch": 2,
                         "dtype": "float32"},
              "cases": ("resnet", "gpt", "llama", "hf_llama"), "points": 3, "rounds": 2, "warmup": 1,
              "pair_rounds": 2},
}
CASES = ("resnet", "gpt", "llama", "hf_llama")

COLUMNS = (
    "case", "system", "family", "point", "levers", "budget_bytes", "peak_bytes", "pred_peak_bytes", "step_s",
    "pred_step_s", "step_vs_plain", "peak_vs_plain", "planner_step_s", "planner_plain_step_s", "peer",
    "peak_vs_peer", "step_vs_peer", "step_vs_peer_paired", "plan", "note", "rounds", "device_name",
    "torch_version", "triton_version", "actsave_version", "git_sha", "timestamp_utc", "config_json",
)


# ------------------------------------------------------------------ the cases


@dataclass
class Case:
    """A model and batch every system trains. ``loss(model)`` runs the forward and
    returns the loss; ``inputs`` are the example inputs as the planner takes them
    (``(x,)`` for a chain, whose targets the loss holds; a tuple or dict for blocks);
    ``counted`` the bytes of the inputs a budget counts."""

    name: str
    description: str
    plain: nn.Module
    inputs: object
    loss: Callable[[nn.Module], torch.Tensor]
    counted: int
    block: Optional[type] = None  # None: a chain (nn.Sequential)
    chain_loss: Optional[Callable] = None  # a chain's loss on its logits, as CheckpointedSequential takes it
    config: dict = field(default_factory=dict)


class NextTokenLoss(nn.Module):
    """A token model with its loss: ``forward(ids, targets)`` returns the cross-entropy
    of its logits (harness.step_loss), so that a block plan's example step is the
    training step."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return harness.measure.step_loss(self.model(ids), targets)


def _unique_bytes(tensors) -> int:
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def resnet_case(device: torch.device, depth: int, batch: int, image: int) -> Case:
    generator = torch.Generator().manual_seed(harness.SEED)
    x = torch.randn(batch, 3, image, image, generator=generator).to(device)
    y = torch.randint(0, 10, (batch,), generator=generator).to(device)
    torch.manual_seed(harness.SEED)
    with torch.device(device):  # built where it trains: a GPU-sized model is not made on the host first
        plain = cifar_resnet(depth)

    def chain_loss(logits):
        return F.cross_entropy(logits, y)

    return Case(f"resnet{depth}", f"cifar_resnet({depth}) b{batch} {image}x{image} fp32", plain, (x,),
                lambda model: chain_loss(model(x)), _unique_bytes([x]), chain_loss=chain_loss,
                config={"model": f"cifar_resnet({depth})", "batch": batch, "image": image, "dtype": "float32"})


def token_batch(device, vocab: int, batch: int, seq_len: int) -> tuple:
    tokens = torch.randint(0, vocab, (batch, seq_len + 1), generator=torch.Generator().manual_seed(harness.SEED))
    return tokens[:, :-1].contiguous().to(device), tokens[:, 1:].contiguous().to(device)  # predict the next token


def stack_case(kind: str, device: torch.device, blocks: int, width: int, heads: int, vocab: int, seq_len: int,
               batch: int, dtype: str) -> Case:
    builder, block = {"gpt": (gpt, TransformerBlock), "llama": (llama, LlamaBlock)}[kind]
    ids, targets = token_batch(device, vocab, batch, seq_len)
    torch.manual_seed(harness.SEED)
    with torch.device(device):
        plain = NextTokenLoss(builder(blocks, width=width, heads=heads, vocab_size=vocab, max_seq_len=seq_len))
    plain = plain.to(dtype=getattr(torch, dtype))
    described = f"{kind}({blocks}) w{width} h{heads} v{vocab} t{seq_len} b{batch} {dtype}"
    return Case(f"{kind}{blocks}", described, plain, (ids, targets), lambda model: model(ids, targets),
                _unique_bytes([ids, targets]), block=block,
                config={"model": f"bench/models.py {kind}", "blocks": blocks, "width": width, "heads": heads,
                        "vocab": vocab, "seq_len": seq_len, "batch": batch, "dtype": dtype})


def hf_llama_case(device: torch.device, blocks: int, width: int, heads: int, vocab: int, seq_len: int, batch: int,
                  dtype: str) -> Optional[Case]:
    """A Hugging Face Llama built from its config (no download), or None without
    transformers. Labels are the input ids (the model shifts them)."""
    try:
        import transformers
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer
    except ImportError:
        return None
    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=width, intermediate_size=swiglu_width(width),
                                      num_hidden_layers=blocks, num_attention_heads=heads, num_key_value_heads=heads,
                                      max_position_embeddings=seq_len, bos_token_id=0, eos_token_id=0,
                                      use_cache=False, attn_implementation="sdpa")
    torch.manual_seed(harness.SEED)
    with torch.device(device):
        plain = transformers.AutoModelForCausalLM.from_config(config).train()
    plain = plain.to(dtype=getattr(torch, dtype))
    plain.config.use_cache = False
    ids, _ = token_batch(device, vocab, batch, seq_len)
    inputs = {"input_ids": ids, "labels": ids}
    described = f"hf_llama({blocks}) w{width} h{heads} v{vocab} t{seq_len} b{batch} {dtype} (Hugging Face)"
    return Case(f"hf_llama{blocks}", described, plain, inputs, lambda model: run_step(model, inputs),
                _unique_bytes([ids]), block=LlamaDecoderLayer,
                config={"model": f"transformers {transformers.__version__} LlamaForCausalLM", "blocks": blocks,
                        "width": width, "heads": heads, "vocab": vocab, "seq_len": seq_len, "batch": batch,
                        "dtype": dtype, "attention": plain.config._attn_implementation})


def build_case(name: str, sizes: dict, device: torch.device) -> Optional[Case]:
    if name == "resnet":
        return resnet_case(device, **sizes["resnet"])
    if name == "hf_llama":
        return hf_llama_case(device, **sizes["blocks"])
    return stack_case(name, device, **sizes["blocks"])


# ------------------------------------------------------------------ the systems


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


# ------------------------------------------------------------------ measuring


def step_of(case: Case, system: System) -> Callable[[], None]:
    """One training step of ``system``, gradients zeroed in place first."""
    def step():
        system.model.zero_grad(set_to_none=False)
        case.loss(system.model).backward()
    return step


def measure_peak(case: Case, system: System, device: torch.device) -> int:
    """The step's activation peak as actsave's budgets count it (module docstring)."""
    system.model.zero_grad(set_to_none=False)

    def forward_backward():
        case.loss(system.model).backward()

    if system.saved is not None:
        system.saved.clear()
    if device.type != "cuda":
        return harness.allocator_peak(forward_backward) + case.counted
    gc.collect()
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    forward_backward()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - before + case.counted


def warm_up(case: Case, systems: list, steps: int, log) -> list:
    """Each system's warm-up steps (plans, compiles); a compiled system that fails is
    left out with a note. Returns the systems that ran."""
    ran = []
    for system in systems:
        try:
            for _ in range(steps):
                step_of(case, system)()
        except Exception as error:  # noqa: BLE001 (a compile failure of any kind: skipped, said so)
            if not system.family.startswith("torch.compile"):
                raise
            log(f"{case.name}: {system.name} skipped: {type(error).__name__}: {str(error).splitlines()[0][:200]}")
            continue
        if system.compiled_by is not None and not system.compiled_by.compiles:
            raise RuntimeError(f"{system.name}: its backend compiled nothing; it ran another system's graph")
        ran.append(system)
    return ran


def sac_check(system: System) -> None:
    """A SAC policy that saved nothing names no op that runs (a packet for an
    overload): its curve would be per-block checkpointing mislabelled."""
    if not system.saved_a_step:
        raise RuntimeError(f"{system.name}: the policy saved no output in a step; it names none of the ops the blocks "
                           "run (policies must name overloads, aten.mm.default, not aten.mm)")


def saved_text(saved: collections.Counter) -> str:
    return ", ".join(f"{op.removeprefix('aten.')} {count}" for op, count in sorted(saved.items()))


# ------------------------------------------------------------------ one case


@dataclass
class CaseResult:
    case: Case
    systems: list
    notes: list


def run_case(case: Case, args, device: torch.device, log) -> CaseResult:
    notes = []
    started = time.monotonic()
    # Gradients allocated before any step, as from the second step of training: every
    # system shares these parameters and so these gradients.
    for p in case.plain.parameters():
        if p.requires_grad and p.grad is None:
            p.grad = torch.zeros_like(p)
    peers = torch_systems(case, args.compile_backend if args.compile else None)
    if case.block is None:
        peers.insert(2, System("actsave default", "actsave default", "CheckpointedSequential()",
                               actsave.CheckpointedSequential(*case.plain)))
    log(f"{case.name}: {case.description}; warming up {len(peers)} systems")
    peers = warm_up(case, peers, args.warmup, log)
    for system in peers:
        system.peak = measure_peak(case, system, device)
        if system.saved is not None:
            system.saved_a_step = collections.Counter(system.saved)
            sac_check(system)
    log(f"{case.name}: peaks measured; planning ({time.monotonic() - started:.0f} s)")

    planner = Planner(case)
    planned = []
    for lever_name, allow in lever_sets(device, args.levers).items():
        try:
            smallest, top = planner.extremes(allow)
        except actsave.ConfigError as error:
            notes.append(f"lever set {lever_name} {allow} skipped: the planner rejects it ({error})")
            continue
        budgets = [round(smallest + (top - smallest) * i / (args.points - 1)) for i in range(args.points)]
        for i, budget in enumerate(budgets):
            share = (budget - smallest) / (top - smallest) if top > smallest else 1.0
            planned.append(planner.system(f"actsave {lever_name} @ {budget / MiB:.2f} MiB", f"actsave {lever_name}",
                                          f"{share:.0%} of smallest..plain", budget, allow, lever_name))
    planned += at_peer_systems(planner, peers, device, notes)
    for peer in [s for s in peers if s.compiled_by is not None]:
        planned.append(compiled_at_peer(planner, peer, device, args.compile_backend))
    log(f"{case.name}: {len(planned)} actsave plans made ({time.monotonic() - started:.0f} s); warming them up")
    planned = warm_up(case, planned, args.warmup, log)
    for system in planned:
        system.peak = measure_peak(case, system, device)
    systems = peers + planned
    log(f"{case.name}: timing {args.rounds} rounds of {len(systems)} systems ({time.monotonic() - started:.0f} s)")
    times = interleaved_times({s.name: step_of(case, s) for s in systems}, args.rounds, device, rotate=True)
    for system in systems:
        system.times = times[system.name]
    if args.pair_rounds:
        log(f"{case.name}: timing each pair in {args.pair_rounds} rounds of its own "
            f"({time.monotonic() - started:.0f} s)")
        time_pairs(case, systems, args.pair_rounds, device)
    log(f"{case.name}: done in {time.monotonic() - started:.0f} s")
    for system in peers:
        if system.saved_a_step is not None:
            notes.append(f"{system.name}: its policy saved, a step: {saved_text(system.saved_a_step)}")
    return CaseResult(case, systems, notes)


# ------------------------------------------------------------------ reports


def at_peer_systems(planner: Planner, peers: list, device: torch.device, notes: list) -> list:
    """actsave planned with each peer's measured peak as its budget (``AT_PEER_LEVERS``),
    and with half of plain's: the issue's target points, each timed against its peer
    (plain, for the half) in rounds of their own (NOTE [ Pair rounds ])."""
    plain = next(s for s in peers if s.family == "plain")
    targets = [(peer, peer.name, peer.peak) for peer in peers if peer.is_peer]
    targets.append((plain, "half of plain's peak", plain.peak // 2))
    systems = []
    for lever_name, allow in lever_sets(device, AT_PEER_LEVERS).items():
        for peer, point, budget in targets:
            name = f"actsave {lever_name} at {point}" if peer is plain else f"actsave {lever_name} at {point}'s peak"
            try:
                system = planner.system(name, f"actsave {lever_name} at a peer's peak", point, budget, allow,
                                        lever_name)
            except actsave.ConfigError as error:
                notes.append(f"{name}: no plan fits {budget / MiB:.2f} MiB ({str(error).splitlines()[0][:160]})")
                continue
            system.peer = peer.name
            systems.append(system)
    return systems


# NOTE [ Pair rounds ]
# Steps timed seconds apart differ by more than the targets' margins on a shared CPU:
# in one round of some 50 systems, the same plain step read 5-12% apart. So each
# target point (actsave at a peer's peak, at half of plain's) is also timed against its
# peer alone, in rounds of their own right after the main ones, the two steps adjacent
# and their order alternating (AB, BA, ...: neither always runs first); its
# step_vs_peer_paired is the median of those rounds' ratios. plain and "plain, again"
# are paired the same way: the noise floor of a pair.
def time_pairs(case: Case, systems: list, rounds: int, device: torch.device) -> None:
    """Each target point's ``pair_times`` against its peer, and the noise floor's: NOTE [
    Pair rounds ]."""
    by_name = {s.name: s for s in systems}
    again = next(s for s in systems if s.family == "again")
    pairs = [(s, by_name[s.peer]) for s in systems if s.peer] + [(again, by_name["plain"])]
    for system, peer in pairs:
        steps = {"system": step_of(case, system), "peer": step_of(case, peer)}
        times = interleaved_times(steps, rounds, device, rotate=True)
        system.pair_times = (times["system"], times["peer"])


def _paired(system: System) -> Optional[float]:
    if system.pair_times is None:
        return None
    return statistics.median(a / b for a, b in zip(*system.pair_times))


def _times(result: CaseResult) -> dict:
    return {s.name: s.times for s in result.systems}


def plain_of(result: CaseResult) -> System:
    return next(s for s in result.systems if s.name == "plain")


def predicted_step(system: System, plain: System) -> Optional[float]:
    """Plain's measured step plus what the planner predicts the plan adds to plain's."""
    if system.planner_step is None:
        return None
    return statistics.median(plain.times) + system.planner_step - system.planner_plain_step


def rows_of(result: CaseResult, metadata: dict, run_config: dict) -> list:
    plain = plain_of(result)
    times = _times(result)
    by_name = {s.name: s for s in result.systems}
    rows = []
    for s in result.systems:
        peer = by_name.get(s.peer)
        predicted = predicted_step(s, plain)
        rows.append({
            "case": result.case.description, "system": s.name, "family": s.family, "point": s.point,
            "levers": s.levers, "budget_bytes": s.budget, "peak_bytes": s.peak, "pred_peak_bytes": s.pred_peak,
            "step_s": statistics.median(s.times), "pred_step_s": predicted,
            "step_vs_plain": paired_ratio(times, s.name, plain.name), "peak_vs_plain": s.peak / plain.peak,
            "planner_step_s": s.planner_step, "planner_plain_step_s": s.planner_plain_step,
            "peer": s.peer, "peak_vs_peer": None if peer is None else s.peak / peer.peak,
            "step_vs_peer": None if peer is None else paired_ratio(times, s.name, peer.name),
            "step_vs_peer_paired": _paired(s),
            "plan": s.plan, "note": "; ".join(filter(None, [s.note, _saved_note(s)])),
            "rounds": len(s.times), **metadata,
            "config_json": json.dumps({**result.case.config, **run_config}, sort_keys=True),
        })
    return rows


def _saved_note(system: System) -> str:
    return f"saved a step: {saved_text(system.saved_a_step)}" if system.saved_a_step else ""


def _mib(nbytes) -> str:
    return "-" if nbytes is None or nbytes == "" else f"{float(nbytes) / MiB:.2f}"


def _ms(seconds) -> str:
    return "-" if seconds is None or seconds == "" else f"{float(seconds) * 1e3:.1f}"


def _x(ratio) -> str:
    return "-" if ratio is None or ratio == "" else f"{float(ratio):.3f}x"


def case_table(rows: list) -> str:
    lines = [["system", "budget MiB", "peak MiB", "pred peak", "step ms", "pred step", "x plain step",
              "x plain peak", "plan"]]
    for r in rows:
        lines.append([r["system"], _mib(r["budget_bytes"]), _mib(r["peak_bytes"]), _mib(r["pred_peak_bytes"]),
                      _ms(r["step_s"]), _ms(r["pred_step_s"]), _x(r["step_vs_plain"]), _x(r["peak_vs_plain"]),
                      r["plan"]])
    return format_table(lines)


def at_peer_table(rows: list, with_case: bool = False) -> str:
    """Each peer point against actsave planned within that peer's measured peak."""
    by_system = {(r["case"], r["system"]): r for r in rows}
    lines = [(["case"] if with_case else []) + ["peer", "peer peak MiB", "peer step ms", "actsave levers",
                                                "actsave peak / peer's", "actsave step / peer's",
                                                "in pair rounds", "actsave plan"]]
    for r in rows:
        if not r["peer"]:
            continue
        peer = by_system[(r["case"], r["peer"])]
        point = r["peer"] if r["point"] == r["peer"] else f"{r['peer']} ({r['point']})"
        lines.append(([r["case"].split(" ")[0]] if with_case else [])
                     + [point, _mib(peer["peak_bytes"]), _ms(peer["step_s"]), r["levers"],
                        _x(r["peak_vs_peer"]), _x(r["step_vs_peer"]), _x(r["step_vs_peer_paired"]), r["plan"]])
    return format_table(lines)


def noise_line(rows: list) -> str:
    again = next(r for r in rows if r["family"] == "again")
    paired = again["step_vs_peer_paired"]
    in_pairs = f"; in pair rounds, {_x(paired)}" if paired not in (None, "") else ""
    return (f"noise floor: plain timed twice in the same rounds, the second copy at {_x(again['step_vs_plain'])} "
            f"the first (median of paired ratios){in_pairs}; a difference of that size means nothing")


# ------------------------------------------------------------------ files


def write_rows(rows: list, path: Path) -> None:
    """Write ``rows`` to ``path``, keeping the rows of other cases already there (a file
    with other columns is replaced)."""
    cases = {r["case"] for r in rows}
    kept = []
    if path.exists():
        with path.open(newline="") as f:
            reader = csv.DictReader(f)
            if tuple(reader.fieldnames or ()) == COLUMNS:
                kept = [r for r in reader if r["case"] not in cases]
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(kept + [{k: ("" if v is None else v) for k, v in r.items()} for r in rows])


def read_rows(path: Path) -> list:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


# How each family is drawn: (colour, marker, line style). Unknown families (a lever
# set added to LEVER_SETS) get the default cycle's colour and a circle.
FAMILY_STYLES = {
    "plain": ("black", "o", ""),
    "again": ("grey", "x", ""),
    "torch checkpoint_sequential": ("tab:orange", "s", "-"),
    "torch checkpoint per block": ("tab:orange", "s", "-"),
    "torch SAC (torchtitan's ops)": ("tab:purple", "P", "-"),
    "torch.compile memory budget": ("tab:brown", "v", "-"),
    "actsave default": ("tab:green", "*", ""),
    "actsave recompute": ("tab:blue", "o", ":"),
    "actsave exact": ("tab:green", "o", "-"),
    "actsave int8": ("tab:red", "D", "--"),
    "actsave offload": ("tab:cyan", "^", "-."),
    "actsave int8+offload": ("tab:pink", "^", "--"),
    "actsave exact at a peer's peak": ("tab:green", "d", ""),
    "actsave int8+offload at a peer's peak": ("tab:pink", "d", ""),
    "actsave exact compiled at a compiled peer's peak": ("tab:olive", "D", ""),
}


def _number(text) -> Optional[float]:
    return None if text in ("", None) else float(text)


def plot(rows: list, path: Path, title: str) -> Optional[str]:
    """Per case, step time over plain's against measured peak, one line per family;
    each actsave point's prediction a hollow marker joined to its measurement. Returns
    a note instead when matplotlib is missing."""
    plt = harness.pyplot()
    if plt is None:
        return harness.MATPLOTLIB_MISSING
    from matplotlib.lines import Line2D
    cases = list(dict.fromkeys(r["case"] for r in rows))
    columns = min(2, len(cases))
    lines = math.ceil(len(cases) / columns)
    fig, axes = plt.subplots(lines, columns, figsize=(7.5 * columns + 3.5, 5.2 * lines), squeeze=False)
    handles = {}
    for ax, case in zip(axes.flat, cases):
        case_rows = [r for r in rows if r["case"] == case]
        for family in dict.fromkeys(r["family"] for r in case_rows):
            members = sorted((r for r in case_rows if r["family"] == family), key=lambda r: float(r["peak_bytes"]))
            color, marker, linestyle = FAMILY_STYLES.get(family, (None, "o", "-"))
            xs = [float(r["peak_bytes"]) / MiB for r in members]
            ys = [float(r["step_vs_plain"]) for r in members]
            (line,) = ax.plot(xs, ys, marker=marker, linestyle=linestyle or "none", color=color, label=family,
                              markersize=7 if marker != "*" else 12)
            handles.setdefault(family, line)
            plain_step = next(float(r["step_s"]) for r in case_rows if r["family"] == "plain")
            for r, x, y in zip(members, xs, ys):
                predicted_peak, predicted = _number(r["pred_peak_bytes"]), _number(r["pred_step_s"])
                if predicted_peak is None or predicted is None:
                    continue
                px, py = predicted_peak / MiB, predicted / plain_step
                ax.plot([x, px], [y, py], color=line.get_color(), linewidth=0.6, linestyle=":")
                ax.plot([px], [py], marker=marker, linestyle="none", markerfacecolor="none", color=line.get_color(),
                        markersize=7)
                handles.setdefault("actsave's prediction (hollow), dotted to its measurement", Line2D(
                    [], [], marker="o", linestyle=":", linewidth=0.6, markerfacecolor="none", color="black"))
        ax.set_title(case, fontsize=10)
        ax.set_xlabel("measured activation peak (MiB), as actsave's budgets count it")
        ax.set_ylabel("step time / plain's (median of paired rounds)")
        ax.grid(True, alpha=0.3)
    for ax in list(axes.flat)[len(cases):]:
        ax.axis("off")
    fig.legend(list(handles.values()), list(handles), loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=9)
    fig.suptitle(title, fontsize=11)
    harness.save_figure(fig, path)
    return None


# ------------------------------------------------------------------ main


def parse_arguments(argv) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", type=lambda text: [c.strip() for c in text.split(",") if c.strip()], default=None,
                        help=f"comma-separated, from {','.join(CASES)} (default: cpu and smoke all of them, "
                             "cuda resnet,gpt)")
    parser.add_argument("--device", type=harness.parse_device, default=None,
                        help="cpu or cuda (default: cuda when available, else cpu)")
    parser.add_argument("--points", type=int, default=None,
                        help="budgets per actsave lever set, from its smallest feasible peak to plain's (default 8; "
                             "--smoke 3)")
    parser.add_argument("--levers", type=lambda text: [c.strip() for c in text.split(",") if c.strip()],
                        default=list(DEFAULT_LEVER_SETS),
                        help=f"actsave's lever sets, from {','.join(LEVER_SETS)} (default "
                             f"{','.join(DEFAULT_LEVER_SETS)}; "
                             f"{','.join(sorted(CUDA_ONLY))} on CUDA only)")
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds (default 5; --smoke 2)")
    parser.add_argument("--pair-rounds", type=int, default=None,
                        help="rounds of each target point against its peer alone, after the main rounds "
                             "(NOTE [ Pair rounds ]; default 7 on a CPU, 5 on CUDA, --smoke 2; 0: none)")
    parser.add_argument("--warmup", type=int, default=None, help="warm-up steps per system (default 2; --smoke 1)")
    parser.add_argument("--compile", action="store_true",
                        help="add torch.compile with activation_memory_budget at "
                             f"{', '.join(map(str, COMPILE_BUDGETS))} (the block stacks)")
    parser.add_argument("--compile-backend", default="inductor", help="torch.compile's backend (default inductor)")
    parser.add_argument("--threads", type=int, default=1, help="intra-op CPU threads on a CPU (default 1)")
    harness.add_output_arguments(parser, "CSV, <device>-frontier.csv; the PNG is written next to it")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, few rounds, for the tests")
    parser.add_argument("--replot", action="store_true", help="measure nothing: draw the PNG again from the CSV")
    args = parser.parse_args(argv)
    if args.device is None:
        args.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    profile = "smoke" if args.smoke else args.device.type
    sizes = SIZES[profile]
    args.sizes = sizes
    args.cases = args.cases or list(sizes["cases"])
    unknown = sorted(set(args.cases) - set(CASES)) + sorted(set(args.levers) - set(LEVER_SETS))
    if unknown:
        parser.error(f"unknown case(s) or lever set(s) {unknown}; cases: {list(CASES)}, lever sets: "
                     f"{list(LEVER_SETS)}")
    args.points = args.points or sizes["points"]
    if args.points < 2:
        parser.error("--points: at least 2 (the smallest feasible peak and plain's)")
    args.rounds = args.rounds or sizes["rounds"]
    args.pair_rounds = args.pair_rounds if args.pair_rounds is not None else sizes["pair_rounds"]
    args.warmup = args.warmup if args.warmup is not None else sizes["warmup"]
    if args.device.type == "cuda" and not torch.cuda.is_available():
        args.out = None  # main says why it stops; the device's name, in the path, is unknown
    else:
        args.out = harness.output_path(args, f"{harness.device_slug(args.device)}-frontier.csv")
    return args


def summary_table(rows: list) -> str:
    return at_peer_table(rows, with_case=True)


def main(argv=None) -> int:
    args = parse_arguments(argv)
    if args.device.type == "cuda" and not torch.cuda.is_available():
        print("frontier: --device cuda needs a CUDA GPU; none is available here (run it on the CPU, or --smoke)",
              file=sys.stderr)
        return 2
    png = args.out.with_suffix(".png")
    if args.replot:
        if not args.out.exists():
            raise SystemExit(f"--replot: no {args.out}")
        rows = read_rows(args.out)
        note = plot(rows, png, f"time-memory frontier on {rows[0]['device_name']}")
        print(f"note: {note}" if note else harness.wrote(png))
        return 0
    if args.device.type == "cpu":
        torch.set_num_threads(args.threads)
    started = time.monotonic()

    def log(message: str) -> None:
        print(f"[frontier +{time.monotonic() - started:6.1f} s] {message}", flush=True)

    metadata = harness.run_metadata(args.device)
    clock = "wall time, synchronized" if args.device.type == "cuda" else "process CPU time"
    run_config = {"rounds": args.rounds, "pair_rounds": args.pair_rounds, "warmup": args.warmup, "points": args.points, "clock": clock,
                  "threads": torch.get_num_threads(), "compile": args.compile_backend if args.compile else None}
    title = f"time-memory frontier on {metadata['device_name']}"
    print(f"{title}, torch {metadata['torch_version']}, at {metadata['git_sha']}; {clock}, "
          f"{torch.get_num_threads()} thread(s); medians of {args.rounds} interleaved rounds", flush=True)
    every_row = []
    for name in args.cases:
        case = build_case(name, args.sizes, args.device)
        if case is None:
            print(f"\n{name}: skipped, transformers is not installed (pip install transformers)")
            continue
        result = run_case(case, args, args.device, log)
        rows = rows_of(result, metadata, run_config)
        every_row += rows
        print(f"\n{case.description}  (peaks: activation bytes as actsave's budgets count them; pred step: plain's "
              "measured step plus the plan's predicted extra)")
        print(case_table(rows))
        print(noise_line(rows))
        if any(r["peer"] for r in rows):
            print("at each peer's measured peak, actsave planned with that peak as its budget:")
            print(at_peer_table(rows))
        for note in result.notes:
            print(f"note: {note}")
        write_rows(rows, args.out)  # after each case: a run cut short keeps what it measured
        del result, case
        gc.collect()
        if args.device.type == "cuda":
            torch.cuda.empty_cache()
    if every_row:
        print("\nsummary: each peer point against actsave planned within its measured peak")
        print(summary_table(every_row))
    note = plot(read_rows(args.out), png, title) if args.out.exists() else None
    if note:
        print(f"note: {note}")
    log(harness.wrote(args.out, *([] if note else [png])))
    return 0


if __name__ == "__main__":
    harness.imports_frozen()  # NOTE [ A script's imports, frozen ]
    sys.exit(main(sys.argv[1:]))
