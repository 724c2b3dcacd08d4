"""Selective recompute (actsave/runtime/selective.py): the outputs of linear layers and
attention kept, the rest recomputed, gradients bit-identical, no matmul run again."""
import copy
import functools
import gc
import warnings
import weakref

import pytest
import torch
import torch.nn.functional as F
from support import OpCounter, sqnr_db
from transformer_blocks import GPTBlock, LlamaBlock, rope, sharp_gpt_blocks, stack
from torch import nn
from torch.distributed._tools.mem_tracker import MemTracker
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts
from torch.utils.checkpoint import checkpoint as torch_checkpoint

import actsave
from actsave import ConfigError, devices
from actsave.codecs import EXPECTED_GRADIENT_SQNR_DB, get_codec
from actsave.runtime.keep_rules import KeepPolicy
from actsave.runtime.recompute_options import DEFAULT_RECOMPUTE
from actsave.runtime.kept_ops import KeptOps
from actsave.runtime import kept_nothing, selective
from actsave.runtime.selective import selective_call


def run(blocks, x, selective: bool, ops=KeptOps(), extra=()):
    for block in blocks:
        x = selective_call(block, (x, *extra), {}, ops, DEFAULT_RECOMPUTE)[0] if selective else block(x, *extra)
    return x


@pytest.mark.parametrize("kind", ["gpt", "llama", "gpt_dropout"])
def test_gradients_are_bit_identical_to_plain_and_no_matmul_or_attention_runs_again(kind):
    block = {"gpt": GPTBlock, "llama": LlamaBlock, "gpt_dropout": lambda: GPTBlock(dropout=0.2)}[kind]
    extra = rope() if kind == "llama" else ()
    plain, model = stack(block), stack(block)
    x = torch.randn(2, 16, 32)
    torch.manual_seed(7)
    run(plain, x.clone().requires_grad_(), False, extra=extra).square().sum().backward()
    torch.manual_seed(7)
    out = run(model, x.clone().requires_grad_(), True, extra=extra).square().sum()
    with OpCounter() as backward:
        out.backward()
    for (name, p), q in zip(plain.named_parameters(), model.parameters()):
        assert torch.equal(p.grad, q.grad), name
    # Linear's forward is addmm (with a bias) or mm (without); attention's its fused op.
    # The backward's matmuls are mm only where the forward used addmm.
    assert backward.counts["aten.addmm.default"] == 0
    assert not any("scaled_dot_product" in op and "backward" not in op for op in backward.counts)
    assert actsave.kept_bytes() == {"device": 0, "host": 0}


def test_it_keeps_less_than_the_plain_saves_and_counts_it_in_kept_bytes():
    torch.manual_seed(0)
    block = GPTBlock()
    x = torch.randn(2, 16, 32, requires_grad=True)
    out, kept = selective_call(block, (x * 1,), {}, KeptOps(), DEFAULT_RECOMPUTE)
    # qkv (3), attention's output (1) and log-sum-exp, proj (1) and fc1 (4) outputs, and
    # the input (1): 10 activations of 4 KiB and 512 B. Not fc2's output: the early stop
    # ends the recompute inside fc2's call, at its input's view, before it returns.
    activation = 2 * 16 * 32 * 4
    assert kept == 10 * activation + 2 * 4 * 16 * 4
    assert actsave.kept_bytes()["device"] == kept
    out.sum().backward()
    assert actsave.kept_bytes() == {"device": 0, "host": 0}


def test_without_the_early_stop_it_keeps_the_last_calls_output_which_the_recompute_then_returns():
    torch.manual_seed(0)
    plain, block = GPTBlock(), GPTBlock()
    block.load_state_dict(plain.state_dict())
    x = torch.randn(2, 16, 32)
    options = DEFAULT_RECOMPUTE.resolve(early_stop=False)
    out, kept = selective_call(block, (x.clone().requires_grad_(),), {}, KeptOps(), options)
    assert kept == 11 * (2 * 16 * 32 * 4) + 2 * 4 * 16 * 4  # fc2's output (1) too
    with OpCounter() as backward:
        out.square().sum().backward()
    plain(x.clone().requires_grad_()).square().sum().backward()
    for (name, p), q in zip(plain.named_parameters(), block.parameters()):
        assert torch.equal(p.grad, q.grad), name
    assert backward.counts["aten.addmm.default"] == 0  # fc2 skipped, its output returned


class InPlaceResidual(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x):
        out = self.lin(x)
        out += x  # changes the kept output: the call runs again in the recompute
        return torch.tanh(out)


def test_an_output_changed_in_place_after_its_call_is_recomputed_not_kept():
    torch.manual_seed(0)
    plain = InPlaceResidual()
    model = copy.deepcopy(plain)
    x = torch.randn(4, 16)
    plain(x.requires_grad_()).sum().backward()
    y = x.detach().clone().requires_grad_()
    out, _ = selective_call(model, (y,), {}, KeptOps(), DEFAULT_RECOMPUTE)
    with OpCounter() as backward:
        out.sum().backward()
    assert backward.counts["aten.addmm.default"] == 1  # run again
    assert torch.equal(plain.lin.weight.grad, model.lin.weight.grad) and torch.equal(x.grad, y.grad)


def test_a_weight_changed_before_backward_raises_as_nn_sequential_does():
    torch.manual_seed(0)
    block = GPTBlock()
    out, _ = selective_call(block, (torch.randn(2, 16, 32, requires_grad=True),), {}, KeptOps(), DEFAULT_RECOMPUTE)
    with torch.no_grad():
        block.fc2.weight.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


def test_a_second_backward_with_retain_graph_gives_the_same_gradients():
    torch.manual_seed(0)
    block = GPTBlock()
    x = torch.randn(2, 16, 32, requires_grad=True)
    out, _ = selective_call(block, (x,), {}, KeptOps(), DEFAULT_RECOMPUTE)
    out.sum().backward(retain_graph=True)
    first = x.grad.clone()
    out.sum().backward()
    assert torch.equal(x.grad, 2 * first)


@pytest.mark.parametrize("names, activations, matmuls_again", [
    # fc2 named or not, its output is not kept: its call is where the early stop ends the recompute.
    (("qkv", "proj", "fc1"), 10, 0),
    (("qkv", "fc1", "fc2"), 9, 1),  # proj's output: its matmul runs again, for the residual ln2 reads
    (("qkv", "proj", "fc2"), 6, 1),  # fc1's: four activations, one matmul again
    (("fc1",), 6, 2),  # qkv and proj run again, fc2 not (the early stop)
])
def test_module_names_keep_only_the_named_linear_layers(names, activations, matmuls_again):
    torch.manual_seed(0)
    plain, block = GPTBlock(), GPTBlock()
    block.load_state_dict(plain.state_dict())
    x = torch.randn(2, 16, 32)
    plain(x.clone().requires_grad_()).square().sum().backward()
    out, kept = selective_call(block, (x.clone().requires_grad_() * 1,), {}, KeptOps(module_names=names),
                               DEFAULT_RECOMPUTE)
    # Beside the named layers' outputs: the input and attention's output and log-sum-exp.
    assert kept == activations * 2 * 16 * 32 * 4 + 2 * 4 * 16 * 4
    with OpCounter() as backward:
        out.square().sum().backward()
    assert backward.counts.get("aten.addmm.default", 0) == matmuls_again
    for (name, p), q in zip(plain.named_parameters(), block.parameters()):
        assert torch.equal(p.grad, q.grad), name


