"""One-bit ReLU decisions: packing, and correcting a recomputed output to them."""
import torch

from actsave.relu_signs import is_relu_output, pack_signs, restore_decisions_, unpack_signs


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
