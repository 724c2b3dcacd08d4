"""What a sweep trains (:class:`Workload`, one seeded model and batch per depth) and
what it records (:class:`Measurement`); the seed and ``MiB``."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
from torch import nn

MiB = 2**20
SEED = 0


@dataclass(frozen=True)
class Workload:
    """What a sweep trains. Depth is counted as the model family counts it; the
    max-depth search steps over ``blocks`` (per stage for ResNets), the unit in which
    the family grows."""

    bench: str
    case: str  # the shapes, e.g. "cifar_resnet b8 16x16"
    build: Callable[[int], nn.Sequential]  # depth -> model
    make_batch: Callable[[torch.Generator], tuple]  # -> (inputs, targets) on the CPU
    depth_of_blocks: Callable[[int], int]
    blocks_of_depth: Callable[[int], int]
    config: dict
    depth_name: str = "depth {}"  # a model of that depth, as the pictures name it: "ResNet-{}"


def _seeded_model(workload: Workload, depth: int) -> nn.Sequential:
    torch.manual_seed(SEED)
    return workload.build(depth)


def _batch(workload: Workload, device: torch.device) -> tuple:
    inputs, targets = workload.make_batch(torch.Generator().manual_seed(SEED))
    return inputs.to(device), targets.to(device)


@dataclass(frozen=True)
class Measurement:
    """One metric of one provider; ``values`` are the repeats (one for exact metrics).
    ``case``: the shapes, where not the workload's (a real-scale stage's)."""

    provider: str
    metric: str
    x_name: str
    x_value: float
    values: tuple
    config: dict = field(default_factory=dict)
    case: Optional[str] = None
