"""Small unsigned fields packed into bytes: the form of the decisions a lossy
checkpoint keeps (ReLU signs, 1 bit: actsave/runtime/relu_signs.py; max-pool window
offsets, 1-8 bits: actsave/runtime/pool_decisions.py), written by the kernels of
decisions/ and their torch references.

NOTE [ Bit fields ]
Field ``j`` of a byte holds element ``j`` of its group of ``8 // bits`` elements, in
bits ``j * bits`` upward; ``n`` fields take ``ceil(n * bits / 8)`` bytes, and the bits
past the last field of the last byte are 0. A field is 1, 2, 4 or 8 bits wide, so
that a byte holds whole fields and packing is shifts.

Pure torch, no Triton: actsave reads :func:`field_bits` without importing it.
"""
from __future__ import annotations

import torch

FIELD_BITS = (1, 2, 4, 8)

_SHIFTS = {}


def field_bits(values: int) -> int:
    """Bits per field that hold ``values`` distinct values (at most 256): the fewest
    of :data:`FIELD_BITS`."""
    if not 1 <= values <= 256:
        raise ValueError(f"a field holds 1 to 256 distinct values, not {values}")
    return next(b for b in FIELD_BITS if values <= 2 ** b)


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
        return packed[:count]
    fields = (packed.unsqueeze(1) >> _shifts(bits, packed.device)) & (2 ** bits - 1)
    return fields.reshape(-1)[:count]
