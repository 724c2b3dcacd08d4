"""Offloaded checkpoints end to end, and the runtime and the planner on one rule of
where host memory is."""
import gc
import weakref

import pytest
import torch

from actsave import ActsaveError
from actsave.offload import (
    HostPool,
    OffloadedTensors,
    host_pool,
)

from offload.helpers import LateCopyEngine, RecordingEngine
from support import sqnr_db

from actsave.codecs import EXPECTED_GRADIENT_SQNR_DB


import copy  # noqa: E402

import actsave  # noqa: E402
from actsave.offload import offloaded as offloaded_module  # noqa: E402
from actsave import CheckpointedSequential  # noqa: E402


def dropout_chain():
    torch.manual_seed(0)
    return torch.nn.Sequential(*[m for _ in range(6) for m in (
        torch.nn.Linear(16, 16), torch.nn.ReLU(inplace=True), torch.nn.Dropout(0.2))])


def step(model, seed=1):
    torch.manual_seed(seed)
    x = torch.randn(8, 16, requires_grad=True)
    out = model(x * 1)
    kept = actsave.kept_bytes()
    out.square().sum().backward()
    return kept, x.grad


def test_offloaded_training_is_bit_identical_and_leaves_nothing():
    plain = dropout_chain()
    model = CheckpointedSequential.from_sequential(copy.deepcopy(plain), segments=6, offload=True)
    _, grad_plain = step(plain)
    kept, grad = step(model)
    assert kept == {"device": 0, "host": 5 * 8 * 16 * 4}  # 5 checkpointed segments of 6
    assert torch.equal(grad, grad_plain)
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(plain.parameters(), model.parameters()))
    assert actsave.kept_bytes() == {"device": 0, "host": 0}
    assert host_pool().in_use_bytes == 0


def test_the_last_offloaded_input_leaves_the_device_when_the_stored_segment_starts():
    # Seen on an H100: nothing registered after the last offloaded segment, so its
    # input stayed on the device until its recompute, one input above the plan.
    model = CheckpointedSequential(*dropout_chain(), segments=6, offload=True)  # 0..12 offloaded, 15.. stored
    inputs = []

    def note_input(_, args):
        inputs.append(weakref.ref(args[0].untyped_storage()))

    model[12].register_forward_pre_hook(note_input)
    out = model(torch.randn(8, 16, requires_grad=True) * 1)
    try:
        assert inputs[0]() is None
    finally:
        out.sum().backward()  # gives the host buffers back, pass or fail


