"""Codecs in the compiled graph: segments and blocks kept by a codec inside one graph, at
one break where actsave's graph hooks are set."""
import copy
import warnings

import pytest
import torch
from torch import nn

import actsave
from actsave import _torch_graphs
from actsave.runtime import compiled_calls, decision_probes, graph_codecs
from actsave.codecs import EXPECTED_GRADIENT_SQNR_DB
from support import ResidualBlock, ResidualNet, load_bench_module, sqnr_db
from compile.steps import (
    BACKEND, assert_codecs_in_the_graph, assert_keeps_as_eager_actsave, compiled_for_counting, compiles_counted,
    flat_gradients, gelu_chain, grads_of_a_step, hugging_face_llama, kept_after_forward
)



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


def test_a_compiled_stored_segment_leaves_exact_the_saves_eager_actsave_leaves_exact():
    # LayerNorm's mean and rstd (last dimension 1), a norm a division reads (NOTE [
    # Saves a lossy codec leaves exact ]): encoded in the graph, the int8 gradients fell
    # to 29 dB where eager actsave's are at 37, and rows 1000x smaller gave NaN.
    def layers():
        torch.manual_seed(0)
        return [m for _ in range(4) for m in (nn.Linear(16, 16), nn.LayerNorm(16), nn.SiLU())]
    x = torch.randn(64, 16)
    x[::2] /= 1000
    plain = flat_gradients(nn.Sequential(*layers()), x)
    eager = flat_gradients(actsave.CheckpointedSequential(*layers(), segments=4, compress="int8"), x)
    compiled = flat_gradients(torch.compile(
        actsave.CheckpointedSequential(*layers(), segments=4, compress="int8"), backend=BACKEND), x)
    assert torch.isfinite(compiled).all() and sqnr_db(plain, compiled) >= sqnr_db(plain, eager) - 1.0


class _PlusAmax(nn.Module):
    def forward(self, h):
        return h + h.amax(dim=-1, keepdim=True)


@pytest.mark.parametrize("codec", ["int8", "fp8_e4m3"])
def test_a_compiled_stored_segment_leaves_exact_what_an_amax_compares(codec):
    # NOTE [ Saves a backward compares ]: the graph saves the amax's result and the
    # GELU's input, and recomputes the amax's input from that: decoded, the comparison
    # matches no element and the gradients are NaN.
    def layers():
        torch.manual_seed(0)
        return [nn.Linear(64, 64), nn.GELU(), _PlusAmax(), nn.Linear(64, 64)]
    x = torch.randn(8, 32, 64)
    plain = flat_gradients(nn.Sequential(*layers()), x)
    compiled = flat_gradients(torch.compile(
        actsave.CheckpointedSequential(*layers(), segments=1, compress=codec), backend=BACKEND), x)
    assert sqnr_db(plain, compiled) >= EXPECTED_GRADIENT_SQNR_DB[codec]


class _Reduced(nn.Module):
    def __init__(self, reduced):
        super().__init__()
        self.reduced = reduced

    def forward(self, h):
        return self.reduced(h)


def _scatter_amax(h):
    r = h.new_zeros(h.shape[0], 4).scatter_reduce(1, torch.arange(64).remainder(4).expand_as(h), h, reduce="amax",
                                                  include_self=False)
    return h * r.sum(-1, keepdim=True) + r.repeat(1, 16)


COMPARING_REDUCTIONS = {  # known by an argument, or of several outputs
    "inf dist": lambda h: h * torch.dist(h[:, :32], h[:, 32:], p=float("inf")),
    "scatter amax": _scatter_amax,
    "aminmax": lambda h: (lambda low, high: h * high + low)(*torch.aminmax(h)),
    "aminmax over a dimension": lambda h: (lambda low, high: h * 0.1 + h[:, :1] * high.unsqueeze(-1) * 0.5
                                           + (high * low).unsqueeze(-1))(*torch.aminmax(h, dim=-1)),
}


@pytest.mark.parametrize("reduce", COMPARING_REDUCTIONS)
def test_a_compiled_stored_segment_leaves_exact_what_other_reductions_compare(reduce):
    # Their inputs were encoded in the graph where eager holds them: NaN in every gradient.
    def layers():
        torch.manual_seed(0)
        return [nn.Linear(64, 64), nn.GELU(), _Reduced(COMPARING_REDUCTIONS[reduce]), nn.Linear(64, 64)]
    x = torch.randn(16, 64)
    plain = flat_gradients(nn.Sequential(*layers()), x)
    compiled = flat_gradients(torch.compile(
        actsave.CheckpointedSequential(*layers(), segments=1, compress="int8"), backend=BACKEND), x)
    assert torch.isfinite(compiled).all() and sqnr_db(plain, compiled) >= EXPECTED_GRADIENT_SQNR_DB["int8"]


