"""actsave under automatic mixed precision.

- A bf16 autocast training step through CheckpointedSequential or ``wrap()`` is bit
  for bit the plain model's step (``compress=None``): the recompute, which runs in
  backward and so outside the ``autocast`` block, replays the forward's autocast
  state, whatever the state around the backward.
- A non-finite value in a kept activation makes the gradients non-finite, so a
  GradScaler skips the step, for every codec. The model is built so that only the
  stored activation can carry the Inf/NaN into the gradients: the forward output and
  the loss are finite, so a codec that turned it into a finite number would give
  finite gradients and fail these tests.

CUDA cases (fp16 and bf16 autocast, GradScaler) are marked ``cuda``.
"""
import contextlib
import copy
import functools
import math

import pytest
import torch
from torch import nn

import actsave
from actsave.planning import plans
from actsave.runtime.nested import Range
from support import ResidualBlock, ResidualNet, sqnr_db

INT8_SQNR_FLOOR_DB = 30.0
COMPRESS = [None, "int8"]


# --- models --------------------------------------------------------------------------

def chain(width=16) -> nn.Sequential:
    """Autocast runs the Linears in bf16: a recompute outside the forward's autocast
    state would save float32 tensors and fail actsave's check."""
    layers = []
    for _ in range(3):
        layers += [nn.Linear(width, width), nn.GELU(), nn.LayerNorm(width), nn.Dropout(0.1)]
    return nn.Sequential(*layers, nn.Linear(width, 4))


def plain_and_actsave(structure: str, compress, device="cpu"):
    torch.manual_seed(0)
    plain = (chain() if structure == "sequential" else ResidualNet(
        width=16, classes=4, activation=nn.functional.gelu, dropout=0.1)).to(device)
    if structure == "sequential":
        model = actsave.CheckpointedSequential.from_sequential(copy.deepcopy(plain), segments=3, compress=compress)
    else:
        model = actsave.wrap(copy.deepcopy(plain), ResidualBlock, compress=compress)
    return plain, model


class Poison(nn.Module):
    """Puts ``value`` at ``[0, 0]`` (out of place)."""

    def __init__(self, value: float):
        super().__init__()
        self.value = value

    def forward(self, x):
        mask = torch.zeros(x.shape, dtype=torch.bool, device=x.device)
        mask[0, 0] = True
        return torch.where(mask, torch.tensor(self.value, dtype=x.dtype, device=x.device), x)


class ZeroNonFinite(nn.Module):
    def forward(self, x):
        return torch.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0)


def poisoned(structure: str, value: float, compress, device="cpu") -> nn.Module:
    """Linear, Poison, then a recomputed part that keeps the poisoned tensor as its
    input: Linear, Tanh, ZeroNonFinite; then a last Linear. The output is finite
    (tanh(+-inf) = +-1, NaN zeroed), but backward multiplies the kept Inf by Tanh's
    zero slope, or differentiates Tanh at NaN: non-finite gradients."""
    torch.manual_seed(0)
    recomputed = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), ZeroNonFinite())
    layers = [nn.Linear(8, 8), Poison(value), *recomputed, nn.Linear(8, 2)]
    if structure == "sequential":
        return actsave.CheckpointedSequential(*layers, segments=[0, 2, 5], compress=compress).to(device)
    model = nn.Sequential(layers[0], layers[1], recomputed, layers[-1])
    return actsave.wrap(model, lambda module, fqn: fqn == "2", compress=compress).to(device)


# --- steps ---------------------------------------------------------------------------

def autocast_step(model, x, dtype=torch.bfloat16, seed=1):
    """Forward under autocast, backward outside it, as training loops do. Returns
    the output and the gradients of the input and of every parameter."""
    x = x.detach().clone().requires_grad_(True)
    torch.manual_seed(seed)
    with torch.autocast(x.device.type, dtype=dtype):
        out = model(x)
        loss = out.float().square().mean()
    loss.backward()
    return out.detach(), [x.grad] + [p.grad for p in model.parameters()]


