"""The checkpoint frame: what is kept, when it is released, failure paths."""
import gc
import weakref

import pytest
import torch
from support import peak_activation_bytes
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

import actsave
from actsave.planning import plans
from actsave.runtime.function import checkpointed_call
from actsave.runtime.keep_rules import EXACT


def chain():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))


def test_returns_output_and_kept_bytes():
    x = torch.randn(3, 4, requires_grad=True)
    out, kept = checkpointed_call(chain(), (x,), {}, EXACT)
    assert kept == x.numel() * 4 == actsave.kept_bytes()["device"]
    out.sum().backward()
    assert actsave.kept_bytes()["device"] == 0


def test_no_grad_runs_plainly():
    with torch.no_grad():
        out, kept = checkpointed_call(chain(), (torch.randn(3, 4),), {}, EXACT)
    assert kept == 0 and not out.requires_grad


def test_failed_recompute_releases_what_it_kept():
    calls = []

    def flaky(x):
        calls.append(1)
        if len(calls) == 2:
            raise ValueError("boom in recompute")
        return torch.tanh(x)

    out, _ = checkpointed_call(flaky, (torch.randn(3, 4, requires_grad=True),), {}, EXACT)
    with pytest.raises(ValueError, match="boom in recompute"):
        out.sum().backward()
    assert actsave.kept_bytes() == {"device": 0, "host": 0}


def test_exception_in_forward_leaves_nothing_kept():
    def broken(x):
        torch.tanh(x)
        raise ValueError("boom in forward")

    with pytest.raises(ValueError, match="boom in forward"):
        checkpointed_call(broken, (torch.randn(3, 4, requires_grad=True),), {}, EXACT)
    assert actsave.kept_bytes() == {"device": 0, "host": 0}


def test_partial_backward_then_full_backward_with_retained_graph():
    model = chain()
    x = torch.randn(3, 4, requires_grad=True)
    hidden = torch.sin(x)
    out, _ = checkpointed_call(model, (hidden,), {}, EXACT)
    loss = out.square().sum()
    (g_hidden,) = torch.autograd.grad(loss, [hidden], retain_graph=True)
    loss.backward()
    expected_hidden = torch.autograd.grad(model(hidden).square().sum(), [hidden])[0]
    assert torch.equal(g_hidden, expected_hidden)
    assert torch.equal(x.grad, expected_hidden * torch.cos(x))


def test_recompute_runs_once_even_for_several_backwards():
    calls = []

    def counted(x):
        calls.append(1)
        return torch.tanh(torch.tanh(x))

    out, _ = checkpointed_call(counted, (torch.randn(3, 4, requires_grad=True),), {}, EXACT)
    loss = out.sum()
    loss.backward(retain_graph=True)
    loss.backward()
    assert len(calls) == 2  # forward, one recompute


class _ProbeSaved(torch.autograd.Function):
    """Saves its input; its backward notes whether that tensor's storage is still held
    once the backward lets go of it."""

    held_after_use = []

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        (saved,) = ctx.saved_tensors
        storage = StorageWeakRef(saved.untyped_storage())
        del saved
        _ProbeSaved.held_after_use.append(not storage.expired())
        return grad * 2


def _probed(x):
    return _ProbeSaved.apply(torch.sin(x))  # the sine is recomputed, then saved by the probe


def test_a_recomputed_tensor_is_freed_as_soon_as_the_node_that_unpacks_it_lets_go():
    # NOTE [ Lifetime of kept inputs ]: held to the end of the node, it cost one
    # activation at the peak of a CUDA matmul's backward.
    _ProbeSaved.held_after_use.clear()
    x = torch.randn(3, 4, requires_grad=True)
    actsave.checkpoint(_probed, x).sum().backward()
    assert _ProbeSaved.held_after_use == [False]
    assert torch.equal(x.grad, 2 * torch.cos(x))


def test_a_backward_that_keeps_the_graph_keeps_recomputed_tensors_for_the_next():
    _ProbeSaved.held_after_use.clear()
    x = torch.randn(3, 4, requires_grad=True)
    loss = actsave.checkpoint(_probed, x).sum()
    loss.backward(retain_graph=True)
    loss.backward()
    assert _ProbeSaved.held_after_use == [True, False]
    assert torch.equal(x.grad, 4 * torch.cos(x))


