"""profile(): what one measured step records per layer, on real and meta tensors, and
how a profile prints."""
import dataclasses

import pytest
import torch
from planning.chains import Residual, max_pool_chain
from support import deep_mlp, mixed_chain
from torch import nn

import actsave
from actsave import CheckpointedSequential, ConfigError
from actsave.planning import plans, profiler


def test_a_meta_profile_measures_the_bytes_of_a_real_step():
    model = CheckpointedSequential(*mixed_chain(width=32))
    x = torch.randn(64, 32, requires_grad=True) * 1  # an activation, as inside a network
    real = actsave.profile(model, (x,))
    meta = actsave.profile(model, (torch.empty(64, 32, device="meta").requires_grad_().clone(),))
    untimed = [f.name for f in dataclasses.fields(profiler.LayerProfile) if f.name.endswith("_s")]
    assert [dataclasses.replace(layer, **{f: None for f in untimed}) for layer in real.layers] == \
           [dataclasses.replace(layer, **{f: None for f in untimed}) for layer in meta.layers]
    assert (real.saved, real.input_bytes, real.output_bytes) == (meta.saved, meta.input_bytes, meta.output_bytes)
    assert all(layer.forward_s == 0 == layer.encode_s["int8"] for layer in meta.layers) and not meta.timed
    with pytest.raises(ConfigError, match="measured on meta tensors and has no times"):
        actsave.plan(meta, 2**30)
    assert actsave.plan(meta, None, objective="memory").predicted_peak_bytes > 0


def test_profile_measures_saved_storages_once_and_leaves_no_trace():
    model = CheckpointedSequential(*mixed_chain(width=32))
    for p in model.parameters():
        p.grad = torch.full_like(p, 3.0)
    buffers = [b.clone() for b in model.buffers()]
    x = torch.randn(16, 32)
    prof = actsave.profile(model, (x,))
    assert all(torch.equal(p.grad, torch.full_like(p, 3.0)) for p in model.parameters())
    assert all(torch.equal(a, b) for a, b in zip(buffers, model.buffers()))
    # Linear saves its input, the in-place ReLU its output: the same storage, once.
    relu = prof.layers[1]
    assert relu.input_saved_by == (1, 1) and relu.saved_bytes == 16 * 32 * 4
    assert prof.layers[0].saved_bytes == 0  # its input is the batch, held anyway
    assert relu.modifies_input and relu.relu_sign_bytes == 16 * 32 // 8


class _ClipsItsWeight(nn.Linear):
    def forward(self, x):
        with torch.no_grad():
            self.weight.clamp_(-0.1, 0.1)  # a forward that changes its own parameter
        return super().forward(x)


def test_profile_puts_back_the_rows_an_embedding_renormalizes_and_names_other_changed_parameters():
    torch.manual_seed(0)
    model = CheckpointedSequential(nn.Embedding(50, 32, max_norm=1.0), nn.Linear(32, 32), nn.Tanh())
    weight = model[0].weight.detach().clone()
    actsave.profile(model, (torch.arange(20).view(4, 5),))  # renormalizes rows 0 to 19
    assert torch.equal(model[0].weight, weight)
    clipping = CheckpointedSequential(nn.Linear(8, 8), _ClipsItsWeight(8, 8), nn.Tanh())
    with pytest.warns(UserWarning, match=r"changed parameter\(s\) \['1.weight'\] in place"):
        actsave.profile(clipping, (torch.randn(4, 8),))


def test_profile_measures_each_layers_rise_with_grad_and_under_no_grad():
    # A residual block, x + Linear(ReLU(Linear(x))): with grad the ReLU's output is saved
    # (for the ReLU and the second Linear) and the block peaks at three activations of
    # 8 x 64 floats; under no_grad each is freed once the next op has it: two.
    block, x = Residual(64), torch.randn(8, 64, requires_grad=True) * 1
    prof = actsave.profile(nn.Sequential(block, nn.Linear(64, 4)), (x,))
    activation = 8 * 64 * 4
    assert (prof.layers[0].forward_rise, prof.layers[0].no_grad_rise) == (3 * activation, 2 * activation)
    # A layer that saves nothing beyond its output rises the same either way.
    assert prof.layers[1].no_grad_rise == prof.layers[1].forward_rise == 8 * 4 * 4


