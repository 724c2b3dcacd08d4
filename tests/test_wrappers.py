"""checkpoint(), Checkpoint and wrap(): semantics of non-reentrant torch checkpoint,
unchanged state_dict keys, in-place selection of submodules."""
import contextlib
import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from support import ResidualBlock, ResidualNet, assert_same_training, codes_and_scales, mixed_chain, twin
from torch import nn
from torch.utils.checkpoint import CheckpointError, noop_context_fn
from torch.utils.checkpoint import checkpoint as torch_checkpoint

import actsave
from actsave import Checkpoint, CheckpointedSequential, ConfigError, checkpoint, wrap
from actsave.codecs import sqnr_db
from actsave.runtime.keep_rules import KeepPolicy


# --- checkpoint(function, *args, **kwargs) ------------------------------------------

def test_functional_checkpoint_with_non_tensor_args_kwargs_and_mixed_outputs():
    fc = nn.Linear(4, 4)

    def fn(x, scale, *, shift, tag):
        y = fc(x) * scale + shift
        return y, None, tag, y.sum()

    x = torch.randn(3, 4, requires_grad=True)
    shift = torch.randn(4)  # a tensor that needs no grad
    y, none, tag, total = checkpoint(fn, x, 2.0, shift=shift, tag="t")
    assert none is None and tag == "t"
    (y.square().sum() + total).backward()
    grads = [x.grad.clone(), fc.weight.grad.clone()]
    x.grad, fc.weight.grad = None, None
    y, _, _, total = fn(x, 2.0, shift=shift, tag="t")
    (y.square().sum() + total).backward()
    assert torch.equal(grads[0], x.grad) and torch.equal(grads[1], fc.weight.grad)


