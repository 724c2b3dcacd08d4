"""runtime/kept_aliases.py: which arguments are kept together. The gradients of aliased
arguments are tested with the kept inputs, in test_store.py; those of views of one
memory that read it otherwise (conjugate, negative bits) here."""
import random

import pytest
import torch
from support import sqnr_db

import actsave
from actsave.codecs import EXPECTED_GRADIENT_SQNR_DB
from actsave.runtime.kept_aliases import _disjoint


def _elements(t: torch.Tensor) -> set:
    offsets = torch.zeros(t.shape, dtype=torch.long) + t.storage_offset()
    for dim, (size, stride) in enumerate(zip(t.shape, t.stride())):
        shape = [1] * t.dim()
        shape[dim] = size
        offsets = offsets + (torch.arange(size) * stride).view(shape)
    return set(offsets.flatten().tolist())


def _random_view(storage: torch.Tensor, rng: random.Random) -> torch.Tensor:
    dims = rng.randint(1, 3)
    shape = [rng.randint(1, 5) for _ in range(dims)]
    strides = [rng.choice([1, 2, 3, 4, 6, 8, 12, 16, 24, 48]) for _ in range(dims)]
    extent = 1 + sum((n - 1) * s for n, s in zip(shape, strides))
    return storage.as_strided(shape, strides, rng.randint(0, storage.numel() - extent))


def test_views_said_to_share_no_element_share_none():
    # Soundness, against the sets of storage elements themselves: a pair kept apart
    # that shares one would miss the other's in-place change in the recompute.
    rng, storage = random.Random(0), torch.zeros(400)
    said_disjoint = 0
    for _ in range(3000):
        a, b = _random_view(storage, rng), _random_view(storage, rng)
        if _disjoint(a, b):
            said_disjoint += 1
            assert not _elements(a) & _elements(b), (a.shape, a.stride(), a.storage_offset(), b.shape, b.stride(),
                                                      b.storage_offset())
    assert said_disjoint > 300  # the test sees the rules at work


def test_chunks_and_columns_are_found_apart():
    qkv = torch.zeros(2, 4, 48)
    q, k, v = qkv.chunk(3, -1)
    matrix = torch.zeros(8, 64)
    assert _disjoint(q, v) and _disjoint(q, k) and _disjoint(matrix[:, 0], matrix[:, 1])
    assert not _disjoint(matrix[:, 0:2], matrix[:, 1:3]) and not _disjoint(matrix[:, :4], matrix[:, :4].t())


def _tanh_times_sigmoid(a, b):
    return torch.tanh(a) * torch.sigmoid(b)


def _complex_product(a, b):
    return (a * b).real * torch.sigmoid(a.imag)


@pytest.mark.parametrize("function, views", [
    (_tanh_times_sigmoid, lambda h: (h.imag, h.conj().imag)),  # the second has the negative bit
    (_tanh_times_sigmoid, lambda h: (h.imag[:, :6], h.conj().imag[:, 2:])),  # one span, other layouts
    (_complex_product, lambda h: (h, h.conj())),  # the second has the conjugate bit
], ids=["negative-bit", "negative-bit-slices", "conjugate-bit"])
def test_views_of_one_memory_read_with_other_bits_are_recomputed_from_their_own_values(function, views):
    torch.manual_seed(0)
    z = torch.randn(4, 8, dtype=torch.complex64)
    grads = []
    for call in (function, lambda a, b: actsave.checkpoint(function, a, b)):
        leaf = z.clone().requires_grad_()
        call(*views(leaf * 1)).sum().backward()
        grads.append(leaf.grad)
    assert torch.equal(*grads)


class _ScaleThenGate(torch.nn.Module):
    inplace = True  # changes its first argument in place: actsave keeps a private copy

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)

    def forward(self, a, b):
        a.mul_(2)
        return torch.tanh(self.fc(a)) * torch.sigmoid(b)


@pytest.mark.parametrize("views, dtype", [
    (lambda h: (h, h.view(4, 8)), torch.float32),
    (lambda h: (h, torch._neg_view(h)), torch.float32),
    (lambda h: (h.imag, h.conj().imag), torch.complex64),
], ids=["alike", "negative-bit", "conjugate-then-imaginary"])
@pytest.mark.parametrize("compress", [None, "int8"])
def test_a_change_in_place_reaches_every_view_of_the_memory_in_the_recompute(views, dtype, compress):
    # The copy keeps the memory once: the change through the first argument reaches the
    # second as in the forward, whatever bits each reads it with.
    def step(wrap):
        torch.manual_seed(0)
        model = _ScaleThenGate()
        leaf = torch.randn(4, 8, dtype=dtype).requires_grad_()
        wrap(model)(*views(leaf * 1)).square().sum().backward()
        return [model.fc.weight.grad, leaf.grad]

    plain, checkpointed = step(lambda m: m), step(lambda m: actsave.Checkpoint(m, compress=compress))
    if compress is None:
        assert all(torch.equal(a, b) for a, b in zip(plain, checkpointed))
    else:
        assert all(sqnr_db(a, b) > EXPECTED_GRADIENT_SQNR_DB["int8"] for a, b in zip(plain, checkpointed))
