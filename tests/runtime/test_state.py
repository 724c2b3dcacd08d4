"""RNG, autocast and default-device replay; module state mutated once, and read
state checked unchanged before the recompute."""
import contextlib
import copy
import threading

import pytest
import torch
from torch import nn

import actsave

from actsave.errors import RecomputeError
from actsave.runtime import replay
from actsave.runtime.replay import ReplayState
from support import assert_same_steps


def test_replay_gives_the_same_random_numbers_and_leaves_the_caller_rng_alone():
    torch.manual_seed(3)
    state = ReplayState.capture([torch.zeros(1)])
    first = torch.rand(5)
    after = torch.get_rng_state()
    with state.replayed():
        again = torch.rand(5)
    assert torch.equal(first, again)
    assert torch.equal(torch.get_rng_state(), after)


def test_a_recompute_on_meta_tensors_sets_no_rng_state():
    # A planner's recompute (meta inputs) draws nothing: it must neither set the
    # process's generator nor put it back, which would undo another thread's draws.
    torch.manual_seed(3)
    state = ReplayState.capture([torch.empty(2, device="meta"), torch.empty(1, device="meta")])
    assert state.cpu_rng is None
    with state.replayed():
        drawn = torch.rand(4)  # as another thread's draw while the recompute runs
    after = torch.rand(4)
    torch.manual_seed(3)
    assert torch.equal(drawn, torch.rand(4)) and torch.equal(after, torch.rand(4))
    # A real input among them: the CPU generator is replayed.
    assert ReplayState.capture([torch.empty(2, device="meta"), torch.zeros(1)]).cpu_rng is not None


@pytest.mark.parametrize("as_keyword", [False, True])
def test_a_generator_passed_to_the_call_is_replayed_and_left_as_the_forward_left_it(as_keyword):
    # torch.utils.checkpoint draws anew from it in the recompute: other noise, wrong gradients.
    linear = nn.Linear(8, 8)

    def noisy(x, generator):
        return linear(x) * torch.rand(4, 8, generator=generator)

    def step(call):
        generator, x = torch.Generator().manual_seed(7), torch.ones(4, 8, requires_grad=True)
        out = call(noisy, x, generator=generator) if as_keyword else call(noisy, x, generator)
        out.pow(2).sum().backward()
        return x.grad, generator.get_state()

    plain = step(lambda function, *args, **kwargs: function(*args, **kwargs))
    for expected, got in zip(plain, step(actsave.checkpoint)):
        assert torch.equal(expected, got)


def test_replay_restores_autocast_state_of_the_forward():
    with torch.autocast("cpu", dtype=torch.bfloat16):
        state = ReplayState.capture([torch.zeros(1)])
    assert not torch.is_autocast_enabled("cpu")
    with state.replayed():
        assert torch.is_autocast_enabled("cpu")
        assert torch.get_autocast_dtype("cpu") == torch.bfloat16
    plain = ReplayState.capture([torch.zeros(1)])
    with torch.autocast("cpu", dtype=torch.bfloat16), plain.replayed():
        assert not torch.is_autocast_enabled("cpu")


def test_replay_restores_the_default_device_of_the_forward():
    with torch.device("meta"):
        state = ReplayState.capture([torch.zeros(1)])
    with state.replayed():
        assert torch.arange(3.0).device.type == "meta"
    plain = ReplayState.capture([torch.zeros(1)])
    with torch.device("meta"), plain.replayed():
        assert torch.arange(3.0).device.type == "cpu"


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv, self.out = nn.Linear(16, 48), nn.Linear(16, 16)

    def forward(self, x):
        q, k, v = self.qkv(x).view(2, 10, 3, 2, 8).permute(2, 0, 3, 1, 4)
        attended = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        return x + self.out(attended.transpose(1, 2).reshape(2, 10, 16))


def test_a_recompute_takes_the_attention_backend_its_forward_took():
    # Forward under sdpa_kernel(MATH), backward outside it: the recompute took the CPU's
    # flash kernel, which saves other tensors, and raised a RecomputeError that blamed
    # Hugging Face's use_cache.
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def layers():
        torch.manual_seed(0)
        return [Attention(), Attention(), nn.Linear(16, 3)]

    x = torch.randn(2, 10, 16)
    grads = []
    for model in (nn.Sequential(*layers()), actsave.CheckpointedSequential(*layers(), segments=[1, 2])):
        with sdpa_kernel(SDPBackend.MATH):
            out = model(x)
        out.sum().backward()
        grads.append([p.grad for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads))
    assert torch.backends.cuda.flash_sdp_enabled()  # as the recompute found it


class ConvNoise(nn.Module):
    """A convolution and noise drawn without a dtype (the default dtype's numbers)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 3, 3, padding=1)

    def forward(self, x):
        y = self.conv(x)
        return torch.tanh(y * (1 + 0.1 * torch.randn(y.shape).to(y.dtype)))


@contextlib.contextmanager
def _default_dtype(dtype):
    found = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(found)


@pytest.mark.parametrize("setting", ["default_dtype", "onednn_off"])
def test_a_recompute_runs_under_the_kernel_settings_its_forward_ran_under(setting):
    # The forward inside the setting, the backward outside: float64 noise of other
    # values (2.07 off plain); oneDNN's convolution for the reference one (7.6e-6 off).
    context = {"default_dtype": lambda: _default_dtype(torch.float64),
               "onednn_off": lambda: torch.backends.mkldnn.flags(enabled=False)}[setting]

    def layers():
        torch.manual_seed(0)
        return [ConvNoise(), ConvNoise(), nn.Conv2d(3, 2, 1)]

    x, grads, found = torch.randn(2, 3, 6, 6), [], replay._settings()
    for model in (nn.Sequential(*layers()), actsave.CheckpointedSequential(*layers(), segments=[0, 2])):
        torch.manual_seed(1)
        with context():
            out = model(x)
        out.square().sum().backward()
        grads.append([p.grad for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads))
    assert replay._settings() == found  # as the recompute found them


def test_checkpoint_made_under_a_device_context_recomputes_there():
    # torch.arange without device= inside `with torch.device(...)` must recompute there too.
    x = torch.randn(5, requires_grad=True)
    with torch.device("meta"):
        meta_x = torch.randn(5, requires_grad=True)
        y = actsave.checkpoint(lambda t: t * torch.arange(5.0), meta_x)
    y.sum().backward()
    assert meta_x.grad.device.type == "meta"
    y = actsave.checkpoint(lambda t: t * torch.arange(5.0), x)
    with torch.device("meta"):  # backward under another default device
        y.sum().backward()
    assert torch.equal(x.grad, torch.arange(5.0))


# --- state a forward reads and mutates -----------------------------------------------


class EMA(nn.Module):
    """A user's module that keeps a running average of what it sees, in a buffer."""

    def __init__(self):
        super().__init__()
        self.register_buffer("average", torch.zeros(4))

    def forward(self, x):
        with torch.no_grad():
            self.average.mul_(0.9).add_(x.mean(0), alpha=0.1)
        return x * 2