def test_functional_checkpoint_reaches_parameters_a_closure_uses():
    fc = nn.Linear(4, 4)
    x = torch.randn(3, 4)  # no input needs grad: only the closed-over parameters do
    loss = checkpoint(lambda t: torch.tanh(fc(t)), x).sum()
    assert actsave.kept_bytes()["device"] == x.numel() * 4  # held by reference, counted
    grads = torch.autograd.grad(loss, list(fc.parameters()))
    assert actsave.kept_bytes()["device"] == 0
    expected = torch.autograd.grad(torch.tanh(fc(x)).sum(), list(fc.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(grads, expected))


def test_functional_checkpoint_keeps_nothing_when_nothing_needs_grad():
    out = checkpoint(torch.tanh, torch.randn(3, 4))
    assert not out.requires_grad
    assert actsave.kept_bytes() == {"device": 0, "host": 0}


def test_input_modified_in_place_after_forward_raises_at_backward():
    x = torch.randn(3, 4, requires_grad=True).tanh()
    out = checkpoint(torch.sin, x)
    x.mul_(2)
    with pytest.raises(actsave.RecomputeError, match="modified in place after the forward"):
        out.sum().backward()


def test_function_modifying_its_input_in_place_is_refused_in_forward():
    def add_one_(t):
        return t.add_(1).sin()

    with pytest.raises(actsave.RecomputeError, match="modified in place by .*add_one_ during its forward"):
        checkpoint(add_one_, torch.randn(3, 4, requires_grad=True).tanh())


def test_in_place_module_gets_a_private_copy():
    x = torch.randn(3, 4, requires_grad=True)
    out = checkpoint(nn.ReLU(inplace=True), x * 1)
    out.sum().backward()
    assert torch.equal(x.grad, (x > 0).float())


@pytest.mark.parametrize("compress", [None, "int8"])
def test_a_sequential_starting_in_place_gets_a_private_copy(compress):
    torch.manual_seed(0)
    plain = nn.Sequential(nn.ReLU(inplace=True), nn.Linear(8, 8))
    x = torch.randn(4, 8, requires_grad=True)
    plain(x * 1).sum().backward()
    expected, x.grad = x.grad, None
    Checkpoint(twin(plain), compress=compress)(x * 1).sum().backward()
    # ReLU's gradient mask is exact under int8 too: a private copy of the input decides it.
    assert torch.equal(x.grad, expected) if compress is None else sqnr_db(expected, x.grad) > 30


# --- Checkpoint(module) --------------------------------------------------------------

def test_checkpoint_module_trains_exactly_and_keeps_state_dict_keys():
    plain = ResidualNet()
    model = twin(plain)
    model.blocks[1] = Checkpoint(model.blocks[1])
    assert list(model.state_dict()) == list(plain.state_dict())
    assert_same_training(plain, model, torch.randn(5, 8))


def test_checkpoint_state_dict_loads_with_and_without_the_wrapper():
    block = ResidualBlock()
    wrapped = Checkpoint(twin(block))
    nn.init.zeros_(wrapped.fc.weight)
    block.load_state_dict(wrapped.state_dict())
    assert torch.equal(block.fc.weight, torch.zeros(8, 8))
    nn.init.ones_(block.fc.weight)
    wrapped.load_state_dict(block.state_dict())
    assert torch.equal(wrapped.module.fc.weight, torch.ones(8, 8))


def test_checkpoint_forwards_attribute_lookups_to_the_module():
    block = ResidualBlock()
    wrapped = Checkpoint(block)
    assert wrapped.fc is block.fc and wrapped.module is block
    with pytest.raises(AttributeError):
        wrapped.no_such_attribute


class _NamedLikeTheWrapper(nn.Module):
    """A block whose child takes a name of Checkpoint's own: ``module``, ``option``..."""

    def __init__(self, name: str):
        super().__init__()
        self.name = name
        setattr(self, name, nn.Linear(8, 8))

    def forward(self, x):
        return torch.tanh(getattr(self, self.name)(x))


@pytest.mark.parametrize("name", ["module", "option", "recompute", "policy", "inputs_policy", "eager_because"])
def test_checkpoint_hides_no_attribute_of_the_module_it_wraps(name):
    plain = nn.Sequential(_NamedLikeTheWrapper(name), _NamedLikeTheWrapper(name))
    model = twin(plain)
    actsave.wrap(model, _NamedLikeTheWrapper, compress="int8")
    block = model[0]._checkpoint_wrapped_module
    assert isinstance(getattr(model[0], name), nn.Linear) and getattr(model[0], name) is getattr(block, name)
    for key in plain.state_dict():  # a state dict's names walk through the wrapper
        assert model.get_parameter(key).shape == plain.get_parameter(key).shape
    out = model(torch.randn(4, 8, requires_grad=True))
    assert actsave.kept_bytes()["device"] > 0  # still checkpointed, its input kept by int8
    out.sum().backward()
    actsave.wrap(model, _NamedLikeTheWrapper)  # selected again: this call's options win
    assert model[0]._option.policy.codec.name == "none"


def test_checkpoint_rejects_what_is_not_a_module():
    with pytest.raises(ConfigError, match="Checkpoint wraps an nn.Module"):
        Checkpoint(torch.relu)


def test_checkpoint_inside_a_checkpointed_segment_is_exact():
    plain = mixed_chain()
    model = twin(plain)
    model[5] = Checkpoint(model[5])
    model[6] = Checkpoint(model[6])  # in-place ReLU inside an outer segment
    model = CheckpointedSequential.from_sequential(model, segments=2)
    assert_same_training(plain, model, torch.randn(8, 16))
    assert actsave.kept_bytes() == {"device": 0, "host": 0}


# --- wrap(model, filter_fn) ----------------------------------------------------------

@pytest.mark.parametrize("filter_fn", [
    ResidualBlock,
    (ResidualBlock, nn.GRU),
    lambda module, fqn: fqn.startswith("blocks."),
], ids=["class", "tuple", "callable"])
def test_wrap_replaces_matching_submodules_in_place(filter_fn):
    plain = ResidualNet()
    model = twin(plain)
    assert wrap(model, filter_fn) is model
    assert all(isinstance(b, Checkpoint) for b in model.blocks)
    assert not isinstance(model.head, Checkpoint)
    assert list(model.state_dict()) == list(plain.state_dict())
    assert_same_training(plain, model, torch.randn(5, 8))


@pytest.mark.parametrize("filter_fn", [lambda module, fqn: fqn.startswith("blocks"), nn.ModuleList],
                         ids=["the container's name too", "the container's type"])
def test_wrap_asks_what_a_container_without_a_forward_holds_never_the_container(filter_fn):
    # Wrapped, the ModuleList the model iterates would run no checkpoint and hide its blocks.
    plain = ResidualNet()
    model = twin(plain)
    if filter_fn is nn.ModuleList:
        with pytest.warns(UserWarning, match="selected no submodule"):
            wrap(model, filter_fn)
    else:
        wrap(model, filter_fn)
        assert all(isinstance(b, Checkpoint) for b in model.blocks)
    assert isinstance(model.blocks, nn.ModuleList)
    assert_same_training(plain, model, torch.randn(5, 8))


class _CallsItsLayer(nn.Module):
    """A block that defines __call__, not forward."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def __call__(self, x):
        return x + torch.tanh(self.fc(x))


def test_wrap_selects_a_block_that_defines_call_instead_of_forward():
    torch.manual_seed(0)
    plain = nn.Sequential(_CallsItsLayer(), _CallsItsLayer())
    model = wrap(twin(plain), _CallsItsLayer)
    assert all(isinstance(block, Checkpoint) for block in model)
    assert_same_training(plain, model, torch.randn(4, 8))


def test_wrap_passes_fully_qualified_names_and_skips_wrapped_subtrees():
    seen = []
    model = ResidualNet()
    wrap(model, lambda module, fqn: seen.append(fqn) or fqn == "blocks.0")
    assert "blocks.0" in seen and "blocks.0.fc" not in seen and "blocks.1.fc" in seen
    seen.clear()
    wrap(model, lambda module, fqn: seen.append(fqn) or isinstance(module, nn.Linear))
    assert "blocks.0" in seen and not any(name.startswith("blocks.0.") for name in seen)
    assert isinstance(model.blocks[1].fc, Checkpoint) and not isinstance(model.blocks[0].module.fc, Checkpoint)


def test_wrap_never_wraps_the_root():
    block = ResidualBlock()
    with pytest.warns(UserWarning, match="selected no submodule"):  # the root does not count
        assert wrap(block, ResidualBlock) is block and not isinstance(block, Checkpoint)


@pytest.mark.parametrize("filter_fn", ["ResidualBlock", (ResidualBlock, "x"), 3])
def test_wrap_rejects_a_bad_filter(filter_fn):
    with pytest.raises(ConfigError, match="filter_fn="):
        wrap(ResidualNet(), filter_fn)


def test_wrap_warns_when_nothing_matches_but_not_when_called_again():
    with pytest.warns(UserWarning, match=r"filter_fn=<class 'torch.nn.modules.conv.Conv2d'> selected no submodule"):
        wrap(ResidualNet(), nn.Conv2d)
    model = wrap(ResidualNet(), ResidualBlock)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        wrap(model, ResidualBlock)  # already wrapped: nothing new, nothing wrong


def test_wrapping_again_applies_the_new_options():
    # A second wrap(model, Block, compress="int8") applies its options; keeping the first
    # call's would be silent (gradients bit-equal to plain).
    model = wrap(ResidualNet(width=64), ResidualBlock)
    wrap(model, ResidualBlock, compress="int8", offload=True, preserve_rng_state=False)
    assert all(block.policy == KeepPolicy.resolve("int8", True) and not block.recompute.preserve_rng_state
               for block in model.blocks)
    out = model(torch.randn(16, 64))
    # The inputs of blocks 1 and 2 in 8 bits on the host; block 0's, the batch, by reference.
    assert actsave.kept_bytes() == {"device": 16 * 64 * 4, "host": 2 * codes_and_scales(16 * 64)}
    out.sum().backward()
    # A Checkpoint the filter does not select keeps its options.
    wrap(model, lambda module, fqn: fqn == "blocks.0", compress="fp8")
    assert [block.policy.codec.name for block in model.blocks] == ["fp8_e4m3", "int8", "int8"]


class _SharedBlockNet(nn.Module):
    """One residual block with BatchNorm and Dropout placed at three positions (shared
    weights, as ALBERT's layers), then a head; ``shared=False``: three blocks alike."""

    def __init__(self, width: int = 8, shared: bool = True):
        super().__init__()
        torch.manual_seed(0)
        block = nn.Sequential(nn.BatchNorm1d(width), nn.Linear(width, width), nn.Tanh(), nn.Dropout(0.2))
        self.blocks = nn.ModuleList([block] * 3 if shared else [twin(block) for _ in range(3)])
        self.head = nn.Linear(width, 2)

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def _steps(model: nn.Module, steps: int = 3) -> list:
    """Each SGD step's input gradient, parameter gradients and buffers, from fixed seeds."""
    optimizer, seen = torch.optim.SGD(model.parameters(), lr=0.1), []
    torch.manual_seed(1)
    for _ in range(steps):
        x = torch.randn(16, 8, requires_grad=True)
        optimizer.zero_grad()
        model(x).square().sum().backward()
        seen.append([x.grad] + [p.grad.clone() for p in model.parameters()] + [b.clone() for b in model.buffers()])
        optimizer.step()
    return seen


def test_wrap_checkpoints_every_place_of_a_shared_block_with_one_checkpoint():
    plain = _SharedBlockNet()
    model, asked = twin(plain), []
    wrap(model, lambda module, fqn: asked.append(fqn) or isinstance(module, nn.Sequential))
    assert asked == ["blocks.0", "head"]  # asked once, under its first name; the ModuleList never
    wrapper = model.blocks[0]
    assert isinstance(wrapper, Checkpoint) and all(block is wrapper for block in model.blocks)
    assert list(model.state_dict()) == list(plain.state_dict())
    assert len(list(model.modules())) == len(list(plain.modules())) + 1
    assert len(list(model.parameters())) == len(list(plain.parameters()))
    for seen_plain, seen_wrapped in zip(_steps(plain), _steps(model)):
        assert all(torch.equal(a, b) for a, b in zip(seen_plain, seen_wrapped))
    kept = []
    for net in (model, wrap(_SharedBlockNet(shared=False), nn.Sequential)):
        out = net(torch.randn(16, 8, requires_grad=True))
        kept.append(actsave.kept_bytes())
        out.sum().backward()
    assert kept[0] == kept[1]  # each call keeps its input, as three blocks' calls do


def test_wrapping_a_shared_block_again_keeps_its_one_checkpoint():
    model = wrap(_SharedBlockNet(), nn.Sequential)
    wrap(model, nn.Sequential, compress="int8")
    wrapper = model.blocks[0]
    assert all(block is wrapper for block in model.blocks) and not isinstance(wrapper.module, Checkpoint)
    assert wrapper.policy == KeepPolicy.resolve("int8", False)


@pytest.mark.parametrize("how", ["plan_blocks", "wrap"])
def test_a_block_plan_refuses_a_shared_block_and_says_what_to_do(how):
    model, x = _SharedBlockNet(), torch.randn(16, 8)
    call = actsave.plan_blocks if how == "plan_blocks" else wrap
    with pytest.raises(ConfigError, match=r"\['blocks.0', 'blocks.1', 'blocks.2'\] are one module .*"
                                          r"with wrap\(model, filter_fn\)"):
        call(model, nn.Sequential, budget=10**7, example_inputs=x)
    assert all(type(block) is nn.Sequential for block in model.blocks)


# --- torch.utils.checkpoint.checkpoint's keywords ------------------------------------

def _dropout_sin(x):
    return F.dropout(x, p=0.5, training=True).sin()


def _grad_and_next_draw(call, function, **keywords):
    torch.manual_seed(0)
    x = torch.randn(6, 8, requires_grad=True)
    call(function, x, **keywords).sum().backward()
    return x.grad, torch.rand(4)  # the draw tells whether the recompute advanced the RNG


@pytest.mark.parametrize("preserve", [True, False])
def test_preserve_rng_state_means_what_it_means_in_torch(preserve):
    ours = _grad_and_next_draw(checkpoint, _dropout_sin, use_reentrant=False, preserve_rng_state=preserve)
    theirs = _grad_and_next_draw(torch_checkpoint, _dropout_sin, use_reentrant=False, preserve_rng_state=preserve)
    plain = _grad_and_next_draw(lambda f, x: f(x), _dropout_sin)
    assert torch.equal(ours[0], theirs[0]) and torch.equal(ours[1], theirs[1])
    # Replayed, the recompute's dropout mask is the forward's; not replayed, it is another.
    assert torch.equal(ours[0], plain[0]) == preserve


def test_checkpoint_module_and_wrap_take_preserve_rng_state_too():
    def run(model_of):
        torch.manual_seed(0)
        model = model_of(nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5)))
        x = torch.randn(6, 8, requires_grad=True)
        model(x).sum().backward()
        return x.grad

    ours = run(lambda m: nn.Sequential(Checkpoint(m, preserve_rng_state=False)))
    wrapped = run(lambda m: wrap(nn.Sequential(m), nn.Sequential, preserve_rng_state=False))
    theirs = run(lambda m: (lambda x: torch_checkpoint(m, x, use_reentrant=False, preserve_rng_state=False)))
    plain = run(lambda m: m)
    assert torch.equal(ours, theirs) and torch.equal(wrapped, theirs) and not torch.equal(ours, plain)
    assert "preserve_rng_state=False" in repr(Checkpoint(nn.ReLU(), preserve_rng_state=False))