# --- a backward inside the checkpointed function ------------------------------------
# NOTE [ Backward inside a checkpointed forward ] in actsave/function.py.


def gradient_penalty(x):
    (g,) = torch.autograd.grad(x.sin().sum(), x, create_graph=True)
    return x.sin() * g


def checkpointed(f):
    return lambda x: actsave.checkpoint(f, x)


def grad_of(f):
    def df(x):
        (g,) = torch.autograd.grad(f(x).sum(), x, create_graph=True)
        return g

    return df


def input_grad(f, x):
    x = x.detach().requires_grad_()
    return torch.autograd.grad(f(x).sum(), x)[0]


def test_autograd_grad_inside_the_function_gives_torchs_gradient():
    x = torch.randn(6)
    assert torch.equal(input_grad(checkpointed(gradient_penalty), x), input_grad(gradient_penalty, x))
    assert actsave.kept_bytes()["device"] == 0


def test_autograd_grad_inside_a_lossy_checkpoint_is_exact_in_the_forward():
    # The backward inside the forward recomputes from the caller's exact inputs, not
    # from the int8 copy: the value the function returns is the plain one.
    x = torch.randn(6, requires_grad=True) * 2  # not a leaf: int8 stores it
    out = actsave.checkpoint(gradient_penalty, x, compress="int8")
    assert torch.equal(out, gradient_penalty(x))


class _PenaltyOfItsHidden(nn.Module):
    """Runs a backward of its own: the gradient of its output by its hidden layer."""

    def __init__(self):
        super().__init__()
        self.first, self.second = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x):
        h = self.first(x)
        y = torch.tanh(self.second(h))
        (g,) = torch.autograd.grad(y.pow(2).sum(), h, create_graph=True)
        return y + g


def test_autograd_grad_inside_a_function_that_starts_in_place_leaves_its_kept_copy_as_it_was():
    # Its input needs no grad, so the copy actsave keeps (the first layer changes the
    # caller's input) is restored as it is: the backward inside the forward must not
    # change it for the backward's recompute.
    def layers():
        torch.manual_seed(0)
        return nn.LeakyReLU(0.1, inplace=True), _PenaltyOfItsHidden(), nn.Linear(16, 16)

    x = torch.randn(4, 16)
    relu, block, head = layers()
    plain = nn.Sequential(relu, block, head)
    relu, block, head = layers()
    checkpointed_block = nn.Sequential(actsave.Checkpoint(nn.Sequential(relu, block)), head)
    chain = actsave.CheckpointedSequential(*layers(), segments=[0, 2])
    for model in (plain, checkpointed_block, chain):
        model(x.clone()).pow(2).sum().backward()
    expected = [p.grad for p in plain.parameters()]
    for model in (checkpointed_block, chain):
        assert all(torch.equal(a, b) for a, b in zip(expected, (p.grad for p in model.parameters())))


def test_autograd_grad_inside_a_lossy_function_that_starts_in_place_raises_naming_the_way_out():
    # Its input as it was is kept only by the codec: the forward would run on decoded values.
    torch.manual_seed(0)
    model = actsave.Checkpoint(nn.Sequential(nn.ReLU(inplace=True), _PenaltyOfItsHidden()), compress="int8")
    with pytest.raises(actsave.ConfigError, match="inplace=False"):
        model(torch.randn(8, 16, requires_grad=True) * 1)


def no_checkpoint(f):
    return f


@pytest.mark.parametrize("compose", [
    lambda c, f: c(grad_of(grad_of(c(f)))),
    lambda c, f: grad_of(c(grad_of(c(f)))),
    lambda c, f: c(c(grad_of(f))),
    lambda c, f: grad_of(grad_of(c(c(f)))),
], ids=["c(g(g(c(f))))", "g(c(g(c(f))))", "c(c(g(f)))", "g(g(c(c(f))))"])
def test_higher_order_nesting_gives_torchs_gradient(compose):
    def f(x):
        return x.sin().exp().sin()

    x = torch.randn(5)
    got = input_grad(compose(checkpointed, f), x)
    assert torch.equal(got, input_grad(compose(no_checkpoint, f), x))