def mutating_models():
    # Each ends in a layer that saves its output, so the recompute runs through the
    # mutating module (it stops at the last saved tensor).
    torch.manual_seed(0)
    return {
        "batchnorm": nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Tanh()),
        "instancenorm": nn.Sequential(
            nn.Linear(4, 4), nn.Unflatten(1, (2, 2)),
            nn.InstanceNorm1d(2, affine=True, track_running_stats=True), nn.Flatten(), nn.Tanh(),
        ),
        "spectral_norm": nn.Sequential(nn.utils.parametrizations.spectral_norm(nn.Linear(4, 4)), nn.Tanh()),
        "ema": nn.Sequential(nn.Linear(4, 4), EMA(), nn.Tanh()),
    }


@pytest.mark.parametrize("name", list(mutating_models()))
def test_state_a_module_mutates_in_forward_is_mutated_once(name):
    model, twin = mutating_models()[name], mutating_models()[name]
    x = torch.randn(8, 4)
    model(x).sum().backward()
    actsave.checkpoint(twin, x).sum().backward()
    for (key, want), got in zip(model.state_dict().items(), twin.state_dict().values()):
        assert torch.equal(got, want), key
    for p, q in zip(model.parameters(), twin.parameters()):
        if name == "spectral_norm":
            # The recompute starts from the vectors the forward's power iteration left,
            # so its sigma is one iteration further on: close, not bit-identical.
            torch.testing.assert_close(q.grad, p.grad, rtol=1e-3, atol=1e-5)
        else:
            assert torch.equal(q.grad, p.grad)


def test_a_second_forward_before_backward_may_move_batchnorm_statistics():
    # Two views of a batch through one encoder, one backward: plain PyTorch allows it.
    model, twin = mutating_models()["batchnorm"], mutating_models()["batchnorm"]
    x, y = torch.randn(8, 4), torch.randn(8, 4)
    (model(x) * model(y)).sum().backward()
    (actsave.checkpoint(twin, x) * actsave.checkpoint(twin, y)).sum().backward()
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p.grad, q.grad)


def linear_weight(model):
    return model[0].weight


def linear_bias(model):  # Linear does not save its bias: only the module hooks see it
    return model[0].bias


@pytest.mark.parametrize("replaced", [False, True])
@pytest.mark.parametrize("tensor_of", [linear_weight, linear_bias])
def test_parameter_changed_between_forward_and_backward_raises_as_autograd_does(tensor_of, replaced):
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
    out = actsave.checkpoint(model, torch.randn(3, 4))
    read, name = tensor_of(model), "weight" if tensor_of is linear_weight else "bias"
    if replaced:  # the module holds another since: the error still names the one the forward read
        setattr(model[0], name, nn.Parameter(read.detach().clone()))
    with torch.no_grad():
        read.add_(1.0)  # an optimizer step of a GAN's other network
    with pytest.raises(RuntimeError, match=f"modified by an inplace operation: parameter '{name}' of Linear"):
        out.sum().backward()


