"""The decision kernels (triton_kernels/decisions/) under Triton's interpreter, bit
for bit against their torch references, and the references against plain oracles
(the packing of bitfields.py, coordinates computed one dimension at a time). Shapes
are small: the interpreter costs milliseconds per program."""
import math
import weakref

import pytest
import torch
from torch import nn

from torch.utils._python_dispatch import TorchDispatchMode

from actsave.meta import simulating
from actsave.codecs.backend import implementation
from actsave.triton_kernels import _launch, bitfields, decision_table, decisions
from actsave.triton_kernels import _division as division
from actsave.triton_kernels.decisions import max_pool, packed_tiles

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_BITS = {torch.float64: torch.int64, torch.float32: torch.int32, torch.bfloat16: torch.int16,
         torch.float16: torch.int16}


def special_values(n: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """n values of ``dtype`` with zeros, -0.0, NaN of both signs, +-inf, subnormals and
    the smallest normal among Gaussian ones, at positions that do not repeat by 8."""
    torch.manual_seed(seed)
    y = torch.randn(n).to(dtype)
    finfo = torch.finfo(dtype)
    for start, step, value in [(0, 5, 0.0), (1, 7, -0.0), (2, 11, float("nan")), (3, 13, -float("nan")),
                               (4, 17, finfo.tiny / 4), (5, 19, float("inf")), (6, 23, -float("inf")),
                               (7, 29, finfo.tiny), (8, 31, -finfo.tiny / 8)]:
        y[start::step] = value
    return y


def relu_output(n: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """A ReLU output: the values above, the negative ones (and -0.0) zeroed, NaN kept."""
    return torch.relu(special_values(n, dtype, seed))


def assert_same_bits(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Same dtype, shape and bits; NaNs need only share positions (their payload and
    sign are unspecified: torch's half-type clamp gives the canonical NaN, the kernels
    keep the bits they read)."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    if actual.is_floating_point():
        nan = expected.isnan()
        assert torch.equal(actual.isnan(), nan), "NaN positions differ"
        actual, expected = actual[~nan].view(_BITS[actual.dtype]), expected[~nan].view(_BITS[expected.dtype])
    assert torch.equal(actual, expected), f"{(actual != expected).sum()} elements differ"


# Ragged counts (not multiples of 8 or 16), one element, and more than one program.
RELU_SIZES = [1, 7, 9, 33, 16 * 8 + 3, 256, 2 * packed_tiles.packed_rows(1, 2) * 8 + 5]


@pytest.fixture(autouse=True)
def launches(monkeypatch):
    """The kernels launched by the test, counted at the launch helper (its documented hook)."""
    launched = []
    real = _launch.launch

    def counting(kernel, grid, *args, **kwargs):
        launched.append(_launch.kernel_name(kernel))
        return real(kernel, grid, *args, **kwargs)

    monkeypatch.setattr(_launch, "launch", counting)
    return launched


# --- ReLU signs ----------------------------------------------------------------------


def oracle_signs(y: torch.Tensor) -> torch.Tensor:
    return bitfields.pack((~(y <= 0)).reshape(-1).view(torch.uint8), 1)


def oracle_restore(y: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    passed = bitfields.unpack(bits, 1, y.numel()).view(torch.bool).view(y.shape)
    return torch.where(passed, y.clamp_min(torch.finfo(y.dtype).tiny), torch.zeros_like(y))


@pytest.mark.parametrize("n", RELU_SIZES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_relu_signs_are_the_references_bits(n, dtype, launches):
    for y in (special_values(n, dtype), relu_output(n, dtype)):  # any sign, and a ReLU's output
        expected = decisions.pack_relu_signs_ref(y)
        assert torch.equal(expected, oracle_signs(y))
        assert torch.equal(decisions.pack_relu_signs(y), expected)
    assert launches == ["_pack_relu_signs_kernel"] * 2


@pytest.mark.parametrize("n", RELU_SIZES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_relu_restore_is_the_references_in_place(n, dtype, launches):
    bits = decisions.pack_relu_signs_ref(relu_output(n, dtype, seed=1))
    for recomputed in (relu_output(n, dtype, seed=2), special_values(n, dtype, seed=3)):
        expected, by_kernel = recomputed.clone(), recomputed.clone()
        decisions.restore_relu_signs_ref_(expected, bits)
        assert_same_bits(expected, oracle_restore(recomputed, bits))
        decisions.restore_relu_signs_(by_kernel, bits)
        assert_same_bits(by_kernel, expected)
    assert launches == ["_restore_relu_signs_kernel"] * 2


def test_relu_restore_zeroes_blocked_and_lifts_passed_zeros_keeping_nan():
    forward = torch.tensor([0.0, 0.5, 1e-3, 0.0, float("nan"), 2.0, 0.0, 1.0, 3.0])
    recomputed = torch.tensor([2e-3, 0.49, 0.0, float("nan"), float("nan"), -0.0, 0.0, 1e-42, float("inf")])
    decisions.restore_relu_signs_(recomputed, decisions.pack_relu_signs(forward))
    tiny = torch.finfo(torch.float32).tiny
    expected = torch.tensor([0.0, 0.49, tiny, 0.0, float("nan"), tiny, 0.0, tiny, float("inf")])
    assert_same_bits(recomputed, expected)


# --- Hardtanh and LeakyReLU bounds ----------------------------------------------------

# (low, high): ReLU6's, Hardtanh's, a bound at 0 from above, bounds no half type holds
# (NOTE [ Bounds as the backward compares ]), a LeakyReLU's (high infinite).
BOUNDS = [(0.0, 6.0), (-1.0, 1.0), (-0.5, 0.0), (0.10002, 1.0), (-2.7, 0.3), (0.0, math.inf)]
BOUND_IDS = ["relu6", "hardtanh", "zero-high", "odd-low", "odd-both", "leaky"]


def near_bounds(n: int, dtype: torch.dtype, low: float, high: float, seed: int = 0) -> torch.Tensor:
    """Special values, and values of ``dtype`` on both sides of and at each bound."""
    v = special_values(n, dtype, seed)
    finite = [b for b in (low, high, (low + high) / 2) if math.isfinite(b)]
    for i, bound in enumerate(finite):
        b = torch.tensor(bound, dtype=torch.float32).to(dtype)
        for j, value in enumerate((b, torch.nextafter(b, b + 1), torch.nextafter(b, b - 1))):
            v[9 + 3 * i + j::37] = value
    return v


def torch_passes(v: torch.Tensor, low: float, high: float) -> torch.Tensor:
    """Where torch's own backward passes the decision on ``v``: the oracle. NaN as the
    kernels take it (a Hardtanh passes it, a LeakyReLU blocks it): torch's CPU
    hardtanh_backward passes NaN one element at a time and blocks it in its vectorized
    loop, CUDA's passes it."""
    x = v.detach().clone().requires_grad_()
    y = nn.functional.leaky_relu(x, 0.5) if math.isinf(high) else nn.functional.hardtanh(x, low, high)
    y.backward(torch.ones_like(y))
    return (x.grad == 1).masked_fill_(v.isnan(), not math.isinf(high))


@pytest.mark.parametrize("n", RELU_SIZES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("low, high", BOUNDS, ids=BOUND_IDS)
def test_bound_bits_are_the_references_and_torchs_backwards_decisions(n, dtype, low, high, launches):
    v = near_bounds(n, dtype, low, high)
    expected = decisions.pack_bounds_ref(v, low, high)
    assert torch.equal(expected, bitfields.pack(torch_passes(v, low, high).view(torch.uint8), 1))
    assert torch.equal(decisions.pack_bounds(v, low, high), expected)
    assert launches == ["_pack_bounds_kernel"]


@pytest.mark.parametrize("n", RELU_SIZES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("low, high", BOUNDS, ids=BOUND_IDS)
def test_bound_restore_is_the_references_in_place_and_decides_as_the_forward(n, dtype, low, high, launches):
    forward = near_bounds(n, dtype, low, high, seed=1)
    bits = decisions.pack_bounds_ref(forward, low, high)
    recomputed = near_bounds(n, dtype, low, high, seed=2)
    expected, by_kernel = recomputed.clone(), recomputed.clone()
    decisions.restore_bounds_ref_(expected, bits, low, high)
    decisions.restore_bounds_(by_kernel, bits, low, high)
    assert_same_bits(by_kernel, expected)
    assert launches == ["_restore_bounds_kernel"]
    # The forward's decisions, NaN apart where a LeakyReLU passed it (no value inside
    # is nearest a NaN); every element that already decided so keeps its bits.
    decided = torch_passes(expected, low, high)
    wanted = torch_passes(forward, low, high)
    nan_kept = recomputed.isnan() & wanted if math.isinf(high) else torch.zeros_like(wanted)
    assert torch.equal(decided | nan_kept, wanted)
    agreed = torch_passes(recomputed, low, high) == wanted
    assert_same_bits(expected[agreed], recomputed[agreed])


def test_bounds_move_to_the_nearest_value_on_the_forwards_side():
    forward = torch.tensor([1.0, 1.0, 3.0, 0.0, 6.0, 7.0, 2.0, float("nan"), 0.0], dtype=torch.float16)
    recomputed = torch.tensor([0.0, 6.5, -1.0, 0.5, 5.9, 2.0, 6.0, 0.0, float("nan")], dtype=torch.float16)
    decisions.restore_bounds_(recomputed, decisions.pack_bounds(forward, 0.0, 6.0), 0.0, 6.0)
    inside = torch.tensor([0.0, 6.0], dtype=torch.float16)
    low_in, high_in = torch.nextafter(inside, torch.tensor([1.0, 0.0], dtype=torch.float16)).tolist()
    # NaN is inside a Hardtanh (it passes): blocked, it goes to the upper bound (it is
    # not below the middle); other blocked elements go to the bound nearest them.
    expected = torch.tensor([low_in, high_in, low_in, 0.0, 6.0, 0.0, high_in, low_in, 6.0], dtype=torch.float16)
    assert_same_bits(recomputed, expected)


def test_bounds_with_nothing_between_them_restore_as_the_kernel_does():
    # bf16 holds no value strictly between 0.1 and 0.10002: the value just inside the
    # lower bound is the upper one. A passed element below both goes there, in the
    # reference as in the kernel.
    restore = decision_table()["bounds", "restore"]
    bits = decisions.pack_bounds(torch.tensor([float("nan")] + [0.0] * 7, dtype=torch.bfloat16), 0.1, 0.10002)
    restored = []
    for run in (restore.launcher, restore.reference):
        recomputed = torch.tensor([0.05] + [0.0] * 7, dtype=torch.bfloat16)
        run(recomputed, bits, 0.1, 0.10002)
        restored.append(recomputed)
    assert_same_bits(*restored)
    assert restored[0][0].item() > 0.1


def test_a_bound_no_half_type_holds_is_compared_as_the_backward_compares():
    # fp16 rounds 0.10002 to the value just above it: a compare in fp16 would block that
    # value, which hardtanh_backward (in fp32) passes.
    v = torch.tensor(0.10002, dtype=torch.float32).to(torch.float16).reshape(1)
    assert v.item() > 0.10002 and torch_passes(v, 0.10002, 1.0).item()
    assert decisions.pack_bounds(v, 0.10002, 1.0).item() == 1


# --- max-pool decisions ----------------------------------------------------------------

# (module, input shape): every field width (window of 2 .. 256 elements), 1-D to 3-D,
# padding, dilation, ceil_mode, unbatched inputs, ragged counts of outputs.
POOLS = [
    (nn.MaxPool1d(2), (3, 17)),  # 2 elements: 1 bit; 24 outputs
    (nn.MaxPool1d(3, 2, 1), (2, 3, 17)),  # 2 bits
    (nn.MaxPool1d(5, 3, 2, dilation=2, ceil_mode=True), (2, 3, 29)),  # 4 bits, dilated
    (nn.MaxPool2d(2), (2, 3, 8, 8)),  # 4 elements: 2 bits
    (nn.MaxPool2d(3, 2, 1), (1, 3, 9, 9)),  # 9 elements: 4 bits, 75 outputs
    (nn.MaxPool2d(3, 2, ceil_mode=True), (3, 8, 11)),  # unbatched, a partial last window
    (nn.MaxPool2d((2, 3), stride=(1, 2), padding=(1, 0), dilation=(2, 1)), (1, 3, 9, 10)),
    (nn.MaxPool2d(4, 4), (2, 3, 8, 8)),  # 16 elements: 4 bits
    (nn.MaxPool2d(5, 1, 2), (1, 2, 7, 7)),  # 25 elements: 8 bits
    (nn.MaxPool2d(16, 2, 8), (1, 1, 20, 18)),  # 256 elements: 8 bits
    (nn.MaxPool2d(2), (1, 1, 190, 200)),  # a plane of more than 2**15 elements
    (nn.MaxPool3d(2), (2, 3, 4, 6, 6)),  # 8 elements: 4 bits
    (nn.MaxPool3d(3, 2, 1, dilation=(1, 2, 1), ceil_mode=True), (1, 2, 5, 9, 7)),  # 27: 8 bits
    (nn.MaxPool3d((1, 2, 1), (1, 2, 1)), (3, 3, 5, 2)),  # unbatched, 2 elements: 1 bit
]
POOL_IDS = [f"{type(m).__name__}{tuple(m.kernel_size) if isinstance(m.kernel_size, tuple) else m.kernel_size}"
            f"-{'x'.join(map(str, shape))}" for m, shape in POOLS]


def pooled(module: nn.Module, shape: tuple, dtype=torch.float32):
    """(x, geometry, pooled, indices) of ``module`` on distinct values (no ties)."""
    dims = {nn.MaxPool1d: 1, nn.MaxPool2d: 2, nn.MaxPool3d: 3}[type(module)]

    def per_dim(value):
        return tuple(value) if isinstance(value, (tuple, list)) else (value,) * dims

    torch.manual_seed(0)
    x = torch.randperm(math.prod(shape)).to(dtype).view(shape)
    geometry = (per_dim(module.kernel_size), per_dim(module.stride), per_dim(module.padding), per_dim(module.dilation))
    max_pool = getattr(nn.functional, f"max_pool{dims}d")
    out, indices = max_pool(x, *geometry, ceil_mode=module.ceil_mode, return_indices=True)
    return x, tuple(shape[-dims:]), geometry, out, indices


def oracle_offsets(indices, input_size, kernel_size, stride, padding, dilation) -> torch.Tensor:
    """Each winner's offset in its window, one spatial dimension at a time (int64)."""
    dims = len(kernel_size)
    offsets = torch.zeros_like(indices)
    for d in range(dims):
        coordinate = (indices // math.prod(input_size[d + 1:])) % input_size[d]
        out = torch.arange(indices.shape[d - dims]).view(-1, *([1] * (dims - 1 - d)))
        step = (coordinate - (out * stride[d] - padding[d])) // dilation[d]
        assert ((step >= 0) & (step < kernel_size[d])).all()
        offsets = offsets + step * math.prod(kernel_size[d + 1:])
    return offsets


@pytest.mark.parametrize("module, shape", POOLS, ids=POOL_IDS)
def test_pool_decisions_are_the_references_bits_and_decode_to_the_indices(module, shape, launches):
    x, input_size, geometry, out, indices = pooled(module, shape)
    bits = bitfields.field_bits(math.prod(geometry[0]))
    expected = decisions.encode_max_pool_ref(indices, input_size, *geometry)
    oracle = oracle_offsets(indices, input_size, *geometry).reshape(-1).to(torch.uint8)
    assert torch.equal(expected, bitfields.pack(oracle, bits))
    assert torch.equal(decisions.encode_max_pool(indices, input_size, *geometry), expected)
    for decode in (decisions.decode_max_pool_ref_, decisions.decode_max_pool_):
        restored = torch.full_like(indices, -1)
        decode(restored, expected, input_size, *geometry)
        assert torch.equal(restored, indices)
    assert launches == ["_encode_max_pool_kernel", "_decode_max_pool_kernel"]


@pytest.mark.parametrize("module, shape", POOLS[::3], ids=POOL_IDS[::3])
@pytest.mark.parametrize("dtype", [*FLOAT_DTYPES, torch.float64], ids=str)
def test_pooling_at_the_decisions_gathers_the_pooled_values(module, shape, dtype, launches):
    x, input_size, geometry, out, indices = pooled(module, shape, dtype)
    dims = len(geometry[0])
    for gather in (decisions.gather_max_pool_ref_, decisions.gather_max_pool_):
        result = torch.zeros_like(out)
        gather(result, x, indices, dims)
        assert_same_bits(result, out)
    assert launches == ["_gather_max_pool_kernel"]


def test_the_gather_moves_bits_nan_and_negative_zero_included():
    x = torch.tensor([[[-0.0, float("nan"), 1e-40, -float("inf")]]])
    indices = torch.tensor([[[0, 1, 2, 3]]])
    pooled_ = torch.zeros(1, 1, 4)
    decisions.gather_max_pool_(pooled_, x, indices, 1)
    assert torch.equal(pooled_.view(torch.int32), x.view(torch.int32))


# --- what the kernels do not take goes to the references --------------------------------


def channels_last_pool():
    x = torch.randperm(2 * 3 * 8 * 8).float().view(2, 3, 8, 8).to(memory_format=torch.channels_last)
    out, indices = nn.functional.max_pool2d(x, 3, 2, 1, return_indices=True)
    return x, out, indices


RELU_FALLBACKS = {
    "transposed": lambda seed: relu_output(40, torch.float32, seed).view(8, 5).t(),
    "float64": lambda seed: relu_output(40, torch.float32, seed).double(),
    "empty": lambda seed: torch.empty(0, 3),
}


@pytest.mark.parametrize("case", RELU_FALLBACKS)
def test_relu_outputs_the_kernels_cannot_take_get_the_references_bits(case, launches):
    y = RELU_FALLBACKS[case](0)
    bits = decisions.pack_relu_signs(y)
    assert torch.equal(bits, decisions.pack_relu_signs_ref(y)) and torch.equal(bits, oracle_signs(y))
    recomputed = RELU_FALLBACKS[case](1)
    expected = oracle_restore(recomputed, bits)
    decisions.restore_relu_signs_(recomputed, bits)
    assert torch.equal(recomputed.isnan(), expected.isnan())
    assert torch.equal(recomputed.nan_to_num(), expected.nan_to_num())
    assert launches == []


@pytest.mark.parametrize("case", RELU_FALLBACKS)
def test_bounded_saves_the_kernels_cannot_take_get_the_references_bits(case, launches):
    v = RELU_FALLBACKS[case](0) - 0.5
    bits = decisions.pack_bounds(v, 0.0, 6.0)
    assert torch.equal(bits, decisions.pack_bounds_ref(v, 0.0, 6.0))
    recomputed = RELU_FALLBACKS[case](1) - 0.5
    expected = recomputed.clone()
    decisions.restore_bounds_ref_(expected, bits, 0.0, 6.0)
    decisions.restore_bounds_(recomputed, bits, 0.0, 6.0)
    assert torch.equal(recomputed.isnan(), expected.isnan())
    assert torch.equal(recomputed.nan_to_num(), expected.nan_to_num()) and launches == []


class HostOps(TorchDispatchMode):
    """The aten operators run outside a launch (the interpreter's own copies of a
    launch's arguments are not the host's work on a GPU)."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func.overloadpacket.__name__))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_a_save_that_needs_grad_is_read_and_changed_by_the_kernels_with_no_operator_but_the_bits(
        dtype, launches, monkeypatch):
    """The kernels take a float save as it is (it may need grad) and read its bits
    themselves (packed_tiles.load_bits): no detach and no integer view on the host, an
    operator each per launch on a GPU. Same bits as the references."""
    y = relu_output(99, dtype).requires_grad_()
    v = near_bounds(99, dtype, -1.0, 1.0).requires_grad_()
    bits, bound_bits = decisions.pack_relu_signs_ref(y), decisions.pack_bounds_ref(v, -1.0, 1.0)
    restored, bounded = (t.detach().clone().requires_grad_() * 1 for t in (y, v))
    expected, expected_bounded = restored.detach().clone(), bounded.detach().clone()
    decisions.restore_relu_signs_ref_(expected, bits)
    decisions.restore_bounds_ref_(expected_bounded, bound_bits, -1.0, 1.0)
    decisions.pack_bounds(v, -1.0, 1.0)  # the bounds' arguments, worked out once per bounds and dtype
    decisions.restore_bounds_(expected_bounded.clone(), bound_bits, -1.0, 1.0)
    launches.clear()
    real, host = _launch.launch, HostOps()

    def outside_the_mode(*args, **kwargs):
        with torch.utils._python_dispatch._disable_current_modes():
            return real(*args, **kwargs)

    monkeypatch.setattr(_launch, "launch", outside_the_mode)
    with host:
        packed, packed_bounds = decisions.pack_relu_signs(y), decisions.pack_bounds(v, -1.0, 1.0)
        decisions.restore_relu_signs_(restored, bits)
        decisions.restore_bounds_(bounded, bound_bits, -1.0, 1.0)
    assert host.ops == ["empty", "empty"]  # the two packs' bits
    assert torch.equal(packed, bits) and torch.equal(packed_bounds, bound_bits)
    assert_same_bits(restored.detach(), expected)
    assert_same_bits(bounded.detach(), expected_bounded)
    assert launches == ["_pack_relu_signs_kernel", "_pack_bounds_kernel", "_restore_relu_signs_kernel",
                        "_restore_bounds_kernel"]


def test_a_save_whose_memory_holds_its_negation_gets_the_references_bits(launches):
    # torch._neg_view: the kernels read memory, the references the values.
    y = torch._neg_view(-relu_output(40, torch.float32, 0))
    assert torch.equal(decisions.pack_relu_signs(y), oracle_signs(y.resolve_neg()))
    v = torch._neg_view(-(relu_output(40, torch.float32, 0) - 0.5))
    assert torch.equal(decisions.pack_bounds(v, 0.0, 6.0), decisions.pack_bounds_ref(v.resolve_neg(), 0.0, 6.0))
    assert launches == []


def test_pools_the_kernels_cannot_take_get_the_references_bits(monkeypatch, launches):
    x, out, indices = channels_last_pool()  # channels-last indices are not contiguous
    geometry = ((3, 3), (2, 2), (1, 1), (1, 1))
    packed = decisions.encode_max_pool(indices, (8, 8), *geometry)
    assert torch.equal(packed, decisions.encode_max_pool_ref(indices.contiguous(), (8, 8), *geometry))
    restored = torch.full_like(indices, -1)
    decisions.decode_max_pool_(restored, packed, (8, 8), *geometry)
    assert torch.equal(restored, indices)
    result = torch.zeros_like(out)
    decisions.gather_max_pool_(result, x, indices, 2)
    assert torch.equal(result, out)
    assert decisions.encode_max_pool(indices[:0], (8, 8), *geometry).numel() == 0  # no elements
    assert launches == []
    # More elements than the kernels index in int32: here, more than 100.
    _, _, geometry, out, indices = pooled(nn.MaxPool2d(2), (2, 3, 10, 10))
    monkeypatch.setattr(max_pool, "MAX_INT32", 100)
    packed = decisions.encode_max_pool(indices, (10, 10), *geometry)
    assert torch.equal(packed, decisions.encode_max_pool_ref(indices, (10, 10), *geometry))
    restored = torch.full_like(indices, -1)
    decisions.decode_max_pool_(restored, packed, (10, 10), *geometry)
    assert torch.equal(restored, indices) and launches == []


def test_packed_decisions_of_the_wrong_size_are_refused():
    y = relu_output(20, torch.float32)
    with pytest.raises(ValueError, match="20 decisions of 1 bits take 3 bytes, got 2"):
        decisions.restore_relu_signs_(y, torch.zeros(2, dtype=torch.uint8))
    _, input_size, geometry, _, indices = pooled(nn.MaxPool2d(2), (2, 3, 8, 8))
    with pytest.raises(ValueError, match="96 decisions of 2 bits take 24 bytes"):
        decisions.decode_max_pool_(indices, torch.zeros(20, dtype=torch.uint8), input_size, *geometry)


def test_meta_tensors_get_the_outputs_and_no_launch(launches):
    # What actsave.estimate simulates a CUDA step with: the launcher's allocation only.
    y = torch.empty(3, 1000, dtype=torch.bfloat16, device="meta")
    with simulating("cuda"):
        pack = implementation(decision_table()["relu_signs", "pack"], y)
        bits = pack(y)
        implementation(decision_table()["relu_signs", "restore"], y)(y, bits)
        bound_bits = implementation(decision_table()["bounds", "pack"], y)(y, 0.0, 6.0)
        implementation(decision_table()["bounds", "restore"], y)(y, bound_bits, 0.0, 6.0)
    assert pack is decisions.pack_relu_signs and (bits.shape, bits.device.type) == ((375,), "meta")
    assert (bound_bits.shape, bound_bits.device.type) == ((375,), "meta")
    indices = torch.empty(8, 16, 7, 7, dtype=torch.int64, device="meta")
    packed = decisions.encode_max_pool(indices, (14, 14), (3, 3), (2, 2), (1, 1), (1, 1))
    decisions.decode_max_pool_(indices, packed, (14, 14), (3, 3), (2, 2), (1, 1), (1, 1))
    decisions.gather_max_pool_(torch.empty(8, 16, 7, 7, device="meta"), torch.empty(8, 16, 14, 14, device="meta"),
                               indices, 2)
    assert (packed.shape, packed.dtype) == ((8 * 16 * 49 // 2,), torch.uint8) and launches == []


class NewStorages(TorchDispatchMode):
    """The bytes of each storage an operation returns that was not seen before (nor
    ``known``), as actsave.planning.live_bytes.LiveBytes counts them."""

    def __init__(self, known=()):
        super().__init__()
        self.seen, self.nbytes = weakref.WeakKeyDictionary(), []
        for t in known:
            self.seen[t.untyped_storage()] = True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in (out if isinstance(out, (tuple, list)) else [out]):
            if isinstance(t, torch.Tensor) and t.untyped_storage() not in self.seen:
                self.seen[t.untyped_storage()] = True
                self.nbytes.append(t.untyped_storage().nbytes())
        return out


def reference_allocations(device) -> list:
    """The storages the references make for a ReLU output, a Hardtanh's and a pool on ``device``,
    their tables made already (a second call)."""
    y = torch.zeros(3, 1000, device=device)
    indices = torch.zeros(8, 16, 7, 7, dtype=torch.int64, device=device)
    window = ((14, 14), (3, 3), (2, 2), (1, 1), (1, 1))

    def work():
        bits = decisions.pack_relu_signs_ref(y)
        decisions.restore_relu_signs_ref_(y, bits)
        decisions.restore_bounds_ref_(y, decisions.pack_bounds_ref(y, -1.0, 1.0), -1.0, 1.0)
        decisions.decode_max_pool_ref_(indices, decisions.encode_max_pool_ref(indices, *window), *window)

    work()
    with NewStorages(known=(y, indices)) as storages:
        work()
    return storages.nbytes


def test_the_references_allocate_on_meta_what_they_allocate_on_a_device():
    # Meta tensors hold no data: the references use no table there, and an estimate
    # (a step on meta tensors) sees what a real step allocates.
    assert reference_allocations("meta") == reference_allocations("cpu")


# --- NOTE [ Division by an invariant ] ------------------------------------------------


@pytest.mark.parametrize("d", [1, 2, 3, 5, 7, 49, 56, 100, 3136, 12544, 65535, 65537, 2 ** 20 + 1,
                               2 ** 30 - 1, 2 ** 30, 2 ** 30 + 1, 2 ** 31 - 1])
def test_division_by_an_invariant_is_exact_for_every_int32_numerator(d):
    multiplier, shift = division.division_constants(d)
    assert 2 ** 31 <= multiplier < 2 ** 32 and shift <= 31
    torch.manual_seed(d % 1000)
    top = 2 ** 31 - 1
    quotients = torch.cat([torch.tensor([0, 1, 2, top // d - 1, top // d]), torch.randint(0, top // d + 1, (5000,))])
    around = (quotients[:, None] * d + torch.tensor([-1, 0, 1, d - 1])).reshape(-1)
    n = torch.cat([around[(around >= 0) & (around <= top)], torch.tensor([top]), torch.randint(0, top, (20000,))])
    # The kernel's uint32 multiply-high of 2n: floor(2n * multiplier / 2**32), which is
    # floor(n * multiplier / 2**31) (below 2**63 here, in int64).
    assert torch.equal(((n * multiplier) >> 31) >> shift, n // d)


# --- on a GPU ----------------------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_cuda_kernels_are_the_references_bits(dtype):
    # Large enough for many programs, ragged, and a multiple of 16 (vector accesses).
    for n in (2 ** 20 + 5, 3 * 2 ** 20):
        y = relu_output(n, dtype).cuda()
        bits = decisions.pack_relu_signs(y)
        assert torch.equal(bits.cpu(), decisions.pack_relu_signs_ref(y.cpu()))
        recomputed = special_values(n, dtype, seed=4).cuda()
        expected = recomputed.cpu()
        decisions.restore_relu_signs_ref_(expected, bits.cpu())
        decisions.restore_relu_signs_(recomputed, bits)
        assert_same_bits(recomputed.cpu(), expected)
        for low, high in BOUNDS:
            forward, recomputed = (near_bounds(n, dtype, low, high, seed).cuda() for seed in (5, 6))
            bits = decisions.pack_bounds(forward, low, high)
            assert torch.equal(bits.cpu(), decisions.pack_bounds_ref(forward.cpu(), low, high))
            expected = recomputed.cpu()
            decisions.restore_bounds_ref_(expected, bits.cpu(), low, high)
            decisions.restore_bounds_(recomputed, bits, low, high)
            assert_same_bits(recomputed.cpu(), expected)
    for module, shape in POOLS + [(nn.MaxPool2d(3, 2, 1), (64, 64, 112, 112))]:
        x, input_size, geometry, out, indices = pooled(module, shape, dtype)
        x, out, indices = x.cuda(), out.cuda(), indices.cuda()
        packed = decisions.encode_max_pool(indices, input_size, *geometry)
        assert torch.equal(packed.cpu(), decisions.encode_max_pool_ref(indices.cpu(), input_size, *geometry))
        restored = torch.full_like(indices, -1)
        decisions.decode_max_pool_(restored, packed, input_size, *geometry)
        assert torch.equal(restored, indices)
        result = torch.zeros_like(out)
        decisions.gather_max_pool_(result, x, indices, len(geometry[0]))
        assert torch.equal(result, out)
