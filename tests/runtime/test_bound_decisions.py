"""Hardtanh (ReLU6) and LeakyReLU decisions under a lossy codec: NOTE [ Bound
decisions ] in runtime/bound_decisions.py."""
import copy
import math

import pytest
import torch
from support import peak_activation_bytes, sqnr_db
from torch import nn

import actsave
from actsave.codecs import EXPECTED_GRADIENT_SQNR_DB, get_codec
from actsave.planning import plans
from actsave.runtime import bound_decisions, relu_signs
from actsave.runtime.bound_decisions import Bounds


def _inside(v, bounds):
    return (v > bounds.low) & (v < bounds.high) if math.isfinite(bounds.high) else v > bounds.low


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bounds", [Bounds(0.0, 6.0), Bounds(-1.0, 1.0), Bounds(0.0, math.inf)],
                         ids=["relu6", "hardtanh", "leaky"])
def test_a_restore_gives_back_the_forwards_decisions_and_moves_no_other_element(bounds, dtype):
    torch.manual_seed(0)
    forward = (torch.randn(1001) * 4).to(dtype)
    forward[:16] = bounds.low
    if math.isfinite(bounds.high):
        forward[16:32] = bounds.high
    forward[32] = float("nan")
    recomputed = forward + (torch.randn(1001) * 0.05).to(dtype)
    recomputed[40:48] = bounds.low
    agreed = _inside(recomputed, bounds) == _inside(forward, bounds)
    assert not agreed.all()
    before = recomputed.clone()
    bound_decisions.restore_(recomputed, bound_decisions.keep(forward, bounds), bounds)
    assert torch.equal(_inside(recomputed, bounds), _inside(forward, bounds))
    torch.testing.assert_close(recomputed[agreed], before[agreed], rtol=0, atol=0, equal_nan=True)


def _stack(activation):
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Sequential(nn.Conv2d(16, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), activation(),
                                      nn.Conv2d(16, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), activation())

        def forward(self, x):
            return self.body(x)

    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), *[Block() for _ in range(4)]), Block


ACTIVATIONS = {"ReLU6": lambda: nn.ReLU6(inplace=True), "Hardtanh": lambda: nn.Hardtanh(0.0, 6.0),
               "LeakyReLU": lambda: nn.LeakyReLU(0.1, inplace=True), "LeakyReLU out of place": nn.LeakyReLU,
               "signed Hardtanh": lambda: nn.Hardtanh(-1.0, 1.0)}


