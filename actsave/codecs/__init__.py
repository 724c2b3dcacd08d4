"""Codecs: how a kept segment input is stored until its backward.

A codec turns a tensor into a :class:`Packed` value and back.

- ``None`` / ``"none"``: the tensor itself (exact, no copy).
- ``"int8"``: symmetric absmax per group of :data:`GROUP_SIZE` elements, one fp32
  scale per group.
- ``"fp8_e4m3"`` (alias ``"fp8"``) and ``"fp8_e5m2"``: an fp32 scale per group, then
  the 8-bit float.

A tensor the caller knows to be non-negative (``encode(x, non_negative=True)``: the
runtime passes it for ReLU outputs, judged by their autograd node, with no device
sync) is stored on the codec's unsigned grid, the same 8 bits spent without a sign:
int8 codes 0..255, fp8 e4m3 -> ue4m4, e5m2 -> ue5m3 (NOTE [ Unsigned grids ] in
``triton_kernels/_scale.py``). One more bit of resolution, about 6 dB of
round-trip SQNR (a bit halves the step). Where kept inputs are ReLU outputs
(torchvision-layout ResNets, whose block outputs are) the worst parameter gradient
gains about as much (docs/results.md, "Other figures"); where they are signed
(pre-activation ResNets, boundaries on a conv or BatchNorm output) nothing changes.
:attr:`Packed.unsigned` records the grid.

A signed conv activation (4-D or 5-D, channel in dim 1, any float dtype) is stored
minus its per-channel means, which are kept exactly (:attr:`Packed.offsets`, one fp32
per channel: the channel's sum, whose mean the kernels work out): the bits go to each
channel's spread, not its offset (NOTE [ Channel centering ] in ``codecs/centering.py``).

The bits are defined by the torch references of ``actsave.triton_kernels``' kernel
table; the Triton kernels match them exactly (codecs/backend.py chooses which runs). Decoding
gives back the original dtype, shape, device and strides (NOTE [ Kept layouts ] in
``actsave/layouts.py``: a dense input's own, channels_last for instance; a strided
slice's as ``torch.empty_like`` gives them). The codes are always in the row-major
order of the shape, whatever the input's layout: encoding a non-contiguous input reads
it into that order first (a copy the kernels would make anyway), so that it stores the
bits its contiguous copy would, and decoding writes the values back into its layout,
one copy more than for a contiguous input, which pays nothing for the layout.

Non-finite values: ``+inf`` and ``-inf`` come back as the same infinity and NaN as
NaN (AMP loss scalers still see them, and ``-inf`` masks of attention scores or
vocabularies still mask). They do not spoil their group: its finite values are scaled
by their own absmax and keep their precision (int8 gives up one step of 127, 0.07 dB).
A finite input never comes back non-finite, its dtype's largest value included
(float64 goes through float32: a value beyond float32's range comes back at float32's
largest).
Bytes stored are the same either way: a group holding inf or NaN is flagged by the
sign bit of its scale.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import ClassVar, Optional

import torch

from .._torch import in_memory
from ..errors import ConfigError
from ..layouts import copied_with_strides, kept_strides, viewed
from .backend import implementation
from .centering import channel_sums
from ..triton_kernels import (DEFAULT_GROUP_SIZE, SUPPORTED_DTYPES, UNSIGNED_VARIANT, channel_size, decision_table,
                              kernel_table)

# Elements per fp32 scale: the kernels' default, justified where it is defined.
GROUP_SIZE = DEFAULT_GROUP_SIZE


@dataclass(frozen=True, init=False)
class Packed:
    """A tensor as a codec stores it: payload, optional per-group scales, and what
    decode needs to give back the original shape, dtype and strides."""

    data: torch.Tensor
    scales: Optional[torch.Tensor]
    shape: torch.Size
    dtype: torch.dtype
    unsigned: bool = False  # stored on the codec's unsigned grid (a non-negative tensor)
    # Per-channel sums, fp32, whose means were subtracted before encoding (NOTE
    # [ Channel centering ]).
    offsets: Optional[torch.Tensor] = None
    # The strides decode gives back, where the input's layout is not contiguous (NOTE
    # [ Kept layouts ]); None otherwise, and for the identity codec, whose data keeps its own.
    strides: Optional[tuple] = None

    TENSOR_FIELDS: ClassVar[tuple] = ("data", "scales", "offsets")

    def __init__(self, data, scales, shape, dtype, unsigned=False, offsets=None, strides=None):
        # The fields above, in their order and with their defaults. Frozen: written
        # through the instance's __dict__, where a frozen dataclass's own __init__ calls
        # object.__setattr__ once per field, host work at every codec call.
        self.__dict__.update(data=data, scales=scales, shape=shape, dtype=dtype, unsigned=unsigned,
                             offsets=offsets, strides=strides)

    def tensors(self) -> dict:
        """``{field: tensor}``, every tensor the value holds (None fields left out):
        what offloading copies and what its bytes count."""
        return {name: t for name in self.TENSOR_FIELDS if (t := getattr(self, name)) is not None}

    def metadata(self) -> dict:
        """The fields that are not tensors."""
        return {name: getattr(self, name) for name in _PACKED_METADATA_FIELDS}

    @classmethod
    def assemble(cls, tensors: dict, metadata: dict) -> "Packed":
        """The value that :meth:`tensors` and :meth:`metadata` took apart."""
        return cls(**{name: tensors.get(name) for name in cls.TENSOR_FIELDS}, **metadata)

    @property
    def nbytes(self) -> int:
        return sum(_nbytes(t) for t in self.tensors().values())

    @property
    def device(self) -> torch.device:
        return self.data.device


# Read once: dataclasses.fields walks the class on every call, and metadata() runs
# for every offloaded kept input.
_PACKED_METADATA_FIELDS = tuple(f.name for f in fields(Packed) if f.name not in Packed.TENSOR_FIELDS)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class Codec:
    """Interface of a codec. ``aliases_input`` says whether ``encode`` keeps a
    reference to its input instead of a copy (then an in-place change of the input
    would change what is stored)."""

    name: str = ""
    lossless: bool = True
    aliases_input: bool = False
    expected_gradient_sqnr_db: float = math.inf  # see EXPECTED_GRADIENT_SQNR_DB

    def encode(self, x: torch.Tensor, non_negative: bool = False) -> Packed:
        """``x`` as stored; ``non_negative=True`` is the caller's promise that every
        element is >= 0 or NaN (a negative one would be stored as 0 by a lossy codec)."""
        raise NotImplementedError

    def decode(self, packed: Packed) -> torch.Tensor:
        raise NotImplementedError

    def encode_with_signs(self, x: torch.Tensor) -> tuple:
        """``(packed, bits)``: ``x``, a ReLU output, stored on the unsigned grid
        (``encode(x, non_negative=True)``), and its ReLU decisions, one bit per element
        as the decision kernels pack them (``not (x <= 0)``), which a lossy recompute
        restores (actsave/runtime/relu_signs.py). Here one after the other; the 8-bit
        codecs take both from one read (NOTE [ Signs from the encoder's read ])."""
        return self.encode(x, non_negative=True), pack_relu_signs(x)

    def __repr__(self) -> str:
        return f"<codec {self.name}>"

    def __reduce__(self):
        # A registered codec unpickles (and deep-copies) as itself: policies compare
        # their codec by identity (KeepPolicy == EXACT), so a plan sent to another
        # process must come back with the same codec objects.
        if _CODECS.get(self.name) is self:
            return get_codec, (self.name,)
        return super().__reduce__()


class IdentityCodec(Codec):
    """Stores the tensor itself: exact, free, and as large as the input."""

    name = "none"
    lossless = True
    aliases_input = True

    def encode(self, x: torch.Tensor, non_negative: bool = False) -> Packed:
        return Packed(data=x, scales=None, shape=x.shape, dtype=x.dtype)

    def decode(self, packed: Packed) -> torch.Tensor:
        return packed.data


class GroupCodec(Codec):
    """An 8-bit per-group codec: the format ``name`` of the kernel table
    (actsave.triton_kernels.kernel_table), or its unsigned variant for a tensor known
    to be non-negative. float64 goes through float32, the widest type the kernels take.
    """

    lossless = False
    aliases_input = False

    def __init__(self, name: str, expected_gradient_sqnr_db: float):
        self.name = name
        self.expected_gradient_sqnr_db = expected_gradient_sqnr_db

    def encode(self, x: torch.Tensor, non_negative: bool = False) -> Packed:
        packed, _ = self._encoded(x, non_negative, signs=False)
        return packed

    def encode_with_signs(self, x: torch.Tensor) -> tuple:
        if x.dtype not in SUPPORTED_DTYPES:  # float64, stored as float32: its decisions are its own
            return super().encode_with_signs(x)
        return self._encoded(x, True, signs=True)

    def _encoded(self, x: torch.Tensor, non_negative: bool, signs: bool) -> tuple:
        """``(packed, bits)``, bits None without ``signs``: the kernel table's encoder on
        ``x`` as the kernels read it (row-major, as the decisions are packed too)."""
        source = _as_kernels_read(x)
        offsets = None if non_negative else channel_sums(source)
        kernel = kernel_table()[self._format(non_negative), "encode"]
        encode = implementation(kernel, source)
        if signs:
            codes, scales, bits = encode(source, **kernel.format_args, group_size=GROUP_SIZE, signs=True)
        else:
            (codes, scales), bits = encode(source, **kernel.format_args, group_size=GROUP_SIZE, sums=offsets), None
        return Packed(codes, scales, x.shape, x.dtype, non_negative, offsets, kept_strides(x)), bits

    def decode(self, packed: Packed) -> torch.Tensor:
        """The tensor ``packed`` stands for, in the input's layout: where that is not
        contiguous (``packed.strides``), the values decoded in row-major order are
        copied into it, one copy more."""
        dtype, offsets = packed.dtype, packed.offsets
        wide = torch.float32 if dtype == torch.float64 else dtype
        kernel = kernel_table()[self._format(packed.unsigned), "decode"]
        decode = implementation(kernel, packed.data)
        flat = decode(packed.data, packed.scales, **kernel.format_args, dtype=wide, group_size=GROUP_SIZE,
                      sums=offsets, channel_size=1 if offsets is None else channel_size(packed.shape))
        if packed.strides is None:
            values = viewed(flat, packed.shape)
            return values if wide is dtype else values.to(dtype)
        return copied_with_strides(viewed(flat, packed.shape), packed.strides, dtype)

    def _format(self, unsigned: bool) -> str:
        return UNSIGNED_VARIANT[self.name] if unsigned else self.name


def pack_relu_signs(x: torch.Tensor) -> torch.Tensor:
    """One bit per element of ReLU output ``x``: 1 where backward passes the gradient
    (NOTE [ Bit fields ], row-major), by the decision kernel, one launch on CUDA
    (triton_kernels/decisions/relu_signs.py), or its reference, which detaches what it
    reads."""
    kernel = decision_table()["relu_signs", "pack"]
    return implementation(kernel, x)(x)


def _as_kernels_read(x: torch.Tensor) -> torch.Tensor:
    """``x`` as the kernels read it: row-major (a copy where ``x`` is not contiguous,
    which the kernels would otherwise make themselves), float64 as float32, its finite
    values beyond float32's range at float32's largest (converted, they would be inf,
    and a finite input never decodes to a non-finite value). Its channel means are
    those of ``x``'s contiguous copy, bit for bit: a mean reduced in another memory
    order may round otherwise. A negative bit (``torch._neg_view``) stays: the
    launchers read such a tensor's values (triton_kernels/_tile.py, kernel_input), the
    references and the means its values anyway."""
    if x.dtype == torch.float64:
        largest = torch.finfo(torch.float32).max
        return torch.where(x.isinf(), x, x.clamp(-largest, largest)).to(torch.float32,
                                                                       memory_format=torch.contiguous_format)
    return x.contiguous()


# The dtypes a lossy codec stores: the kernels' own, and float64 through float32.
ENCODED_DTYPES = (*SUPPORTED_DTYPES, torch.float64)


def encodable(t: torch.Tensor) -> bool:
    """Whether a lossy codec takes ``t``: a dense tensor (strided layout, not nested)
    of one of :data:`ENCODED_DTYPES`, in memory. Sparse and nested tensors have no
    row-major memory of their shape for the kernels to read, nor have forward AD's zero
    tensors and torch.func's wrappers any of their own (``_torch.in_memory``), and the
    kernels read no float8 type; the runtime keeps such tensors exactly, as it keeps
    integer ones (runtime/keep_rules.should_encode)."""
    return t.dtype in ENCODED_DTYPES and t.layout == torch.strided and not t.is_nested and in_memory(t)


IDENTITY = IdentityCodec()
# The second argument: the worst parameter-gradient SQNR (dB) to plan with. It is the
# lowest, over the float32 cases of bench/fidelity.py at their own plans (ResNet-56 and
# -164, the conv-BN-ReLU chain and the max-pooling ResNet, batch 8 and 32), of the
# median over batches of the worst meaningful tensor, rounded down (the figures and
# their command: docs/results.md, "Gradient fidelity"). Shallower networks of these
# widths and batches do better (docs/results.md, "Figures behind the code's rules");
# narrow ones at small batch and uncentered channel offsets can do worse
# (docs/limits.md, "Lossy codecs on BatchNorm CNNs"). A figure to plan with, not a
# guarantee.
_E4M3 = GroupCodec("fp8_e4m3", 21.0)

# Every codec, by the names compress= accepts, aliases included; the one list of them.
_CODECS: dict = {
    IDENTITY.name: IDENTITY,
    "int8": GroupCodec("int8", 33.0),
    "fp8": _E4M3,
    "fp8_e4m3": _E4M3,
    "fp8_e5m2": GroupCodec("fp8_e5m2", 15.0),
}
# Codec name (no aliases) -> its expected gradient SQNR in dB; the planner's
# min_sqnr_db reads it.
EXPECTED_GRADIENT_SQNR_DB = {codec.name: codec.expected_gradient_sqnr_db for codec in _CODECS.values()}
# The lossy codecs' names, no aliases: "int8", "fp8_e4m3", "fp8_e5m2".
LOSSY_CODECS = tuple(name for name in EXPECTED_GRADIENT_SQNR_DB if not _CODECS[name].lossless)


def get_codec(name) -> Codec:
    """The codec called ``name`` (``None`` means ``"none"``)."""
    if name is None:
        return IDENTITY
    if isinstance(name, Codec):
        return name
    if isinstance(name, str) and name in _CODECS:
        return _CODECS[name]
    raise ConfigError(f"compress={name!r} is not a codec; use one of {available_codecs()}")


def available_codecs() -> list:
    """Names accepted by ``compress=``, ``None`` included."""
    return [None, *_CODECS]


def sqnr_db(reference: torch.Tensor, approximation: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio of ``approximation`` in dB,
    ``20*log10(|reference| / |reference - approximation|)`` with 2-norms over all
    elements, computed in float64: ``inf`` when the two are equal, ``-inf`` when
    ``reference`` is zero and ``approximation`` is not, NaN when either holds a NaN."""
    reference = reference.double()
    error = torch.linalg.vector_norm(reference - approximation.double())
    if error == 0:
        return math.inf
    return (20 * torch.log10(torch.linalg.vector_norm(reference) / error)).item()


__all__ = ["Codec", "Packed", "GROUP_SIZE", "IDENTITY", "EXPECTED_GRADIENT_SQNR_DB", "LOSSY_CODECS", "available_codecs",
           "encodable", "get_codec", "pack_relu_signs", "sqnr_db"]
