"""actsave under torch.compile: gradients equal eager ones.

Two compositions:
- compile outside: ``torch.compile(model)`` over a CheckpointedSequential or over
  ``wrap()``-ed blocks. An exact checkpointed call becomes torch's checkpoint in the
  graph (NOTE [ Checkpoints in a compiled graph ] in runtime/compiled_calls.py): the forward
  is one graph (a CheckpointedSequential breaks once, before any compute, where it
  looks up its segments) and the compiled backward recomputes each segment. A call
  that keeps its input by a codec or on the host runs eagerly: a CheckpointedSequential
  runs its whole forward eagerly at its one break, a wrapped block breaks the graph.
- compile inside: the blocks compiled first, then checkpointed. Forward and recompute
  run the same compiled code, so they save the same tensors, and codecs and offload
  apply.

The backend is ``aot_eager``: it runs Dynamo and AOTAutograd, the two layers that
meet actsave's saved-tensor hooks, and compiles in about a second. Inductor only
changes the generated kernels, and on this CPU-only machine each of its graphs is a
C++ build of 10-20 s, so one test covers it.
"""
import contextlib
import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import actsave
from actsave import _torch, _torch_graphs
from actsave.planning import plans
from actsave.runtime import compiled_calls, compiled_layers, graph_codecs
from actsave.runtime.nested import Range
from support import ResidualBlock, ResidualNet, load_bench_module, sqnr_db

BACKEND = "aot_eager"
INT8_SQNR_FLOOR_DB = 30.0
COMPRESS = [None, "int8"]


def chain(width=8) -> list:
    torch.manual_seed(0)
    layers = []
    for _ in range(3):
        layers += [nn.Linear(width, width), nn.Tanh(), nn.Dropout(0.2)]
    return layers


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Compiled code and its guards do not leak from one test into the next, nor do
    actsave's graph hooks where a test fails inside a compiled forward."""
    torch._dynamo.reset()
    yield
    graph_codecs.hooks_off()
    torch._dynamo.reset()


def grads_of_a_step(model: nn.Module, x: torch.Tensor, seed: int = 1) -> list:
    """Input (a float one's) and parameter gradients of one forward/backward from a
    fixed RNG state."""
    x = x.detach().clone().requires_grad_(x.is_floating_point())
    torch.manual_seed(seed)
    model(x).float().square().sum().backward()
    return [x.grad] * x.is_floating_point() + [p.grad for p in model.parameters()]


def assert_same_gradients(expected: list, got: list, compress) -> None:
    if compress is None:
        torch.testing.assert_close(got, expected)
        return
    flat = [torch.cat([g.flatten() for g in grads]) for grads in (expected, got)]
    assert sqnr_db(*flat) >= INT8_SQNR_FLOOR_DB


@pytest.mark.parametrize("compress", COMPRESS)
def test_compiled_checkpointed_sequential_has_eager_gradients(compress):
    x = torch.randn(4, 8)
    expected = grads_of_a_step(nn.Sequential(*chain()), x)
    model = actsave.CheckpointedSequential(*chain(), segments=2, compress=compress)
    assert_same_gradients(expected, grads_of_a_step(torch.compile(model, backend=BACKEND), x), compress)


@pytest.mark.parametrize("compress", COMPRESS)
def test_compiled_model_with_wrapped_blocks_has_eager_gradients(compress):
    plain, x = ResidualNet(), torch.randn(4, 8)
    model = actsave.wrap(copy.deepcopy(plain), ResidualBlock, compress=compress)
    compiled = torch.compile(model, backend=BACKEND)
    assert_same_gradients(grads_of_a_step(plain, x), grads_of_a_step(compiled, x), compress)


@pytest.mark.parametrize("compress", COMPRESS)
def test_blocks_compiled_then_wrapped_have_eager_gradients(compress):
    plain, x = ResidualNet(), torch.randn(4, 8)
    model = copy.deepcopy(plain)
    for block in model.blocks:
        block.compile(backend=BACKEND)
    actsave.wrap(model, ResidualBlock, compress=compress)
    assert all(isinstance(block, actsave.Checkpoint) for block in model.blocks)
    assert_same_gradients(grads_of_a_step(plain, x), grads_of_a_step(model, x), compress)


