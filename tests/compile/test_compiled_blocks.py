"""Blocks compiled first, then checkpointed: compiled once, no warnings; a lossy checkpoint
runs compiled code's eager code where it makes decisions."""
import copy
import functools
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import actsave
from actsave.runtime import compiled_layers
from support import sqnr_db
from compile.steps import BACKEND, INT8_SQNR_FLOOR_DB, assert_same_gradients, grads_of_a_step


class ReluBlock(nn.Module):
    """A block that ends in a ReLU, so that int8 keeps its decision bits."""

    def __init__(self, width: int = 16):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(width, width), nn.Linear(width, width)

    def forward(self, x):
        return torch.relu(self.fc2(torch.relu(self.fc1(x)) + x))


def compiled(block: nn.Module, how: str) -> nn.Module:
    if how == "torch.compile":
        return torch.compile(block, backend=BACKEND)
    block.compile(backend=BACKEND)
    return block


def graphs_over_steps(model: nn.Module, make_input, steps: int = 4) -> tuple:
    """The graphs Dynamo compiled after the first step and after the last, and every
    warning the steps raised."""
    counters = torch._dynamo.utils.counters
    counters.clear()
    graphs = []
    with warnings.catch_warnings(record=True) as raised:
        warnings.simplefilter("always")
        for _ in range(steps):
            grads_of_a_step(model, make_input())
            graphs.append(counters["stats"]["unique_graphs"])
    return graphs[0], graphs[-1], [f"{w.category.__name__}: {w.message}" for w in raised]


def plain_and_graphs_alone(blocks: list, how: str) -> tuple:
    """An eager copy of ``blocks``, and the Dynamo graphs the compiled blocks make on
    their own over the steps of :func:`graphs_over_steps` (Dynamo reset after)."""
    plain = nn.Sequential(*copy.deepcopy(blocks))
    alone = nn.Sequential(*[compiled(block, how) for block in copy.deepcopy(blocks)])
    graphs = graphs_over_steps(alone, lambda: torch.randn(8, 16))[1]
    torch._dynamo.reset()
    assert graphs >= 1
    return plain, graphs


def assert_trains_as_plain(model: nn.Module, plain: nn.Module, compress):
    model.zero_grad(set_to_none=True)
    x = torch.randn(8, 16)
    assert_same_gradients(grads_of_a_step(plain, x), grads_of_a_step(model, x), compress)


class GeluBlock(ReluBlock):
    """The same block with GELU: no decisions for a lossy recompute to keep."""

    def forward(self, x):
        return F.gelu(self.fc2(F.gelu(self.fc1(x)) + x))


# A lossy checkpoint runs compiled blocks whose eager code keeps no decisions (GELU)
# compiled; its first call runs the eager code, to find out (NOTE [ Decisions in
# compiled layers ]), by then the exact segments (the chain input's) compiled them.
CLEAN_COMPILES = [(None, ReluBlock), ("int8", GeluBlock)]


@pytest.mark.parametrize("how", ["torch.compile", "Module.compile"])
@pytest.mark.parametrize("compress, block_class", CLEAN_COMPILES)
def test_compiled_blocks_in_a_balanced_checkpointed_sequential_compile_once_and_warn_nothing(
        compress, block_class, how):
    # The default segments plan on a meta step of the chain: it runs the compiled
    # blocks eagerly (NOTE [ torch.compile ]); compiled there, they recompiled until
    # Dynamo's limit, with warnings.
    torch.manual_seed(0)
    blocks = [block_class() for _ in range(6)]
    plain, graphs = plain_and_graphs_alone(blocks, how)
    model = actsave.CheckpointedSequential(*[compiled(block, how) for block in blocks], compress=compress)
    assert graphs_over_steps(model, lambda: torch.randn(8, 16)) == (graphs, graphs, [])
    assert_trains_as_plain(model, plain, compress)


@pytest.mark.parametrize("how", ["torch.compile", "Module.compile"])
@pytest.mark.parametrize("compress, block_class", CLEAN_COMPILES)
def test_blocks_compiled_then_wrapped_are_checkpointed_compile_once_and_warn_nothing(
        compress, block_class, how):
    # wrap selects torch.compile(block) whole: replacing the block inside it would leave
    # the compiled forward calling the old block, checkpointing nothing.
    torch.manual_seed(0)
    blocks = [block_class() for _ in range(4)]
    plain, graphs = plain_and_graphs_alone(blocks, how)
    model = nn.Sequential(*[compiled(block, how) for block in blocks])
    keys = list(model.state_dict())
    actsave.wrap(model, block_class, compress=compress)
    assert all(isinstance(block, actsave.Checkpoint) for block in model) and list(model.state_dict()) == keys
    assert graphs_over_steps(model, lambda: torch.randn(8, 16)) == (graphs, graphs, [])
    out = model(torch.randn(8, 16, requires_grad=True))
    assert actsave.kept_bytes()["device"] > 0  # the blocks keep their inputs: checkpointed
    del out
    assert_trains_as_plain(model, plain, compress)


