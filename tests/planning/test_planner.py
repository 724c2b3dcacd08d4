"""The planner: profile, memory model against MemTracker, the dynamic program against
brute force, presets, errors.

Peaks are MemTracker peaks of one training step (``out = model(x)``, then
``out.backward`` from a full-size gradient, parameter gradients allocated before)
minus parameters, buffers and gradients: the planner's "peak activation memory".
Measured over 100 random chains x 5 random plans: measured / predicted between 0.942
and 1.000; equal for the MLPs and the CIFAR ResNet-56 of bench/models.py.
"""
import dataclasses
import itertools
import math
import random
import re
import time

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support import assert_same_training, deep_mlp, mixed_chain, peak_activation_bytes, twin
from torch import nn

import actsave
from actsave import CheckpointedSequential, ConfigError
from actsave.planning import planner
from actsave.sequential import segment_starts
from actsave.runtime.store import KeepPolicy


class Residual(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width))

    def forward(self, x):
        return x + self.body(x)


WIDTHS = (16, 32, 64, 128)
LAYER_KINDS = {
    "relu": lambda w: nn.ReLU(),
    "gelu": lambda w: nn.GELU(),
    "tanh": lambda w: nn.Tanh(),
    "sigmoid": lambda w: nn.Sigmoid(),
    "dropout": lambda w: nn.Dropout(0.2),
    "batchnorm": lambda w: nn.BatchNorm1d(w),
    "layernorm": lambda w: nn.LayerNorm(w),
    "residual": Residual,
}


def chain(kinds: list, widths: list) -> list:
    """Linear layers of the given widths, each followed by one layer of ``kinds``."""
    torch.manual_seed(0)
    layers, width = [], 32
    for kind, out in zip(kinds, widths):
        layers += [nn.Linear(width, out), LAYER_KINDS[kind](out)]
        width = out
    return layers


random_chains = st.integers(1, 6).flatmap(lambda n: st.tuples(
    st.lists(st.sampled_from(sorted(LAYER_KINDS)), min_size=n, max_size=n),
    st.lists(st.sampled_from(WIDTHS), min_size=n, max_size=n)))


# --- the memory model against measurements --------------------------------------------


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layers=random_chains, share=st.floats(0.0, 1.0))
def test_applied_plans_stay_within_budget_on_random_chains(layers, share):
    model = CheckpointedSequential(*chain(*layers))
    x = torch.randn(64, 32)
    prof = actsave.profile(model, (x,))
    smallest = actsave.plan(prof, None, objective="memory").predicted_peak_bytes
    everything = planner.predict(prof, [0]).predicted_peak_bytes
    budget = int(smallest + share * (everything - smallest))
    plan = actsave.plan(prof, budget)
    model.apply_plan(plan)
    assert plan.predicted_peak_bytes <= budget
    assert peak_activation_bytes(model, x) <= 1.05 * budget


@pytest.mark.parametrize("codecs", [["none"] * 4, ["int8", "fp8_e4m3", "none", "int8"]], ids=["exact", "lossy"])
def test_predictions_match_measured_peaks_of_any_segmentation(codecs):
    # Mixed layers, an in-place ReLU starting a segment (private copy), lossy codecs.
    model = CheckpointedSequential(*mixed_chain(width=64))
    x = torch.randn(128, 64) * 1  # an activation: its codec applies
    prof = actsave.profile(model, (x,))
    for starts in ([0, 1, 6, 11, 16], [0, 3, 8, 12, 19]):
        plan = planner.predict(prof, starts, codecs)
        model.apply_plan(plan)
        measured = peak_activation_bytes(model, x)
        assert 0.9 * plan.predicted_peak_bytes <= measured <= plan.predicted_peak_bytes


def test_generous_budget_keeps_everything_and_trains_exactly():
    plain = nn.Sequential(*mixed_chain())
    model = CheckpointedSequential.from_sequential(twin(plain))
    x = torch.randn(8, 16)
    prof = actsave.profile(model, (x,))
    model.apply_plan(actsave.plan(prof, 10 * planner.predict(prof, [0]).predicted_peak_bytes))
    assert model.segments == [0] and model.applied_plan.codecs == ()
    assert_same_training(plain, model, x)


