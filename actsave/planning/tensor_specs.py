"""What a measured step notes of a tensor, enough to make another like it: a layer's
input (:class:`TensorSpec`; the codec costs, codec_costs.py, and the block options,
block_options.py, are measured on such stand-ins) and a max pool call
(:class:`PoolSample`)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch

from ..runtime.keep_rules import CallerTensors, should_encode
from ..runtime.pool_decisions import Window


@dataclass(frozen=True)
class TensorSpec:
    """What the planner needs of a layer input: enough to make another like it."""

    shape: tuple
    dtype: torch.dtype
    storage_bytes: int
    requires_grad: bool
    encodable: bool  # whether actsave would encode or offload it: keep_rules.should_encode

    @classmethod
    def of(cls, t: torch.Tensor, made_by: Optional[CallerTensors] = None) -> "TensorSpec":
        """``made_by``: ``t`` is a layer input after the first, made by the chain."""
        return cls(tuple(t.shape), t.dtype, t.untyped_storage().nbytes(), t.requires_grad, should_encode(t, made_by))

    @property
    def dense_bytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


class PoolSample(NamedTuple):
    """A max pool call of the profiled step: enough to make one like it."""

    window: Window
    input_size: tuple
    indices_shape: tuple