def _worst_gradient_sqnr(activation, codec: str, keep: str) -> float:
    plain, block = _stack(activation)
    model = actsave.wrap(copy.deepcopy(plain), block, keep=keep, compress=codec)
    x = torch.randn(8, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    for m in (plain, model):
        m(x).square().mean().backward()
    assert actsave.kept_bytes() == {"device": 0, "host": 0}
    return min(sqnr_db(p.grad, q.grad) for p, q in zip(plain.parameters(), model.parameters()))


@pytest.mark.parametrize("keep", ["inputs", "saves"])
@pytest.mark.parametrize("codec", ["int8", "fp8_e4m3"])
@pytest.mark.parametrize("activation", ["ReLU6", "Hardtanh"])
def test_a_lossy_block_of_clamping_activations_keeps_its_gradients_above_the_codecs_floor(activation, codec, keep):
    # Without the decisions: 11-16 dB under int8, 6 under e4m3 (a BatchNorm puts much
    # of the mass at 0, where a recompute or a decoded save decides again).
    assert _worst_gradient_sqnr(ACTIVATIONS[activation], codec, keep) >= EXPECTED_GRADIENT_SQNR_DB[
        get_codec(codec).name]


@pytest.mark.parametrize("keep", ["inputs", "saves"])
@pytest.mark.parametrize("codec", ["int8", "fp8_e4m3"])
@pytest.mark.parametrize("activation", ["LeakyReLU", "LeakyReLU out of place", "signed Hardtanh"])
def test_a_lossy_block_of_signed_clamps_keeps_its_gradients_as_a_smooth_activations(activation, codec, keep):
    # Their kept inputs are signed, as a GELU's are: within a few dB of the same stack
    # with GELU (LeakyReLU without the decisions: 2-12 dB, 20 below it).
    smooth = _worst_gradient_sqnr(nn.GELU, codec, keep)
    assert _worst_gradient_sqnr(ACTIVATIONS[activation], codec, keep) >= smooth - 5.0


SLOPE_CHANGES = {"PReLU": lambda: nn.PReLU(16), "Threshold": lambda: nn.Threshold(0.1, 0.0),
                 "ELU": lambda: nn.ELU(0.5), "SELU": nn.SELU}


@pytest.mark.parametrize("keep", ["inputs", "saves"])
@pytest.mark.parametrize("activation", SLOPE_CHANGES)
def test_activations_whose_slope_changes_at_a_bound_keep_their_gradients_as_a_smooth_activations(activation, keep):
    # Without their decisions, int8: 9.8-17.3 dB under keep="inputs", 11.3-15.7 under
    # "saves", where the same stack with GELU gives 27.1 and 33.2.
    smooth = _worst_gradient_sqnr(nn.GELU, "int8", keep)
    assert _worst_gradient_sqnr(SLOPE_CHANGES[activation], "int8", keep) >= smooth - 5.0


def test_a_hardsigmoid_keeps_a_bit_per_element_as_a_hardtanh_between_its_bounds_does():
    # Its backward passes (a slope of 1/6) strictly between -3 and 3.
    kept = {}
    for name, activation in (("Hardsigmoid", nn.Hardsigmoid), ("Hardtanh", lambda: nn.Hardtanh(-3.0, 3.0)),
                             ("GELU", nn.GELU)):
        plain, block = _stack(activation)
        model = actsave.wrap(plain, block, keep="saves", compress="fp8_e4m3")
        out = model(torch.randn(2, 3, 8, 8))
        kept[name] = actsave.kept_bytes()["device"]
        del out
    assert kept["Hardsigmoid"] == kept["Hardtanh"] > kept["GELU"]


def test_a_relu6_output_is_stored_on_the_unsigned_grid_and_a_hardtanhs_below_0_is_not():
    x = torch.randn(4, 8, requires_grad=True) * 1
    assert relu_signs.known_non_negative(nn.ReLU6(inplace=True)(x * 1))
    assert relu_signs.known_non_negative(nn.Hardtanh(0.5, 2.0)(x))
    assert not relu_signs.known_non_negative(nn.Hardtanh(-1.0, 1.0)(x))


def test_a_relu6_keeps_what_a_relu_keeps():
    # Its block's input on the unsigned grid, one bit per element of its save.
    kept = {}
    for name, activation in (("ReLU", lambda: nn.ReLU(inplace=True)), ("ReLU6", ACTIVATIONS["ReLU6"])):
        plain, block = _stack(activation)
        model = actsave.wrap(plain, block, compress="int8")
        out = model(torch.randn(2, 3, 8, 8))
        kept[name] = actsave.kept_bytes()["device"]
        del out
    assert kept["ReLU6"] == kept["ReLU"] > 0


@pytest.mark.parametrize("activation", ["ReLU6", "LeakyReLU"])
def test_a_lossy_chain_of_bounded_activations_measures_at_most_its_prediction(activation):
    # The bits and the restore's transient are priced as the runtime keeps and makes them.
    torch.manual_seed(0)
    layers = [nn.Conv2d(3, 16, 3, padding=1)]
    for _ in range(6):
        layers += [nn.Conv2d(16, 16, 3, padding=1), nn.BatchNorm2d(16), ACTIVATIONS[activation]()]
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10)]
    x = torch.randn(4, 3, 16, 16)
    starts, codecs = [0, 4, 7, 10, 13], ["int8"] * 4
    planned = actsave.CheckpointedSequential(*copy.deepcopy(layers))
    plan = plans.predict(actsave.profile(planned, (x,)), starts, codecs=codecs)
    planned.apply_plan(plan)
    assert peak_activation_bytes(planned, x) <= plan.predicted_peak_bytes
    balanced = actsave.CheckpointedSequential(*layers, compress="int8")
    assert peak_activation_bytes(balanced, x) <= balanced.balanced_plan.predicted_peak_bytes


