"""One-bit ReLU decisions: packing, and correcting a recomputed output to them."""
from typing import Optional

import pytest
import torch
from torch import nn
from torch.nn.modules import module as module_globals

import actsave
from actsave.codecs import EXPECTED_GRADIENT_SQNR_DB, sqnr_db
from actsave.runtime.relu_signs import (InplaceRelus, is_relu_output, keeps_decisions, known_non_negative, pack_signs,
                                        restore_decisions_, unpack_signs)


def test_signs_round_trip_for_odd_sizes():
    y = torch.relu(torch.randn(3, 7, 5))
    bits = pack_signs(y)
    assert bits.dtype == torch.uint8 and bits.numel() == -(-y.numel() // 8)
    assert torch.equal(unpack_signs(bits, y), y > 0)


def test_nan_counts_as_passing_as_in_threshold_backward():
    y = torch.tensor([0.0, float("nan"), 1.0])
    assert unpack_signs(pack_signs(y), y).tolist() == [False, True, True]


def test_restore_makes_the_recompute_decide_as_the_forward():
    forward = torch.tensor([0.0, 0.5, 1e-3, 0.0, float("nan")])
    recomputed = torch.tensor([2e-3, 0.49, 0.0, 0.0, float("nan")])
    restore_decisions_(recomputed, pack_signs(forward))
    assert recomputed[0] == 0 and recomputed[1] == 0.49 and recomputed[3] == 0
    assert recomputed[2] == torch.finfo(torch.float32).tiny
    assert recomputed[4].isnan()
    assert torch.equal(recomputed > 0, forward > 0)


def test_only_relu_outputs_are_recognised():
    x = torch.randn(4, requires_grad=True)
    assert is_relu_output(torch.relu(x)) and is_relu_output(torch.relu_(x * 1))
    assert not is_relu_output(torch.nn.functional.leaky_relu(x)) and not is_relu_output(x)


# --- an in-place ReLU on a view -------------------------------------------------------


def saves_through_a_view(relus: InplaceRelus, relu: nn.Module, make_view) -> tuple:
    """A Linear, a view of its output, ``relu`` and a Linear, run while ``relus``
    watch: ``(the view, whether each save of it is a ReLU output, whether each other
    save is)``, as the pack hook sees them."""
    torch.manual_seed(0)
    saves = []
    x = torch.randn(4, 8, requires_grad=True)
    hooks = torch.autograd.graph.saved_tensors_hooks(lambda t: saves.append((t, is_relu_output(t))) or t, lambda t: t)
    with relus.watching(), hooks:
        h = make_view(nn.Linear(8, 8)(x))
        nn.Linear(8, 2)(relu(h))
    return h, [known for t, known in saves if t is h], [known for t, known in saves if t is not h]


@pytest.mark.parametrize("make_view", [lambda h: h.view(h.shape), lambda h: h[:, :], lambda h: h.unsqueeze(0)],
                         ids=["view", "slice", "unsqueeze"])
def test_in_place_relu_module_on_a_view_makes_a_relu_output(make_view):
    # The view's autograd node after the in-place ReLU does not say ReLU (NOTE [ In-place
    # ReLUs on views ]): the watch knows it, at its saves and after.
    h, of_view, others = saves_through_a_view(InplaceRelus.among(None), nn.ReLU(inplace=True), make_view)
    assert h._is_view() and of_view and all(of_view) and not any(others)  # the ReLU's save, the Linear's
    assert is_relu_output(h) and known_non_negative(h) and keeps_decisions(h, {})


def test_a_watch_of_known_layers_sees_only_their_relus():
    relu = nn.ReLU(inplace=True)
    view = lambda h: h.view(h.shape)  # noqa: E731
    assert saves_through_a_view(InplaceRelus.among([(0, relu)]), relu, view)[1] == [True, True]
    assert saves_through_a_view(InplaceRelus.among([(0, nn.ReLU(inplace=True))]), relu, view)[1] == [False, False]


def test_a_view_changed_in_place_after_its_relu_is_no_longer_known():
    h = saves_through_a_view(InplaceRelus.among(None), nn.ReLU(inplace=True), lambda h: h.view(h.shape))[0]
    h.sub_(1)  # negative values now: its version moved
    assert not is_relu_output(h) and not known_non_negative(h)


@pytest.mark.parametrize("layer", [nn.Tanh(), nn.ReLU6(inplace=True), nn.ReLU()], ids=["tanh", "relu6", "relu"])
def test_other_layers_on_a_view_make_no_relu_output_of_it(layer):
    # Out of place, nn.ReLU's output is a new tensor, known by its node; the view is not it.
    h, of_view, _ = saves_through_a_view(InplaceRelus.among(None), layer, lambda h: h[:, :])
    assert not any(of_view) and not is_relu_output(h)


def relu_blocks_on_views(inplace: bool) -> nn.Sequential:
    # On a 3-D input each Linear's output is a view, so an in-place ReLU changes a view.
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.ReLU(inplace=inplace)) for _ in range(6)])


