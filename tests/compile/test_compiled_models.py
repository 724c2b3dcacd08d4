"""A compiled model that contains actsave: one graph with torch's checkpoints, eager at one
break where it keeps on the host or keeps decisions, failures that leave no hooks set."""
import copy
import gc
import warnings
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import actsave
from actsave import _torch
from actsave.planning import plans
from actsave.runtime import compiled_calls, graph_codecs
from actsave.runtime.nested import Range
from support import ResidualBlock, ResidualNet
from compile.steps import (
    BACKEND, activation_bytes_saved, chain, checkpoints_in, compiled_for_counting, compiles_counted, dropout_free_chain,
    gelu_chain, grads_of_a_step, hugging_face_llama, relu_chain
)



@pytest.mark.parametrize("segments", ["balanced", 4])
def test_a_compiled_checkpointed_sequential_is_one_graph_that_recomputes_its_segments(segments):
    eager = actsave.CheckpointedSequential(*dropout_free_chain(), segments=segments)
    model, graphs = compiled_for_counting(actsave.CheckpointedSequential(*dropout_free_chain(), segments=segments))
    counters = torch._dynamo.utils.counters
    counters.clear()
    for _ in range(3):
        x = torch.randn(16, 32)
        got, expected = grads_of_a_step(model, x), grads_of_a_step(eager, x)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
        for m in (model, eager):
            m.zero_grad(set_to_none=True)
    # One break, where the segments are looked up; one graph; a checkpoint per
    # checkpointed segment of the same plan.
    assert (sum(counters["graph_break"].values()), len(graphs)) == (1, 1)
    starts = eager.balanced_plan.starts if segments == "balanced" else (0, 4, 8, 12)
    assert checkpoints_in(graphs) == len(starts) - 1 >= 2
    plain = torch.compile(nn.Sequential(*dropout_free_chain()), backend=BACKEND)
    x = torch.randn(16, 32)
    assert activation_bytes_saved(model, x) < activation_bytes_saved(plain, x) / 2


def test_compiled_wrapped_blocks_are_one_graph_with_a_checkpoint_each():
    plain, x = ResidualNet(depth=4), torch.randn(4, 8)
    eager = actsave.wrap(copy.deepcopy(plain), ResidualBlock)
    model, graphs = compiled_for_counting(actsave.wrap(copy.deepcopy(plain), ResidualBlock))
    counters = torch._dynamo.utils.counters
    counters.clear()
    for seed in (1, 2, 3):  # Dropout: the checkpoint replays the forward's RNG in the graph
        torch.testing.assert_close(grads_of_a_step(model, x, seed), grads_of_a_step(eager, x, seed))
        for m in (model, eager):
            m.zero_grad(set_to_none=True)
    assert (sum(counters["graph_break"].values()), len(graphs), checkpoints_in(graphs)) == (0, 1, 4)


def test_a_compiled_hugging_face_llama_with_exact_wrapped_blocks_is_one_graph_with_a_checkpoint_each():
    # Its decoder layers take keyword arguments (mask, rotary embeddings) and its mask
    # code reads a value unless the tensor is fake: neither breaks the graph.
    plain, LlamaDecoderLayer, Logits = hugging_face_llama()
    eager = Logits(actsave.wrap(copy.deepcopy(plain), LlamaDecoderLayer))
    model, graphs = compiled_for_counting(Logits(actsave.wrap(copy.deepcopy(plain), LlamaDecoderLayer)))
    counters = torch._dynamo.utils.counters
    counters.clear()
    ids = torch.randint(1, 64, (2, 16))
    for _ in range(2):
        torch.testing.assert_close(grads_of_a_step(model, ids), grads_of_a_step(eager, ids))
        for m in (model, eager):
            m.zero_grad(set_to_none=True)
    assert (sum(counters["graph_break"].values()), len(graphs), checkpoints_in(graphs)) == (0, 1, 2)