def _rows(k):
    def first_rows(x):  # saves x[:k[0]] for sin's backward: its shape follows k
        return (x[:k[0]] * 2).sin()
    return first_rows


@pytest.mark.parametrize("call", ["actsave", "torch"])
def test_determinism_check_none_lets_a_changed_shape_through_as_torch_does(call):
    k = [3]
    ckpt = checkpoint if call == "actsave" else torch_checkpoint
    x = torch.randn(3, 4, requires_grad=True)
    out = ckpt(_rows(k), x, use_reentrant=False, determinism_check="none")
    k[0] = 1  # the recompute saves a (1, 4) tensor where the forward saved (3, 4)
    out.sum().backward()
    # sin's backward broadcasts the one recomputed row: every row's gradient is row 0's.
    assert torch.equal(x.grad, (2 * torch.cos(2 * x.detach()[:1])).expand(3, 4))


def test_determinism_check_default_raises_where_torch_raises():
    for ckpt, error in ((checkpoint, actsave.RecomputeError), (torch_checkpoint, CheckpointError)):
        k = [3]
        out = ckpt(_rows(k), torch.randn(3, 4, requires_grad=True), use_reentrant=False, determinism_check="default")
        k[0] = 1
        with pytest.raises(error):
            out.sum().backward()


def test_debug_lists_the_operators_of_the_forward_and_of_the_recompute():
    k = [3]
    out = checkpoint(_rows(k), torch.randn(3, 4, requires_grad=True), debug=True)
    k[0] = 1
    with pytest.raises(actsave.RecomputeError) as raised:
        out.sum().backward()
    message = str(raised.value)
    forward, recompute = message.split("Operators the forward ran")[1].split("Operators the recompute ran")
    assert "aten.mul" in forward and "aten.sin" in forward
    assert "aten.mul" in recompute and "aten.sin" not in recompute  # it stopped at sin's save