class CheckpointedFunction(nn.Module):
    """The blocks checkpointed as a plain callable: no known layers, so global hooks watch."""

    def __init__(self, blocks: nn.Module, codec: str):
        super().__init__()
        self.blocks, self.codec = blocks, codec

    def forward(self, x):
        return actsave.checkpoint(lambda y: self.blocks(y), x, compress=self.codec)


WRAPPERS = {
    "segments": lambda blocks, codec: actsave.CheckpointedSequential(*blocks, segments=[0, 2, 4], compress=codec),
    "inputs": lambda blocks, codec: actsave.Checkpoint(blocks, keep="inputs", compress=codec),
    "saves": lambda blocks, codec: actsave.Checkpoint(blocks, keep="saves", compress=codec),
    "function": CheckpointedFunction,
}


def gradients_through_views(inplace: bool, wrapper: str, codec: Optional[str]) -> list:
    """The input's and the weights' gradients of the blocks on an activation (not the
    batch, which a codec keeps by reference), plain where ``codec`` is None."""
    blocks = relu_blocks_on_views(inplace)
    model = blocks if codec is None else WRAPPERS[wrapper](blocks, codec)
    torch.manual_seed(1)
    x = torch.randn(8, 32, 64, requires_grad=True)
    model(x * 1.0).backward(torch.randn(8, 32, 64))
    return [x.grad] + [p.grad for p in blocks.parameters() if p.dim() == 2]


@pytest.mark.parametrize("codec", ["int8", "fp8_e4m3"])
@pytest.mark.parametrize("wrapper", WRAPPERS)
def test_in_place_relu_on_views_keeps_the_decisions_of_the_out_of_place_one(wrapper, codec):
    # Its decisions are kept and its outputs stored on the unsigned grid, as an
    # out-of-place ReLU's: the same gradients, at the codec's floor (NOTE [ In-place
    # ReLUs on views ]). Without them the recompute's flips put int8 near 20 dB.
    plain = gradients_through_views(True, wrapper, None)
    got, want = gradients_through_views(True, wrapper, codec), gradients_through_views(False, wrapper, codec)
    assert min(sqnr_db(p, g) for p, g in zip(plain, got)) >= EXPECTED_GRADIENT_SQNR_DB[codec]
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_only_a_lossy_forward_hooks_in_place_relus_and_only_those_among_its_layers():
    # Each hook sends its module's calls down _call_impl's slow path: none in exact
    # modes, none in a recompute (it restores by placeholder), none global.
    seen = []

    class Probe(nn.Module):
        def forward(self, x):
            seen.append(sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in blocks.modules())
                        + len(module_globals._global_forward_pre_hooks) + len(module_globals._global_forward_hooks))
            return x

    blocks = nn.Sequential(nn.Linear(4, 4), nn.ReLU(inplace=True), Probe(), nn.ReLU(), nn.Linear(4, 4))
    x = torch.randn(2, 3, 4, requires_grad=True)
    hooks = {}
    for name, model in {"exact": actsave.Checkpoint(blocks), "exact chain": actsave.CheckpointedSequential(
            *blocks, segments=[0, 4]), "int8": actsave.Checkpoint(blocks, keep="inputs", compress="int8")}.items():
        seen.clear()
        model(x * 1.0).sum().backward()
        hooks[name] = list(seen)
    assert hooks == {"exact": [0, 0], "exact chain": [0, 0], "int8": [2, 0]}  # forward, recompute


# --- an in-place ReLU at a segment start ------------------------------------------


def conv_bn_relu_chain(inplace: bool, blocks: int = 3) -> list:
    torch.manual_seed(0)
    layers = [nn.Conv2d(3, 4, 3, padding=1)]
    for _ in range(blocks):
        layers += [nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(inplace=inplace)]
    return layers + [nn.Flatten(), nn.Linear(4 * 6 * 6, 3)]


def lossy_gradients(inplace: bool, segments: list, codec: str) -> list:
    model = actsave.CheckpointedSequential(*conv_bn_relu_chain(inplace), segments=segments, compress=codec)
    torch.manual_seed(1)
    model(torch.randn(8, 3, 6, 6)).square().mean().backward()
    return [p.grad for p in model.parameters()]


@pytest.mark.parametrize("codec", ["int8", "fp8_e4m3"])
@pytest.mark.parametrize("start", range(1, len(conv_bn_relu_chain(False))))
def test_in_place_relu_chain_has_the_fidelity_of_the_out_of_place_one(start, codec):
    # The same decisions are kept wherever a boundary falls, on a ReLU included, so
    # the gradients are the same bits.
    segments = [0, start]
    for got, want in zip(lossy_gradients(True, segments, codec), lossy_gradients(False, segments, codec)):
        assert torch.equal(got, want)


# --- the fused kernels (triton_kernels/decisions/relu_signs.py) -----------------------