def test_module_names_match_the_end_of_a_qualified_name_and_say_which_exist():
    block = nn.Sequential(GPTBlock())
    x = torch.randn(2, 16, 32, requires_grad=True)
    assert selective_call(block, (x * 1,), {}, KeptOps(module_names="0.fc1"), DEFAULT_RECOMPUTE)[1] == \
        selective_call(block, (x * 1,), {}, KeptOps(module_names="fc1"), DEFAULT_RECOMPUTE)[1]
    with pytest.raises(ConfigError, match=r"names \['c1'\], which match no module.*'0.fc1', '0.fc2', '0.proj'"):
        selective_call(block, (x * 1,), {}, KeptOps(module_names=("fc2", "c1")), DEFAULT_RECOMPUTE)
    with pytest.raises(ConfigError, match="pass qualified module names"):
        KeptOps(module_names=())
    with pytest.raises(ConfigError, match=r"chooses among the modules of the types in modules, and there are none"):
        KeptOps(modules=(), module_names=("fc1",))


def test_module_names_inside_a_wrapped_child_are_spelled_as_its_state_dict_spells_them():
    # The wrapper's child (_checkpoint_wrapped_module) is left out, as state_dict leaves it.
    block = nn.Sequential(GPTBlock())
    actsave.wrap(block, GPTBlock)
    assert "0.fc1.weight" in block.state_dict()
    x = torch.randn(2, 16, 32, requires_grad=True)
    assert selective_call(block, (x * 1,), {}, KeptOps(module_names="0.fc1"), DEFAULT_RECOMPUTE)[1] == \
        selective_call(block, (x * 1,), {}, KeptOps(module_names="fc1"), DEFAULT_RECOMPUTE)[1]
    with pytest.raises(ConfigError, match=r"names \['c1'\], which match no module.*'0.fc1', '0.fc2', '0.proj'"):
        selective_call(block, (x * 1,), {}, KeptOps(module_names=("fc2", "c1")), DEFAULT_RECOMPUTE)


def test_a_block_without_the_named_ops_warns_once_and_recomputes_everything():
    block = nn.Sequential(nn.LayerNorm(8), nn.Tanh())
    x = torch.randn(4, 8, requires_grad=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            out, kept = selective_call(block, (x,), {}, KeptOps(modules=(nn.Conv2d,)), DEFAULT_RECOMPUTE)
            out.sum().backward()
    messages = [str(w.message) for w in caught if "kept nothing" in str(w.message)]
    assert len(messages) == 1 and "Conv2d" in messages[0]


class RaisesAfterItsLinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.fail = True

    def forward(self, x):
        h = self.lin(x)
        if self.fail:
            raise RuntimeError("the forward failed")
        return torch.tanh(h)


def test_a_forward_that_raises_after_its_kept_calls_says_nothing_of_what_it_kept(monkeypatch):
    monkeypatch.setattr(kept_nothing, "_warned", set())
    block = RaisesAfterItsLinear()
    x = torch.randn(4, 8, requires_grad=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(RuntimeError, match="the forward failed"):
            selective_call(block, (x,), {}, KeptOps(), DEFAULT_RECOMPUTE)
        block.fail = False
        out, _ = selective_call(block, (x,), {}, KeptOps(), DEFAULT_RECOMPUTE)
        out.sum().backward()
    assert not [w for w in caught if "kept nothing" in str(w.message)]


class Recurrent(nn.Module):
    def __init__(self):
        super().__init__()
        self.lstm, self.lin = nn.LSTM(8, 8, batch_first=True), nn.Linear(8, 8)

    def forward(self, x):
        h, _ = self.lstm(x)
        return x + torch.tanh(self.lin(h))


def test_named_modules_that_return_tuples_warn_that_they_return_no_tensor_not_that_one_changed(monkeypatch):
    # nn.LSTM returns (output, (h, c)): nothing of it is kept, and nothing was changed in place.
    monkeypatch.setattr(kept_nothing, "_warned", set())
    torch.manual_seed(0)
    plain = Recurrent()
    block = copy.deepcopy(plain)
    x = torch.randn(2, 5, 8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out, _ = selective_call(block, (x,), {}, KeptOps(modules=(nn.LSTM,)), DEFAULT_RECOMPUTE)
        out.sum().backward()
    messages = [str(w.message) for w in caught if "kept nothing" in str(w.message)]
    assert len(messages) == 1 and "no call of ['LSTM', " in messages[0] and "returned a tensor" in messages[0]
    assert "in place" not in messages[0]
    plain(x).sum().backward()
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(plain.parameters(), block.parameters()))


@pytest.mark.parametrize("compress", [None, "int8"])
def test_a_jagged_nested_input_trains_as_plain(compress):
    # A nested tensor has no strides to make a kept call's views of it by: its saves are
    # kept as they are (and exactly by a codec, which takes no nested tensor).
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
    block = copy.deepcopy(plain)
    parts = [torch.randn(n, 16) for n in (3, 5, 2)]
    x = torch.nested.as_nested_tensor(parts, layout=torch.jagged)
    out = actsave.checkpoint(block, x, keep="selective", compress=compress)
    out.values().sum().backward()
    plain(x).values().sum().backward()
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(plain.parameters(), block.parameters()))
    assert actsave.kept_bytes() == {"device": 0, "host": 0}


class _StatisticInInferenceMode(nn.Module):
    def __init__(self):
        super().__init__()
        self.aux, self.up, self.down = nn.Linear(16, 16), nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x):
        with torch.inference_mode():  # inference tensors: no version counter, never saved
            scale = self.aux(self.aux(x)).abs().mean().item()
        return x + self.down(F.gelu(self.up(x) * scale))


@pytest.mark.parametrize("compress", [None, "int8"])
def test_kept_modules_called_in_inference_mode_run_plainly_in_forward_and_recompute(compress):
    # They raised "Inference tensors do not track version counter" as the call ended.
    torch.manual_seed(0)
    plain = nn.Sequential(*[_StatisticInInferenceMode() for _ in range(2)])
    model = actsave.wrap(copy.deepcopy(plain), _StatisticInInferenceMode, keep="selective", compress=compress)
    x = torch.randn(4, 16)
    for m in (plain, model):
        m(x).square().sum().backward()
    pairs = [(p, q) for p, q in zip(plain.parameters(), model.parameters()) if p.grad is not None]  # not aux's
    assert len(pairs) == 8 and all(q.grad is not None for _, q in pairs)
    if compress is None:
        assert all(torch.equal(p.grad, q.grad) for p, q in pairs)
    else:
        assert min(sqnr_db(p.grad, q.grad) for p, q in pairs) >= EXPECTED_GRADIENT_SQNR_DB["int8"]


@pytest.mark.parametrize("bad, match", [
    (dict(functions=("aten.mm.default",)), "nor of aten operators"),
    (dict(functions=("linear",)), r"not of other functions \(F.linear\).*modules=\(nn.Linear,\)"),
    (dict(modules=(nn.Linear(2, 2),)), "the classes, not instances"),
])
def test_bad_policies_say_what_to_name(bad, match):
    with pytest.raises(ConfigError, match=match):
        KeptOps(**bad)


def test_module_types_need_a_module_to_find_them_in():
    with pytest.raises(ConfigError, match="checkpoint the module itself"):
        block = GPTBlock()
        selective_call(lambda t: block(t), (torch.randn(2, 16, 32, requires_grad=True),), {}, KeptOps(),
                       DEFAULT_RECOMPUTE)


