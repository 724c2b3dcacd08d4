"""A whole training step that uses actsave, captured in a CUDA graph and replayed
(README, "Which to choose": the recipe for small batches; docs/limits.md, "CUDA
graphs"). Every mode replays the eager step's gradients bit for bit. All marked
``cuda``: a capture needs a device. What a CPU can show of the rules (the host pool
asks no event of a capture and keeps its buffers: offload/pool.py, NOTE [ Host buffers
of a captured graph ]) is in tests/offload/test_pool.py.
"""
import copy

import pytest
import torch
from torch import nn

import actsave
from actsave.offload import HostPool, offloaded
from support import sqnr_db

pytestmark = pytest.mark.cuda

# A floor below int8's expected gradient SQNR (actsave.codecs, EXPECTED_GRADIENT_SQNR_DB)
# and far above what gradients of other dropout masks keep of each other.
DIFFERENT_MASKS_ARE_BELOW_DB = 20.0

MODES = {"exact": {}, "int8": {"compress": "int8"}, "fp8": {"compress": "fp8"}, "offload": {"offload": True},
         "int8 + offload": {"compress": "int8", "offload": True}}


def conv_chain(dropout: float = 0.0) -> nn.Sequential:
    layers = [nn.Conv2d(3, 16, 3, padding=1)]
    for _ in range(4):
        layers += [nn.BatchNorm2d(16), nn.ReLU(), nn.Conv2d(16, 16, 3, padding=1)]
        if dropout:
            layers.append(nn.Dropout(dropout))
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10))


def loss_of(model, x, y):
    return nn.functional.cross_entropy(model(x), y)


def eager_grads(model, x, y) -> list:
    model.zero_grad(set_to_none=True)
    loss_of(model, x, y).backward()
    return [p.grad.clone() for p in model.parameters()]


def has_eager_grads(model, reference, x, y) -> bool:
    """Whether ``model``'s gradients are those of an eager step of ``reference`` on (x, y)."""
    torch.cuda.synchronize()
    return all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), eager_grads(reference, x, y)))


def captured_step(model, x, y, warmup: int = 3):
    """The recipe: warm-up steps on a side stream (actsave plans, Triton compiles), then
    one step captured whole; returns the graph and its static input tensors."""
    static_x, static_y = x.clone(), y.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            model.zero_grad(set_to_none=True)
            loss_of(model, static_x, static_y).backward()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    model.zero_grad(set_to_none=True)
    with torch.cuda.graph(graph):
        loss_of(model, static_x, static_y).backward()
    return graph, static_x, static_y


def batches(count: int = 2):
    generator = torch.Generator().manual_seed(0)
    return [(torch.randn(8, 3, 16, 16, generator=generator).cuda(),
             torch.randint(0, 10, (8,), generator=generator).cuda()) for _ in range(count)]


@pytest.fixture(autouse=True)
def deterministic_and_a_pool_of_its_own(monkeypatch):
    """cuDNN's deterministic algorithms (two models' steps compared bit for bit), and a
    host pool of the test's own: the buffers a graph keeps stay out of the others'."""
    monkeypatch.setattr(torch.backends.cudnn, "deterministic", True)
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", False)
    pool = HostPool()
    monkeypatch.setattr(offloaded, "host_pool_for", lambda device: pool)


@pytest.mark.parametrize("mode", MODES)
def test_a_captured_step_replays_the_eager_steps_gradients_for_each_batch(mode):
    torch.manual_seed(0)
    model = actsave.CheckpointedSequential.from_sequential(conv_chain().cuda(), segments=4, **MODES[mode])
    reference = copy.deepcopy(model)
    (x, y), (x2, y2) = batches()
    graph, static_x, static_y = captured_step(model, x, y)
    for inputs, targets in ((x, y), (x2, y2), (x, y)):
        static_x.copy_(inputs)
        static_y.copy_(targets)
        graph.replay()
        assert has_eager_grads(model, reference, inputs, targets), mode


@pytest.mark.parametrize("mode", ["offload", "int8 + offload"])
def test_a_replay_between_an_eager_forward_and_its_backward_leaves_their_host_buffers_alone(mode):
    # NOTE [ Host buffers of a captured graph ]: the buffers a capture took are never
    # lent to an eager step, so a replay between its forward and its backward, which
    # writes the graph's buffers, leaves the eager step's offloaded inputs as they were.
    torch.manual_seed(0)
    model = actsave.CheckpointedSequential.from_sequential(conv_chain().cuda(), segments=4, **MODES[mode])
    other, reference = copy.deepcopy(model), copy.deepcopy(model)
    (x, y), (x2, y2) = batches()
    graph, static_x, static_y = captured_step(model, x, y)
    eager_grads(other, x2, y2)  # the eager step's buffers are the pool's idle ones now
    other.zero_grad(set_to_none=True)
    loss = loss_of(other, x2, y2)
    graph.replay()
    loss.backward()
    assert has_eager_grads(other, reference, x2, y2) and has_eager_grads(model, reference, x, y)


@pytest.mark.parametrize("mode", ["exact", "int8", "fp8"])
def test_graphed_callables_give_the_eager_gradients(mode):
    # torch.cuda.make_graphed_callables captures the forward and the backward in two
    # graphs. Offload and random draws in a checkpointed segment are left to a whole-
    # step capture (docs/limits.md, "CUDA graphs").
    torch.manual_seed(0)
    model = actsave.CheckpointedSequential.from_sequential(conv_chain().cuda(), segments=4, **MODES[mode])
    reference = copy.deepcopy(model)
    (x, y), (x2, y2) = batches()
    graphed = torch.cuda.make_graphed_callables(model, (x.clone().requires_grad_(False),))
    for inputs, targets in ((x, y), (x2, y2)):
        model.zero_grad(set_to_none=True)
        loss_of(graphed, inputs, targets).backward()
        assert has_eager_grads(model, reference, inputs, targets), mode


@pytest.mark.parametrize("mode", ["exact", "int8"])
def test_a_captured_step_recomputes_the_forwards_random_draws(mode):
    # Dropout in a checkpointed segment: the recompute replays the forward's draws
    # inside the graph, so the step is the plain model's step captured the same way,
    # seeded alike.
    torch.manual_seed(0)
    plain = conv_chain(dropout=0.2).cuda()
    model = actsave.CheckpointedSequential.from_sequential(copy.deepcopy(plain), segments=4, **MODES[mode])
    (x, y), = batches(1)
    graphs = [captured_step(m, x, y) for m in (plain, model)]
    grads = []
    for (graph, _, _), m in zip(graphs, (plain, model)):
        torch.cuda.manual_seed(7)
        graph.replay()
        torch.cuda.synchronize()
        grads.append([p.grad.clone() for p in m.parameters()])
    if mode == "exact":
        assert all(torch.equal(a, b) for a, b in zip(*grads))
    else:  # the codec's error only, over every gradient at once (a conv bias before a
        # BatchNorm has a gradient of rounding alone); other dropout masks fall far below
        assert sqnr_db(torch.cat([g.flatten() for g in grads[0]]),
                       torch.cat([g.flatten() for g in grads[1]])) >= DIFFERENT_MASKS_ARE_BELOW_DB
