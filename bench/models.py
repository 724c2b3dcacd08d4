"""Deep models for the benchmarks, each a FLAT ``nn.Sequential``.

Flat means every residual block is one child module with its skip connection
inside, so the chain drops into ``actsave.CheckpointedSequential`` (or
``torch.utils.checkpoint.checkpoint_sequential``) and segments can start at any
block. No torchvision: the builders are small and the layouts are those of the
papers.

- ``cifar_resnet(depth)``: pre-activation bottleneck ResNet for 32x32 inputs
  (He et al. 2016, "Identity Mappings in Deep Residual Networks"), depth = 9n + 2
  (164, 1001, 2000, ...): three stages of n bottleneck blocks.
- ``conv_bn_relu_chain(blocks)``: ``blocks`` x (conv3x3, BatchNorm, in-place ReLU)
  at one width and resolution, then a linear head: no skip connections, so every
  ReLU decision shapes the gradient of all that precedes it (the gradient-fidelity
  stress case: BatchNorm in training mode puts much pre-activation mass near zero).
- ``pooled_resnet(blocks_per_stage)``: torchvision's layout with max pooling: a
  conv-BN-ReLU-MaxPool(3, 2, 1) stem, then stages of post-activation basic blocks
  with a MaxPool(3, 2, 1) between stages (where torchvision strides a conv), so a
  max pool's window decisions sit inside the chain (the MaxPool fidelity case).
- ``gpt(depth)``: GPT-style decoder: token + position embedding, ``depth`` pre-LN
  blocks with causal attention (``F.scaled_dot_product_attention``), final LayerNorm
  and head.
- ``llama(depth)``: Llama-style decoder: token embedding, ``depth`` pre-norm blocks
  (RMSNorm, rotary position embeddings on q and k, causal SDPA, a SwiGLU MLP, no
  biases), final RMSNorm and head; the blocks take the hidden state alone (each
  attention holds its own rotary tables), so the stack is a flat chain too.

None has Dropout, so two copies of a model fed the same batch produce bit-identical
gradients: the benchmarks compare gradients exactly. BatchNorm runs in train mode.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

CIFAR_STAGE_WIDTHS = (16, 32, 64)  # bottleneck widths; block outputs are 4x these
BOTTLENECK_EXPANSION = 4


class PreActBottleneck(nn.Module):
    """BN-ReLU-conv1x1, BN-ReLU-conv3x3 (stride), BN-ReLU-conv1x1, plus the skip.

    The projection shortcut (when shape changes) reads the pre-activated input, as
    in the paper; the identity shortcut reads the raw input.
    """

    def __init__(self, in_channels: int, width: int, stride: int = 1):
        super().__init__()
        out_channels = width * BOTTLENECK_EXPANSION
        self.bn1 = nn.BatchNorm2d(in_channels)
        self.conv1 = nn.Conv2d(in_channels, width, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride=stride, padding=1, bias=False)
        self.bn3 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, out_channels, 1, bias=False)
        self.projection = None
        if stride != 1 or in_channels != out_channels:
            self.projection = nn.Conv2d(in_channels, out_channels, 1, stride=stride, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pre = F.relu(self.bn1(x))
        skip = x if self.projection is None else self.projection(pre)
        out = self.conv1(pre)
        out = self.conv2(F.relu(self.bn2(out)))
        out = self.conv3(F.relu(self.bn3(out)))
        return out + skip


def _residual_stages(block: type, in_channels: int, widths, blocks_per_stage, first_stride: int) -> list:
    """Blocks of all stages, in order; every stage after the first halves the resolution."""
    layers = []
    for stage, (width, n_blocks) in enumerate(zip(widths, blocks_per_stage)):
        for i in range(n_blocks):
            stride = (first_stride if stage == 0 else 2) if i == 0 else 1
            layers.append(block(in_channels, width, stride))
            in_channels = width * BOTTLENECK_EXPANSION
    return layers


def _classifier_head(channels: int, num_classes: int) -> list:
    return [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, num_classes)]


def cifar_blocks_per_stage(depth: int) -> int:
    """n of a depth-(9n + 2) CIFAR bottleneck ResNet (3 stages x n blocks x 3 convs,
    plus the stem conv and the classifier)."""
    if depth < 11 or (depth - 2) % 9:
        raise ValueError(f"a CIFAR bottleneck ResNet has depth 9n + 2 (11, 164, 1001, ...), got {depth}")
    return (depth - 2) // 9


def cifar_resnet(depth: int, num_classes: int = 10, in_channels: int = 3) -> nn.Sequential:
    """Pre-activation bottleneck ResNet-``depth`` (9n + 2) for small images, flat:
    ``[stem conv, 3n blocks, BN, ReLU, pool, flatten, linear]``."""
    n = cifar_blocks_per_stage(depth)
    stem_channels = CIFAR_STAGE_WIDTHS[0]
    blocks = _residual_stages(PreActBottleneck, stem_channels, CIFAR_STAGE_WIDTHS, (n,) * 3, first_stride=1)
    out_channels = CIFAR_STAGE_WIDTHS[-1] * BOTTLENECK_EXPANSION
    return nn.Sequential(
        nn.Conv2d(in_channels, stem_channels, 3, padding=1, bias=False),
        *blocks,
        # Pre-activation blocks end on a conv: the head normalizes before pooling.
        nn.BatchNorm2d(out_channels),
        nn.ReLU(),
        *_classifier_head(out_channels, num_classes),
    )


def conv_bn_relu_chain(blocks: int, channels: int = 16, image_size: int = 16, num_classes: int = 10) -> nn.Sequential:
    """``blocks`` x (Conv2d(channels, channels, 3, padding=1), BatchNorm2d,
    ReLU(inplace=True)), flat, then flatten and linear; inputs are
    (batch, channels, image_size, image_size). The convs keep their bias, which the
    next BatchNorm cancels: its true gradient is zero."""
    layers = []
    for _ in range(blocks):
        layers += [nn.Conv2d(channels, channels, 3, padding=1), nn.BatchNorm2d(channels), nn.ReLU(inplace=True)]
    return nn.Sequential(*layers, nn.Flatten(), nn.Linear(channels * image_size**2, num_classes))


class BasicBlock(nn.Module):
    """torchvision's post-activation basic block: conv3x3-BN-ReLU-conv3x3-BN, plus the
    skip (a 1x1 conv-BN projection where the width changes), then ReLU."""

    def __init__(self, in_channels: int, channels: int):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)
        self.projection = None
        if in_channels != channels:
            self.projection = nn.Sequential(nn.Conv2d(in_channels, channels, 1, bias=False), nn.BatchNorm2d(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skip = x if self.projection is None else self.projection(x)
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + skip)


def pooled_resnet(
    blocks_per_stage: int = 2, widths=(16, 32, 64), num_classes: int = 10, max_pool: type = nn.MaxPool2d
) -> nn.Sequential:
    """A basic-block ResNet that downsamples by max pooling, flat:
    ``[conv, BN, ReLU, pool, (blocks, pool) per stage but the last, blocks, pool, flatten,
    linear]``; every pool is ``max_pool(3, 2, 1)`` (the bench passes an instrumented
    MaxPool2d), so 32x32 inputs reach the head at 4x4."""
    layers = [nn.Conv2d(3, widths[0], 3, padding=1, bias=False), nn.BatchNorm2d(widths[0]), nn.ReLU(inplace=True),
              max_pool(3, 2, 1)]
    in_channels = widths[0]
    for stage, width in enumerate(widths):
        if stage:
            layers.append(max_pool(3, 2, 1))
        for _ in range(blocks_per_stage):
            layers.append(BasicBlock(in_channels, width))
            in_channels = width
    return nn.Sequential(*layers, *_classifier_head(in_channels, num_classes))


class TokenAndPositionEmbedding(nn.Module):
    def __init__(self, vocab_size: int, max_seq_len: int, width: int):
        super().__init__()
        self.tokens = nn.Embedding(vocab_size, width)
        self.positions = nn.Embedding(max_seq_len, width)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[-1], device=ids.device)
        return self.tokens(ids) + self.positions(positions)


class CausalSelfAttention(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        if width % heads:
            raise ValueError(f"width {width} is not a multiple of heads {heads}")
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.out = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, width = x.shape
        q, k, v = self.qkv(x).view(batch, seq, 3, self.heads, width // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(batch, seq, width))


class TransformerBlock(nn.Module):
    """Pre-LN block: ``x + attn(ln(x))``, then ``x + mlp(ln(x))``."""

    def __init__(self, width: int, heads: int, mlp_ratio: int = 4):
        super().__init__()
        self.ln1 = nn.LayerNorm(width)
        self.attn = CausalSelfAttention(width, heads)
        self.ln2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(
            nn.Linear(width, mlp_ratio * width), nn.GELU(), nn.Linear(mlp_ratio * width, width)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


def gpt(
    depth: int, width: int = 256, heads: int = 4, vocab_size: int = 1024, max_seq_len: int = 1024
) -> nn.Sequential:
    """GPT-style decoder with ``depth`` blocks, flat:
    ``[embedding, blocks, LayerNorm, head]``; maps token ids (B, T) to logits (B, T, vocab)."""
    if depth < 1:
        raise ValueError(f"a GPT needs at least one block, got depth={depth}")
    return nn.Sequential(
        TokenAndPositionEmbedding(vocab_size, max_seq_len, width),
        *(TransformerBlock(width, heads) for _ in range(depth)),
        nn.LayerNorm(width),
        nn.Linear(width, vocab_size),
    )


class RotaryAttention(nn.Module):
    """Causal self-attention with rotary position embeddings on q and k (the "rotate
    half" layout of Llama), separate q, k, v and output projections, no biases. The
    cos and sin tables are buffers (not saved in the state dict)."""

    def __init__(self, width: int, heads: int, max_seq_len: int, base: float = 10000.0):
        super().__init__()
        if width % heads or (width // heads) % 2:
            raise ValueError(f"width {width} must split into {heads} heads of an even size")
        self.heads = heads
        self.q, self.k, self.v, self.out = (nn.Linear(width, width, bias=False) for _ in range(4))
        head = width // heads
        frequencies = base ** -(torch.arange(0, head, 2, dtype=torch.float32) / head)
        angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), frequencies).repeat(1, 2)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def _rotated(self, x: torch.Tensor) -> torch.Tensor:
        seq = x.shape[-2]
        first, second = x.chunk(2, dim=-1)
        return x * self.cos[:seq] + torch.cat((-second, first), dim=-1) * self.sin[:seq]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, width = x.shape

        def heads(t):
            return t.view(batch, seq, self.heads, width // self.heads).transpose(1, 2)

        q, k, v = self._rotated(heads(self.q(x))), self._rotated(heads(self.k(x))), heads(self.v(x))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(batch, seq, width))


class SwiGLU(nn.Module):
    """``down(silu(gate(x)) * up(x))``, no biases."""

    def __init__(self, width: int, hidden: int):
        super().__init__()
        self.gate, self.up = nn.Linear(width, hidden, bias=False), nn.Linear(width, hidden, bias=False)
        self.down = nn.Linear(hidden, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


def swiglu_width(width: int, multiple: int = 64) -> int:
    """Llama's MLP width: 2/3 of 4 x width, rounded up to a multiple of ``multiple``."""
    return -(-(8 * width // 3) // multiple) * multiple


class LlamaBlock(nn.Module):
    """Pre-norm block: ``x + attn(rmsnorm(x))``, then ``x + swiglu(rmsnorm(x))``."""

    def __init__(self, width: int, heads: int, max_seq_len: int):
        super().__init__()
        self.attn_norm = nn.RMSNorm(width, eps=1e-6)
        self.attn = RotaryAttention(width, heads, max_seq_len)
        self.mlp_norm = nn.RMSNorm(width, eps=1e-6)
        self.mlp = SwiGLU(width, swiglu_width(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


def llama(
    depth: int, width: int = 256, heads: int = 4, vocab_size: int = 1024, max_seq_len: int = 1024
) -> nn.Sequential:
    """Llama-style decoder with ``depth`` blocks, flat: ``[embedding, blocks, RMSNorm,
    head]``; maps token ids (B, T) to logits (B, T, vocab)."""
    if depth < 1:
        raise ValueError(f"a Llama needs at least one block, got depth={depth}")
    return nn.Sequential(
        nn.Embedding(vocab_size, width),
        *(LlamaBlock(width, heads, max_seq_len) for _ in range(depth)),
        nn.RMSNorm(width, eps=1e-6),
        nn.Linear(width, vocab_size, bias=False),
    )