class DropoutAttention(nn.Module):
    """Attention with dropout (it draws), then a Dropout after it, which must draw in
    the recompute what it drew in the forward though the attention is skipped."""

    def __init__(self, d: int = 32):
        super().__init__()
        self.qkv, self.drop = nn.Linear(d, 3 * d), nn.Dropout(0.3)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = (part.view(b, t, 4, d // 4).transpose(1, 2) for part in self.qkv(x).split(d, dim=2))
        a = F.scaled_dot_product_attention(q, k, v, dropout_p=0.3).transpose(1, 2).reshape(b, t, d)
        return self.drop(torch.tanh(a))


def test_a_skipped_call_that_drew_random_numbers_leaves_the_generator_as_it_did():
    torch.manual_seed(0)
    plain = DropoutAttention()
    model = copy.deepcopy(plain)
    x = torch.randn(2, 8, 32)
    torch.manual_seed(3)
    plain(x.clone().requires_grad_()).sum().backward()
    torch.manual_seed(3)
    out, _ = selective_call(model, (x.clone().requires_grad_(),), {}, KeptOps(), DEFAULT_RECOMPUTE)
    out.sum().backward()
    for (name, p), q in zip(plain.named_parameters(), model.parameters()):
        assert torch.equal(p.grad, q.grad), name


class _InputDropoutLinear(nn.Linear):
    """A Linear that draws random numbers (a LoRA layer's input dropout)."""

    def forward(self, x):
        return F.linear(F.dropout(x, 0.3, self.training), self.weight, self.bias)


class _DrawingBlock(nn.Module):
    def __init__(self, linear: nn.Module):
        super().__init__()
        self.fc, self.ln, self.drop = linear, nn.LayerNorm(16), nn.Dropout(0.5)

    def forward(self, x):
        return self.ln(self.drop(self.fc(x)) + x)


class _WeightNoise(nn.Module):
    def forward(self, weight):
        return weight + 0.1 * torch.randn_like(weight)


def _noisy_linear() -> nn.Module:
    linear = nn.Linear(16, 16)
    torch.nn.utils.parametrize.register_parametrization(linear, "weight", _WeightNoise())  # a ParametrizedLinear
    return linear


def _dropout_linear_forward(self, x):
    return F.linear(F.dropout(x, 0.3, self.training), self.weight, self.bias)


def _linear_with_a_forward_of_its_own() -> nn.Module:
    linear = nn.Linear(16, 16)
    linear.forward = _dropout_linear_forward.__get__(linear)  # an input dropout patched in
    return linear


def _assert_the_selective_block_draws_as_plain(make_linear) -> None:
    torch.manual_seed(0)
    plain = _DrawingBlock(make_linear())
    torch.manual_seed(0)
    selective = actsave.Checkpoint(_DrawingBlock(make_linear()), keep="selective")
    for model in (plain, selective):
        torch.manual_seed(1)
        x = torch.randn(4, 16, requires_grad=True)
        y = model(x)
        (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
    for a, b in zip(plain.parameters(), selective.parameters()):
        assert torch.equal(a.grad, b.grad)


@pytest.mark.parametrize("make_linear", [lambda: _InputDropoutLinear(16, 16), _noisy_linear,
                                         _linear_with_a_forward_of_its_own],
                         ids=["linear-subclass", "parametrized", "forward-on-the-instance"])
def test_a_kept_linear_of_a_subclass_that_draws_replays_the_generator_exactly(make_linear):
    # Only torch's own Linear and convolutions running torch's forward are known to draw
    # nothing: a kept call of another type or forward skipped in the recompute still
    # moves the generator past its draws, so the Dropout after it draws the forward's mask.
    _assert_the_selective_block_draws_as_plain(make_linear)


def test_a_kept_convolution_with_a_conv_forward_of_its_own_replays_the_generator_exactly():
    # Conv2d's forward runs its _conv_forward: one set on the instance may draw.
    def block():
        conv = nn.Conv2d(3, 3, 3, padding=1)
        torch_conv_forward = conv._conv_forward
        conv._conv_forward = lambda x, weight, bias: torch_conv_forward(F.dropout(x, 0.3), weight, bias)
        return nn.Sequential(conv, nn.Dropout(0.5), nn.Conv2d(3, 3, 1))

    torch.manual_seed(0)
    plain = block()
    torch.manual_seed(0)
    selective = actsave.Checkpoint(block(), keep=KeptOps(modules=(nn.Conv2d,)))
    for model in (plain, selective):
        torch.manual_seed(1)
        model(torch.randn(2, 3, 8, 8, requires_grad=True)).square().sum().backward()
    for a, b in zip(plain.parameters(), selective.parameters()):
        assert torch.equal(a.grad, b.grad)


def _wrapping_with_an_input_dropout(forward):
    @functools.wraps(forward)  # takes torch's name and module, not its code
    def wrapper(self, x):
        return forward(self, F.dropout(x, 0.3, self.training))
    return wrapper


@pytest.mark.parametrize("patch", [lambda forward: _dropout_linear_forward, _wrapping_with_an_input_dropout],
                         ids=["replaced", "wrapped"])
def test_a_kept_linear_whose_class_forward_was_patched_replays_the_generator_exactly(monkeypatch, patch):
    monkeypatch.setattr(nn.Linear, "forward", patch(nn.Linear.forward))
    _assert_the_selective_block_draws_as_plain(lambda: nn.Linear(16, 16))


class _ReturnsItsLinearOutput(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.ln = nn.Linear(8, 8), nn.LayerNorm(8)

    def forward(self, x):
        h = self.fc(x)
        return h, self.ln(h + 1)


@pytest.mark.parametrize("stored", [{}, {"offload": True}, {"compress": "int8"}],
                         ids=["kept as it is", "offloaded", "by int8"])
def test_a_kept_output_changed_in_place_after_the_forward_raises_in_the_recompute_that_reads_it(stored):
    # The recompute of ln's saves reads fc's kept output: changed by the caller, it is not
    # what fc returned, and reading it would give wrong gradients, so it is refused
    # (nn.Sequential, which saves h + 1, is unaffected). Stored, it is refused alike: a
    # copy to the host may still be reading it on a GPU (NOTE [ Stored kept outputs ]).
    model = actsave.Checkpoint(_ReturnsItsLinearOutput(), keep="selective", **stored)
    h, y = model(torch.randn(4, 8, requires_grad=True))
    with torch.no_grad():
        h.mul_(10)
    with pytest.raises(actsave.RecomputeError, match="changed in place after the checkpointed forward returned"):
        y.sum().backward()


class _EndsOnALinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln, self.fc1, self.fc2 = nn.LayerNorm(8), nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(self.ln(x))))


def test_the_last_calls_output_changed_in_place_after_the_forward_trains_as_plain():
    # The early stop ends the recompute inside fc2's call: its output is not kept, and
    # the caller may change it, as under nn.Sequential.
    torch.manual_seed(0)
    plain = _EndsOnALinear()
    model = actsave.Checkpoint(copy.deepcopy(plain), keep="selective")
    x = torch.randn(4, 8)
    for m in (plain, model):
        y = m(x.clone().requires_grad_())
        y.mul_(2)
        y.sum().backward()
    for (name, p), q in zip(plain.named_parameters(), model.parameters()):
        assert torch.equal(p.grad, q.grad), name


class _TwoPaths(nn.Module):
    """A Python flag picks the path: b's call, or an op saving a tensor of the shape b's
    input has (tanh), then a second call of a."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.through_b = nn.Linear(32, 32), nn.Linear(32, 32), True

    def forward(self, x):
        h = F.gelu(self.a(x))
        return self.b(h) if self.through_b else torch.tanh(h) + self.a(h)


@pytest.mark.parametrize("keep", ["selective", KeptOps(module_names=("b",))])
def test_a_recompute_that_takes_another_path_past_a_skipped_call_raises(keep):
    # The forward kept b's call; the recompute makes tanh's save where b's input view was
    # (same shape) and would stop there (NOTE [ Selective recompute ]).
    model = actsave.Checkpoint(_TwoPaths(), keep=keep)
    y = model(torch.randn(4, 32, requires_grad=True))
    model.through_b = False
    with pytest.raises(actsave.RecomputeError, match=r"outside any kept call where the forward's save \d+ was made "
                                                     r"inside Linear"):
        y.square().sum().backward()


class _LinearNormResidual(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.ln = nn.Linear(16, 16), nn.LayerNorm(16)

    def forward(self, x):
        return self.ln(self.fc(x)) + x


def _registered(where: str, kind: str, hook, module: nn.Module):
    """``hook`` registered as a forward hook or pre-hook (``kind``) on ``module`` itself, or
    for every module (``where="global"``) acting on the Linear layers only."""
    if where == "local":
        return getattr(module, f"register_{kind}")(hook)
    on_linear = lambda m, *rest: hook(m, *rest) if isinstance(m, nn.Linear) else None  # noqa: E731
    return getattr(torch.nn.modules.module, f"register_module_{kind}")(on_linear)


def _gradients_with_hook(where: str, kind: str, hook) -> list:
    """The gradients of _LinearNormResidual, plain and selective, with ``hook`` registered
    around each run (removed after it, a global one too)."""
    torch.manual_seed(0)
    plain = _LinearNormResidual()
    selective = actsave.Checkpoint(copy.deepcopy(plain), keep="selective")
    for model, inner in ((plain, plain), (selective, selective.module)):
        handle = _registered(where, kind, hook, inner.fc)
        try:
            x = torch.randn(4, 16, generator=torch.Generator().manual_seed(1), requires_grad=True)
            model(x).pow(3).sum().backward()
        finally:
            handle.remove()
    return [(a.grad, b.grad) for a, b in zip(plain.parameters(), selective.parameters())]


@pytest.mark.parametrize("where", ["local", "global"])
@pytest.mark.parametrize("hook", [lambda module, args, out: out * 1.5 + 0.1, lambda module, args, out: torch.sin(out),
                                  lambda module, args, out: out.mul_(2)],
                         ids=["returns-a-new-output", "saves-its-output", "changes-it-in-place"])
def test_a_forward_hook_on_a_kept_module_applies_once(where, hook):
    # The recompute returns what the module's forward returned and nn.Module runs the
    # hooks on it again, global ones (which it runs before the module's own) as well:
    # so the output is recorded before every hook, which applies once.
    for a, b in _gradients_with_hook(where, "forward_hook", hook):
        assert torch.equal(a, b)


@pytest.mark.parametrize("where", ["local", "global"])
def test_a_forward_pre_hook_on_a_kept_module_applies_once(where):
    # The forward's arguments come after every pre-hook, in the forward as in the recompute.
    for a, b in _gradients_with_hook(where, "forward_pre_hook", lambda module, args: (args[0] * 1.5 + 0.1,)):
        assert torch.equal(a, b)


class _DropoutAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv, self.ln = nn.Linear(8, 24), nn.LayerNorm(8)

    def forward(self, x):
        q, k, v = self.qkv(self.ln(x)).chunk(3, -1)
        attended = torch.tanh(x + F.scaled_dot_product_attention(q[None], k[None], v[None], dropout_p=0.5)[0])
        return attended + 0.1 * torch.randn_like(x)  # drawn after the attention; nothing saved after it


def test_without_preserve_rng_state_a_selective_recompute_leaves_the_generator_where_the_forward_did():
    # Nothing it recomputes draws (the attention is kept): the generator stays where the
    # forward left it, as without a checkpoint; set back to its state after the attention,
    # the next step would draw this step's noise again.
    def next_draw(make):
        torch.manual_seed(0)
        model = make()
        torch.manual_seed(1)
        model(torch.randn(6, 8, requires_grad=True)).pow(2).sum().backward()
        return torch.rand(3)

    plain = next_draw(_DropoutAttention)
    selective = next_draw(lambda: actsave.Checkpoint(_DropoutAttention(), keep="selective", preserve_rng_state=False))
    assert torch.equal(plain, selective)


@pytest.mark.parametrize("keeps", [dict(compress="int8"), dict(offload=True)], ids=["int8", "offload"])
def test_a_strided_slice_input_comes_back_dense_and_its_views_are_made_again(keeps):
    # The block's input is a column slice of a fused projection (chunk): a codec or the
    # host gives it back dense, and the Linear's saved view of it is made again in the
    # forward's strides (made on the dense tensor, it would be out of bounds).
    def grads(make):
        torch.manual_seed(0)
        pre, block = nn.Linear(16, 32), make(_LinearNormResidual())
        a, _ = pre(torch.randn(8, 16)).chunk(2, dim=-1)
        block(a).pow(2).sum().backward()
        return [p.grad for p in (*pre.parameters(), *block.parameters())]

    with devices.host_tier_simulated():
        plain = grads(lambda block: block)
        selective = grads(lambda block: actsave.Checkpoint(block, keep="selective", **keeps))
    if "offload" in keeps:  # exact
        assert all(torch.equal(a, b) for a, b in zip(plain, selective))
    else:
        assert min(sqnr_db(a, b) for a, b in zip(plain, selective)) > 25


class _SlicedAttention(nn.Module):
    """Attention on q, k, v that are slices of one non-dense input, which it halves in
    place first (so a selective checkpoint keeps a private copy of it)."""
    inplace = True

    def __init__(self, split: bool):
        super().__init__()
        self.out, self.split = nn.Linear(32, 32), split

    def forward(self, x):
        x.mul_(0.5)
        if self.split:
            q, k, v = x.split(32, -1)
        else:  # overlapping windows of one storage: k and v lie in q's strides' gaps
            q, k, v = x[:, ::2, :32], x[:, :8, 32:64], x[:, :8, 64:96]
        q, k, v = (t.unflatten(-1, (4, 8)).transpose(1, 2) for t in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v)
        return self.out(a.transpose(1, 2).flatten(2))


@pytest.mark.parametrize("split", [True, False], ids=["split", "windows"])
@pytest.mark.parametrize("compress", [None, "int8"])
def test_views_of_arguments_that_share_a_storage_are_made_again_of_their_own_argument(split, compress):
    # q, k and v are slices of one storage, and the recompute's input is a dense copy:
    # k and v made again as offsets from q read past it (NaN, or out of bounds).
    def grads(make):
        torch.manual_seed(1)
        pre, block = nn.Linear(32, 128), _SlicedAttention(split)
        x = pre(torch.randn(2, 16, 32))[..., :96]  # a non-dense slice
        make(block)(x).pow(2).sum().backward()
        return [p.grad for p in (*pre.parameters(), *block.parameters())]

    plain = grads(lambda block: block)
    selective = grads(lambda block: actsave.Checkpoint(block, keep="selective", compress=compress))
    if compress is None:
        assert all(torch.equal(a, b) for a, b in zip(plain, selective))
    else:
        assert min(sqnr_db(a, b) for a, b in zip(plain, selective)) > 33  # int8's floor


class _InPlaceActivation(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.act, self.lin = nn.LayerNorm(16), nn.ReLU(inplace=True), nn.Linear(16, 16)

    def forward(self, x):
        h = self.norm(x) * 2
        self.act(h)  # changes h in place, and the Linear reads it
        return self.lin(h)


def test_a_kept_call_that_changes_its_argument_in_place_runs_again():
    torch.manual_seed(0)
    plain, x = _InPlaceActivation(), torch.randn(2, 8, 16)
    model = copy.deepcopy(plain)
    plain(x.clone().requires_grad_()).pow(2).sum().backward()
    keep = actsave.KeptOps(modules=(nn.Linear, nn.ReLU))
    actsave.Checkpoint(model, keep=keep)(x.clone().requires_grad_()).pow(2).sum().backward()
    for p, q in zip(plain.parameters(), model.parameters()):
        assert torch.equal(p.grad, q.grad)


class _ChangesEveryKeptOutput(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(16, 64), nn.Linear(64, 16)

    def forward(self, x):
        h = self.up(x)
        h += 1.0
        y = self.down(F.gelu(h))
        y += x
        return y


def test_a_call_run_again_keeps_neither_its_output_nor_the_saves_made_of_it():
    # Every kept output changes in place after its call, so every call runs again: the
    # checkpoint keeps what keep="inputs" keeps (and warns that it kept nothing).
    x = torch.randn(8, 16, requires_grad=True)
    held = {}
    for keep in ("inputs", "selective"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = actsave.Checkpoint(_ChangesEveryKeptOutput(), keep=keep)(x * 1)
        held[keep] = actsave.kept_bytes()["device"]
        out.sum().backward()
    assert held["selective"] == held["inputs"] == 8 * 16 * 4


class _GradientPenalty(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        y = self.fc2(torch.tanh(self.fc1(x)))
        (g,) = torch.autograd.grad(y.pow(2).sum(), x, create_graph=True)
        return y + torch.tanh(g)


class _GradientOfAKeptOutput(nn.Module):
    """A backward inside the forward through a kept call's output, then another kept
    call: the recompute for that backward runs fc1 again, which is no kept call."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        h = self.fc1(torch.sin(x))
        (g,) = torch.autograd.grad(torch.tanh(h).sum(), h, create_graph=True)
        return self.fc2(g * h)


@pytest.mark.parametrize("make", [_GradientPenalty, _GradientOfAKeptOutput])
def test_a_forward_that_runs_a_backward_of_its_own_is_recomputed_whole_and_exactly(make):
    # Its recompute runs that backward again, through every call: a skipped Linear (its
    # output not connected to x) would make autograd.grad raise; the recompute for the
    # backward inside the forward records no kept call.
    torch.manual_seed(0)
    plain = make()
    selective = actsave.Checkpoint(copy.deepcopy(plain), keep="selective")
    grads = []
    for model in (plain, selective):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1), requires_grad=True)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model(x).sum().backward()
        grads.append([*(p.grad for p in model.parameters()), x.grad])
    assert any("runs a backward of its own" in str(w.message) for w in caught)
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def lossy_gradients(blocks, x, codec, ops=KeptOps()) -> tuple:
    """Parameter gradients of a step through ``blocks`` (selective under ``codec``, or
    plain where it is None), and the aten operators its backward ran."""
    y = x.clone().requires_grad_()
    for block in blocks:
        y = block(y) if codec is None else \
            selective_call(block, (y,), {}, ops, DEFAULT_RECOMPUTE, policy=KeepPolicy.resolve(codec))[0]
    with OpCounter() as backward:
        y.square().sum().backward()
    return [p.grad for p in blocks.parameters()], backward.counts