def test_inductor_compiled_block_then_wrapped_has_eager_gradients():
    # fallback_random: Inductor's own RNG would draw other Dropout masks than eager.
    plain, x = ResidualNet(depth=1), torch.randn(4, 8)
    model = copy.deepcopy(plain)
    model.blocks[0].compile(backend="inductor")
    actsave.wrap(model, ResidualBlock)
    with torch._inductor.config.patch(fallback_random=True):
        got = grads_of_a_step(model, x)
    assert_same_gradients(grads_of_a_step(plain, x), got, None)


# --- compiled blocks, then checkpointed: compiled once, no warnings ---

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
    assert actsave.stored_bytes()["device"] > 0  # the blocks keep their inputs: checkpointed
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
    by reference, and the stored last) stay compiled."""
    monkeypatch.setattr(compiled_layers, "_warned", False)  # once per process
    monkeypatch.setattr(compiled_layers, "_KEEPS_DECISIONS", {})
    x = torch.randn(4, 8, 8, 8)
    model = actsave.CheckpointedSequential(*[compiled(block, how) for block in conv_bn_relu_blocks()],
                                           segments=4, compress="int8")
    model.set_compression(6, None)  # the stored last segment keeps autograd's saves
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


# --- a compiled model that contains actsave ---------------------------

def compiled_for_counting(model: nn.Module, in_place: bool = False) -> tuple:
    """``torch.compile(model)`` with aot_eager (or ``model.compile(...)`` and
    ``model``, ``in_place``), and the FX graphs Dynamo hands it."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return torch._dynamo.lookup_backend(BACKEND)(gm, example_inputs)
    if in_place:
        model.compile(backend=backend)
        return model, graphs
    return torch.compile(model, backend=backend), graphs


def checkpoints_in(graphs: list) -> int:
    return sum(node.target is torch.ops.higher_order.tag_activation_checkpoint
               for gm in graphs for node in gm.graph.nodes)


def activation_bytes_saved(model: nn.Module, x: torch.Tensor) -> int:
    """Bytes of the tensors autograd saves in a forward of ``model``, parameters left
    out (the compiled graph saves them, eager layers read them from the module)."""
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in parameters:
            saved[storage.data_ptr()] = storage.nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x.detach().requires_grad_())
    return sum(saved.values())


def dropout_free_chain(width: int = 32) -> list:
    torch.manual_seed(0)
    return [m for _ in range(8) for m in (nn.Linear(width, width), nn.GELU())]


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


def relu_chain(width=8) -> list:
    torch.manual_seed(0)
    return [m for _ in range(3) for m in (nn.Linear(width, width), nn.ReLU(), nn.Dropout(0.2))]


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


# --- codecs in the compiled graph --------------------------------------

def kept_after_forward(model: nn.Module, x: torch.Tensor) -> int:
    """The bytes a forward leaves allocated for its backward, its output left out, as
    the CPU allocator counts them: a compiled graph's encoded saves and eager actsave's
    kept inputs alike (bench/compile_memory.py measures so)."""
    allocator_rise = load_bench_module("harness").allocator_rise
    outputs = []
    kept = allocator_rise(lambda: outputs.append(model(x)))[1]
    return kept - outputs[0].untyped_storage().nbytes()


def flat_gradients(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The parameter gradients of a step on a batch that needs no gradient (a leaf
    that does is encoded by a compiled wrapped block, and kept by reference eagerly:
    graph_codecs.inputs_copied)."""
    torch.manual_seed(1)
    model(x).float().square().sum().backward()
    gradients = torch.cat([p.grad.flatten() for p in model.parameters()])
    model.zero_grad(set_to_none=True)
    return gradients


@contextlib.contextmanager
def compiles_counted():
    """While active, the list it yields grows by one for each frame Dynamo starts to
    compile; a frame it skips (a non-recursively disabled one, each call) is none."""
    started = []

    def count(args):
        started.append(args)
    torch._dynamo.callback_handler.register_start_callback(count)
    try:
        yield started
    finally:
        torch._dynamo.callback_handler.remove_start_callback(count)


def assert_codecs_in_the_graph(make, x: torch.Tensor, plain: nn.Module, in_place: bool = False) -> None:
    """``make()``'s model compiled keeps by its codecs in one graph, at one break
    where actsave's graph hooks are set around the graph compiled (a
    CheckpointedSequential's forward, a wrapped model's root forward). It compiles
    nothing after its first step, warns nothing, leaves no hooks set, and matches eager
    actsave (:func:`assert_keeps_as_eager_actsave`). ``in_place``: compiled by
    ``model.compile()``, which traces the model's ``Module.__call__`` too."""
    model, graphs = compiled_for_counting(make(), in_place)
    counters = torch._dynamo.utils.counters
    counters.clear()
    with warnings.catch_warnings(record=True) as raised, compiles_counted() as compiles:
        warnings.simplefilter("always")
        compiles_after = assert_keeps_as_eager_actsave(model, make(), plain, x, compiles)
    assert not [w for w in raised if "actsave" in str(w.message)]
    assert (len(counters["graph_break"]), len(graphs)) == (1, 1)
    assert compiles_after[0] >= 1 and compiles_after == compiles_after[:1] * 3