def assert_same_step(plain, model, x, compress, dtype=torch.bfloat16):
    out_plain, grads_plain = autocast_step(plain, x, dtype)
    out, grads = autocast_step(model, x, dtype)
    assert out.dtype == out_plain.dtype == dtype
    assert torch.equal(out, out_plain)  # the forward is never lossy
    if compress is None:
        for i, (g, h) in enumerate(zip(grads, grads_plain)):
            assert torch.equal(g, h), f"gradient {i}"
    else:
        flat = [torch.cat([g.flatten().float() for g in gs]) for gs in (grads_plain, grads)]
        assert sqnr_db(*flat) >= INT8_SQNR_FLOOR_DB


# --- CPU -----------------------------------------------------------------------------

@pytest.mark.parametrize("compress", COMPRESS)
@pytest.mark.parametrize("structure", ["sequential", "wrapped"])
def test_bf16_autocast_step_equals_the_plain_models_step(structure, compress):
    plain, model = plain_and_actsave(structure, compress)
    assert_same_step(plain, model, torch.randn(6, 16), compress)


def test_bf16_autocast_step_through_a_nested_recompute_equals_the_plain_models_step():
    # Each pass of a segment recomputed in stages replays its range's autocast state,
    # and the stored ranges after a recomputed one get requires_grad as the forward had
    # it (runtime/nested.py): the chain's 13 layers as [0, 11) cut three levels deep.
    torch.manual_seed(0)
    plain = chain()
    model = actsave.CheckpointedSequential(*copy.deepcopy(plain))
    x = torch.randn(6, 16)
    stored = functools.partial(Range, recomputed=False)
    top = Range(0, 11, inner=(Range(0, 2), Range(2, 7, inner=(Range(2, 3), stored(3, 7))), stored(7, 11)))
    model.apply_plan(plans.predict(actsave.profile(model, (x,)), [0, 11], nested=[top]))
    assert_same_step(plain, model, x, compress=None)


@pytest.mark.parametrize("structure", ["sequential", "wrapped"])
def test_recompute_uses_the_forwards_autocast_state_not_the_backwards(structure):
    plain, model = plain_and_actsave(structure, None)
    grads = []
    for m in (plain, model):
        x = torch.randn(6, 16, generator=torch.Generator().manual_seed(0), requires_grad=True)
        torch.manual_seed(1)
        loss = m(x).square().mean()  # float32 forward
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss.backward()  # a bf16 recompute would change the gradients
        grads.append([x.grad] + [p.grad for p in m.parameters()])
    assert all(torch.equal(g, h) for g, h in zip(*grads))


class EntersAutocast(nn.Module):
    """Enters bf16 autocast for the layers after it, up to an ExitsAutocast."""

    def forward(self, x):
        self.context = torch.autocast("cpu", dtype=torch.bfloat16)
        self.context.__enter__()
        return x


class ExitsAutocast(nn.Module):
    def __init__(self, entered: EntersAutocast):
        super().__init__()
        self.__dict__["entered"] = entered  # not a submodule

    def forward(self, x):
        self.entered.context.__exit__(None, None, None)
        return x.float()


def _autocast_region_chain() -> list:
    torch.manual_seed(0)
    enters = EntersAutocast()
    return [nn.Linear(16, 16), nn.GELU(), enters, nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 16),
            ExitsAutocast(enters), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4)]


@pytest.mark.parametrize("segments", [[0, 4, 8], [0, 2, 4, 6, 8]])
def test_a_recompute_leaves_autocast_as_it_found_it_where_a_layer_enters_it_for_the_next_segments(segments):
    # The first segment's recompute enters autocast (its third layer) and leaves it open:
    # the casts it caches must not stay for the next step's forward, after the optimizer's.
    plain = nn.Sequential(*_autocast_region_chain())
    model = actsave.CheckpointedSequential(*_autocast_region_chain(), segments=segments)
    steps = []
    for m in (plain, model):
        optimizer, grads = torch.optim.SGD(m.parameters(), lr=0.1), []
        for step in range(3):
            optimizer.zero_grad()
            m(torch.randn(4, 16, generator=torch.Generator().manual_seed(step))).square().mean().backward()
            grads.append([p.grad.clone() for p in m.parameters()])
            optimizer.step()
        steps.append(grads)
    for step, (expected, got) in enumerate(zip(*steps)):
        assert all(torch.equal(a, b) for a, b in zip(expected, got)), step