@pytest.mark.parametrize("codec", ["int8", "fp8"])
def test_under_a_lossy_codec_attention_runs_again_from_decoded_inputs_within_the_codecs_floor(codec):
    # NOTE [ Attention's saves agree ]: its output decoded beside its exact log-sum-exp
    # and the recompute's decoded q, k, v put the worst gradient below the floor here;
    # recomputed from those q, k, v they agree. The Linear layers stay kept.
    x = torch.randn(4, 32, 32, generator=torch.Generator().manual_seed(3))
    expected, _ = lossy_gradients(sharp_gpt_blocks(), x, None)
    got, backward = lossy_gradients(sharp_gpt_blocks(), x, codec)
    assert min(sqnr_db(e, g) for e, g in zip(expected, got)) >= EXPECTED_GRADIENT_SQNR_DB[get_codec(codec).name]
    assert any("scaled_dot_product" in op and "backward" not in op for op in backward)
    assert backward["aten.addmm.default"] == 0
    assert actsave.kept_bytes() == {"device": 0, "host": 0}


def test_a_lossy_selective_that_names_only_attention_warns_that_it_keeps_nothing(monkeypatch):
    monkeypatch.setattr(kept_nothing, "_warned", set())
    blocks = stack(GPTBlock)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        lossy_gradients(blocks, torch.randn(2, 16, 32), "int8", KeptOps(modules=()))
    messages = [str(w.message) for w in caught if "kept nothing" in str(w.message)]
    assert len(messages) == 1 and "attention is recomputed from its decoded q, k and v" in messages[0]