@pytest.mark.parametrize("layers, options", [(chain, {"offload": True}), (relu_chain, {"compress": "int8"}),
                                             (relu_chain, {"compress": "int8", "segments": "balanced"})],
                         ids=["offload", "int8 with ReLU decisions", "int8 with ReLU decisions, balanced"])
def test_a_compiled_checkpointed_sequential_that_keeps_on_the_host_or_keeps_decisions_runs_eagerly_at_one_break(
        monkeypatch, layers, options):
    """Its forward runs eagerly at the one break where the segments are looked up, as
    without torch.compile: the same gradients, the same kept bytes, one warning, no
    recompile; not a break at each segment (N segments were N + 1 breaks before)."""
    monkeypatch.setattr(compiled_calls, "_warned_eager_under_compile", False)  # once per process
    options = {"segments": 3, **options}
    x = torch.randn(4, 8)
    eager = actsave.CheckpointedSequential(*layers(), **options)
    model, graphs = compiled_for_counting(actsave.CheckpointedSequential(*layers(), **options))
    counters = torch._dynamo.utils.counters
    counters.clear()
    compiles_after = []
    with warnings.catch_warnings(record=True) as raised, compiles_counted() as compiles:
        warnings.simplefilter("always")
        for seed in (1, 2, 3):
            torch.testing.assert_close(grads_of_a_step(model, x, seed), grads_of_a_step(eager, x, seed))
            for m in (model, eager):
                m.zero_grad(set_to_none=True)
            compiles_after.append(len(compiles))
    why = "offload is not an op" if "offload" in options else "makes ReLU decisions"
    assert len([w for w in raised if "runs eagerly under torch.compile" in str(w.message)
                and why in str(w.message)]) == 1
    assert sum(counters["graph_break"].values()) == 1
    assert compiles_after[0] >= 1 and compiles_after == compiles_after[:1] * 3  # nothing compiled after step 1
    assert model._orig_mod.describe() == eager.describe()  # kept bytes reported, as eagerly

class FailsOnce(nn.Module):
    def __init__(self):
        super().__init__()
        self.fail = False

    def forward(self, x):
        if self.fail:
            raise RuntimeError("failed on purpose")
        return x


@pytest.mark.parametrize("kind", ["CheckpointedSequential", "wrap"])
def test_a_compiled_forward_that_raises_leaves_no_hooks_set(kind):
    # NOTE [ Codecs in a compiled graph ]: a CheckpointedSequential and a wrapped
    # model's root forward unset them as the compiled forward raises.
    failing = FailsOnce()
    if kind == "wrap":
        chain = actsave.wrap(nn.Sequential(*gelu_chain(), failing), nn.Linear, compress="int8")
    else:
        chain = actsave.CheckpointedSequential(*gelu_chain(), failing, segments=4, compress="int8")
    model = torch.compile(chain, backend=BACKEND)
    x = torch.randn(8, 64)
    grads_of_a_step(model, x)
    failing.fail = True
    with pytest.raises(RuntimeError, match="failed on purpose"):
        model(x)
    assert _torch.top_saved_tensor_hooks() is None
    failing.fail = False
    grads_of_a_step(model, x)
    assert _torch.top_saved_tensor_hooks() is None


def test_hooks_a_failed_forward_left_set_are_unset_at_the_next_one():
    # What unsets them where nothing else did: hooks_on pops its own hooks from the top.
    assert graph_codecs.hooks_on()
    try:
        assert graph_codecs.hooks_on()  # ours on top: popped, then set again
        assert _torch.top_saved_tensor_hooks() == graph_codecs._the_hooks()
        graph_codecs.hooks_off()
        assert _torch.top_saved_tensor_hooks() is None
    finally:
        graph_codecs.hooks_off()


