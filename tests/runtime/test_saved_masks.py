"""A lossy recompute's masks compared with the forward's (runtime/saved_masks.py,
NOTE [ Masks a lossy recompute compares ])."""
import pytest
import torch
from torch import nn

import actsave
from actsave.errors import RecomputeError
from support import sqnr_db


class _Masked(nn.Module):
    """A Linear, a mask on its output's sign (a decision on decoded values in a lossy
    recompute), and ``select`` of the output by it."""

    def __init__(self, select):
        super().__init__()
        self.lin, self.select = nn.Linear(64, 64), select

    def forward(self, x):
        a = self.lin(x)
        return self.select(torch.tanh(a), a > 0)


SELECTS = {"masked_select": torch.masked_select, "indexing": lambda y, m: y[m],
           "where": lambda y, m: torch.where(m, y, 0.0), "masked_fill": lambda y, m: y.masked_fill(m, 0.0)}


def _grads(select, **options):
    """The gradients of a step through a Linear and the block, checkpointed with
    ``options`` (its input, made in the step, is the codec's to keep)."""
    torch.manual_seed(0)
    before, block, x = nn.Linear(64, 64), _Masked(select), torch.randn(64, 64)
    h = before(x)
    output = block(h) if not options else actsave.checkpoint(block, h, **options)
    (output * torch.linspace(-1, 1, output.numel()).view_as(output)).sum().backward()
    return [p.grad for p in (*before.parameters(), *block.parameters())]


@pytest.mark.parametrize("keep", ["inputs", "selective"])
@pytest.mark.parametrize("select", ["masked_select", "indexing"])
def test_a_mask_the_lossy_recompute_counts_otherwise_raises_where_its_backward_gathers_by_it(select, keep):
    # masked_select's backward scattered the forward's gradient onto the recompute's
    # elements, silently (every gradient at -1.2 to -1.8 dB); indexing's raised torch's
    # shape error.
    with pytest.raises(RecomputeError, match="with other elements True than its forward's"):
        _grads(SELECTS[select], compress="int8", keep=keep)


@pytest.mark.parametrize("select", ["where", "masked_fill"])
def test_a_mask_counted_otherwise_decides_again_where_its_backward_goes_element_by_element(select):
    plain = _grads(SELECTS[select])
    lossy = _grads(SELECTS[select], compress="int8")
    assert min(sqnr_db(p, q) for p, q in zip(plain, lossy)) > 15  # decisions taken again, not misaligned


@pytest.mark.parametrize("select", SELECTS)
def test_an_exact_recompute_counts_no_mask_and_is_bit_identical(select):
    plain = _grads(SELECTS[select])
    exact = _grads(SELECTS[select], keep="inputs")
    assert all(torch.equal(p, q) for p, q in zip(plain, exact))


def test_a_lossy_forward_keeps_one_bit_per_mask_element():
    # An eighth of the mask's bytes, beside the decisions: what kept_bytes counts of them.
    torch.manual_seed(0)
    before, x = nn.Linear(64, 64), torch.randn(8, 64)
    kept = {}
    for select in ("where", "none"):
        block = _Masked(SELECTS.get(select, lambda y, m: y))
        output = actsave.checkpoint(block, before(x), compress="int8")
        kept[select] = actsave.kept_bytes()["device"]
        del output
    assert kept["where"] - kept["none"] == 8 * 64 // 8


def test_a_lossy_step_on_meta_tensors_has_no_counts_to_compare():
    # estimate() runs the step on meta tensors: no values, so nothing to count (nonzero
    # raised NotImplementedError there).
    torch.manual_seed(0)
    chain = actsave.CheckpointedSequential(nn.Linear(64, 64), _Masked(SELECTS["where"]), nn.Linear(64, 64),
                                           segments=[0, 2], compress="int8")
    actsave.estimate(chain, [(4, 64)], device="cpu")
    chain.to("meta")(torch.empty(4, 64, device="meta", requires_grad=True)).sum().backward()


class _Thresholded(nn.Module):
    """``h[h > t]``, t one threshold per element."""

    def __init__(self, thresholds):
        super().__init__()
        self.register_buffer("thresholds", thresholds)

    def forward(self, h):
        return h.masked_select(h > self.thresholds)