class _GradientStatistic(nn.Module):
    """Keeps a statistic of its output's gradient in a buffer its forward never reads."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.register_buffer("power", torch.zeros(4))

    def forward(self, x):
        h = torch.tanh(self.fc(x))
        h.register_hook(self._note)
        return x + h

    def _note(self, grad):
        with torch.no_grad():
            self.power.mul_(0.9).add_(grad.pow(2).mean(0), alpha=0.1)


def test_a_buffer_a_backward_hook_changes_before_the_recompute_raises_saying_what_changed_when():
    # Every buffer of the modules run is checked (which ones a forward reads is not
    # known); the error must not claim the forward read it.
    out = actsave.checkpoint(_GradientStatistic(), torch.randn(3, 4, requires_grad=True))
    with pytest.raises(RuntimeError, match=r"buffer 'power' of _GradientStatistic .* changed between the "
                                           r"forward .* and its recompute.*backward hook"):
        out.sum().backward()


def test_weight_a_function_closes_over_is_checked_too():
    # Checked because autograd saves it (x needs grad); a leaf read outside any module
    # and not saved is not seen (NOTE [ State a forward reads and mutates ]).
    weight = torch.randn(4, 4, requires_grad=True)
    out = actsave.checkpoint(lambda x: torch.tanh(x @ weight), torch.randn(3, 4, requires_grad=True))
    with torch.no_grad():
        weight.mul_(0.5)
    with pytest.raises(RuntimeError, match="modified by an inplace operation: a tensor of shape .* read it in its "
                                           "forward"):
        out.sum().backward()


class _GathersParameters:
    """ZeRO-3 style gathering (FSDP1 with use_orig_params alike): each parameter's data is
    the whole tensor while its module runs (forward, recompute, backward) and empty
    otherwise, so between a forward and its recompute it is other storage."""

    def __init__(self, model: nn.Module):
        self.whole = {p: p.detach().clone() for p in model.parameters()}
        for module in model.modules():
            if module._parameters:
                module.register_forward_pre_hook(lambda m, args: self.gather(m))
                module.register_full_backward_pre_hook(lambda m, grad: self.gather(m))
                module.register_forward_hook(lambda m, args, out: self.free(m))
        for p in model.parameters():
            p.data = torch.empty(0)

    def gather(self, module):
        for p in module._parameters.values():
            p.data = self.whole[p].clone()

    def free(self, module):
        for p in module._parameters.values():
            p.data = torch.empty(0)


@pytest.mark.parametrize("how", ["sequential", "checkpoint_module", "checkpoint_lambda"])
def test_parameters_gathered_again_for_the_recompute_train_as_plain(how):
    # Their storage differs at every call: NOTE [ Parameters a recompute reads ].
    def step(checkpointed: bool):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16))
        _GathersParameters(model)
        x = torch.randn(4, 16, requires_grad=True)
        checkpointed_as(how if checkpointed else "plain", model, x).sum().backward()
        return [x.grad, *(p.grad for p in model.parameters())]

    for plain, checkpointed in zip(step(False), step(True)):
        assert torch.equal(plain, checkpointed)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("how", ["sequential", "checkpoint_module", "checkpoint_lambda"])
def test_parameters_frozen_or_unfrozen_between_forward_and_backward_recompute_as_the_forward_ran(how, tied):
    # The recompute saves what the forward saved only with the forward's requires_grad:
    # with square layers torch's checkpoint saves other tensors of the same shapes and
    # gives a wrong input gradient, silently. A tied weight is one tensor, set once.
    def step(checkpointed: bool):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16))
        if tied:
            model[2].weight = model[0].weight
        model[0].weight.requires_grad_(False)
        x = torch.randn(4, 16, requires_grad=True)
        out = checkpointed_as(how if checkpointed else "plain", model, x)
        model[0].weight.requires_grad_(True)
        model[2].bias.requires_grad_(False)
        (out * torch.arange(16.0)).sum().backward()
        assert model[0].weight.requires_grad and not model[2].bias.requires_grad  # the caller's, after
        return [x.grad, *(p.grad for p in model.parameters())]

    for plain, checkpointed in zip(step(False), step(True)):
        assert (plain is None and checkpointed is None) or torch.equal(plain, checkpointed)


class _FreezesItsFirstLayer(nn.Module):
    """Freezes its first layer after using it: a freeze schedule applied in the forward."""

    def __init__(self):
        super().__init__()
        self.first, self.second = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x):
        h = torch.tanh(self.first(x))
        self.first.requires_grad_(False)
        return self.second(h)


def test_a_parameter_frozen_in_the_forward_after_its_use_recomputes_as_used_or_raises():
    # Where its module is called under global hooks (a function's checkpoint) its flag is
    # noted as the module is called, and the recompute freezes it again: bit-identical,
    # and frozen after the backward as in plain PyTorch (a flag the recompute changed is
    # not flipped back). Where the layers are known the flag is noted as the forward ends, and the
    # recompute saves what the forward did not: RecomputeError, as torch's checkpoint
    # raises (NOTE [ Parameters a recompute reads ]).
    def step(how: str):
        torch.manual_seed(0)
        block = _FreezesItsFirstLayer()
        x = torch.randn(4, 16, requires_grad=True)
        checkpointed_as(how, block, x).pow(2).sum().backward()
        assert not block.first.weight.requires_grad and block.second.weight.requires_grad
        return [x.grad, *(p.grad for p in block.parameters())]

    for plain, checkpointed in zip(step("plain"), step("checkpoint_lambda")):
        assert (plain is None and checkpointed is None) or torch.equal(plain, checkpointed)
    for how in ("sequential", "checkpoint_module"):
        with pytest.raises(RecomputeError, match="saved a tensor of shape"):
            step(how)


class _UnfreezesItsSecondLayerOnce(nn.Module):
    """Unfreezes its second layer just before its first use, once: a schedule's step
    that Python state consumes, so its recompute does not take it again."""

    def __init__(self):
        super().__init__()
        self.first, self.second = nn.Linear(16, 16), nn.Linear(16, 16)
        self.second.weight.requires_grad_(False)
        self.unfreeze = True

    def forward(self, x):
        h = torch.tanh(self.first(x))
        if self.unfreeze:
            self.second.weight.requires_grad_(True)
            self.unfreeze = False
        return self.second(h)


@pytest.mark.parametrize("how", ["sequential", "checkpoint_module", "checkpoint_lambda"])
def test_a_parameter_unfrozen_in_the_forward_before_its_use_recomputes_as_used(how):
    # Noted as the forward ends (as its module is called, under global hooks), not as the
    # forward starts: the recompute does not unfreeze it again, so a flag noted at the
    # start would make it save other tensors (NOTE [ Parameters a recompute reads ]).
    def step(checkpointed: bool):
        torch.manual_seed(0)
        block = _UnfreezesItsSecondLayerOnce()
        x = torch.randn(4, 16, requires_grad=True)
        checkpointed_as(how if checkpointed else "plain", block, x).pow(2).sum().backward()
        assert block.second.weight.requires_grad
        return [x.grad, *(p.grad for p in block.parameters())]

    for plain, checkpointed in zip(step(False), step(True)):
        assert (plain is None and checkpointed is None) or torch.equal(plain, checkpointed)


@pytest.mark.parametrize("frozen_in_forward", [True, False], ids=["unfrozen after", "frozen after"])
def test_two_threads_recomputing_with_one_parameter_run_with_its_forward_flag_and_leave_it_as_found(
        frozen_in_forward):
    # The flag changed between the forwards and two backwards whose recomputes overlap,
    # the weight read after the first recompute ends: were each recompute to flip back
    # what it flipped as it ends, the second would read the new flag and save other
    # tensors (wrong gradients, or a RecomputeError); were each to put back the flag it
    # found, the weight would end as the forwards left it (NOTE [ Parameters a recompute
    # reads ]).
    def model_and_inputs():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
        model[2].weight.requires_grad_(not frozen_in_forward)
        return model, [torch.randn(4, 8, requires_grad=True) for _ in range(2)]

    model, inputs = model_and_inputs()
    for x in inputs:
        model(x).pow(2).sum().backward()
    expected = [x.grad for x in inputs]

    model, inputs = model_and_inputs()
    first_in, second_in, first_done = threading.Event(), threading.Event(), threading.Event()
    in_backward = []

    def overlap(module, args):  # the second recompute reads the weight after the first ends
        if not in_backward:
            return
        if threading.current_thread().name == "first":
            first_in.set()
            assert second_in.wait(10)
        else:
            second_in.set()
            assert first_done.wait(10)

    model[2].register_forward_pre_hook(overlap)
    outs = [actsave.checkpoint(model, x) for x in inputs]
    model[2].weight.requires_grad_(frozen_in_forward)
    in_backward.append(True)
    errors = []

    def backward(out, done=None):
        try:
            out.pow(2).sum().backward()
        except Exception as error:  # noqa: BLE001 - reported below
            errors.append(error)
        if done is not None:
            done.set()

    first = threading.Thread(target=backward, args=(outs[0], first_done), name="first")
    second = threading.Thread(target=backward, args=(outs[1],), name="second")
    first.start()
    assert first_in.wait(10)
    second.start()
    first.join(20)
    second.join(20)
    assert not errors and model[2].weight.requires_grad is frozen_in_forward
    for want, got in zip(expected, (x.grad for x in inputs)):
        assert torch.equal(want, got)


def test_two_threads_recomputing_with_a_parameter_their_forwards_used_with_different_flags_leave_it_as_found():
    # Frozen in one forward, not in the other, unfrozen before both backwards: the two
    # recomputes cannot both have their flag (docs/limits.md), but the weight must end as
    # the backwards found it; were each to flip back what it set, the second would leave
    # it frozen, and training would stop updating it (NOTE [ Parameters a recompute
    # reads ]).
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
    first_in, second_in, first_done = threading.Event(), threading.Event(), threading.Event()
    in_backward = []

    def overlap(module, args):
        if not in_backward:
            return
        if threading.current_thread().name == "first":
            first_in.set()
            second_in.wait(10)
        else:
            second_in.set()
            first_done.wait(10)

    model[2].register_forward_pre_hook(overlap)
    model[2].weight.requires_grad_(False)
    frozen = actsave.checkpoint(model, torch.randn(4, 8, requires_grad=True))
    model[2].weight.requires_grad_(True)
    unfrozen = actsave.checkpoint(model, torch.randn(4, 8, requires_grad=True))
    in_backward.append(True)

    def backward(out, done=None):
        try:
            out.pow(2).sum().backward()
        except RecomputeError:  # the first recompute runs with the second's flag
            pass
        if done is not None:
            done.set()

    first = threading.Thread(target=backward, args=(frozen, first_done), name="first")
    second = threading.Thread(target=backward, args=(unfrozen,), name="second")
    first.start()
    assert first_in.wait(10)
    second.start()
    first.join(20)
    second.join(20)
    assert model[2].weight.requires_grad


def test_a_flag_autograd_refuses_to_set_leaves_no_flag_held():
    # Leaves are held one by one: those held before a refusal (an integer tensor cannot
    # require grad) must be released, or their flags stay set for every later recompute
    # (NOTE [ Parameters a recompute reads ]).
    from actsave.runtime.guarded_parameters import _FLAGS_HELD
    weight, counts = torch.randn(4, requires_grad=True), torch.arange(4)
    with pytest.raises(RuntimeError, match="floating point"):
        _FLAGS_HELD.hold_all([(weight, False), (counts, True)])
    assert weight.requires_grad and not _FLAGS_HELD._held


@pytest.mark.parametrize("how", ["closure", "attribute", "argument"])
def test_a_leaf_read_outside_any_module_and_unfrozen_before_the_backward_recomputes_as_the_forward_ran(how):
    # A weight closed over, held as a plain tensor attribute, or passed as an argument:
    # with the new flag the recompute saved the input where the forward saved the
    # weight, both 8x8, and the input's gradient came out wrong by up to 70 (torch's
    # checkpoint too): NOTE [ Parameters a recompute reads ].
    weight = torch.randn(8, 8)
    holder = nn.Module()
    holder.weight = weight  # a plain tensor: not a registered parameter

    def step(checkpointed: bool):
        weight.requires_grad_(False)
        weight.grad = None
        torch.manual_seed(1)
        x = torch.randn(8, 8, requires_grad=True)
        if how == "argument":
            function, args = (lambda a, w: torch.sigmoid(a @ w)), (x, weight)
        else:
            read = weight if how == "closure" else holder.weight
            function, args = (lambda a: torch.sigmoid(a @ read)), (x,)
        out = actsave.checkpoint(function, *args) if checkpointed else function(*args)
        weight.requires_grad_(True)
        out.pow(2).sum().backward()
        return x.grad, weight.grad

    (plain_x, plain_w), (checkpointed_x, checkpointed_w) = step(False), step(True)
    assert torch.equal(plain_x, checkpointed_x) and plain_w is None and checkpointed_w is None


def test_a_recompute_runs_on_copies_of_the_state_its_forward_mutated_and_puts_the_originals_back():
    # One copy of each mutated buffer per recompute pass, made together as it starts
    # (one foreach op per dtype), not a clone per buffer per module call; the
    # originals are back when it ends (NOTE [ State a forward reads and mutates ]).
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Tanh(), nn.BatchNorm1d(4), nn.Tanh())
    first, second = model[1], model[3]
    originals = (first.running_mean, second.running_mean)
    seen = []  # as each BatchNorm starts: whether each one holds its own statistics

    def note(module, args):
        seen.append((first.running_mean is originals[0], second.running_mean is originals[1]))

    out = actsave.checkpoint(model, torch.randn(8, 4))
    handles = [first.register_forward_pre_hook(note), second.register_forward_pre_hook(note)]
    try:
        out.sum().backward()
    finally:
        for handle in handles:
            handle.remove()
    assert seen == [(False, False), (False, False)]  # both on copies from the pass's start
    assert first.running_mean is originals[0] and second.running_mean is originals[1]  # put back


# --- the recompute reads module state as the forward read it ----------------------


class Center(nn.Module):
    """Subtracts a running mean of what it sees, then updates it: reads a buffer, then
    mutates it (the recompute must read the value the forward read)."""

    def __init__(self, width: int = 8):
        super().__init__()
        self.register_buffer("mu", torch.zeros(width))

    def forward(self, x):
        y = x - self.mu
        with torch.no_grad():
            self.mu.mul_(0.5).add_(0.5 * x.mean(0))
        return y


def center_chain():
    torch.manual_seed(0)
    return [nn.Linear(8, 8), Center(), nn.Tanh(), nn.Linear(8, 1)]


def assert_same_training(plain: nn.Module, model: nn.Module, steps: int = 3, x=None) -> None:
    """``steps`` steps of each on the same batches: gradients after each and state after
    all bit-identical."""
    for step in range(steps):
        batch = torch.randn(4, 8) + 3 if x is None else x(step)
        for m in (plain, model):
            m.zero_grad()
            m(batch).sum().backward()
        for (name, p), q in zip(plain.named_parameters(), model.parameters()):
            assert torch.equal(p.grad, q.grad), (step, name)
    for (name, want), got in zip(plain.state_dict().items(), model.state_dict().values()):
        assert torch.equal(want, got), name


@pytest.mark.parametrize("how", ["sequential", "checkpoint_module", "checkpoint_lambda"])
def test_a_buffer_read_then_updated_is_read_as_the_forward_read_it(how):
    # torch.utils.checkpoint recomputes from the updated mean, so its gradients are wrong.
    plain = nn.Sequential(*center_chain())
    if how == "sequential":
        model = actsave.CheckpointedSequential(*center_chain(), segments=[0, 3])
    else:
        inner = nn.Sequential(*center_chain()[:3])
        head = center_chain()[3]
        call = inner if how == "checkpoint_module" else (lambda t: inner(t))  # known layers, global hooks
        model = nn.Sequential(inner, head)
        model.forward = lambda x: head(actsave.checkpoint(call, x))
    assert_same_training(plain, model)


class _CentersItsOwnInput(nn.Module):
    """Reads, then updates, a buffer of its own in its own forward (no submodule holds it)."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.register_buffer("mu", torch.zeros(8))
        self.shift = nn.Parameter(torch.zeros(8))  # added, not saved: only the module's own state says it was read

    def forward(self, x):
        h = self.linear(x)
        y = torch.tanh(h - self.mu + self.shift)
        with torch.no_grad():
            self.mu.mul_(0.5).add_(0.5 * h.mean(0))
        return y


