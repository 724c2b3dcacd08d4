"""Inputs and checks shared by the codec kernel tests.

Shapes are small and groups of 16 are the norm: the interpreter costs milliseconds
per program, and small groups put many groups, partial ones included, in small tensors.
"""
import json
import os
import subprocess
import sys

import pytest
import torch

from actsave.codecs import sqnr_db

GROUP = 16
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _with(x, index, value):
    x[index] = value
    return x


def _wide_range(n_groups):
    """Groups whose magnitudes span 2**0 .. 2**-40, signs alternating: divided by the
    group's scale they sweep the normal and subnormal ranges of both fp8 formats down
    to rounding to zero, as they do for int8."""
    magnitudes = torch.pow(2.0, torch.linspace(0, -40, GROUP)) * (1 + torch.rand(n_groups, GROUP))
    return magnitudes * torch.tensor([1.0, -1.0]).repeat(GROUP // 2)


def _non_finite_groups():
    """One group each: finite; a NaN; a +inf; +inf, -inf and NaN together; all -inf;
    -inf beside zeros; -inf beside the fp32 maximum (cast to bf16 or fp16, inf)."""
    x = torch.randn(7, GROUP)
    x[1, 3], x[2, 0] = float("nan"), float("inf")
    x[3, 2], x[3, 9], x[3, 15] = float("inf"), float("-inf"), float("nan")
    x[4] = float("-inf")
    x[5, ::2], x[5, 1::2] = 0.0, float("-inf")
    x[6, 0], x[6, 1] = float("-inf"), torch.finfo(torch.float32).max
    return x


# name -> fp32 tensor; each case is cast to the dtype under test.
INPUT_CASES = {
    "one_element": lambda: torch.randn(1, 1),
    "three": lambda: torch.randn(3),
    "odd_width": lambda: torch.randn(7, 33),
    "several_programs": lambda: torch.randn(3, 1500),  # > 4096 elements
    "zero_groups": lambda: _with(torch.randn(4, 2 * GROUP + 5), (slice(1, 3), slice(None)), 0.0),
    "nan": lambda: _with(torch.randn(5, GROUP), (2, 3), float("nan")),
    "pos_inf": lambda: _with(torch.randn(5, GROUP), (1, 0), float("inf")),
    "neg_inf": lambda: _with(torch.randn(5, GROUP), (4, 15), float("-inf")),
    "non_finite_groups": _non_finite_groups,
    "causal_mask": lambda: torch.randn(3, 8, 8).masked_fill(~torch.ones(8, 8, dtype=torch.bool).tril(), float("-inf")),
    "transposed": lambda: torch.randn(33, 20).t(),
    "sliced": lambda: torch.randn(40, 50)[::3, 5:40],
    "wide_range": lambda: _wide_range(6),
    "empty": lambda: torch.empty(0, 5),
}


@pytest.fixture(params=FLOAT_DTYPES, ids=str)
def dtype(request):
    return request.param


@pytest.fixture(params=FLOAT_DTYPES, ids=str)
def out_dtype(request):
    return request.param


@pytest.fixture(params=sorted(INPUT_CASES))
def input_case(request, dtype):
    torch.manual_seed(0)
    return INPUT_CASES[request.param]().to(dtype)


@pytest.fixture(params=["max", "tiny", "exact_max"])
def extreme_input(request, dtype):
    """Values up to the dtype's largest finite one, or within its subnormal range, or
    groups holding +-that largest value itself."""
    torch.manual_seed(0)
    finfo = torch.finfo(dtype)
    top = finfo.tiny if request.param == "tiny" else finfo.max
    x = (torch.rand(4, GROUP) * 2 - 1).mul(top).to(dtype)
    if request.param == "exact_max":
        x[:, 0], x[1:, 5] = finfo.max, -finfo.max
    return x


@pytest.fixture
def non_finite_input(dtype):
    torch.manual_seed(0)
    return _non_finite_groups().to(dtype)


@pytest.fixture(scope="session")
def signals():
    """Activation-like data for the SQNR floors, 2**14 values each."""
    torch.manual_seed(0)
    n = 1 << 14
    channel_scale = torch.where(torch.arange(256) % 64 == 0, 100.0, 1.0)
    return {
        "gaussian": torch.randn(n),
        "post_relu": torch.relu(torch.randn(n)),
        "student_t3": torch.distributions.StudentT(3.0).sample((n,)),
        # 4 channels in 256 are 100x larger, as in transformer residual streams.
        "outlier_channels": (torch.randn(n // 256, 256) * channel_scale).reshape(-1),
    }


def _assert_same_bits(actual, expected):
    """Same dtype, shape and bits; NaNs need only share positions (their payload and
    sign are unspecified and differ between torch, numpy and GPUs)."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    if actual.is_floating_point():
        nan = expected.isnan()
        assert torch.equal(actual.isnan(), nan), "NaN positions differ"
        bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[actual.element_size()]
        actual, expected = actual[~nan].view(bits), expected[~nan].view(bits)
    mismatches = (actual != expected).nonzero().flatten()
    assert mismatches.numel() == 0, f"{mismatches.numel()} elements differ, first at {mismatches[:5].tolist()}"


def _assert_matches_reference(kernel, reference, x, group_size, out_dtype=None):
    """The Triton codec's codes, scales and decoded values equal, bit for bit, those of
    the torch reference run on CPU. kernel and reference are (encode, decode) pairs
    called as encode(x, group_size=) and decode(codes, scales, dtype=, group_size=)."""
    (encode, decode), (encode_ref, decode_ref) = kernel, reference
    out_dtype = out_dtype or x.dtype
    codes, scales = encode(x, group_size=group_size)
    ref_codes, ref_scales = encode_ref(x.cpu(), group_size=group_size)
    _assert_same_bits(codes.cpu(), ref_codes)
    _assert_same_bits(scales.cpu(), ref_scales)
    decoded = decode(codes, scales, dtype=out_dtype, group_size=group_size)
    expected = decode_ref(ref_codes, ref_scales, dtype=out_dtype, group_size=group_size)
    _assert_same_bits(decoded.cpu(), expected)


def _round_trip(codec, x, group_size):
    """(scales, decoded in x's dtype and shape) of an (encode, decode) pair."""
    encode, decode = codec
    codes, scales = encode(x, group_size=group_size)
    return scales, decode(codes, scales, dtype=x.dtype, group_size=group_size).view(x.shape)


def _assert_non_finite_kept(codec, x, group_size):
    """NOTE [ Non-finite groups ]: a group's scale is negative exactly when it holds inf
    or NaN; +-inf decode to the same +-inf, NaN to NaN, finite values to finite ones."""
    scales, decoded = _round_trip(codec, x, group_size)
    finite = x.isfinite()
    assert torch.equal(scales.signbit(), ~finite.view(-1, group_size).all(dim=1))
    assert torch.equal(decoded.isnan(), x.isnan())
    assert torch.equal(decoded.isposinf(), x.isposinf()) and torch.equal(decoded.isneginf(), x.isneginf())
    assert decoded[finite].isfinite().all()


def _sqnr_beside_neg_inf(codec):
    """SQNR in dB of the finite values of 256 Gaussian groups of 128 when one value in
    each group is -inf, and when that value is 0 (which leaves the scale as it is)."""
    torch.manual_seed(0)
    x = torch.randn(256, 128)
    finite = torch.ones_like(x, dtype=torch.bool)
    finite[:, 77] = False
    result = []
    for masked in (float("-inf"), 0.0):
        _, decoded = _round_trip(codec, x.masked_fill(~finite, masked), 128)
        result.append(sqnr_db(x[finite], decoded[finite]))
    return result


@pytest.fixture
def round_trip():
    return _round_trip


@pytest.fixture
def assert_non_finite_kept():
    return _assert_non_finite_kept


@pytest.fixture
def sqnr_beside_neg_inf():
    return _sqnr_beside_neg_inf


@pytest.fixture
def assert_same_bits():
    return _assert_same_bits


@pytest.fixture
def assert_matches_reference():
    return _assert_matches_reference


@pytest.fixture
def group_size():
    """The group size the input cases are built around."""
    return GROUP


@pytest.fixture
def sqnr():
    return sqnr_db


@pytest.fixture
def large_cuda_input():
    """17 Mi + 5 fp32 values (68 MiB, partial last group) with a NaN, an Inf and a
    zero group."""
    torch.manual_seed(0)
    x = torch.randn(17 * 2**20 + 5, device="cuda")
    x[12345], x[2**20] = float("nan"), float("inf")
    x[4096:4096 + 4096] = 0
    return x


_COMPILE_FOR_CUDA = """
import importlib, json, re, subprocess, sys, tempfile
import triton
from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

# What the JIT attaches to an argument it specializes as divisible by 16: a pointer
# to a 16-byte aligned tensor, or an integer that is a multiple of 16.
DIVISIBLE_BY_16 = [["tt.divisibility", 16]]


def resource_usage(cubin):
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        report = subprocess.run([knobs.nvidia.cuobjdump.path, "-res-usage", f.name],
                                capture_output=True, text=True, check=True).stdout
    return {key: int(value) for key, value in re.findall(r"(STACK|LOCAL):(\\d+)", report)}


compiled = {}
for name, job in json.loads(sys.stdin.read()).items():
    kernel = getattr(importlib.import_module(job["module"]), job["kernel"])
    attrs = {(kernel.arg_names.index(arg),): DIVISIBLE_BY_16 for arg in job["divisible_by_16"]}
    source = ASTSource(kernel, job["signature"], job["constexprs"], attrs)
    binary = triton.compile(source, target=GPUTarget("cuda", job["arch"], 32), options=job["options"])
    compiled[name] = {"ptx": binary.asm["ptx"], **resource_usage(binary.asm["cubin"])}
print(json.dumps(compiled))
"""


def _compile_for_cuda(jobs):
    """Compile {name: job} ahead of time, without a GPU, and return {name: {"ptx": text,
    "STACK": bytes, "LOCAL": bytes}} (stack and local memory per thread, as ptxas
    allotted them). A job names its kernel ("module", "kernel"), its "signature" and
    "constexprs" as triton.compile takes them, the CUDA "arch" (80, 90) and the
    arguments the JIT would see as "divisible_by_16" (16-byte aligned pointers,
    integers that are multiples of 16), and the launch's compile "options" (warps
    and the rest, as the launcher passes them). Triton compiles for a GPU only outside
    interpreter mode, hence the subprocess."""
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", _COMPILE_FOR_CUDA], input=json.dumps(jobs),  # stdin: no argv limit
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout)


@pytest.fixture(scope="session")
def compile_for_cuda():
    pytest.importorskip("triton.backends.nvidia", reason="this Triton has no CUDA backend")
    return _compile_for_cuda
