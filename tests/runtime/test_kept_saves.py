"""Saves kept instead of recomputed (actsave/runtime/kept_saves.py). The last segment's
saves stored by its codec: what is stored, what is held as it is, exact ReLU decisions,
and other saved-tensor hooks. call_with_kept_saves: a block run once, its saves kept by
a codec (all of them, or its Linear layers' inputs) or on the host, one group per call
on the prefetch tape."""
import contextlib
import copy
import gc
import math
import weakref

import pytest
import torch
from support import CallCounter, channel_means, codes_and_scales, peak_activation_bytes, sqnr_db
from torch import nn
from torch.nn import functional as F
from transformer_blocks import AttentionBlock, sharp_gpt_blocks
from torch.utils.checkpoint import checkpoint as torch_checkpoint

import actsave
from actsave import CheckpointedSequential
from actsave.codecs import EXPECTED_GRADIENT_SQNR_DB, get_codec
from actsave.offload import HostCopyEngine, PrefetchTape, current_tape, host_pool
from actsave.planning import plans
from actsave.runtime import kept_saves, pool_decisions
from actsave.runtime.kept_saves import call_with_kept_saves
from actsave.runtime.keep_rules import KeepPolicy


def last_segment_only(*layers, compress="int8") -> CheckpointedSequential:
    """One segment: the last, so everything it saves is kept, none recomputed."""
    return CheckpointedSequential(*layers, segments=1, compress=compress)


