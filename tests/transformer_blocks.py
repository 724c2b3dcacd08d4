"""Small transformer blocks for the tests of selective recompute and what it keeps
(tests/runtime): a GPT block (LayerNorm, one qkv projection, GELU MLP) and a Llama block
(RMSNorm, rotary q and k, SwiGLU); an attention block alone, and GPT blocks whose
attention is sharp."""
import torch
import torch.nn.functional as F
from torch import nn


class GPTBlock(nn.Module):
    def __init__(self, d: int = 32, heads: int = 4, dropout: float = 0.0):
        super().__init__()
        self.heads = heads
        self.ln1, self.qkv, self.proj = nn.LayerNorm(d), nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.ln2, self.fc1, self.fc2 = nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.drop = nn.Dropout(dropout)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = (part.view(b, t, self.heads, d // self.heads).transpose(1, 2)
                   for part in self.qkv(self.ln1(x)).split(d, dim=2))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.drop(self.proj(a))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class RMSNorm(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def rotated(x, cos, sin):
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


class LlamaBlock(nn.Module):
    """RMSNorm, rotary q and k, SwiGLU: the attention's inputs are not a Linear's output."""

    def __init__(self, d: int = 32, heads: int = 4):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = RMSNorm(d), RMSNorm(d)
        self.q, self.k, self.v, self.o = (nn.Linear(d, d, bias=False) for _ in range(4))
        self.gate, self.up, self.down = nn.Linear(d, 2 * d, bias=False), nn.Linear(d, 2 * d, bias=False), \
            nn.Linear(2 * d, d, bias=False)

    def forward(self, x, cos, sin):
        b, t, d = x.shape
        h = self.norm1(x)
        q, k, v = ((proj(h).view(b, t, self.heads, d // self.heads).transpose(1, 2)) for proj in (self.q, self.k, self.v))
        a = F.scaled_dot_product_attention(rotated(q, cos, sin), rotated(k, cos, sin), v, is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, t, d))
        h = self.norm2(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


def stack(block, n: int = 3, seed: int = 0):
    torch.manual_seed(seed)
    return nn.ModuleList([block() for _ in range(n)])


def rope(t: int = 16, d: int = 8):
    angles = torch.arange(t)[:, None] * torch.arange(d // 2)[None, :] / 10.0
    return torch.cat((angles.cos(), angles.cos()), -1), torch.cat((angles.sin(), angles.sin()), -1)


class AttentionBlock(nn.Module):
    """A norm, q, k and v projected together, fused attention, the output projected:
    the attention's output is the projection's input."""

    def __init__(self, d: int = 32, heads: int = 4):
        super().__init__()
        self.heads, self.norm, self.qkv, self.out = heads, nn.LayerNorm(d), nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, x):
        b, t, d = x.shape
        parts = self.qkv(self.norm(x)).split(d, 2)
        q, k, v = (part.view(b, t, self.heads, d // self.heads).transpose(1, 2) for part in parts)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, t, d))


def sharp_gpt_blocks() -> nn.ModuleList:
    """Three GPT blocks whose attention is sharp (the query and key weights 3x
    initialization's: logits of std about 3)."""
    blocks = stack(GPTBlock)
    with torch.no_grad():
        for block in blocks:
            block.qkv.weight[:64] *= 3
    return blocks