@pytest.mark.parametrize("compress", COMPRESS)
@pytest.mark.parametrize("value", [math.inf, math.nan], ids=["inf", "nan"])
@pytest.mark.parametrize("structure", ["sequential", "wrapped"])
def test_non_finite_kept_activation_gives_non_finite_gradients(structure, value, compress):
    model = poisoned(structure, value, compress)
    out, grads = autocast_step(model, torch.randn(4, 8))
    assert torch.isfinite(out).all()  # so only the stored activation can carry it
    assert not all(torch.isfinite(g).all() for g in grads[1:])


def scaled_step_is_skipped(model: nn.Module, x: torch.Tensor, dtype: torch.dtype) -> bool:
    """One GradScaler step; True if it left the parameters alone and backed off."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler(x.device.type, init_scale=2.0**8)
    before = [p.detach().clone() for p in model.parameters()]
    with torch.autocast(x.device.type, dtype=dtype):
        loss = model(x).float().square().mean()
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    unchanged = all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    return unchanged and scaler.get_scale() == 2.0**7


@pytest.mark.parametrize("compress", COMPRESS)
def test_grad_scaler_skips_the_step_when_a_kept_activation_overflows(compress):
    model = poisoned("sequential", math.inf, compress)
    assert scaled_step_is_skipped(model, torch.randn(4, 8), torch.bfloat16)


# --- CUDA ----------------------------------------------------------------------------

@pytest.mark.cuda
@pytest.mark.parametrize("compress", COMPRESS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("structure", ["sequential", "wrapped"])
def test_cuda_autocast_step_equals_the_plain_models_step(structure, dtype, compress):
    plain, model = plain_and_actsave(structure, compress, device="cuda")
    assert_same_step(plain, model, torch.randn(6, 16, device="cuda"), compress, dtype)


@pytest.mark.cuda
@pytest.mark.parametrize("compress", COMPRESS)
@pytest.mark.parametrize("value", [math.inf, math.nan], ids=["inf", "nan"])
def test_cuda_fp16_grad_scaler_skips_the_step_on_a_non_finite_kept_activation(value, compress):
    model = poisoned("sequential", value, compress, device="cuda")
    assert scaled_step_is_skipped(model, torch.randn(4, 8, device="cuda"), torch.float16)


@pytest.mark.cuda
@pytest.mark.parametrize("compress", COMPRESS)
def test_cuda_fp16_grad_scaler_step_equals_the_plain_models_step(compress):
    """Finite case: the scaled, unscaled and applied step is the plain model's."""
    plain, model = plain_and_actsave("wrapped", compress, device="cuda")
    x = torch.randn(6, 16, device="cuda")
    updates = []
    for m in (plain, model):
        optimizer = torch.optim.SGD(m.parameters(), lr=0.1)
        scaler = torch.amp.GradScaler("cuda", init_scale=2.0**8)
        before = torch.cat([p.detach().flatten() for p in m.parameters()])
        torch.manual_seed(1)
        with torch.autocast("cuda", dtype=torch.float16):
            loss = m(x).float().square().mean()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        updates.append(torch.cat([p.detach().flatten() for p in m.parameters()]) - before)
    assert updates[0].abs().sum() > 0, "the scaler skipped a finite step"
    if compress is None:
        assert torch.equal(*updates)
    else:
        assert sqnr_db(*updates) >= INT8_SQNR_FLOOR_DB


# --- autocast's cache of casts (NOTE [ Casts autocast caches ] in runtime/replay.py) ---

def _linear_chain(width: int = 128, depth: int = 8) -> list:
    torch.manual_seed(0)
    layers = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.GELU()]
    return layers


def _square_mean(output: torch.Tensor) -> torch.Tensor:
    return output.float().square().mean()


def _autocast_step_peak(model: nn.Module, x: torch.Tensor, cache: bool, backward_inside: bool = False) -> int:
    """The activation peak of one bf16 autocast step (its forward in autocast, its
    backward outside it unless ``backward_inside``), parameters and gradients left out."""
    from actsave.planning.live_bytes import LiveBytes

    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    tracker = LiveBytes("cpu", known=[*model.parameters(), *(p.grad for p in model.parameters()), x])
    with tracker:
        with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=cache):
            loss = _square_mean(model(x))
            if backward_inside:
                loss.backward()
        if not backward_inside:
            loss.backward()
    return tracker.peak