def test_one_segment_with_a_codec_recomputes_nothing():
    # ActNN's mode: every save stored by the codec, each layer run once.
    model = last_segment_only(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    counter = CallCounter(model)
    model(torch.randn(4, 8, requires_grad=True) * 1).sum().backward()
    assert counter.counts == {"0": 1, "1": 1, "2": 1}
    assert model.describe().splitlines()[1].split()[4:6] == ["saves", "int8"]


def test_parameters_and_batchnorm_statistics_are_held_as_they_are():
    torch.manual_seed(0)
    model = last_segment_only(nn.Conv2d(4, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU())
    x = torch.randn(2, 4, 8, 8, requires_grad=True)
    out = model(x * 1)
    # Stored: the conv's input and the BatchNorm's input, each with its channel means
    # (signed conv activations are centered), the ReLU's output with 1 bit per element.
    # Held: the weights, running and batch statistics (leaves).
    conv_in, activation = 2 * 4 * 8 * 8, 2 * 8 * 8 * 8
    expected = (codes_and_scales(conv_in) + channel_means(4) + 2 * codes_and_scales(activation)
                + channel_means(8) + activation // 8)
    assert actsave.kept_bytes()["device"] == expected
    out.sum().backward()
    assert actsave.kept_bytes() == {"device": 0, "host": 0}


class _RowNorms(nn.Module):
    """F.normalize (its norm saved broadcast, ``expand_as``) then an RMSNorm written in
    Python (the rsqrt of each row's variance saved, last dimension 1)."""

    def forward(self, x):
        x = nn.functional.normalize(x, dim=-1)
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


@pytest.mark.parametrize("codec", ["int8", "fp8_e4m3", "fp8_e5m2"])
def test_per_row_statistics_are_held_exactly_beside_padding_rows(codec):
    # All-zero padding rows in a group with real ones: their saved norms, encoded, decode
    # to 0, and the divisions' gradients came back -inf and NaN.
    torch.manual_seed(0)
    embed, block = nn.Linear(16, 32, bias=False), nn.Sequential(_RowNorms(), nn.Linear(32, 32))
    tokens = torch.randn(64, 16)
    tokens[46:] = 0
    mask = (tokens.abs().sum(-1, keepdim=True) > 0).float()
    grads = []
    for compress in (None, codec):
        embed.zero_grad(), block.zero_grad()
        h = embed(tokens)
        out = block(h) if compress is None else actsave.checkpoint(block, h, keep="saves", compress=compress)
        ((out * mask) ** 2).sum().backward()
        grads.append([p.grad.clone() for p in (embed.weight, *block.parameters())])
    for reference, approximation in zip(*grads):
        assert approximation.isfinite().all()
        assert sqnr_db(reference, approximation) >= EXPECTED_GRADIENT_SQNR_DB[codec]


class _FirstColumnGate(nn.Module):
    """``x * sigmoid(x)[..., :1]``: saves a last-dimension-1 view of a wider tensor, or
    that view broadcast to ``x``'s shape (``expand``)."""

    def __init__(self, expand: bool):
        super().__init__()
        self.expand = expand

    def forward(self, x):
        gate = torch.sigmoid(x)
        self.gate = weakref.ref(gate)
        column = gate[..., :1]
        return x * (column.expand_as(x) if self.expand else column)


@pytest.mark.parametrize("expand", [False, True])
def test_a_narrow_view_of_a_wide_save_is_encoded_not_held_with_its_storage(expand):
    gate = _FirstColumnGate(expand)
    x = torch.randn(64, 32, requires_grad=True)
    out = actsave.checkpoint(gate, x * 1, keep="saves", compress="int8")
    assert gate.gate() is None  # nothing holds the wide sigmoid output: its saves are encoded
    out.sum().backward()


class _SmoothAbs(nn.Module):
    """``sqrt(x * x + eps)``: its backward divides by the sqrt's result."""

    def forward(self, x):
        return torch.sqrt(x * x + 1e-12)


@pytest.mark.parametrize("codec", ["int8", "fp8_e4m3", "fp8_e5m2"])
def test_a_result_its_backward_divides_by_is_held_exactly(codec):
    # Outputs of a wide range: the small magnitudes in a group with a large one decoded
    # to 0, and their gradients came back inf and NaN (int8).
    torch.manual_seed(0)
    layers = [nn.Linear(32, 256), nn.GELU(), nn.Linear(256, 256), _SmoothAbs()]
    with torch.no_grad():
        layers[2].weight.mul_(8)
    x = torch.randn(8, 32, requires_grad=True)
    last_segment_only(*layers, compress=codec)(x * 1).sum().backward()
    assert x.grad.isfinite().all() and all(p.grad.isfinite().all() for layer in layers for p in layer.parameters())


class _GroupNormed(nn.Module):
    """A Linear into a group norm over 8 groups of 8, two groups of each sample
    constant: their rstd, ~1/sqrt(eps), is far above the others'."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(64, 64)

    def forward(self, x):
        h = self.lin(x)
        h = torch.cat([h[:, :48], torch.zeros_like(h[:, :16])], dim=1)
        return F.group_norm(h.view(-1, 64, 1), 8).view(-1, 64)


@pytest.mark.parametrize("codec", ["int8", "fp8_e4m3"])
def test_a_group_norms_statistics_are_held_exactly(codec):
    # Encoded, the constant groups' rstd set their codec group's scale and the others'
    # decoded far off: gradients at 5.9 dB (int8).
    torch.manual_seed(0)
    layers = [nn.Linear(32, 64), nn.GELU(), _GroupNormed(), nn.Linear(64, 64)]
    x = torch.randn(16, 32)
    plain = nn.Sequential(*copy.deepcopy(layers))
    plain(x).square().sum().backward()
    last_segment_only(*layers, compress=codec)(x).square().sum().backward()
    pairs = [(p.grad, q.grad) for p, q in zip(plain.parameters(), (p for layer in layers for p in layer.parameters()))]
    assert min(sqnr_db(p, q) for p, q in pairs) >= EXPECTED_GRADIENT_SQNR_DB[get_codec(codec).name]


def _covariance(h: torch.Tensor) -> torch.Tensor:
    return h.mT @ h / h.shape[0] + 1e-3 * torch.eye(h.shape[1], dtype=h.dtype)


DECOMPOSITIONS = {  # a ZCA whitening, a low-rank projection, a QR's R
    "eigh": lambda h: (lambda L, Q: h @ Q @ torch.diag(L.rsqrt()) @ Q.mT)(*torch.linalg.eigh(_covariance(h))),
    "svd": lambda h: (lambda U, S, Vh: h @ Vh.mT[:, :8] @ torch.diag(S[:8]) @ Vh[:8])(
        *torch.linalg.svd(h, full_matrices=False)),
    "qr": lambda h: h @ torch.linalg.qr(h.mT @ h)[1],
    "cholesky": lambda h: h @ torch.linalg.cholesky(_covariance(h))}


class _Decomposed(nn.Module):
    def __init__(self, decompose):
        super().__init__()
        self.decompose, self.a, self.b = decompose, nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x):
        return self.b(self.decompose(self.a(x))) + x


@pytest.mark.parametrize("decomposition", DECOMPOSITIONS)
def test_the_results_of_a_decomposition_are_held_exactly(decomposition):
    # Their backwards divide by differences of eigen- or singular values, or by a
    # factor's diagonal: encoded, near values decoded equal, and every gradient was NaN.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), _Decomposed(DECOMPOSITIONS[decomposition]), nn.Linear(16, 4)).double()
    actsave.wrap(model, _Decomposed, keep="saves", compress="int8")
    x = torch.randn(64, 16, dtype=torch.float64)
    y = model(x)
    (y * torch.linspace(-1, 2, y.numel(), dtype=y.dtype).view_as(y)).square().sum().backward()
    assert all(p.grad.isfinite().all() for p in model.parameters())


class _PlusReduction(nn.Module):
    """``x + reduce(x)``: a reduction whose backward compares its input with its result."""

    def __init__(self, reduce):
        super().__init__()
        self.reduce = reduce

    def forward(self, x):
        return x + self.reduce(x)


REDUCTIONS = {"amax": lambda h: h.amax(dim=1, keepdim=True), "amin": lambda h: torch.amin(h, dim=1, keepdim=True),
              "max": lambda h: h.max(), "median": lambda h: h.median(),
              "inf norm": lambda h: torch.linalg.vector_norm(h, math.inf, dim=1, keepdim=True),
              "aminmax": lambda h: sum(torch.aminmax(h, dim=1, keepdim=True)),
              # A p-norm node (NormBackward1), not a vector norm's.
              "inf pairwise distance": lambda h: F.pairwise_distance(h, h.roll(1, -1), p=math.inf)[..., None],
              # Their results compared with both inputs saved before them (a scatter's self and
              # source, a distance's two points): NaN in every gradient before, or none.
              "scatter amax": lambda h: _eighths(h).scatter_reduce(-1, (torch.arange(64) % 8).expand_as(h), h, "amax",
                                                                  include_self=False).repeat(1, 1, 8),
              "index amin": lambda h: _eighths(h).index_reduce(-1, torch.arange(64) % 8, h, "amin").repeat(1, 1, 8),
              "inf distance": lambda h: torch.cdist(h, h.roll(1, -1), p=math.inf).repeat(1, 1, 2),
              "inf dist": lambda h: torch.dist(h, h.roll(1, -1), p=math.inf)}
# An infinity distance's gradient goes to one element of each pair: a few gradients
# carry the whole step, and their SQNR spreads wider about the codec's floor.
_ONE_ELEMENT_EACH = {"inf distance", "inf dist", "inf pairwise distance"}


def _eighths(h: torch.Tensor) -> torch.Tensor:
    """Zeros of ``h``'s shape but the last dimension, 8 there: a reduction's self."""
    return h.new_zeros(*h.shape[:-1], 8)


def _reducing_chain(reduce):
    torch.manual_seed(0)
    return [nn.Linear(64, 64), nn.GELU(), _PlusReduction(REDUCTIONS[reduce]), nn.Linear(64, 64), nn.Tanh(),
            _PlusReduction(REDUCTIONS[reduce]), nn.Linear(64, 64)]


@pytest.mark.parametrize("codec", ["int8", "fp8_e4m3"])
@pytest.mark.parametrize("reduce", REDUCTIONS)
def test_a_result_its_backward_compares_with_its_input_is_held_with_that_input(reduce, codec):
    # NOTE [ Saves a backward compares ]: decoded apart, the input equalled the result
    # nowhere, and every gradient before an amax or amin came back NaN.
    layers = _reducing_chain(reduce)
    x, weights = torch.randn(8, 32, 64), torch.randn(8, 32, 64)
    plain = nn.Sequential(*copy.deepcopy(layers))
    (plain(x) * weights).sum().backward()
    (last_segment_only(*layers, compress=codec)(x) * weights).sum().backward()
    pairs = [(p.grad, q.grad) for p, q in zip(plain.parameters(), (p for layer in layers for p in layer.parameters()))]
    margin = 3.0 if reduce in _ONE_ELEMENT_EACH else 0.0
    assert min(sqnr_db(p, q) for p, q in pairs) >= EXPECTED_GRADIENT_SQNR_DB[get_codec(codec).name] - margin


class _AmaxBeforeLinear(nn.Module):
    """An amax of ``h``, then a Linear on ``h`` and a division by the amax: saves of
    ``h`` after the amax's."""

    def __init__(self):
        super().__init__()
        self.up, self.lin = nn.Linear(64, 64), nn.Linear(64, 64)

    def forward(self, x):
        h = self.up(x)
        m = h.amax(-1, keepdim=True)
        return self.lin(h) + (h - m) / (m.abs() + 1)


@pytest.mark.parametrize("keep", ["saves", "linear_inputs"])
def test_later_saves_of_a_compared_input_are_held_with_it(keep):
    # Under linear_inputs the Linear taking h encoded every save of it held so far, the
    # amax's too: every gradient before it NaN; under saves a later save of h kept an
    # int8 copy beside the exact one (2.2% over the prediction).
    torch.manual_seed(0)
    block = _AmaxBeforeLinear()
    plain = copy.deepcopy(block)
    x = torch.randn(8, 32, 64)
    plain(x).sum().backward()
    actsave.checkpoint(block, x, keep=keep, compress="int8").sum().backward()
    assert min(sqnr_db(p.grad, q.grad) for p, q in zip(plain.parameters(), block.parameters())) >= \
        EXPECTED_GRADIENT_SQNR_DB["int8"]


@pytest.mark.parametrize("chain", ["amax", "inf norm", "scatter amax", "inf distance", "amax, then a Linear"])
def test_a_chain_holding_compared_saves_measures_at_most_its_prediction(chain):
    # The input held as it is is priced so, beside the others' stored copy of it; one
    # segment, whose saves int8 keeps. Later saves of the input are held too, not an
    # int8 copy beside it (the figures: docs/results.md).
    x = torch.randn(8, 32, 64)
    torch.manual_seed(0)
    layers = [_AmaxBeforeLinear() for _ in range(3)] if chain == "amax, then a Linear" else _reducing_chain(chain)
    model = CheckpointedSequential(*layers)
    plan = plans.predict(actsave.profile(model, (x,)), [0], saves_codec="int8")
    model.apply_plan(plan)
    assert peak_activation_bytes(model, x) <= plan.predicted_peak_bytes


def _negated_twin(x, w1, w2):
    """Saves ``y`` and its negation as a view of the same memory (the negative bit)."""
    y = torch.tanh(x)
    return (y @ w1).sum() + (torch._neg_view(y) @ w2).sum()


@pytest.mark.parametrize("policy", [KeepPolicy.resolve("int8"), KeepPolicy.resolve(offload=True)],
                         ids=["int8", "exact offload"])
def test_a_view_with_the_negative_bit_is_kept_as_its_values(policy):
    # A lossy codec stored y once for both saves, an exact offload copied the bytes of y:
    # the negated save came back as y (the second weight's gradient at -6 dB).
    torch.manual_seed(0)
    x = torch.randn(4, 16, requires_grad=True)
    w1, w2 = torch.randn(16, 8, requires_grad=True), torch.randn(16, 8, requires_grad=True)
    grads = []
    for kept in (None, policy):
        x.grad = w1.grad = w2.grad = None
        out = _negated_twin(x, w1, w2) if kept is None else call_with_kept_saves(_negated_twin, (x, w1, w2), {},
                                                                                 kept)[0]
        out.backward()
        grads.append((x.grad.clone(), w1.grad.clone(), w2.grad.clone()))
    for expected, got in zip(*grads):
        if policy.lossy:
            assert sqnr_db(expected, got) >= EXPECTED_GRADIENT_SQNR_DB["int8"]
        else:
            assert torch.equal(expected, got)


def test_a_relu_output_and_its_view_are_stored_once():
    torch.manual_seed(0)
    model = last_segment_only(nn.ReLU(), nn.Linear(128, 4))  # the Linear saves a (6, 128) view
    out = model(torch.randn(2, 3, 128, requires_grad=True) * 1)
    assert actsave.kept_bytes()["device"] == codes_and_scales(768) + 768 // 8
    out.sum().backward()


class Product(nn.Module):
    def forward(self, x):
        return (x * 2) * (x * 3)  # saves two tensors of one shape, alive together


@pytest.mark.parametrize("device", ["cpu", "meta"])  # meta: what actsave.estimate runs
def test_distinct_saves_of_one_shape_are_stored_apart(device):
    out = last_segment_only(Product())(torch.ones(4, 128, device=device, requires_grad=True) * 1)
    assert actsave.kept_bytes()["device"] == 2 * codes_and_scales(512)
    del out


def test_relu_decisions_are_the_forwards_where_the_codec_rounds_to_zero():
    # One group: 1000 sets the int8 step to about 7.9, so the small positives code to 0.
    x = torch.tensor([1000.0, 1e-3, 2.0, -1e-3, 3e-2, -5.0] * 8, requires_grad=True)
    last_segment_only(nn.ReLU())(x * 1).sum().backward()
    assert torch.equal(x.grad, (x > 0).float())


def test_gradients_are_close_and_training_runs_twice_with_retain_graph():
    torch.manual_seed(0)
    layers = [nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10)]
    plain, lossy = nn.Sequential(*layers), last_segment_only(*layers)
    x = torch.randn(32, 64)
    plain(x).square().sum().backward()
    expected = [p.grad.clone() for p in plain.parameters()]
    plain.zero_grad()
    out = lossy(x).square().sum()
    out.backward(retain_graph=True)
    once = [p.grad.clone() for p in lossy.parameters()]
    out.backward()
    for e, g, twice in zip(expected, once, lossy.parameters()):
        assert sqnr_db(e, g) >= 35
        assert torch.equal(twice.grad, 2 * g)


def test_an_exception_in_the_forward_keeps_nothing():
    class Boom(nn.Module):
        def forward(self, x):
            raise RuntimeError("boom")

    model = last_segment_only(nn.Linear(8, 8), nn.ReLU(), Boom())
    with pytest.raises(RuntimeError, match="boom"):
        model(torch.randn(4, 8, requires_grad=True) * 1)
    assert actsave.kept_bytes() == {"device": 0, "host": 0}


def test_a_last_segments_saves_are_left_to_an_outer_checkpoint():
    # An outer checkpoint recomputes the last segment and counts its saves: hiding them
    # behind our hooks would break it. The saves stay exact, as with compress=None there.
    torch.manual_seed(0)
    layers = [nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4)]
    x = torch.randn(8, 16, requires_grad=True)
    exact_last = CheckpointedSequential(*layers, segments=[0, 2], compress={0: "int8"})
    exact_last(x * 1).sum().backward()
    expected = [p.grad.clone() for p in exact_last.parameters()]
    exact_last.zero_grad()

    model = CheckpointedSequential(*layers, segments=[0, 2], compress="int8")
    out = torch_checkpoint(model, x * 1, use_reentrant=False)
    out.sum().backward()
    for e, p in zip(expected, model.parameters()):
        assert torch.equal(e, p.grad)


def test_relu_outputs_are_stored_on_the_unsigned_grid():
    grids = []

    class Recording(type(actsave.codecs.get_codec("int8"))):
        def encode(self, x, non_negative=False):
            grids.append((tuple(x.shape), non_negative))
            return super().encode(x, non_negative)

        def encode_with_signs(self, x):  # a ReLU output with its decisions: unsigned
            grids.append((tuple(x.shape), True))
            return super().encode_with_signs(x)

    recording = Recording("int8", 37.0)
    out = last_segment_only(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2), compress=recording)(
        torch.randn(4, 8, requires_grad=True) * 1)
    # The first Linear's input (signed); the ReLU output, saved by the ReLU and the
    # second Linear, stored once and unsigned.
    assert grids == [((4, 8), False), ((4, 16), True)]
    out.sum().backward()