# --- identity of inputs that need no grad ------------------------------------------


class SavesSecondInput(torch.autograd.Function):
    seen = []

    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(b)
        return a * b

    @staticmethod
    def backward(ctx, grad):
        (b,) = ctx.saved_tensors
        SavesSecondInput.seen.append(b)
        return grad * b, None


def test_saved_input_that_needs_no_grad_comes_back_as_the_same_object():
    a, b = torch.randn(4, requires_grad=True), torch.randn(4)
    SavesSecondInput.seen.clear()
    actsave.checkpoint(SavesSecondInput.apply, a, b).sum().backward()
    assert SavesSecondInput.seen[0] is b  # as under torch.utils.checkpoint
    assert torch.equal(a.grad, b)


class _MyRReLU(nn.RReLU):
    pass


@pytest.mark.parametrize("rrelu", [nn.RReLU, _MyRReLU], ids=["rrelu", "subclass"])
@pytest.mark.parametrize("wrapped", ["chain", "checkpoint"])
def test_a_training_rrelu_at_a_segments_end_is_recomputed_to_the_end(wrapped, rrelu):
    # RReLU saves its noise and then draws into it: a recompute stopped at that save
    # (the early stop) would leave the noise uninitialized, so it runs to the end.
    def layers():
        torch.manual_seed(0)
        return [nn.Linear(8, 8), rrelu(), nn.Linear(8, 8)]

    def step(model):
        torch.manual_seed(5)
        model(torch.randn(4, 8)).square().sum().backward()
        return [p.grad for p in model.parameters()]

    plain = step(nn.Sequential(*layers()))
    if wrapped == "chain":
        model = actsave.CheckpointedSequential(*layers(), segments=[0, 2])
    else:
        first, rrelu, last = layers()
        model = nn.Sequential(actsave.Checkpoint(nn.Sequential(first, rrelu)), last)
    assert all(torch.equal(a, b) for a, b in zip(plain, step(model)))


class _ChangesASave(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x):
        gate = torch.sigmoid(self.lin(x))  # sigmoid saves its output
        gate.mul_(2)  # and then it changes: nn.Sequential's backward raises
        return gate * x


@pytest.mark.parametrize("wrap", [
    lambda m: m,
    lambda m: actsave.Checkpoint(m),
    lambda m: actsave.Checkpoint(m, keep="selective"),
    lambda m: actsave.Checkpoint(m, compress="int8"),
    lambda m: actsave.CheckpointedSequential(m, nn.Identity(), segments=[0, 1]),
], ids=["plain", "inputs", "selective", "int8", "chain"])
def test_a_save_the_forward_changes_in_place_raises_as_nn_sequential_does(wrap):
    # The recompute runs the same change after its save: the placeholder bypasses
    # autograd's version check, which the unpack makes instead of a wrong gradient.
    model = wrap(_ChangesASave())
    out = model(torch.randn(8, 16, requires_grad=True))
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.pow(2).sum().backward()


def test_a_cache_the_forward_appends_to_is_named_in_the_recompute_error():
    # Hugging Face's use_cache=True in training: the recompute appends again, and the
    # attention then reads twice the keys.
    cache, lin = [], nn.Linear(8, 8)

    def attend(x):
        cache.append(lin(x))
        keys = torch.cat(cache)
        return (x @ keys.t()).softmax(-1) @ keys

    out, _ = checkpointed_call(attend, (torch.randn(4, 8, requires_grad=True),), {}, EXACT)
    with pytest.raises(actsave.RecomputeError, match="use_cache=False"):
        out.sum().backward()


class _Cache:
    def __init__(self):
        self.values = []


class _AppendsToACache(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x, cache):
        cache.values.append(torch.tanh(self.lin(x)))  # tanh saves its output
        return cache.values[-1] * x


@pytest.mark.parametrize("options", [dict(), dict(keep="selective"), dict(compress="int8"),
                                     dict(keep="saves", compress="int8")], ids=["inputs", "selective", "int8", "saves"])
