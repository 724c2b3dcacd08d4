"""CheckpointedSequential: exact recompute, nn.Sequential compatibility, memory, errors."""
import gc
import math
import warnings
import weakref
from collections import OrderedDict

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support import (CallCounter, assert_same_training, codes_and_scales, mixed_chain, peak_activation_bytes,
                     sqnr_db, train_step, twin)
from torch import nn
from torch.distributed._tools.mem_tracker import MemTracker
from torch.utils.checkpoint import checkpoint_sequential

import actsave
from actsave import CheckpointedSequential, ConfigError, RecomputeError
from actsave.planning.segments import plan_segments, split_starts
from actsave.runtime.keep_rules import EXACT, KeepPolicy

SEGMENT_SPECS = [1, 2, 3, "sqrt", "balanced", [0, 1, 3, 7], [1, 6, 11, 16], 20]


def as_checkpointed(plain, **options):
    return CheckpointedSequential.from_sequential(twin(plain), **options)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("segments", SEGMENT_SPECS, ids=str)
def test_training_is_bit_identical_to_plain(dtype, segments):
    # The chain has Dropout (RNG replay), BatchNorm (running stats), GELU and
    # ReLU(inplace=True); [1, 6, 11, 16] starts every segment with the in-place ReLU.
    plain = mixed_chain().to(dtype)
    model = as_checkpointed(plain, segments=segments)
    assert_same_training(plain, model, torch.randn(8, 16, dtype=dtype))


def test_segment_starting_in_place_works_where_torch_checkpoint_raises():
    plain = mixed_chain()
    x = torch.randn(8, 16)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        train_step(lambda inp: checkpoint_sequential(twin(plain), 20, inp, use_reentrant=False), x)
    assert_same_training(plain, as_checkpointed(plain, segments=20), x)


def identity_then_in_place_chain():
    torch.manual_seed(0)
    layers = []
    # A norm left out as nn.Identity (or a dropout of p=0, in a Sequential), then an
    # in-place activation.
    for between in [nn.Identity, lambda: nn.Dropout(0.0), lambda: nn.Sequential(nn.Identity())] * 2:
        layers += [nn.Linear(32, 32), between(), nn.ReLU(inplace=True)]
    return nn.Sequential(*layers, nn.Linear(32, 32), nn.Flatten(), nn.ReLU(inplace=True), nn.Linear(32, 4))


def assert_trains_as_plain(plain, model, compress):
    """Bit-identical training where ``compress`` is None, else every parameter gradient
    above int8's floor (33 dB)."""
    if compress is None:
        assert_same_training(plain, model, torch.randn(8, 32))
        return
    x = torch.randn(8, 32)
    plain(x.clone().requires_grad_()).sum().backward()
    model(x.clone().requires_grad_()).sum().backward()
    assert min(sqnr_db(p.grad, q.grad) for p, q in zip(plain.parameters(), model.parameters())) > 33


@pytest.mark.parametrize("segments", ["balanced", [0, 1, 4, 7, 10, 13, 16, 19], [0, 19]], ids=str)
@pytest.mark.parametrize("compress", [None, "int8"])
def test_a_segment_starting_with_layers_that_hand_their_input_to_an_in_place_one_keeps_a_copy(segments, compress):
    # The in-place ReLU changes the Identity's (the Flatten's) input, the segment's:
    # the balanced plan starts segments there by itself.
    plain = identity_then_in_place_chain()
    model = as_checkpointed(plain, segments=segments, compress=compress)
    assert_trains_as_plain(plain, model, compress)


class _Tap(nn.Module):
    """A layer of the user's own that notes a statistic and returns its input (as it
    is, or as a view of it): actsave knows it hands its input on only once it has run."""

    def __init__(self, as_view: bool = False):
        super().__init__()
        self.as_view = as_view

    def forward(self, x):
        self.last_mean = x.detach().mean()
        return x.view(x.shape) if self.as_view else x


def tap_then_in_place_chain(as_views=(False,) * 6):
    torch.manual_seed(0)
    layers = []
    for as_view in as_views:
        layers += [nn.Linear(32, 32), _Tap(as_view), nn.ReLU(inplace=True)]
    return nn.Sequential(*layers, nn.Linear(32, 4))


@pytest.mark.parametrize("segments", ["balanced", 4, [0, 1, 4, 7, 10, 13, 16]], ids=str)
@pytest.mark.parametrize("compress", [None, "int8"])
def test_a_segment_starting_with_a_layer_that_turns_out_to_return_its_input_to_an_in_place_one_trains(
        segments, compress):
    # The balanced plan, an even split of 4 and the list start segments on the taps,
    # whose in-place ReLU would change the segment's input. (An in-place ReLU on a view
    # keeps no decisions under a lossy codec, whoever made the view: views exact only.)
    plain = tap_then_in_place_chain((False, True) * 3 if compress is None else (False,) * 6)
    model = as_checkpointed(plain, segments=segments, compress=compress)
    assert_trains_as_plain(plain, model, compress)
    assert any(isinstance(model[start], _Tap) for start in model._last_call.kept)


