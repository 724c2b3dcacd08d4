"""The planner's steps leave no trace on the model (planning/step_isolation.py, NOTE [
Module state a step puts back ]). Buffers and gradients put back: test_profiler.py; other
threads: test_threads.py."""
import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
import torch.nn.utils.parametrize as parametrize
from torch import nn
from torch.nn.utils import parametrizations

import actsave
from actsave import CheckpointedSequential


class _BuildsState(nn.Module):
    """State a forward builds as it runs, each kind once: a Python int grown with the
    input and a buffer registered anew for it (rotary tables), a tensor cached as a
    plain attribute, a flag, a dict and a list it fills, a buffer and a submodule it
    registers."""

    def __init__(self, width: int):
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.register_buffer("table", torch.ones(1), persistent=False)
        self.cached_len = 1
        self.proj = None
        self.initialized = False
        self.by_shape = {}
        self.shapes = []

    def forward(self, x):
        width = x.shape[-1]
        if width > self.cached_len:
            self.cached_len = width
            self.register_buffer("table", torch.linspace(0.5, 1.5, width, device=x.device), persistent=False)
        if self.proj is None:
            self.proj = torch.eye(width, device=x.device)
        if not self.initialized:
            self.register_buffer("registered", torch.zeros(1, device=x.device))
            self.added = nn.Identity()
            self.initialized = True
        self.by_shape[tuple(x.shape)] = self.proj
        self.shapes.append(tuple(x.shape))
        return self.lin(F.linear(x, self.proj)) * self.table[:width]


def _held(module: nn.Module) -> dict:
    """What ``module`` holds, each entry and each item of its tables and containers, as
    the objects themselves (compared by identity)."""
    return {name: (value, list(value.items()) if isinstance(value, dict) else list(value)
                   if isinstance(value, (list, set)) else None)
            for name, value in vars(module).items()}


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        a[k][0] is b[k][0] and (a[k][1] is None) == (b[k][1] is None)
        and (a[k][1] is None or len(a[k][1]) == len(b[k][1]) and all(
            (x[0] is y[0] and x[1] is y[1]) if isinstance(x, tuple) else x is y for x, y in zip(a[k][1], b[k][1])))
        for k in a)


@pytest.mark.parametrize("device", ["cpu", "meta"], ids=["real step", "meta step"])
def test_a_profiled_step_leaves_every_module_holding_what_it_held(device):
    torch.manual_seed(0)
    model = nn.Sequential(_BuildsState(16), nn.GELU(), nn.Linear(16, 4))
    before = {name: _held(m) for name, m in model.named_modules()}
    actsave.profile(model, (torch.randn(8, 16, device=device),))
    after = {name: _held(m) for name, m in model.named_modules()}
    assert after.keys() == before.keys()  # the submodule registered during the step is gone
    assert all(_same(before[name], after[name]) for name in before), [
        name for name in before if not _same(before[name], after[name])]
    layer = model[0]
    assert (layer.cached_len, layer.proj, layer.initialized, layer.by_shape, layer.shapes) == (1, None, False, {}, [])
    assert set(layer._buffers) == {"table"} and not hasattr(layer, "added")


@pytest.mark.parametrize("planner", ["default segments", "wrap(budget=)"])
def test_a_hook_a_hook_registers_at_the_first_forward_stays_registered(planner):
    # Hook tables are not put back: a library that installs a hook once, at the first
    # forward, and notes that outside the module never installs it again.
    fired, installed = [], []

    def installer(module, args, output):
        if not installed:
            installed.append(module.register_forward_hook(lambda m, a, o: fired.append(1)))

    torch.manual_seed(0)
    layers = [nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(4)]
    layers[2].register_forward_hook(installer)
    x = torch.randn(4, 8)
    if planner == "default segments":
        model = CheckpointedSequential(*layers)
    else:
        model = actsave.wrap(nn.Sequential(*layers), lambda m, name: name in {"0", "1", "2", "3"}, budget=2**30,
                             example_inputs=(x,))
    model(x).sum().backward()
    fired.clear()
    model(x).sum().backward()
    assert len(installed) == 1 and len(layers[2]._forward_hooks) == 2 and len(fired) == 1


class _ActNorm(nn.Module):
    """Glow's ActNorm: its shift and scale set from the first batch's statistics, once
    (a Python flag)."""

    def __init__(self, width: int):
        super().__init__()
        self.loc = nn.Parameter(torch.zeros(width))
        self.logs = nn.Parameter(torch.zeros(width))
        self.initialized = False

    def forward(self, x):
        if not self.initialized:
            with torch.no_grad():
                self.loc.copy_(-x.mean(0))
                self.logs.copy_(-torch.log(x.std(0) + 1e-6))
            self.initialized = True
        return (x + self.loc) * torch.exp(self.logs)