def test_under_other_saved_tensor_hooks_a_compiled_codec_runs_eagerly_and_says_why(monkeypatch):
    monkeypatch.setattr(compiled_calls, "_warned_eager_under_compile", False)
    x = torch.randn(8, 64)
    eager = actsave.CheckpointedSequential(*gelu_chain(), segments=4, compress="int8")
    model = torch.compile(actsave.CheckpointedSequential(*gelu_chain(), segments=4, compress="int8"),
                          backend=BACKEND)
    with warnings.catch_warnings(record=True) as raised, torch.autograd.graph.save_on_cpu():
        warnings.simplefilter("always")
        torch.testing.assert_close(grads_of_a_step(model, x), grads_of_a_step(eager, x))
    assert len([w for w in raised if "other saved-tensor hooks are set" in str(w.message)]) == 1


def test_a_compiled_wrapped_block_that_makes_decisions_runs_eagerly_and_says_why_once(monkeypatch):
    monkeypatch.setattr(compiled_calls, "_warned_eager_under_compile", False)
    plain, x = ResidualNet(depth=3, activation=torch.relu), torch.randn(4, 8)
    eager = actsave.wrap(copy.deepcopy(plain), ResidualBlock, compress="int8")
    model = torch.compile(actsave.wrap(copy.deepcopy(plain), ResidualBlock, compress="int8"), backend=BACKEND)
    with warnings.catch_warnings(record=True) as raised:
        warnings.simplefilter("always")
        for seed in (1, 2):
            torch.testing.assert_close(grads_of_a_step(model, x, seed), grads_of_a_step(eager, x, seed))
            for m in (model, eager):
                m.zero_grad(set_to_none=True)
    assert len([w for w in raised if "a graph break at each such call" in str(w.message)
                and "makes ReLU decisions" in str(w.message)]) == 1


class _ClampedBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.act = nn.Linear(8, 8), nn.ReLU6()

    def forward(self, x):
        return x + self.act(self.fc(x))


def test_a_compiled_wrapped_block_with_a_relu6_module_runs_eagerly_with_its_decisions(monkeypatch):
    # NOTE [ Bound decisions ]: kept by eager actsave only, as a max pool's are.
    monkeypatch.setattr(compiled_calls, "_warned_eager_under_compile", False)
    torch.manual_seed(0)
    plain, x = nn.Sequential(*[_ClampedBlock() for _ in range(3)]), torch.randn(4, 8)
    eager = actsave.wrap(copy.deepcopy(plain), _ClampedBlock, compress="int8")
    model = torch.compile(actsave.wrap(copy.deepcopy(plain), _ClampedBlock, compress="int8"), backend=BACKEND)
    with warnings.catch_warnings(record=True) as raised:
        warnings.simplefilter("always")
        torch.testing.assert_close(grads_of_a_step(model, x), grads_of_a_step(eager, x))
    assert len([w for w in raised if "makes Hardtanh or LeakyReLU decisions" in str(w.message)]) == 1


def _relu_warnings(raised) -> int:
    return len([w for w in raised if "makes ReLU decisions" in str(w.message)])


def test_a_compiled_chain_looks_for_decisions_again_once_its_layers_change(monkeypatch):
    # The answer found for the GELUs (none: the codec in the graph) must not stand for
    # the ReLUs put in their place, whose decisions a recompute in the graph would lose.
    x = torch.randn(8, 64)
    chain = actsave.CheckpointedSequential(*gelu_chain(), segments=4, compress="int8")
    model = torch.compile(chain, backend=BACKEND)
    grads_of_a_step(model, x)
    for i, layer in enumerate(list(chain)):
        if isinstance(layer, nn.GELU):
            chain[i] = nn.ReLU()
    chain.zero_grad(set_to_none=True)
    eager = copy.deepcopy(chain)
    monkeypatch.setattr(compiled_calls, "_warned_eager_under_compile", False)
    with warnings.catch_warnings(record=True) as raised:
        warnings.simplefilter("always")
        torch.testing.assert_close(grads_of_a_step(model, x), grads_of_a_step(eager, x))
    assert _relu_warnings(raised) == 1