def pooled_step() -> tuple:
    """(kept bytes after the forward, parameter gradients) of a last segment with a
    max pool, under int8."""
    torch.manual_seed(0)
    model = last_segment_only(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(3, 2, 1), nn.Flatten(),
                              nn.Linear(8 * 4 * 4, 2))
    out = model(torch.randn(2, 3, 8, 8, requires_grad=True) * 1)
    stored = actsave.kept_bytes()["device"]
    out.sum().backward()
    assert actsave.kept_bytes() == {"device": 0, "host": 0}
    return stored, [p.grad for p in model.parameters()]


def test_max_pool_indices_are_stored_as_window_decisions_exactly(monkeypatch):
    stored, gradients = pooled_step()
    monkeypatch.setattr(pool_decisions.Window, "of", classmethod(lambda cls, module: None))
    held_stored, held_gradients = pooled_step()  # the int64 indices held by autograd, uncounted
    assert all(torch.equal(a, b) for a, b in zip(gradients, held_gradients))  # decoded exactly
    # 4 bits per 3x3 window where the int64 indices took 64: 2 x 8 planes of 4 x 4.
    assert stored - held_stored == 2 * 8 * 4 * 4 * 4 // 8


@pytest.mark.parametrize("compress", ["int8", "fp8"])
@pytest.mark.parametrize("segments", [1, [0, 2]])
def test_a_weight_changed_before_backward_raises_as_nn_sequential_does(compress, segments):
    # Where hooks are set autograd checks no version: the store checks them itself.
    torch.manual_seed(0)
    model = CheckpointedSequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4), segments=segments,
                                   compress=compress)
    out = model(torch.randn(8, 16)).square().sum()
    with torch.no_grad():
        model[2].weight.mul_(0.5)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.backward()