class _CheckpointsItsOwnBody(_CentersItsOwnInput):
    def forward(self, x):
        return actsave.checkpoint(super().forward, x)


class _AliasesItsForward(_CentersItsOwnInput):
    """Its forward under another name: ``forward = _run``."""

    def _run(self, x):
        return _CentersItsOwnInput.forward(self, x)

    forward = _run


@pytest.mark.parametrize("how", ["bound_forward", "inside_forward", "override_named_otherwise", "class_alias",
                                 "partial"])
def test_a_bound_method_of_a_module_is_watched_with_its_module_own_state(how):
    # checkpoint(block.forward, x) runs the block without calling it, so no module hook
    # saw its own buffer: the recompute updated it again and read the updated value.
    # torch.utils.checkpoint does the same. A forward is told by the function, not its
    # name: an override named otherwise, or an alias, was off by 1.39.
    import functools
    import types

    torch.manual_seed(0)
    plain = nn.Sequential(_CentersItsOwnInput(), nn.Linear(8, 1))
    model = nn.Sequential(_AliasesItsForward() if how == "class_alias" else _CheckpointsItsOwnBody(), nn.Linear(8, 1))
    model.load_state_dict(plain.state_dict())
    block, head = model[0], model[1]
    if how == "override_named_otherwise":
        def centred(self, x):
            return _CentersItsOwnInput.forward(self, x)
        block.forward = types.MethodType(centred, block)
    if how != "inside_forward":
        forward = block.forward
        if how in ("bound_forward", "partial"):
            forward = _CentersItsOwnInput.forward.__get__(block)  # super().forward, from outside
        if how == "partial":
            forward = functools.partial(forward)
        model.forward = lambda x: head(actsave.checkpoint(forward, x))
    assert_same_training(plain, model)