class _Scaled(nn.ReLU6):
    """A ReLU6 whose own forward scales its input first, by a parameter (a save)."""

    def __init__(self):
        super().__init__()
        self.gain = nn.Parameter(torch.tensor(1.5))

    def forward(self, x):
        return super().forward(x * self.gain)


def _prehooked():
    relu6 = nn.ReLU6()
    relu6.gain = nn.Parameter(torch.tensor(1.5))
    relu6.register_forward_pre_hook(lambda module, args: (args[0] * module.gain,))  # saves before the ReLU6
    return relu6


class _ScaledInForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.gain, self.relu6 = nn.Parameter(torch.tensor(1.5)), nn.ReLU6()

    def forward(self, x):
        return self.relu6(x * self.gain)


def _gradients(activation, keep: str) -> list:
    plain, block = _stack(activation)
    model = actsave.wrap(plain, block, keep=keep, compress="int8")
    model(torch.randn(8, 3, 16, 16, generator=torch.Generator().manual_seed(1))).square().mean().backward()
    return [p.grad for p in model.parameters()]


@pytest.mark.parametrize("keep", ["inputs", "saves"])
@pytest.mark.parametrize("activation", [_Scaled, _prehooked], ids=["subclass", "pre-hook"])
def test_the_decisions_are_the_clamps_own_however_the_module_calls_it(activation, keep):
    # The same math with the scale written in the block: the same bits, the same
    # gradients (the module's first save was the scale's: 11-16 dB).
    expected = _gradients(_ScaledInForward, keep)
    assert all(torch.equal(g, e) for g, e in zip(_gradients(activation, keep), expected))


class _Mlp(nn.Module):
    def __init__(self, activation):
        super().__init__()
        self.up, self.act, self.down = nn.Linear(32, 128), activation(), nn.Linear(128, 32)

    def forward(self, x):
        return x + self.down(self.act(self.up(x)))


@pytest.mark.parametrize("keep", ["inputs", "selective", "saves"])
@pytest.mark.parametrize("activation", ["ReLU6", "LeakyReLU out of place", "Hardtanh"])
def test_a_clamp_that_saves_a_selectively_kept_output_decides_as_the_forward(activation, keep):
    # Selective keeps the Linear's output, which the clamp saves as its input: decoded,
    # it decided again (19-21 dB); now that Linear runs again where the bits restore it.
    torch.manual_seed(0)
    plain = nn.Sequential(*[_Mlp(ACTIVATIONS[activation]) for _ in range(2)])
    model = actsave.wrap(copy.deepcopy(plain), _Mlp, keep=keep, compress="int8")
    x = torch.randn(4, 16, 32, generator=torch.Generator().manual_seed(1)) * 3
    for m in (plain, model):
        m(x).square().mean().backward()
    worst = min(sqnr_db(p.grad, q.grad) for p, q in zip(plain.parameters(), model.parameters()))
    assert worst >= EXPECTED_GRADIENT_SQNR_DB["int8"]


