"""Ahead-of-time builds of every codec kernel for sm_80 and sm_90, checked in their PTX
and resource usage, without a GPU (docs/architecture.md, "Testing without a GPU").

Each kernel x input (or output) dtype x codec is compiled as the JIT compiles it for
16-byte aligned tensors (pointers divisible by 16), for an element count that is a
multiple of 16 (int32, and int64 as for tensors of 2**31 elements and more), and, on
sm_90, for one that is not; the signed formats also with channel means (NOTE [ Channel
means ]) for each way a thread's run of elements can meet channels. All builds run once
per session, in one subprocess.
"""
import math
from collections import Counter
from itertools import product
import re

import pytest

import torch

from actsave.triton_kernels import DEFAULT_GROUP_SIZE, DIRECTIONS, FORMATS, SIGNED_FORMATS, UNSIGNED_VARIANT, kernel_table
from actsave.triton_kernels.decisions import bounds, max_pool, packed_tiles, relu_signs
from actsave.triton_kernels._tile import CUDA_TILE, VECTOR_BYTES

GROUP_SIZE = DEFAULT_GROUP_SIZE  # the tile a program owns is the same for every group size
TILE = {"GROUP_SIZE": GROUP_SIZE, "GROUPS_PER_PROGRAM": CUDA_TILE.elements // GROUP_SIZE}
DTYPES = {"fp32": 4, "bf16": 2, "fp16": 2}  # Triton type -> bytes per element
# format -> Triton type of its codes (the unsigned variants store bytes 0..255)
CODE_POINTERS = {"int8": "*i8", "fp8_e4m3": "*u8", "fp8_e5m2": "*u8", "uint8": "*u8", "fp8_ue4m4": "*u8",
                 "fp8_ue5m3": "*u8"}
# (arch, numel's Triton type, numel a multiple of 16, RUN_CHANNELS or None without channel
# means): what a launch can specialize on. RUN_CHANNELS (NOTE [ Channel means ]) is 1 where
# channel_size is a multiple of a thread's run (32x32, 16x16, 8x8 maps), 2 where a run may
# cross into the next channel (14x14, 7x7), 0 where it may span several (3x3, 1x1).
TARGETS = {
    "sm80": (80, "i32", True, None),
    "sm90": (90, "i32", True, None),
    "sm90_int64": (90, "i64", True, None),
    "sm90_ragged": (90, "i32", False, None),
    # Signed formats only: non-negative tensors are not centered.
    "sm90_centered": (90, "i32", True, 2),
    "sm90_centered_whole_runs": (90, "i32", True, 1),
    "sm90_centered_per_element": (90, "i32", True, 0),
}
KERNELS = [f"{codec}-{direction}-{dtype}" for codec, direction, dtype in product(FORMATS, DIRECTIONS, DTYPES)]
# "signs": an unsigned encoder that also stores the ReLU decisions (NOTE [ Signs from the
# encoder's read ]); never centered.
SIGNS_KERNELS = [f"{codec}-signs-{dtype}" for codec, dtype in product(UNSIGNED_VARIANT.values(), DTYPES)]
BUILDS = [f"{kernel}-{target}" for kernel, target in product(KERNELS + SIGNS_KERNELS, TARGETS)
          if TARGETS[target][3] is None or kernel.split("-")[0] in SIGNED_FORMATS]
# The elements one thread owns: the [groups, runs, RUN] tile spread evenly over the
# program's threads, a run of RUN contiguous elements at a time (NOTE [ Tile ]).
ELEMENTS_PER_THREAD = CUDA_TILE.elements // (CUDA_TILE.warps * 32)


def _run(direction, dtype):
    """The elements of a thread's run: one 16-byte vector of codes when encoding (16
    one-byte codes), of values when decoding (4 fp32 or 8 halves)."""
    return VECTOR_BYTES // (1 if _encodes(direction) else DTYPES[dtype])


def _encodes(direction):
    return direction in ("encode", "signs")


def _job(codec, direction, dtype, target):
    kernel = kernel_table()[codec, "encode" if _encodes(direction) else direction]
    code_ptr = CODE_POINTERS[codec]
    arch, numel_type, numel_divisible, run_channels = TARGETS[target]
    signs = {}
    if _encodes(direction):
        pointers = {"x_ptr": f"*{dtype}", "codes_ptr": code_ptr, "scales_ptr": "*fp32", "means_ptr": "*fp32"}
        signs = {"signs_ptr": "*u8"}
    else:
        pointers = {"codes_ptr": code_ptr, "scales_ptr": "*fp32", "out_ptr": f"*{dtype}", "means_ptr": "*fp32"}
    channels = dict.fromkeys(["channel_size", "channels", "size_magic", "size_shift", "count_magic", "count_shift"],
                             "i32")
    constexprs = {**kernel.constexprs, "CENTERED": run_channels is not None, "RUN_CHANNELS": run_channels or 0,
                  "INDEX_64": numel_type == "i64", "INTERPRETED": False, **TILE, "RUN": _run(direction, dtype),
                  **({"SIGNS": True} if direction == "signs" else {})}
    return {
        "module": kernel.jit.fn.__module__,  # the subprocess imports it by name
        "kernel": kernel.jit.fn.__name__,
        "signature": {**pointers, "mean_divisor": "fp32", "numel": numel_type, **channels, **signs,
                      **dict.fromkeys(constexprs, "constexpr")},
        "constexprs": constexprs,
        "arch": arch,
        "divisible_by_16": [*pointers, *signs] + (["numel"] if numel_divisible else []),
        "options": CUDA_TILE.options(),
    }


@pytest.fixture(scope="session")
def builds(compile_for_cuda):
    """{build id: {"ptx", "STACK", "LOCAL"}} for every build, the decision kernels'
    (below) included, compiled once (about 40 s on two cores; Triton's cache makes
    later sessions faster)."""
    return compile_for_cuda({**{build: _job(*build.split("-")) for build in BUILDS},
                             **{build: _decision_job(build) for build in DECISION_BUILDS}})


def _global_accesses(ptx):
    """How many of each form of global load and store the PTX holds, e.g.
    {"ld.global.v4.b32": 2, "st.global.b32": 1}."""
    return Counter(re.findall(r"\b(?:ld|st)\.global(?:\.[a-z0-9]+)+", ptx))


@pytest.mark.parametrize("build", BUILDS)
def test_arithmetic_is_correctly_rounded_ieee(builds, build):
    """What bit-exactness with the torch references rests on: divisions correctly
    rounded (plain `/` is div.full, an approximation), no flush of subnormals to zero,
    no multiply-add fused into one rounding. Encoding divides twice per group, for the
    scale and for the multiplier, and multiplies each value (NOTE [ Scale rule ]): a
    thread, whose run lies in one group, holds two divisions in each of its two paths
    (NOTE [ Plain tiles ]), not one per value; and one for each channel mean it loads,
    a sum over its count (NOTE [ Channel means ])."""
    ptx = builds[build]["ptx"]
    # Integer divisions (an element's channel, NOTE [ Channel means ]) are exact.
    divisions = re.findall(r"\bdiv\.[\w.]*f32\b", ptx)
    assert set(divisions) <= {"div.rn.f32"}, divisions
    assert not re.findall(r"\bdiv\.[\w.]*f(16|64)\b", ptx)
    _, direction, dtype, target = build.split("-")
    means = _means_loaded(direction, dtype, TARGETS[target][3])
    assert len(divisions) == (4 if _encodes(direction) else 0) + means
    assert ".approx" not in ptx and "ftz" not in ptx and "fma" not in ptx


# Stack bytes per thread that ptxas (CUDA 12.9, as bundled with Triton 3.9) chose to
# spend on a build: here it holds the fp32 e5m2 encoder to 64 registers and spills one
# (`8 bytes stack frame, 4 bytes spill stores, 4 bytes spill loads`: one STL and one
# LDL per thread, against 80 bytes of streaming traffic), where it gives the e4m3
# twin 71 registers and no spill. An occupancy trade of ptxas's at -O3 (at -O1 it
# takes 120 registers and spills nothing), not local memory the kernel asks for.
# Measured on a GPU it may cost nothing; an entry may only shrink.
STACK_BYTES_ALLOWED = {"fp8_e5m2-encode-fp32-sm80": 8}


@pytest.mark.parametrize("build", BUILDS)
def test_no_local_memory(builds, build):
    """No array placed in local memory, no register spilled to it (but where listed)."""
    compiled = builds[build]
    assert ".local" not in compiled["ptx"]
    assert compiled["LOCAL"] == 0
    assert compiled["STACK"] <= STACK_BYTES_ALLOWED.get(build, 0)


def _expected_aligned_accesses(direction, dtype, run_channels):
    """A thread owns runs of contiguous elements (NOTE [ Tile ]), each run in its own group.
    An encoder's run is 16 elements: its codes are one 16-byte store (st.global.v4.b32)
    and its values 16-byte loads (ld.global.v4.b32); a decoder's run is 4 fp32 or 8 half
    values, one 16-byte store, and its codes a 4- or 8-byte load. That narrower load is
    as coalesced (a warp reads 128 or 256 contiguous bytes of codes) and keeps both
    streams in one layout: with 16 codes per thread and 4 fp32 values, Triton converted
    between the two through shared memory. The scales are one fp32 per group: one
    4-byte access per run, which moves 1/128 of the bytes at groups of 128; a decoder
    reads its tile's scales once more, one per thread, for its check that none is
    flagged (NOTE [ Plain tiles ]), as Triton lays that reduction out. Channel
    means (NOTE [ Channel means ]) are read where a run needs them: one per run
    (RUN_CHANNELS 1), two (2), or one per element (0); a few hundred bytes in all,
    which the caches serve."""
    run = _run(direction, dtype)
    runs = ELEMENTS_PER_THREAD // run
    means = _means_loaded(direction, dtype, run_channels)
    value_vectors = ELEMENTS_PER_THREAD * DTYPES[dtype] // VECTOR_BYTES
    if _encodes(direction):
        # A run's 16 decisions are 2 bytes, stored one by one (a warp's stores still
        # cover 64 contiguous bytes): 1/16 of the codes' bytes.
        signs = {"st.global.b8": 2 * runs} if direction == "signs" else {}
        return {"ld.global.v4.b32": value_vectors, **({"ld.global.b32": means} if means else {}),
                "st.global.v4.b32": runs, "st.global.b32": runs, **signs}
    code_load = {4: "ld.global.b32", 8: "ld.global.v2.b32", 16: "ld.global.v4.b32"}[run]
    accesses = Counter({code_load: runs, "st.global.v4.b32": value_vectors})
    accesses["ld.global.b32"] += runs + 1 + means  # scales, the tile's scales for none_flagged, means
    return dict(accesses)


def _means_loaded(direction, dtype, run_channels):
    """Channel means a thread loads (NOTE [ Channel means ]): one per run (RUN_CHANNELS 1),
    two (2), or one per element (0); none without means."""
    runs = ELEMENTS_PER_THREAD // _run(direction, dtype)
    return {None: 0, 1: runs, 2: 2 * runs, 0: ELEMENTS_PER_THREAD}[run_channels]


@pytest.mark.parametrize("build", [b for b in BUILDS if not b.endswith("_ragged")])
def test_streams_move_in_16_byte_vectors(builds, build):
    _, direction, dtype, target = build.split("-")
    expected = _expected_aligned_accesses(direction, dtype, run_channels=TARGETS[target][3])
    assert _global_accesses(builds[build]["ptx"]) == expected


@pytest.mark.parametrize("build", [b for b in BUILDS if TARGETS[b.split("-")[-1]][1] == "i32"])
def test_no_64_bit_integer_division_where_offsets_fit_int32(builds, build):
    """An element's channel (NOTE [ Channel means ]) is found by multiplying by a magic
    number, not by a 64-bit division (a subroutine of dozens of instructions) per
    element; int64 offsets are for tensors of 2**31 elements and more only."""
    assert not re.findall(r"\b(div|rem)\.[su]64\b", builds[build]["ptx"])


@pytest.mark.parametrize("build", [b for b in BUILDS if b.endswith("_ragged")])
def test_a_ragged_element_count_gets_scalar_accesses(builds, build):
    """Where numel is not a multiple of 16, the bound `offsets < numel` may fall inside
    any 16-byte vector, so Triton must mask element by element: every access is one
    element wide. Correct, and slower; a tensor whose element count is a multiple of
    16 (most activations) gets the vectors above."""
    accesses = _global_accesses(builds[build]["ptx"])
    assert accesses and not [form for form in accesses if ".v2." in form or ".v4." in form], accesses


# --- the decision kernels (triton_kernels/decisions/) --------------------------------

# The ReLU and bounds kernels take the float output and read its bits (load_bits).
RELU_POINTERS = {"fp32": ("*fp32", torch.float32), "bf16": ("*bf16", torch.bfloat16), "fp16": ("*fp16", torch.float16)}
# The windows of the pool builds: every field width, 1-D to 3-D, dilation.
POOL_WINDOWS = {
    "k2": ((2,), (2,), (0,), (1,)),  # 1-bit offsets
    "k2x2": ((2, 2), (2, 2), (0, 0), (1, 1)),  # 2 bits
    "k3x3": ((3, 3), (2, 2), (1, 1), (1, 1)),  # 4 bits: ResNet's stem pool
    "k5x5": ((5, 5), (1, 1), (2, 2), (1, 1)),  # 8 bits
    "k3x3x3": ((3, 3, 3), (2, 2, 2), (1, 1, 1), (1, 2, 1)),  # 8 bits, 3-D, dilated
}
GATHER_POINTERS = {"fp32": "*i32", "bf16": "*i16", "fp64": "*i64"}
# (arch, numel's Triton type, numel and the packed byte count multiples of 16). "ones":
# every integer argument the JIT may specialize is 1, a constexpr (one element, a plane
# of one, a dimension of size 1): the kernels must compile so too.
DECISION_TARGETS = {"sm80": (80, "i32", True), "sm90": (90, "i32", True), "sm90_int64": (90, "i64", True),
                    "sm90_ragged": (90, "i32", False), "sm90_ones": (90, "i32", False),
                    "sm90_leaky": (90, "i32", True)}  # bounds: a LeakyReLU's (one bound)
DECISION_BUILDS = (
    [f"relu-{step}-{dtype}-{target}" for step in ("pack", "restore") for dtype, target in
     [("fp32", "sm80"), ("bf16", "sm80"), ("fp32", "sm90"), ("bf16", "sm90"), ("fp16", "sm90"),
      ("fp32", "sm90_int64"), ("fp32", "sm90_ragged")]]
    + [f"pool-{step}-{window}-{target}" for step in ("encode", "decode") for window in POOL_WINDOWS
       for target in ("sm90", *(("sm80", "sm90_ragged") if window == "k3x3" else ()))]
    + [f"gather-{dtype}-{target}" for dtype in GATHER_POINTERS for target in ("sm90", "sm80")]
    + [f"bounds-{step}-{dtype}-{target}" for step in ("pack", "restore") for dtype, target in
       [("fp32", "sm80"), ("bf16", "sm80"), ("fp32", "sm90"), ("bf16", "sm90"), ("fp16", "sm90"),
        ("fp32", "sm90_int64"), ("fp32", "sm90_ragged"), ("bf16", "sm90_ragged"), ("bf16", "sm90_ones")]]
    + [f"bounds-{step}-fp16-sm90_leaky" for step in ("pack", "restore")]
    + ["gather-fp32-sm90_ragged", "relu-pack-fp32-sm90_ones", "relu-restore-bf16-sm90_ones",
       "pool-encode-k3x3x3-sm90_ones", "pool-decode-k3x3x3-sm90_ones", "gather-bf16-sm90_ones"])
_DIVISORS = ("plane", "out_inner_0", "out_inner_1", "in_inner_0", "in_inner_1")


def _pool_geometry(window):
    kernel_size = POOL_WINDOWS[window][0]
    # Indices of (8, 16, 7, ...) windows over a 14 x ... input: only the types matter.
    return max_pool.PoolGeometry.of((8, 16) + (7,) * len(kernel_size), (14,) * len(kernel_size),
                                    *POOL_WINDOWS[window])


def _decision_job(build):
    kind, *rest = build.split("-")
    target = rest[-1]
    arch, numel_type, divisible = DECISION_TARGETS[target]
    if kind == "relu":
        step, dtype, _ = rest
        pointer, torch_dtype = RELU_POINTERS[dtype]
        kernel = relu_signs._pack_relu_signs_kernel if step == "pack" else relu_signs._restore_relu_signs_kernel
        signature = {"y_ptr": pointer, "bits_ptr": "*u8", "numel": numel_type, "packed_bytes": numel_type}
        constexprs = {**relu_signs.relu_constexprs(torch_dtype),
                      "ROWS": packed_tiles.packed_rows(1, torch_dtype.itemsize)}
        counts = ["numel", "packed_bytes"]
    elif kind == "bounds":
        step, dtype, _ = rest
        pointer, torch_dtype = RELU_POINTERS[dtype]
        kernel = bounds._pack_bounds_kernel if step == "pack" else bounds._restore_bounds_kernel
        scalars = bounds.BOUND_SCALARS if step == "restore" else bounds.BOUND_SCALARS[:3]
        signature = {"v_ptr": pointer, "bits_ptr": "*u8", "numel": numel_type, "packed_bytes": numel_type,
                     **dict.fromkeys(scalars, "i32")}
        high = math.inf if target == "sm90_leaky" else 6.0
        constexprs = {name: value for name, value in bounds._launch_arguments(0.0, high, torch_dtype)[step == "restore"]
                      .items() if name in ("MAGNITUDE", "INF_BITS", "UPPER", "ROWS")}
        counts = ["numel", "packed_bytes"]
    elif kind == "pool":
        step, window, _ = rest
        kernel = max_pool._encode_max_pool_kernel if step == "encode" else max_pool._decode_max_pool_kernel
        signature = {"indices_ptr": "*i64", "packed_ptr": "*u8", "numel": numel_type, "packed_bytes": numel_type}
        for name in _DIVISORS:  # multipliers: the bits of a uint32, as an int32
            signature.update({name: "i32", f"{name}_multiplier": "i32", f"{name}_shift": "i32"})
        constexprs = _pool_geometry(window).constexprs()
        counts = ["numel", "packed_bytes"]
    else:
        dtype, _ = rest
        kernel = max_pool._gather_max_pool_kernel
        signature = {"pooled_ptr": GATHER_POINTERS[dtype], "x_ptr": GATHER_POINTERS[dtype], "indices_ptr": "*i64",
                     "numel": numel_type, "input_plane": "i32", "plane": "i32", "plane_multiplier": "i32",
                     "plane_shift": "i32"}
        constexprs = {"BLOCK": max_pool.GATHER_BLOCK}
        counts = ["numel"]
    pointers = [name for name in signature if name.endswith("_ptr")]
    if target == "sm90_ones":  # what the JIT makes of integer arguments equal to 1
        ones = [name for name, kind in signature.items() if kind in ("i32", "i64")
                and name not in max_pool._DIVISION_CONSTANTS + bounds.BOUND_SCALARS]  # do_not_specialize
        constexprs = {**constexprs, **dict.fromkeys(ones, 1)}
    return {
        "module": kernel.fn.__module__,
        "kernel": kernel.fn.__name__,
        "signature": {**signature, **dict.fromkeys(constexprs, "constexpr")},
        "constexprs": constexprs,
        "arch": arch,
        "divisible_by_16": pointers + (counts if divisible else []),
        "options": packed_tiles.LAUNCH_OPTIONS,
    }


@pytest.mark.parametrize("build", DECISION_BUILDS)
def test_decision_kernels_use_no_local_memory_and_no_division(builds, build):
    """No local memory, no stack; no integer division instruction: window geometry is
    constexpr (divisions by constants become multiplies) and sizes known at launch are
    divided by a multiply and a shift (_division.py, NOTE [ Division by an
    invariant ])."""
    compiled = builds[build]
    assert ".local" not in compiled["ptx"] and compiled["LOCAL"] == 0 and compiled["STACK"] == 0
    assert not re.findall(r"\b(?:div|rem)\.", compiled["ptx"])


def _expected_decision_accesses(build):
    """Every stream in 16-byte vectors: a thread owns contiguous elements
    (decisions/packed_tiles.py), 16 packed bytes (fewer where the wide stream would pass
    WIDE_BYTES_PER_THREAD: one 8-byte access), the ReLU output as 4-byte words (v4.b32),
    int64 indices as pairs (v2.b64). A gather reads the pooled input at the decisions,
    one element per access (those are scattered)."""
    kind, *rest = build.split("-")
    vector = {16: "v4.b32", 8: "v2.b32"}
    if kind in ("relu", "bounds"):  # the same streams; a bounds restore's tile is its own
        step, dtype, _ = rest
        packed = packed_tiles.packed_bytes_per_thread(1, RELU_POINTERS[dtype][1].itemsize)
        if (kind, step) == ("bounds", "restore"):
            packed = bounds.RESTORE_PACKED_BYTES_PER_THREAD
        values = packed * 8 * RELU_POINTERS[dtype][1].itemsize // VECTOR_BYTES
        if step == "pack":
            return {"ld.global.v4.b32": values, f"st.global.{vector[packed]}": 1}
        if packed == 16:
            return {"ld.global.v4.b32": values + 1, "st.global.v4.b32": values}
        return {"ld.global.v4.b32": values, f"ld.global.{vector[packed]}": 1, "st.global.v4.b32": values}
    if kind == "pool":
        step, window, _ = rest
        bits = _pool_geometry(window).bits
        packed = packed_tiles.packed_bytes_per_thread(bits, 8)
        pairs = packed * (8 // bits) * 8 // VECTOR_BYTES
        if step == "encode":
            return {"ld.global.v2.b64": pairs, f"st.global.{vector[packed]}": 1}
        return {f"ld.global.{vector[packed]}": 1, "st.global.v2.b64": pairs}
    size = {"fp32": 4, "bf16": 2, "fp64": 8}[rest[0]]
    per_thread = max_pool.GATHER_ELEMENTS_PER_THREAD
    vectors = {"fp32": "v4.b32", "bf16": "v4.b32", "fp64": "v2.b64"}[rest[0]]
    return {"ld.global.v2.b64": per_thread * 8 // VECTOR_BYTES, f"ld.global.b{8 * size}": per_thread,
            f"st.global.{vectors}": per_thread * size // VECTOR_BYTES}


@pytest.mark.parametrize("build", [b for b in DECISION_BUILDS if not b.endswith(("_ragged", "_ones"))])
def test_decision_streams_move_in_16_byte_vectors(builds, build):
    assert _global_accesses(builds[build]["ptx"]) == _expected_decision_accesses(build)


@pytest.mark.parametrize("build", [b for b in DECISION_BUILDS if b.endswith("_ragged")])
def test_a_ragged_decision_count_gets_scalar_accesses(builds, build):
    """As for the codecs: where the counts are not multiples of 16, the bounds may fall
    inside any vector, so every access is one element wide."""
    accesses = _global_accesses(builds[build]["ptx"])
    assert accesses and not [form for form in accesses if ".v2." in form or ".v4." in form], accesses