def test_compressed_bytes_are_what_travel():
    model = CheckpointedSequential(*dropout_chain(), segments=6, compress="int8", offload=True)
    kept, _ = step(model)
    # Per segment: int8 codes, one fp32 scale, and the ReLU's decisions (1 bit per element).
    assert kept["host"] == 5 * (8 * 16 + 4 + 8 * 16 // 8)


def test_a_hundred_steps_keep_the_pool_constant():
    # A buffer the pool failed to reuse shows as an allocation at the first step after
    # the warm-up one: a hundred steps show any growth a thousand would.
    model = CheckpointedSequential(*dropout_chain(), segments=6, compress="int8", offload=True)
    step(model)
    reserved, allocations = host_pool().reserved_bytes, host_pool().allocations
    for seed in range(100):
        step(model, seed)
    assert (host_pool().reserved_bytes, host_pool().allocations) == (reserved, allocations)
    assert host_pool().in_use_bytes == 0


def test_per_layer_offload():
    model = CheckpointedSequential(*dropout_chain(), segments=[0, 3, 6, 9], offload={3: True})
    model.set_offload(slice(6, 7), True)
    kept, _ = step(model)
    assert kept["host"] == 2 * 8 * 16 * 4
    where = [line.split()[6:8] for line in model.describe().splitlines()[1:] if "input" in line]
    assert where == [["device", str(8 * 16 * 4)], ["host", str(8 * 16 * 4)], ["host", str(8 * 16 * 4)]]


class LayoutNotingConv(torch.nn.Conv2d):
    """A convolution that notes, at each call, whether its input is channels_last."""
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.channels_last_inputs = []

    def forward(self, x):
        self.channels_last_inputs.append(x.is_contiguous(memory_format=torch.channels_last))
        return super().forward(x)


def channels_last_conv_chain():
    torch.manual_seed(0)
    layers = [m for _ in range(3) for m in (LayoutNotingConv(8, 8, 3, padding=1), torch.nn.BatchNorm2d(8),
                                            torch.nn.ReLU())]
    return torch.nn.Sequential(*layers).to(memory_format=torch.channels_last)


def test_offloaded_channels_last_inputs_are_recomputed_channels_last_with_identical_gradients():
    # NOTE [ Kept layouts ]: a convolution recomputed on a contiguous copy of its
    # channels_last input runs other kernels, and its gradients may differ.
    plain = channels_last_conv_chain()
    model = CheckpointedSequential(*copy.deepcopy(plain), segments=[0, 3, 6], offload=True)
    x = torch.randn(4, 8, 6, 6).to(memory_format=torch.channels_last)
    grads, kept = [], []
    for net in (plain, model):
        leaf = x.clone().requires_grad_(True)
        out = net(leaf * 1)
        kept.append(actsave.kept_bytes())
        out.square().sum().backward()
        grads.append(leaf.grad)
    assert kept[1]["host"] == 2 * 4 * 8 * 6 * 6 * 4  # the inputs of the two checkpointed segments
    # Each checkpointed segment's convolution: its forward, then its recompute.
    assert model[0].channels_last_inputs == model[3].channels_last_inputs == [True, True]
    assert torch.equal(*grads)
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(plain.parameters(), model.parameters()))


class Boom(torch.nn.Module):
    def __init__(self, when):
        super().__init__()
        self.when, self.calls = when, 0

    def forward(self, x):
        self.calls += 1
        if self.calls == self.when:
            raise ValueError("boom")
        return x * 2


@pytest.mark.parametrize("when", [1, 2], ids=["in forward", "in backward"])
def test_an_exception_leaves_no_buffer_claimed(when):
    model = CheckpointedSequential(*dropout_chain()[:6], Boom(when), *dropout_chain()[:6],
                                   segments=[0, 3, 6, 9], offload=True)
    with pytest.raises(ValueError, match="boom"):
        step(model)
    gc.collect()  # the traceback held the partial graph
    assert host_pool().in_use_bytes == 0
    assert actsave.kept_bytes() == {"device": 0, "host": 0}


def test_offloaded_input_modified_in_place_during_forward_is_refused():
    def add_one_(t):
        return t.add_(1).sin()

    with pytest.raises(actsave.RecomputeError, match="modified in place by .*add_one_ during its forward"):
        actsave.checkpoint(add_one_, torch.randn(3, 4, requires_grad=True).tanh(), offload=True)
    assert host_pool().in_use_bytes == 0


def _gradients_after_an_in_place_change(wrapped):
    torch.manual_seed(0)
    linear = torch.nn.Linear(16, 16)
    x = torch.randn(8, 16, requires_grad=True)
    h = x * 1

    def block(t):
        return linear(torch.tanh(t * 2))  # saves tanh's output, not t: plain PyTorch lets t change

    y = wrapped(block, h)
    h.mul_(3)
    y.sum().backward()
    return linear.weight.grad, x.grad


@pytest.mark.parametrize("keep", ["exact", "int8"])
def test_an_offloaded_input_changed_in_place_after_the_forward_gives_the_forwards_gradients(monkeypatch, keep):
    # Kept exactly, the caller's tensor is the copy's source: on a GPU behind the host
    # the copy could read the change (NOTE [ Offload stream ordering ], rule 2).
    engine = LateCopyEngine()
    monkeypatch.setattr(offloaded_module, "copy_engine_for", lambda device: engine)
    compress = None if keep == "exact" else keep
    expected = _gradients_after_an_in_place_change(lambda f, h: f(h))
    got = _gradients_after_an_in_place_change(
        lambda f, h: actsave.checkpoint(f, h, offload=True, compress=compress))
    if keep == "exact":
        assert all(torch.equal(a, b) for a, b in zip(expected, got))
    else:  # the codec's copy is private anyway: the forward's values, by int8
        assert all(sqnr_db(a, b) >= EXPECTED_GRADIENT_SQNR_DB["int8"] for a, b in zip(expected, got))