def test_a_compiled_wrapped_model_probes_its_blocks_again_once_a_module_changes(monkeypatch):
    plain, x = ResidualNet(depth=2, activation=F.gelu, dropout=0.0), torch.randn(4, 8)
    wrapped = actsave.wrap(plain, ResidualBlock, compress="int8")
    model = torch.compile(wrapped, backend=BACKEND)
    grads_of_a_step(model, x)
    assert [block.eager_because for block in wrapped.blocks] == [None, None]
    torch.manual_seed(1)
    wrapped.blocks[1] = actsave.Checkpoint(ResidualBlock(activation=nn.ReLU(), dropout=0.0), compress="int8")
    monkeypatch.setattr(compiled_calls, "_warned_eager_under_compile", False)
    with warnings.catch_warnings(record=True) as raised:
        warnings.simplefilter("always")
        grads_of_a_step(model, x)
    # The new block runs eagerly, keeping its ReLU decisions; the GELU block stays in the graph.
    assert wrapped.blocks[0].eager_because is None and "ReLU decisions" in wrapped.blocks[1].eager_because
    assert _relu_warnings(raised) == 1


def test_a_compiled_wrapped_model_is_freed_once_dropped():
    # The probe's record of a root is keyed by the root, weakly: it must not hold it.
    wrapped = actsave.wrap(ResidualNet(depth=2, activation=F.gelu, dropout=0.0), ResidualBlock, compress="int8")
    grads_of_a_step(torch.compile(wrapped, backend=BACKEND), torch.randn(4, 8))
    alive = weakref.ref(wrapped)
    del wrapped
    torch._dynamo.reset()
    gc.collect()
    assert alive() is None


def test_a_compiled_chain_whose_layers_all_keep_on_the_device_compiles(monkeypatch):
    # Built with offload=True, then every layer set back: no layer keeps on the host.
    chain = actsave.CheckpointedSequential(*dropout_free_chain(), segments=4, offload=True)
    chain.set_offload(slice(None), False)
    model, graphs = compiled_for_counting(chain)
    grads_of_a_step(model, torch.randn(16, 32))
    assert len(graphs) == 1 and chain._last_call.traced


def test_a_deep_copied_checkpointed_sequential_compiles_its_exact_segments_too():
    # copy.deepcopy gives the copy codec objects of its own: exactness is judged by value.
    model, graphs = compiled_for_counting(copy.deepcopy(actsave.CheckpointedSequential(*dropout_free_chain(),
                                                                                        segments=4)))
    counters = torch._dynamo.utils.counters
    counters.clear()
    grads_of_a_step(model, torch.randn(16, 32))
    assert (sum(counters["graph_break"].values()), checkpoints_in(graphs)) == (1, 3)


class DataDependent(nn.Module):
    """A layer whose Python branches on a tensor's value: a graph break in its forward."""

    def forward(self, x):
        return x * 2 if x.abs().sum().item() < 1e9 else x


def test_a_layer_dynamo_cannot_trace_breaks_the_graph_and_trains_as_eager_actsave():
    def layers():
        torch.manual_seed(0)
        return [nn.Linear(16, 16), nn.GELU(), DataDependent(), nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 16)]
    eager = actsave.CheckpointedSequential(*layers(), segments=3)
    model = torch.compile(actsave.CheckpointedSequential(*layers(), segments=3), backend=BACKEND)
    x = torch.randn(4, 16)
    for _ in range(2):
        torch.testing.assert_close(grads_of_a_step(model, x), grads_of_a_step(eager, x))


def test_describe_says_a_compiled_call_reports_no_kept_bytes():
    model = actsave.CheckpointedSequential(*dropout_free_chain(), segments=4)
    grads_of_a_step(torch.compile(model, backend=BACKEND), torch.randn(16, 32))
    assert "ran in a compiled graph" in model.describe()
    assert "a compiled backward may hold more" in model.describe()  # than the plan's prediction
    grads_of_a_step(model, torch.randn(16, 32))
    assert "compiled" not in model.describe() and "device        2048" in model.describe()