def test_a_plan_from_an_activation_that_the_first_layer_changes_in_place_trains_and_leaves_it_as_it_was():
    # The example is an embedding's output (not a leaf), and the chain's first layer
    # changes its input in place: each profiled step runs on a copy of it.
    torch.manual_seed(0)
    embedding = nn.Embedding(100, 16)
    example = embedding(torch.randint(0, 100, (8, 4)))
    values, node = example.detach().clone(), example.grad_fn
    plain = nn.Sequential(nn.ReLU(inplace=True), nn.Linear(16, 16), nn.ReLU(inplace=True), nn.Linear(16, 16))
    model = as_checkpointed(plain, segments="auto", budget=2**30, example_inputs=(example,))
    assert torch.equal(example, values) and example.grad_fn is node
    x = torch.randn(8, 4, 16, requires_grad=True)
    outputs = [net(x * 1) for net in (plain, model)]
    for output in outputs:
        output.square().sum().backward()
    assert torch.equal(*outputs)
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(plain.parameters(), model.parameters()))


def test_autocast_state_is_replayed_in_recompute():
    plain = mixed_chain()
    model = as_checkpointed(plain, segments=4)
    x = torch.randn(8, 16)

    def step(m):
        inp = x.clone().requires_grad_(True)
        torch.manual_seed(1)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = m(inp)
        # Backward outside the autocast block: the recompute must re-enter it.
        out.float().square().sum().backward()
        return out, inp.grad

    (out_a, grad_a), (out_b, grad_b) = step(plain), step(model)
    assert out_b.dtype == torch.bfloat16
    assert torch.equal(out_a, out_b) and torch.equal(grad_a, grad_b)
    for p, q in zip(plain.parameters(), model.parameters()):
        assert torch.equal(p.grad, q.grad)


def test_batchnorm_statistics_are_updated_once():
    plain = mixed_chain()
    model = as_checkpointed(plain, segments=20)
    for _ in range(2):
        batch = torch.randn(8, 16)
        train_step(plain, batch)
        train_step(model, batch)
    for name, buffer in model.named_buffers():
        assert torch.equal(buffer, plain.get_buffer(name)), name
    assert int(model[3].num_batches_tracked) == 2


def test_each_layer_runs_once_forward_and_at_most_once_more_in_backward():
    model = as_checkpointed(mixed_chain(), segments=4)
    counter = CallCounter(model)
    out = model(torch.randn(8, 16, requires_grad=True))
    assert set(counter.counts.values()) == {1} and len(counter.counts) == len(model)
    counter.reset()
    out.sum().backward()
    last = plan_segments(len(model), 4)[-1]
    assert all(count == 1 for count in counter.counts.values())
    assert not any(str(i) in counter.counts for i in range(last.start, last.stop))


def test_autograd_grad_on_parameters_and_inputs():
    plain = mixed_chain()
    model = as_checkpointed(plain, segments="sqrt")
    x = torch.randn(8, 16)

    def grads(m):
        inp = x.clone().requires_grad_(True)
        torch.manual_seed(1)
        loss = m(inp).square().sum()
        return torch.autograd.grad(loss, [inp, *m.parameters()])

    for a, b in zip(grads(plain), grads(model)):
        assert torch.equal(a, b)
    assert all(p.grad is None for p in model.parameters())
    assert actsave.kept_bytes() == {"device": 0, "host": 0}


def test_gradient_accumulation_over_micro_batches():
    plain = mixed_chain()
    model = as_checkpointed(plain, segments=3)
    for seed in range(3):
        batch = torch.randn(8, 16)
        train_step(plain, batch, seed=seed)
        train_step(model, batch, seed=seed)
    for p, q in zip(plain.parameters(), model.parameters()):
        assert torch.equal(p.grad, q.grad)


def test_second_backward_with_retain_graph_is_correct():
    plain = mixed_chain()
    model = as_checkpointed(plain, segments=4)
    x = torch.randn(8, 16)
    for m in (plain, model):
        torch.manual_seed(1)
        loss = m(x).square().sum()
        loss.backward(retain_graph=True)
        loss.backward()
    for p, q in zip(plain.parameters(), model.parameters()):
        assert torch.equal(p.grad, q.grad)


@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode])
def test_nothing_is_kept_or_recomputed_without_grad(mode):
    model = as_checkpointed(mixed_chain(), segments=4).eval()
    counter = CallCounter(model)
    with mode():
        model(torch.randn(8, 16))
        assert actsave.kept_bytes() == {"device": 0, "host": 0}
    assert set(counter.counts.values()) == {1}


def test_kept_bytes_counts_kept_inputs_until_backward():
    model = as_checkpointed(mixed_chain(), segments=4)
    out = model(torch.randn(8, 16, requires_grad=True))
    # Three checkpointed segments, each keeping one 8x16 float32 input and the snapshot
    # of the BatchNorm it runs (two 16-float statistics, an int64 count): NOTE [ State a
    # forward reads and mutates ].
    snapshot = 2 * 16 * 4 + 8
    assert actsave.kept_bytes() == {"device": 3 * (8 * 16 * 4 + snapshot), "host": 0}
    out.sum().backward()
    assert actsave.kept_bytes() == {"device": 0, "host": 0}