@pytest.mark.filterwarnings("ignore:There is a performance drop")  # vmap's loop over CPU attention
@pytest.mark.parametrize("compress", [None, "int8"])
def test_under_vmap_and_jvp_it_runs_as_plain_and_under_grad_torch_func_refuses_it_as_torchs_checkpoint(compress):
    # A kept call's output there is the transform's wrapper (vmap's BatchedTensor, jvp's
    # TensorWrapper): no storage to name, and it holds the forward's graph. Not kept: the
    # call runs again in a recompute, as under keep="inputs", and nothing stays held.
    torch.manual_seed(0)
    block, mlp = GPTBlock(), nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))
    options = {"keep": "selective"} if compress is None else {"keep": "selective", "compress": compress}
    x, v = torch.randn(3, 2, 16, 32), torch.randn(4, 8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert torch.equal(torch.func.vmap(actsave.Checkpoint(block, **options))(x), torch.func.vmap(block)(x))
        tangents = [torch.func.jvp(f, (v,), (v.flip(0),)) for f in (actsave.Checkpoint(mlp, **options), mlp)]
    assert all(torch.equal(a, b) for a, b in zip(*tangents))
    assert not [w for w in caught if "actsave" in str(w.message)]  # it kept what the transform lets it keep
    with pytest.raises(RuntimeError, match=r"torch.func.{grad, vjp, jacrev, hessian} don't yet support saved tensor"):
        torch.func.grad(lambda t: actsave.Checkpoint(mlp, **options)(t).sum())(v)
    # A backward after jvp recomputes outside it, which saves other tensors: refused as
    # keep="inputs" and torch's checkpoint refuse it.
    y, tangent = torch.func.jvp(actsave.Checkpoint(mlp, **options), (v.requires_grad_(),), (v.flip(0),))
    with pytest.raises(actsave.RecomputeError, match="saved a tensor of shape/dtype/device"):
        (y.sum() + tangent.sum()).backward()
    del y, tangent, tangents, caught  # the graphs that hold the calls
    gc.collect()
    assert actsave.kept_bytes() == {"device": 0, "host": 0}


class _NotingLinear(nn.Linear):
    """A Linear whose forward changes state of its own: ``"running"`` a buffer (a
    running mean of its output), ``"shift"`` a Python attribute (its output's mean) beside
    a constant buffer, ``"shift alone"`` that attribute on a module with no buffer."""

    def __init__(self, features_in, features_out, changes: str):
        super().__init__(features_in, features_out)
        self.changes = changes
        if changes != "shift alone":
            self.register_buffer("running", torch.zeros(features_out))
        self.shift = 0.0

    def forward(self, x):
        y = super().forward(x)
        if self.changes == "running":
            with torch.no_grad():
                self.running.mul_(0.5).add_(y.mean(0), alpha=0.5)
        else:
            self.shift = float(y.detach().mean())
        return y


class _ReadsWhatItsCallChanged(nn.Module):
    """Reads after each call of ``fc1`` (twice: a shared layer) what that call changed."""

    def __init__(self, changes: str):
        super().__init__()
        self.read = "running" if changes == "running" else "shift"
        self.fc1, self.fc2 = _NotingLinear(4, 4, changes), nn.Linear(4, 4)

    def forward(self, x):
        h = F.gelu(self.fc1(x) - getattr(self.fc1, self.read))
        h = F.gelu(self.fc1(h) * getattr(self.fc1, self.read))
        return self.fc2(h)


@pytest.mark.parametrize("changes", ["running", "shift", "shift alone"])
@pytest.mark.parametrize("keep", ["selective", KeptOps(module_names=("fc1",))])
def test_a_kept_call_that_changes_its_modules_state_leaves_the_code_after_it_reading_the_change(changes, keep,
                                                                                              monkeypatch):
    # Skipped without a word, the call would leave the recompute on the forward's
    # starting state (or on what the module's last call left): the block would read other
    # values than the forward. A buffer changed: the call runs again, and keeps nothing
    # here; an attribute set: the skip sets it as the call left it, and keeps the output.
    def model():
        torch.manual_seed(0)
        return nn.Sequential(_ReadsWhatItsCallChanged(changes))

    x = torch.randn(6, 4)
    plain, wrapped = model(), actsave.wrap(model(), _ReadsWhatItsCallChanged, keep=keep)
    plain(x).square().sum().backward()
    monkeypatch.setattr(kept_nothing, "_warned", set())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        wrapped(x).square().sum().backward()
    for p, q in zip(plain.parameters(), wrapped.parameters()):
        assert torch.equal(p.grad, q.grad)
    for a, b in zip(plain.buffers(), wrapped.buffers()):
        assert torch.equal(a, b)
    said = [str(w.message) for w in caught if "kept nothing" in str(w.message)]
    if changes != "running":
        assert not said
    elif isinstance(keep, KeptOps):  # fc1 kept alone, and run again: it keeps nothing, and says why
        assert len(said) == 1 and "change their modules' buffers or parameters" in said[0]


class _NotesItsRows(nn.Linear):
    def forward(self, x):
        self.rows = x.shape[0]  # a small int: the object it held where the count repeats
        return super().forward(x)


def test_an_attribute_a_call_sets_to_the_object_it_held_is_replayed_where_a_later_call_moves_it():
    # The first call sets 6 where 6 was (no move, by identity), the second 3: skipped,
    # the first would leave the recompute reading 3.
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = _NotesItsRows(4, 4)
            self.fc.rows = 6

        def forward(self, x):
            h = F.gelu(self.fc(x) * self.fc.rows)
            return F.gelu(self.fc(h[:3]) * self.fc.rows).sum(0) + h.sum(0)

    def model():
        torch.manual_seed(0)
        return nn.Sequential(Block())

    x = torch.randn(6, 4)
    plain, wrapped = model(), actsave.wrap(model(), Block, keep="selective")
    plain(x).square().sum().backward()
    with OpCounter() as backward:
        out = wrapped(x).square().sum()
        out.backward()
    for p, q in zip(plain.parameters(), wrapped.parameters()):
        assert torch.equal(p.grad, q.grad)
    assert backward.counts["aten.addmm.default"] == 2  # the forward's two calls only: both skipped


class _NotesItsInputsMean(nn.Linear):
    def forward(self, x):
        self.mean = x.detach().mean(0)  # a tensor of more than one element: not replayed
        return super().forward(x)


@pytest.mark.parametrize("calls", [1, 2])
def test_a_tensor_attribute_two_calls_of_a_module_set_has_them_run_again(calls):
    # The code after each call reads what that call set; replayed, each call's tensor
    # would stay alive until the backward, so a module whose calls set it in turn runs
    # again; one call alone leaves the value the recompute finds, and is skipped.
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc, self.out = _NotesItsInputsMean(8, 8), nn.Linear(8, 8)

        def forward(self, x):
            h = torch.tanh(self.fc(x)) * self.fc.mean
            if calls == 2:
                h = torch.tanh(self.fc(h)) * self.fc.mean
            return self.out(h)

    def model():
        torch.manual_seed(0)
        return nn.Sequential(Block())

    x = torch.randn(4, 8)
    plain, wrapped = model(), actsave.wrap(model(), Block, keep=KeptOps(module_names=("fc",)))
    plain(x).square().sum().backward()
    with warnings.catch_warnings(record=True) as caught, OpCounter() as backward:
        warnings.simplefilter("always")
        wrapped(x).square().sum().backward()
    for p, q in zip(plain.parameters(), wrapped.parameters()):
        assert torch.equal(p.grad, q.grad)
    said = [str(w.message) for w in caught if "kept nothing" in str(w.message)]
    # The forward's calls, then the recompute's of fc (the output layer's not: the
    # recompute stops at its input): none where fc is called once, both where twice.
    assert backward.counts["aten.addmm.default"] == (calls + 1) + (0 if calls == 1 else 2)
    assert (len(said) == 1 and "sets again" in said[0]) if calls == 2 else not said


class _DropsInputsBy(nn.Linear):
    def forward(self, x, generator):
        return super().forward(x * (torch.rand(x.shape, generator=generator) > 0.2))


def test_a_skipped_call_leaves_a_generator_passed_to_it_as_the_forwards_call_left_it():
    # The recompute skips the kept call; the block's draws after it from the same
    # generator must be the forward's, as under keep="inputs", which replays it.
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.first, self.second = _DropsInputsBy(8, 8), _DropsInputsBy(8, 8)

        def forward(self, x, generator):
            h = torch.tanh(self.first(x, generator))
            h = torch.tanh(h * torch.randn(h.shape, generator=generator))
            return self.second(h, generator)

    def step(call):
        torch.manual_seed(0)
        block, generator = Block(), torch.Generator().manual_seed(7)
        call(block, torch.randn(4, 8, generator=torch.Generator().manual_seed(1)), generator).square().sum().backward()
        return [p.grad for p in block.parameters()], generator.get_state()

    plain_grads, plain_state = step(lambda block, x, g: block(x, g))
    grads, state = step(lambda block, x, g: actsave.checkpoint(block, x, g, keep=KeptOps(modules=(_DropsInputsBy,))))
    assert all(torch.equal(a, b) for a, b in zip(grads, plain_grads)) and torch.equal(state, plain_state)


class _ShrinksItsWeightWhenCalled(nn.Linear):
    def forward(self, x):
        with torch.no_grad():
            self.weight.mul_(0.9)
        return super().forward(x)


@pytest.mark.parametrize("keep", ["inputs", "selective"])
def test_a_kept_call_that_changes_its_parameter_runs_again_and_is_checked_as_any_recompute(keep):
    # The block reads the weight before the call: skipped, the call would leave the
    # recompute reading the weight as the forward left it, silently.
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = _ShrinksItsWeightWhenCalled(8, 8), nn.Linear(8, 8)

        def forward(self, x):
            return self.fc2(F.gelu(self.fc1(x * torch.exp(self.fc1.weight.mean()))))

    torch.manual_seed(0)
    model = actsave.wrap(nn.Sequential(Block()), Block, keep=keep)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = model(torch.randn(6, 8)).square().sum()
    with pytest.raises(actsave.RecomputeError, match="changed parameter 'weight'"):
        out.backward()


class _CountsItsCalls(nn.Linear):
    """A Linear with no buffer that counts its calls in an attribute and scales by it."""

    def __init__(self, features_in, features_out):
        super().__init__(features_in, features_out)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return super().forward(x) * min(1.0, self.calls / 10)


@pytest.mark.parametrize("order", ["two forwards, one backward", "backwards reversed", "early stop"])
def test_attributes_a_recompute_replays_are_put_back_as_it_ends(order):
    # The skips set the counter as each call left it; left so, two forwards before their
    # backwards, or a recompute that stops before the module's last call, would rewind it.
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = _CountsItsCalls(8, 8), nn.Linear(8, 8)

        def forward(self, x):
            h = self.fc2(F.gelu(self.fc1(x)))
            return self.fc1(h) if order == "early stop" else h  # its output only leaves the block

    def trained(keep):
        torch.manual_seed(0)
        model = nn.Sequential(Block())
        if keep:
            actsave.wrap(model, Block, keep=keep)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(3):
            x1, x2 = torch.randn(4, 8, generator=torch.Generator().manual_seed(step)).chunk(2)
            if order == "two forwards, one backward":
                (model(x1).square().sum() + model(x2).square().sum()).backward()
            elif order == "backwards reversed":
                first, second = model(x1).square().sum(), model(x2).square().sum()
                second.backward()
                first.backward()
            else:
                model(x1).square().sum().backward()
            optimizer.step()
            optimizer.zero_grad()
        counter = next(m for m in model.modules() if isinstance(m, _CountsItsCalls))
        return counter.calls, list(model.parameters())

    (plain_calls, plain), (calls, wrapped) = trained(None), trained("selective")
    assert calls == plain_calls
    assert all(torch.equal(p, q) for p, q in zip(plain, wrapped))


class _CachesItsWeight(nn.Linear):
    """A Linear that keeps a copy of its weight as an attribute at each call (as a
    quantized layer keeps its dequantized weight)."""

    def forward(self, x):
        self.cache = self.weight.detach() * 1.0
        return F.linear(x, self.weight, self.bias)


def test_a_cache_a_kept_call_sets_is_not_held_until_the_backward(no_collector):
    # A tensor of more than one element an attribute holds is left as the forward left
    # it (as module_attributes leaves it): replayed, each call's cache would stay alive.
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = _CachesItsWeight(16, 16), nn.Linear(16, 16)

        def forward(self, x):
            h = F.gelu(self.fc1(x))
            first = weakref.ref(self.fc1.cache)
            return self.fc2(F.gelu(self.fc1(h))), first

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.block = Block()

        def forward(self, x):
            return self.block(x)

    model = actsave.wrap(Model(), Block, keep="selective")
    out, first = model(torch.randn(4, 16))
    assert first() is None  # replaced by the second call, and freed
    out.square().sum().backward()


class PairedComplexGain(nn.Linear):
    """A Linear after a complex gain per pair of features, read as complex numbers: the
    product saves a complex view of the Linear's float argument (``view_as_complex``)."""

    def __init__(self, width: int = 16):
        super().__init__(width, width)
        self.gain = nn.Parameter(torch.randn(width // 2, dtype=torch.complex64))

    def forward(self, x):
        z = torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2))
        return super().forward(torch.view_as_real(z * self.gain).flatten(-2))


class ConjugateGain(nn.Module):
    """A complex gain on the conjugate of its argument: the product saves a view of the
    argument with its conjugate bit set."""

    def __init__(self, width: int = 16):
        super().__init__()
        self.gain = nn.Parameter(torch.randn(width, dtype=torch.complex64))

    def forward(self, z):
        return z.conj() * self.gain


class GainBlock(nn.Module):
    def __init__(self, gain: nn.Module, complex_input: bool):
        super().__init__()
        self.complex_input = complex_input
        self.norm, self.gain, self.out = nn.LayerNorm(16), gain, nn.Linear(16, 16)

    def forward(self, x):
        h = self.norm(x)
        if self.complex_input:  # the gain's argument: a complex tensor the block makes
            h = self.gain(torch.complex(h, h.flip(-1))).abs()
        else:
            h = self.gain(h)
        return x + self.out(F.gelu(h))


@pytest.mark.parametrize("gain, complex_input", [(PairedComplexGain, False), (ConjugateGain, True)])
def test_a_save_that_reads_an_argument_as_another_dtype_or_conjugated_is_kept_as_it_is(gain, complex_input):
    # As as_strided of the argument made again, it would read its bytes as the argument does.
    torch.manual_seed(0)
    plain = GainBlock(gain(), complex_input)
    block = copy.deepcopy(plain)
    x = torch.randn(2, 5, 16)
    plain(x.clone().requires_grad_()).square().sum().backward()
    ops = KeptOps(modules=(nn.Linear, gain))
    options = DEFAULT_RECOMPUTE.resolve(determinism_check="none")  # no signature check to raise first
    out, _ = selective_call(block, (x.clone().requires_grad_(),), {}, ops, options)
    out.square().sum().backward()
    for (name, p), q in zip(plain.named_parameters(), block.parameters()):
        assert torch.equal(p.grad, q.grad), name


def test_a_generator_a_block_holds_and_passes_to_kept_calls_is_left_as_plain_leaves_it():
    # A skipped call sets the generator as the forward's call left it; the recompute
    # puts it back as it found it, as it does the default generators.
    class Block(nn.Module):
        def __init__(self, generator):
            super().__init__()
            self.first, self.second, self.generator = _DropsInputsBy(8, 8), _DropsInputsBy(8, 8), generator

        def forward(self, x):
            return self.second(torch.tanh(self.first(x, self.generator)), self.generator)

    def step(wrapped: bool):
        torch.manual_seed(0)
        generator = torch.Generator().manual_seed(7)
        model = nn.Sequential(Block(generator), Block(generator))
        if wrapped:
            actsave.wrap(model, Block, keep=KeptOps(modules=(_DropsInputsBy,)))
        model(torch.randn(4, 8, generator=torch.Generator().manual_seed(1))).square().sum().backward()
        return [p.grad for p in model.parameters()], generator.get_state()

    (plain_grads, plain_state), (grads, state) = step(False), step(True)
    assert all(torch.equal(a, b) for a, b in zip(grads, plain_grads)) and torch.equal(state, plain_state)


class _NotesAStatistic(nn.Linear):
    """Sets ``stat`` to one element at one call and to a row of them at the other."""

    def __init__(self, one_first: bool):
        super().__init__(8, 8)
        self.one_first, self.calls = one_first, 0

    def forward(self, x):
        y = super().forward(x)
        self.calls += 1
        self.stat = y.mean() if (self.calls % 2 == 1) == self.one_first else y.mean(0)
        return y


@pytest.mark.parametrize("one_first", [True, False])
def test_an_attribute_set_to_one_element_and_to_a_row_by_two_calls_has_them_run_again(one_first):
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc, self.out = _NotesAStatistic(one_first), nn.Linear(8, 8)

        def forward(self, x):
            h = torch.tanh(self.fc(x)) * (1 + self.fc.stat.sum())
            return self.out(torch.tanh(self.fc(h)) * (1 + self.fc.stat.sum()))

    torch.manual_seed(0)
    plain, x = Block(), torch.randn(4, 8)
    wrapped = actsave.Checkpoint(copy.deepcopy(plain), keep="selective")
    plain(x).square().sum().backward()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # it keeps nothing of fc, and says so
        wrapped(x).square().sum().backward()
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(plain.parameters(), wrapped.parameters()))