def test_without_debug_the_error_lists_no_operators():
    k = [3]
    out = checkpoint(_rows(k), torch.randn(3, 4, requires_grad=True))
    k[0] = 1
    with pytest.raises(actsave.RecomputeError) as raised:
        out.sum().backward()
    assert "aten." not in str(raised.value)


@pytest.mark.parametrize("early_stop", [True, False])
def test_early_stop_as_in_torch(early_stop):
    def runs_of(ckpt):
        calls = []

        def function(x):
            y = x.sin()
            calls.append(1)  # after the last save: the early-stopped recompute never gets here
            return y

        ckpt(function, torch.randn(3, requires_grad=True), use_reentrant=False, early_stop=early_stop).sum().backward()
        return len(calls)

    assert runs_of(checkpoint) == runs_of(torch_checkpoint) == (1 if early_stop else 2)


@pytest.mark.parametrize("keep", ["inputs", "selective"])
def test_an_early_stop_the_function_catches_ends_the_recompute_as_in_torch(keep):
    class CatchesAroundItsLastSave(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(8, 8), nn.Linear(8, 8)
            self.fc2.weight.requires_grad_(False)  # its call saves no tensor of the recompute's
            self.after = 0

        def forward(self, x):
            h = self.fc1(x)
            with contextlib.suppress(Exception):  # an optional op with a silent fallback
                h = torch.tanh(h)
            self.after += 1
            return x + self.fc2(h)

    torch.manual_seed(0)
    plain = CatchesAroundItsLastSave()
    model, torch_model = copy.deepcopy(plain), copy.deepcopy(plain)
    x = torch.randn(4, 8)
    plain(x.clone().requires_grad_()).square().sum().backward()
    checkpoint(model, x.clone().requires_grad_(), keep=keep).square().sum().backward()
    for (name, p), q in zip(plain.named_parameters(), model.parameters()):
        assert p.grad is None or torch.equal(p.grad, q.grad), name
    # A selective recompute stops at fc2, whose output it let go of: the stop is raised
    # again there, and the function ran as far as under torch's checkpoint.
    torch_checkpoint(torch_model, x.clone().requires_grad_(), use_reentrant=False).square().sum().backward()
    assert model.after == torch_model.after == 2


def test_torch_keywords_are_checkpoints_own_and_the_rest_reach_the_function():
    def scaled(x, *, scale):
        return x.sin() * scale

    x = torch.randn(3, requires_grad=True)
    out = checkpoint(scaled, x, use_reentrant=False, preserve_rng_state=True, determinism_check="default",
                     debug=False, early_stop=True, context_fn=noop_context_fn, scale=3.0)
    out.sum().backward()
    assert torch.allclose(x.grad, 3 * x.detach().cos())


@pytest.mark.parametrize("keywords, names", [
    ({"use_reentrant": True}, ["use_reentrant=True", "non-reentrant", "use_reentrant=False"]),
    ({"use_reentrant": "False"}, ["use_reentrant='False'"]),
    ({"context_fn": lambda: (None, None)}, ["context_fn=", "not supported", "actsave.wrap"]),
    ({"preserve_rng_state": None}, ["preserve_rng_state=None", "True or False"]),
    ({"determinism_check": "strict"}, ["determinism_check='strict'", "'default'", "'none'"]),
    ({"debug": "yes"}, ["debug='yes'"]),
    ({"early_stop": 0}, ["early_stop=0"]),
])
def test_torch_keywords_actsave_does_not_implement_are_refused(keywords, names):
    with pytest.raises(ConfigError) as raised:
        checkpoint(torch.sin, torch.randn(3, requires_grad=True), **keywords)
    assert all(name in str(raised.value) for name in names), str(raised.value)


# --- keep=: what a checkpoint keeps (NOTE [ Keep modes ]) --------------------------


class Block(nn.Module):
    def __init__(self, d: int = 16):
        super().__init__()
        self.norm, self.fc1, self.fc2 = nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class Stack(nn.Module):
    def __init__(self, n: int = 3):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(Block() for _ in range(n))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


@pytest.mark.parametrize("how", ["wrap", "Checkpoint", "checkpoint", "KeptOps"])
def test_selective_blocks_train_as_plain_ones(how):
    plain, model = Stack(), Stack()
    if how == "wrap":
        wrap(model, Block, keep="selective")
    elif how == "KeptOps":
        wrap(model, Block, keep=actsave.KeptOps(modules=(nn.Linear,), functions=()))
    elif how == "Checkpoint":
        model.blocks = nn.ModuleList(Checkpoint(block, keep="selective") for block in model.blocks)
    else:
        blocks = list(model.blocks)
        model.forward = lambda x: checkpoint(blocks[2], checkpoint(blocks[1], checkpoint(
            blocks[0], x, keep="selective"), keep="selective"), keep="selective")
    assert_same_training(plain, model, torch.randn(4, 8, 16, requires_grad=True))
    if how in ("wrap", "Checkpoint"):
        assert "keep='selective'" in repr(model.blocks[0])


def test_keep_is_checked_and_a_planned_block_takes_none():
    with pytest.raises(ConfigError, match="keep='everything' is not one of"):
        Checkpoint(Block(), keep="everything")
    with pytest.raises(ConfigError, match="keep='selective'.*block's keep option is planned"):
        wrap(Stack(), Block, keep="selective", budget=10**6, example_inputs=torch.randn(2, 8, 16))


@pytest.mark.parametrize("keep, compress", [("saves", "int8"), ("linear_inputs", "int8"), ("saves", None)])
def test_blocks_that_keep_their_saves_recompute_nothing(keep, compress):
    plain, model = Stack(), Stack()
    wrap(model, Block, keep=keep, compress=compress)
    x = torch.randn(4, 8, 16, requires_grad=True)
    out = model(x)
    calls = {"fc1": 0}
    model.blocks[0].module.fc1.register_forward_hook(lambda *a: calls.__setitem__("fc1", calls["fc1"] + 1))
    out.square().sum().backward()
    assert calls["fc1"] == 0  # nothing ran again
    plain(x).square().sum().backward()
    if compress is None:
        for p, q in zip(plain.parameters(), model.parameters()):
            assert torch.equal(p.grad, q.grad)
    assert actsave.kept_bytes() == {"device": 0, "host": 0}


class _LoRA(nn.Module):
    def __init__(self, base: nn.Linear):
        super().__init__()
        self.base, self.down, self.up = base, nn.Linear(8, 2, bias=False), nn.Linear(2, 8, bias=False)

    def forward(self, x):
        return self.base(x) + self.up(self.down(x))


def test_an_attribute_of_the_module_set_through_the_checkpoint_is_set_on_the_module():
    # LoRA put in after wrap, as a user writes it: set on the wrapper, the adapter
    # would never run and its parameters get no gradient.
    plain = nn.Sequential(ResidualBlock(), ResidualBlock())
    model = twin(plain)
    actsave.wrap(model, ResidualBlock)
    for blocks in (plain, model):
        torch.manual_seed(0)
        blocks[0].fc = _LoRA(blocks[0].fc)
        blocks[1].activation = torch.sigmoid  # an attribute that is not a module
    x = torch.randn(4, 8)
    for blocks in (plain, model):
        torch.manual_seed(1)
        blocks(x).sum().backward()
    assert isinstance(model[0].module.fc, _LoRA) and "fc" not in model[0]._modules
    assert "activation" not in model[1].__dict__ and model[1].module.activation is torch.sigmoid
    assert list(model.state_dict()) == list(plain.state_dict())
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(plain.parameters(), model.parameters()))


def test_an_attribute_set_through_the_checkpoint_of_a_compiled_block_is_set_on_the_block():
    block = ResidualBlock()
    wrapped = Checkpoint(torch.compile(block, backend="eager"))
    wrapped.fc = _LoRA(block.fc)
    assert isinstance(block.fc, _LoRA) and "fc" not in wrapped._modules
    wrapped.activation = torch.sigmoid
    assert block.activation is torch.sigmoid and "activation" not in vars(wrapped)
    del wrapped.activation
    assert "activation" not in vars(block)
