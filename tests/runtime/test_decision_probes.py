"""The probes on meta tensors (actsave/runtime/decision_probes.py): which lossy
segments and wrapped blocks make decisions that a compiled recompute cannot keep."""
import torch
from support import ResidualBlock
from torch import nn

import actsave
from actsave.runtime import decision_probes
from actsave.runtime.keep_rules import EXACT, KeepPolicy

INT8 = KeepPolicy.resolve("int8")


def linear(activation: nn.Module) -> list:
    return [nn.Linear(8, 8), activation]


def test_a_lossy_segment_that_saves_a_relu_output_makes_decisions():
    segments = [(linear(nn.GELU()), INT8), (linear(nn.ReLU()), INT8)]
    assert decision_probes.decisions_made(segments, torch.randn(4, 8)) == "ReLU decisions"


def test_relu_outputs_of_exact_segments_and_gelu_ones_of_lossy_segments_make_none():
    segments = [(linear(nn.ReLU()), EXACT), (linear(nn.GELU()), INT8), (linear(nn.Tanh()), INT8)]
    assert decision_probes.decisions_made(segments, torch.randn(4, 8)) is None


def test_an_in_place_relu_module_on_a_view_in_a_lossy_segment_makes_decisions():
    # On a 3-D input a Linear's output is a view: the in-place ReLU's autograd node then
    # says no ReLU, and the probe watches the module as eager actsave does (NOTE [ In-place
    # ReLUs on views ]). An exact segment's is not watched, and makes none.
    x = torch.randn(2, 3, 8)
    assert decision_probes.decisions_made([(linear(nn.ReLU(inplace=True)) + [nn.Linear(8, 8)], INT8)], x) == \
        "ReLU decisions"
    assert decision_probes.decisions_made([(linear(nn.ReLU(inplace=True)), EXACT), (linear(nn.GELU()), INT8)], x) is None


class ReluOnAView(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear, self.relu = nn.Linear(8, 8), nn.ReLU(inplace=True)

    def forward(self, x):
        return self.relu(self.linear(x))


def test_a_wrapped_block_with_an_in_place_relu_module_on_a_view_makes_decisions():
    model = actsave.wrap(nn.Sequential(ReluOnAView(), ReluOnAView()), ReluOnAView, compress="int8")
    why = decision_probes.probe_blocks(model, list(model), (torch.randn(2, 3, 8),), {})
    assert set(why) == set(model) and all("makes ReLU decisions" in reason for reason in why.values())


def test_a_max_pool_module_in_a_lossy_segment_makes_decisions():
    segments = [([nn.Conv2d(3, 4, 3), nn.MaxPool2d(2)], INT8)]
    assert decision_probes.decisions_made(segments, torch.randn(2, 3, 8, 8)) == "max-pool decisions"


def test_integer_inputs_are_probed_without_a_gradient():
    segments = [([nn.Embedding(16, 8), nn.Linear(8, 8)], INT8), (linear(nn.GELU()), INT8)]
    assert decision_probes.decisions_made(segments, torch.randint(0, 16, (2, 5))) is None


class ReadsValues(nn.Module):
    def forward(self, x):
        return x * 2 if x.sum().item() > 0 else x


def test_a_forward_that_fails_on_meta_tensors_is_said_to_make_decisions_and_names_why():
    why = decision_probes.decisions_made([([ReadsValues()], INT8)], torch.randn(4, 8))
    assert why.startswith("decisions unknown: its forward failed on meta tensors")


class DrawsOnTheCpu(nn.Module):
    """Stochastic depth drawn on the CPU: a forward that moves the CPU's RNG."""

    def forward(self, x):
        return x * (torch.rand(()) < 0.9)


def test_the_probe_leaves_parameters_and_the_rng_as_they_were():
    layers = [nn.Linear(8, 8), DrawsOnTheCpu(), nn.GELU()]
    weight, x = layers[0].weight, torch.randn(4, 8)
    state = torch.get_rng_state()
    decision_probes.decisions_made([(layers, INT8)], x)
    assert layers[0].weight is weight and weight.device.type == "cpu"
    assert torch.equal(torch.get_rng_state(), state)


class CachesAtFirstForward(nn.Module):
    """Caches a tensor at its first forward, made where its input is."""

    def __init__(self):
        super().__init__()
        self.linear, self.cache = nn.Linear(8, 8), None

    def forward(self, x):
        if self.cache is None:
            self.cache = torch.linspace(0.5, 1.5, 8, device=x.device)
        return torch.relu(self.linear(x)) * self.cache


def test_the_probes_leave_the_modules_attributes_as_they_were():
    # On meta tensors a layer's first-forward cache would be a meta tensor, which the
    # real forward then met ("found at least two devices, cpu and meta").
    layers = [CachesAtFirstForward(), nn.GELU()]
    decision_probes.decisions_made([(layers, INT8)], torch.randn(4, 8))
    assert layers[0].cache is None
    model = actsave.wrap(nn.Sequential(CachesAtFirstForward(), CachesAtFirstForward()), CachesAtFirstForward,
                         compress="int8")
    decision_probes.probe_blocks(model, list(model), (torch.randn(4, 8),), {})
    assert all(block._wrapped.cache is None for block in model)


def test_a_model_that_fails_on_meta_tensors_runs_every_lossy_block_eagerly_and_names_why():
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(ResidualBlock() for _ in range(2))

        def forward(self, x):
            x = ReadsValues()(x)
            for block in self.blocks:
                x = block(x)
            return x
    model = actsave.wrap(Model(), ResidualBlock, compress="int8")
    checkpoints = list(model.blocks)
    why = decision_probes.probe_blocks(model, checkpoints, (torch.randn(4, 8),), {})
    assert set(why) == set(checkpoints)
    assert all(reason.startswith("decisions unknown: the model's forward failed on meta tensors")
               for reason in why.values())