def assert_keeps_as_eager_actsave(model, eager, plain: nn.Module, x: torch.Tensor, compiles: list) -> list:
    """Over three steps of compiled ``model`` and ``eager`` actsave: the gradients'
    SQNR against ``plain`` within 1 dB of eager's (lossy both), no saved-tensor hooks
    left set, and then no more bytes kept after forward than eager's plus 5% (the
    partitioner may keep fewer: of a stored segment it saves what it chooses, and a
    compiled checkpoint keeps no RNG state where its region draws none). Returns how
    many frames Dynamo had compiled after each step (``compiles``:
    :func:`compiles_counted`'s list)."""
    compiles_after = []
    for _ in range(3):
        expected = flat_gradients(plain, x)
        eager_db, compiled_db = (sqnr_db(expected, flat_gradients(m, x)) for m in (eager, model))
        assert abs(compiled_db - eager_db) <= 1.0 and compiled_db < 200  # lossy, as eagerly
        assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
        compiles_after.append(len(compiles))
    assert kept_after_forward(model, x) <= 1.05 * kept_after_forward(eager, x)
    return compiles_after


def gelu_chain(width: int = 64) -> list:
    torch.manual_seed(0)
    return [m for _ in range(8) for m in (nn.Linear(width, width), nn.GELU())]


@pytest.mark.parametrize("segments", [4, "balanced"])
def test_a_compiled_checkpointed_sequential_keeps_its_inputs_by_a_codec_in_the_graph(segments):
    x = torch.randn(32, 64)
    assert_codecs_in_the_graph(lambda: actsave.CheckpointedSequential(*gelu_chain(), segments=segments,
                                                                      compress="int8"),
                               x, nn.Sequential(*gelu_chain()))


def test_a_compiled_stored_segment_keeps_its_saves_by_its_codec_too():
    # segments=4 sets int8 on every layer, the last segment's too: its saves are stored
    # by int8 (kept_saves.py eagerly), so that int8 keeps under a quarter of
    # fp32's bytes and scales, as eagerly (27,840 against 64,320 bytes).
    x = torch.randn(32, 64)
    exact = torch.compile(actsave.CheckpointedSequential(*gelu_chain(), segments=4), backend=BACKEND)
    int8 = torch.compile(actsave.CheckpointedSequential(*gelu_chain(), segments=4, compress="int8"),
                         backend=BACKEND)
    for model in (exact, int8):
        grads_of_a_step(model, x)
    assert kept_after_forward(int8, x) < 0.3 * kept_after_forward(exact, x)


def test_describe_says_a_compiled_call_encoded_the_kept_inputs_in_the_graph():
    model = actsave.CheckpointedSequential(*gelu_chain(), segments=4, compress="int8")
    grads_of_a_step(torch.compile(model, backend=BACKEND), torch.randn(8, 64))
    assert "(those set to keep by a codec encoded in it)" in model.describe()


def test_compiled_wrapped_blocks_keep_their_inputs_by_a_codec_in_the_graph():
    # Each block ends in a saved copy: the next block's kept input, encoded, and the
    # head's input, kept exactly as eagerly (NOTE [ Codecs in a compiled graph ]).
    plain = ResidualNet(depth=4, width=64, dropout=0.0)
    assert_codecs_in_the_graph(lambda: actsave.wrap(copy.deepcopy(plain), ResidualBlock, compress="int8"),
                               torch.randn(32, 64), plain)


