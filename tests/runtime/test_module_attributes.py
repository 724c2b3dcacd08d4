"""Python attributes a checkpointed forward sets are found by its recompute as the
forward found them (runtime/module_attributes.py, NOTE [ Python attributes a forward
sets ]): the recompute takes the forward's branches, and leaves the attributes as it
found them."""
import weakref

import pytest
import torch
from torch import nn

import actsave
from actsave.runtime.module_attributes import ModuleAttributes
from actsave.runtime.nested import Range, nested_call
from support import assert_same_steps

HOWS = ["sequential", "checkpoint_module", "checkpoint_lambda"]


class Flagged(nn.Module):
    def __init__(self):
        super().__init__()
        self.flag, self.gone = False, "here"


def test_the_attributes_a_forward_set_added_or_deleted_are_as_it_found_them_in_the_recompute():
    module, layer = Flagged(), nn.Linear(2, 2)
    attributes = ModuleAttributes()
    attributes.started(enumerate([module, layer]))
    module.flag, module.added = True, 1  # the forward sets one, adds one, deletes one
    del module.gone
    attributes.ended({module})
    module.flag = "set by the caller since"
    with attributes.as_in_forward():
        assert module.flag is False and module.gone == "here" and not hasattr(module, "added")
        module.flag, module.added = "set by the recompute", 2
    assert module.flag == "set by the caller since" and module.added == 1 and not hasattr(module, "gone")


def test_torch_layers_are_not_watched_and_their_subclasses_are():
    class MyLinear(nn.Linear):
        pass

    layer, mine = nn.Linear(2, 2), MyLinear(2, 2)
    attributes = ModuleAttributes()
    attributes.started(enumerate([layer, mine]))
    layer.note, mine.note = 1, 1
    attributes.ended({layer, mine})
    with attributes.as_in_forward():
        assert layer.note == 1 and not hasattr(mine, "note")


def test_a_forward_that_sets_nothing_installs_nothing():
    module = Flagged()
    attributes = ModuleAttributes()
    attributes.started(enumerate([module]))
    module.flag = module.flag  # the same object: no change
    module.training = module.training
    attributes.ended({module})
    assert attributes._set == []


def test_a_module_without_buffers_keeps_its_attributes_as_the_forward_left_them():
    # So a forward can hand state to its own recompute through an attribute (only the
    # modules that hold buffers, the ``holders``, are put back).
    module, other = Flagged(), Flagged()
    attributes = ModuleAttributes()
    attributes.started(enumerate([module, other]))
    module.flag = other.flag = True
    attributes.ended({other})
    with attributes.as_in_forward():
        assert module.flag is True and other.flag is False


class ActNorm(nn.Module):
    """Glow's ActNorm with its statistics in buffers, set from the first batch behind a
    Python flag; the shift is added (not saved for backward), the scale multiplied."""

    def __init__(self, width: int = 8):
        super().__init__()
        self.register_buffer("loc", torch.zeros(width))
        self.register_buffer("scale", torch.ones(width))
        self.initialized = False

    def forward(self, x):
        if not self.initialized:
            with torch.no_grad():
                self.loc.copy_(-x.mean(0))
                self.scale.copy_(1 / (x.std(0) + 1e-6))
            self.initialized = True
        return (x + self.loc) * self.scale


class Warmup(nn.Module):
    """A scale that follows a step counter kept in a Python int, beside an EMA buffer."""

    def __init__(self):
        super().__init__()
        self.linear, self.steps = nn.Linear(8, 8), 0
        self.register_buffer("mean", torch.zeros(8))

    def forward(self, x):
        self.steps += 1
        with torch.no_grad():
            self.mean.mul_(0.9).add_(x.mean(0), alpha=0.1)
        return self.linear(x) * min(1.0, self.steps / 4)


def chain(make_middle):
    torch.manual_seed(0)
    return [nn.Linear(8, 8), make_middle(), nn.Tanh(), nn.Linear(8, 2)]