@pytest.mark.parametrize("keep", ["inputs", "saves"])
def test_a_save_in_another_layout_keeps_and_restores_its_decisions(keep):
    # channels_last: the restore works on the save's own layout (a flat view of it raised).
    x = torch.randn(8, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    worst = {}
    for layout in (torch.contiguous_format, torch.channels_last):
        plain, block = _stack(ACTIVATIONS["ReLU6"])
        plain = plain.to(memory_format=layout)
        model = actsave.wrap(copy.deepcopy(plain), block, keep=keep, compress="int8")
        for m in (plain, model):
            m(x.to(memory_format=layout)).square().mean().backward()
        worst[layout] = min(sqnr_db(p.grad, q.grad) for p, q in zip(plain.parameters(), model.parameters()))
    assert worst[torch.channels_last] >= worst[torch.contiguous_format] - 3.0


class _SideFirst(nn.Module):
    """A conv saves ``h`` before the clamp does (the order written decides it)."""

    def __init__(self, activation, side_first: bool):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(16, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16)  # no bias: BN drops it
        self.side = nn.Conv2d(16, 16, 1)
        self.act, self.side_first = activation(), side_first

    def forward(self, x):
        h = self.bn(self.conv(x))
        if self.side_first:
            side = self.side(h)
            return side + self.act(h)
        return self.act(h) + self.side(h)


@pytest.mark.parametrize("activation", ["Hardtanh", "signed Hardtanh", "LeakyReLU out of place"])
def test_a_clamp_keeps_its_decisions_where_another_op_saved_its_input_first(activation):
    # The stored copy is made at the conv's save; the clamp's save shares it and must
    # add its bits to it, so either order gives the same fidelity.
    worst = {}
    for side_first in (False, True):
        torch.manual_seed(0)
        plain = nn.Sequential(*[_SideFirst(ACTIVATIONS[activation], side_first) for _ in range(3)])
        model = actsave.wrap(copy.deepcopy(plain), _SideFirst, keep="saves", compress="int8")
        x = torch.randn(8, 16, 8, 8, generator=torch.Generator().manual_seed(1))
        for m in (plain, model):
            m(x).square().mean().backward()
        worst[side_first] = min(sqnr_db(p.grad, q.grad) for p, q in zip(plain.parameters(), model.parameters()))
    assert worst[True] >= worst[False] - 1.0


def test_bits_kept_on_a_copy_another_op_stored_first_are_priced():
    # One segment whose saves int8 keeps (without: 2 KiB, 0.6%, over the prediction).
    torch.manual_seed(0)
    model = actsave.CheckpointedSequential(*[_SideFirst(ACTIVATIONS["signed Hardtanh"], True) for _ in range(3)])
    x = torch.randn(8, 16, 8, 8)
    plan = plans.predict(actsave.profile(model, (x,)), [0], saves_codec="int8")
    model.apply_plan(plan)
    assert peak_activation_bytes(model, x) <= plan.predicted_peak_bytes


@pytest.mark.parametrize("keep", ["inputs", "saves"])
def test_forced_triton_keeps_and_restores_each_clamps_decisions_in_one_launch_each(keep, monkeypatch):
    # Under the interpreter on CPU: gradients bit-identical to the torch references';
    # each ReLU6 call (2 per block, 4 blocks) packs its save's decisions in one launch
    # in the forward and restores them in one after its recompute or decode.
    from actsave.triton_kernels import _launch

    launched = []
    real = _launch.launch
    monkeypatch.setattr(_launch, "launch", lambda kernel, *a, **k: launched.append(_launch.kernel_name(kernel))
                        or real(kernel, *a, **k))

    def gradients():
        plain, block = _stack(ACTIVATIONS["ReLU6"])
        model = actsave.wrap(plain, block, keep=keep, compress="int8")
        model(torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(1))).square().mean().backward()
        return [p.grad for p in model.parameters()]

    with actsave.set_backend("triton"):
        by_kernels = gradients()
    assert all(torch.equal(a, b) for a, b in zip(by_kernels, gradients()))
    assert [launched.count(kernel) for kernel in ("_pack_bounds_kernel", "_restore_bounds_kernel")] == [8, 8]


def test_a_watch_whose_pushes_fail_part_way_leaves_every_clamp_untapped(monkeypatch):
    # The watch pushes a handler on each clamp's tap as it opens; one that raises part
    # way must leave the taps pushed before it popped, and itself nothing to pop.
    import torch.nn.functional as F

    from actsave._taps import CLAMPS
    from actsave.runtime.bound_decisions import BoundWatch

    originals = {name: getattr(F, name) for name in CLAMPS}
    failing = CLAMPS["threshold"]._swap

    def refuse():
        raise RuntimeError("swap refused")

    monkeypatch.setattr(failing, "open", refuse)
    with pytest.raises(RuntimeError, match="swap refused"):
        with BoundWatch().watching():
            pass
    assert {name: getattr(F, name) for name in CLAMPS} == originals
    assert all(not tap._stack() for tap in CLAMPS.values())
