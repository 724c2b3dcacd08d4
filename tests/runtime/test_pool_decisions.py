"""Max-pool window decisions kept by lossy checkpoints: the packing, which saves are
recognised, and a lossy recompute pooling exactly at the forward's decisions."""
import pytest
import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks

import actsave
from actsave import CheckpointedSequential
from actsave.codecs import LOSSY_CODECS, get_codec, sqnr_db
from actsave.runtime import pool_decisions
from actsave.runtime.pool_decisions import PoolWatch, Window

# (module, input shape): every geometry a plain max pool takes.
GEOMETRIES = [
    (nn.MaxPool1d(3, 2, 1), (2, 3, 17)),
    (nn.MaxPool1d(2), (3, 16)),  # unbatched
    (nn.MaxPool2d(3, 2, 1), (2, 3, 9, 9)),
    (nn.MaxPool2d(2), (2, 3, 8, 8)),
    (nn.MaxPool2d((2, 3), stride=(1, 2), padding=(1, 0), dilation=(2, 1)), (2, 3, 9, 10)),
    (nn.MaxPool2d(3, 2, 1, ceil_mode=True), (2, 3, 10, 10)),
    (nn.MaxPool2d(3, 2, ceil_mode=True), (3, 8, 11)),  # unbatched, a partial last window
    (nn.MaxPool2d(4, 4), (2, 3, 8, 8)),  # 16 elements: 4 bits
    (nn.MaxPool2d(5, 1, 2), (1, 2, 7, 7)),  # 25 elements: 8 bits
    (nn.MaxPool2d(2), (1, 2, 200, 200)),  # planes of more than 2**15 elements
    (nn.MaxPool3d(2), (2, 3, 4, 6, 6)),
    (nn.MaxPool3d(3, 2, 1, dilation=(1, 2, 1), ceil_mode=True), (2, 2, 5, 9, 7)),
]


def ties_broken(shape) -> torch.Tensor:
    """Distinct values: which element wins a window is then one answer."""
    torch.manual_seed(0)
    return torch.randperm(torch.Size(shape).numel()).float().view(shape)


def saved_under_watch(module: nn.Module, x: torch.Tensor) -> list:
    """(tensor, window_of) of each save of ``module(x)``, with the pools watched."""
    watch, saves = PoolWatch(), []

    def pack(t):
        saves.append((t, watch.window_of(t)))
        return t

    with watch.watching(), saved_tensors_hooks(pack, lambda t: t):
        module(x)
    return saves


@pytest.mark.parametrize("module, shape", GEOMETRIES, ids=lambda v: str(v).replace(" ", ""))
def test_indices_save_is_recognised_and_its_decisions_round_trip(module, shape):
    x = ties_broken(shape).requires_grad_()
    saves = saved_under_watch(module, x * 1)
    recognised = [(t, found) for t, found in saves if found is not None]
    assert len(recognised) == 1 and len(saves) == 2
    indices, (window, input_size) = recognised[0]
    packed = window.encode(indices, input_size)
    assert packed.dtype == torch.uint8 and packed.numel() == window.packed_bytes(indices.numel())
    restored = torch.full_like(indices, -1)
    window.decode_into_(restored, packed, input_size)
    assert torch.equal(restored, indices)


def test_bits_per_decision_follow_the_window():
    assert [Window.of(nn.MaxPool2d(k)).bits for k in (2, 3, 4, 5, 16)] == [2, 4, 4, 8, 8]
    assert Window.of(nn.MaxPool1d(2)).bits == 1 and Window.of(nn.MaxPool3d(2)).bits == 4
    # One element decides nothing; more than 256 do not fit a byte: not kept.
    assert Window.of(nn.MaxPool2d(1)) is None and Window.of(nn.MaxPool2d(17)) is None


class OwnForwardPool(nn.MaxPool2d):
    def forward(self, x):
        return super().forward(x) * 1


def test_other_integer_saves_are_not_decisions():
    # Embedding ids saved with no pool running, a subclass with its own forward, a
    # functional max pool: nothing is recognised.
    ids = torch.randint(0, 10, (4, 5))
    assert all(found is None for _, found in saved_under_watch(nn.Embedding(10, 3), ids))
    x = torch.randn(2, 3, 8, 8, requires_grad=True) * 1
    assert all(found is None for _, found in saved_under_watch(OwnForwardPool(2), x))
    assert all(found is None for _, found in saved_under_watch(
        lambda t: nn.functional.max_pool2d(t, 2), x))


# --- a lossy recompute pools at the forward's decisions -----------------------------