class _Stabilized(nn.Module):
    """``exp(h - reduce(h).detach())``: a reduction whose backward never runs."""

    def __init__(self, reduce):
        super().__init__()
        self.reduce = reduce

    def forward(self, h):
        return torch.exp(h - self.reduce(h).detach())


def test_a_compiled_stored_segment_encodes_what_a_detached_amax_reads():
    # Only a reduction whose result the backward reads compares: a detached amax holds
    # nothing exactly, so the segment keeps what the same one with a mean keeps.
    x = torch.randn(8, 32, 64)
    kept = []
    for reduce in (lambda h: h.amax(-1, keepdim=True), lambda h: h.mean(-1, keepdim=True)):
        torch.manual_seed(0)
        model = torch.compile(actsave.CheckpointedSequential(
            nn.Linear(64, 64), nn.GELU(), _Stabilized(reduce), nn.Linear(64, 64), segments=1, compress="int8"),
            backend=BACKEND)
        grads_of_a_step(model, x)
        kept.append(kept_after_forward(model, x))
    assert kept[0] == kept[1]


def test_a_compiled_plain_middle_segment_keeps_its_saves_by_its_codec_too():
    # A plan's plain segment before a checkpointed one, its saves kept by int8: a
    # quarter of the exact plan's bytes there (the partitioner chooses which saves,
    # so the gradients' error is not eager actsave's: lossy, within int8's floor).
    x, plain = torch.randn(32, 64), nn.Sequential(*gelu_chain())
    kept, gradients = {}, {}
    for codec in ("none", "int8"):
        model = actsave.CheckpointedSequential(*gelu_chain())
        model.apply_plan(actsave.Plan(16, (0, 6, 10), (codec, "none"), (False, False), 0, 0.0, 0,
                                      plain=(True, False)))
        compiled = torch.compile(model, backend=BACKEND)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no eager fallback
            gradients[codec] = flat_gradients(compiled, x)
        kept[codec] = kept_after_forward(compiled, x)
    assert kept["int8"] < 0.6 * kept["none"]
    assert torch.equal(gradients["none"], flat_gradients(plain, x))
    assert EXPECTED_GRADIENT_SQNR_DB["int8"] <= sqnr_db(gradients["none"], gradients["int8"]) < 200


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
    plain, LlamaDecoderLayer, Logits = hugging_face_llama()
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


def test_a_compiled_chain_of_in_place_relus_on_views_keeps_their_decisions_as_eager_actsave_does(monkeypatch):
    # On a 3-D batch each Linear's output is a view, on which nn.ReLU(inplace=True)'s
    # autograd node says no ReLU: the probe watches the module as eager actsave does
    # (NOTE [ In-place ReLUs on views ]), and the chain runs eagerly with the decisions.
    # In the graph, without them, int8 gradients fell to half of eager's dB.
    monkeypatch.setattr(compiled_calls, "_warned_eager_under_compile", False)

    def make():
        torch.manual_seed(0)
        return actsave.CheckpointedSequential(
            *[m for _ in range(3) for m in (nn.Linear(16, 16), nn.ReLU(inplace=True))], segments=[0, 2, 4],
            compress="int8")
    x = torch.randn(4, 8, 16)
    with warnings.catch_warnings(record=True) as raised:
        warnings.simplefilter("always")
        compiled = flat_gradients(torch.compile(make(), backend=BACKEND), x)
    assert len([w for w in raised if "makes ReLU decisions" in str(w.message)]) == 1
    assert torch.equal(compiled, flat_gradients(make(), x))


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


def test_compiled_wrapped_blocks_keep_by_a_codec_when_the_batch_changes():
    # The recompile after a new batch size makes that size dynamic: the backward's trace
    # rebuilds the saved shape from the codes (_torch_graphs.traced_shape): the
    # forward's symbol is unknown to it.
    torch.manual_seed(0)
    plain = ResidualNet(depth=3, width=32, dropout=0.0)
    compiled = torch.compile(actsave.wrap(copy.deepcopy(plain), ResidualBlock, compress="int8"), backend=BACKEND)
    for batch in (4, 4, 6):
        x = torch.randn(batch, 32)
        plain.zero_grad(), compiled.zero_grad()
        assert sqnr_db(flat_gradients(plain, x), flat_gradients(compiled, x)) >= EXPECTED_GRADIENT_SQNR_DB["int8"]


