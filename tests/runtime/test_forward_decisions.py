"""The decisions a lossy forward keeps (runtime/forward_decisions.py): here, the warning
for a torch.utils.checkpoint inside one, whose recompute no decision kept here reaches."""
import warnings

import pytest
import torch
import torch.utils.checkpoint as torch_checkpoint
from torch import nn

import actsave
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