def test_profile_counts_the_max_pool_decisions_a_lossy_segment_keeps():
    layers, x = max_pool_chain(pools=2)
    prof = actsave.profile(CheckpointedSequential(*layers), (x,))
    pools = [i for i, layer in enumerate(layers) if isinstance(layer, nn.MaxPool2d)]
    for i, layer in enumerate(prof.layers):
        # 3x3 windows, 4 bits each, one per output: 8 x 16 planes of 16 x 16.
        assert layer.pool_decision_bytes == (8 * 16 * 16 * 16 * 4 // 8 if i in pools else 0)
        assert (layer.pool_restore_bytes > 0) == (i in pools)


def test_the_losss_saves_and_rise_are_the_losss_not_the_last_layers():
    model = nn.Sequential(*deep_mlp(3, 32), nn.Linear(32, 256))
    x, targets = torch.randn(16, 32), torch.randint(0, 256, (16,))
    plain = actsave.profile(model, (x,))
    with_loss = actsave.profile(model, (x,), loss=lambda logits: nn.functional.cross_entropy(logits, targets))
    untimed = [f.name for f in dataclasses.fields(profiler.LayerProfile) if f.name.endswith("_s")]
    assert [dataclasses.replace(layer, **{f: None for f in untimed}) for layer in plain.layers] == \
           [dataclasses.replace(layer, **{f: None for f in untimed}) for layer in with_loss.layers]
    logits = 16 * 256 * 4
    # Cross-entropy's log-softmax and, in its backward, two more logits-sized tensors
    # (and a few scalars: the loss, its gradient, the reduction's).
    assert plain.loss_rise == logits and 3 * logits <= with_loss.loss_rise < 3 * logits + 1024
    with pytest.raises(ConfigError, match=r"loss\(output\) gave a tensor of shape \(\) that needs no grad: it must "
                                          "return a one-element tensor"):
        actsave.profile(model, (x,), loss=lambda logits: logits.detach().sum())
    # The same rule as actsave.estimate's: a training loss is one value.
    with pytest.raises(ConfigError, match=r"loss\(output\) gave a tensor of shape \(16, 256\): it must return"):
        actsave.profile(model, (x,), loss=lambda logits: logits * 2)


def test_a_profile_without_stored_saves_plans_the_stored_segment_exact():
    model = nn.Sequential(*deep_mlp(8, 64))
    x = torch.randn(128, 64)
    prof = actsave.profile(model, (x,), stored_saves=False)
    assert prof.stored_saves is None and actsave.profile(model, (x,)).stored_saves is not None
    # One-layer segments: with its saves recorded, the smallest plan stores them by int8.
    smallest = actsave.plan(prof, None, objective="memory", max_checkpointed_layers=1, allow=("recompute", "int8"))
    assert set(smallest.saves_codecs) <= {None, "none"}
    with pytest.raises(ConfigError, match="records no saves of a plain segment"):
        plans.predict(prof, [0], saves_codec="int8")
    with pytest.raises(ConfigError, match="records no saves of a plain segment"):
        plans.predict(prof, [0, 4], ["int8"], plain=[True])


def test_profile_and_plan_print_as_tables():
    prof = actsave.profile(nn.Sequential(*deep_mlp(4)), (torch.randn(32, 64),))
    lines = str(prof).splitlines()
    assert lines[0].split()[:5] == ["layer", "name", "type", "out", "MiB"] and len(lines) == 1 + 8 + 1
    plan = actsave.plan(prof, None, objective="memory")
    text = str(plan)
    rows = [line.split() for line in text.splitlines()[1:]]
    assert "predicted peak activation memory" in text and rows[0] == ["segment", "layers", "keeps", "codec", "where"]
    assert rows[-1][2:] == ["saves", "none", "device"] and "<- peak" in text  # the last segment, plain


# --- the runtime and the profile on one rule ------------------------------------------

from actsave.planning.memory_model import effective_option  # noqa: E402
from actsave.runtime.keep_rules import CallerTensors, KeepPolicy, should_encode  # noqa: E402
from actsave.runtime.store import _KeptTensor  # noqa: E402


class _WeightView(nn.Module):
    """Returns a view of its own parameter: the caller's tensor, as a layer input."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(8, 8))

    def forward(self, x):
        return self.weight.t()


class _ToIndex(nn.Module):
    def forward(self, x):
        return x.argmax(-1)


def test_the_runtime_and_the_profile_keep_the_same_inputs_by_reference():
    # NOTE [ Inputs kept by reference ]: a leaf batch, a frozen prefix's activation, a
    # parameter's view, an int tensor and an activation, asked of should_encode as the
    # runtime asks it (a chain's later inputs made by its layers) and of the profile.
    torch.manual_seed(0)
    frozen = nn.Linear(8, 8).requires_grad_(False)
    model = nn.Sequential(frozen, nn.ReLU(), nn.Linear(8, 8), _WeightView(), nn.Linear(8, 8), _ToIndex(),
                          nn.Embedding(8, 8), nn.ReLU())
    x = torch.randn(4, 8)
    inputs = []
    hooks = [layer.register_forward_pre_hook(lambda _, args: inputs.append(args[0])) for layer in model]
    model(x)
    for hook in hooks:
        hook.remove()
    caller = CallerTensors(x, model)
    runtime = [should_encode(t, caller if i > 0 else None) for i, t in enumerate(inputs)]
    assert runtime == [False, True, True, True, False, True, False, True]
    layers = actsave.profile(model, x).layers
    assert [layer.input_encodable for layer in layers] == runtime
    int8 = KeepPolicy.resolve("int8")
    kept = [_KeptTensor(t, int8, False, caller if i > 0 else None).codec.name for i, t in enumerate(inputs)]
    assert kept == [effective_option(int8, layer, "cpu").codec.name for layer in layers]


@pytest.mark.parametrize("segments", [3, 7])
@pytest.mark.parametrize("inplace", [False, True])
def test_the_runtime_and_the_profile_keep_the_same_relu_decisions(monkeypatch, inplace, segments):
    # NOTE [ ReLU outputs that keep decisions ]: under int8 each ReLU output keeps its
    # bits once, in the segment that made it, in the runtime as in the profile; an
    # in-place ReLU may start a segment (segments=7).
    from actsave.runtime import relu_signs

    def chain():
        torch.manual_seed(0)
        return [nn.Linear(8, 16), nn.ReLU(inplace), nn.Linear(16, 12), nn.ReLU(inplace), nn.Linear(12, 10),
                nn.ReLU(inplace), nn.Linear(10, 6)]

    x = torch.randn(4, 8, requires_grad=True) * 1  # an activation: the first segment is int8 too
    layers = actsave.profile(nn.Sequential(*chain()), x).layers
    picked = [i for i, layer in enumerate(layers) if layer.relu_sign_bytes > 0]
    assert picked == [1, 3, 5]
    packed, pack_signs = [], relu_signs.pack_signs
    monkeypatch.setattr(relu_signs, "pack_signs", lambda t: packed.append(tuple(t.shape)) or pack_signs(t))
    # A segment's last ReLU output, which the next keeps by int8, is encoded with its
    # decisions (NOTE [ Decisions at a boundary ]).
    codec_type = type(actsave.codecs.get_codec("int8"))
    encode_with_signs = codec_type.encode_with_signs
    monkeypatch.setattr(codec_type, "encode_with_signs",
                        lambda codec, t: packed.append(tuple(t.shape)) or encode_with_signs(codec, t))
    model = CheckpointedSequential(*chain(), segments=segments, compress="int8")
    out = model(x)
    assert packed == [(4, 16), (4, 12), (4, 10)]
    out.sum().backward()


class GatheredLinear(nn.Module):
    """A linear layer whose weight lives, as under FSDP2, in a storage filled before
    its forward and emptied in place after it (``resize_``), and filled again before
    its backward needs the saved weight."""

    def __init__(self, width: int, frees_after_forward: bool):
        super().__init__()
        torch.manual_seed(0)
        self.values = torch.randn(width, width)
        self.gathered = torch.empty(0)
        self.frees_after_forward = frees_after_forward

    def _fill(self):
        self.gathered.untyped_storage().resize_(self.values.numel() * self.values.element_size())
        self.gathered.set_(self.gathered.untyped_storage(), 0, self.values.shape)
        self.gathered.copy_(self.values)

    def forward(self, x):
        self._fill()
        weight = self.gathered.requires_grad_(False)
        y = x @ weight
        if self.frees_after_forward and y.requires_grad:
            self.gathered.untyped_storage().resize_(0)
            y.register_hook(lambda grad: self._fill())  # gathered again for the backward
        return y


def test_a_saved_storage_emptied_in_place_after_its_forward_is_not_held_to_the_backward():
    """FSDP2 frees a unit's gathered parameters after the forward that saved them
    (NOTE [ Storage resizes ]); counted as held, they made block plans of sharded
    models far too conservative (docs/limits.md, "FSDP2 and DDP")."""
    x = torch.randn(16, 64, requires_grad=True)
    saved = {}
    for frees in (False, True):
        chain = nn.Sequential(*[GatheredLinear(64, frees) for _ in range(3)])
        saved[frees] = [layer.saved_bytes for layer in actsave.profile(chain, (x,)).layers]
    weight = 64 * 64 * 4
    assert [b - a for a, b in zip(saved[True], saved[False])] == [weight] * 3


def test_a_module_placed_twice_is_profiled_at_each_position_and_plans_do_not_nest_it():
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(32, 32), nn.BatchNorm1d(32), nn.ReLU())
    chain = nn.Sequential(*[block] * 8, nn.Linear(32, 2))
    prof = actsave.profile(chain, (torch.randn(16, 32),))
    assert len(prof.layers) == 9 and prof.repeats_modules
    # Each occurrence keeps its own snapshot of the BatchNorm's statistics.
    assert all(layer.mutated_state_bytes == 2 * 32 * 4 + 8 for layer in prof.layers[:8])
    plan = actsave.plan(prof, actsave.plan(prof, None, objective="memory").predicted_peak_bytes)
    assert all(r is None for r in plan.nested)


def test_the_profile_measures_the_snapshot_of_mutated_state_and_leaves_every_buffer_as_it_was():
    torch.manual_seed(0)
    chain = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 8),
                          nn.BatchNorm1d(8).eval(), nn.Tanh())
    before = {name: b.clone() for name, b in chain.named_buffers()}
    prof = actsave.profile(chain, (torch.randn(4, 8),))
    assert [layer.mutated_state_bytes for layer in prof.layers] == [0, 2 * 8 * 4 + 8, 0, 0, 0, 0]
    for name, b in chain.named_buffers():
        assert torch.equal(b, before[name]), name


class _Doubles(nn.Module):
    """Changes its input in place, and says so."""

    inplace = True

    def forward(self, x):
        return x.mul_(2)


class _Records(nn.Module):
    """Notes every input it gets, in a list the test holds: the module's own lists are
    put back as the profile ends (NOTE [ Module state a step puts back ])."""

    def __init__(self, seen: list):
        super().__init__()
        self.note = seen.append

    def forward(self, x):
        self.note(x.detach().clone())
        return x


@pytest.mark.parametrize("activation", [True, False], ids=["activation", "batch"])
def test_each_profiled_step_starts_from_the_example_which_a_first_layer_changing_its_input_leaves_as_it_was(
        activation):
    # NOTE [ Each step on its own input ]: an activation's (a non-leaf's) in-place node
    # is not stacked step on step, and no step starts from the doubling of the last.
    torch.manual_seed(0)
    example = torch.randn(4, 8, requires_grad=True) * 1 if activation else torch.randn(4, 8)
    values = example.detach().clone()
    seen = []
    actsave.profile(nn.Sequential(_Doubles(), _Records(seen), nn.Linear(8, 8)), (example,))
    assert torch.equal(example, values)
    assert len(seen) > 3 and all(torch.equal(got, 2 * values) for got in seen)


def test_profile_leaves_the_gradient_of_a_leaf_example_as_it_was():
    x = torch.randn(4, 8, requires_grad=True)
    actsave.profile(nn.Sequential(nn.Linear(8, 8), nn.Tanh()), (x,))
    assert x.grad is None


class _Tap(nn.Module):
    """A layer of the user's own that returns its input (or a view of it)."""

    def __init__(self, as_view: bool = False):
        super().__init__()
        self.as_view = as_view

    def forward(self, x):
        return x.view(x.shape) if self.as_view else x


def test_a_layer_the_step_sees_hand_its_input_to_an_in_place_one_is_profiled_as_changing_it():
    # NOTE [ A layer that turns out to pass its input on ]: a segment starting there
    # holds a copy of its input beside it, as a private copy would be held.
    layers = [nn.Linear(8, 8), _Tap(), nn.ReLU(inplace=True), nn.Linear(8, 8), nn.Identity(), _Tap(as_view=True),
              nn.ReLU(inplace=True), nn.Linear(8, 8), _Tap(), nn.Tanh()]
    for x in (torch.randn(4, 8), torch.empty(4, 8, device="meta")):
        prof = actsave.profile(nn.Sequential(*layers), (x,))
        assert [layer.modifies_input for layer in prof.layers] == [False, True, True, False, True, True, True,
                                                                   False, False, False]


class _ResidualInPlace(nn.Module):
    """A block that starts by changing its input (its hidden state) in place, and says so."""

    inplace = True

    def __init__(self, width: int):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x):
        x = torch.relu_(x)
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(x)))


class _Stack(nn.Module):
    def __init__(self, width: int = 16):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(width, width)
        self.blocks = nn.ModuleList(_ResidualInPlace(width) for _ in range(3))

    def forward(self, x):
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return h.square().mean()


def test_a_block_plan_whose_first_block_changes_its_hidden_state_in_place_trains_as_plain():
    # The block plan profiles the blocks from the first one's recorded input, an
    # activation the first block changes in place.
    x = torch.randn(4, 6, 16)
    plain, wrapped = _Stack(), actsave.wrap(_Stack(), _ResidualInPlace, budget=2**30, example_inputs=(x,))
    for model in (plain, wrapped):
        model(x).backward()
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(plain.parameters(), wrapped.parameters()))