def test_a_stored_activation_changed_in_place_raises_even_after_it_is_freed():
    # The Tanh's output is encoded; the store follows its version counter without
    # holding its storage, through a view that outlives it.
    model = last_segment_only(nn.Linear(16, 16), nn.Tanh())
    out = model(torch.randn(8, 16, requires_grad=True) * 1)
    view = out.view(-1)
    loss = out.sum()
    del out
    with torch.no_grad():
        view.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_saves_unchanged_since_the_forward_unpack_as_before():
    torch.manual_seed(0)
    model = last_segment_only(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))
    x = torch.randn(8, 16, requires_grad=True)
    model(x * 1).sum().backward()
    assert x.grad is not None and actsave.kept_bytes() == {"device": 0, "host": 0}


# --- call_with_kept_saves: a block kept instead of recomputed ---------------------------

NOTHING = {"device": 0, "host": 0}


def keep(codec=None, offload=False) -> KeepPolicy:
    return KeepPolicy(get_codec(codec), offload)


class Block(nn.Module):
    """``x + fc2(gelu(fc1(norm(x))))``: a transformer's MLP block."""

    def __init__(self, width: int = 32):
        super().__init__()
        self.norm, self.fc1 = nn.LayerNorm(width), nn.Linear(width, 4 * width)
        self.act, self.fc2 = nn.GELU(), nn.Linear(4 * width, width)

    def forward(self, x):
        return x + self.fc2(self.act(self.fc1(self.norm(x))))


def transformer_blocks() -> list:
    torch.manual_seed(0)
    return [Block(), Block()]


def conv_bn_relu_blocks() -> list:
    torch.manual_seed(0)
    return [nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2)),
            nn.Sequential(nn.Conv2d(8, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU())]


MODELS = {"transformer": (transformer_blocks, (4, 6, 32)), "conv_bn_relu": (conv_bn_relu_blocks, (8, 3, 16, 16))}


def kept_forward(blocks, x, policy, scope="all"):
    """The blocks one after another, each run by call_with_kept_saves (None: plainly)."""
    for block in blocks:
        x = block(x) if policy is None else call_with_kept_saves(block, (x,), {}, policy, scope)[0]
    return x


def gradients(blocks, x, policy, scope="all", backwards=1) -> list:
    """Parameter and input gradients of one step, seeded; ``backwards`` > 1: that many
    backwards of one graph (retain_graph=True but the last)."""
    blocks = copy.deepcopy(blocks)
    x = x.detach().clone().requires_grad_()
    torch.manual_seed(1)
    loss = kept_forward(blocks, x, policy, scope).square().sum()
    for k in range(backwards):
        loss.backward(retain_graph=k < backwards - 1)
    return [x.grad] + [p.grad for b in blocks for p in b.parameters()]


def assert_nothing_held():
    assert actsave.kept_bytes() == NOTHING
    assert host_pool().in_use_bytes == 0


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("scope", kept_saves.SCOPES)
def test_offload_with_the_exact_codec_gives_plain_gradients_bit_for_bit(model, scope):
    make, shape = MODELS[model]
    blocks, x = make(), torch.randn(shape)
    expected = gradients(blocks, x, None)
    got = gradients(blocks, x, keep(offload=True), scope)
    assert all(torch.equal(e, g) for e, g in zip(expected, got))
    assert_nothing_held()


