"""Triton kernels for actsave codecs and decisions, installed as ``actsave.triton_kernels``.

This package is the kernel table: :func:`kernel_table` maps ``(format, direction)``
(a name of :data:`FORMATS`, one of :data:`DIRECTIONS`) to a :class:`Kernel`, the
Triton launcher and the pure-torch reference that defines its bits; beside it,
:func:`decision_table` holds the kernels of the decisions a lossy recompute keeps
(ReLU signs, max-pool windows: decisions/). Callers read the tables rather than
build function names, so a renamed function fails when a table is built, not at some
later call. Every launch goes through ``_launch.launch``.

Importing the package imports no Triton: int8.py, fp8.py and decisions/ (which do)
are imported by the first call of their table, so ``import actsave`` needs no Triton.
Nothing here imports actsave.
"""
import contextlib
import math
import threading
from functools import lru_cache
from types import MappingProxyType
from typing import Any, Callable, Mapping, NamedTuple, Tuple

import torch

# The group size actsave stores with, and the launchers' default. A group of 128 costs 4
# bytes of scale per 128 one-byte codes (3.1% overhead), so int8/fp8 store 0.258x of
# fp32 and 0.516x of bf16. Halving the group doubles that overhead and buys little
# round-trip SQNR (docs/results.md, "Figures behind the code's rules"). Defined
# here, not in _tile.py, so that actsave reads it without importing Triton.
DEFAULT_GROUP_SIZE = 128

# Traced references (NOTE [ Codecs in a compiled graph ] in actsave's graph_codecs.py):
# while above 0, the references take their general path, in which no branch reads a
# value (_scale.py). torch.compiler.is_compiling() says so too where Dynamo traces, but
# torch 2.11 leaves it False where AOTAutograd traces saved-tensor hooks.
# general_path() blocks open on this thread (``depth``). A plain threading.local read by
# getattr with a default: Dynamo, which may trace on_general_path, guards on that.
_this_thread = threading.local()


@contextlib.contextmanager
def general_path():
    """Inside the block, the torch references read no value to choose a path: for a
    trace of them, which a value read back would break. On this thread only, which
    traces; other threads' references choose as usual meanwhile."""
    _this_thread.depth = getattr(_this_thread, "depth", 0) + 1
    try:
        yield
    finally:
        _this_thread.depth -= 1


def on_general_path() -> bool:
    """Whether the references must take their general path now (:func:`general_path`,
    a trace by Dynamo, or a CUDA graph being captured, where reading a value back to
    choose a path is a device sync that the capture refuses)."""
    # The capture check is actsave.devices.capturing's, written again: nothing here imports actsave.
    return (torch.compiler.is_compiling() or getattr(_this_thread, "depth", 0) > 0
            or (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()))


# The dtypes the kernels encode from and decode to (float64 goes through float32 in
# actsave.codecs).
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


# NOTE [ Channel means ] in _channel_means.py: the largest mean magnitude subtracted;
# beyond it, or not finite, a channel's mean is taken as 0.
MAX_MEAN = 2.0**100


def channel_size(shape) -> int:
    """Elements of one channel of one sample in a tensor of ``shape`` (N, C, ...): the
    ``channel_size`` of NOTE [ Channel means ] in _channel_means.py."""
    return max(math.prod(shape[2:]), 1)


# Signed formats, then their unsigned variants for tensors known to be non-negative
# (NOTE [ Unsigned grids ] in _scale.py): one more bit of resolution, same bytes.
SIGNED_FORMATS = ("int8", "fp8_e4m3", "fp8_e5m2")
UNSIGNED_VARIANT = {"int8": "uint8", "fp8_e4m3": "fp8_ue4m4", "fp8_e5m2": "fp8_ue5m3"}
FORMATS = (*SIGNED_FORMATS, *UNSIGNED_VARIANT.values())
DIRECTIONS = ("encode", "decode")


class Kernel(NamedTuple):
    """One direction of one format.

    ``launcher`` runs ``jit`` (on CUDA, or on CPU under TRITON_INTERPRET=1);
    ``reference`` is its specification in torch and gives the same bits (a decoder's,
    on what its encoder makes: a scale no encoder writes, NaN or inf, may decode
    otherwise, and a NaN's payload is unspecified). Both take
    the same arguments, ``format_args`` (fp8's ``fmt``, int8's ``unsigned``) included: ``encode(x,
    **format_args, group_size=..., means=None, sums=None)`` returns ``(codes, scales)``,
    ``means`` being per-channel values to subtract first, or ``sums`` the channels' sums
    whose means those are (NOTE [ Channel means ] in _channel_means.py);
    ``decode(codes, scales, **format_args, dtype=..., group_size=..., means=None,
    channel_size=1, sums=None)`` a 1-D tensor of ``dtype``, the means added back. ``constexprs``
    are the format's constexprs the launcher passes to ``jit`` (the launch adds the
    tile's and ``CENTERED``), for builds ahead of time. ``format_args`` and
    ``constexprs`` are plain dicts, shared: read, never changed (a codec call unpacks
    ``format_args``, and a dict unpacks in half a mapping proxy's time). The unsigned
    formats' encoders also take ``signs=True`` (no means): ``(codes, scales, bits)``, the
    bits a ReLU output's decisions from the same read (NOTE [ Signs from the encoder's
    read ] in _tile.py); ``constexprs`` are those of the plain encode (SIGNS False).
    """

    launcher: Callable
    reference: Callable
    format_args: Mapping[str, str]
    jit: Any
    constexprs: Mapping[str, Any]

    @property
    def interpreted(self) -> bool:
        """Whether ``jit`` runs under Triton's interpreter (CPU tensors), as Triton chose
        when it defined the kernel, from TRITON_INTERPRET then: the variable's value
        now does not matter."""
        import triton  # imported already: the table holding this kernel imported it

        return not isinstance(self.jit, triton.JITFunction)