def test_forced_triton_keeps_the_same_decisions_in_one_launch_each(monkeypatch):
    # Under the interpreter on CPU: the kernels' bits are the references', so the
    # gradients are the same bits; each packing and each restore is one launch.
    from actsave.runtime import relu_signs
    from actsave.triton_kernels import _launch

    calls, launched = [], []
    for name in ("pack_signs", "restore_decisions_"):
        real_call = getattr(relu_signs, name)
        monkeypatch.setattr(relu_signs, name, lambda *a, _name=name, _real=real_call: calls.append(_name)
                            or _real(*a))
    real = _launch.launch
    monkeypatch.setattr(_launch, "launch", lambda kernel, *a, **k: launched.append(_launch.kernel_name(kernel))
                        or real(kernel, *a, **k))
    grads = {}
    for name in ("torch", "triton"):
        with actsave.set_backend(name):
            grads[name] = lossy_gradients(False, [0, 4, 7], "int8")
    assert all(torch.equal(a, b) for a, b in zip(grads["torch"], grads["triton"]))
    # The first segment keeps the batch by reference: its recompute is exact. The
    # second's ReLU packs its decisions; the last segment's saves are stored with theirs
    # by the encoder (NOTE [ Signs from the encoder's read ]), its ReLU output restored
    # as each of its two saves (the ReLU's, the Linear's view) is decoded.
    packs, restores = calls.count("pack_signs") // 2, calls.count("restore_decisions_") // 2
    assert (packs, restores) == (1, 3)
    assert launched.count("_pack_relu_signs_kernel") == packs
    assert launched.count("_restore_relu_signs_kernel") == restores


@pytest.mark.parametrize("codec", ["int8", "fp8_e4m3"])
def test_a_kept_relu_save_is_encoded_with_its_decisions_in_one_launch(codec, monkeypatch):
    # A call kept instead of recomputed (keep="saves") stores each ReLU output it made
    # with its decisions: one encoder launch gives codes and bits (NOTE [ Signs from the
    # encoder's read ]), no pack of their own; the gradients are the torch references'.
    from actsave.triton_kernels import _launch

    launched = []
    real = _launch.launch
    monkeypatch.setattr(_launch, "launch", lambda kernel, *a, **k: launched.append((_launch.kernel_name(kernel),
                                                                                     k.get("SIGNS")))
                        or real(kernel, *a, **k))

    def gradients():
        block = actsave.Checkpoint(nn.Sequential(*conv_bn_relu_chain(False)[:-2]), keep="saves", compress=codec)
        block(torch.randn(2, 3, 6, 6, generator=torch.Generator().manual_seed(1))).square().mean().backward()
        return [p.grad for p in block.parameters()]

    with actsave.set_backend("triton"):
        by_kernels = gradients()
    assert all(torch.equal(a, b) for a, b in zip(by_kernels, gradients()))
    encoder = "_encode_int8_kernel" if codec == "int8" else "_encode_fp8_kernel"
    assert launched.count((encoder, True)) == 3  # the three ReLU outputs
    # Each save decoded is restored: the first two outputs are saved by their ReLU and the next conv.
    assert launched.count(("_restore_relu_signs_kernel", None)) == 5
    assert not [kernel for kernel, _ in launched if kernel == "_pack_relu_signs_kernel"]


def test_an_in_place_relu_with_a_forward_set_on_it_is_not_watched():
    # Its output is no ReLU's (here tanh_'s): ReLU decisions would zero its negatives.
    torch.manual_seed(0)
    act = nn.ReLU(inplace=True)
    act.forward = torch.Tensor.tanh_
    plain = nn.Sequential(nn.Linear(16, 32), act, nn.Linear(32, 4))
    x = torch.randn(8, 16, requires_grad=True)
    grads = []
    for run in (plain, lambda h: actsave.checkpoint(plain, h, compress="int8")):
        plain.zero_grad()
        run(x * 1.0).square().sum().backward()
        grads.append(plain[0].weight.grad.clone())
    assert sqnr_db(grads[0], grads[1]) > 30


def test_an_in_place_relu_behind_a_pass_through_wrapper_keeps_its_decisions():
    # accelerate's hooks and profilers set such a forward on every module; the chain
    # must then run exactly as it does with bare ReLUs, kept decisions included.
    import functools
    torch.manual_seed(0)
    linears = [nn.Linear(32, 32) for _ in range(3)]
    bare, wrapped = [], []
    for linear in linears:
        relu = nn.ReLU(inplace=True)
        relu.forward = functools.wraps(relu.forward)(lambda *args, _inner=relu.forward: _inner(*args))
        bare += [linear, nn.ReLU(inplace=True)]
        wrapped += [linear, relu]
    x = torch.randn(4, 16, 32)  # 3-D: each Linear's output is a view
    grads = []
    for layers in (bare, wrapped):
        for linear in linears:
            linear.zero_grad()
        actsave.CheckpointedSequential(*layers, segments=3, compress="int8")(x).square().sum().backward()
        grads.append(torch.cat([p.grad.flatten() for p in (q for m in linears for q in m.parameters())]))
    assert torch.equal(grads[0], grads[1])