class _RandomFeatures(nn.Module):
    """A projection built at the first forward and kept as a plain tensor attribute."""

    def __init__(self, width: int):
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.proj = None

    def forward(self, x):
        if self.proj is None:
            g = torch.Generator().manual_seed(123)
            self.proj = (torch.randn(x.shape[-1], x.shape[-1], generator=g) / x.shape[-1] ** 0.5).to(x)
        return self.lin(F.linear(x, self.proj))


def _layers(kind) -> list:
    torch.manual_seed(0)
    return [m for _ in range(4) for m in (nn.Linear(16, 16), kind(16), nn.GELU())] + [nn.Linear(16, 4)]


def _trained(model: nn.Module, steps: int = 3) -> list:
    torch.manual_seed(1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    outputs = []
    for _ in range(steps):
        optimizer.zero_grad()
        out = model(torch.randn(8, 16) * 3 + 1)
        out.square().mean().backward()
        optimizer.step()
        outputs.append(out.detach())
    return outputs


@pytest.mark.parametrize("kind", [_ActNorm, _RandomFeatures])
def test_state_a_layer_builds_at_its_first_forward_is_built_by_the_real_step_not_the_meta_one(kind):
    # The default segments plan on meta tensors at the first call: the meta step set
    # ActNorm's flag (its parameters then never initialized) and left a meta projection.
    expected = _trained(nn.Sequential(*_layers(kind)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nor a warning about the meta copies it changed
        got = _trained(CheckpointedSequential(*_layers(kind)))
    assert all(torch.equal(a, b) for a, b in zip(expected, got))


def test_a_parameter_a_real_step_changes_in_place_is_named_at_the_callers_line():
    model = nn.Sequential(*_layers(_ActNorm))
    with pytest.warns(UserWarning, match=r"changed parameter\(s\) \['1.loc', '1.logs'") as caught:
        actsave.profile(model, (torch.randn(8, 16),))
    assert caught[0].filename == __file__
    assert not model[1].initialized  # set again by the first training step, from its batch


def _weight_normed_chain(frozen_head: bool) -> list:
    torch.manual_seed(0)
    head = nn.Linear(24, 4)
    parametrizations.weight_norm(head)
    head.parametrizations.requires_grad_(not frozen_head)
    return [m for _ in range(4) for m in (nn.Linear(24, 24), nn.GELU())] + [head]


def _cached_step(model: nn.Module) -> tuple:
    torch.manual_seed(1)
    with parametrize.cached():
        out = model(torch.randn(8, 24))
    out.square().sum().backward()
    return out.detach(), [p.grad for p in model.parameters() if p.requires_grad]


@pytest.mark.parametrize("frozen_head", [True, False], ids=["frozen head", "trained head"])
def test_a_first_call_under_parametrize_cached_trains_as_plain(frozen_head):
    # The meta step filled parametrize's cache with meta weights, which the real step read.
    expected = _cached_step(nn.Sequential(*_weight_normed_chain(frozen_head)))
    got = _cached_step(CheckpointedSequential(*_weight_normed_chain(frozen_head)))
    assert torch.equal(expected[0], got[0])
    assert all(torch.equal(a, b) for a, b in zip(expected[1], got[1]))


def test_a_first_call_under_parametrize_cached_trains_as_plain_on_a_deep_copy():
    # A copy's cache entries are keyed by the module it was copied from (torch keys them
    # by the module the parametrization was registered on): those keys are the ones to
    # set aside, or the real step reads the meta step's weights.
    layers = _weight_normed_chain(frozen_head=False)
    expected = _cached_step(nn.Sequential(*copy.deepcopy(layers)))
    got = _cached_step(CheckpointedSequential(*copy.deepcopy(layers)))
    assert torch.equal(expected[0], got[0])
    assert all(torch.equal(a, b) for a, b in zip(expected[1], got[1]))


def test_a_profile_inside_parametrize_cached_leaves_other_modules_entries_alone():
    # Another model's (another thread's, say): set aside and dropped with the steps' own,
    # it would be computed again inside its cached() block.
    model = nn.Sequential(*_weight_normed_chain(frozen_head=False))
    other = parametrizations.weight_norm(nn.Linear(4, 4))
    read_during = []
    model[0].register_forward_hook(lambda *_: read_during.append(other.weight))  # as another thread would
    with parametrize.cached():
        weight = other.weight
        actsave.profile(model, (torch.empty(8, 24, device="meta"),))
        assert read_during and all(w is weight for w in read_during)
        assert other.weight is weight


def test_a_profile_inside_parametrize_cached_keeps_the_weights_cached_before_it():
    model = nn.Sequential(*_weight_normed_chain(frozen_head=False))
    with parametrize.cached():
        weight = model[-1].weight  # computed and cached
        actsave.profile(model, (torch.empty(8, 24, device="meta"),))
        assert model[-1].weight is weight