def test_tightest_budget_beats_sqrt_in_measured_peak():
    model = CheckpointedSequential(*deep_mlp(16, 128))
    x = torch.randn(256, 128)
    prof = actsave.profile(model, (x,))
    sqrt = planner.predict(prof, segment_starts(len(model), "sqrt"))
    with pytest.raises(ConfigError) as error:
        actsave.plan(prof, 1)
    stated = re.search(r"smallest feasible budget is ([\d,]+) bytes", str(error.value)).group(1)
    tightest = int(stated.replace(",", ""))
    results = {}
    exact = actsave.plan(prof, None, allow=("recompute",), objective="memory")
    for name, plan in (("sqrt", sqrt), ("exact", exact), ("auto", actsave.plan(prof, tightest))):
        model.apply_plan(plan)
        results[name] = peak_activation_bytes(model, x)
    # Measured (= predicted): plain 2.563 MiB, sqrt 1.563, best exact plan 1.313, with codecs 1.172.
    assert results["exact"] <= results["sqrt"]
    assert results["auto"] <= results["exact"]


# --- the dynamic program ------------------------------------------------------------


def all_plans(n: int, options: list):
    for inner in itertools.chain.from_iterable(itertools.combinations(range(1, n), k) for k in range(n)):
        for chosen in itertools.product(options, repeat=len(inner)):
            yield [0, *inner], chosen


def with_host_copies(prof: actsave.Profile) -> actsave.Profile:
    """The profile as if measured on CUDA, where offload is a lever: copies that take
    1-4x as long as the layer's forward, so they are partly exposed."""
    layers = tuple(dataclasses.replace(layer,
                                       to_host_s={c: (1 + i % 4) * layer.forward_s for c in layer.kept_bytes},
                                       to_device_s={c: 2 * layer.forward_s for c in layer.kept_bytes})
                   for i, layer in enumerate(prof.layers))
    return dataclasses.replace(prof, layers=layers, device="cuda")