@pytest.mark.parametrize("how", ["model.compile()", "an nn.Sequential root", "a wrapped root inside another"])
def test_wrapped_blocks_keep_by_a_codec_in_the_graph_at_one_break_however_the_root_is_compiled(how):
    # Module.compile() and torch.compile of an nn.Sequential trace the root's
    # Module.__call__, which calls its RootForward; a wrapped root inside another is
    # traced as the outer one's code (NOTE [ Codecs in a compiled graph ]).
    plain = ResidualNet(depth=4, width=64, dropout=0.0)
    if how == "an nn.Sequential root":
        plain = nn.Sequential(*plain.blocks, plain.head)
    elif how == "a wrapped root inside another":
        plain = nn.Sequential(ResidualBlock(64, dropout=0.0), plain)

    def make():
        model = copy.deepcopy(plain)
        if how == "a wrapped root inside another":
            actsave.wrap(model[1], ResidualBlock, compress="int8")
        return actsave.wrap(model, ResidualBlock, compress="int8")
    assert_codecs_in_the_graph(make, torch.randn(32, 64), plain, in_place=how == "model.compile()")


def test_compiled_wrapped_attention_blocks_keep_by_a_codec_in_the_graph():
    models = load_bench_module("models")
    torch.manual_seed(0)
    plain = models.gpt(4, width=64, heads=2, vocab_size=64, max_seq_len=16)
    assert_codecs_in_the_graph(
        lambda: actsave.wrap(copy.deepcopy(plain), models.TransformerBlock, compress="int8"),
        torch.randint(0, 64, (4, 16)), plain)


def test_a_compiled_hugging_face_llama_keeps_its_wrapped_blocks_by_a_codec_in_the_graph():
    # Its mask code reads a value (Tensor.item()) unless the tensor is fake: the probe
    # runs on fake tensors (NOTE [ Fake tensors in a probe ]), so the blocks' codec
    # goes in the graph instead of running eagerly at a break per block.
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      bos_token_id=0, eos_token_id=0, use_cache=False)
    torch.manual_seed(0)
    plain = transformers.AutoModelForCausalLM.from_config(config).train()
    Logits = load_bench_module("compile_memory").Logits  # the causal LM as a map from ids to logits
    assert_codecs_in_the_graph(
        lambda: Logits(actsave.wrap(copy.deepcopy(plain), LlamaDecoderLayer, compress="int8")),
        torch.randint(1, 64, (2, 16)), Logits(plain))