def test_a_nested_segment_compiles_as_one_checkpoint_with_eager_gradients():
    # Its inner cuts apply eagerly only (docs/limits.md, "torch.compile").
    def planned() -> actsave.CheckpointedSequential:
        model = actsave.CheckpointedSequential(*dropout_free_chain())
        inner = (Range(0, 6), Range(6, 12, recomputed=False))
        plan = plans.predict(actsave.profile(model, (torch.randn(16, 32),)), [0, 12],
                             nested=[Range(0, 12, inner=inner)])
        model.apply_plan(plan)
        return model
    eager = planned()
    assert "input, nested" in eager.describe()
    model, graphs = compiled_for_counting(planned())
    counters = torch._dynamo.utils.counters
    counters.clear()
    x = torch.randn(16, 32)
    torch.testing.assert_close(grads_of_a_step(model, x), grads_of_a_step(eager, x), rtol=1e-5, atol=1e-6)
    assert (sum(counters["graph_break"].values()), checkpoints_in(graphs)) == (1, 1)


class LinearBlock(nn.Module):
    def __init__(self, width: int = 16):
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(width), nn.Linear(width, 2 * width), nn.Linear(2 * width, width)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


def linear_stack(n: int = 3) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*(LinearBlock() for _ in range(n)))


def test_compiled_selective_blocks_are_one_graph_of_torch_selective_checkpoints():
    # keep="selective" is torch's selective checkpoint in the graph, saving the linear
    # layers' matmuls (NOTE [ Keep modes ]): one graph, no break, eager's gradients.
    eager = actsave.wrap(linear_stack(), LinearBlock, keep="selective")
    model, graphs = compiled_for_counting(actsave.wrap(linear_stack(), LinearBlock, keep="selective"))
    counters = torch._dynamo.utils.counters
    counters.clear()
    x = torch.randn(4, 8, 16)
    torch.testing.assert_close(grads_of_a_step(model, x), grads_of_a_step(eager, x))
    assert (sum(counters["graph_break"].values()), len(graphs), checkpoints_in(graphs)) == (0, 1, 3)