def conv_bn_relu_blocks() -> list:
    torch.manual_seed(0)
    return [nn.Sequential(nn.Conv2d(8, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU())
            for _ in range(8)]


def worst_parameter_sqnr(model: nn.Module, reference: nn.Module, x: torch.Tensor) -> float:
    got, expected = (grads_of_a_step(m, x)[1:] for m in (model, reference))
    return min(sqnr_db(e, g) for e, g in zip(expected, got))


@pytest.mark.parametrize("how", ["torch.compile", "Module.compile"])
def test_a_lossy_checkpoint_runs_compiled_blocks_whose_eager_code_keeps_decisions_as_that_code(monkeypatch, how):
    """A compiled graph hides its ReLU outputs from the pack hook and recomputes them
    whole, so a lossy recompute could not take the forward's decisions: BatchNorm's
    gradients lost most of their precision (12.8 dB worst here, 3 dB on a ResNet-56:
    docs/limits.md). Such blocks run their eager code in lossy checkpoints, forward and
    recompute, with one warning; exact segments (the first, which keeps the chain input
    by reference, and the plain last) stay compiled."""
    monkeypatch.setattr(compiled_layers, "_warned", False)  # once per process
    monkeypatch.setattr(compiled_layers, "_KEEPS_DECISIONS", {})
    x = torch.randn(4, 8, 8, 8)
    model = actsave.CheckpointedSequential(*[compiled(block, how) for block in conv_bn_relu_blocks()],
                                           segments=4, compress="int8")
    model.set_compression(6, None)  # the plain last segment keeps autograd's saves
    plain = nn.Sequential(*conv_bn_relu_blocks())
    with warnings.catch_warnings(record=True) as raised:
        warnings.simplefilter("always")
        sqnrs = [worst_parameter_sqnr(model, plain, x) for _ in range(2)]
    assert len([w for w in raised if "Decisions in compiled layers" in str(w.message)]) == 1
    assert min(sqnrs) >= INT8_SQNR_FLOOR_DB


class CheckpointedCompiledFunctions(nn.Module):
    """Pairs of conv-BN-ReLU blocks, the middle ones each run as a compiled function
    under ``actsave.checkpoint(..., compress="int8")``."""

    def __init__(self):
        super().__init__()
        blocks = conv_bn_relu_blocks()
        self.stages = nn.ModuleList(nn.Sequential(*blocks[i:i + 2]) for i in range(0, len(blocks), 2))
        self.functions = [torch.compile(lambda x, stage=stage: stage(x), backend=BACKEND) for stage in self.stages]

    def forward(self, x):
        x = self.stages[0](x)
        for function in self.functions[1:-1]:
            x = actsave.checkpoint(function, x, compress="int8")
        return self.stages[-1](x)


def test_a_compiled_function_in_a_lossy_checkpoint_runs_its_eager_code_where_it_makes_decisions(monkeypatch):
    """As compiled blocks: a compiled function's modules are not known, so the
    function counts as one compiled layer (NOTE [ Decisions in compiled layers ])."""
    monkeypatch.setattr(compiled_layers, "_warned", False)
    monkeypatch.setattr(compiled_layers, "_KEEPS_DECISIONS", {})
    x = torch.randn(4, 8, 8, 8)
    model, plain = CheckpointedCompiledFunctions(), nn.Sequential(*conv_bn_relu_blocks())
    with warnings.catch_warnings(record=True) as raised:
        warnings.simplefilter("always")
        sqnrs = [worst_parameter_sqnr(model, plain, x) for _ in range(2)]  # the first call finds out
    assert min(sqnrs) >= INT8_SQNR_FLOOR_DB
    assert len([w for w in raised if "Decisions in compiled layers" in str(w.message)]) == 1


def library_blocks() -> list:
    """Blocks of torch's own modules, with no forward of their own: Module.compile
    compiles their call, whose saves reach actsave's eager hooks inside the graph."""
    torch.manual_seed(0)
    return [nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16)), nn.Linear(16, 16),
            nn.Sequential(nn.Linear(16, 16), nn.ReLU())]


@pytest.mark.parametrize("entry", ["checkpoint", "Checkpoint", "CheckpointedSequential"])
def test_modules_compiled_in_place_inside_an_eager_checkpoint_compile_once_and_train_as_plain(entry):
    # NOTE [ Eager hooks Dynamo leaves alone ]: Dynamo compiled the hooks' own frames, broke
    # inside them and crashed ('NoneType' object has no attribute 'is_leaf'), or compiled a
    # graph again at every step.
    blocks = library_blocks()
    plain = nn.Sequential(*copy.deepcopy(blocks))
    for block in blocks:
        block.compile(backend=BACKEND)
    if entry == "CheckpointedSequential":
        model = actsave.CheckpointedSequential(*blocks, segments=2)
    else:
        wrapped = [actsave.Checkpoint(block) for block in blocks] if entry == "Checkpoint" else [
            functools.partial(actsave.checkpoint, block) for block in blocks]
        model = nn.Sequential(*blocks)
        model.forward = lambda x: functools.reduce(lambda h, call: call(h), wrapped, x)
    first, last, raised = graphs_over_steps(model, lambda: torch.randn(2, 8, 16))
    assert first == last and raised == []
    assert_trains_as_plain(model, plain, None)


class ShorterEachCall(nn.Module):
    """Its recompute saves another shape than its forward did."""

    def __init__(self):
        super().__init__()
        self.fc, self.calls = nn.Linear(16, 16), 0

    def forward(self, x):
        self.calls += 1
        return self.fc(x[: x.shape[0] - self.calls % 2]).sum(0)


def test_a_recompute_that_saves_otherwise_says_where_the_function_runs_modules_compiled_on_their_own():
    block = ShorterEachCall()
    block.compile(backend=BACKEND)
    with pytest.raises(actsave.RecomputeError, match=r"compiled on their own .*recompile_limit"):
        actsave.checkpoint(block, torch.randn(8, 16, requires_grad=True)).sum().backward()
    with pytest.raises(actsave.RecomputeError) as raised:
        actsave.checkpoint(ShorterEachCall(), torch.randn(8, 16, requires_grad=True)).sum().backward()
    assert "compiled on their own" not in str(raised.value)
