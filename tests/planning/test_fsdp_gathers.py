"""FSDP2's gathered parameters in a plan (planning/fsdp_gathers.py, NOTE [ Gathered
parameters ]): what each layer gathers, what a plain step holds of them, and the
balanced plan's prediction against a sharded step's measured peak.

One process stands for rank 0 of two over torch's fake process group: FSDP2 shards,
gathers and frees as on a real rank (its collectives move no data), on this thread
only, so the allocator's events see every free (under gloo its worker threads drop
some buffers, which the profiler does not see: docs/results.md, "FSDP2").
tests/test_distributed.py trains on two gloo ranks."""
import dataclasses

import pytest
import torch
import torch.distributed as dist
from torch import nn

import actsave
from actsave.planning import plans, profiler
from actsave.planning.fsdp_gathers import gathered_bytes, with_plain_step_gathers
from support import load_bench_module

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="needs torch.distributed")

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def mesh():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        yield init_device_mesh("cpu", (2,))
    finally:
        dist.destroy_process_group()


def shard(model: nn.Module, units: list, mesh) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    for unit in units:
        fully_shard(unit, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def test_a_layer_gathers_the_whole_parameters_of_the_units_at_or_inside_it(mesh):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16))
    half = nn.Linear(16, 16)
    by_the_root = nn.Linear(16, 16)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16), block, half, by_the_root)
    fully_shard(half, mesh=mesh, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    shard(model, [model[0], model[2], block], mesh)
    assert [gathered_bytes(layer, CPU) for layer in model] == [
        (16 * 32 + 32) * 4, 0, (32 * 16 + 16) * 4, 2 * (16 * 16 + 16) * 4, (16 * 16 + 16) * 2,
        0]  # the root's parameters are not the layer's units'
    assert gathered_bytes(model[0], torch.device("cuda")) == 2560  # CUDA's 512-byte blocks


def layer(name: str, gathered: int, rise: int = 100) -> profiler.LayerProfile:
    plain = profiler.LayerProfile.saving_nothing(name, "Linear", input_bytes=8, dense_input_bytes=8,
                                                 input_grad_bytes=8, input_saved_by=None, output_bytes=8,
                                                 forward_rise=rise, backward_rise=rise)
    return dataclasses.replace(plain, gathered_bytes=gathered, forward_rise_to_last_save=rise)


def test_a_plain_step_holds_a_layers_units_the_prefetched_ones_and_one_reduce_scatter_input():
    """Forward: a layer's own units. Backward: its own, the nearest earlier gathering
    layer's (prefetched by this layer's units or a later layer's) and the nearest
    later one's reduce-scatter input; a layer after the last unit holds none."""
    layers = [layer("unit a", 10), layer("act", 0), layer("unit b", 20), layer("unit c", 40), layer("act", 0)]
    out = with_plain_step_gathers(layers)
    assert [x.forward_rise - 100 for x in out] == [10, 0, 20, 40, 0]
    assert [x.forward_rise_to_last_save - 100 for x in out] == [10, 0, 20, 40, 0]
    assert [x.no_grad_rise - 100 for x in out] == [10, 0, 20, 40, 0]
    assert [x.backward_rise - 100 for x in out] == [10 + 0 + 20, 0 + 10 + 20, 20 + 10 + 40, 40 + 20 + 0, 0]
    assert with_plain_step_gathers([layer("act", 0)] * 3) == [layer("act", 0)] * 3


@pytest.mark.parametrize("segments", ["balanced", [0, 5, 9, 12, 14], [0]], ids=["balanced", "unsharded-plan", "stored"])
def test_a_plan_predicts_a_sharded_steps_peak_within_5_percent(mesh, segments):
    """The bench's chain (bench/fsdp_memory.py), each Linear a unit, with the balanced
    plan, with the unsharded model's (whose peak is in its first checkpointed
    segment's backward, three units gathered and one reduce-scatter input) and stored
    whole (the plain step's units: the last two, as its backward starts): the plan
    counts the units each recompute keeps gathered. The measured peak exceeds the
    prediction by the CPU generator's state each checkpoint keeps to replay its RNG,
    which no plan counts (docs/results.md, "FSDP2")."""
    harness = load_bench_module("harness")
    torch.manual_seed(0)
    layers = [m for _ in range(8) for m in (nn.Linear(256, 256), nn.GELU())]
    model = shard(actsave.CheckpointedSequential(*layers, segments=segments),
                  [m for m in layers if isinstance(m, nn.Linear)], mesh)
    x = torch.randn(512, 256, requires_grad=True)

    def step():
        out = model(x)
        out.backward(torch.ones_like(out))

    step()  # plans
    measured = harness.allocator_peak(step) + x.numel() * x.element_size()
    if segments == "balanced":
        predicted = model.balanced_plan.predicted_peak_bytes
    else:
        meta_x = torch.empty_like(x, device="meta").requires_grad_()
        predicted = plans.predict(actsave.profile(model, (meta_x,)), segments).predicted_peak_bytes
    unit = (256 * 256 + 256) * 4
    assert predicted <= measured <= 1.05 * predicted
    assert measured - predicted < unit / 8  # no unit uncounted
    assert "a balanced plan counts the parameters FSDP2 gathers" in model.describe()


@pytest.mark.parametrize("segments", ["auto", "memory"])
def test_segments_planned_from_a_measured_step_are_refused_on_sharded_layers(mesh, segments):
    # Each rank would plan from its own times, and a recompute gathers its units: ranks
    # with other segments gather in other orders and hang (seen on two gloo ranks).
    torch.manual_seed(0)
    layers = [nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU()]
    shard(nn.Sequential(*layers), [layers[0], layers[2]], mesh)
    with pytest.raises(actsave.ConfigError, match="not supported on sharded .DTensor. layers.*segments='balanced'"):
        actsave.CheckpointedSequential(*layers, segments=segments, budget=2**20, example_inputs=(torch.randn(8, 32),))
