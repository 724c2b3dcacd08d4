"""Steps on meta tensors (actsave/meta.py). The replayed output metadata and attention on
a simulated device are tested through the planner: tests/planning."""
import random
import warnings

import pytest
import torch
from support import peak_activation_bytes
from torch import nn

import actsave
from actsave import CheckpointedSequential


def _chain() -> CheckpointedSequential:
    torch.manual_seed(0)
    return CheckpointedSequential(*[m for _ in range(6) for m in (nn.Linear(16, 16), nn.GELU())])


def test_a_meta_step_under_anomaly_mode_plans_and_leaves_its_nan_check_on():
    # NOTE [ Anomaly mode in a meta step ]: its NaN check reads each gradient, which a
    # meta tensor cannot give; the plan fell back to "sqrt".
    x = torch.randn(4, 16, requires_grad=True)
    expected = _chain()
    expected(x).sum().backward()
    model = _chain()
    with torch.autograd.set_detect_anomaly(True), warnings.catch_warnings():
        warnings.simplefilter("error")
        model(x).sum().backward()
        assert torch.is_anomaly_enabled() and torch.is_anomaly_check_nan_enabled()
        nan = torch.tensor([1.0], requires_grad=True)
        try:
            (nan * float("nan")).sum().backward()
        except RuntimeError as error:
            assert "returned nan values" in str(error)
        else:
            raise AssertionError("anomaly mode's NaN check did not run after the meta step")
    assert model.balanced_plan is not None and model.balanced_plan.starts == expected.balanced_plan.starts
    assert not torch.is_anomaly_enabled()


def _embedding_chain(sparse: bool) -> list:
    torch.manual_seed(0)
    return [nn.Embedding(100, 32, sparse=sparse)] + [m for _ in range(6) for m in (nn.Linear(32, 32), nn.GELU())]


def test_a_meta_step_over_a_sparse_gradient_estimates_and_plans_as_over_a_dense_one():
    # Meta steps give each parameter a dense gradient: an embedding's sparse one is
    # accumulated into it, which torch's meta kernels cannot do by themselves.
    ids = torch.randint(0, 100, (4, 10), generator=torch.Generator().manual_seed(1))
    estimates = [actsave.estimate(actsave.CheckpointedSequential(*_embedding_chain(sparse), segments=[0, 5, 9]),
                                  ids).activation_peak_bytes for sparse in (False, True)]
    assert estimates[0] == estimates[1]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback to "sqrt"
        chain = actsave.CheckpointedSequential(*_embedding_chain(True))
        chain(ids).sum().backward()
    plain = nn.Sequential(*_embedding_chain(True))
    plain(ids).sum().backward()
    assert all(torch.equal(a.grad.to_dense(), b.grad.to_dense()) for a, b in zip(chain.parameters(), plain.parameters()))


def test_a_meta_step_over_batchnorm_counting_its_batches_plans_without_falling_back():
    # num_batches_tracked.add_(1) reaches the meta step's add_ with a number, not a
    # tensor: only a sparse tensor added to a dense one is taken apart there.
    torch.manual_seed(0)
    layers = [m for _ in range(6) for m in (nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU())]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        chain = CheckpointedSequential(*layers)
        chain(torch.randn(2, 4, 8, 8)).sum().backward()
    assert "fell back" not in str(chain.describe())


class _Recurrent(nn.Module):
    def __init__(self):
        super().__init__()
        self.rnn = nn.LSTM(16, 16, batch_first=True)

    def forward(self, x):
        return self.rnn(x)[0]


def test_a_meta_step_over_a_recurrent_layer_warns_once_that_it_misstates_its_memory(monkeypatch):
    # On meta tensors an LSTM runs torch's per-step composite, not the device's fused kernel.
    monkeypatch.setattr(actsave.meta, "_warned_recurrences", set())
    model = CheckpointedSequential(nn.Linear(16, 16), _Recurrent(), nn.GELU(), _Recurrent(), nn.Linear(16, 4))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            actsave.estimate(model, (2, 5, 16), device="cpu")
    messages = [str(w.message) for w in caught if "per-step composite" in str(w.message)]
    assert len(messages) == 1 and "runs LSTM" in messages[0] and "segments='auto'" in messages[0]


class DrawsOnTheCPU(nn.Module):
    """Skips itself at random and shuffles its features, drawn by factories without a
    device (on the CPU, whatever its input's), and adds noise from a generator it holds
    (``holds``; a recompute draws from it again, as under torch.utils.checkpoint:
    docs/limits.md)."""

    def __init__(self, holds: bool = False):
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.generator = torch.Generator().manual_seed(3) if holds else None

    def forward(self, x):
        if self.training and torch.rand([]) < 0.3:  # Hugging Face's LayerDrop
            return x
        if self.generator is not None:
            x = x + torch.rand(8, generator=self.generator).to(x.device)
        return x + torch.tanh(self.linear(x))[:, torch.randperm(8).to(x.device)]