def _autocast_grads(model: nn.Module, step, cache: bool = True) -> list:
    """The parameter gradients of ``step(model)`` run under bf16 autocast."""
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=cache):
        loss = step(model)
    loss.backward()
    return [p.grad for p in model.parameters()]


class _SharedAround(nn.Module):
    """One Linear used before and after a block (its cast made before the checkpoint and
    used after it), and one used by two calls of the block (a layer shared by several
    checkpoints, as ALBERT shares its layers)."""

    def __init__(self, wrap):
        super().__init__()
        torch.manual_seed(0)
        self.shared = nn.Linear(64, 64)
        self.block = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64))
        self.wrap = wrap

    def forward(self, x):
        h = self.shared(x)
        h = self.wrap(self.block, h)
        h = self.wrap(self.block, h)
        return _square_mean(self.shared(h))


@pytest.mark.parametrize("cache", [True, False])
def test_a_weight_whose_one_cast_serves_several_uses_gets_the_plain_steps_gradient(cache):
    """Every use of a weight in an autocast region shares one cast under the cache, its
    gradients adding up in bf16 before one conversion; a cast made again after a
    checkpoint would add them in float32: other bits (NOTE [ Casts autocast caches ])."""
    x = torch.randn(8, 64)
    expected = _autocast_grads(_SharedAround(lambda block, h: block(h)), lambda m: m(x), cache)
    for checkpointed in (actsave.checkpoint, lambda block, h: actsave.Checkpoint(block)(h),
                         lambda block, h: actsave.Checkpoint(block, keep="selective")(h)):
        grads = _autocast_grads(_SharedAround(checkpointed), lambda m: m(x), cache)
        assert all(torch.equal(a, b) for a, b in zip(expected, grads))


def test_a_profile_counts_the_casts_autocast_caches_for_each_layer():
    """A Linear's weight and bias cast to bf16 (saved or not: the first layer's weight is
    not saved, its input needing no gradient); none without autocast or its cache."""
    x = torch.randn(16, 128)
    cast = 2 * (128 * 128 + 128)
    for context, expected in ((torch.autocast("cpu", dtype=torch.bfloat16), [cast, 0] * 8),
                              (torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False), [0] * 16),
                              (contextlib.nullcontext(), [0] * 16)):
        with context:
            profile = actsave.profile(nn.Sequential(*_linear_chain()), (x,), loss=_square_mean)
        assert [layer.cached_cast_bytes for layer in profile.layers] == expected



class _AutocastLinear(nn.Linear):
    """A Linear that enters bf16 autocast itself."""

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return super().forward(x)


def test_a_layer_entering_autocast_itself_keeps_its_casts_where_a_region_is_open_around_it():
    """Only the outermost region's exit drops the cache: inside another (a disabled one,
    ``enabled=args.amp``), the layer's casts stay to that one's exit; alone, they go
    with its own."""
    x, cast = torch.randn(16, 128), 2 * (128 * 128 + 128)
    for around, expected in ((torch.autocast("cpu", enabled=False), [cast, 0] * 2),
                             (contextlib.nullcontext(), [0] * 4)):
        torch.manual_seed(0)
        layers = [_AutocastLinear(128, 128), nn.GELU(), _AutocastLinear(128, 128), nn.GELU()]
        with around:
            profile = actsave.profile(nn.Sequential(*layers), (x,), loss=_square_mean)
        assert [layer.cached_cast_bytes for layer in profile.layers] == expected

def test_a_plan_made_under_autocast_with_its_cache_fits_its_budget():
    """The cache holds a checkpointed segment's weight casts to the autocast region's
    end; the plan counts them as kept (on the safe side where the backward runs after
    the region, which drops them). Here they are most of the step's memory: counted as
    freed, a plan at 0.6x plain's peak measured 1.52x its budget, and at 0.95x 1.03x."""
    x = torch.randn(16, 128)
    plain = _autocast_step_peak(nn.Sequential(*_linear_chain()), x, cache=True)

    def planned(share):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return actsave.CheckpointedSequential(*_linear_chain(), segments="auto", budget=int(share * plain),
                                                  example_inputs=(x,), loss=_square_mean)
    assert _autocast_step_peak(planned(0.95), x, cache=True) <= 0.95 * plain
    with pytest.raises(actsave.ConfigError, match="no plan fits"):
        planned(0.6)  # below the casts every plan holds
