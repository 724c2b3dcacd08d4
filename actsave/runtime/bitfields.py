"""Small unsigned fields packed into bytes: the form of the decisions a lossy
checkpoint keeps (ReLU signs, 1 bit: relu_signs.py; max-pool window offsets, 1-8
bits: pool_decisions.py). Field ``j`` of a byte holds element ``j`` of its group, in
bits ``j * bits`` upward."""
from __future__ import annotations

import torch

_SHIFTS = {}


def _shifts(bits: int, device) -> torch.Tensor:
    key = (bits, device)
    if key not in _SHIFTS:
        _SHIFTS[key] = torch.arange(0, 8, bits, dtype=torch.uint8, device=device)
    return _SHIFTS[key]


def pack(values: torch.Tensor, bits: int) -> torch.Tensor:
    """``values`` (uint8, 1-D, each below ``2 ** bits``; ``bits`` in 1, 2, 4, 8) packed
    into ``ceil(numel * bits / 8)`` bytes."""
    if bits == 8:
        return values
    per_byte = 8 // bits
    padded = torch.nn.functional.pad(values, (0, -values.numel() % per_byte)).view(-1, per_byte)
    # Disjoint bit fields: their sum is their OR.
    return (padded << _shifts(bits, values.device)).sum(1, dtype=torch.uint8)


def unpack(packed: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """The first ``count`` values :func:`pack` packed, as uint8, 1-D."""
    if bits == 8:
        return packed
    fields = (packed.unsqueeze(1) >> _shifts(bits, packed.device)) & (2 ** bits - 1)
    return fields.reshape(-1)[:count]