def _assert_a_copy_checkpointed_trains_as_plain(plain: nn.Module, x: torch.Tensor, keep="selective") -> nn.Module:
    """One step of ``plain`` and of a copy under ``actsave.Checkpoint(copy, keep=keep)``:
    the same gradients (None where a parameter got none in either). Returns the copy
    checkpointed."""
    model = actsave.Checkpoint(copy.deepcopy(plain), keep=keep)
    for m in (plain, model):
        m(x.clone().requires_grad_()).square().sum().backward()
    for a, b in zip(plain.parameters(), model.parameters()):
        assert (a.grad is None and b.grad is None) or torch.equal(a.grad, b.grad)
    return model


class _AttentionWithAFallback(nn.Module):
    """Tries the fused attention, which refuses an integer mask, and writes it out then
    (``again``: calls it again with a float mask); ``remembers``: tries it no more after
    it failed once."""

    def __init__(self, remembers: bool = False, again: bool = False):
        super().__init__()
        self.qkv, self.out = nn.Linear(16, 48), nn.Linear(16, 16)
        self.remembers, self.again, self.fused = remembers, again, True

    def forward(self, x):
        q, k, v = self.qkv(x).view(2, 6, 3, 2, 8).permute(2, 0, 3, 1, 4)
        mask = torch.ones(6, 6, dtype=torch.int64).tril()
        a = None
        if self.fused:
            try:
                a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            except RuntimeError:
                self.fused = not self.remembers
        if a is None and self.again:
            a = F.scaled_dot_product_attention(q, k, v, attn_mask=(mask - 1.0) * 1e9)
        elif a is None:
            a = torch.softmax(q @ k.transpose(-1, -2) / 8 ** 0.5 + (mask - 1) * 1e9, -1) @ v
        return self.out(a.transpose(1, 2).reshape(2, 6, 16))


