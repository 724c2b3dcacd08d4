"""Nested recompute (runtime/nested.py): exact gradients, RNG and module state as in a
plain step, each layer's recompute count, what is kept, and bad ranges."""

import pytest
import torch
from support import mixed_chain, twin
from torch import nn
from torch.utils.checkpoint import checkpoint

import actsave
from actsave import ConfigError
from actsave.planning.plan_record import Plan
from actsave.runtime.nested import Range, nested_call

R = Range

# Trees over 20 layers: one level, two levels with a stored first part, three levels,
# a recomputed last part, and an inner range starting with an in-place ReLU (layer 6).
TREES = {
    "plain": R(0, 20),
    "one level": R(0, 20, inner=(R(0, 5), R(5, 10), R(10, 20, recomputed=False))),
    "two levels": R(0, 20, inner=(R(0, 10, inner=(R(0, 3, recomputed=False), R(3, 10))), R(10, 13),
                                  R(13, 20, recomputed=False))),
    "three levels": R(0, 20, inner=(R(0, 12, inner=(R(0, 6, inner=(R(0, 2), R(2, 6, recomputed=False))),
                                                    R(6, 12, recomputed=False))), R(12, 20, recomputed=False))),
    "recomputed last": R(0, 20, inner=(R(0, 4, recomputed=False), R(4, 11), R(11, 20))),
    "in-place start": R(0, 20, inner=(R(0, 6), R(6, 20, recomputed=False))),
}


def step(layers, x, tree=None, seed=1):
    """One forward and backward (plain without ``tree``); returns the input gradient."""
    x = x.detach().clone().requires_grad_()
    torch.manual_seed(seed)
    if tree is None:
        out = x
        for layer in layers:
            out = layer(out)
    else:
        out, _ = nested_call(layers, tree, x)
    out.square().sum().backward()
    return x.grad


@pytest.mark.parametrize("name", list(TREES))
def test_gradients_rng_and_running_statistics_are_those_of_a_plain_step(name):
    # Linear, in-place ReLU, Dropout (RNG), BatchNorm (running statistics), GELU.
    layers = list(mixed_chain(width=16, repeats=4))
    plain = twin(nn.Sequential(*layers))
    x = torch.randn(32, 16)
    assert torch.equal(step(layers, x, TREES[name]), step(list(plain), x))
    for mine, theirs in zip(nn.Sequential(*layers).state_dict().values(), plain.state_dict().values()):
        assert torch.equal(mine, theirs)  # running statistics updated once
    for mine, theirs in zip(nn.Sequential(*layers).parameters(), plain.parameters()):
        assert torch.equal(mine.grad, theirs.grad)


