"""Codecs: how a kept segment input is stored until its backward.

A codec turns a tensor into a :class:`Packed` value and back. ``None`` / ``"none"``
stores the tensor itself (exact, no copy). The lossy 8-bit codecs join this registry
with the compression issue; until then their names are rejected with an error that
says so, and any other name with the list of valid ones.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .errors import ConfigError


@dataclass(frozen=True)
class Packed:
    """A tensor as a codec stores it: payload, optional per-group scales, and what
    decode needs to give back the original shape and dtype."""

    data: torch.Tensor
    scales: Optional[torch.Tensor]
    shape: torch.Size
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        scale_bytes = 0 if self.scales is None else _nbytes(self.scales)
        return _nbytes(self.data) + scale_bytes

    @property
    def device(self) -> torch.device:
        return self.data.device


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class Codec:
    """Interface of a codec. ``aliases_input`` says whether ``encode`` keeps a
    reference to its input instead of a copy (then an in-place change of the input
    would change what is stored)."""

    name: str = ""
    lossless: bool = True
    aliases_input: bool = False

    def encode(self, x: torch.Tensor) -> Packed:
        raise NotImplementedError

    def decode(self, packed: Packed) -> torch.Tensor:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<codec {self.name}>"


class IdentityCodec(Codec):
    """Stores the tensor itself: exact, free, and as large as the input."""

    name = "none"
    lossless = True
    aliases_input = True

    def encode(self, x: torch.Tensor) -> Packed:
        return Packed(data=x, scales=None, shape=x.shape, dtype=x.dtype)

    def decode(self, packed: Packed) -> torch.Tensor:
        return packed.data


IDENTITY = IdentityCodec()

_CODECS: dict[str, Codec] = {IDENTITY.name: IDENTITY}
# Names the compression issue defines; accepted by name only once their kernels land.
_PLANNED = ("int8", "fp8", "fp8_e4m3", "fp8_e5m2")


def get_codec(name) -> Codec:
    """The codec called ``name`` (``None`` means ``"none"``)."""
    if name is None:
        return IDENTITY
    if isinstance(name, Codec):
        return name
    if isinstance(name, str) and name in _CODECS:
        return _CODECS[name]
    if isinstance(name, str) and name in _PLANNED:
        raise ConfigError(
            f"compress={name!r} is not available in this version of actsave; "
            f"use one of {available_codecs()}"
        )
    raise ConfigError(f"compress={name!r} is not a codec; use one of {available_codecs()}")


def available_codecs() -> list:
    """Names accepted by ``compress=``, ``None`` included."""
    return [None, *_CODECS]