def test_a_parameter_of_a_bound_method_s_module_changed_before_backward_raises():
    block = _CentersItsOwnInput()
    out = actsave.checkpoint(block.forward, torch.randn(4, 8))
    with torch.no_grad():
        block.shift.add_(1.0)
    with pytest.raises(RuntimeError, match="parameter 'shift' of _CentersItsOwnInput"):
        out.sum().backward()


def checkpointed_as(how: str, block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``block(x)`` checkpointed ``how``: as a CheckpointedSequential's checkpointed
    segment, or by ``actsave.checkpoint`` of the module (known layers) or of a function
    that calls it (global hooks); ``"plain"``: not checkpointed."""
    if how == "plain":
        return block(x)
    if how == "sequential":
        return actsave.CheckpointedSequential(block, nn.Identity(), segments=[0, 1])(x)
    return actsave.checkpoint(block if how == "checkpoint_module" else (lambda t: block(t)), x)


class _ShrinksItsWeight(nn.Module):
    """Scales its weight in place in its forward, then uses it."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(8, 8))

    def forward(self, x):
        with torch.no_grad():
            self.weight.mul_(0.9)
        return torch.tanh(x @ self.weight)


@pytest.mark.parametrize("how", ["sequential", "checkpoint_module", "checkpoint_lambda"])
def test_a_parameter_the_forward_changes_again_in_the_recompute_raises_and_is_put_back(how):
    # torch.utils.checkpoint scales the weight twice (0.81x) and gives wrong gradients.
    torch.manual_seed(0)
    block = _ShrinksItsWeight()
    weight = block.weight.detach().clone()
    x = torch.randn(4, 8, requires_grad=True)
    out = checkpointed_as(how, block, x)
    with pytest.raises(actsave.RecomputeError, match="changed parameter 'weight' of _ShrinksItsWeight in place.*again"):
        out.sum().backward()
    assert torch.equal(block.weight, weight * 0.9)  # as after one forward


@pytest.mark.parametrize("keep", ["inputs", "selective"])
def test_a_parameter_the_recompute_changes_to_the_same_values_trains_exactly(keep):
    # Embedding(max_norm=...) renormalizes its rows in place in every forward: again in
    # the recompute, to the values the forward left.
    def model():
        torch.manual_seed(0)
        return nn.Sequential(nn.Embedding(32, 8, max_norm=1.0), nn.Linear(8, 8))

    ids = torch.randint(0, 32, (4, 6))
    plain, wrapped = model(), model()
    plain(ids).sum().backward()
    actsave.checkpoint(wrapped, ids, keep=keep).sum().backward()
    for p, q in zip(plain.parameters(), wrapped.parameters()):
        assert torch.equal(p, q) and torch.equal(p.grad, q.grad)


def test_a_parameter_the_recompute_changes_by_rounding_alone_is_put_back_and_trains():
    # At this size some rows' norms come out an ulp above max_norm after the forward's
    # renormalization, and the recompute's moves them by an ulp again (17 of 1000 rows).
    def model():
        torch.manual_seed(0)
        return nn.Sequential(nn.Embedding(1000, 64, max_norm=1.0), nn.Linear(64, 8))

    ids = torch.randint(0, 1000, (256,), generator=torch.Generator().manual_seed(0))
    plain, wrapped = model(), model()
    plain(ids).sum().backward()
    actsave.checkpoint(wrapped, ids).sum().backward()
    for p, q in zip(plain.parameters(), wrapped.parameters()):
        assert torch.equal(p, q)  # as after one forward
        assert torch.allclose(p.grad, q.grad, rtol=1e-5, atol=1e-6)


class _ByMode(nn.Module):
    """Linear, then what its ``training`` flag decides (``kind``), then tanh and Linear."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind, self.first, self.last = kind, nn.Linear(8, 16), nn.Linear(16, 8)
        self.mode_dependent = nn.BatchNorm1d(16) if kind == "batchnorm" else nn.Dropout(0.3)

    def forward(self, x):
        h = self.first(x)
        h = h * (0.5 if self.training else 1.0) * h if self.kind == "branch" else self.mode_dependent(h)
        return self.last(torch.tanh(h))


@pytest.mark.parametrize("kind", ["batchnorm", "dropout", "branch"])
@pytest.mark.parametrize("how", ["sequential", "checkpoint_module", "checkpoint_lambda"])
def test_the_recompute_runs_each_module_in_the_mode_its_forward_ran_in(kind, how):
    # model.eval() between forward and backward: torch.utils.checkpoint recomputes in
    # eval mode (wrong gradients for the branch, an error for BatchNorm and Dropout).
    def step(checkpointed: bool):
        torch.manual_seed(0)
        block = _ByMode(kind)
        x = torch.randn(4, 8, requires_grad=True)
        out = checkpointed_as(how if checkpointed else "plain", block, x)
        block.eval()
        out.pow(2).sum().backward()
        assert not any(module.training for module in block.modules())  # the caller's mode, after
        return [x.grad, *(p.grad for p in block.parameters()), *block.buffers()]

    for plain, checkpointed in zip(step(False), step(True)):
        assert torch.equal(plain, checkpointed)


class _EvaluatesItsNormOnce(nn.Module):
    """Puts its BatchNorm in eval mode at its first call (freezing it), every call
    after that finds it so; then a branch on its own mode."""

    def __init__(self):
        super().__init__()
        self.first, self.norm, self.frozen = nn.Linear(8, 8), nn.BatchNorm1d(8), False

    def forward(self, x):
        if not self.frozen:
            self.norm.eval()
            self.frozen = True
        return torch.tanh(self.norm(self.first(x))) * (2.0 if self.training else 3.0)


@pytest.mark.parametrize("how", ["sequential", "checkpoint_module", "checkpoint_lambda"])
def test_a_mode_the_forward_itself_sets_is_the_one_its_recompute_runs_in(how):
    def step(checkpointed: bool):
        torch.manual_seed(0)
        block = _EvaluatesItsNormOnce()
        x = torch.randn(4, 8, requires_grad=True)
        out = checkpointed_as(how if checkpointed else "plain", block, x)
        out.pow(2).sum().backward()
        modes = torch.tensor([module.training for module in block.modules()])
        return [x.grad, *(p.grad for p in block.parameters()), *block.buffers(), modes]

    for plain, checkpointed in zip(step(False), step(True)):
        assert torch.equal(plain, checkpointed)


class _EvaluatesItsNormForOneCall(nn.Module):
    """Runs its BatchNorm in eval mode for one call, then puts it back in train mode."""

    def __init__(self):
        super().__init__()
        self.first, self.norm = nn.Linear(8, 8), nn.BatchNorm1d(8)

    def forward(self, x):
        self.norm.eval()
        y = torch.tanh(self.norm(self.first(x)))
        self.norm.train()
        return y


@pytest.mark.parametrize("how", ["sequential", "checkpoint_module", "checkpoint_lambda"])
def test_a_recompute_that_stops_before_the_forward_restores_a_mode_gives_the_callers_back(how):
    # The early stop ends the recompute after its last save, before norm.train() runs.
    block = _EvaluatesItsNormForOneCall()
    checkpointed_as(how, block, torch.randn(4, 8, requires_grad=True)).sum().backward()
    assert block.norm.training


def test_a_bfloat16_parameter_the_recompute_changes_again_raises_too():
    torch.manual_seed(0)
    block = _ShrinksItsWeight().to(torch.bfloat16)
    out = actsave.checkpoint(block, torch.randn(4, 8, dtype=torch.bfloat16, requires_grad=True))
    with pytest.raises(actsave.RecomputeError, match="changed parameter 'weight'"):
        out.float().sum().backward()


def fake_quantized_chain():
    from torch.ao.quantization import FakeQuantize, MovingAverageMinMaxObserver
    torch.manual_seed(0)
    return [nn.Linear(8, 16), FakeQuantize(MovingAverageMinMaxObserver, quant_min=0, quant_max=255),
            nn.Tanh(), nn.Linear(16, 16), FakeQuantize(MovingAverageMinMaxObserver, quant_min=0, quant_max=255),
            nn.Tanh(), nn.Linear(16, 2)]


def test_quantization_aware_training_keeps_gradients_and_observer_state_bit_identical():
    # FakeQuantize updates its observer's moving min and max, then quantizes with the
    # scale taken from them: a recompute that read the updated ones would get other gradients.
    plain = nn.Sequential(*fake_quantized_chain())
    model = actsave.CheckpointedSequential(*fake_quantized_chain(), segments=[0, 3, 6])
    assert_same_training(plain, model, x=lambda step: torch.randn(4, 8) * (step + 1))


def test_a_block_placed_twice_is_recomputed_from_the_state_each_occurrence_saw():
    # Its BatchNorm runs once per occurrence, as in nn.Sequential: 6 batches tracked,
    # not 10 (the later occurrences recomputed on the real buffers).
    def chain(block):
        return [*[block] * 6, nn.Linear(16, 4)]

    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(16, 16), nn.BatchNorm1d(16), nn.ReLU(), Center(16))
    twin = copy.deepcopy(block)
    plain = nn.Sequential(*chain(block))
    torch.manual_seed(1)
    head = nn.Linear(16, 4)
    plain[6].load_state_dict(head.state_dict())
    model = actsave.CheckpointedSequential(*chain(twin), segments=[0, 3, 6])
    model[6].load_state_dict(head.state_dict())
    assert_same_training(plain, model, x=lambda step: torch.randn(8, 16) + step)
    assert twin[1].num_batches_tracked.item() == 3 * 6


def test_spectral_norm_recomputes_from_the_vectors_the_forward_started_from():
    # Its power iteration reads and updates u and v: the recompute starts from the u
    # and v the forward started from, not one iteration further on.
    model, twin = mutating_models()["spectral_norm"], mutating_models()["spectral_norm"]
    x = torch.randn(8, 4)
    model(x).sum().backward()
    actsave.checkpoint(twin, x).sum().backward()
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p.grad, q.grad)


def test_the_snapshot_is_held_from_the_forward_to_the_recompute_and_counted_in_kept_bytes():
    model = nn.Sequential(nn.Linear(8, 8), Center(), nn.Tanh())
    x = torch.randn(4, 8, requires_grad=True)
    out = actsave.checkpoint(model, x)
    # The kept input (the caller's, held by reference) and the snapshot of the mean.
    assert actsave.kept_bytes() == {"device": 4 * 8 * 4 + 8 * 4, "host": 0}
    out.sum().backward()
    assert actsave.kept_bytes() == {"device": 0, "host": 0}


def test_a_module_without_mutated_state_keeps_no_snapshot():
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Tanh()).eval()  # eval: no update
    out = actsave.checkpoint(model, torch.randn(4, 8, requires_grad=True))
    assert actsave.kept_bytes() == {"device": 4 * 8 * 4, "host": 0}  # the kept input only
    out.sum().backward()


class LazyCache(nn.Module):
    """Registers a buffer in its first forward."""

    def forward(self, x):
        if getattr(self, "cache", None) is None:
            self.register_buffer("cache", x.detach().mean(0))
        return x - self.cache


def test_a_forward_that_registers_a_buffer_cannot_be_replayed_and_raises_naming_it():
    model = nn.Sequential(nn.Linear(8, 8), LazyCache(), nn.Tanh())
    out = actsave.checkpoint(model, torch.randn(4, 8))
    with pytest.raises(actsave.RecomputeError, match="LazyCache registered or removed buffer 'cache'"):
        out.sum().backward()
    # Registered before checkpointing, it replays.
    out = actsave.checkpoint(model, torch.randn(4, 8))
    out.sum().backward()


# --- a buffer the forward replaces, lazy modules -----------------------------------


class ReassignedCenter(Center):
    """Center whose forward replaces its buffer by a new tensor (``self.mu = ...``, the
    out-of-place EMA) rather than changing it in place."""

    def forward(self, x):
        y = x - self.mu
        self.mu = (0.5 * self.mu + 0.5 * x.mean(0)).detach()
        return y


def reassigned_center_chain():
    torch.manual_seed(0)
    return [nn.Linear(8, 8), ReassignedCenter(), nn.Tanh(), nn.Linear(8, 1)]


def checkpointed_model(how: str, chain) -> nn.Module:
    """``chain()``'s layers with the first three checkpointed ``how`` (as
    checkpointed_as), the last one plain."""
    if how == "sequential":
        return actsave.CheckpointedSequential(*chain(), segments=[0, 3])
    inner, head = nn.Sequential(*chain()[:3]), chain()[3]
    model = nn.Sequential(inner, head)
    model.forward = lambda x: head(checkpointed_as(how, inner, x))
    return model


@pytest.mark.parametrize("how", ["sequential", "checkpoint_module", "checkpoint_lambda"])
def test_a_buffer_read_then_replaced_is_read_as_the_forward_read_it(how):
    # Under global hooks (checkpoint_lambda) a replaced buffer's new tensor is at the
    # version the old one was at: its identity, not its version, says it changed.
    plain = nn.Sequential(*reassigned_center_chain())
    assert_same_training(plain, checkpointed_model(how, reassigned_center_chain))


@pytest.mark.parametrize("how", ["checkpoint_module", "checkpoint_lambda"])
def test_a_buffer_the_forward_replaced_may_change_before_the_backward(how):
    # The recompute reads the snapshot of the old tensor, not the old tensor: it is not
    # checked unchanged.
    grads = []
    for kind in ("plain", how):
        block = nn.Sequential(*reassigned_center_chain()[:3])
        old = block[1].mu
        out = checkpointed_as(kind, block, torch.randn(4, 8) + 3)
        old.add_(1)
        out.sum().backward()
        grads.append(block[0].weight.grad)
    assert block[1].mu is not old and torch.equal(*grads)


def lazy_block():
    return nn.Sequential(nn.LazyLinear(8), nn.LazyBatchNorm1d(), nn.Dropout(0.5), nn.Tanh())


@pytest.mark.parametrize("how", ["sequential", "checkpoint_module", "checkpoint_lambda"])
def test_a_lazy_module_is_refused_until_one_forward_initializes_it_and_then_trains_as_plain(how):
    # Its initialization draws random numbers in the forward that the recompute would
    # not draw: the Dropout after it would drop other elements (torch.utils.checkpoint's
    # gradients are wrong).
    def steps(kind, block):
        with torch.no_grad():
            block(torch.randn(5, 6))  # initializes it: shapes, random weights
        grads = []
        for _ in range(3):
            x = torch.randn(5, 6, requires_grad=True)
            checkpointed_as(kind, block, x).pow(2).sum().backward()
            grads += [x.grad, *(p.grad for p in block.parameters())]
        return grads + list(block.state_dict().values())

    torch.manual_seed(0)
    plain = steps("plain", lazy_block())
    torch.manual_seed(0)
    block = lazy_block()
    with pytest.raises(actsave.ConfigError, match=r"LazyLinear's parameter 'weight' is not initialized yet.*"
                                                  r"Run one forward of the model before checkpointing it"):
        checkpointed_as(how, block, torch.ones(5, 6, requires_grad=True))  # draws nothing
    for want, got in zip(plain, steps(how, block), strict=True):
        assert torch.equal(want, got)


def test_a_chain_of_segments_with_a_lazy_norm_is_refused_naming_it():
    # The chain snapshots its segments' buffers together as it starts (ChainState).
    chain = actsave.CheckpointedSequential(nn.Linear(6, 8), nn.LazyBatchNorm1d(), nn.Linear(8, 8),
                                           nn.LazyBatchNorm1d(), nn.Tanh(), segments=[0, 2, 4])
    with pytest.raises(actsave.ConfigError, match="LazyBatchNorm1d's parameter 'weight' is not initialized yet"):
        chain(torch.randn(5, 6, requires_grad=True))


class OwnsStatistic(nn.Module):
    """Updates its buffer and reads it."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.register_buffer("statistic", torch.ones(8))

    def forward(self, x):
        with torch.no_grad():
            self.statistic.mul_(0.5).add_(x.mean(0))
        return torch.tanh(self.linear(x) * self.statistic)