def test_kept_bytes_is_zero_when_the_graph_is_dropped_without_backward():
    model = as_checkpointed(mixed_chain(), segments=4)
    out = model(torch.randn(8, 16, requires_grad=True))
    assert actsave.kept_bytes()["device"] > 0
    del out
    assert actsave.kept_bytes() == {"device": 0, "host": 0}


class AlternatingWidth(nn.Module):
    """Keeps 9 then 8 then 9 ... features: the recompute sees another shape."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return x[:, : 8 + self.calls % 2]


class SumFeatures(nn.Module):
    def forward(self, x):
        return x.sum(dim=1, keepdim=True)


def test_nondeterministic_layer_raises_instead_of_wrong_gradients():
    # Tanh saves its output: 9 wide in forward, 8 wide in the recompute.
    model = CheckpointedSequential(nn.Linear(16, 16), AlternatingWidth(), nn.Tanh(), SumFeatures(), segments=[0, 3])
    out = model(torch.randn(4, 16))
    with pytest.raises(RecomputeError, match="not deterministic"):
        out.sum().backward()


# --- peak memory ---------------------------------------------------------------------

def deep_chain():
    torch.manual_seed(0)
    return nn.Sequential(*[m for _ in range(64) for m in (nn.Linear(256, 256), nn.ReLU())])


def runner_peak_bytes(model, run) -> int:
    """MemTracker peak of one training step by ``run(model, x)`` minus parameters and
    their gradients."""
    x = torch.randn(4096, 256)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    static = sum(2 * p.numel() * p.element_size() for p in model.parameters())
    tracker = MemTracker()
    tracker.track_external(model, x)  # the batch counts the same for every runner
    with tracker:
        run(model, x).sum().backward()
    return max(v["Total"] for v in tracker.get_tracker_snapshot("peak").values()) - static


def test_sqrt_segments_cut_peak_activation_memory():
    k = round(math.sqrt(128))
    plain = runner_peak_bytes(deep_chain(), lambda m, x: m(x))
    torch_ckpt = runner_peak_bytes(
        deep_chain(), lambda m, x: checkpoint_sequential(m, k, x, use_reentrant=False))
    ours = runner_peak_bytes(CheckpointedSequential(*deep_chain(), segments="sqrt"), lambda m, x: m(x))
    # Measured: plain 264.3 MiB, checkpoint_sequential 84.3 MiB, actsave 84.3 MiB.
    assert ours <= plain / 3
    assert ours <= 1.05 * torch_ckpt


def test_int_and_sqrt_segments_split_as_checkpoint_sequential():
    assert [(s.start, s.stop) for s in plan_segments(128, 11)][-2:] == [(99, 110), (110, 128)]
    assert plan_segments(128, "sqrt") == plan_segments(128, 11)
    assert [s.checkpointed for s in plan_segments(5, [0, 2])] == [True, False]
    assert [s.start for s in plan_segments(5, [2, 4])] == [0, 2, 4]


def conv_bn_relu(blocks: int = 16, inplace: bool = True) -> list:
    return [m for _ in range(blocks)
            for m in (nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(inplace=inplace))] + [nn.Flatten()]


@pytest.mark.parametrize("inplace", [True, False])
@pytest.mark.parametrize("segments", ["sqrt", 7])
def test_under_a_lossy_codec_an_even_split_starts_on_relu_outputs(segments, inplace):
    layers = conv_bn_relu(inplace=inplace)  # 49 layers: the even split starts at 0, 7, 14, ... 42
    lossy = (KeepPolicy.resolve("fp8_e4m3"),) * len(layers)
    assert split_starts(layers, segments, lossy) == [0, 9, 15, 21, 30, 36, 42]
    assert split_starts(layers, segments, (EXACT,) * len(layers)) == [0, 7, 14, 21, 28, 35, 42]
    assert split_starts(layers, [0, 7, 14], lossy) == [0, 7, 14]  # a list is the caller's
    model = CheckpointedSequential(*layers, segments=segments, compress="int8")
    kept_at = [line.split()[0] for line in model.describe().splitlines() if " input " in line or " saves " in line]
    assert kept_at == ["0", "9", "15", "21", "30", "36", "42"]


def test_a_boundary_moves_only_onto_a_layer_with_its_own_settings():
    layers = conv_bn_relu()
    int8, exact = KeepPolicy.resolve("int8"), EXACT
    policies = (int8,) * 9 + (exact,) * (len(layers) - 9)  # layer 9 onwards exact
    assert split_starts(layers, "sqrt", policies)[:2] == [0, 7]


def test_a_boundary_stays_within_its_segment():
    layers = [nn.Linear(4, 4), nn.BatchNorm1d(4), nn.BatchNorm1d(4), nn.ReLU(), nn.Linear(4, 4)]
    lossy = (KeepPolicy.resolve("int8"),) * len(layers)
    assert split_starts(layers, 2, lossy) == [0, 4]  # past both BatchNorms and the ReLU
    # One layer per segment: a move would empty a segment or pass the next start.
    assert split_starts(layers, 5, lossy) == [0, 1, 2, 3, 4]


def frozen_prefix_chain(**options):
    """8 x Linear(64, 64), the first four frozen (fine-tuning): layer 4's input needs no
    grad and has no grad_fn, yet nothing but the chain holds it."""
    torch.manual_seed(0)
    layers = [nn.Linear(64, 64) for _ in range(8)]
    for layer in layers[:4]:
        layer.requires_grad_(False)
    return CheckpointedSequential(*layers, **options)


@pytest.mark.parametrize("offload", [False, True])
def test_an_input_made_by_a_frozen_prefix_follows_its_codec_and_offload(offload):
    # It is the chain's activation, so it is kept as describe() says: by int8, and on
    # the host under offload (not exactly, 32 x 64 fp32, 8,192 B, on the device).
    model = frozen_prefix_chain(segments=[0, 4, 6], compress={4: "int8"}, offload={4: offload})
    x = torch.randn(32, 64)
    out = model(x)
    expected = codes_and_scales(32 * 64)
    assert actsave.kept_bytes() == ({"device": 0, "host": expected} if offload else {"device": expected, "host": 0})
    row = model.describe().splitlines()[1 + 4].split()
    assert row[4:6] == ["input", "int8"] and row[-1] == str(expected)
    out.sum().backward()
    assert actsave.kept_bytes() == {"device": 0, "host": 0}
    # The planner's profile asks the same question (keep_rules.should_encode).
    prof = actsave.profile(model, (x,))
    assert [layer.input_encodable for layer in prof.layers] == [False] + [True] * 7
    assert prof.layers[4].kept_bytes["int8"] == expected


def test_a_balanced_plan_prices_a_frozen_prefix_input_as_kept():
    # (MemTracker cannot follow frozen parameters; estimate runs the step as it runs,
    # on meta tensors, its bytes counted exactly as on the CPU.)
    model = frozen_prefix_chain(compress="int8")
    peak = actsave.estimate(model, (256, 64)).activation_peak_bytes
    predicted = model.balanced_plan.predicted_peak_bytes
    assert 0.85 * predicted <= peak <= predicted


# --- balanced segments (the default): NOTE [ Balanced segments ] ---------------------


@pytest.mark.parametrize("activation, int8_ratio", [(nn.ReLU, 0.9), (nn.GELU, 0.7)])
def test_balanced_beats_sqrt_and_a_codec_buys_more_shorter_segments(activation, int8_ratio):
    def chain(**options):
        torch.manual_seed(0)
        layers = [m for _ in range(64) for m in (nn.Linear(256, 256), activation())]
        return CheckpointedSequential(*layers, **options)

    x = torch.randn(1024, 256)
    sqrt = peak_activation_bytes(chain(segments="sqrt"), x)
    exact, int8 = chain(), chain(compress="int8")
    peaks = {model: peak_activation_bytes(model, x) for model in (exact, int8)}
    # Measured (MiB; each equal to the plan's prediction): ReLU sqrt 23.25, balanced
    # 16.00 in 10 segments, int8 13.42 in 19 (0.84x: 1 bit per ReLU output is kept
    # too); GELU sqrt 31.25, balanced 20.00 in 15, int8 13.35 in 26 (0.67x).
    assert peaks[exact] <= 0.7 * sqrt
    assert peaks[int8] <= int8_ratio * peaks[exact]
    assert len(int8.balanced_plan.starts) > len(exact.balanced_plan.starts)
    for model, peak in peaks.items():
        assert 0.85 * model.balanced_plan.predicted_peak_bytes <= peak <= model.balanced_plan.predicted_peak_bytes


def test_offload_at_the_default_makes_the_device_peak_flat_in_depth():
    # What the README promises at real scale, on meta tensors for a CUDA device.
    def estimate(depth, **options):
        torch.manual_seed(0)
        layers = [m for _ in range(depth) for m in (nn.Linear(1024, 1024), nn.ReLU())]
        return actsave.estimate(CheckpointedSequential(*layers, **options), (4096, 1024), device="cuda")

    exact = [estimate(depth) for depth in (32, 128)]
    offloaded = [estimate(depth, compress="int8", offload=True) for depth in (32, 128)]
    # Measured (MiB), depth 32 -> 128: exact 208 -> 336 (int8 alone 174 -> 275);
    # int8 + offload 113.25 -> 113.25 on the device, 139 -> 583 on the host.
    assert exact[1].activation_peak_bytes > 1.5 * exact[0].activation_peak_bytes
    assert offloaded[1].activation_peak_bytes <= 1.02 * offloaded[0].activation_peak_bytes
    assert offloaded[1].activation_peak_bytes <= 0.4 * exact[1].activation_peak_bytes
    assert offloaded[1].host_peak_bytes > 3.5 * offloaded[0].host_peak_bytes


def test_balanced_plans_once_per_input():
    model = CheckpointedSequential(*mixed_chain())
    profiles = []
    real_profile = actsave.planning.profiler.profile
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(actsave.planning.profiler, "profile", lambda *a, **k: profiles.append(a[1][0].shape) or real_profile(*a, **k))
        assert "chosen at the first training call" in model.describe()
        for batch in (8, 8, 4, 8):
            model(torch.randn(batch, 16)).sum().backward()
        assert profiles == [(8, 16), (4, 16)]
        model[0].eval()  # BatchNorm-free layer, but a layer's mode is part of the input it plans for
        model(torch.randn(8, 16)).sum().backward()
    assert len(profiles) == 3
    assert model.describe().splitlines()[0].startswith("segments='balanced' for input (8, 16) torch.float32 on cpu")


def test_plans_for_layers_since_replaced_keep_no_module_alive():
    model = CheckpointedSequential(*mixed_chain())
    model(torch.randn(8, 16)).sum().backward()
    replaced = weakref.ref(model[0])
    model[0] = nn.Linear(16, 16)
    model(torch.randn(8, 16)).sum().backward()  # plans anew for the new layers
    gc.collect()
    assert replaced() is None


class ItemLayer(nn.Module):
    """A data-dependent layer: meta tensors have no values to read."""

    def forward(self, x):
        return x * (1.0 if x.sum().item() > 0 else 2.0)


def test_a_chain_the_meta_step_cannot_run_falls_back_to_sqrt_with_one_warning():
    plain = nn.Sequential(*mixed_chain(), ItemLayer())
    model = as_checkpointed(plain)
    with pytest.warns(UserWarning, match=r"'sqrt' split: it could not run its layers on meta tensors \(RuntimeError: .*item"):
        assert_same_training(plain, model, torch.randn(8, 16))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model(torch.randn(4, 16)).sum().backward()  # another shape: no second warning
    assert model.balanced_plan is None and "fell back to 'sqrt'" in model.describe()


class AddPair(nn.Module):
    def forward(self, pair):
        return pair[0] + pair[1]


def test_a_chain_that_takes_no_tensor_falls_back_to_sqrt():
    model = CheckpointedSequential(AddPair(), nn.Linear(4, 4), nn.Tanh())
    x = torch.randn(2, 4, requires_grad=True)
    with pytest.warns(UserWarning, match="its input is a tuple; the planner follows one tensor"):
        model((x, x)).sum().backward()
    assert x.grad is not None and "fell back to 'sqrt' for input tuple" in model.describe()


def test_balanced_plans_inside_an_outer_checkpoint():
    # The plan's meta step runs while the outer checkpoint's saved-tensor hooks are set.
    plain = mixed_chain()
    model = as_checkpointed(plain)
    x = torch.randn(8, 16)
    assert_same_training(plain, actsave.Checkpoint(model), x)
    assert model.balanced_plan is not None


def test_the_last_segment_of_a_balanced_plan_stores_its_saves_exactly():
    model = CheckpointedSequential(*mixed_chain(), compress="int8")
    model(torch.randn(8, 16) * 1).sum().backward()
    last = [line.split() for line in model.describe().splitlines()[2:] if "saves" in line]
    assert len(last) == 1 and last[0][5] == "none"


def test_balanced_runs_each_layer_at_most_once_more_after_its_first_call():
    model = as_checkpointed(mixed_chain())
    # Plans for an input that requires grad: each layer also runs on meta tensors.
    model(torch.randn(8, 16, requires_grad=True)).sum().backward()
    counter = CallCounter(model)
    out = model(torch.randn(8, 16, requires_grad=True))
    assert set(counter.counts.values()) == {1}
    counter.reset()
    out.sum().backward()
    assert set(counter.counts.values()) <= {1}


# --- nn.Sequential compatibility -----------------------------------------------------

def test_behaves_as_the_sequential_it_replaces():
    layers = [nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)]
    plain, model = nn.Sequential(*layers), CheckpointedSequential(*layers)
    assert isinstance(model, nn.Sequential) and len(model) == 3
    assert model[0] is layers[0] and list(model) == layers
    assert list(model.state_dict()) == list(plain.state_dict())
    assert isinstance(model[1:], CheckpointedSequential) and len(model[1:]) == 2
    model.append(nn.Linear(2, 2))
    assert len(model) == 4 and model(torch.randn(3, 4, requires_grad=True)).shape == (3, 2)


def test_ordered_dict_names_and_state_dict_round_trip():
    names = OrderedDict([("fc1", nn.Linear(4, 4)), ("act", nn.ReLU()), ("fc2", nn.Linear(4, 2))])
    plain = nn.Sequential(twin(names))
    model = CheckpointedSequential(twin(names), segments=[0, 2])
    model.load_state_dict(plain.state_dict())
    assert model.fc1 is model[0]
    plain.load_state_dict(model.state_dict())
    for key, value in plain.state_dict().items():
        assert torch.equal(value, model.state_dict()[key])


def test_from_sequential_shares_modules():
    plain = mixed_chain()
    model = CheckpointedSequential.from_sequential(plain, segments=2)
    assert all(a is b for a, b in zip(plain, model))
    assert model.segments == 2


# --- per-layer options follow their module ----------------------


def codecs_by_layer(model) -> list:
    """The codec column of describe(), one entry per layer (segments=[0, 1, ..., n-1])."""
    model.segments = list(range(len(model)))
    return [model._settings.policy(layer).codec.name for layer in model]


def four_linears(compress=None):
    model = CheckpointedSequential(*[nn.Linear(4, 4) for _ in range(4)], segments=[0, 1, 2, 3], compress=compress)
    model.set_compression(3, "int8")
    model.set_offload(1, True)
    return model


def offloads_by_layer(model) -> list:
    return [model._settings.policy(layer).offload for layer in model]


def test_options_follow_their_layer_through_insert_append_and_delete():
    model = four_linears()
    chosen = model[3]
    model.insert(0, nn.Linear(4, 4))
    assert codecs_by_layer(model) == ["none", "none", "none", "none", "int8"]
    assert offloads_by_layer(model) == [False, False, True, False, False]
    model.append(nn.Linear(4, 4))
    del model[0]
    assert codecs_by_layer(model) == ["none", "none", "none", "int8", "none"]
    assert model[3] is chosen
    model[3] = nn.Linear(4, 4)  # a replaced layer takes the defaults
    assert codecs_by_layer(model) == ["none"] * 5 and not model._settings.layers_set("codec")


def test_slices_and_from_sequential_keep_the_options():
    model = four_linears(compress="fp8")
    tail = model[2:]
    assert isinstance(tail, CheckpointedSequential) and tail.segments == "balanced"
    assert codecs_by_layer(tail) == ["fp8_e4m3", "int8"]
    copy = CheckpointedSequential.from_sequential(model)
    assert codecs_by_layer(copy) == ["fp8_e4m3", "fp8_e4m3", "fp8_e4m3", "int8"]
    assert offloads_by_layer(copy) == [False, True, False, False]
    replaced = CheckpointedSequential.from_sequential(model, compress=None)
    assert codecs_by_layer(replaced) == ["none"] * 4 and offloads_by_layer(replaced)[1]


def test_describe_lists_every_layer_with_its_segment_and_kept_bytes():
    model = as_checkpointed(mixed_chain(), segments=4)
    model(torch.randn(8, 16, requires_grad=True)).sum().backward()
    lines = model.describe().splitlines()
    assert lines[0].split() == ["layer", "name", "type", "segment", "keeps", "codec", "where", "kept", "bytes"]
    assert len(lines) == 1 + len(model)
    # The batch is the caller's: kept by reference, none of actsave's bytes but the
    # snapshot of the segment's BatchNorm (NOTE [ State a forward reads and mutates ]).
    snapshot = 2 * 16 * 4 + 8
    assert lines[1].split() == ["0", "0", "Linear", "0", "input", "none", "by", "reference", str(snapshot)]
    second = lines[1 + plan_segments(len(model), 4)[1].start].split()
    assert second[4:7] == ["input", "none", "device"] and int(second[7]) > 0
    last_start = plan_segments(len(model), 4)[-1].start
    # The exact last segment's saves are autograd's own: no bytes of actsave's.
    assert lines[1 + last_start].split()[4:] == ["saves", "none", "device"]


# --- bad input -------------------------------------------------------------------------

@pytest.mark.parametrize("segments", [0, 21, -1, True, "cube", [3, 1], [0, 0, 4], [0, 20], [], [0.5], "auto"])
def test_bad_segments_name_the_argument_and_allowed_values(segments):
    with pytest.raises(ConfigError, match="segments="):
        CheckpointedSequential(*mixed_chain(), segments=segments)


@pytest.mark.parametrize("codec", ["int4", "fp16", 8])
def test_unknown_codec_lists_the_valid_ones(codec):
    with pytest.raises(ConfigError, match=r"compress=.*use one of \[None, 'none'"):
        CheckpointedSequential(nn.Linear(2, 2), compress=codec)


def test_non_module_layer_is_refused():
    with pytest.raises(ConfigError, match="layer 1 is .* not an nn.Module"):
        CheckpointedSequential(nn.Linear(2, 2), torch.relu)


@pytest.mark.parametrize("container", [nn.Sequential, nn.ModuleList, CheckpointedSequential])
def test_one_container_is_refused_rather_than_run_as_one_layer_that_saves_nothing(container):
    # CheckpointedSequential(seq) would be one layer whose only segment is never
    # checkpointed (estimate() equal to plain's): it is refused, saying so.
    layers = list(mixed_chain())

    def made():
        return nn.ModuleList(layers) if container is nn.ModuleList else container(*layers)

    with pytest.raises(ConfigError, match=r"one .* as its only layer.*no memory would be saved.*"
                                          r"CheckpointedSequential\(\*"):
        CheckpointedSequential(made())
    if container is not nn.ModuleList:
        with pytest.raises(ConfigError, match=r"from_sequential\(seq\)"):
            CheckpointedSequential(made())
    # Its layers, or a container among other layers, are a chain as before.
    assert len(CheckpointedSequential(*layers)) == len(layers)
    assert len(CheckpointedSequential(made(), nn.Identity())) == 2


def test_per_layer_options_name_existing_layers():
    model = CheckpointedSequential(nn.Linear(2, 2), nn.ReLU(), compress={0: None, "1": "none"})
    model.set_compression(slice(0, 2), None)
    model.set_offload("0", False)
    with pytest.raises(ConfigError, match="layer 'fc' is not in this CheckpointedSequential"):
        model.set_compression("fc", None)
    with pytest.raises(ConfigError, match="layer 5 is not"):
        CheckpointedSequential(nn.Linear(2, 2), compress={5: None})


# --- property: exactness over random chains ------------------------------------------

LAYER_KINDS = {
    "linear": lambda w: nn.Linear(w, w),
    "relu": lambda w: nn.ReLU(),
    "relu_": lambda w: nn.ReLU(inplace=True),
    "gelu": lambda w: nn.GELU(),
    "tanh": lambda w: nn.Tanh(),
    "dropout": lambda w: nn.Dropout(0.2),
    "batchnorm": lambda w: nn.BatchNorm1d(w),
    "layernorm": lambda w: nn.LayerNorm(w),
}


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    kinds=st.lists(st.sampled_from(sorted(LAYER_KINDS)), min_size=1, max_size=12),
    data=st.data(),
)
def test_random_chains_train_bit_identically(kinds, data):
    torch.manual_seed(0)
    kinds = ["linear", *kinds]  # a leaf input may not go into an in-place layer, as in plain torch
    plain = nn.Sequential(*[LAYER_KINDS[k](6) for k in kinds]).double()
    n = len(plain)
    segments = data.draw(st.one_of(
        st.integers(1, n), st.just("sqrt"),
        st.lists(st.integers(0, n - 1), min_size=1, unique=True).map(sorted)))
    model = as_checkpointed(plain, segments=segments)
    x = torch.randn(5, 6, dtype=torch.float64)
    try:
        train_step(twin(plain), x)
    except RuntimeError:
        # Plain torch refuses an in-place layer after one that saved its output. actsave
        # may recompute that output instead; then it must train as the out-of-place
        # chain does (same numbers), or refuse too: never anything else.
        plain = out_of_place(plain)
        try:
            train_step(twin(model), x)
        except RuntimeError as error:
            assert "modified by an inplace operation" in str(error)
            return
    assert_same_training(plain, model, x)


def out_of_place(model):
    model = twin(model)
    for module in model.modules():
        if getattr(module, "inplace", False):
            module.inplace = False
    return model


def test_describe_and_the_balanced_plan_say_what_each_segment_keeps_in_the_same_words():
    # The batch, which the caller holds and actsave keeps by reference, is not shown as
    # kept by a codec or on the host, and the balanced plan and describe() name the
    # same place for each input.
    torch.manual_seed(0)
    model = CheckpointedSequential(*[m for _ in range(6) for m in (nn.Linear(64, 64), nn.ReLU())],
                                   compress="int8", offload=True)
    model(torch.randn(32, 64)).sum().backward()
    lines = model.describe().splitlines()
    assert lines[1].split()[4:] == ["keeps", "codec", "where", "kept", "bytes"]
    kept = {int(row[0]): row[4:] for row in map(str.split, lines[2:]) if len(row) > 4}
    assert kept[0] == ["input", "none", "by", "reference", "0"]
    plan_rows = [row.split() for row in model.balanced_plan.table(every_segment=True).splitlines()[2:]]
    by_start = {int(row[1].split("-")[0]): row[2:5] for row in plan_rows}  # keeps, codec, where
    assert len(by_start) > 2 and by_start.pop(0) == ["input", "none", "device"]
    assert all(kept[start][:3] == row for start, row in by_start.items()), (kept, by_start)
    assert {tuple(row) for row in by_start.values()} == {("input", "int8", "host"), ("saves", "none", "device")}


def repeated_block_chain():
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(16, 16), nn.BatchNorm1d(16), nn.ReLU())
    return [*[block] * 6, nn.Linear(16, 4)]


def test_a_chain_that_repeats_a_block_gets_a_balanced_plan_and_nn_sequentials_training():
    plain, model = nn.Sequential(*repeated_block_chain()), CheckpointedSequential(*repeated_block_chain())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback to "sqrt"
        for _ in range(2):
            assert_same_training(plain, model, torch.randn(8, 16))
    assert model.balanced_plan is not None and model.balanced_plan.n_layers == 7
    assert model[0][1].num_batches_tracked.item() == plain[0][1].num_batches_tracked.item() == 2 * 6


def test_from_sequential_keeps_every_position_of_a_repeated_block():
    seq = nn.Sequential(*repeated_block_chain())
    model = CheckpointedSequential.from_sequential(seq)
    assert len(model) == 7 and list(model.state_dict()) == list(seq.state_dict())


def test_describe_shows_no_negative_bytes_for_a_first_segment_that_saves_nothing():
    # Its layer needs no gradient (a weight held as a buffer, an input that needs none):
    # the checkpoint keeps nothing, the batch by reference included.
    class FrozenLinear(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("weight", torch.randn(64, 64))

        def forward(self, x):
            return torch.nn.functional.linear(x, self.weight)

    model = CheckpointedSequential(FrozenLinear(), nn.GELU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64))
    x = torch.randn(50, 64)
    model.apply_plan(actsave.planning.plans.predict(actsave.profile(model, (x,)), [0, 1, 3]))
    model(x).sum().backward()
    (first,) = [row.split() for row in model.describe().splitlines() if "FrozenLinear" in row]
    assert first[4:] == ["input", "none", "by", "reference", "0"]


def test_a_codec_set_after_a_plan_nested_its_segment_applies_and_the_segment_recomputes_in_one_stage():
    # A nested recompute keeps its inputs exactly on the device, so the setting wins
    # over the nesting: the segment runs as a one-stage segment with that codec would,
    # and describe() says so.
    from actsave.runtime.nested import Range

    torch.manual_seed(0)
    layers = [m for _ in range(4) for m in (nn.Linear(16, 16), nn.GELU())] + [nn.Linear(16, 16)]
    nested = CheckpointedSequential(*twin(nn.Sequential(*layers)))
    nested.apply_plan(actsave.Plan(n_layers=9, starts=(0, 2, 8), codecs=("none", "none"), offload=(False, False),
                                   predicted_peak_bytes=0, predicted_step_seconds=0.0, peak_segment=0,
                                   nested=(None, Range(0, 6, inner=(Range(0, 3), Range(3, 6, recomputed=False))))))
    one_stage = CheckpointedSequential(*twin(nn.Sequential(*layers)), segments=[0, 2, 8])
    x = torch.randn(8, 16)
    for model in (nested, one_stage):
        model.set_compression(2, "int8")
        model(x).square().sum().backward()
    assert nested._last_call.kept == one_stage._last_call.kept
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(nested.parameters(), one_stage.parameters()))
    (row,) = [row.split() for row in nested.describe().splitlines() if row.split()[:1] == ["2"]]
    assert row[4:7] == ["input", "int8", "device"]


def test_a_codec_set_on_layers_where_no_segment_starts_warns_once_that_it_is_unused():
    torch.manual_seed(0)
    layers = [m for _ in range(4) for m in (nn.Linear(8, 8), nn.Tanh())]
    model = CheckpointedSequential(*layers, segments=[0, 4], compress={2: "int8"})
    x = torch.randn(4, 8)
    with pytest.warns(UserWarning, match=r"set on layers \[2\] is not used"):
        model(x).sum().backward()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model(x).sum().backward()  # once
        CheckpointedSequential(*layers, segments=[0, 2], compress={2: "int8"})(x).sum().backward()
        # A plan chooses its starts with the settings; undoing the default costs nothing unused.
        CheckpointedSequential(*layers, compress={2: "int8"})(x).sum().backward()
        undone = CheckpointedSequential(*layers, segments=[0, 4], compress="int8")
        undone.set_compression(2, None)
        undone(x).sum().backward()


def test_layers_set_alike_apart_are_settings_of_their_own_and_one_unused_warns():
    torch.manual_seed(0)
    layers = [nn.Linear(8, 8) for _ in range(9)]
    x = torch.randn(4, 8)
    apart = CheckpointedSequential(*layers, segments=3)  # starts 0, 3, 6
    apart.set_compression(1, "int8")
    apart.set_compression(3, "int8")  # used: a segment starts there; layer 1's is not
    with pytest.warns(UserWarning, match=r"codec set on layers \[1\] is not used"):
        apart(x).sum().backward()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sliced = CheckpointedSequential(*layers, segments=3)
        sliced.set_compression(slice(1, 5), "int8")  # one setting, used where layer 3 starts a segment
        sliced(x).sum().backward()



def test_a_module_placed_twice_has_one_setting_used_where_a_segment_starts_at_either_place():
    torch.manual_seed(0)
    layers = [module for _ in range(6) for module in (nn.Linear(16, 16), nn.ReLU())]
    layers[8] = layers[2]
    x = torch.randn(4, 16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for place in (8, 2):  # the module's setting, used at 8
            model = CheckpointedSequential(*layers, segments=[0, 4, 8])
            model.set_compression(place, "int8")
            model(x).sum().backward()
    unused = CheckpointedSequential(*layers, segments=[0, 4, 6])
    unused.set_compression(2, "int8")
    with pytest.warns(UserWarning, match=r"codec set on layers \[2, 8\] is not used"):
        unused(x).sum().backward()

def test_a_setting_made_after_a_plan_where_none_of_its_segments_starts_warns_that_it_is_unused():
    # The plan's starts stay where it put them: a codec set elsewhere, or an offload set
    # where it runs a segment plainly, changes nothing.
    torch.manual_seed(0)
    layers = [nn.Linear(8, 8) for _ in range(9)]
    x = torch.randn(4, 8)
    model = CheckpointedSequential(*layers)
    profile = actsave.profile(model, (x,))
    plan = actsave.planning.plans.predict(profile, [0, 3, 6], plain=(True, False))
    model.apply_plan(plan)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model(x).sum().backward()  # the plan's own settings
        model.set_compression(3, "int8")  # where a segment starts: used
        model(x).sum().backward()
    model.set_compression(1, "int8")
    with pytest.warns(UserWarning, match=r"codec set on layers \[1\] is not used.*plan again"):
        model(x).sum().backward()
    model.set_offload(0, True)  # the plan runs the segment at 0 plainly
    with pytest.warns(UserWarning, match=r"offload set on layers \[0\] is not used.*plainly"):
        model(x).sum().backward()


def test_an_offload_set_where_only_the_last_segment_starts_warns_that_it_is_unused():
    # The last segment runs plainly: its saves stay on the device, whatever its first layer sets.
    torch.manual_seed(0)
    layers = [nn.Linear(8, 8) for _ in range(9)]
    model = CheckpointedSequential(*layers, segments=3)
    model.set_offload(6, True)
    with pytest.warns(UserWarning, match=r"offload set on layers \[6\] is not used"):
        model(torch.randn(4, 8)).sum().backward()