@pytest.mark.parametrize("remembers, again", [(False, False), (True, False), (True, True)],
                         ids=["tries-again", "remembers", "remembers-then-calls-it-again"])
def test_a_kept_call_that_raises_inside_a_try_runs_again_if_made_again_and_the_calls_after_it_are_kept(
        remembers, again):
    torch.manual_seed(0)
    x = torch.randn(2, 6, 16)
    model = _assert_a_copy_checkpointed_trains_as_plain(_AttentionWithAFallback(remembers, again), x)
    frame_calls = []
    original = selective.SelectiveFrame.end_forward

    def recorded(frame):
        original(frame)
        frame_calls.append([(call.target, call.skipped) for call in frame.calls])
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(selective.SelectiveFrame, "end_forward", recorded)
        model(x.clone().requires_grad_()).square().sum().backward()
    tried = [] if remembers else [("scaled_dot_product_attention", False)]  # run again
    fallback = [("scaled_dot_product_attention", True)] if again else []
    assert frame_calls == [[(model.module.qkv, True), *tried, *fallback, (model.module.out, True)]]


class _AttentionTryingMasks(nn.Module):
    """Tries masks until the fused attention takes one (two raise), and keeps to it."""

    def __init__(self):
        super().__init__()
        self.qkv, self.out, self.which = nn.Linear(16, 48), nn.Linear(16, 16), None

    def forward(self, x):
        q, k, v = self.qkv(x).view(2, 5, 3, 2, 8).permute(2, 0, 3, 1, 4)
        causal = torch.ones(5, 5).tril()
        masks = [causal.long(), causal.int(), (causal - 1) * 1e9]
        for i in range(3) if self.which is None else [self.which]:
            try:
                a = F.scaled_dot_product_attention(q, k, v, attn_mask=masks[i])
                self.which = i
                break
            except RuntimeError as error:
                if isinstance(error, actsave.ActsaveError):
                    raise
        return self.out(a.transpose(1, 2).reshape(2, 5, 16))


