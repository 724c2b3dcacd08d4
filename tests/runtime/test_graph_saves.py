"""actsave/runtime/graph_saves.py: which saves of a compiled graph a codec keeps;
attention's stay exact, as eager actsave keeps them (NOTE [ Attention's saves agree ])."""
import copy

import torch
import torch.nn.functional as F
from torch import nn
from torch.fx.experimental.proxy_tensor import make_fx

import actsave
from actsave.codecs import sqnr_db
from actsave.runtime.graph_saves import attention_holds

WIDTH, HEADS = 32, 2


class AttentionBlock(nn.Module):
    """Self-attention with an output projection; q and k weights ``sharpness`` times
    nn.Linear's initialization (sharp attention, where decoded saves disagree most)."""

    def __init__(self, sharpness: float = 1.0):
        super().__init__()
        self.qkv, self.out = nn.Linear(WIDTH, 3 * WIDTH), nn.Linear(WIDTH, WIDTH)
        with torch.no_grad():
            self.qkv.weight[:2 * WIDTH] *= sharpness

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, HEADS, WIDTH // HEADS).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.out(a.transpose(1, 2).reshape(b, t, WIDTH))


def test_attention_inputs_outputs_and_their_views_are_held_and_other_tensors_are_not():
    block = AttentionBlock()
    graph = make_fx(block)(torch.randn(2, 8, WIDTH)).graph
    attention = next(n for n in graph.nodes if "scaled_dot_product" in str(n.target))
    q, k, v = attention.args[:3]
    made = [user for user in attention.users]  # its outputs (getitem)
    output_views = [n for n in graph.nodes if n.op == "call_function" and n.args and n.args[0] in made]
    for node in (q, k, v, *made, *output_views):
        assert attention_holds(node), node
    addmms = [n for n in graph.nodes if "addmm" in str(n.target)]
    assert not attention_holds(addmms[1])  # the output projection's result
    assert not attention_holds(next(n for n in graph.nodes if n.target is torch.ops.aten.add.Tensor))


def _gradients(model, x):
    torch.manual_seed(1)
    model(x).square().mean().backward()
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def assert_compiled_stores_as_eager(blocks: list, x: torch.Tensor, codec: str) -> None:
    """A chain of ``blocks`` in one segment (the last, plain: its saves stored by the
    codec) gives gradients as close to plain's compiled as eagerly."""
    plain = _gradients(nn.Sequential(*copy.deepcopy(blocks)), x)
    chain = lambda: actsave.CheckpointedSequential(*copy.deepcopy(blocks), segments=1, compress=codec)  # noqa: E731
    eager = sqnr_db(plain, _gradients(chain(), x))
    compiled = sqnr_db(plain, _gradients(torch.compile(chain(), backend="aot_eager"), x))
    assert compiled >= eager - 1.0, (compiled, eager)


def test_a_compiled_stored_segment_keeps_attentions_saves_exactly_as_eager_actsave_does():
    torch.manual_seed(0)
    assert_compiled_stores_as_eager([AttentionBlock(sharpness=3.0) for _ in range(2)], torch.randn(2, 16, WIDTH),
                                    "fp8_e4m3")


class RotaryBlock(nn.Module):
    """A Linear's output rotated by angles the block makes from a buffer and positions,
    from no input that needs a gradient, as a Llama block that makes its rotary table."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)
        self.register_buffer("inv_freq", 1.0 / 100 ** (torch.arange(0, WIDTH, 2) / WIDTH), persistent=False)

    def forward(self, x):
        freqs = torch.outer(torch.arange(x.shape[1], dtype=x.dtype, device=x.device), self.inv_freq)
        angles = torch.cat([freqs, freqs], dim=-1)
        h = self.linear(x)
        first, second = h.chunk(2, dim=-1)
        return x + h * angles.cos() + torch.cat([-second, first], dim=-1) * angles.sin()


def test_a_compiled_stored_segment_keeps_exact_the_saves_that_need_no_gradient_as_eager_actsave_does():
    # The partitioner saves the angles and makes cos and sin again from them in the
    # backward; eager actsave keeps cos and sin, which need no gradient, by reference.
    # Encoded, the angles' error (a step of the largest angle) reached every gradient.
    torch.manual_seed(0)
    assert_compiled_stores_as_eager([RotaryBlock() for _ in range(2)], torch.randn(2, 32, WIDTH), "int8")