def checkpointed(how: str, layers: list) -> nn.Module:
    """``layers`` with the first three checkpointed ``how``: a CheckpointedSequential's
    segment, ``actsave.checkpoint`` of a module (known layers) or of a function calling
    it (global hooks)."""
    if how == "sequential":
        return actsave.CheckpointedSequential(*layers, segments=[0, 3])
    inner, rest = nn.Sequential(*layers[:3]), nn.Sequential(*layers[3:])
    call = inner if how == "checkpoint_module" else (lambda t: inner(t))
    model = nn.Sequential(inner, rest)
    model.forward = lambda x: rest(actsave.checkpoint(call, x))
    return model


class EveryOtherCall(nn.Module):
    """Updates its EMA on every other call, by a count kept in a Python int."""

    def __init__(self):
        super().__init__()
        self.linear, self.calls = nn.Linear(8, 8), 0
        self.register_buffer("ema", torch.zeros(8))

    def forward(self, x):
        if self.calls % 2 == 0:
            with torch.no_grad():
                self.ema.mul_(0.5).add_(x.mean(0))
        self.calls += 1
        return torch.tanh(self.linear(x) + self.ema)


@pytest.mark.parametrize("how", HOWS)
@pytest.mark.parametrize("make_middle", [ActNorm, Warmup, EveryOtherCall], ids=["actnorm", "warmup", "every_other"])
def test_a_module_whose_forward_sets_python_state_trains_as_plain(make_middle, how):
    # ActNorm: the recompute skipped the initialization and added the shift as the
    # forward found it (zeros), silently. Warmup: the
    # recompute, run on the EMA's snapshot, counted a step more than the forward and
    # scaled by it. EveryOtherCall: on a call that left the EMA as it was, the recompute
    # counted an even call and updated the buffer itself, a second time.
    plain, model = nn.Sequential(*chain(make_middle)), checkpointed(how, chain(make_middle))
    assert_same_steps(plain, model, [torch.randn(6, 8, generator=torch.Generator().manual_seed(step)) * 3 + 1
                                     for step in range(5)])
    assert plain[1].__dict__.keys() == (model[1] if how == "sequential" else model[0][1]).__dict__.keys()
    if make_middle is Warmup:  # the recompute leaves the count as the forward left it
        assert plain[1].steps == (model[1] if how == "sequential" else model[0][1]).steps == 5


def test_an_attribute_holding_one_element_is_a_value_put_back():
    module = Flagged()
    module.length = torch.tensor(16)
    attributes = ModuleAttributes()
    attributes.started(enumerate([module]))
    module.length = torch.tensor(64)
    attributes.ended({module})
    with attributes.as_in_forward():
        assert module.length.item() == 16
    assert module.length.item() == 64


def test_an_attribute_holding_a_tensor_is_left_as_the_forward_left_it():
    # A cache or a record the forward keeps: holding the old one until the backward
    # would keep its memory alive (a tensor that decides the computation is a buffer).
    module = Flagged()
    module.record = torch.zeros(4)
    old = weakref.ref(module.record)
    attributes = ModuleAttributes()
    attributes.started(enumerate([module]))
    module.record, module.cache, module.flag = torch.ones(4), torch.ones(2), True
    attributes.ended({module})
    assert old() is None
    with attributes.as_in_forward():
        assert torch.equal(module.record, torch.ones(4)) and hasattr(module, "cache") and module.flag is False


class Gain(nn.Module):
    """Sets a Python gain from its EMA buffer, which a later layer reads."""

    def __init__(self):
        super().__init__()
        self.register_buffer("mean", torch.zeros(8))
        self.gain = 1.0

    def forward(self, x):
        with torch.no_grad():
            self.mean.mul_(0.9).add_(x.mean(0), alpha=0.1)
        self.gain = 1.0 + float(self.mean.abs().sum())
        return x


class ScaledByGain(nn.Module):
    def __init__(self, source: Gain):
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.__dict__["source"] = source  # read, not a submodule

    def forward(self, x):
        return torch.tanh(self.linear(x) * self.source.gain)


