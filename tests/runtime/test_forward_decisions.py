"""The decisions a lossy forward keeps (runtime/forward_decisions.py): the warning for a
torch.utils.checkpoint inside one, whose recompute no decision kept here reaches, and
the parameters its saves view, which a recompute that took another path does not."""
import warnings

import pytest
import torch
import torch.utils.checkpoint as torch_checkpoint
from torch import nn

import actsave
from actsave.errors import RecomputeError
from actsave.runtime import forward_decisions


class InnerCheckpointed(nn.Module):
    """torchvision's memory-efficient DenseNet layer, in short: its bottleneck checkpointed by torch."""

    def __init__(self):
        super().__init__()
        self.bottleneck = nn.Sequential(nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 1))

    def forward(self, x):
        return x + torch_checkpoint.checkpoint(self.bottleneck, x, use_reentrant=False)


@pytest.mark.parametrize("keep, compress, warns", [("inputs", "int8", True), ("saves", "int8", True),
                                                   ("inputs", None, False)])
def test_a_torch_checkpoint_inside_a_lossy_one_warns_once(monkeypatch, keep, compress, warns):
    monkeypatch.setattr(forward_decisions, "_warned_torch_checkpoint", False)
    torch.manual_seed(0)
    model = actsave.wrap(nn.Sequential(InnerCheckpointed(), InnerCheckpointed()), InnerCheckpointed, keep=keep,
                         compress=compress)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            model(torch.randn(2, 8, 4, 4)).sum().backward()
    raised = [w for w in caught if "torch.utils.checkpoint runs inside a checkpoint" in str(w.message)]
    assert len(raised) == (1 if warns else 0)


class Halting(nn.Module):
    """One pass through ``a``, or two where ``h[0, 1] <= 10.2`` (adaptive computation),
    then ``b`` and ``c``, all of one shape."""

    def __init__(self, width):
        super().__init__()
        self.a, self.b, self.c = (nn.Linear(width, width) for _ in range(3))
        self.passes = []

    def forward(self, h):
        self.passes.append(1 if h[0, 1] > 10.2 else 2)
        for _ in range(self.passes[-1]):
            h = torch.tanh(self.a(h))
        return self.c(torch.tanh(self.b(h)))


def _halting_input():
    """One int8 group whose step is 1 (its largest magnitude 127): its 10.4 decodes to 10."""
    h = torch.zeros(1, actsave.codecs.GROUP_SIZE)
    h[0, :2] = torch.tensor([127.0, 10.4])
    return h


@pytest.mark.parametrize("entry", ["checkpoint", "chain", "autocast"])
def test_a_lossy_recompute_that_takes_a_longer_path_raises(entry):
    # The recompute made two passes where the forward made one, stopped at the
    # forward's last save, and b's and c's places held a's saves: every gradient at -8
    # to -2 dB, silently. A shorter path raised already (fewer saves).
    torch.manual_seed(0)
    block = Halting(actsave.codecs.GROUP_SIZE)
    h = _halting_input().requires_grad_()
    if entry == "checkpoint":
        y = actsave.checkpoint(block, h * 1, compress="int8")
    elif entry == "autocast":  # its saves are casts of the parameters, not views
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = actsave.checkpoint(block, h * 1, compress="int8")
    else:
        y = actsave.CheckpointedSequential(nn.Identity(), block, nn.Identity(), segments=[0, 1, 2],
                                           compress="int8")(h * 1)
    with pytest.raises(RecomputeError, match="took another path than its forward"):
        y.sum().backward()
    assert block.passes == [1, 2]


def test_an_exact_recompute_of_the_same_function_runs_as_plain():
    torch.manual_seed(0)
    block = Halting(actsave.codecs.GROUP_SIZE)
    h = _halting_input().requires_grad_()
    actsave.checkpoint(block, h * 1).sum().backward()
    assert block.passes == [1, 1] and h.grad is not None


def test_a_lossy_recompute_that_reads_a_parameter_otherwise_raises():
    # W where the forward read W.t(), both views of one parameter: -1.5 dB, silently.
    torch.manual_seed(0)
    weight = nn.Parameter(torch.randn(actsave.codecs.GROUP_SIZE, actsave.codecs.GROUP_SIZE))
    h = _halting_input().requires_grad_()
    y = actsave.checkpoint(lambda h: torch.tanh(h @ (weight.t() if h[0, 1] > 10.2 else weight)), h * 1,
                           compress="int8")
    with pytest.raises(RecomputeError, match="took another path than its forward"):
        y.sum().backward()


INPUTS_AND_LEAVES = {
    # A view of a parameter passed in: the codec stores it, the recompute reads its decoded copy.
    "a parameter's view as an input": lambda lin, h: actsave.checkpoint(
        lambda h, w: torch.relu(h @ w), h, lin.weight.t(), compress="int8"),
    # A leaf made inside the function: a new one at each call.
    "a leaf made inside": lambda lin, h: actsave.checkpoint(
        lambda h: torch.relu(h @ lin.weight.detach().requires_grad_().t()), h, compress="int8"),
}


@pytest.mark.parametrize("case", INPUTS_AND_LEAVES)
def test_inputs_and_leaves_made_inside_are_no_parameters_the_recompute_must_read_again(case):
    torch.manual_seed(0)
    lin, h = nn.Linear(16, 16), torch.randn(8, 16, requires_grad=True)
    INPUTS_AND_LEAVES[case](lin, h * 1).sum().backward()
    assert h.grad is not None and h.grad.isfinite().all()