@pytest.mark.cuda
def test_on_cuda_an_offloaded_input_changed_in_place_after_the_forward_gives_the_forwards_gradients():
    # 256 MiB: its copy to the host outlasts the block's forward, so an in-place change
    # queued after the call would reach the copy if nothing ordered it behind.
    torch.manual_seed(0)
    linear = torch.nn.Linear(1024, 1024, device="cuda")
    x0 = torch.randn(65536, 1024, device="cuda")

    def gradients(wrapped):
        linear.zero_grad(set_to_none=True)
        x = x0.clone().requires_grad_()
        h = x * 1
        y = wrapped(lambda t: linear(torch.tanh(t * 2)), h)
        h.mul_(3)
        y.square().mean().backward()
        return linear.weight.grad, x.grad

    expected = gradients(lambda f, h: f(h))
    for _ in range(3):
        got = gradients(lambda f, h: actsave.checkpoint(f, h, offload=True))
        assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(expected, got))


def relu_chain():
    torch.manual_seed(0)
    return [m for _ in range(4) for m in (torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16),
                                          torch.nn.ReLU())]


class CountingPool(HostPool):
    """A host pool that counts its loans: one per host enqueue of an offloaded group."""

    def __init__(self):
        super().__init__()
        self.loans = 0

    def acquire(self, nbytes):
        self.loans += 1
        return super().acquire(nbytes)


def test_a_kept_input_and_a_segments_decisions_each_go_to_the_host_as_one_group(monkeypatch):
    # int8 keeps codes and scales; each segment's forward keeps two ReLU decisions.
    pool = CountingPool()
    monkeypatch.setattr(actsave.offload.pool, "_DEFAULT_POOL", pool)
    model = CheckpointedSequential(*relu_chain(), segments=4, compress="int8", offload=True)
    plain = CheckpointedSequential(*relu_chain(), segments=4, compress="int8")
    x = torch.randn(8, 16, requires_grad=True)
    out = model(x * 1)
    assert pool.loans == 2 * 3  # 3 checkpointed segments; the first's input is x * 1
    out.square().sum().backward()
    plain(x * 1).square().sum().backward()
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(plain.parameters(), model.parameters()))
    assert pool.in_use_bytes == 0


def test_offloaded_tensors_come_back_as_views_of_one_copy():
    log = []
    engine, pool = RecordingEngine(log), HostPool()
    parts = [torch.full((5,), 1.0), torch.arange(3, dtype=torch.int8), torch.ones((), dtype=torch.float64)]
    group = OffloadedTensors(parts, pool=pool, engine=engine)
    assert group.nbytes == 5 * 4 + 3 + 8
    back = group.fetch()
    assert [what for what, _ in log] == ["to_host", "to_host", "to_host", "free_after", "to_device", "wait"]
    assert all(b.dtype == p.dtype and torch.equal(b, p) for b, p in zip(back, parts))
    assert len({b.untyped_storage().data_ptr() for b in back}) == 1  # one buffer, aligned parts
    assert all(b.data_ptr() % 16 == 0 for b in back)
    group.release()
    assert pool.in_use_bytes == 0


def test_a_group_is_on_one_device():
    with pytest.raises(ActsaveError, match="one or more tensors, all on one device"):
        OffloadedTensors([])
    with pytest.raises(ActsaveError, match="one or more tensors, all on one device"):
        OffloadedTensors([torch.ones(2), torch.ones(2, device="meta")])


# --- the runtime and the planner on one rule ------------------------------------------

