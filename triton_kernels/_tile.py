"""A codec kernel's tile and its launch, shared by the int8 and fp8 codecs.

Both codecs cut a flattened tensor into contiguous groups of ``group_size`` elements
(the last one may be partial) and store one fp32 scale per group. This module holds
how their kernels walk the groups: the tile a program owns, the loads every encoder and
decoder starts with, the path of plain tiles, and the host-side checks and launch
grid. The rules of the values live beside it: _scale.py (NOTE [ Scale rule ], NOTE
[ Non-finite groups ], NOTE [ Unsigned grids ]), _channel_means.py (NOTE [ Channel means ])
and _rounding.py (NOTE [ Round half to even ]).

NOTE [ Tile ]
Each program owns GROUPS_PER_PROGRAM whole groups (its Tile's elements)
as a ``[groups, GROUP_SIZE // RUN, RUN]`` block and reduces along its rows. A run is
RUN contiguous elements that one thread owns: one 16-byte vector of codes when
encoding (16 codes), of values when decoding (4 fp32 or 8 halves, whose codes are
then one 4- or 8-byte load, as coalesced). Triton gives each memory access a layout
of at most 16 bytes per thread for a store; one run size for both streams is one
layout, with no conversion through shared memory between them. What depends on the
run only (a channel, NOTE [ Channel means ]) is worked out once per thread. Offsets
are int32 where every offset of the launch is below 2**31 (``needs_int64``), else
int64.

NOTE [ Plain tiles ]
Most tiles hold only groups whose values are finite, with an
absmax below 2**127 and either 0 or at least 2**-64 (and, for an encoder that
subtracts channel means, lie wholly inside the tensor, a partial tile's padding being
centered too). There NOTE [ Scale rule ] needs no step, no pre-scale and no flag, and
NOTE [ Non-finite groups ] no code, so the kernels take a path without them: an
encoder decides from its rows' magnitudes (``row_magnitudes``, ``plain_tile``), a
decoder from its scales' signs (``none_flagged``), once per program, by a branch on a
reduction over the tile; every other tile takes the general path. Both give the
references' bits, and a plain tile pays for the rules it does not need with that
reduction alone.

NOTE [ Signs from the encoder's read ]
A tensor on an unsigned grid is often a ReLU output whose decisions a lossy recompute
keeps too (actsave's runtime/relu_signs.py): a kept call's save, or the output of a
segment that the next segment keeps. Its encoder can store them as it encodes
(``signs=True``, SIGNS): the bits ``pack_relu_signs`` gives, from the one read of the
tensor the codes take, in the same launch, where packing them apart reads the tensor a
second time in a launch of its own. The unsigned grids only: a ReLU output is never
centered, and a signed tensor has no ReLU decisions. The references are the encoder's
and ``pack_relu_signs_ref``, one after the other.
"""
import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from . import SUPPORTED_DTYPES, _launch
from ._channel_means import channel_arguments, channel_means, channel_means_of, per_channel_ref
from ._scale import TINY_ABSMAX

# Below 8 elements the fp32 scale is at least a third of what is stored, which defeats
# compression; above 4096 a single group outgrows a program's tile (below).
MIN_GROUP_SIZE, MAX_GROUP_SIZE = 8, 4096
# Compile options of every launch (and of the ahead-of-time builds that check them).
# No FMA fusion: a decoder's add of a channel mean after its multiply (NOTE [ Channel
# means ]) must round twice, as torch does.
COMPILE_OPTIONS = {"enable_fp_fusion": False}


class Tile(NamedTuple):
    """A program's share of a launch (NOTE [ Tile ]): its elements and its warps."""

    elements: int
    warps: int

    def options(self) -> dict:
        return {"num_warps": self.warps, **COMPILE_OPTIONS}