@pytest.mark.parametrize("names, kept_per_block", [(("up",), 4 * 8 * 32 * 4), (("down",), 0)])
def test_compiled_selective_blocks_keeping_linear_layers_by_name_save_those_alone(names, kept_per_block):
    # The policy asks which module each matmul runs in (NOTE [ Kept calls in a graph ]):
    # up's output is saved, down's recomputed (its output, which only joins the
    # residual, the backward never reads); one graph, no break, eager's gradients.
    keep = actsave.KeptOps(module_names=names)
    eager = actsave.wrap(linear_stack(), LinearBlock, keep=keep)
    model, graphs = compiled_for_counting(actsave.wrap(linear_stack(), LinearBlock, keep=keep))
    inputs_only, _ = compiled_for_counting(actsave.wrap(linear_stack(), LinearBlock))
    counters = torch._dynamo.utils.counters
    counters.clear()
    x = torch.randn(4, 8, 16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = grads_of_a_step(model, x)
    assert all(torch.equal(a, b) for a, b in zip(got, grads_of_a_step(eager, x)))
    assert (sum(counters["graph_break"].values()), len(graphs), checkpoints_in(graphs)) == (0, 1, 3)
    assert activation_bytes_saved(model, x) - activation_bytes_saved(inputs_only, x) == 3 * kept_per_block


def test_a_compiled_selective_block_naming_no_module_raises_as_eagerly(monkeypatch):
    monkeypatch.setattr(compiled_calls, "_warned_eager_under_compile", False)
    model = torch.compile(actsave.wrap(linear_stack(), LinearBlock, keep=actsave.KeptOps(module_names=("gate",))),
                          backend=BACKEND)
    with pytest.warns(UserWarning, match=r"some name matches no module of the block"), \
            pytest.raises(actsave.ConfigError, match=r"names \['gate'\].*\['down', 'up'\]"):
        model(torch.randn(4, 8, 16))


def test_a_compiled_selective_function_keeping_modules_by_name_is_refused_as_eagerly(monkeypatch):
    # A function that is not a module: actsave cannot name its modules, compiled or not.
    monkeypatch.setattr(compiled_calls, "_warned_eager_under_compile", False)
    block, keep = linear_stack(1)[0], actsave.KeptOps(module_names=("up",))
    compiled = torch.compile(lambda t: actsave.checkpoint(lambda u: block(u), t, keep=keep), backend=BACKEND)
    x = torch.randn(4, 8, 16, requires_grad=True)
    with pytest.warns(UserWarning, match=r"by name in a function that is not a module"), \
            pytest.raises(actsave.ConfigError, match=r"finds the modules a function runs only where it is a module"):
        compiled(x)


class PrintingBlock(LinearBlock):
    """A LinearBlock whose forward breaks the graph between its linear layers."""

    def forward(self, x):
        h = self.up(self.norm(x))
        if h.abs().sum().item() < 0:  # a value read back: a graph break
            h = -h
        return x + self.down(F.gelu(h))


def test_a_compiled_block_keeping_modules_by_name_that_breaks_the_graph_trains_as_eagerly():
    # Dynamo rebuilds the policy where the block breaks the graph: one that held
    # frozensets raised an AssertionError inside Dynamo ("frozenset not in co_names").
    def stack():
        torch.manual_seed(0)
        return actsave.wrap(nn.Sequential(*(PrintingBlock() for _ in range(2))), PrintingBlock,
                            keep=actsave.KeptOps(module_names=("up",)))
    x = torch.randn(4, 8, 16)
    got = grads_of_a_step(torch.compile(stack(), backend=BACKEND), x)
    assert all(torch.equal(a, b) for a, b in zip(got, grads_of_a_step(stack(), x)))


class ScoresBlock(nn.Module):
    """Attention written with torch.bmm: a T x T score matrix between two matmuls."""

    def __init__(self, width: int = 16):
        super().__init__()
        self.up, self.down = nn.Linear(width, width), nn.Linear(width, width)

    def forward(self, x):
        h = self.up(x)
        scores = torch.bmm(h, h.transpose(1, 2)).softmax(-1)
        return x + self.down(torch.bmm(scores, h))


@pytest.mark.parametrize("keep", ["selective", actsave.KeptOps(module_names=("up",))])
def test_a_compiled_selective_block_saves_no_hand_written_matmul(keep):
    # NOTE [ Kept calls in a graph ]: a graph keeps no more than the eager checkpoint;
    # saving every bmm as attention's had kept the score matrix too.
    def stack(keep=None):
        torch.manual_seed(0)
        model = nn.Sequential(*(ScoresBlock() for _ in range(2)))
        return actsave.wrap(model, ScoresBlock, keep=keep) if keep is not None else actsave.wrap(model, ScoresBlock)
    x = torch.randn(2, 32, 16)
    compiled = torch.compile(stack(keep), backend=BACKEND)
    inputs_only = torch.compile(stack(), backend=BACKEND)
    linear_outputs = 2 * 2 * x.numel() * x.element_size()  # up's and down's, at most, per block
    assert activation_bytes_saved(compiled, x) - activation_bytes_saved(inputs_only, x) <= linear_outputs


class NormedBreakingBlock(nn.Module):
    """A BatchNorm between linear layers, and a value read back: a graph break inside."""

    def __init__(self, width: int = 16):
        super().__init__()
        self.up, self.norm, self.down = nn.Linear(width, width), nn.BatchNorm1d(width), nn.Linear(width, width)

    def forward(self, x):
        h = self.norm(self.up(x))
        if h.abs().sum().item() < 0:
            h = -h
        return x + self.down(torch.tanh(h))


class Counted(nn.Module):
    """Scales by a factor its call count sets: a Python attribute its forward changes."""

    def __init__(self):
        super().__init__()
        self.register_buffer("scale", torch.ones(()))
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return x * self.scale * (1.0 + 0.5 * (self.calls % 2))


class CountingBlock(nn.Module):
    def __init__(self, width: int = 16):
        super().__init__()
        self.up, self.counted, self.down = nn.Linear(width, width), Counted(), nn.Linear(width, width)

    def forward(self, x):
        return x + self.down(torch.tanh(self.counted(self.up(x))))


@pytest.mark.parametrize("keep", ["inputs", "selective"])
@pytest.mark.parametrize("block", [NormedBreakingBlock, CountingBlock])
def test_a_compiled_block_dynamo_cannot_trace_runs_the_eager_checkpoint_of_actsave(block, keep, monkeypatch):
    # NOTE [ A checkpoint Dynamo cannot trace ]: torch's checkpoint run eagerly there
    # recomputed on the state the forward left (BatchNorm's statistics updated twice; a
    # count read at another value: gradients 0.03 off); actsave's eager path does not.
    monkeypatch.setattr(compiled_calls, "_warned_eager_under_compile", False)

    def stack():
        torch.manual_seed(0)
        return actsave.wrap(nn.Sequential(*(block() for _ in range(2))), block, keep=keep)
    eager, compiled = stack(), stack()
    x = torch.randn(8, 16)
    with pytest.warns(UserWarning, match="Dynamo cannot trace whole"):
        got = [grads_of_a_step(torch.compile(compiled, backend=BACKEND), x) for _ in range(2)]
    expected = [grads_of_a_step(eager, x) for _ in range(2)]
    assert all(torch.equal(a, b) for step, step_eager in zip(got, expected) for a, b in zip(step, step_eager))
    assert all(torch.equal(a, b) for a, b in zip(compiled.buffers(), eager.buffers()))
    assert [m.calls for m in compiled.modules() if isinstance(m, Counted)] == \
        [m.calls for m in eager.modules() if isinstance(m, Counted)]


def test_a_compiled_chain_with_a_layer_dynamo_cannot_trace_updates_its_statistics_once():
    def layers():
        torch.manual_seed(0)
        return [nn.Linear(16, 16), nn.BatchNorm1d(16), DataDependent(), nn.Linear(16, 16), nn.BatchNorm1d(16),
                nn.Linear(16, 16)]
    eager = actsave.CheckpointedSequential(*layers(), segments=3)
    compiled = actsave.CheckpointedSequential(*layers(), segments=3)
    model, x = torch.compile(compiled, backend=BACKEND), torch.randn(8, 16)
    for _ in range(2):
        assert all(torch.equal(a, b) for a, b in zip(grads_of_a_step(model, x), grads_of_a_step(eager, x)))
    assert all(torch.equal(a, b) for a, b in zip(compiled.buffers(), eager.buffers()))


class Noting(LinearBlock):
    """Sets an attribute __init__ did not: Dynamo skips each frame of the block's call."""

    def forward(self, x):
        self.noted = x.shape[0]
        return super().forward(x)


@pytest.mark.parametrize("keep", ["inputs", "selective"])
def test_a_compiled_block_that_sets_a_new_attribute_trains_as_eagerly(keep):
    # The checkpoint then runs from a frame Dynamo ran eagerly, whose callees it
    # compiles: actsave's eager path, compiled frame by frame, hit a Dynamo guard
    # assertion ("Guard failed on the same frame it was created"). It now runs out of
    # Dynamo's reach (compiled_calls.out_of_dynamo).
    def stack():
        torch.manual_seed(0)
        return actsave.wrap(nn.Sequential(*(Noting() for _ in range(2))), Noting, keep=keep)
    x = torch.randn(4, 8, 16)
    got = grads_of_a_step(torch.compile(stack(), backend=BACKEND), x)
    assert all(torch.equal(a, b) for a, b in zip(got, grads_of_a_step(stack(), x)))


def test_a_compiled_selective_function_keeping_modules_is_refused_as_eagerly():
    # Compiled, it kept every matching operator of the function by type (a hand-written
    # matmul too), where eagerly it is refused.
    block = linear_stack(1)[0]
    compiled = torch.compile(lambda t: actsave.checkpoint(lambda u: block(u), t, keep="selective"), backend=BACKEND)
    with pytest.raises(actsave.ConfigError, match=r"finds the modules a function runs only where it is a module"):
        compiled(torch.randn(4, 8, 16, requires_grad=True))