@lru_cache(maxsize=None)
def kernel_table() -> Mapping[Tuple[str, str], Kernel]:
    """``{(format, direction): Kernel}`` for every format and direction (imports Triton
    on the first call)."""
    from . import fp8, int8

    table = {}
    for name, unsigned in (("int8", False), ("uint8", True)):
        format_args = {"unsigned": unsigned}
        table[name, "encode"] = Kernel(int8.encode_int8, int8.encode_int8_ref, format_args,
                                       int8._encode_int8_kernel, int8.encode_constexprs(unsigned))
        table[name, "decode"] = Kernel(int8.decode_int8, int8.decode_int8_ref, format_args,
                                       int8._decode_int8_kernel, int8.decode_constexprs(unsigned))
    for fmt, spec in {**fp8.FP8_FORMATS, **fp8.UNSIGNED_FP8_FORMATS}.items():
        format_args = {"fmt": fmt}
        table[f"fp8_{fmt}", "encode"] = Kernel(fp8.encode_fp8, fp8.encode_fp8_ref, format_args,
                                               fp8._encode_fp8_kernel, spec.encode_constexprs())
        table[f"fp8_{fmt}", "decode"] = Kernel(fp8.decode_fp8, fp8.decode_fp8_ref, format_args,
                                               fp8._decode_fp8_kernel, spec.decode_constexprs())
    assert set(table) == {(f, d) for f in FORMATS for d in DIRECTIONS}, sorted(table)
    return MappingProxyType(table)


# The decisions a lossy recompute keeps (decisions/), by what they decide and the step.
DECISION_KERNELS = (("relu_signs", "pack"), ("relu_signs", "restore"), ("bounds", "pack"), ("bounds", "restore"),
                    ("max_pool", "encode"), ("max_pool", "decode"), ("max_pool", "gather"))


@lru_cache(maxsize=None)
def decision_table() -> Mapping[Tuple[str, str], Kernel]:
    """``{(decision, step): Kernel}`` for :data:`DECISION_KERNELS` (imports Triton on
    the first call), read as the codecs' table is (actsave.codecs.backend.implementation
    picks the launcher or the reference). They take no format arguments; their
    constexprs follow the tensor (its dtype, the pool's window), so ``constexprs`` is
    empty and the ahead-of-time builds take them from decisions.relu_signs.relu_constexprs,
    decisions.bounds and decisions.max_pool.PoolGeometry.
    ReLU signs: ``pack(y) -> bits``; ``restore(y, bits)``, in place;
    bounds: ``pack(v, low, high) -> bits``; ``restore(v, bits, low, high)``, in place;
    max pools:
    ``encode(indices, input_size, kernel_size, stride, padding, dilation) -> packed``;
    ``decode(indices, packed, input_size, kernel_size, stride, padding, dilation)``, in place;
    ``gather(pooled, x, indices, dims)``, in place.
    """
    from .decisions import bounds, max_pool, relu_signs

    none = MappingProxyType({})
    table = {
        ("relu_signs", "pack"): Kernel(relu_signs.pack_relu_signs, relu_signs.pack_relu_signs_ref, none,
                                       relu_signs._pack_relu_signs_kernel, none),
        ("relu_signs", "restore"): Kernel(relu_signs.restore_relu_signs_, relu_signs.restore_relu_signs_ref_, none,
                                          relu_signs._restore_relu_signs_kernel, none),
        ("bounds", "pack"): Kernel(bounds.pack_bounds, bounds.pack_bounds_ref, none, bounds._pack_bounds_kernel, none),
        ("bounds", "restore"): Kernel(bounds.restore_bounds_, bounds.restore_bounds_ref_, none,
                                      bounds._restore_bounds_kernel, none),
        ("max_pool", "encode"): Kernel(max_pool.encode_max_pool, max_pool.encode_max_pool_ref, none,
                                       max_pool._encode_max_pool_kernel, none),
        ("max_pool", "decode"): Kernel(max_pool.decode_max_pool_, max_pool.decode_max_pool_ref_, none,
                                       max_pool._decode_max_pool_kernel, none),
        ("max_pool", "gather"): Kernel(max_pool.gather_max_pool_, max_pool.gather_max_pool_ref_, none,
                                       max_pool._gather_max_pool_kernel, none),
    }
    assert tuple(table) == DECISION_KERNELS, sorted(table)
    return MappingProxyType(table)