# 16 elements per thread, in the range Triton's tutorials use for memory-bound
# kernels. On a GPU, 2048 elements over 4 warps: at 4096 over 8 the decoders, and the
# encoders of bf16, stayed far below a copy's bandwidth (docs/results.md, "Figures
# behind the code's rules", "Codec tiles"). Under the interpreter, 4096 over 8: its
# cost is per program and dominates small launches. A tile changes the work a program
# does, never the bits (each group is coded alone), which the kernel tests check on
# the interpreter with either tile and bench/kernels.py on the GPU. The launcher reads
# them from this module at each call, so a benchmark can try others (bench/kernels.py
# --tiles).
CUDA_TILE, INTERPRETER_TILE = Tile(elements=2048, warps=4), Tile(elements=4096, warps=8)
# Offsets stay int32 below 2**31 less a tile (needs_int64): the largest tile a launch may use.
LARGEST_TILE_ELEMENTS = 16384
# The widest global load and store a thread issues (ld/st.global.v4.b32).
VECTOR_BYTES = 16
# NOTE [ Plain tiles ]: below this absmax no scale needs the scale rule's step.
PLAIN_ABSMAX_LIMIT = tl.constexpr(2.0**127)


# ----------------------------------------------------------------- Triton helpers


@triton.jit
def group_tile(numel, GROUP_SIZE: tl.constexpr, GROUPS_PER_PROGRAM: tl.constexpr, RUN: tl.constexpr,
               INDEX_64: tl.constexpr):
    """This program's groups and their mask; the first element of each run of its groups,
    as [groups, GROUP_SIZE // RUN, 1]; the element offsets, [groups, GROUP_SIZE // RUN, RUN],
    and their mask. A run is RUN contiguous elements that one thread owns (NOTE [ Tile ]).
    Offsets are int64 where INDEX_64, else int32 (the launch knows which fit)."""
    program = tl.program_id(0)
    if INDEX_64:
        program = program.to(tl.int64)
    groups = program * GROUPS_PER_PROGRAM + tl.arange(0, GROUPS_PER_PROGRAM)
    runs = groups[:, None] * GROUP_SIZE + tl.arange(0, GROUP_SIZE // RUN)[None, :] * RUN
    offsets = runs[:, :, None] + tl.arange(0, RUN)[None, None, :]
    return groups, groups * GROUP_SIZE < numel, runs[:, :, None], offsets, offsets < numel


@triton.jit
def tile_is_whole(numel, GROUP_SIZE: tl.constexpr, GROUPS_PER_PROGRAM: tl.constexpr, INDEX_64: tl.constexpr):
    """Whether every element of this program's tile is in bounds (a scalar)."""
    program = tl.program_id(0)
    if INDEX_64:
        program = program.to(tl.int64)
    return (program + 1) * (GROUPS_PER_PROGRAM * GROUP_SIZE) <= numel


@triton.jit
def load_as_float32(ptrs, mask):
    """Load fp32, bf16 or fp16 values and widen them exactly to fp32. bf16 is widened
    on its bits: the interpreter's bf16 -> fp32 cast turns subnormals into wrong values."""
    x = tl.load(ptrs, mask=mask, other=0.0)
    if ptrs.dtype.element_ty == tl.bfloat16:
        return (x.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    return x.to(tl.float32)


@triton.jit
def _max_keeping_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def row_magnitudes(x, INTERPRETED: tl.constexpr):
    """Per row of a [groups, runs, RUN] fp32 block, as [groups]: the largest |x|, NaN
    where the row holds a NaN, +inf where it holds an infinity and no NaN. On a GPU a
    NaN-keeping maximum is one instruction a value; the interpreter's reductions skip
    NaN (numpy's nanmax) and its custom ones run in Python, so there the magnitudes'
    bits are compared as integers, an order that puts NaN above +inf above every
    finite value."""
    if INTERPRETED:
        bits = tl.max(tl.max(x.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=2), axis=1)
        return bits.to(tl.float32, bitcast=True)
    return tl.reduce(tl.reduce(tl.abs(x), 2, _max_keeping_nan), 1, _max_keeping_nan)


@triton.jit
def plain_tile(magnitudes):
    """NOTE [ Plain tiles ]: whether every row of the tile, given its row_magnitudes, is
    finite with an absmax below 2**127 and either 0 or at least 2**-64 (a scalar)."""
    plain = (magnitudes < PLAIN_ABSMAX_LIMIT) & ((magnitudes >= TINY_ABSMAX) | (magnitudes == 0.0))
    return tl.min(plain.to(tl.int32), axis=0) > 0


@triton.jit
def load_encoder_tile(x_ptr, means_ptr, mean_divisor, numel, channel_size, channels, size_magic, size_shift,
                      count_magic, count_shift, CENTERED: tl.constexpr, RUN_CHANNELS: tl.constexpr,
                      INDEX_64: tl.constexpr, INTERPRETED: tl.constexpr, GROUP_SIZE: tl.constexpr,
                      GROUPS_PER_PROGRAM: tl.constexpr, RUN: tl.constexpr):
    """What every encoder starts with, for this program's tile: ``(groups, their mask,
    offsets, their mask, x as fp32, x less its channel means where CENTERED (NOTE
    [ Channel means ]), each row's magnitudes, whether the tile is plain: NOTE [ Plain
    tiles ])``. A partial tile's padding is centered too, so a centered tile is plain
    only when it is whole."""
    groups, groups_in_bounds, runs, offsets, in_bounds = group_tile(numel, GROUP_SIZE, GROUPS_PER_PROGRAM, RUN,
                                                                    INDEX_64)
    x = load_as_float32(x_ptr + offsets, in_bounds)
    centered = x
    if CENTERED:
        centered = x - channel_means_of(runs, offsets, in_bounds, means_ptr, mean_divisor, channel_size, channels,
                                        size_magic, size_shift, count_magic, count_shift, RUN_CHANNELS, INDEX_64)
    magnitudes = row_magnitudes(centered, INTERPRETED)
    plain = plain_tile(magnitudes)
    if CENTERED:
        plain = plain & tile_is_whole(numel, GROUP_SIZE, GROUPS_PER_PROGRAM, INDEX_64)
    return groups, groups_in_bounds, offsets, in_bounds, x, centered, magnitudes, plain


@triton.jit
def store_relu_signs(signs_ptr, x, groups, numel, GROUP_SIZE: tl.constexpr, GROUPS_PER_PROGRAM: tl.constexpr,
                     RUN: tl.constexpr):
    """NOTE [ Signs from the encoder's read ]: the ReLU decisions of an encoder's tile
    ``x`` ([groups, runs, RUN] fp32, 0 in its padding), ``not (x <= 0)`` (NaN passes),
    stored one bit per element as decisions/relu_signs.py packs them (NOTE [ Bit
    fields ]): a run's RUN elements make RUN // 8 whole bytes, which the run's thread
    stores."""
    passes = tl.where(x <= 0.0, 0, 1)
    fields = tl.reshape(passes, (GROUPS_PER_PROGRAM, GROUP_SIZE // RUN, RUN // 8, 8))
    packed = tl.sum(fields << tl.arange(0, 8)[None, None, None, :], axis=3)
    group_bytes = groups[:, None] * (GROUP_SIZE // 8) + tl.arange(0, GROUP_SIZE // 8)[None, :]
    rows = tl.reshape(group_bytes, (GROUPS_PER_PROGRAM, GROUP_SIZE // RUN, RUN // 8))
    tl.store(signs_ptr + rows, packed.to(tl.uint8), mask=rows * 8 < numel)


@triton.jit
def load_decoder_tile(codes_ptr, scales_ptr, means_ptr, mean_divisor, numel, channel_size, channels, size_magic,
                      size_shift, count_magic, count_shift, CENTERED: tl.constexpr, RUN_CHANNELS: tl.constexpr,
                      INDEX_64: tl.constexpr, GROUP_SIZE: tl.constexpr, GROUPS_PER_PROGRAM: tl.constexpr,
                      RUN: tl.constexpr):
    """What every decoder starts with, for this program's tile: ``(offsets, their
    mask, the codes as stored, each row's scale, each element's channel mean where
    CENTERED, else 0)``."""
    groups, groups_in_bounds, runs, offsets, in_bounds = group_tile(numel, GROUP_SIZE, GROUPS_PER_PROGRAM, RUN,
                                                                    INDEX_64)
    codes = tl.load(codes_ptr + offsets, mask=in_bounds, other=0)
    scale = tl.load(scales_ptr + groups, mask=groups_in_bounds, other=0.0)
    means = 0.0
    if CENTERED:
        means = channel_means_of(runs, offsets, in_bounds, means_ptr, mean_divisor, channel_size, channels,
                                 size_magic, size_shift, count_magic, count_shift, RUN_CHANNELS, INDEX_64)
    return offsets, in_bounds, codes, scale, means


# ----------------------------------------------------------------- host helpers


def ceil_div(a: int, b: int) -> int:
    """``a / b`` rounded up, for the host's sizes and grids. Not ``triton.cdiv``: that is
    a constexpr function (Triton 3.9), whose call unwraps its arguments, several
    microseconds a call on the host, three calls a codec call."""
    return -(-a // b)


def check_group_size(group_size):
    if not (isinstance(group_size, int) and MIN_GROUP_SIZE <= group_size <= MAX_GROUP_SIZE
            and group_size & (group_size - 1) == 0):
        raise ValueError(
            f"group_size must be a power of two from {MIN_GROUP_SIZE} to {MAX_GROUP_SIZE}, "
            f"got {group_size!r}")


def check_float_dtype(dtype, what):
    if dtype not in SUPPORTED_DTYPES:
        allowed = ", ".join(str(d) for d in SUPPORTED_DTYPES)
        raise ValueError(f"{what} must be one of {allowed}, got {dtype}; integer and bool "
                         "tensors are never quantized: keep them as they are")


def flat_input(x, group_size):
    """x checked and flattened row-major into a contiguous 1-D tensor."""
    check_group_size(group_size)
    check_float_dtype(x.dtype, "the tensor to encode")
    return _flat(x)


def kernel_input(x, group_size):
    """x checked, its values in row-major memory, as an encoder kernel reads them: x
    itself where it is contiguous, whatever its shape (a view would cost host work and
    change nothing the kernel reads), else a contiguous copy; a copy too where memory
    holds the negation of its values (the negative bit of ``torch._neg_view``)."""
    check_group_size(group_size)
    check_float_dtype(x.dtype, "the tensor to encode")
    if x.is_neg():
        x = x.resolve_neg()
    return x if x.is_contiguous() else x.reshape(-1).contiguous()


def _flat(t):
    """t as a contiguous 1-D tensor: itself where it is one (a codec's codes and scales);
    a copy where memory holds the negation of its values (``torch._neg_view``), which a
    kernel would read. Resolved unasked (itself where no bit is set): the references run
    inside traced graphs too, where asking ``is_neg()`` breaks the graph."""
    t = t.resolve_neg()
    return t if t.dim() == 1 and t.is_contiguous() else t.reshape(-1).contiguous()


def flat_codes(codes, scales, code_dtype, dtype, group_size):
    """codes checked against their scales and flattened for decoding."""
    check_group_size(group_size)
    check_float_dtype(dtype, "the decoded dtype")
    if codes.dtype != code_dtype:
        raise ValueError(f"codes must be {code_dtype}, got {codes.dtype}")
    n_groups = ceil_div(codes.numel(), group_size)
    if scales.dtype != torch.float32 or scales.numel() != n_groups:
        raise ValueError(f"{codes.numel()} codes in groups of {group_size} need {n_groups} "
                         f"float32 scales, got {scales.numel()} {scales.dtype} scales")
    return _flat(codes), _flat(scales)


def empty_encoding(numel, device, group_size, code_dtype):
    """Uninitialised codes (one byte per element, unpadded) and per-group scales for
    ``numel`` values on ``device``."""
    codes = torch.empty(numel, dtype=code_dtype, device=device)
    scales = torch.empty(ceil_div(numel, group_size), dtype=torch.float32, device=device)
    return codes, scales


def empty_signs(numel, device):
    """Uninitialised ReLU decisions for ``numel`` values, one bit each (NOTE [ Signs
    from the encoder's read ])."""
    return torch.empty(ceil_div(numel, 8), dtype=torch.uint8, device=device)


def check_signs(unsigned, means, sums):
    """An encode that also stores ReLU decisions is one on an unsigned grid, uncentered
    (NOTE [ Signs from the encoder's read ])."""
    if not unsigned or means is not None or sums is not None:
        raise ValueError("signs=True encodes a ReLU output: on an unsigned grid, with no channel means")


def launch(kernel, numel, group_size, stream_dtype, means, constexprs, *tensors, **pointers):
    """One launch of a group kernel over numel elements, on its tensors' device; none
    for an empty tensor, nor for meta tensors: they hold no data, and the launcher's
    allocations are what actsave.estimate simulates a CUDA step by. ``stream_dtype``
    is the dtype whose 16-byte vectors make a thread's run (NOTE [ Tile ]: the codes
    when encoding, the values when decoding), ``means`` the kernel's
    :class:`ChannelMeans`, whose tensor is passed after ``tensors`` (every codec kernel
    takes its means pointer fourth, after its three tensors), ``constexprs`` the
    format's (:class:`Constexprs`); ``pointers``, tensors passed by name (an
    encoder's ``signs_ptr``)."""
    first = tensors[0]
    if numel == 0 or first.is_meta:
        return
    # The interpreter runs CPU tensors. The tile is read at each call (CUDA_TILE) and
    # keys the arguments with the shape.
    interpreted = first.is_cpu
    grid, arguments = _launch_arguments(numel, group_size, stream_dtype, means.channel_size, means.channels,
                                        means.centered, means.divisor, interpreted,
                                        INTERPRETER_TILE if interpreted else CUDA_TILE, constexprs)
    # Through the package's one launch helper: a kernel that fails to compile on the
    # user's GPU raises an error naming it and the fallback (_launch.py).
    _launch.launch(kernel, grid, *tensors, means.means, **pointers, **arguments)


class Constexprs(dict):
    """A format's constexprs, by name: built once per format and shared, never changed.
    Hashed by identity, so that it keys a launch's cached arguments for the price of
    a pointer (equal contents in two objects key two entries, both right)."""

    __hash__ = object.__hash__


@functools.lru_cache(maxsize=None)
def with_signs(constexprs: Constexprs) -> Constexprs:
    """An encoder's ``constexprs`` (SIGNS False) for the launch that also stores the
    tensor's ReLU decisions (NOTE [ Signs from the encoder's read ]): built once per format."""
    return Constexprs({**constexprs, "SIGNS": True})


# A launch's grid and arguments but its tensors depend on its shape and format alone:
# worked out once per shape (a model has a few), not at every call, whose host work a
# GPU waits for (docs/performance.md, "Rules of the hot path"). One dict, so that the
# call binds one mapping of keywords, not several merged.
@functools.lru_cache(maxsize=4096)
def _launch_arguments(numel, group_size, stream_dtype, channel_size, channels, centered, divisor, interpreted, tile,
                      constexprs) -> tuple:
    """``(grid, arguments)``: a launch's grid and its arguments by name but the tensors
    (shared: read, never changed)."""
    groups_per_program = max(1, tile.elements // group_size)
    run = min(run_elements(stream_dtype), group_size)
    grid = (ceil_div(ceil_div(numel, group_size), groups_per_program),)
    own = {"numel": numel, **channel_arguments(channel_size, channels, centered, run, divisor),
           "GROUP_SIZE": group_size, "GROUPS_PER_PROGRAM": groups_per_program, "RUN": run,
           "INDEX_64": needs_int64(numel), "INTERPRETED": interpreted, **tile.options()}
    assert own.keys().isdisjoint(constexprs), sorted(own.keys() & constexprs.keys())  # none overrides another
    return grid, {**own, **constexprs}


def needs_int64(numel):
    """Whether a launch over numel elements indexes in int64: where an offset in its last
    program's tile could reach 2**31 (the magic-number quotients of NOTE [ Channel means ]
    need offsets below it too)."""
    return numel + LARGEST_TILE_ELEMENTS > 2**31


def run_elements(dtype):
    """Elements per thread run for a stream of ``dtype`` values: one 16-byte vector."""
    return VECTOR_BYTES // dtype.itemsize


# ----------------------------------------------------------------- torch references


def centered_input_ref(x, group_size, means, sums=None):
    """``(source, centered)``: ``x`` flat in fp32, and those values less their channel's
    mean (NOTE [ Channel means ]; ``means`` or ``sums`` as :func:`channel_means` takes them). Where no
    mean is subtracted ``centered`` is ``source`` itself; otherwise it is a new tensor,
    the reference's own, which it may overwrite."""
    source = flat_input(x, group_size).to(torch.float32)
    checked = channel_means(x, means, source, sums)
    if not checked.centered or source.numel() == 0:
        return source, source
    values, channel_means_ = per_channel_ref(source, checked)
    return source, (values - channel_means_).view(-1)