def test_a_mask_with_as_many_true_elements_in_other_places_raises_where_its_backward_gathers_by_it():
    # One group of int8 codes whose step is 1 (its largest magnitude 127): 10.4 and 9.6
    # both decode to 10, so the recompute's mask drops element 1 and takes element 2,
    # as many True elements as the forward's. A count saw nothing, and masked_select's
    # backward put the gradient of element 1 on element 2, silently.
    h = torch.zeros(1, actsave.codecs.GROUP_SIZE)
    h[0, :3] = torch.tensor([127.0, 10.4, 9.6])
    thresholds = torch.full_like(h, 200.0)
    thresholds[0, 1:3] = torch.tensor([10.2, 9.8])
    h = (h * 1).requires_grad_()
    selected = actsave.checkpoint(_Thresholded(thresholds), h * 1, compress="int8")
    assert selected.detach().tolist() == [pytest.approx(10.4)]
    with pytest.raises(RecomputeError, match="with other elements True than its forward's"):
        selected.sum().backward()


class _Nonzero(_Thresholded):
    """``h`` at the indices of ``h > t``: a shape decided by the values."""

    def forward(self, h):
        rows, columns = (h > self.thresholds).nonzero().unbind(1)
        return h[rows, columns]


def test_a_shape_a_lossy_recompute_decides_otherwise_raises_naming_the_codec():
    # The recompute's nonzero found no element (10.4 decoded to 10, below 10.2): the
    # error blamed non-determinism and use_cache, and advised skipping the check.
    h = torch.zeros(1, actsave.codecs.GROUP_SIZE)
    h[0, :2] = torch.tensor([127.0, 10.4])
    thresholds = torch.full_like(h, 200.0)
    thresholds[0, 1] = 10.2
    h = (h * 1).requires_grad_()
    selected = actsave.checkpoint(_Nonzero(thresholds), h * 1, compress="int8")
    with pytest.raises(RecomputeError, match="kept by a lossy codec, and a shape decided by their values"):
        selected.sum().backward()


def _flipped_two_ways(select):
    """``select(h, h > t)`` checkpointed with int8 on the one group of
    test_a_mask_with_as_many_true_elements_in_other_places_raises..., where the
    recompute's mask drops element 1 and takes element 2."""
    h = torch.zeros(1, actsave.codecs.GROUP_SIZE)
    h[0, :3] = torch.tensor([127.0, 10.4, 9.6])
    thresholds = torch.full_like(h, 200.0)
    thresholds[0, 1:3] = torch.tensor([10.2, 9.8])
    h = (h * 1).requires_grad_()
    actsave.checkpoint(lambda h: select(h * h, h > thresholds), h * 1, compress="int8").sum().backward()
    return h.grad


def test_a_scatter_of_a_value_with_no_gradient_through_a_differing_mask_decides_again_as_masked_fill():
    # y[mask] = 0 scatters no gradient of a source: its backward goes element by element.
    put = _flipped_two_ways(lambda y, m: y.index_put((m,), torch.tensor(0.0)))
    filled = _flipped_two_ways(lambda y, m: y.masked_fill(m, 0.0))
    assert torch.equal(put, filled)


def test_a_mask_broadcast_along_dimensions_keeps_the_bits_of_its_own_elements():
    # A causal mask expanded over 4 samples and 16 heads kept the bits of all 64 copies.
    torch.manual_seed(0)
    causal = torch.ones(32, 32, dtype=torch.bool).triu(1)
    q = torch.randn(4, 16, 32, 8, requires_grad=True)

    def attention(q):
        scores = (q @ q.mT).masked_fill(causal.expand(4, 16, 32, 32), float("-inf"))
        return scores.softmax(-1) @ q

    kept = {}
    for compress in (None, "int8"):
        output = actsave.checkpoint(attention, q * 1, compress=compress)
        kept[compress] = actsave.kept_bytes()["device"]
        del output
    # q's codes, its fp32 scales and channel sums (NOTE [ Channel centering ]), the mask's bits.
    stored = q.numel() + 4 * -(-q.numel() // actsave.codecs.GROUP_SIZE) + 4 * q.shape[1]
    assert kept["int8"] == stored + 32 * 32 // 8