class WritesThroughAlias(nn.Module):
    """Changes another module's buffer through an alias it registered as its own."""

    def __init__(self, alias):
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.register_buffer("alias", alias)

    def forward(self, x):
        with torch.no_grad():
            self.alias.add_(x.mean(0))
        return torch.tanh(self.linear(x))


def test_a_segment_whose_buffers_a_plain_segment_before_it_changed_snapshots_them_as_it_starts():
    # The chain snapshots its checkpointed segments' buffers together as it starts
    # (ChainState); a plain segment between them that changes one (here through an alias)
    # makes that copy stale: the segment takes its own.
    from actsave.planning import plans

    def make():
        torch.manual_seed(0)
        owner = OwnsStatistic()
        return [nn.Linear(8, 8), WritesThroughAlias(owner.statistic[:]), owner, nn.Linear(8, 8)]

    plain, layers = nn.Sequential(*make()), make()
    chain = actsave.CheckpointedSequential(*layers, segments=[0, 1, 2, 3])
    state = copy.deepcopy(chain.state_dict())
    profile = actsave.profile(chain, (torch.randn(4, 8, requires_grad=True),))
    chain.load_state_dict(state)
    chain.apply_plan(plans.predict(profile, [0, 1, 2, 3], plain=[False, True, False]))
    assert_same_steps(plain, chain, [torch.randn(4, 8, generator=torch.Generator().manual_seed(step)) + step
                                     for step in range(3)])


