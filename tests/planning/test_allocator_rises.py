"""The allocator's count in a profile (planning/allocator_rises.py, NOTE [ Allocator
rises ]): memory a kernel takes that no tensor holds prices the layer that takes it.

Read on CUDA only, from torch.cuda's statistics. Here a fake of those statistics stands
for the CUDA allocator, counting only what the test's layers take as "workspaces", and
the profile reads it as it would on a GPU.
"""
import pytest
import torch
from torch import nn

import actsave
from actsave import CheckpointedSequential, devices
from actsave.planning import allocator_rises, instrumented_step, plans
from actsave.planning.allocator_rises import AllocatorRises, larger_of_each
from actsave.planning.block_options import BlockMeasurer
from actsave.planning.tensor_specs import TensorSpec
from actsave.runtime.keep_modes import BlockOption
from support import cuda_activation_peak, load_bench_module


class FakeAllocator:
    """torch.cuda's three statistics the profile reads, over bytes taken by hand."""

    def __init__(self):
        self.allocated = self.peak = 0
        self.resets = 0

    def take(self, nbytes: int) -> None:
        self.allocated += nbytes
        self.peak = max(self.peak, self.allocated)

    def give(self, nbytes: int) -> None:
        self.allocated -= nbytes

    def memory_allocated(self, device=None) -> int:
        return self.allocated

    def max_memory_allocated(self, device=None) -> int:
        return self.peak

    def reset_peak_memory_stats(self, device=None) -> None:
        self.peak, self.resets = self.allocated, self.resets + 1


@pytest.fixture
def fake(monkeypatch):
    allocator = FakeAllocator()
    for name in ("memory_allocated", "max_memory_allocated", "reset_peak_memory_stats"):
        monkeypatch.setattr(torch.cuda, name, getattr(allocator, name))
    return allocator


def test_a_span_rises_by_the_peak_above_its_start_and_spans_nest(fake):
    rises = AllocatorRises("cuda")
    fake.take(100)  # held before: not a rise
    with rises.span() as outer:
        fake.take(50)
        fake.give(50)
        with rises.span() as inner:  # resets the peak: the outer span keeps the one before
            fake.take(20)
            fake.give(20)
        fake.take(5)
    assert (outer[0], inner[0]) == (50, 20)
    with rises.span() as outer:
        with rises.span() as inner:
            fake.take(10)
        fake.take(60)  # after the inner span: the outer span's own peak
    assert (outer[0], inner[0]) == (70, 10)
    with rises.span() as after:
        fake.give(75)
    assert after[0] == 0


class _Workspace(torch.autograd.Function):
    """The identity, taking ``forward_bytes`` from the fake allocator while its forward
    runs and ``backward_bytes`` while its backward runs, as a cuDNN convolution takes
    its workspace."""

    @staticmethod
    def forward(ctx, x, allocator, forward_bytes, backward_bytes):
        ctx.allocator, ctx.backward_bytes = allocator, backward_bytes
        allocator.take(forward_bytes)
        allocator.give(forward_bytes)
        ctx.save_for_backward(x)  # saved as the forward ends: after the workspace
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        ctx.allocator.take(ctx.backward_bytes)
        ctx.allocator.give(ctx.backward_bytes)
        return grad.clone(), None, None, None


class WorkspaceLayer(nn.Module):
    def __init__(self, allocator, forward_bytes, backward_bytes):
        super().__init__()
        self.allocator, self.forward_bytes, self.backward_bytes = allocator, forward_bytes, backward_bytes

    def forward(self, x):
        return _Workspace.apply(x, self.allocator, self.forward_bytes, self.backward_bytes)


WORKSPACE = 1 << 20  # above any rise of the chain's own tensors (64 x 64 fp32: 16 KiB)


def chain(allocator):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), WorkspaceLayer(allocator, WORKSPACE, 2 * WORKSPACE),
                         nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64))