from actsave.devices import host_is_separate  # noqa: E402
from actsave.planning.memory_model import effective_option  # noqa: E402
from actsave.planning.plans import keep_options  # noqa: E402
from actsave.codecs import IDENTITY  # noqa: E402
from actsave.runtime.keep_rules import EXACT, KeepPolicy  # noqa: E402


def wide_relu_chain():
    torch.manual_seed(0)
    return [m for _ in range(6) for m in (torch.nn.Linear(64, 64), torch.nn.ReLU())]


@pytest.mark.parametrize("device", ["cpu", "cuda", "meta"], ids=["cpu", "simulated_gpu", "meta"])  # no GPU needed
def test_runtime_and_planner_agree_on_whether_host_memory_is_separate(device):
    # NOTE [ Separate host memory ]: the runtime offloads on every device and counts it
    # as host memory; those bytes leave the device, for the planner as for a step's
    # simulation (estimate), only where host_is_separate says so.
    separate = host_is_separate(device)
    assert separate == (device == "cuda")  # meta stands for no device: no host apart
    shape = (32, 64)
    exact = actsave.estimate(CheckpointedSequential(*wide_relu_chain(), segments=6), shape, device=device)
    offloaded = actsave.estimate(CheckpointedSequential(*wide_relu_chain(), segments=6, offload=True), shape, device=device)
    assert offloaded.host_peak_bytes >= 4 * 32 * 64 * 4  # four middle segments' inputs, on every device
    assert (offloaded.activation_peak_bytes < exact.activation_peak_bytes) == separate
    assert [option.offload for option in keep_options(("recompute", "offload"), None, device)] == \
        ([False, True] if separate else [False])
    layer = actsave.profile(torch.nn.Sequential(*wide_relu_chain()), torch.randn(shape)).layers[2]
    assert effective_option(KeepPolicy(IDENTITY, True), layer, device).offload == separate


def test_a_cpu_step_offloads_what_the_planner_counts_on_the_device():
    model = CheckpointedSequential(*wide_relu_chain(), segments=6, offload=True)
    x = torch.randn(32, 64, requires_grad=True)
    out = model(x * 1)
    assert actsave.kept_bytes() == {"device": 0, "host": 5 * 32 * 64 * 4}
    out.sum().backward()
    assert not host_is_separate(x.device)
    layer = actsave.profile(torch.nn.Sequential(*wide_relu_chain()), x.detach()).layers[2]
    assert layer.to_host_s == {} and effective_option(KeepPolicy(IDENTITY, True), layer, "cpu") == EXACT


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))


@pytest.mark.parametrize("keep", ["saves", "linear_inputs", "selective"])
def test_offloaded_saves_under_torch_func_jvp_give_plain_values(keep):
    # The saves come unwrapped to the hooks, but tensors made under the transform are
    # wrapped: the host buffers and their copies are made outside it.
    model, x, tangent = _mlp(), torch.randn(5, 8), torch.randn(5, 8)
    expected = torch.func.jvp(model, (x,), (tangent,))
    for _ in range(2):  # the second takes a buffer the pool lent before
        got = torch.func.jvp(lambda z: actsave.checkpoint(model, z, keep=keep, offload=True), (x,), (tangent,))
        assert all(torch.equal(a, b) for a, b in zip(got, expected))


@pytest.mark.parametrize("keep", ["saves", "selective"])
def test_forward_ad_zero_tangents_are_held_not_offloaded(keep):
    # A weight without a tangent saves an efficient zero tensor, a storage with no
    # memory: copying it to the host read address 0 (a segmentation fault).
    import torch.autograd.forward_ad as forward_ad
    model, x, tangent = _mlp(), torch.randn(5, 8), torch.randn(5, 8)
    with forward_ad.dual_level():
        expected = forward_ad.unpack_dual(model(forward_ad.make_dual(x, tangent)))
        got = forward_ad.unpack_dual(actsave.checkpoint(model, forward_ad.make_dual(x, tangent), keep=keep,
                                                        offload=True))
    assert torch.equal(got.primal, expected.primal) and torch.equal(got.tangent, expected.tangent)