class _PoolAt(torch.autograd.Function):
    """Max pooling at given decisions: forward gathers, backward scatters."""

    @staticmethod
    def forward(ctx, x, indices):
        ctx.save_for_backward(x, indices)
        return x.flatten(2).gather(2, indices.flatten(2)).view(indices.shape).clone()

    @staticmethod
    def backward(ctx, grad):
        x, indices = ctx.saved_tensors
        grad_x = torch.zeros_like(x).flatten(2).scatter_add_(2, indices.flatten(2), grad.flatten(2))
        return grad_x.view(x.shape), None


class OraclePool(nn.MaxPool2d):
    """The exact-math oracle: ``nn.MaxPool2d`` whose recompute pools at the decisions
    its forward call took (a subclass with its own forward: actsave keeps nothing)."""

    recomputing = False

    def forward(self, x):
        with torch.no_grad():
            _, indices = nn.functional.max_pool2d(x, self.kernel_size, self.stride, self.padding,
                                                  return_indices=True)
        if self.recomputing:
            indices = self.decisions
        self.decisions = indices
        return _PoolAt.apply(x, indices)


def pooled_chain(pool=nn.MaxPool2d) -> list:
    """conv-BN-ReLU-MaxPool three times at 16x16, then a linear head (14 layers)."""
    torch.manual_seed(0)
    return [nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(), pool(3, 2, 1),
            nn.Conv2d(8, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU(), pool(3, 2, 1),
            nn.Conv2d(16, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU(), pool(2),
            nn.Flatten(), nn.Linear(16 * 2 * 2, 10)]


# Segments that start at each pool (recomputed from a lossy input) and one with a pool
# inside it; the last segment is the head.
POOL_SEGMENTS = [0, 3, 7, 9, 12]


def step_gradients(model: nn.Module, seed: int = 1) -> list:
    torch.manual_seed(seed)
    x, labels = torch.randn(8, 3, 16, 16), torch.randint(0, 10, (8,))
    out = model(x)
    for m in model.modules():
        if isinstance(m, OraclePool):
            m.recomputing = True
    nn.functional.cross_entropy(out, labels).backward()
    return [p.grad for p in model.parameters()]


def lossy_gradients(codec: str, pool=nn.MaxPool2d, seed: int = 1) -> list:
    return step_gradients(CheckpointedSequential(*pooled_chain(pool), segments=POOL_SEGMENTS, compress=codec), seed)


def without_pool_decisions(monkeypatch) -> None:
    monkeypatch.setattr(pool_decisions.Window, "of", classmethod(lambda cls, module: None))


@pytest.mark.parametrize("codec", LOSSY_CODECS)
def test_lossy_gradients_are_the_oracles_at_the_forwards_decisions(codec, monkeypatch):
    # Bit-identical: the recompute's indices are the forward's, its pooled values a
    # gather at them (as the oracle's), and max pooling's backward adds each window's
    # gradient at its index in the oracle's order (output by output, per plane).
    oracle = lossy_gradients(codec, OraclePool)
    assert all(torch.equal(got, want) for got, want in zip(lossy_gradients(codec), oracle))
    without_pool_decisions(monkeypatch)  # the same run deciding anew: windows change
    assert not all(torch.equal(got, want) for got, want in zip(lossy_gradients(codec), oracle))


def worst_gradient_sqnr(codec: str, seed: int) -> float:
    exact = step_gradients(nn.Sequential(*pooled_chain()), seed)
    return min(sqnr_db(a, b) for a, b in zip(exact, lossy_gradients(codec, seed=seed)))


# Worst parameter-gradient SQNR (no conv bias: every gradient is meaningful) over seeds
# 1-6 with the decisions kept, without, and the gain: int8 38.8-45.5, 11.7-16.6, +23.7
# to +33.6 dB; e4m3 25.6-29.9, 8.6-11.3, +15.6 to +19.4; e5m2 20.6-25.2, 6.0-9.5, +11.1
# to +18.2 (seed 1: 41.3 / 11.8, 27.2 / 8.6, 21.0 / 7.8). Floors and gains: 3 dB under
# the worst seed's.
@pytest.mark.parametrize("codec, floor, gain", [("int8", 35.5, 20.5), ("fp8_e4m3", 22.5, 12.5),
                                                ("fp8_e5m2", 17.5, 8.0)])
def test_kept_decisions_lift_the_gradient_sqnr(codec, floor, gain, monkeypatch):
    kept = worst_gradient_sqnr(codec, seed=1)
    without_pool_decisions(monkeypatch)
    assert kept >= floor and kept >= worst_gradient_sqnr(codec, seed=1) + gain


def test_exact_checkpoints_keep_no_decisions_and_stay_bit_identical():
    plain = step_gradients(nn.Sequential(*pooled_chain()))
    model = CheckpointedSequential(*pooled_chain(), segments=POOL_SEGMENTS)
    assert all(torch.equal(a, b) for a, b in zip(step_gradients(model), plain))


def forward_kept_bytes(codec, offload=False) -> dict:
    model = CheckpointedSequential(*pooled_chain(), segments=POOL_SEGMENTS, compress=codec, offload=offload)
    out = model(torch.randn(8, 3, 16, 16))
    stored = actsave.kept_bytes()
    out.sum().backward()
    assert actsave.kept_bytes() == {"device": 0, "host": 0}  # released after the recompute
    return stored


@pytest.mark.parametrize("offload", [False, True])
def test_kept_bytes_count_the_decisions_where_the_inputs_are(offload, monkeypatch):
    kept = forward_kept_bytes("int8", offload)
    without_pool_decisions(monkeypatch)
    without = forward_kept_bytes("int8", offload)
    # Every pool is recomputed: 3x3 windows (4 bits) to 8x8 on 8 x 8 planes and to 4x4
    # on 8 x 16 planes, 2x2 windows (2 bits) to 2x2 on 8 x 16 planes.
    decisions = 8 * 8 * 8 * 8 * 4 // 8 + 8 * 16 * 4 * 4 * 4 // 8 + 8 * 16 * 2 * 2 * 2 // 8
    where = "host" if offload else "device"
    assert kept[where] - without[where] == decisions


def pool_unpool_indices(codec: str) -> tuple:
    """The indices a MaxUnpool2d read from a ``return_indices=True`` pool in the
    forward and in the recompute of a lossy segment."""
    seen = []

    class PoolUnpool(nn.Module):
        def __init__(self):
            super().__init__()
            self.pool, self.unpool = nn.MaxPool2d(3, 2, 1, return_indices=True), nn.MaxUnpool2d(3, 2, 1)

        def forward(self, x):
            y, indices = self.pool(x)
            seen.append(indices.clone())
            return self.unpool(y, indices, output_size=x.shape[-2:])

    torch.manual_seed(0)
    layers = [nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), PoolUnpool(), nn.Flatten(),
              nn.Linear(8 * 16 * 16, 3)]
    model = CheckpointedSequential(*layers, segments=[0, 3, 4], compress=codec)
    model(torch.randn(8, 3, 16, 16)).sum().backward()
    return tuple(seen)


def test_return_indices_callers_read_the_forwards_decisions(monkeypatch):
    forward, recomputed = pool_unpool_indices("fp8_e5m2")
    assert torch.equal(forward, recomputed)
    without_pool_decisions(monkeypatch)
    forward, recomputed = pool_unpool_indices("fp8_e5m2")
    assert not torch.equal(forward, recomputed)


class Scale(nn.Module):
    """``x * w``: a layer before the pool, so the pool's input is recomputed."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.tensor(1.5))

    def forward(self, x):
        return x * self.w


def pooled_at_forward_decisions(module: nn.Module, x: torch.Tensor, w: torch.Tensor, grad: torch.Tensor) -> list:
    """The oracle for ``[Scale, module]`` recomputed from an int8 kept ``x``: the decoded
    input, scaled, gathered and its gradient scattered at the forward's decisions."""
    dims = len(Window.of(module).kernel)
    _, indices = module.__class__(module.kernel_size, module.stride, module.padding, module.dilation,
                                  return_indices=True, ceil_mode=module.ceil_mode)(x.detach() * w.detach())
    codec = get_codec("int8")
    decoded = codec.decode(codec.encode(x.detach())).requires_grad_()
    w = w.detach().requires_grad_()
    scaled = (decoded * w).flatten(-dims) if dims > 1 else decoded * w
    pooled = scaled.gather(-1, indices.reshape(*scaled.shape[:-1], -1)).view(indices.shape)
    (pooled * grad).sum().backward()
    return [decoded.grad, w.grad]


def coarsely_kept(shape) -> torch.Tensor:
    """Values that int8 keeps coarsely: an outlier in every 64 elements widens each
    group's scale, so many windows tie or flip in the recompute (checked: without the
    decisions every geometry's gradients differ from the oracle's)."""
    torch.manual_seed(0)
    x = torch.randn(shape)
    x.view(-1)[::64] = 50.0
    return x


@pytest.mark.parametrize("module, shape", GEOMETRIES, ids=lambda v: str(v).replace(" ", ""))
def test_every_geometry_is_recomputed_at_the_forwards_decisions(module, shape):
    # Bit-identical, as above; the input's gradient passes through the decoded input
    # unchanged, so both are compared.
    leaf = coarsely_kept(shape).requires_grad_()
    x = leaf * 1  # an activation: the codec keeps it
    model = CheckpointedSequential(Scale(), module, nn.Identity(), segments=[0, 2], compress="int8")
    out = model(x)
    grad = torch.randn(out.shape)
    (out * grad).sum().backward()
    expected = pooled_at_forward_decisions(module, x, model[0].w, grad)
    assert torch.equal(leaf.grad, expected[0]) and torch.equal(model[0].w.grad, expected[1])


# --- the fused kernels (triton_kernels/decisions.py) ----------------------------------


def test_forced_triton_pools_at_the_same_decisions_in_one_launch_each(monkeypatch):
    # Under the interpreter on CPU: bit-identical gradients; each recomputed pool's
    # decisions are encoded, decoded and gathered at by one launch each.
    from actsave.triton_kernels import _launch

    launched = []
    real = _launch.launch
    monkeypatch.setattr(_launch, "launch", lambda kernel, *a, **k: launched.append(_launch.kernel_name(kernel))
                        or real(kernel, *a, **k))
    with actsave.set_backend("triton"):
        by_kernels = lossy_gradients("int8")
    assert all(torch.equal(a, b) for a, b in zip(by_kernels, lossy_gradients("int8")))
    # POOL_SEGMENTS recompute every pool; the last pool's recompute stops at its indices
    # (early stop: nothing after the segment's last save runs), so its output is not set.
    assert [launched.count(kernel) for kernel in ("_encode_max_pool_kernel", "_decode_max_pool_kernel",
                                                  "_gather_max_pool_kernel")] == [3, 3, 2]


def _pool_then_scale(x):
    return torch.nn.functional.max_pool2d(x, 2) * 3.0


@pytest.mark.parametrize("keep", ["inputs", "selective"])
def test_a_pool_with_a_forward_set_on_it_is_recomputed_as_it_comes(keep):
    # Its output is not the pool's: the forward's decisions must not overwrite it.
    torch.manual_seed(0)
    pool = nn.MaxPool2d(2)
    pool.forward = _pool_then_scale
    plain = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), pool, nn.Flatten(), nn.Linear(64, 5))
    x = torch.randn(2, 3, 8, 8, requires_grad=True)
    grads = []
    for run in (plain, lambda h: actsave.checkpoint(plain, h, compress="int8", keep=keep)):
        plain.zero_grad()
        run(x * 1.0).square().sum().backward()
        grads.append(plain[3].weight.grad.clone())
    assert sqnr_db(grads[0], grads[1]) > 30  # 3.5 dB where the pool's decisions replaced its output
    assert Window.of(pool) is None