@pytest.mark.parametrize("codec", ["int8", "fp8"])
@pytest.mark.parametrize("model", MODELS)
def test_a_lossy_codec_keeps_gradients_within_its_floor_and_offload_changes_no_bit(codec, model):
    make, shape = MODELS[model]
    blocks, x = make(), torch.randn(shape)
    expected = gradients(blocks, x, None)
    on_device = gradients(blocks, x, keep(codec))
    floor = EXPECTED_GRADIENT_SQNR_DB[get_codec(codec).name]
    # The floors (33 dB int8, 21 fp8) are whole planned networks' figures; a block's
    # worst tensor is above them (the worst here: the first BatchNorm's weight).
    assert min(sqnr_db(e, g) for e, g in zip(expected, on_device)) >= floor
    on_host = gradients(blocks, x, keep(codec, offload=True))  # the same codes cross the bus
    assert all(torch.equal(d, h) for d, h in zip(on_device, on_host))
    assert_nothing_held()


def test_the_exact_codec_on_the_device_is_a_plain_call():
    blocks, x = transformer_blocks(), torch.randn(4, 6, 32, requires_grad=True)
    out, kept = call_with_kept_saves(blocks[0], (x,), {}, keep())
    assert kept is None and out.grad_fn is not None and actsave.kept_bytes() == NOTHING
    with torch.no_grad():
        assert call_with_kept_saves(blocks[0], (x,), {}, keep("int8"))[1] == NOTHING


def linear_gelu_linear() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))


class RecordingInt8(type(get_codec("int8"))):
    """int8, recording the shape of each tensor it encodes and its grid."""

    def __init__(self):
        super().__init__("int8", 33.0)
        self.encoded = []

    def encode(self, x, non_negative=False):
        self.encoded.append((tuple(x.shape), non_negative))
        return super().encode(x, non_negative)

    def encode_with_signs(self, x):  # a ReLU output with its decisions: unsigned
        self.encoded.append((tuple(x.shape), True))
        return super().encode_with_signs(x)


@pytest.mark.parametrize("as_callable", [False, True], ids=["module", "callable"])
@pytest.mark.parametrize("offload", [False, True])
def test_linear_inputs_alone_are_kept_by_the_codec(offload, as_callable):
    # Both Linear inputs encoded; GELU's save (the first Linear's output) is autograd's
    # own: uncounted, exact. A plain callable's Linear modules are found by a global hook.
    block, codec = linear_gelu_linear(), RecordingInt8()
    function = (lambda h: block(h)) if as_callable else block
    x = torch.randn(8, 64, requires_grad=True)
    out, kept = call_with_kept_saves(function, (x * 1,), {}, KeepPolicy(codec, offload), "linear_inputs")
    assert codec.encoded == [((8, 64), False), ((8, 256), False)]
    expected = codes_and_scales(8 * 64) + codes_and_scales(8 * 256)
    where = "host" if offload else "device"
    assert kept == actsave.kept_bytes() == {**NOTHING, where: expected}
    out.sum().backward()
    assert_nothing_held()


class _CallsByKeyword(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(64, 256), nn.Linear(256, 64)

    def forward(self, x):
        return self.b(input=nn.functional.gelu(self.a(input=x)))


def test_linear_inputs_passed_by_keyword_are_kept_by_the_codec():
    # They were not seen (0 bytes kept), and a warning said no nn.Linear ran.
    block, codec = _CallsByKeyword(), RecordingInt8()
    out, kept = call_with_kept_saves(block, (torch.randn(8, 64, requires_grad=True) * 1,), {},
                                     KeepPolicy(codec, False), "linear_inputs")
    assert codec.encoded == [((8, 64), False), ((8, 256), False)]
    assert kept == {**NOTHING, "device": codes_and_scales(8 * 64) + codes_and_scales(8 * 256)}
    out.sum().backward()
    assert_nothing_held()


class _Conv1D(nn.Module):
    """A projection that is not an nn.Linear (transformers' GPT-2 Conv1D: addmm)."""

    def __init__(self, n_in: int, n_out: int):
        super().__init__()
        self.weight, self.bias = nn.Parameter(torch.randn(n_in, n_out) * 0.1), nn.Parameter(torch.zeros(n_out))

    def forward(self, x):
        return torch.addmm(self.bias, x, self.weight)


def test_linear_inputs_without_a_linear_keep_nothing_and_say_so_once(monkeypatch):
    monkeypatch.setattr(kept_saves, "_WARNED_NO_LINEAR", set())
    block = nn.Sequential(_Conv1D(64, 64), nn.GELU(), _Conv1D(64, 64))
    with pytest.warns(UserWarning, match="keep='linear_inputs' on Sequential kept nothing by its codec") as caught:
        for _ in range(2):
            out, kept = call_with_kept_saves(block, (torch.randn(8, 64, requires_grad=True) * 1,), {},
                                             KeepPolicy(get_codec("int8"), False), "linear_inputs")
            assert kept == NOTHING
            out.sum().backward()
    assert len([w for w in caught if "linear_inputs" in str(w.message)]) == 1


def test_offload_with_the_exact_codec_and_linear_inputs_sends_those_alone():
    block = linear_gelu_linear()
    out, kept = call_with_kept_saves(block, (torch.randn(8, 64, requires_grad=True) * 1,), {}, keep(offload=True),
                                     "linear_inputs")
    assert kept == actsave.kept_bytes() == {"device": 0, "host": (8 * 64 + 8 * 256) * 4}
    out.sum().backward()
    assert_nothing_held()


def test_every_save_is_kept_by_the_codec_by_default():
    block, codec = linear_gelu_linear(), RecordingInt8()
    out, kept = call_with_kept_saves(block, (torch.randn(8, 64, requires_grad=True) * 1,), {}, KeepPolicy(codec, False))
    assert codec.encoded == [((8, 64), False), ((8, 256), False), ((8, 256), False)]  # GELU's input too
    assert kept["device"] == codes_and_scales(8 * 64) + 2 * codes_and_scales(8 * 256)
    del out


def test_a_linear_input_saved_before_its_linear_is_kept_once_by_the_codec():
    # The ReLU saves its output before the second Linear takes it: converted as the
    # Linear starts, one copy for both, with its ReLU decisions, on the unsigned grid.
    torch.manual_seed(0)
    block, codec = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64)), RecordingInt8()
    x = torch.randn(8, 64)
    expected = gradients([block], x, None)
    out, kept = call_with_kept_saves(block, (x.requires_grad_() * 1,), {}, KeepPolicy(codec, False),
                                     "linear_inputs")
    assert codec.encoded == [((8, 64), False), ((8, 64), True)]
    assert kept["device"] == 2 * codes_and_scales(8 * 64) + 8 * 64 // 8
    del out
    # Here the first Linear's input is the batch, held: only the second Linear's weight
    # gradient reads an encoded save; the ReLU's decisions are exact.
    got = gradients([block], x, KeepPolicy(codec, False), "linear_inputs")
    assert min(sqnr_db(e, g) for e, g in zip(expected, got)) >= 33