def drawing_layers(holds: bool = False) -> list:
    torch.manual_seed(0)
    return [DrawsOnTheCPU(holds) for _ in range(6)] + [nn.Linear(8, 2)]


def test_a_first_calls_meta_step_leaves_the_first_step_drawing_what_plain_pytorchs_draws():
    # NOTE [ A meta step draws nothing ]: the balanced plan's meta step runs each layer's
    # Python; its draws on the CPU would otherwise move the generator the step draws from.
    x = torch.randn(4, 8)
    steps = {}
    for name, model in (("plain", nn.Sequential(*drawing_layers())), ("ours", CheckpointedSequential(*drawing_layers()))):
        torch.manual_seed(5)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # the balanced plan, not its fallback
            model(x).pow(2).sum().backward()
        steps[name] = [p.grad for p in model.parameters()], torch.get_rng_state()
    (plain_grads, plain_rng), (grads, rng) = steps["plain"], steps["ours"]
    assert [g is None for g in grads] == [g is None for g in plain_grads]
    assert all(torch.equal(a, b) for a, b in zip(grads, plain_grads) if a is not None)
    assert torch.equal(rng, plain_rng)


def test_an_estimate_draws_nothing_from_the_generators_a_layer_draws_from_on_the_cpu():
    model = CheckpointedSequential(*drawing_layers(holds=True), segments=3)
    before = [torch.get_rng_state()] + [m.generator.get_state() for m in model[:6]]
    actsave.estimate(model, (4, 8))
    after = [torch.get_rng_state()] + [m.generator.get_state() for m in model[:6]]
    assert all(torch.equal(a, b) for a, b in zip(after, before))


class _HeldConstants(nn.Module):
    """Constants held as a plain attribute and in a list, not as buffers (docs/limits.md,
    "Large buffers"), and sizes read as Python values."""

    def __init__(self, width: int):
        super().__init__()
        self.linear, self.scale = nn.Linear(width, width), torch.linspace(0.5, 1.5, width)
        self.shifts, self.sizes = [torch.rand(width)], torch.tensor([width // 4, width - width // 4])

    def forward(self, x):
        a, b = (self.linear(x) * self.scale + self.shifts[0]).split(self.sizes.tolist(), dim=-1)
        return torch.cat([b, a], dim=-1)


def test_constants_held_outside_buffers_meet_a_meta_step_as_meta_copies_and_are_read_as_they_are():
    torch.manual_seed(0)
    layers = [_HeldConstants(32), nn.ReLU(), _HeldConstants(32), nn.Linear(32, 32)]
    estimated = actsave.estimate(nn.Sequential(*layers), (16, 32), device="cpu").activation_peak_bytes
    model = actsave.CheckpointedSequential(*layers)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback to the "sqrt" split
        model(torch.randn(16, 32)).sum().backward()
    assert model.balanced_plan is not None and not layers[0].scale.is_meta
    assert estimated == peak_activation_bytes(nn.Sequential(*layers), torch.randn(16, 32))


class _PythonJitter(nn.Module):
    """Scales by a draw from Python's generator (an older LayerDrop's ``random.uniform``)."""

    def forward(self, x):
        return x * (1.0 + random.random())


def test_a_first_calls_meta_step_leaves_pythons_generator_as_it_found_it():
    def layers():
        torch.manual_seed(0)
        return [nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16), _PythonJitter()]

    x = torch.randn(4, 16)
    outputs, states = [], []
    for model in (nn.Sequential(*layers()), CheckpointedSequential(*layers())):
        random.seed(42)
        outputs.append(model(x))
        states.append(random.getstate())
    assert torch.equal(*outputs) and states[0] == states[1]


class _NoisyByAConstant(nn.Module):
    def __init__(self, width: int, trained: bool = False):
        super().__init__()
        self.linear, self.std = nn.Linear(width, width), torch.full((width,), 0.1, requires_grad=trained)

    def forward(self, x):
        return torch.normal(torch.tanh(self.linear(x)), self.std) if not self.std.requires_grad \
            else torch.tanh(self.linear(x)) * self.std


def test_a_random_operator_meeting_a_held_constant_in_a_meta_step_draws_nothing():
    torch.manual_seed(0)
    model = nn.Sequential(_NoisyByAConstant(16), nn.Linear(16, 16))
    state = torch.get_rng_state()
    assert actsave.estimate(model, (4, 16), device="cpu").activation_peak_bytes > 0
    assert torch.equal(state, torch.get_rng_state())


def test_a_tensor_that_requires_grad_held_outside_the_parameters_is_refused_in_a_meta_step_naming_the_way_out():
    model = nn.Sequential(_NoisyByAConstant(16, trained=True), nn.Linear(16, 16))
    with pytest.raises(actsave.ActsaveError, match="Register it as an nn.Parameter"):
        actsave.estimate(model, (4, 16), device="cpu")
