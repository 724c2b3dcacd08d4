"""The keep rules (actsave/runtime/keep_rules.py): which tensors a codec or offload
takes, which saves a lossy codec leaves exact, and which saves share a stored copy."""
import pytest
import torch

import actsave
from actsave.codecs import EXPECTED_GRADIENT_SQNR_DB, sqnr_db
from actsave.runtime.keep_rules import lossy_codec_stores, should_encode, stored_once_key


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