def test_views_of_one_storage_cross_the_bus_once():
    # exp saves y; the product saves two slices of it, sin its transpose: one span, the
    # bytes of y, goes to the host; each view comes back as it was.
    def function(x, scale):
        y = x.exp()
        return (y[:, :4] * y[:, 4:]).sum() + y.t().sin().sum() * scale

    x = torch.randn(6, 8)
    plain = x.clone().requires_grad_()
    function(plain, scale=2.0).backward()
    kept_x = x.clone().requires_grad_()
    out, kept = call_with_kept_saves(function, (kept_x,), {"scale": 2.0}, keep(offload=True))
    assert kept == actsave.kept_bytes() == {"device": 0, "host": 6 * 8 * 4}
    out.backward()
    assert torch.equal(plain.grad, kept_x.grad)
    assert_nothing_held()


def test_offloaded_saves_leave_the_device_when_the_tape_lets_them_go():
    block, outputs = linear_gelu_linear(), []
    block[0].register_forward_hook(lambda module, args, out: outputs.append(out.untyped_storage()))
    out, kept = call_with_kept_saves(block, (torch.randn(8, 64, requires_grad=True),), {}, keep(offload=True))
    gelu_input = weakref.ref(outputs.pop())  # what GELU saved
    assert kept == actsave.kept_bytes() == {"device": 0, "host": 2 * 8 * 256 * 4}  # both GELU's sides
    tape = current_tape()
    tape.segment_starts()  # the next block starts: the group's copy overlaps it...
    assert gelu_input() is not None
    tape.segment_starts()  # ...and its device memory goes as the one after starts
    assert gelu_input() is None
    out.sum().backward()
    assert_nothing_held()


class _Event:
    def __init__(self, name):
        self.name = name

    def query(self):
        return True

    def synchronize(self):
        pass


class LoggingEngine(HostCopyEngine):
    """Synchronous copies, logged: each group named by the order of its copy out."""

    def __init__(self):
        self.log, self._names = [], {}

    def to_host_all(self, pairs):
        super().to_host_all(pairs)
        name = self._names[pairs[0][1].untyped_storage().data_ptr()] = len(self._names) + 1
        self.log.append(("to_host", name))
        return _Event(name)

    def to_device(self, host):
        name = self._names[host.untyped_storage().data_ptr()]
        self.log.append(("to_device", name))
        return super().to_device(host)[0], _Event(name)

    def wait(self, event):
        self.log.append(("wait", event.name))

    def free_after(self, event):
        pass


@pytest.mark.parametrize("depth, expected", [
    (1, [("to_device", 2), ("to_device", 1), ("wait", 2), ("wait", 1)]),
    (0, [("to_device", 2), ("wait", 2), ("to_device", 1), ("wait", 1)]),
])
def test_each_call_is_one_group_fetched_once_and_prefetched_by_the_tape(monkeypatch, depth, expected):
    engine, tape = LoggingEngine(), PrefetchTape(depth=depth)
    monkeypatch.setattr(actsave.offload.offloaded, "copy_engine_for", lambda device: engine)
    monkeypatch.setattr(kept_saves, "current_tape", lambda: tape)
    blocks, x = transformer_blocks(), torch.randn(4, 6, 32)
    loss = kept_forward(blocks, x.requires_grad_(), keep("int8", offload=True)).square().sum()
    assert engine.log == [("to_host", 1), ("to_host", 2)]  # one copy out per call
    engine.log.clear()
    loss.backward(retain_graph=True)
    loss.backward()  # the saves fetched the first time serve the second backward
    assert engine.log == expected  # the second block's group first, the first's brought ahead
    assert_nothing_held()


POLICIES = {"int8": keep("int8"), "int8_host": keep("int8", offload=True), "exact_host": keep(offload=True)}


@pytest.mark.parametrize("scope", kept_saves.SCOPES)
@pytest.mark.parametrize("policy", POLICIES)
def test_memory_is_released_after_backward_and_with_a_graph_dropped_unused(policy, scope):
    blocks, x = transformer_blocks(), torch.randn(4, 6, 32, requires_grad=True)
    out = kept_forward(blocks, x * 1, POLICIES[policy], scope)
    assert sum(actsave.kept_bytes().values()) > 0
    out.sum().backward()
    assert_nothing_held()
    out = kept_forward(blocks, x * 1, POLICIES[policy], scope)
    del out
    assert_nothing_held()


class _RMSNormMLP(nn.Module):
    """A Llama-style block: rsqrt of a (..., 1) statistic and sqrt save results a lossy
    codec leaves exact, each its own node's output."""

    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(32, 64), nn.Linear(64, 32)

    def forward(self, x):
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        return self.down(torch.sqrt(self.up(x).square() + 1))


@pytest.mark.parametrize("scope", kept_saves.SCOPES)
@pytest.mark.parametrize("policy", POLICIES)
def test_a_graph_dropped_without_backward_is_freed(policy, scope):
    torch.manual_seed(0)
    blocks, x = [_RMSNormMLP(), _RMSNormMLP()], torch.randn(4, 6, 32, requires_grad=True)
    out = kept_forward(blocks, x * 1, POLICIES[policy], scope)
    assert sum(actsave.kept_bytes().values()) > 0
    del out
    gc.collect()  # a cycle through autograd's graph is one the collector does not see either
    assert_nothing_held()


@pytest.mark.parametrize("policy", POLICIES)
def test_a_forward_that_raises_keeps_nothing(policy):
    class Boom(nn.Module):
        def forward(self, x):
            raise RuntimeError("boom")

    block = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), Boom())
    with pytest.raises(RuntimeError, match="boom"):
        call_with_kept_saves(block, (torch.randn(4, 8, requires_grad=True) * 1,), {}, POLICIES[policy])
    assert_nothing_held()