class ResidualBlocks(nn.Module):
    """Residual blocks, the second with a ReLU, and a graph break after each where asked."""

    def __init__(self, graph_breaks: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(ResidualBlock(64, activation=activation, dropout=0.0)
                                    for activation in (torch.tanh, torch.relu, torch.tanh, torch.tanh))
        self.head = nn.Linear(64, 2)
        self.graph_breaks = graph_breaks

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
            if self.graph_breaks:
                torch._dynamo.graph_break()
        return self.head(x)


@pytest.mark.parametrize("graph_breaks", [False, True], ids=["one loop", "a break in the loop"])
def test_compiled_wrapped_blocks_keep_by_a_codec_where_one_runs_eagerly_or_each_compiles_alone(
        monkeypatch, graph_breaks):
    # The ReLU block runs eagerly at a break of its own, and Dynamo runs a loop with a
    # break in it eagerly: the other blocks compile one by one, their inputs graph
    # inputs, whose copies they encode (NOTE [ Codecs in a compiled graph ]).
    monkeypatch.setattr(compiled_calls, "_warned_eager_under_compile", False)
    plain = ResidualBlocks(graph_breaks)
    model = torch.compile(actsave.wrap(copy.deepcopy(plain), ResidualBlock, compress="int8"), backend=BACKEND)
    with warnings.catch_warnings(record=True) as raised, compiles_counted() as compiles:
        warnings.simplefilter("always")
        compiles_after = assert_keeps_as_eager_actsave(
            model, actsave.wrap(copy.deepcopy(plain), ResidualBlock, compress="int8"), plain, torch.randn(32, 64),
            compiles)
    assert len([w for w in raised if "makes ReLU decisions" in str(w.message)]) == 1
    assert compiles_after[0] >= 1 and compiles_after == compiles_after[:1] * 3


@pytest.mark.parametrize("backend", ["triton", "auto"])
def test_a_graphs_codec_traces_its_torch_reference_whichever_backend_runs_eagerly(backend):
    # Seen on an H200 (torch 2.11): on CUDA the "auto" backend picked the Triton
    # launcher inside the traced pack hook, which cannot run on fake tensors, and every
    # compile of a wrapped int8 model failed. Forcing "triton" here (the interpreter on
    # this CPU) takes the same path (NOTE [ Codecs in a compiled graph ]).
    plain, x = ResidualNet(depth=4, width=64, dropout=0.0), torch.randn(32, 64)
    with actsave.set_backend(backend):
        eager = actsave.wrap(copy.deepcopy(plain), ResidualBlock, compress="int8")
        model = torch.compile(actsave.wrap(copy.deepcopy(plain), ResidualBlock, compress="int8"), backend=BACKEND)
        expected = flat_gradients(plain, x)
        eager_db, compiled_db = (sqnr_db(expected, flat_gradients(m, x)) for m in (eager, model))
    assert abs(compiled_db - eager_db) <= 1.0 and compiled_db < 200
    assert kept_after_forward(model, x) <= 1.05 * kept_after_forward(eager, x)


def test_inductor_compiled_wrapped_blocks_keep_by_a_codec_in_the_graph():
    # Inductor drops a clone nothing needs, and with it the copy a block's codec keeps:
    # the copies are actsave's own operator (graph_codecs._copy). One C++ build.
    plain, x = ResidualNet(depth=2, width=64, dropout=0.0), torch.randn(32, 64)
    eager = actsave.wrap(copy.deepcopy(plain), ResidualBlock, compress="int8")
    model = torch.compile(actsave.wrap(copy.deepcopy(plain), ResidualBlock, compress="int8"), backend="inductor")
    expected = flat_gradients(plain, x)
    eager_db, compiled_db = (sqnr_db(expected, flat_gradients(m, x)) for m in (eager, model))
    assert abs(compiled_db - eager_db) <= 1.0 and compiled_db < 200


def test_compiled_segments_keep_by_each_layer_codec_and_exact_ones_exactly():
    def make():
        model = actsave.CheckpointedSequential(*gelu_chain(), segments=4, compress="int8")
        for layer in range(4, 8):
            model.set_compression(layer, "fp8_e4m3")
        for layer in range(8, 16):
            model.set_compression(layer, None)
        return model
    assert_codecs_in_the_graph(make, torch.randn(32, 64), nn.Sequential(*gelu_chain()))


def test_compiled_attention_on_the_cpu_keeps_by_a_codec_in_the_graph():
    # The CPU's fused attention is a seeded op: its checkpointed recompute saves an RNG
    # state (NOTE [ RNG states under graph hooks ] in actsave/_torch.py).
    gpt = load_bench_module("models").gpt

    def blocks():
        torch.manual_seed(0)
        return gpt(4, width=64, heads=2, vocab_size=64, max_seq_len=16)
    assert_codecs_in_the_graph(lambda: actsave.CheckpointedSequential(*blocks(), segments=3, compress="int8"),
                               torch.randint(0, 64, (4, 16)), blocks())


def test_without_the_private_torch_pieces_a_compiled_codec_runs_eagerly_and_names_them(monkeypatch):
    monkeypatch.setattr(compiled_calls, "_warned_eager_under_compile", False)
    monkeypatch.setattr(graph_codecs, "missing_pieces", lambda: "this PyTorch lacks torch.fx.traceback.annotate")
    x = torch.randn(8, 64)
    eager = actsave.CheckpointedSequential(*gelu_chain(), segments=4, compress="int8")
    model = torch.compile(actsave.CheckpointedSequential(*gelu_chain(), segments=4, compress="int8"),
                          backend=BACKEND)
    with warnings.catch_warnings(record=True) as raised:
        warnings.simplefilter("always")
        torch.testing.assert_close(grads_of_a_step(model, x), grads_of_a_step(eager, x))
    assert len([w for w in raised if "lacks torch.fx.traceback.annotate" in str(w.message)]) == 1


def test_without_the_private_torch_pieces_exact_segments_still_compile(monkeypatch):
    monkeypatch.setattr(_torch_graphs, "_annotate", None)
    x = torch.randn(8, 64)
    eager = actsave.CheckpointedSequential(*gelu_chain(), segments=4)
    model, graphs = compiled_for_counting(actsave.CheckpointedSequential(*gelu_chain(), segments=4))
    torch.testing.assert_close(grads_of_a_step(model, x), grads_of_a_step(eager, x))
    assert len(graphs) == 1


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
