"""The providers a sweep compares: how each turns a plain ``nn.Sequential`` into the
model it trains (plain torch, torch checkpointing, actsave modes)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint, checkpoint_sequential

import actsave

from .measure import step_loss


class TorchCheckpointSequential(nn.Module):
    """``torch.utils.checkpoint.checkpoint_sequential`` over ``chain`` with
    ``round(sqrt(n))`` segments (the split of actsave's ``segments="sqrt"``)."""

    def __init__(self, chain: nn.Sequential):
        super().__init__()
        self.chain = chain
        self.segments = max(1, round(math.sqrt(len(chain))))

    def forward(self, x):
        return checkpoint_sequential(self.chain, self.segments, x, use_reentrant=False)


@dataclass(frozen=True)
class Provider:
    """How to turn a plain ``nn.Sequential`` into the model a provider trains, given a
    training batch and the memory budget (for the planned provider). ``timed_plan``:
    it plans from a timed step, so it cannot be built on meta tensors."""

    build: Callable[[nn.Sequential, tuple, int], nn.Module]
    description: str
    uses_actsave: bool = False
    timed_plan: bool = False


def _actsave(**options) -> Provider:
    settings = ", ".join(f"{k}={v!r}" for k, v in options.items())
    return Provider(
        build=lambda chain, batch, budget: actsave.CheckpointedSequential.from_sequential(chain, **options),
        description=f"actsave.CheckpointedSequential({settings})",
        uses_actsave=True,
    )


def _actsave_planned(chain: nn.Sequential, batch: tuple, budget: int) -> nn.Module:
    # The fastest plan within the budget; where no plan fits it, the smallest peak
    # (so the sweep still shows the planner at depths past the budget). The sweep's
    # budget bounds the whole step; the planner's bounds activations, so the resident
    # parameters, their gradients and the buffers come off first. The profile runs the
    # step's own loss: cross-entropy's memory comes on top of all the forward left, so
    # a plan that fills its budget must know it (memory_model.py, the loss event).
    inputs, targets = batch
    resident = sum(2 * p.numel() * p.element_size() for p in chain.parameters())
    resident += sum(b.numel() * b.element_size() for b in chain.buffers())
    model = actsave.CheckpointedSequential.from_sequential(chain, segments=1)
    profile = actsave.profile(model, (inputs,), loss=lambda logits: step_loss(logits, targets))
    try:
        plan = actsave.plan(profile, budget - resident)
    except actsave.ConfigError:
        plan = actsave.plan(profile, None, objective="memory")
    model.apply_plan(plan)
    return model


PROVIDERS = {
    "torch": Provider(lambda chain, batch, budget: chain, "nn.Sequential"),
    "torch_ckpt": Provider(
        lambda chain, batch, budget: TorchCheckpointSequential(chain),
        "checkpoint_sequential(round(sqrt(n)) segments, use_reentrant=False)",
    ),
    "actsave_none": _actsave(),
    "actsave_int8": _actsave(compress="int8"),
    "actsave_fp8": _actsave(compress="fp8"),
    "actsave_offload": _actsave(offload=True),
    "actsave_int8_offload": _actsave(compress="int8", offload=True),
    "actsave_auto": Provider(
        _actsave_planned, "actsave.plan(profile(..., loss=cross-entropy), budget=--budget) applied", uses_actsave=True,
        timed_plan=True,
    ),
}
REFERENCE = "torch"


class TorchCheckpointBlock(nn.Module):
    """``torch.utils.checkpoint.checkpoint(block, *args, use_reentrant=False)``: one
    block checkpointed as torch's users write it, in a wrapper module as
    :func:`actsave.wrap` puts each block in one (so both pay one more module call)."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    def forward(self, *args, **kwargs):
        return checkpoint(self.block, *args, use_reentrant=False, **kwargs)


def _torch_checkpoint_blocks(model: nn.Module, block_class: type) -> nn.Module:
    for name, child in list(model.named_children()):
        if isinstance(child, block_class):
            setattr(model, name, TorchCheckpointBlock(child))
        else:
            _torch_checkpoint_blocks(child, block_class)
    return model


@dataclass(frozen=True)
class BlockProvider:
    """How to checkpoint the blocks of a model that is not one chain (a transformer's
    stack): ``build(model, block_class)`` wraps each block of ``model`` in place and
    returns it. Give it a container of its own (``nn.Sequential(*shared)``) to share
    the blocks, and so their parameters, with other providers."""

    build: Callable[[nn.Module, type], nn.Module]
    description: str
    uses_actsave: bool = False


def _actsave_blocks(**options) -> BlockProvider:
    settings = "".join(f", {k}={v!r}" for k, v in options.items())
    return BlockProvider(lambda model, block_class: actsave.wrap(model, block_class, **options),
                         f"actsave.wrap(model, Block{settings})", uses_actsave=True)


# The same names as PROVIDERS, per block instead of per segment.
BLOCK_PROVIDERS = {
    "torch": BlockProvider(lambda model, block_class: model, "plain blocks"),
    "torch_ckpt": BlockProvider(_torch_checkpoint_blocks,
                                "torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False) per block"),
    "actsave_none": _actsave_blocks(),
    "actsave_int8": _actsave_blocks(compress="int8"),
    "actsave_fp8": _actsave_blocks(compress="fp8"),
    "actsave_offload": _actsave_blocks(offload=True),
    "actsave_int8_offload": _actsave_blocks(compress="int8", offload=True),
}


class ProviderError(RuntimeError):
    """A provider the run asked for cannot be built."""


def available_providers(names: list) -> tuple:
    """``(names, [])`` once every provider in ``names`` builds on a small chain, so that
    a run fails at its start, not mid-sweep. A provider that fails to build raises
    :class:`ProviderError` naming it and the cause: a benchmark does not skip what it
    was asked to measure. (The empty list of notes keeps the shape callers unpack.)"""
    probe, batch = nn.Sequential(nn.Linear(2, 2), nn.ReLU()), (torch.randn(2, 2), torch.tensor([0, 1]))
    for name in names:
        provider = PROVIDERS[name]
        try:
            provider.build(probe, batch, 2**30)
        except Exception as error:
            raise ProviderError(f"provider {name!r} ({provider.description}) fails to build: "
                                f"{type(error).__name__}: {error}") from error
    return list(names), []


# What a picture calls each provider id of the results files: the API call a user
# writes, so a legend reads as the code it stands for. The ids stay in the CSV and the
# console tables. One mapping for every bench (tests/bench checks that it covers the
# providers of PROVIDERS, BLOCK_PROVIDERS and the committed results).
DISPLAY_NAMES = {
    "torch": "nn.Sequential",
    "torch_ckpt": "torch.utils.checkpoint",
    "actsave_none": "CheckpointedSequential()",
    "actsave_int8": 'compress="int8"',
    "actsave_fp8": 'compress="fp8"',
    "actsave_fp8_e4m3": 'compress="fp8_e4m3"',
    "actsave_fp8_e5m2": 'compress="fp8_e5m2"',
    "actsave_offload": "offload=True",
    "actsave_none_offload": "offload=True",  # bench/offload_overlap.py's id of the same mode
    "actsave_int8_offload": 'compress="int8", offload=True',
    "actsave_auto": 'segments="auto", budget=B',
    # bench/rotor_compare.py: the planner with recompute only, and the rotor reference
    "actsave_recompute": 'segments="auto", recompute only',
    "rotor": "rotor (Beaumont et al. 2019)",
    "rotor_lower_bound": "rotor, sizes rounded down",
    "rotor_single_level": "rotor, single level",
    # bench/kernels.py: one codec kernel each
    "int8": 'codec "int8"',
    "fp8_e4m3": 'codec "fp8_e4m3"',
    "fp8_e5m2": 'codec "fp8_e5m2"',
}


def display_name(provider: str) -> str:
    """The name a picture gives ``provider`` (see ``DISPLAY_NAMES``)."""
    return DISPLAY_NAMES[provider]