@pytest.mark.parametrize("device, n", [("cpu", 6), ("cuda", 4)])
def test_dynamic_program_agrees_with_brute_force(device, n):
    model = CheckpointedSequential(*chain(["gelu", "relu", "residual"], [64, 32, 64])[:n])
    prof = actsave.profile(model, (torch.randn(32, 32) * 1,))
    if device == "cuda":
        prof = with_host_copies(prof)
    options = planner.keep_options(planner.DEFAULT_ALLOW, None, device)
    plans = [planner.predict(prof, starts, [o.codec.name for o in chosen], [o.offload for o in chosen])
             for starts, chosen in all_plans(n, options)]
    smallest = min(p.predicted_peak_bytes for p in plans)
    assert actsave.plan(prof, None, objective="memory").predicted_peak_bytes == smallest
    peaks = sorted({p.predicted_peak_bytes for p in plans})
    for budget in (peaks[0], peaks[len(peaks) // 3], peaks[len(peaks) // 2], peaks[-1]):
        fastest = min(p.predicted_step_seconds for p in plans if p.predicted_peak_bytes <= budget)
        planned = actsave.plan(prof, budget)
        assert planned.predicted_peak_bytes <= budget
        assert math.isclose(planned.predicted_step_seconds, fastest, rel_tol=1e-9)


@pytest.mark.parametrize("device, n", [("cpu", 6), ("cuda", 5)])
def test_balanced_agrees_with_brute_force_over_fixed_options(device, n):
    model = CheckpointedSequential(*chain(["gelu", "relu", "residual"], [64, 32, 64])[:n])
    prof = actsave.profile(model, (torch.empty(32, 32, device="meta").requires_grad_().clone(),), device=device)
    rng = random.Random(n)
    options = [KeepPolicy.resolve(rng.choice(["none", "int8", "fp8_e5m2"]), rng.random() < 0.5) for _ in range(n)]
    effective = [o if device == "cuda" else KeepPolicy(o.codec) for o in options]
    plans = [planner.predict(prof, starts, [effective[a].codec.name for a in starts[:-1]],
                             [effective[a].offload for a in starts[:-1]])
             for starts, _ in all_plans(n, [None])]
    planned = planner.balanced(prof, options)
    assert planned.predicted_peak_bytes == min(p.predicted_peak_bytes for p in plans)
    assert [planned.codecs, planned.offload] == [tuple(effective[a].codec.name for a in planned.starts[:-1]),
                                                tuple(effective[a].offload for a in planned.starts[:-1])]
    # The fewest layers recomputed among the smallest-peak plans (a meta profile has no times).
    fewest = min(p.starts[-1] for p in plans if p.predicted_peak_bytes == planned.predicted_peak_bytes)
    assert planned.starts[-1] == fewest


def test_a_meta_profile_measures_the_bytes_of_a_real_step():
    model = CheckpointedSequential(*mixed_chain(width=32))
    x = torch.randn(64, 32, requires_grad=True) * 1  # an activation, as inside a network
    real = actsave.profile(model, (x,))
    meta = actsave.profile(model, (torch.empty(64, 32, device="meta").requires_grad_().clone(),))
    untimed = [f.name for f in dataclasses.fields(planner.LayerProfile) if f.name.endswith("_s")]
    assert [dataclasses.replace(layer, **{f: None for f in untimed}) for layer in real.layers] == \
           [dataclasses.replace(layer, **{f: None for f in untimed}) for layer in meta.layers]
    assert (real.saved, real.input_bytes, real.output_bytes) == (meta.saved, meta.input_bytes, meta.output_bytes)
    assert all(layer.forward_s == 0 == layer.encode_s["int8"] for layer in meta.layers) and not meta.timed
    with pytest.raises(ConfigError, match="measured on meta tensors and has no times"):
        actsave.plan(meta, 2**30)
    assert actsave.plan(meta, None, objective="memory").predicted_peak_bytes > 0


def test_offloaded_relu_bits_on_a_carry_grid_stay_within_one_fetch_of_the_exact_plan():
    # Offloaded ReLU bits make fetch sizes depend on both ends of a segment; past
    # _MAX_CARRIES sizes the carries are a grid, which costs at most the largest fetch.
    layers = [m for _ in range(12) for m in (nn.Linear(64, 64), nn.ReLU())]
    prof = actsave.profile(nn.Sequential(*layers), (torch.empty(256, 64, device="meta").requires_grad_().clone(),),
                           device="cuda")
    options = [KeepPolicy.resolve("int8", offload=True)] * len(layers)
    exact = planner.balanced(prof, options)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(planner, "_MAX_CARRIES", 4)
        gridded = planner.balanced(prof, options)
    largest_fetch = max(planner._stored_by(prof, a, b, option) for a, b, option in exact.segments[:-1])
    assert exact.predicted_peak_bytes <= gridded.predicted_peak_bytes <= exact.predicted_peak_bytes + largest_fetch


def test_dynamic_program_time_for_1000_layers_is_printed(capsys):
    prof = actsave.profile(nn.Sequential(*deep_mlp(500, 16)), (torch.randn(8, 16),))
    everything = planner.predict(prof, [0]).predicted_peak_bytes
    lines = []
    for share in (1.0, 0.3, 0.1):
        start = time.perf_counter()
        plan = actsave.plan(prof, int(share * everything))
        lines.append(f"{share:.0%} of the no-checkpoint peak: {time.perf_counter() - start:.3f} s, "
                     f"{len(plan.starts)} segments")
    start = time.perf_counter()
    actsave.plan(prof, None, objective="memory")
    lines.append(f"smallest peak: {time.perf_counter() - start:.3f} s")
    with capsys.disabled():
        print("\nplanning 1,000 layers: " + "; ".join(lines))


# --- presets and levers -------------------------------------------------------------


@pytest.mark.parametrize("strategy", ["auto", "speed", "memory"])
def test_presets_plan_at_construction(strategy):
    x = torch.randn(128, 64)
    budget = 2 * 2**20
    model = CheckpointedSequential(*deep_mlp(), segments=strategy, budget=budget, example_inputs=(x,))
    plan = model.applied_plan
    assert model.segments == list(plan.starts) and plan.predicted_peak_bytes <= budget
    assert peak_activation_bytes(model, x) <= 1.05 * budget
    if strategy == "memory":
        prof = actsave.profile(model, (x,))
        assert plan.predicted_peak_bytes == actsave.plan(prof, None, objective="memory").predicted_peak_bytes


def test_min_sqnr_and_allow_choose_the_codecs():
    prof = actsave.profile(nn.Sequential(*deep_mlp()), (torch.randn(128, 64),))
    tight = actsave.plan(prof, None, objective="memory").predicted_peak_bytes

    def codecs(**levers):
        return {c for p in (actsave.plan(prof, None, objective="memory", **levers),) for c in p.codecs}

    assert codecs() - {"none"}, "at the smallest peak some inputs are compressed"
    assert codecs(min_sqnr_db=30) <= {"none", "int8"}
    assert codecs(min_sqnr_db=40) == codecs(allow=("recompute",)) == {"none"}
    assert actsave.plan(prof, None, objective="memory", allow=()).starts == (0,)
    with pytest.raises(ConfigError, match="smallest feasible budget"):
        actsave.plan(prof, tight, allow=("recompute",))


def test_offload_is_a_lever_on_cuda_only():
    cpu = planner.keep_options(planner.DEFAULT_ALLOW, None, "cpu")
    cuda = planner.keep_options(planner.DEFAULT_ALLOW, None, "cuda:0")
    assert not any(o.offload for o in cpu)
    codecs = ("none", "int8", "fp8_e4m3")
    assert {(o.codec.name, o.offload) for o in cuda} == {(c, f) for c in codecs for f in (False, True)}


# --- profile and printing -----------------------------------------------------------


def test_profile_measures_saved_storages_once_and_leaves_no_trace():
    model = CheckpointedSequential(*mixed_chain(width=32))
    for p in model.parameters():
        p.grad = torch.full_like(p, 3.0)
    buffers = [b.clone() for b in model.buffers()]
    x = torch.randn(16, 32)
    torch.manual_seed(5)
    expected_random = torch.rand(1)
    torch.manual_seed(5)
    prof = actsave.profile(model, (x,))
    assert torch.equal(torch.rand(1), expected_random)
    assert all(torch.equal(p.grad, torch.full_like(p, 3.0)) for p in model.parameters())
    assert all(torch.equal(a, b) for a, b in zip(buffers, model.buffers()))
    # Linear saves its input, the in-place ReLU its output: the same storage, once.
    relu = prof.layers[1]
    assert relu.input_saved_by == (1, 1) and relu.saved_bytes == 16 * 32 * 4
    assert prof.layers[0].saved_bytes == 0  # its input is the batch, held anyway
    assert relu.modifies_input and relu.relu_sign_bytes == 16 * 32 // 8


def test_profile_and_plan_print_as_tables():
    prof = actsave.profile(nn.Sequential(*deep_mlp(4)), (torch.randn(32, 64),))
    lines = str(prof).splitlines()
    assert lines[0].split()[:5] == ["layer", "name", "type", "out", "MiB"] and len(lines) == 1 + 8 + 1
    plan = actsave.plan(prof, None, objective="memory")
    text = str(plan)
    assert "predicted peak activation memory" in text and "stored (no recompute)" in text and "<- peak" in text


# --- bad input ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def small_profile():
    return actsave.profile(nn.Sequential(*deep_mlp(2)), (torch.randn(8, 64),))


@pytest.mark.parametrize("arguments, message", [
    (dict(budget=None), "budget .* is required"),
    (dict(budget=-5), "budget=-5 must be a positive number of bytes"),
    (dict(budget=True), "budget=True must be"),
    (dict(budget="1GB"), "budget='1GB' must be"),
    (dict(budget=2**30, objective="fast"), "objective='fast' must be one of"),
    (dict(budget=2**30, allow="int8"), "allow='int8' must be a tuple of lever names"),
    (dict(budget=2**30, allow=("int4",)), r"unknown levers \['int4'\]"),
    (dict(budget=2**30, allow=("int8",)), "need 'recompute' in allow"),
    (dict(budget=2**30, min_sqnr_db="high"), "min_sqnr_db='high' must be a number"),
])
def test_bad_plan_arguments_say_what_to_do(small_profile, arguments, message):
    with pytest.raises(ConfigError, match=message):
        actsave.plan(small_profile, **arguments)


def test_bad_profile_and_preset_arguments_say_what_to_do(small_profile):
    x = torch.randn(8, 64)
    with pytest.raises(ConfigError, match="expects an nn.Sequential"):
        actsave.profile(nn.Linear(64, 64), (x,))
    with pytest.raises(ConfigError, match=r"example_inputs must be \(x,\)"):
        actsave.profile(nn.Sequential(nn.Linear(64, 64)), (x, x))
    with pytest.raises(ConfigError, match="plan expects a Profile"):
        actsave.plan("profile", 2**30)
    with pytest.raises(ConfigError, match="the plan is for 4 layers"):
        CheckpointedSequential(*deep_mlp(3)).apply_plan(actsave.plan(small_profile, None, objective="memory"))
    with pytest.raises(ConfigError, match="segments='auto' needs budget="):
        CheckpointedSequential(*deep_mlp(2), segments="auto", example_inputs=(x,))
    with pytest.raises(ConfigError, match="segments='speed' chooses codecs and offload itself"):
        CheckpointedSequential(*deep_mlp(2), segments="speed", budget=2**20, example_inputs=(x,),
                               compress="int8")
    with pytest.raises(ConfigError, match="used by segments=.* only"):
        CheckpointedSequential(*deep_mlp(2), segments="sqrt", budget=2**20)