class _RefusesOtherWidths(nn.Linear):
    """A fused projection that refuses an input it cannot take, before any work."""

    def forward(self, x):
        if x.shape[-1] != self.in_features:
            raise RuntimeError("unsupported width")
        return super().forward(x)


class _AttentionTryingTwoWays(_AttentionTryingMasks):
    """Tries the fused attention with an integer mask, then a projection that refuses the
    width, then the fused attention with a float mask, and keeps to that."""

    def __init__(self):
        super().__init__()
        self.other = _RefusesOtherWidths(8, 8)

    def forward(self, x):
        q, k, v = self.qkv(x).view(2, 5, 3, 2, 8).permute(2, 0, 3, 1, 4)
        causal = torch.ones(5, 5).tril()
        for attempt in ("integer mask", "projection") if self.which is None else ():
            try:
                if attempt == "integer mask":
                    F.scaled_dot_product_attention(q, k, v, attn_mask=causal.long())
                else:
                    self.other(q.reshape(2, 2, 40))
            except RuntimeError as error:
                if isinstance(error, actsave.ActsaveError):
                    raise
        self.which = "float mask"
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=(causal - 1) * 1e9)
        return self.out(a.transpose(1, 2).reshape(2, 5, 16))


@pytest.mark.parametrize("block", [_AttentionTryingMasks, _AttentionTryingTwoWays], ids=["one-target", "two-targets"])
def test_kept_calls_that_raise_in_a_row_before_a_fallback_to_the_same_function_are_passed_over(block):
    torch.manual_seed(0)
    _assert_a_copy_checkpointed_trains_as_plain(block(), torch.randn(2, 5, 16),
                                                keep=KeptOps(modules=(nn.Linear, _RefusesOtherWidths)))


class _GraphConvolution(nn.Module):
    def __init__(self):
        super().__init__()
        edges = torch.tensor([[0, 1, 2, 3, 3], [1, 2, 3, 0, 2]])
        self.register_buffer("adjacency", torch.sparse_coo_tensor(edges, torch.ones(5), (4, 4)).coalesce())
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return torch.tanh(self.fc(torch.sparse.mm(self.adjacency, x)))


def test_a_block_that_saves_a_sparse_tensor_is_exact():
    torch.manual_seed(0)
    _assert_a_copy_checkpointed_trains_as_plain(_GraphConvolution(), torch.randn(4, 8))


def test_a_chain_inside_the_block_plans_at_its_first_call_without_its_calls_being_kept():
    # The chain's balanced plan runs its layers on meta tensors inside the block's forward:
    # those calls are no calls of the forward, neither recorded nor skipped.
    def model(chain_type):
        torch.manual_seed(0)
        chain = chain_type(*[nn.Sequential(nn.Linear(16, 16), nn.GELU()) for _ in range(4)])
        return nn.Sequential(nn.Linear(16, 16), chain, nn.Linear(16, 16))

    plain = model(nn.Sequential)
    selective = actsave.Checkpoint(model(actsave.CheckpointedSequential), keep="selective")
    x = torch.randn(8, 16)
    for m in (plain, selective):
        m(x).square().sum().backward()
    for a, b in zip(plain.parameters(), selective.parameters()):
        assert torch.equal(a.grad, b.grad)


class EagerAttention(nn.Module):
    """Attention written out (matmul and softmax): no scaled_dot_product_attention call."""

    def __init__(self):
        super().__init__()
        self.qkv, self.out = nn.Linear(8, 24), nn.Linear(8, 8)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        return self.out(torch.softmax(q @ k.transpose(-2, -1), dim=-1) @ v)


def test_a_named_op_no_call_matches_warns_once_while_the_others_are_kept(monkeypatch):
    monkeypatch.setattr(kept_nothing, "_warned", set())
    x = torch.randn(2, 4, 8, requires_grad=True)
    named = KeptOps(modules=(nn.Linear, nn.Conv1d), functions=("scaled_dot_product_attention",))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            out, _ = selective_call(EagerAttention(), (x,), {}, named, DEFAULT_RECOMPUTE)
            out.sum().backward()
        for ops in (KeptOps(), KeptOps(modules=(nn.Linear,), functions=())):  # the default, or all matched
            out, _ = selective_call(EagerAttention(), (x,), {}, ops, DEFAULT_RECOMPUTE)
            out.sum().backward()
    said = [str(w.message) for w in caught if "actsave" in str(w.message)]
    assert len(said) == 1 and "no call of ['Conv1d', 'scaled_dot_product_attention'] ran" in said[0]


class _MLPBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(64, 256), nn.Linear(256, 64)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(x)))


def _live_bytes_in_backward(call) -> int:
    """MemTracker's live bytes as the backward of six blocks' chain reaches the second
    block, the chain run by ``call``."""
    torch.manual_seed(0)
    blocks, x = nn.Sequential(*(_MLPBlock() for _ in range(6))), torch.randn(32, 64, requires_grad=True)
    tracker, seen = MemTracker(), []
    tracker.track_external(blocks, x)
    blocks[1].fc1.weight.register_post_accumulate_grad_hook(lambda _: seen.append(tracker.get_tracker_snapshot()))
    with tracker:
        call(blocks, x).sum().backward()
    return sum(device["Total"] for device in seen[0].values())


def test_the_kept_outputs_go_with_the_nodes_that_need_them_once_the_recompute_is_done():
    # The frame held every kept call's output to the end of the checkpoint's backward
    # (1.13x torch's selective checkpoint of the same outputs, as its backward reached the
    # second of six blocks).
    def torch_sac(blocks, x):
        def policy(ctx, op, *args, **kwargs):
            saved = op in (torch.ops.aten.addmm.default, torch.ops.aten.mm.default)
            return CheckpointPolicy.MUST_SAVE if saved else CheckpointPolicy.PREFER_RECOMPUTE
        context = functools.partial(create_selective_checkpoint_contexts, policy)
        return torch_checkpoint(blocks, x, use_reentrant=False, context_fn=context)

    actsave_bytes = _live_bytes_in_backward(lambda blocks, x: actsave.checkpoint(blocks, x, keep="selective"))
    assert actsave_bytes <= _live_bytes_in_backward(torch_sac)