class Counted(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear, self.calls = nn.Linear(8, 8), 0

    def forward(self, x):
        self.calls += 1
        return torch.tanh(self.linear(x))


def test_each_recomputed_range_runs_its_layers_once_more():
    layers = [Counted() for _ in range(6)]
    tree = R(0, 6, inner=(R(0, 4, inner=(R(0, 2), R(2, 4, recomputed=False))), R(4, 6, recomputed=False)))
    step(layers, torch.randn(4, 8), tree)
    # Forward, the top pass, the pass of [0, 4), the pass of [0, 2).
    assert [layer.calls for layer in layers] == [4, 4, 3, 3, 2, 2]


def test_keeps_only_the_input_until_backward_and_releases_everything():
    layers = [Counted() for _ in range(6)]
    x = torch.randn(4, 8, requires_grad=True)
    tree = R(0, 6, inner=(R(0, 3), R(3, 6, recomputed=False)))
    out, kept = nested_call(layers, tree, x * 1)
    assert kept == x.numel() * 4 == actsave.kept_bytes()["device"]
    out.sum().backward()
    assert actsave.kept_bytes()["device"] == 0


def test_a_second_backward_with_retain_graph_recomputes_nothing():
    layers = [Counted() for _ in range(6)]
    x = torch.randn(4, 8, requires_grad=True)
    out, _ = nested_call(layers, R(0, 6, inner=(R(0, 3), R(3, 6, recomputed=False))), x)
    first, = torch.autograd.grad(out.sum(), x, retain_graph=True)
    calls = [layer.calls for layer in layers]
    second, = torch.autograd.grad(out.sum(), x)
    assert torch.equal(first, second) and [layer.calls for layer in layers] == calls


def test_without_grad_it_runs_plainly():
    with torch.no_grad():
        out, kept = nested_call([Counted(), Counted()], R(0, 2), torch.randn(4, 8))
    assert kept == 0 and not out.requires_grad


@pytest.mark.parametrize("make, message", [
    (lambda: R(2, 2), "at least one layer"),
    (lambda: R(0, 4, recomputed=False, inner=(R(0, 2), R(2, 4))), "only a recomputed range"),
    (lambda: R(0, 4, inner=(R(0, 2), R(3, 4))), "contiguous"),
    (lambda: R(0, 4, inner=(R(0, 2), R(2, 3))), "contiguous"),
])
def test_bad_ranges_are_refused(make, message):
    with pytest.raises(ConfigError, match=message):
        make()


def test_a_range_that_does_not_cover_the_layers_is_refused():
    with pytest.raises(ConfigError, match="over all 3 layers"):
        nested_call([Counted() for _ in range(3)], R(0, 2), torch.randn(4, 8, requires_grad=True))


def test_a_nested_segment_refuses_a_module_placed_in_two_of_its_layers():
    block = nn.Sequential(nn.Linear(8, 8), nn.Tanh())
    with pytest.raises(actsave.ConfigError, match="cannot hold one module in two of its layers"):
        nested_call([block, nn.ReLU(), block], Range(0, 3, inner=(Range(0, 1), Range(1, 3, recomputed=False))),
                    torch.randn(4, 8, requires_grad=True))


def test_a_graph_dropped_without_backward_frees_what_it_kept_at_once(no_collector):
    # BatchNorm: a snapshot of its running statistics is kept beside the input.
    layers = list(mixed_chain(width=16, repeats=4))
    for _ in range(3):  # a validation pass without no_grad, a skipped step
        out, kept = nested_call(layers, TREES["two levels"], torch.randn(32, 16, requires_grad=True))
        assert kept > 0
        del out
        assert actsave.kept_bytes() == {"device": 0, "host": 0}


def test_inside_torch_checkpoint_a_backward_frees_what_it_kept_at_once(no_collector):
    # torch's recompute runs the nested call again, up to the square, whose save is
    # torch's: that frame's graph is dropped without a backward through it.
    layers = list(mixed_chain(width=16, repeats=4))
    x = torch.randn(32, 16, requires_grad=True)
    for _ in range(3):
        out = checkpoint(lambda x: nested_call(layers, TREES["one level"], x)[0].square(), x, use_reentrant=False)
        out.sum().backward()
        del out
        assert actsave.kept_bytes() == {"device": 0, "host": 0}


class GradientFeature(nn.Module):
    """Runs a backward inside its forward: its output adds the gradient of its
    activation's sum to its input (as a gradient penalty takes a gradient)."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x):
        y = torch.tanh(self.linear(x))
        g, = torch.autograd.grad(y.sum(), x, create_graph=True)
        return y + 0.1 * g


@pytest.mark.parametrize("tree", [
    R(0, 6, inner=(R(0, 2), R(2, 4, recomputed=False), R(4, 6))),  # in a stored range
    R(0, 6, inner=(R(0, 3), R(3, 6, recomputed=False))),  # in a recomputed one
    R(0, 6, inner=(R(0, 4, inner=(R(0, 2, recomputed=False), R(2, 4))), R(4, 6, recomputed=False))),  # deeper
], ids=["stored", "recomputed", "two levels"])
def test_a_layer_that_runs_a_backward_in_its_forward_trains_as_in_a_plain_step(tree):
    torch.manual_seed(0)
    layers = [nn.Linear(8, 8), nn.Tanh(), GradientFeature(), nn.Tanh(), nn.Linear(8, 8), nn.Tanh()]
    plain = twin(nn.Sequential(*layers))
    x = torch.randn(4, 8)
    assert torch.equal(step(layers, x, tree), step(list(plain), x))
    for mine, theirs in zip(nn.Sequential(*layers).parameters(), plain.parameters()):
        assert torch.equal(mine.grad, theirs.grad)


class Tap(nn.Module):
    """Notes a statistic and returns its input as it is."""

    def forward(self, x):
        self.mean = x.detach().mean()
        return x


# Over [Tap, Tap, in-place ReLU, Linear] x 3: ranges that start on a tap, whose in-place
# ReLU would change the input the range keeps by reference (or, in the range's own
# pass, the leaf it is restored as); a recomputed range of one tap hands its kept input
# (the segment's, in "tap first") on to the next range.
TAP_TREES = {
    "inner range": R(0, 12, inner=(R(0, 4, recomputed=False), R(4, 12))),
    "tap alone": R(0, 12, inner=(R(0, 4, recomputed=False), R(4, 5), R(5, 12, recomputed=False))),
    "two levels": R(0, 12, inner=(R(0, 8, inner=(R(0, 4), R(4, 8, recomputed=False))),
                                  R(8, 12, recomputed=False))),
    "tap first": R(0, 12, inner=(R(0, 1), R(1, 12, recomputed=False))),
    "plain": R(0, 12),
}


@pytest.mark.parametrize("name", list(TAP_TREES))
def test_ranges_starting_on_a_layer_that_hands_its_input_to_in_place_layers_train_as_plain(name):
    torch.manual_seed(0)
    layers = [layer for _ in range(3) for layer in (Tap(), Tap(), nn.ReLU(inplace=True), nn.Linear(8, 8))]
    plain = twin(nn.Sequential(*layers))
    x = torch.randn(4, 8)

    def run(tree):
        leaf = x.clone().requires_grad_()
        h = leaf * 1  # not a leaf: plain PyTorch's ReLU may change it in place
        out = nested_call(layers, tree, h)[0] if tree is not None else plain(h)
        out.square().sum().backward()
        return out, leaf.grad, h

    (out, grad, h), (plain_out, plain_grad, _) = run(TAP_TREES[name]), run(None)
    assert torch.equal(out, plain_out) and torch.equal(grad, plain_grad)
    assert torch.equal(h, x)  # the segment's input, kept by reference, is left as it is
    for mine, theirs in zip(nn.Sequential(*layers).parameters(), plain.parameters()):
        assert torch.equal(mine.grad, theirs.grad)
    assert actsave.kept_bytes()["device"] == 0


def test_an_inner_range_starting_on_a_tap_after_a_linear_trains_as_plain():
    # The range's own pass restores its input as a leaf that needs a gradient, which
    # autograd refuses to change in place: the ReLU after the tap changes a copy.
    torch.manual_seed(0)
    layers = [layer for _ in range(3) for layer in (nn.Linear(8, 8), Tap(), nn.ReLU(inplace=True))]
    plain = twin(nn.Sequential(*layers))
    x = torch.randn(4, 8)
    tree = R(0, 9, inner=(R(0, 4, recomputed=False), R(4, 9)))
    assert torch.equal(step(layers, x, tree), step(list(plain), x))
    for mine, theirs in zip(nn.Sequential(*layers).parameters(), plain.parameters()):
        assert torch.equal(mine.grad, theirs.grad)


@pytest.mark.parametrize("name", list(TAP_TREES))
def test_ranges_that_keep_a_private_copy_run_in_place_on_what_an_identity_hands_on_as_plain(name):
    # A range starting on nn.Identity before an in-place ReLU keeps a private copy of
    # its input, so its layers change the input itself, as plain PyTorch does, with no
    # second copy (the segment's input too: the caller's h changes as in a plain step).
    torch.manual_seed(0)
    layers = [layer for _ in range(3) for layer in (nn.Identity(), nn.Identity(), nn.ReLU(inplace=True),
                                                   nn.Linear(8, 8))]
    plain = twin(nn.Sequential(*layers))
    x = torch.randn(4, 8)

    def run(tree):
        leaf = x.clone().requires_grad_()
        h = leaf * 1
        out = nested_call(layers, tree, h, private_copy=True)[0] if tree is not None else plain(h)
        out.square().sum().backward()
        return out, leaf.grad, h

    (out, grad, h), (plain_out, plain_grad, plain_h) = run(TAP_TREES[name]), run(None)
    assert torch.equal(out, plain_out) and torch.equal(grad, plain_grad) and torch.equal(h, plain_h)
    for mine, theirs in zip(nn.Sequential(*layers).parameters(), plain.parameters()):
        assert torch.equal(mine.grad, theirs.grad)
    assert actsave.kept_bytes()["device"] == 0


def test_a_range_run_without_grad_that_changes_a_view_of_its_input_in_place_trains_as_plain():
    # The skipped range makes a view of its input without grad and changes it in place;
    # the layers after it get that output as a tensor that requires grad.
    torch.manual_seed(0)
    layers = [nn.Linear(16, 16), nn.Unflatten(1, (4, 4)), nn.ReLU(inplace=True), nn.Flatten(), nn.Linear(16, 16)]
    plain = twin(nn.Sequential(*layers))
    x = torch.randn(4, 16)
    tree = R(0, 5, inner=(R(0, 1, recomputed=False), R(1, 3), R(3, 5, recomputed=False)))
    assert torch.equal(step(layers, x, tree), step(list(plain), x))
    for mine, theirs in zip(nn.Sequential(*layers).parameters(), plain.parameters()):
        assert torch.equal(mine.grad, theirs.grad)


class _Split(nn.Module):
    def forward(self, x):
        return x[:, :8], x[:, 8:]


class _Join(nn.Module):
    def forward(self, pair):
        return torch.cat([pair[0].tanh(), pair[1].sigmoid()], 1)


@pytest.mark.parametrize("cuts", [((0, 1, True), (1, 2, True), (2, 4, False)), ((0, 2, False), (2, 4, True))])
def test_inner_ranges_cut_where_a_layer_passes_a_tuple_are_refused(cuts):
    # A range keeps and recomputes from one tensor: such a cut raised a misleading
    # "not deterministic" RecomputeError in the backward, or an AttributeError.
    layers = [nn.Linear(16, 16), _Split(), _Join(), nn.Linear(16, 16), nn.Tanh()]
    plan = Plan(5, (0, 4), ("none",), (False,), 0, 0.0, 0,
                nested=(Range(0, 4, inner=tuple(Range(a, b, recomputed=r) for a, b, r in cuts)),))
    chain = actsave.CheckpointedSequential(*layers)
    chain.apply_plan(plan)
    with pytest.raises(ConfigError, match="cut where layer 2 starts, but layer 1 passes it a tuple"):
        chain(torch.randn(8, 16, requires_grad=True))


class _PoolOverTime(nn.Module):
    """A max pool over dim 1 of (batch, time, features): under no_grad it returns
    another memory layout than with grad (no indices kept)."""

    def forward(self, h):
        return nn.functional.max_pool1d(h.transpose(1, 2), 3, 1, 1).transpose(1, 2)


class _Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.attention = nn.MultiheadAttention(8, 2, batch_first=True)

    def forward(self, h):
        return self.attention(h, h, h, need_weights=False)[0]


@pytest.mark.parametrize("first", [_PoolOverTime, _Attention])
@pytest.mark.parametrize("second", [lambda: nn.Linear(8, 8), lambda: nn.LayerNorm(8)])
def test_a_range_run_for_its_output_runs_its_kernels_as_in_the_forward(first, second):
    """A recomputed range runs with grad, its saves dropped: under no_grad a max pool's
    layout and eval-mode attention's fast path differ, and the layers after them
    computed other bits (1e-8 off) or saved other tensors (a RecomputeError)."""
    torch.manual_seed(0)
    layers = [first(), second(), nn.Identity()]
    plain = twin(nn.Sequential(*layers))
    for model in (*layers, plain):
        model.eval()  # eval-mode attention: torch's fast path under no_grad
    x = torch.randn(3, 5, 8)
    tree = R(0, 3, inner=(R(0, 1), R(1, 3, recomputed=False)))
    assert torch.equal(step(layers, x, tree), step(list(plain), x))
    for mine, theirs in zip(nn.Sequential(*layers).parameters(), plain.parameters()):
        assert torch.equal(mine.grad, theirs.grad)