def test_a_nested_part_finds_the_attributes_earlier_layers_set_as_they_left_them():
    # The pass of layers [3, 6) reads the gain layer 1 set in the forward; putting back
    # every attribute for each part would give it the forward's start value.
    def make():
        torch.manual_seed(0)
        gain = Gain()
        return [nn.Linear(8, 8), gain, nn.Tanh(), nn.Linear(8, 8), ScaledByGain(gain), nn.Linear(8, 8)]

    class Nested(nn.Sequential):
        def forward(self, x):
            return nested_call(list(self), Range(0, 6, inner=(Range(0, 3), Range(3, 6, recomputed=False))), x)[0]

    plain, nested = nn.Sequential(*make()), Nested(*make())
    assert_same_steps(plain, nested, [torch.randn(4, 8, generator=torch.Generator().manual_seed(step)) + step
                                      for step in range(3)])
    assert plain[1].gain == nested[1].gain


class HeldNoise(nn.Module):
    """Multiplicative noise from a generator of its own (NOTE [ Generators a module holds ])."""

    def __init__(self, seed: int = 123):
        super().__init__()
        self.linear, self.noise = nn.Linear(8, 8), torch.Generator().manual_seed(seed)

    def forward(self, x):
        h = self.linear(x)
        return h * (1 + 0.5 * torch.randn(h.shape, generator=self.noise))


def _batches():
    return [torch.randn(6, 8, generator=torch.Generator().manual_seed(step)) for step in range(3)]


@pytest.mark.parametrize("how", HOWS)
def test_a_generator_a_module_holds_draws_the_forwards_numbers_in_the_recompute(how):
    # Drawn anew, the noise differed from the forward's: gradients 4.5-8.5 off plain's,
    # silently, and the generator a draw further than plain's at each step.
    plain, model = nn.Sequential(*chain(HeldNoise)), checkpointed(how, chain(HeldNoise))
    assert_same_steps(plain, model, _batches())
    held = model[1] if how == "sequential" else model[0][1]
    assert torch.equal(plain[1].noise.get_state(), held.noise.get_state())


def test_a_generator_two_modules_hold_is_replayed_from_the_state_the_forward_first_found():
    # Under global hooks the second module is noted after the first drew: its state
    # then is not the one to replay the first draw from.
    def make():
        torch.manual_seed(0)
        first, second = HeldNoise(), HeldNoise()
        second.noise = first.noise  # one generator, drawn from twice a forward
        return nn.Sequential(first, nn.Tanh(), second)

    wrapped = make()
    actsave.wrap(wrapped, HeldNoise)  # a checkpoint each: the second's forward finds the first's draw made
    function = make()
    function.forward = lambda x: actsave.checkpoint(lambda t: nn.Sequential.forward(function, t), x)
    for model in (wrapped, function, actsave.CheckpointedSequential(*make(), segments=[0])):
        plain = make()
        assert_same_steps(plain, model, _batches())
        assert torch.equal(plain[0].noise.get_state(), model[0].noise.get_state())


@pytest.mark.parametrize("shared", [False, True], ids=["own", "shared"])
def test_each_pass_of_a_nested_recompute_replays_the_generators_from_where_the_forward_reached_it(shared):
    # Shared: set per part from the forward's start, the second part (which does not
    # hold the generator first) drew from the state the first part's pass left: 0.69 off.
    def make():
        torch.manual_seed(0)
        first, second = HeldNoise(1), HeldNoise(2)
        if shared:
            second.noise = first.noise
        return [nn.Linear(8, 8), first, nn.Tanh(), nn.Linear(8, 8), second, nn.Linear(8, 8)]

    class Nested(nn.Sequential):
        def forward(self, x):
            return nested_call(list(self), Range(0, 6, inner=(Range(0, 3), Range(3, 6, recomputed=False))), x)[0]

    plain, nested = nn.Sequential(*make()), Nested(*make())
    assert_same_steps(plain, nested, _batches())
    for index in (1, 4):
        assert torch.equal(plain[index].noise.get_state(), nested[index].noise.get_state())