@pytest.mark.parametrize("scope", kept_saves.SCOPES)
@pytest.mark.parametrize("policy", POLICIES)
def test_a_weight_changed_in_place_before_backward_raises_as_nn_sequential_does(policy, scope):
    blocks, x = transformer_blocks(), torch.randn(4, 6, 32, requires_grad=True)
    loss = kept_forward(blocks, x * 1, POLICIES[policy], scope).square().sum()
    with torch.no_grad():
        blocks[1].fc2.weight.mul_(0.5)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


@pytest.mark.parametrize("scope", kept_saves.SCOPES)
@pytest.mark.parametrize("policy", POLICIES)
def test_retain_graph_runs_backward_twice(policy, scope):
    blocks, x = transformer_blocks(), torch.randn(4, 6, 32)
    once = gradients(blocks, x, POLICIES[policy], scope)
    twice = gradients(blocks, x, POLICIES[policy], scope, backwards=2)
    assert all(torch.equal(2 * a, b) for a, b in zip(once, twice))
    assert_nothing_held()


class _UnderHooks(nn.Module):
    """``model`` run under the caller's saved-tensor hooks made by ``hooks``."""

    def __init__(self, model: nn.Module, hooks):
        super().__init__()
        self.model, self.hooks = model, hooks

    def forward(self, x):
        with self.hooks():
            return self.model(x)


def gelu_mlp() -> list:
    torch.manual_seed(0)
    return [m for _ in range(4) for m in (nn.Linear(128, 128), nn.GELU())]


KEPT_SAVES_MODELS = {
    "saves": lambda: actsave.Checkpoint(nn.Sequential(*gelu_mlp()), keep="saves", compress="int8"),
    "linear_inputs": lambda: actsave.Checkpoint(nn.Sequential(*gelu_mlp()), keep="linear_inputs", compress="int8"),
    "last_segment": lambda: last_segment_only(*gelu_mlp()),
}
CALLERS_HOOKS = {"identity": lambda: torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t),
                 "save_on_cpu": torch.autograd.graph.save_on_cpu}


@pytest.mark.parametrize("hooks", CALLERS_HOOKS)
@pytest.mark.parametrize("model", KEPT_SAVES_MODELS)
def test_under_the_callers_saved_tensor_hooks_a_codec_keeps_the_bytes_and_peak_it_keeps_without(model, hooks):
    x = torch.randn(256, 128)
    measured = {}
    for name, make in (("without", contextlib.nullcontext), ("under", CALLERS_HOOKS[hooks])):
        step = _UnderHooks(KEPT_SAVES_MODELS[model](), make)
        out = step(x.clone().requires_grad_())
        kept = actsave.kept_bytes()
        out.square().sum().backward()
        gradients = [p.grad.clone() for p in step.parameters()]
        measured[name] = (kept, peak_activation_bytes(step, x.clone().requires_grad_()), gradients)
    (kept, peak, expected), (kept_under, peak_under, got) = measured["without"], measured["under"]
    assert kept["device"] > 0 and (kept_under, peak_under) == (kept, peak)
    assert all(torch.equal(e, g) for e, g in zip(expected, got))
    assert_nothing_held()


class _CountingHooks(torch.autograd.graph.saved_tensors_hooks):
    """A caller's identity saved-tensor hooks that count the saves they are given."""

    def __init__(self):
        self.count = 0
        super().__init__(self._pack, lambda t: t)

    def _pack(self, tensor):
        self.count += 1
        return tensor


def hooked_step(block, x, policy, hooks=None) -> tuple:
    """``(kept, gradients)`` of ``x.sin()`` then ``block`` kept by ``policy``, under
    ``hooks`` (None: none)."""
    block, x = copy.deepcopy(block), x.detach().clone().requires_grad_()
    with hooks or contextlib.nullcontext():  # allow_mutation_on_saved_tensors: backward inside
        out, kept = call_with_kept_saves(block, (x.sin(),), {}, policy)
        out.square().sum().backward()
    return kept, [x.grad] + [p.grad for p in block.parameters()]


@pytest.mark.parametrize("hooks", ["counting", "save_on_cpu", "allow_mutation_on_saved_tensors"])
@pytest.mark.parametrize("policy", POLICIES)
def test_under_the_callers_saved_tensor_hooks_a_call_keeps_its_saves_as_without_them(policy, hooks):
    # NOTE [ Kept saves ]: innermost hooks win, as a checkpoint's do. The saves outside
    # the call (sin's input, square's) still go to the caller's hooks.
    blocks, x = transformer_blocks(), torch.randn(4, 6, 32)
    expected_kept, expected = hooked_step(blocks[0], x, POLICIES[policy])
    callers = _CountingHooks() if hooks == "counting" else getattr(torch.autograd.graph, hooks)()
    kept, got = hooked_step(blocks[0], x, POLICIES[policy], callers)
    assert kept == expected_kept and sum(kept.values()) > 0
    assert all(torch.equal(e, g) for e, g in zip(expected, got))
    assert hooks != "counting" or callers.count == 2
    assert_nothing_held()


def test_under_the_callers_saved_tensor_hooks_an_exact_call_on_the_device_is_a_plain_call():
    blocks, x = transformer_blocks(), torch.randn(4, 6, 32)
    plain, callers = _CountingHooks(), _CountingHooks()
    with plain:
        blocks[0](x.requires_grad_().sin()).square()
    kept, _ = hooked_step(blocks[0], x, keep(), callers)
    assert kept is None and callers.count == plain.count > 1  # every save is theirs, as plainly


@pytest.mark.parametrize("outer", ["torch", "actsave"])
@pytest.mark.parametrize("policy", POLICIES)
def test_inside_a_checkpoint_a_call_keeps_nothing_and_its_saves_are_recomputed_exactly(outer, policy):
    # The checkpoint drops the saves and recomputes them: kept too, they would only cost
    # memory; its forward and recompute must see the same saves, exact.
    blocks, x = transformer_blocks(), torch.randn(4, 6, 32)
    checkpoint = (lambda f, h: torch_checkpoint(f, h, use_reentrant=False)) if outer == "torch" else actsave.checkpoint
    results = {}
    for name in ("plain", "kept"):
        block, h, kept = copy.deepcopy(blocks[0]), x.clone().requires_grad_(), []

        def function(h):
            if name == "plain":
                return block(h)
            out, kept_bytes = call_with_kept_saves(block, (h,), {}, POLICIES[policy])
            kept.append(kept_bytes)
            return out

        out = checkpoint(function, h * 1)
        held = actsave.kept_bytes()
        out.square().sum().backward()
        results[name] = (held, kept, [h.grad] + [p.grad for p in block.parameters()])
    (plain_held, _, expected), (held, kept, got) = results["plain"], results["kept"]
    # The forward's call kept nothing; the recompute's stopped as the last save was made.
    assert kept == [None] and held == plain_held
    assert all(torch.equal(e, g) for e, g in zip(expected, got))
    assert_nothing_held()


