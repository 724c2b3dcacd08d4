"""One-bit ReLU decisions: packing, and correcting a recomputed output to them."""
import pytest
import torch
from torch import nn

import actsave
from actsave.runtime.relu_signs import is_relu_output, pack_signs, restore_decisions_, unpack_signs


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
    packs, restores = calls.count("pack_signs") // 2, calls.count("restore_decisions_") // 2
    assert packs >= 2 and restores >= 2
    assert launched.count("_pack_relu_signs_kernel") == packs
    assert launched.count("_restore_relu_signs_kernel") == restores