def test_a_profile_prices_the_layer_that_takes_a_workspace(fake, monkeypatch):
    x = torch.randn(64, 64, requires_grad=True)
    model = chain(fake)
    live_only = actsave.profile(model, (x,))  # on a CPU: the live storages alone
    assert fake.resets == 0
    monkeypatch.setattr(allocator_rises, "allocator_statistics", lambda device: True)
    counted = actsave.profile(model, (x,))
    assert fake.resets > 0
    for i, (live, both) in enumerate(zip(live_only.layers, counted.layers)):
        if i == 2:
            assert (both.forward_rise, both.forward_rise_to_last_save, both.no_grad_rise, both.backward_rise) == \
                   (WORKSPACE, WORKSPACE, WORKSPACE, 2 * WORKSPACE)
            assert max(live.forward_rise, live.forward_rise_to_last_save, live.backward_rise) < WORKSPACE
        else:  # the fake counts no tensor: the live storages' rises stand
            assert (both.forward_rise, both.forward_rise_to_last_save, both.no_grad_rise, both.backward_rise) == \
                   (live.forward_rise, live.forward_rise_to_last_save, live.no_grad_rise, live.backward_rise)
    assert counted.loss_rise == live_only.loss_rise
    # Every plan's peak counts the backward's workspace above what its tensors hold then.
    for starts in ([0], [0, 3], [0, 2, 4]):
        live, both = (plans.predict(p, starts, ["none"] * (len(starts) - 1)).predicted_peak_bytes
                      for p in (live_only, counted))
        assert both >= 2 * WORKSPACE > live


class Block(nn.Module):
    def __init__(self, allocator):
        super().__init__()
        self.linear, self.work = nn.Linear(64, 64), WorkspaceLayer(allocator, WORKSPACE, 2 * WORKSPACE)

    def forward(self, x):
        return self.work(torch.relu(self.linear(x)))


def test_a_blocks_per_op_options_are_measured_with_the_workspace_they_take(fake, monkeypatch):
    # A block plan prices plain and checkpointed blocks by the chain's profile, above, and
    # measures the per-op options apart (block_options.py): there too.
    torch.manual_seed(0)
    block, x = Block(fake), torch.randn(64, 64, requires_grad=True) * 1
    options = [BlockOption.resolve("selective"), BlockOption.resolve("saves", compress="int8")]

    def rises():
        measurer = BlockMeasurer(nn.Sequential(block), [TensorSpec.of(x)], "cpu", timed=False)
        return [(m.forward_rise, m.backward_rise) for m in (measurer.measured(0, option) for option in options)]

    live_only = rises()
    monkeypatch.setattr(allocator_rises, "allocator_statistics", lambda device: True)
    assert rises() == [(WORKSPACE, 2 * WORKSPACE)] * len(options)
    assert all(forward < WORKSPACE and backward < WORKSPACE for forward, backward in live_only)


def test_the_allocator_is_read_on_cuda_only():
    assert devices.allocator_statistics("cuda") and devices.allocator_statistics("cuda:1")
    assert not devices.allocator_statistics("cpu") and not devices.allocator_statistics("meta")
    assert instrumented_step.measure_allocator_rises([], torch.zeros(1)) is None


def test_larger_of_each_takes_each_spans_larger_rise():
    assert larger_of_each([1, 5, 3], [4, 2, 3]) == [4, 5, 3]
    with pytest.raises(ValueError):
        larger_of_each([1], [1, 2])


@pytest.mark.cuda
def test_cuda_plans_of_a_convolution_chain_measure_within_3_percent_of_their_prediction():
    # cuDNN's workspaces are memory no tensor holds: the allocator's count prices them
    # (docs/results.md, "Memory no tensor holds, on a CPU", has the H200's figures).
    bench_models = load_bench_module("models.py")
    model = CheckpointedSequential(*bench_models.cifar_resnet(56)).cuda()
    x = torch.randn(128, 3, 32, 32, device="cuda")
    prof = actsave.profile(model, (x,))
    smallest = actsave.plan(prof, None, objective="memory").predicted_peak_bytes
    everything = plans.predict(prof, [0]).predicted_peak_bytes
    for share in (0.0, 0.25, 0.5, 1.0):
        plan = actsave.plan(prof, int(smallest + share * (everything - smallest)))
        model.apply_plan(plan)
        ratio = cuda_activation_peak(model, x) / plan.predicted_peak_bytes
        print(f"{plan}\nmeasured / predicted {ratio:.4f}")
        assert 0.9 <= ratio <= 1.03, (plan, ratio)