def _noisy(module, args, output):
    return output * (1 + 0.5 * torch.randn(output.shape, generator=module.noise))


@pytest.mark.parametrize("how", HOWS)
@pytest.mark.parametrize("code", ["forward_hook", "instance_forward"])
def test_a_torch_layer_running_code_of_its_own_replays_the_generator_it_holds(code, how):
    # torch.nn's own layers were not looked at: a hook drawing from one's generator drew
    # anew in the recompute (0.56-0.59 off).
    def make():
        layers = chain(nn.Tanh)
        layers[1] = nn.Linear(8, 8)
        layers[1].noise = torch.Generator().manual_seed(3)
        if code == "forward_hook":
            layers[1].register_forward_hook(_noisy)
        else:
            layer = layers[1]
            layer.forward = lambda x: _noisy(layer, (x,), nn.Linear.forward(layer, x))
        return layers

    plain, model = nn.Sequential(*make()), checkpointed(how, make())
    assert_same_steps(plain, model, _batches())


def test_a_generator_replaced_after_the_forward_is_not_the_one_the_recompute_draws_from():
    plain, model = nn.Sequential(*chain(HeldNoise)), checkpointed("checkpoint_module", chain(HeldNoise))
    for m in (plain, model):
        out = m(_batches()[0])
        held = m[1] if m is plain else m[0][1]
        replaced = held.noise = torch.Generator().manual_seed(99)
        out.square().sum().backward()
        assert held.noise is replaced and replaced.initial_seed() == 99
        assert torch.equal(replaced.get_state(), torch.Generator().manual_seed(99).get_state())
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(plain.parameters(), model.parameters()))


def test_without_preserve_rng_state_the_recompute_draws_from_the_generators_a_module_holds_as_they_are():
    # torch's meaning of preserve_rng_state=False, for the process's generators and these alike.
    inner = nn.Sequential(*chain(HeldNoise)[:3])
    actsave.checkpoint(inner, _batches()[0].requires_grad_(), preserve_rng_state=False).sum().backward()
    twice = torch.Generator().manual_seed(123)  # HeldNoise's seed, drawn from by the forward and the recompute
    for _ in range(2):
        torch.randn(6, 8, generator=twice)
    assert torch.equal(inner[1].noise.get_state(), twice.get_state())


def test_a_keep_selective_block_replays_the_generator_it_holds():
    plain, model = nn.Sequential(*chain(HeldNoise)), nn.Sequential(*chain(HeldNoise))
    actsave.wrap(model, HeldNoise, keep="selective")
    assert_same_steps(plain, model, _batches())


class NoisyLinear(nn.Linear):
    """A Linear whose output is scaled by noise from a generator it holds: a call
    ``keep="selective"`` keeps, and skips in the recompute."""

    def forward(self, x):
        out = super().forward(x)
        return out * (1 + 0.1 * torch.randn(out.shape, generator=self.noise))


class NoisyBlock(nn.Module):
    """Draws from the generator its NoisyLinear holds after that call drew from it."""

    def __init__(self):
        super().__init__()
        self.noise = torch.Generator().manual_seed(5)
        self.fc = NoisyLinear(8, 8)
        self.fc.noise = self.noise

    def forward(self, x):
        return torch.tanh(self.fc(x)) * (1 + 0.1 * torch.randn(x.shape, generator=self.noise))


def test_a_call_keep_selective_skips_leaves_the_generators_its_module_holds_as_the_forward_did():
    # The recompute skipped fc's draws, and the block's own draw read the generator at
    # the forward's start: other noise, silently.
    def make():
        torch.manual_seed(0)
        return nn.Sequential(NoisyBlock(), nn.Linear(8, 2))

    plain, model = make(), make()
    actsave.wrap(model, NoisyBlock, keep="selective")
    assert_same_steps(plain, model, _batches())
    assert torch.equal(plain[0].noise.get_state(), model[0].noise.get_state())
