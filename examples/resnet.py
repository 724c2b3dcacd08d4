"""A deep pre-activation bottleneck ResNet for 32x32 images, as a flat list of layers.

He et al. 2016, "Identity Mappings in Deep Residual Networks": depth = 9n + 2 (29,
164, 1001, ...), three stages of n bottleneck blocks. Each block is one module with
its skip connection inside, so the list drops into ``nn.Sequential`` or
``actsave.CheckpointedSequential`` and a segment can start at any block. The examples
import it; bench/models.py holds the same model for the benchmarks.
"""
import torch.nn.functional as F
from torch import nn

WIDTHS = (16, 32, 64)  # bottleneck widths of the three stages; blocks output 4x these
EXPANSION = 4


class PreActBottleneck(nn.Module):
    """BN-ReLU-conv1x1, BN-ReLU-conv3x3 (stride), BN-ReLU-conv1x1, plus the skip."""

    def __init__(self, in_channels: int, width: int, stride: int = 1):
        super().__init__()
        out_channels = width * EXPANSION
        self.bn1, self.conv1 = nn.BatchNorm2d(in_channels), nn.Conv2d(in_channels, width, 1, bias=False)
        self.bn2, self.conv2 = nn.BatchNorm2d(width), nn.Conv2d(width, width, 3, stride, 1, bias=False)
        self.bn3, self.conv3 = nn.BatchNorm2d(width), nn.Conv2d(width, out_channels, 1, bias=False)
        self.projection = None
        if stride != 1 or in_channels != out_channels:
            self.projection = nn.Conv2d(in_channels, out_channels, 1, stride, bias=False)

    def forward(self, x):
        pre = F.relu(self.bn1(x))
        skip = x if self.projection is None else self.projection(pre)
        out = self.conv1(pre)
        out = self.conv2(F.relu(self.bn2(out)))
        out = self.conv3(F.relu(self.bn3(out)))
        return out + skip


def preact_resnet(depth: int, num_classes: int = 10) -> list:
    """The layers of ResNet-``depth``: stem conv, 3n blocks, BN, ReLU, pool, linear."""
    if depth < 11 or (depth - 2) % 9:
        raise ValueError(f"a bottleneck ResNet has depth 9n + 2 (29, 164, 1001, ...), got {depth}")
    n = (depth - 2) // 9
    layers, channels = [nn.Conv2d(3, WIDTHS[0], 3, padding=1, bias=False)], WIDTHS[0]
    for stage, width in enumerate(WIDTHS):
        for i in range(n):
            layers.append(PreActBottleneck(channels, width, stride=2 if stage and i == 0 else 1))
            channels = width * EXPANSION
    return layers + [nn.BatchNorm2d(channels), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                     nn.Linear(channels, num_classes)]
