"""The keep rules (actsave/runtime/keep_rules.py): which tensors a codec or offload
takes, which saves a lossy codec leaves exact, and which saves share a stored copy."""
import pytest
import torch
from torch import nn

import actsave
from actsave.codecs import EXPECTED_GRADIENT_SQNR_DB, sqnr_db
from actsave.runtime.keep_rules import AttentionSaves, lossy_codec_stores, should_encode, stored_once_key


def _dense():
    return torch.randn(4, 8, requires_grad=True) * 2


# What no codec reads: each would crash it (no row-major memory of its shape, or a
# dtype the kernels do not take), so it is kept as it is, as an integer tensor is.
NOT_ENCODED = {
    "sparse_coo": lambda: _dense().to_sparse(),
    "sparse_csr": lambda: _dense().to_sparse_csr(),
    "jagged_nested": lambda: torch.nested.as_nested_tensor([_dense()[:2], _dense()[2:3]], layout=torch.jagged),
    "strided_nested": lambda: 2 * torch.nested.nested_tensor([torch.randn(2, 8), torch.randn(1, 8)],
                                                             requires_grad=True),
    "float8_e4m3fn": lambda: _dense().to(torch.float8_e4m3fn),
    "float8_e5m2": lambda: _dense().to(torch.float8_e5m2),
    "int64": lambda: _dense().long(),
}


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support", "ignore:The PyTorch API of nested tensors")
@pytest.mark.parametrize("kind", NOT_ENCODED)
def test_only_dense_tensors_of_the_codecs_dtypes_are_encoded(kind):
    tensor = NOT_ENCODED[kind]()
    assert not should_encode(tensor) and not lossy_codec_stores(tensor)