def test_the_scope_is_checked():
    with pytest.raises(actsave.ConfigError, match="scope='linear'"):
        call_with_kept_saves(nn.Identity(), (torch.ones(1),), {}, keep("int8"), "linear")


# --- CUDA: the copy stream, real ------------------------------------------------------

@pytest.mark.cuda
@pytest.mark.parametrize("scope", kept_saves.SCOPES)
@pytest.mark.parametrize("codec", [None, "int8", "fp8"])
def test_cuda_saves_on_the_host_give_the_gradients_of_saves_on_the_device(codec, scope):
    blocks, x = [block.cuda() for block in transformer_blocks()], torch.randn(4, 6, 32, device="cuda")
    on_device = gradients(blocks, x, None if codec is None else keep(codec), scope)
    on_host = gradients(blocks, x, keep(codec, offload=True), scope)
    assert all(torch.equal(d, h) for d, h in zip(on_device, on_host))
    torch.cuda.synchronize()
    assert_nothing_held()


@pytest.mark.cuda
def test_cuda_saves_on_the_host_leave_device_memory():
    torch.manual_seed(0)
    blocks, x = [Block(1024).cuda() for _ in range(4)], torch.randn(8, 512, 1024, device="cuda", requires_grad=True)

    def forward_rise(policy) -> int:
        """Device memory the forward leaves allocated, once the tape has let go of what
        it copied (the two block starts that follow the last block)."""
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        out = kept_forward(blocks, x * 1, policy)
        current_tape().segment_starts()
        current_tape().segment_starts()
        torch.cuda.synchronize()
        rise = torch.cuda.memory_allocated() - before
        out.square().sum().backward()
        return rise

    plain, offloaded = forward_rise(None), forward_rise(keep(offload=True))
    # Each block saves 10 activations of 16 MiB (its input, the LayerNorm's output, and
    # 4 of GELU's on each side); offloaded, the output alone stays.
    assert plain >= 4 * 10 * (16 << 20)
    assert offloaded < 2 * (16 << 20)
    torch.cuda.synchronize()
    assert_nothing_held()


class _SavedThenChangedInPlace(nn.Module):
    """Saves h for a statistic whose node never runs in backward (a logged value),
    changes h in place, and saves it again: the second save holds other values."""

    def __init__(self, logged: bool):
        super().__init__()
        self.ln, self.probe, self.fc2, self.logged = nn.LayerNorm(64), nn.Linear(64, 1), nn.Linear(64, 64), logged

    def forward(self, x):
        h = self.ln(x)
        if self.logged:
            self.statistic = self.probe(h).mean().item()
        return self.fc2(h.tanh_())


@pytest.mark.parametrize("scope", ["all", "linear_inputs"])
def test_a_tensor_changed_in_place_between_two_saves_is_stored_again(scope):
    # One copy per storage holds only while the tensor is unchanged: the second save
    # must not decode to the values of the first (stored_once_key holds the version).
    grads = []
    for logged in (False, True):
        torch.manual_seed(0)
        block = _SavedThenChangedInPlace(logged)
        x = torch.randn(256, 64, generator=torch.Generator().manual_seed(1)) * 1
        y, _ = call_with_kept_saves(block, (x,), {}, KeepPolicy(get_codec("int8"), False), scope)
        (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
        grads.append([block.ln.weight.grad, block.fc2.weight.grad])
    # What the logged statistic saved is never read: the same gradients with it as without.
    assert all(torch.equal(a, b) for a, b in zip(*grads))


@pytest.mark.parametrize("codec", ["int8", "fp8"])
@pytest.mark.parametrize("scope", kept_saves.SCOPES)
def test_attention_saves_and_the_storage_of_its_output_are_held_exactly(codec, scope):
    # NOTE [ Attention's saves agree ]: the attention's backward reads the forward's q,
    # k, v, output and log-sum-exp, so the input's gradient, which no encoded save
    # enters, is plain's bit for bit; so is the output projection's weight gradient:
    # its input, a view of the attention output, is held exactly with it. Only the
    # qkv projection's input (the norm's output) is encoded.
    torch.manual_seed(0)
    block, x = AttentionBlock(), torch.randn(2, 16, 32)
    expected = gradients([block], x, None)
    got = gradients([block], x, keep(codec), scope)
    named = dict(zip(["input", *(name for name, _ in block.named_parameters())], zip(expected, got)))
    for name in ("input", "norm.weight", "qkv.bias", "out.weight", "out.bias"):
        assert torch.equal(*named[name]), name
    assert not torch.equal(*named["qkv.weight"])
    recording = RecordingInt8()
    out, kept = call_with_kept_saves(block, (x,), {}, KeepPolicy(recording, False), scope)
    assert recording.encoded == [((32, 32), False)]  # the 2-D view the Linear saves
    assert kept["device"] == codes_and_scales(2 * 16 * 32)
    del out
    assert_nothing_held()


@pytest.mark.parametrize("codec", ["int8", "fp8"])
@pytest.mark.parametrize("scope", kept_saves.SCOPES)
def test_sharp_attention_keeps_the_codecs_gradient_floor(codec, scope):
    # Decoded apart, q, k and v beside the exact log-sum-exp and the decoded output put
    # the worst gradient below the floor here (NOTE [ Attention's saves agree ]).
    blocks, x = sharp_gpt_blocks(), torch.randn(4, 32, 32, generator=torch.Generator().manual_seed(3))
    expected = gradients(blocks, x, None)
    got = gradients(blocks, x, keep(codec), scope)
    assert min(sqnr_db(e, g) for e, g in zip(expected, got)) >= EXPECTED_GRADIENT_SQNR_DB[get_codec(codec).name]
    assert_nothing_held()