def _wrapping(pool: nn.MaxPool2d, before, after) -> nn.MaxPool2d:
    """``pool`` with a forward that says it wraps the class's (functools.wraps, as
    accelerate's hooks set it) and changes its input or output around it."""
    import functools
    inner = pool.forward
    pool.forward = functools.wraps(inner)(lambda x: after(inner(before(x))))
    return pool


def _doubled_outside_autograd(y: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return y.mul_(2)


@pytest.mark.parametrize("before, after", [(lambda x: x * 2, lambda y: y), (lambda x: x, lambda y: y * 2),
                                           (lambda x: x, lambda y: y.mul_(2)),
                                           (lambda x: x, _doubled_outside_autograd)],
                         ids=["input scaled", "output scaled", "output scaled in place", "output scaled in no_grad"])
def test_a_pool_whose_wrapper_changes_its_input_or_output_keeps_them(before, after):
    # Its decisions are kept (it runs the class's forward), but its output is not its
    # argument at them: 6.4 dB where the correction wrote the argument's values.
    torch.manual_seed(0)
    pool = _wrapping(nn.MaxPool2d(2), before, after)
    plain = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.Tanh(), nn.Conv2d(8, 8, 3, padding=1), pool,
                          nn.Conv2d(8, 8, 3, padding=1), nn.Tanh(), nn.Flatten(), nn.Linear(128, 4))
    x = torch.randn(2, 3, 8, 8)
    grads = []
    for run in (plain, CheckpointedSequential(*plain, segments=[0, 2, 6], compress="int8")):
        plain.zero_grad()
        run(x).square().sum().backward()
        grads.append([p.grad.clone() for p in plain.parameters()])
    assert Window.of(pool) is not None
    assert min(sqnr_db(a, b) for a, b in zip(*grads)) > 30


def test_a_pool_called_with_its_input_by_keyword_keeps_its_decisions_without_its_output():
    # The hooks see no positional argument: the output keeps the recompute's values.
    class PoolsByKeyword(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv, self.pool = nn.Conv2d(3, 4, 3, padding=1), nn.MaxPool2d(2)

        def forward(self, x):
            return torch.tanh(self.pool(input=torch.tanh(self.conv(x))))  # a save after it: no early stop there

    torch.manual_seed(0)
    block, leaf = PoolsByKeyword(), torch.randn(2, 3, 8, 8, requires_grad=True)
    x = leaf * 1  # an activation: the codec keeps it
    plain = torch.autograd.grad(block(x).square().sum(), leaf, retain_graph=True)[0]
    lossy = torch.autograd.grad(actsave.checkpoint(block, x, compress="int8").square().sum(), leaf)[0]
    assert sqnr_db(plain, lossy) > 30