SPARSE_NESTED_AND_FLOAT8 = {
    "sparse_coo": (lambda h: h.to_sparse(), lambda s, w: torch.sparse.mm(s, w).tanh().sum()),
    "sparse_csr": (lambda h: h.to_sparse_csr(), lambda s, w: torch.sparse.mm(s, w).tanh().sum()),
    "jagged_nested": (lambda h: torch.nested.as_nested_tensor([h[:2], h[2:3]], layout=torch.jagged),
                      lambda nt, w: (nt @ w).tanh().values().sum()),
    "float8": (lambda h: h.to(torch.float8_e4m3fn), lambda h8, w: (h8.float() @ w).tanh().sum()),
}


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support")
@pytest.mark.parametrize("keep", ["inputs", "saves"])
@pytest.mark.parametrize("kind", SPARSE_NESTED_AND_FLOAT8)
def test_a_lossy_checkpoint_keeps_what_no_codec_reads_as_it_is(kind, keep):
    make, function = SPARSE_NESTED_AND_FLOAT8[kind]
    torch.manual_seed(0)
    weight, x = torch.randn(8, 8, requires_grad=True), torch.randn(4, 8)
    x[x.abs() < 0.8] = 0
    grads = []
    for compress in (None, "int8"):
        weight.grad = None
        h = make(x.requires_grad_() * 2)
        out = function(h, weight) if compress is None else actsave.checkpoint(
            function, h, weight, keep=keep, compress=compress)
        out.backward()
        grads.append(weight.grad.clone())
    assert sqnr_db(*grads) >= EXPECTED_GRADIENT_SQNR_DB["int8"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_a_dense_activation_of_a_codec_dtype_is_encoded(dtype):
    assert should_encode(_dense().to(dtype)) and lossy_codec_stores(_dense().to(dtype))


def test_the_result_a_backward_divides_by_is_left_exact_not_the_tensors_it_is_made_from():
    # NOTE [ Saves a lossy codec leaves exact ]: sqrt's backward divides by its result.
    x = _dense()
    square = x * x
    assert lossy_codec_stores(square) and not lossy_codec_stores(torch.sqrt(square + 1e-12))
    assert not lossy_codec_stores(torch.linalg.vector_norm(x, dim=0))  # a norm per column, not per row
    assert not lossy_codec_stores(x.std(dim=0))
    assert lossy_codec_stores(torch.rsqrt(square + 1))  # rsqrt's backward multiplies by it


def test_a_view_with_the_negative_bit_is_not_stored_as_the_tensor_it_reads():
    y = torch.randn(4, 128).tanh()
    negated = torch._neg_view(y)
    assert negated.is_neg() and torch.equal(negated, -y)
    assert stored_once_key(negated) != stored_once_key(y)
    assert stored_once_key(negated) == stored_once_key(torch._neg_view(y))


def _attention_saves(attention: AttentionSaves, dropout_p: float = 0.0) -> tuple:
    """Whether each save a lossy codec would store is held: those an attention call
    makes (with ``dropout_p`` on a CPU: the math path's), and those of the step after
    it (a product that saves the attention output, an exp, its own output); and the
    output."""
    q, k, v = (torch.randn(2, 4, 16, 8, requires_grad=True) * 1 for _ in range(3))
    asked = []

    def pack(t):
        if lossy_codec_stores(t):
            asked.append(attention.holds(t))
        return t

    with attention.watching(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p)
        inside, asked[:] = asked[:], []
        (y * torch.randn(8, requires_grad=True)).exp()
    return inside, asked, y


@pytest.mark.parametrize("dropout_p", [0.0, 0.5], ids=["fused", "math"])
def test_every_save_an_attention_call_makes_is_held_whichever_kernel_runs(dropout_p):
    # NOTE [ Attention's saves agree ]: known by the call (on a CPU a dropout takes the
    # math path, which saves its probabilities).
    inside, _, _ = _attention_saves(AttentionSaves(), dropout_p)
    assert len(inside) >= 4 and all(inside)  # q, k, v, the output (fused) or the probabilities (math)


def test_a_later_save_of_a_storage_an_attention_save_holds_is_held_until_forgotten():
    attention = AttentionSaves()
    _, after, y = _attention_saves(attention)
    assert after == [True, False]  # the fused kernel's output, which it saved; exp's output
    assert attention.holds(y.view(-1))
    attention.forget()
    assert not attention.holds(y)


def test_outside_a_watch_no_save_is_an_attentions():
    attention = AttentionSaves()
    q, k, v = (torch.randn(2, 4, 16, 8, requires_grad=True) * 1 for _ in range(3))
    held = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: held.append(attention.holds(t)) or t, lambda t: t):
        torch.nn.functional.scaled_dot_product_attention(q, k, v)
    assert held and not any(held)


def test_a_dense_tensor_in_another_layout_is_stored_once_for_its_saves_as_a_contiguous_one_is():
    # A channels_last ReLU output saved by the ReLU and again by the next conv: one
    # stored copy, which decodes into that layout; another view of its memory is not it.
    y = torch.randn(2, 4, 3, 3).to(memory_format=torch.channels_last)
    again = y.view(y.shape)
    assert stored_once_key(y) is not None and stored_once_key(y) == stored_once_key(again)
    assert stored_once_key(y.transpose(2, 3)) != stored_once_key(y)
    assert stored_once_key(y[:, :2]) is None  # not dense: a copy per save


def test_a_channels_last_model_keeps_the_bytes_of_its_contiguous_self_under_a_codec():
    def keeps(channels_last: bool) -> int:
        torch.manual_seed(0)
        layers = [nn.Conv2d(8, 16, 3, padding=1)]
        for _ in range(3):
            layers += [nn.BatchNorm2d(16), nn.ReLU(), nn.Conv2d(16, 16, 3, padding=1)]
        model = actsave.CheckpointedSequential(*layers, segments=1, compress="int8")
        x = torch.randn(4, 8, 16, 16)
        if channels_last:
            model, x = model.to(memory_format=torch.channels_last), x.to(memory_format=torch.channels_last)
        out = model(x)
        kept = actsave.kept_bytes()["device"]
        out.sum().backward()
        return kept

    assert keeps(channels_last=True) == keeps(channels_last=False)