def test_a_parameter_the_forward_changes_raises_in_a_cuda_graph_capture_naming_it(monkeypatch):
    # Its check reads values back, which a capture refuses: a clear error, not torch's.
    from actsave.runtime import guarded_parameters

    block = _ShrinksItsWeight()
    out = actsave.checkpoint(block, torch.randn(4, 8, requires_grad=True))
    monkeypatch.setattr(guarded_parameters, "capturing", lambda: True)
    with pytest.raises(actsave.RecomputeError, match="changed parameter 'weight'.*CUDA graph's capture cannot"):
        out.sum().backward()


@pytest.mark.parametrize("how", ["sequential", "checkpoint"])
def test_a_torchscript_module_in_a_checkpoint_is_refused_by_name(how):
    # Its tables are not dicts: an AttributeError from deep inside ('OrderedDictWrapper'
    # object has no attribute 'get') named neither the module nor what to do.
    scripted = torch.jit.script(nn.Linear(8, 8))
    x = torch.randn(6, 8, requires_grad=True)
    with pytest.raises(actsave.ConfigError, match="RecursiveScriptModule is a TorchScript module"):
        if how == "sequential":
            actsave.CheckpointedSequential(nn.Linear(8, 8), scripted, nn.Tanh(), segments=[2])(x)
        else:
            actsave.checkpoint(scripted, x)
