"""What the tests of actsave under torch.compile share (tests/compile/): the backend,
small chains, one step's gradients, graph and compile counters, what a forward keeps."""
import contextlib
import warnings

import pytest
import torch
from torch import nn

from support import load_bench_module, sqnr_db


BACKEND = "aot_eager"
INT8_SQNR_FLOOR_DB = 30.0
COMPRESS = [None, "int8"]


def chain(width=8) -> list:
    torch.manual_seed(0)
    layers = []
    for _ in range(3):
        layers += [nn.Linear(width, width), nn.Tanh(), nn.Dropout(0.2)]
    return layers


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


def relu_chain(width=8) -> list:
    torch.manual_seed(0)
    return [m for _ in range(3) for m in (nn.Linear(width, width), nn.ReLU(), nn.Dropout(0.2))]


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
    partitioner may keep fewer: of a plain segment it saves what it chooses, and a
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


def hugging_face_llama() -> tuple:
    """``(a 2-layer Hugging Face Llama in training mode, its decoder layer class, Logits)``
    from a config (no download), seeded; ``Logits`` makes the causal LM a map from ids to
    logits. Skips the test without transformers."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      bos_token_id=0, eos_token_id=0, use_cache=False)
    torch.manual_seed(0)
    plain = transformers.AutoModelForCausalLM.from_config(config).train()
    return plain, LlamaDecoderLayer, load_bench_module("compile_memory").Logits