def test_finding_compared_saves_reads_each_op_of_a_stored_segment_a_bounded_number_of_times(monkeypatch):
    # graph_saves.compared_by_backward answers every save from one pass over the graph:
    # the ops it asks about grow with the segment's ops, not with saves x ops (a walk
    # per save is quadratic in them).
    from actsave.runtime import graph_saves

    asked = []
    real = graph_saves.compares_with_input_op
    monkeypatch.setattr(graph_saves, "compares_with_input_op", lambda node: asked.append(node.name) or real(node))
    counts = []
    for layers in (4, 16):
        torch._dynamo.reset()
        asked.clear()
        torch.manual_seed(0)
        model = torch.compile(actsave.CheckpointedSequential(
            *[layer for _ in range(layers) for layer in (nn.Linear(64, 64), nn.GELU())], segments=1,
            compress="int8"), backend=BACKEND)
        model(torch.randn(8, 32, 64)).sum().backward()
        counts.append(len(asked))
    assert counts[0] > 0 and counts[1] <= 4 * counts[0] + 8


class _ReluBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x):
        return torch.relu(self.fc2(torch.relu(self.fc1(x))))


class _ReluStack(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks, self.head = nn.ModuleList(_ReluBlock() for _ in range(3)), nn.Linear(16, 4)

    def forward(self, x, depth):
        for block in self.blocks[:depth]:
            x = block(x)
        return self.head(x)


def _gradients_of_a_step(model, x) -> torch.Tensor:
    model.zero_grad(set_to_none=True)
    model(x, 3).square().sum().backward()
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def _frozen_first(model, x):
    for p in model.blocks.parameters():
        p.requires_grad_(False)
    model(x, 3).sum().backward()
    for p in model.blocks.parameters():
        p.requires_grad_(True)


@pytest.mark.parametrize("first_call", [
    _frozen_first, lambda model, x: model(x, 1), lambda model, x: torch.inference_mode()(model)(x, 3)],
    ids=["frozen_blocks", "a_flag_leaving_blocks_out", "inference_mode"])
def test_a_first_compiled_call_that_saves_less_does_not_hide_the_blocks_decisions(first_call):
    # The probe's answer was cached per input shape alone: the blocks it saw save
    # nothing were taken to make no decisions, and lost them in the steps after
    # (23.8 dB where eager int8 gives 51).
    plain = _ReluStack()
    model = actsave.wrap(copy.deepcopy(plain), _ReluBlock, compress="int8")
    compiled, x = torch.compile(model, backend=BACKEND), torch.randn(32, 16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        first_call(compiled, x)
        got = _gradients_of_a_step(compiled, x)
    assert all(block._eager_because is not None for block in model.blocks)  # run eagerly, decisions kept
    assert sqnr_db(_gradients_of_a_step(plain, x), got) >= EXPECTED_GRADIENT_SQNR_DB["int8"]


class _GeluBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x):
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(x)))


class _Forces(nn.Module):
    """Differentiates inside its forward, whatever the caller's grad mode (the forces of
    an energy model)."""

    def __init__(self):
        super().__init__()
        self.blocks, self.head = nn.ModuleList(_GeluBlock() for _ in range(2)), nn.Linear(16, 1)

    def forward(self, x, scale=1.0):
        with torch.enable_grad():
            x = x.detach().requires_grad_()
            h = x
            for block in self.blocks:
                h = block(h)
            return -torch.autograd.grad(self.head(h).sum() * scale, x)[0]


def test_a_compiled_model_called_without_grad_that_differentiates_inside_keeps_by_its_codec():
    plain = _Forces()
    model = actsave.wrap(copy.deepcopy(plain), _GeluBlock, compress="int8")
    x = torch.randn(32, 16)
    with torch.no_grad():
        got, expected = torch.compile(model, backend=BACKEND)(x), plain(x)
    assert sqnr_db(expected, got) >= EXPECTED_GRADIENT_SQNR_DB["int8"]


def test_a_compiled_model_probes_once_for_an_argument_that_changes_at_every_call(monkeypatch):
    probes = []
    monkeypatch.setattr(graph_codecs, "probe_blocks", lambda *args: probes.append(1) or decision_probes.probe_blocks(
        *args))
    model = torch.compile(actsave.wrap(_Forces(), _GeluBlock, compress="int8"), backend=BACKEND)
    for step in range(4):
        model(torch.randn(32, 16), scale=1.0 + step / 10)
    assert len(probes) == 1
