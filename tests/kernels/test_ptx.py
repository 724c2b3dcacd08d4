"""Ahead-of-time builds of every codec kernel for sm_80 and sm_90, checked in their PTX
and resource usage, without a GPU (docs/architecture.md, "Testing without a GPU").

Each kernel x input (or output) dtype x codec is compiled as the JIT compiles it for
16-byte aligned tensors (pointers divisible by 16), for an element count that is a
multiple of 16 (int32, and int64 as for tensors of 2**31 elements and more), and, on
sm_90, for one that is not. All builds run once per session, in one subprocess.
"""
from collections import Counter
from itertools import product
import re

import pytest

from actsave.triton_kernels import DEFAULT_GROUP_SIZE, DIRECTIONS, FORMATS, SIGNED_FORMATS, kernel_table
from actsave.triton_kernels._rounding import ELEMENTS_PER_PROGRAM, NUM_WARPS

GROUP_SIZE = DEFAULT_GROUP_SIZE  # the tile a program owns is the same for every group size
TILE = {"GROUP_SIZE": GROUP_SIZE, "GROUPS_PER_PROGRAM": ELEMENTS_PER_PROGRAM // GROUP_SIZE}
DTYPES = {"fp32": 4, "bf16": 2, "fp16": 2}  # Triton type -> bytes per element
# format -> Triton type of its codes (the unsigned variants store bytes 0..255)
CODE_POINTERS = {"int8": "*i8", "fp8_e4m3": "*u8", "fp8_e5m2": "*u8", "uint8": "*u8", "fp8_ue4m4": "*u8",
                 "fp8_ue5m3": "*u8"}
# (arch, numel's Triton type, numel a multiple of 16, channel means subtracted): what a
# launch can specialize on.
TARGETS = {
    "sm80": (80, "i32", True, False),
    "sm90": (90, "i32", True, False),
    "sm90_int64": (90, "i64", True, False),
    "sm90_ragged": (90, "i32", False, False),
    "sm90_centered": (90, "i32", True, True),  # NOTE [channel means]: signed formats only
}
KERNELS = [f"{codec}-{direction}-{dtype}" for codec, direction, dtype in product(FORMATS, DIRECTIONS, DTYPES)]
BUILDS = [f"{kernel}-{target}" for kernel, target in product(KERNELS, TARGETS)
          if not TARGETS[target][3] or kernel.split("-")[0] in SIGNED_FORMATS]
# The elements, hence the bytes of each stream, one thread owns: the [groups,
# GROUP_SIZE] tile is spread evenly over the program's threads, contiguously.
ELEMENTS_PER_THREAD = ELEMENTS_PER_PROGRAM // (NUM_WARPS * 32)
VECTOR_BYTES = 16


def _job(codec, direction, dtype, target):
    kernel = kernel_table()[codec, direction]
    code_ptr = CODE_POINTERS[codec]
    arch, numel_type, numel_divisible, centered = TARGETS[target]
    if direction == "encode":
        pointers = {"x_ptr": f"*{dtype}", "codes_ptr": code_ptr, "scales_ptr": "*fp32", "means_ptr": "*fp32"}
    else:
        pointers = {"codes_ptr": code_ptr, "scales_ptr": "*fp32", "out_ptr": f"*{dtype}", "means_ptr": "*fp32"}
    channels = {"channel_size": "i32", "channels": "i32"}
    constexprs = {**kernel.constexprs, "CENTERED": centered, **TILE}
    return {
        "module": kernel.jit.fn.__module__,  # the subprocess imports it by name
        "kernel": kernel.jit.fn.__name__,
        "signature": {**pointers, "numel": numel_type, **channels, **dict.fromkeys(constexprs, "constexpr")},
        "constexprs": constexprs,
        "arch": arch,
        "divisible_by_16": list(pointers) + (["numel"] if numel_divisible else []),
    }


@pytest.fixture(scope="session")
def builds(compile_for_cuda):
    """{build id: {"ptx", "STACK", "LOCAL"}} for every build, compiled once (about 40 s
    on two cores; Triton's cache makes later sessions faster)."""
    return compile_for_cuda({build: _job(*build.split("-")) for build in BUILDS})


def _global_accesses(ptx):
    """How many of each form of global load and store the PTX holds, e.g.
    {"ld.global.v4.b32": 2, "st.global.b32": 1}."""
    return Counter(re.findall(r"\b(?:ld|st)\.global(?:\.[a-z0-9]+)+", ptx))


@pytest.mark.parametrize("build", BUILDS)
def test_arithmetic_is_correctly_rounded_ieee(builds, build):
    """What bit-exactness with the torch references rests on: divisions correctly
    rounded (plain `/` is div.full, an approximation), no flush of subnormals to zero,
    no multiply-add fused into one rounding."""
    ptx = builds[build]["ptx"]
    # Integer divisions (an element's channel, NOTE [channel means]) are exact.
    divisions = set(re.findall(r"\bdiv\.[\w.]*f32\b", ptx))
    assert divisions <= {"div.rn.f32"}, divisions
    assert not re.findall(r"\bdiv\.[\w.]*f(16|64)\b", ptx)
    if "-encode-" in build:
        assert divisions == {"div.rn.f32"}, "encoding divides by the scale: the check above saw no division"
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


def _expected_aligned_accesses(direction, dtype, centered):
    """A thread's elements are contiguous, so each stream is read or written in 16-byte
    vectors (ld/st.global.v4.b32): the float values (4 or 2 bytes each) and the codes
    (one byte each, 16 per thread: one vector). The scales are one fp32 per group,
    each thread's elements lying in one group: one 4-byte access, predicated, which
    moves 1/128 of the bytes at groups of 128. Channel means (NOTE [channel means]) are
    gathered, one 4-byte load per element: a few hundred bytes in all, which the caches
    serve, and the value stream keeps its vectors."""
    value_vectors = ELEMENTS_PER_THREAD * DTYPES[dtype] // VECTOR_BYTES
    code_vectors = ELEMENTS_PER_THREAD // VECTOR_BYTES
    means = ELEMENTS_PER_THREAD if centered else 0
    if direction == "encode":
        return {"ld.global.v4.b32": value_vectors, **({"ld.global.b32": means} if means else {}),
                "st.global.v4.b32": code_vectors, "st.global.b32": 1}
    return {"ld.global.v4.b32": code_vectors, "ld.global.b32": 1 + means, "st.global.v4.b32": value_vectors}


@pytest.mark.parametrize("build", [b for b in BUILDS if not b.endswith("_ragged")])
def test_streams_move_in_16_byte_vectors(builds, build):
    _, direction, dtype, target = build.split("-")
    expected = _expected_aligned_accesses(direction, dtype, centered=TARGETS[target][3])
    assert _global_accesses(builds[build]["ptx"]) == expected


@pytest.mark.parametrize("build", [b for b in BUILDS if b.endswith("_ragged")])
def test_a_ragged_element_count_gets_scalar_accesses(builds, build):
    """Where numel is not a multiple of 16, the bound `offsets < numel` may fall inside
    any 16-byte vector, so Triton must mask element by element: every access is one
    element wide. Correct, and slower; a tensor whose element count is a multiple of
    16 (most activations) gets the vectors above."""
    accesses = _global_accesses(builds[build]["ptx"])
    assert accesses and not [form for form in accesses if ".v2." in form or ".v4." in form], accesses