def test_a_cache_the_recompute_appends_to_is_freed_with_the_step(options):
    # The cache, an argument the checkpoint keeps, holds what the recompute appends, and
    # so the recompute's graph and its pack hooks: were those to hold the frame, the
    # cycle (through autograd's graph, which Python's collector does not see) would keep
    # the cache and the step's kept inputs for good. torch's checkpoint frees them.
    block, cache = actsave.Checkpoint(_AppendsToACache(), **options), _Cache()
    block(torch.randn(4, 8, requires_grad=True), cache).sum().backward()
    freed = weakref.ref(cache)
    del cache
    gc.collect()
    assert freed() is None
    assert actsave.kept_bytes() == {"device": 0, "host": 0}


def in_place_relus_on_views(blocks: int = 6) -> list:
    torch.manual_seed(0)
    return [m for _ in range(blocks) for m in (nn.Linear(64, 64), nn.ReLU(inplace=True))]


@pytest.mark.parametrize("codec", ["int8", "none"])
def test_a_segment_ending_in_an_in_place_relu_on_a_view_recomputes_within_its_plan(codec):
    # A Linear on a 3-D input returns a view; the in-place ReLU on it makes the output's
    # node a view's, whose backward makes the base's gradient and CopySlices two copies
    # before the ReLU's save is unpacked. The recompute runs before them, under the
    # output's gradient alone, as the plan counts it (NOTE [ Segment checkpoint
    # mechanism ]); gradients stay plain's where the chain is exact.
    x = torch.randn(8, 32, 64)
    model = actsave.CheckpointedSequential(*in_place_relus_on_views())
    plan = plans.predict(actsave.profile(model, (x,)), [0, 2, 4, 6, 8, 10], [codec] * 5)
    model.apply_plan(plan)
    assert peak_activation_bytes(model, x) <= plan.predicted_peak_bytes + 256
    if codec == "none":
        plain = nn.Sequential(*in_place_relus_on_views())
        for m in (model, plain):
            for p in m.parameters():
                p.grad = None
            m(x).sum().backward()
        assert all(torch.equal(a.grad, b.grad) for a, b in zip(model.parameters(), plain.parameters()))


@pytest.mark.parametrize("backward", ["in the level", "after it"])
def test_a_backward_through_a_dual_input_says_the_recompute_has_no_tangents(backward):
    # After it: the level is closed by the backward, so the forward's is named.
    import torch.autograd.forward_ad as forward_ad
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
    x = torch.randn(5, 8, requires_grad=True)
    raises = pytest.raises(actsave.RecomputeError,
                           match=r"Forward-mode AD was on \(in the forward or the backward\).*torch.utils.checkpoint")
    with forward_ad.dual_level():
        out = forward_ad.unpack_dual(actsave.checkpoint(model, forward_ad.make_dual(x, torch.randn(5, 8)))).primal
        if backward == "in the level":
            with raises:
                out.sum().backward()
    if backward == "after it":
        with raises:
            out.sum().backward()


@pytest.mark.parametrize("keep", ["inputs", "selective"])
def test_an_error_of_the_functions_code_in_the_recompute_names_the_recompute(keep):
    # The recompute's input is a leaf of its own (docs/limits.md, "What a recompute's
    # input is"): a forward that reads its input's grad_fn fails there, inside the backward.
    class Watched(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(8, 8)

        def forward(self, x):
            x.grad_fn.register_prehook(lambda gradients: None)
            return self.linear(x).tanh()

    y = actsave.Checkpoint(Watched(), keep=keep)(torch.randn(2, 8, requires_grad=True) * 2)
    with pytest.raises(AttributeError) as raised:
        y.sum().backward()
    assert any("recomputing" in note and "What a recompute's input is" in note for note in raised.value.__notes__)


def test_a_forward_that_freezes_a_weight_after_using_it_is_told_why_its_recompute_differs():
    class FreezesAfterUse(nn.Module):
        def __init__(self):
            super().__init__()
            self.first, self.second = nn.Linear(16, 16), nn.Linear(16, 16)

        def forward(self, x):
            h = self.first(x)
            self.first.weight.requires_grad_(False)  # a freeze schedule inside forward
            return self.second(torch.tanh(h))

    y = actsave.Checkpoint(FreezesAfterUse())(torch.randn(4, 16, requires_grad=True) * 1)
    with pytest.raises(actsave.RecomputeError, match="changes a parameter's requires_grad after using it"):
        y.sum().backward()
