"""The helpers of actsave/_torch.py and _torch_graphs.py that do more than name a private API."""
import operator
import threading
import time

import pytest
import torch

from actsave import _torch, _torch_graphs
from actsave._torch import copies_of, default_device
from actsave._torch_graphs import _give_rng_state_its_backward_name


def bits(t):
    return t.reshape(-1).view(torch.uint8)


def same_values(copy, original):
    """Equal values, -0.0 told from +0.0 and NaN equal to NaN whatever its payload."""
    assert copy.dtype == original.dtype and copy.shape == original.shape
    if copy.is_floating_point():
        assert torch.equal(copy.isnan(), original.isnan())
        copy, original = torch.where(copy.isnan(), 0, copy), torch.where(original.isnan(), 0, original)
        assert torch.equal(copy.signbit(), original.signbit())
    assert torch.equal(copy, original)


def test_copies_are_new_tensors_with_the_same_values_in_every_dtype():
    tensors = [torch.tensor([-0.0, float("nan"), float("inf"), -float("inf"), 1e-45, 3.0]),
               torch.tensor([-0.0, 1.5], dtype=torch.bfloat16), torch.tensor(7, dtype=torch.int64),
               torch.tensor([True, False]), torch.tensor([complex(float("inf"), 1.0)]),
               torch.tensor([1, 255], dtype=torch.uint8)]
    copies = copies_of(tensors)
    for original, copy in zip(tensors, copies):
        assert copy is not original and copy.untyped_storage().data_ptr() != original.untyped_storage().data_ptr()
        if original.is_complex():
            assert torch.equal(bits(copy), bits(original))
        else:
            same_values(copy, original)



def test_copies_of_tensors_that_require_grad_beside_integer_ones():
    """Autograd refuses one foreach call mixing them (a BatchNorm's counter beside a
    buffer that requires grad, a block plan's argument that needs a gradient)."""
    tensors = [torch.randn(3, requires_grad=True), torch.tensor(4, dtype=torch.int64), torch.randn(2)]
    copies = copies_of(tensors)
    assert [copy.requires_grad for copy in copies] == [True, False, False]
    for original, copy in zip(tensors, copies):
        assert torch.equal(copy, original)

def test_the_default_device_is_read_as_torch_reads_it():
    assert default_device() == torch.get_default_device() == torch.device("cpu")
    with torch.device("meta"):
        assert default_device() == torch.device("meta")
    torch.set_default_device("meta")
    try:
        assert default_device() == torch.get_default_device() == torch.device("meta")
    finally:
        torch.set_default_device(None)
    assert default_device() == torch.device("cpu")


@pytest.mark.cuda
def test_copies_of_mixed_dtypes_on_cuda_have_the_same_values():
    # Seen on an H200: the multiply gives a NaN back as the canonical NaN (0x7fc00000).
    tensors = [torch.tensor([-0.0, float("nan"), 2.5], device="cuda"), torch.tensor(7, device="cuda"),
               torch.tensor([True], device="cuda"), torch.randn(1000, device="cuda", dtype=torch.bfloat16)]
    for original, copy in zip(tensors, copies_of(tensors)):
        same_values(copy, original)
        assert copy.data_ptr() != original.data_ptr()


def test_a_cpu_rng_state_takes_the_name_of_its_backward_input():
    # NOTE [ RNG states under graph hooks ]: AOTAutograd's partitioner names the
    # backward's input for a saved RNG state rng_state_output_<k>.
    run_and_save = torch._prims.rng_prims.run_and_save_rng_state
    forward = torch.fx.Graph()
    x = forward.placeholder("x")
    runs = [forward.call_function(run_and_save, (torch.ops.aten.rand.default, [2])) for _ in range(2)]
    states = [forward.call_function(operator.getitem, (run, 0)) for run in runs]
    other = forward.call_function(torch.ops.aten.mul.Tensor, (x, x))
    forward.output((other, *states))
    backward = torch.fx.Graph()
    backward.placeholder("mul")
    inputs = [backward.placeholder(f"rng_state_output_{k}") for k in (7, 9)]
    backward.output(tuple(inputs))
    before = (other.name, states[0].name)
    _give_rng_state_its_backward_name(other, forward, backward)  # not an RNG state: left alone
    _give_rng_state_its_backward_name(states[1], forward, backward)
    assert (other.name, states[0].name, states[1].name) == (*before, "rng_state_output_9")


def test_a_probe_makes_fake_meta_tensors_and_plain_ones_without_fake_tensor_mode(monkeypatch):
    # NOTE [ Fake tensors in a probe ]: code written to be traced checks for a fake tensor.
    is_tracing = pytest.importorskip("transformers.utils.import_utils").is_tracing  # Hugging Face's mask code asks
    with _torch_graphs.fake_tensors() as fake:
        probe = fake(torch.empty(2, 3, device="meta"))
        assert probe.device.type == "meta" and probe.shape == (2, 3) and is_tracing(probe)
    monkeypatch.setattr(_torch_graphs, "_FakeTensorMode", None)
    meta = torch.empty(2, 3, device="meta")
    with _torch_graphs.fake_tensors() as fake:
        assert fake(meta) is meta and not is_tracing(meta)


class _Base:
    def name(self):
        return "base"


class _Inherits(_Base):
    pass


@pytest.mark.parametrize("owner", [_Inherits, _Base], ids=["inherited", "own"])
def test_an_attribute_swap_nests_and_puts_the_attribute_back_as_it_was(owner):
    swap = _torch.AttributeSwap(owner, "name", lambda self: "swapped")
    own_before = dict(vars(owner))
    with swap.active():
        with swap.active():
            assert owner().name() == "swapped"
        assert owner().name() == "swapped"  # the inner context closing leaves it swapped
    assert dict(vars(owner)) == own_before and owner().name() == "base"  # an inherited one deleted again
    assert swap.original(owner()) == "base"


def test_an_attribute_swap_puts_the_attribute_back_when_its_context_raises():
    swap = _torch.AttributeSwap(_Inherits, "name", lambda self: "swapped")
    with pytest.raises(RuntimeError), swap.active():
        raise RuntimeError
    assert "name" not in vars(_Inherits) and _Inherits().name() == "base"


class _SlowToDelete(type):
    def __delattr__(cls, name):
        time.sleep(0.1)  # the other thread runs meanwhile
        super().__delattr__(name)


class _SlowOwner(_Base, metaclass=_SlowToDelete):
    pass


def test_an_attribute_swap_opened_on_another_thread_as_one_closes_stays_swapped():
    # The main thread's close puts the attribute back slowly; the other thread opens
    # meanwhile and must find it swapped throughout, and leave it put back.
    swap = _torch.AttributeSwap(_SlowOwner, "name", lambda self: "swapped")
    closing, seen, errors = threading.Event(), [], []

    def other():
        try:
            closing.wait(10)
            time.sleep(0.02)  # inside the close's delattr
            with swap.active():
                time.sleep(0.2)  # until that close has finished
                seen.append(_SlowOwner().name())
        except Exception as error:  # noqa: BLE001 - checked below
            errors.append(error)
    thread = threading.Thread(target=other)
    thread.start()
    with swap.active():
        closing.set()
    thread.join(10)
    assert not errors and seen == ["swapped"]
    assert "name" not in vars(_SlowOwner) and _SlowOwner().name() == "base"


def test_compiled_code_runs_eagerly_on_the_asking_thread_only():
    """NOTE [ Compiled code run eagerly on one thread ]: a compiled function, a compiled
    module and a module compiled in place run their eager code on the thread inside
    compiled_code_eager, and compile on another meanwhile."""
    compiled = []

    def backend(graph, example_inputs):
        compiled.append(graph)
        return graph.forward

    function = torch.compile(lambda t: t * 3, backend=backend)
    module = torch.compile(torch.nn.Linear(3, 3), backend=backend)
    in_place = torch.nn.Linear(3, 3)
    in_place.compile(backend=backend)
    x = torch.ones(2, 3)
    inside, resume = threading.Event(), threading.Event()

    def eager_thread():
        with _torch.compiled_code_eager():
            with _torch.compiled_code_eager():  # nests
                function(x), module(x), in_place(x)
            function(x), module(x), in_place(x)
            inside.set()
            resume.wait(20)
            function(x), module(x), in_place(x)
    thread = threading.Thread(target=eager_thread)
    thread.start()
    try:
        assert inside.wait(20)
        assert not compiled
        function(x), module(x), in_place(x)
        assert compiled  # compiled here, while the other thread runs eagerly
    finally:
        resume.set()
        thread.join(20)
    found = len(compiled)
    torch.compile(lambda t: t + 1, backend=backend)(x)
    assert len(compiled) == found + 1  # nothing left forced


def test_an_untraced_frame_breaks_its_traced_caller_once_and_compiles_what_it_calls():
    """NOTE [ A frame Dynamo skips ]: the function's own ops run eagerly, the frames it
    calls compile, its traced caller breaks once there, and Dynamo never decides its
    frame; so again after a reset."""
    def inner(x):
        return x.sin() + 1

    def own(x):
        return inner(x) * 2
    untraced = _torch_graphs.untraced_frame(own)

    def outer(x):
        return untraced(x.cos()) - 1

    x = torch.randn(4)
    for _ in range(2):
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        graphs = []

        def backend(gm, example_inputs):
            graphs.append({getattr(node.target, "__name__", node.target) for node in gm.graph.nodes
                           if node.op in ("call_function", "call_method")})
            return gm.forward
        assert torch.equal(torch.compile(outer, backend=backend)(x), outer(x))
        assert sum(torch._dynamo.utils.counters["graph_break"].values()) == 1
        ops = set().union(*graphs)
        assert {"sin", "cos"} <= ops  # inner's frame compiled, and the caller's
        assert "mul" not in ops  # untraced's own op ran eagerly
        # and Dynamo's frame callback never took its frame (it takes every frame it
        # decides, at each call, a frame disable(recursive=False) makes included)
        assert own.__code__ not in torch._dynamo.convert_frame.input_codes


def test_version_counter_of_follows_the_tensor_and_its_views_without_holding_its_storage():
    from actsave._torch import version_counter_of
    t = torch.randn(1000)
    view = t.view(10, 100)
    counter = version_counter_of(t)
    storage = t.untyped_storage()._cdata
    uses = torch._C._storage_Use_Count(storage)
    assert counter.numel() == 0 and counter._version == t._version == 0
    t.add_(1)
    view.mul_(2)
    assert counter._version == t._version == 2
    assert torch._C._storage_Use_Count(storage) == uses  # holds none of it


def _never_ours(pack, unpack):
    return False


def test_torchs_checkpoint_hooks_are_a_checkpoints_and_the_callers_are_not():
    # Inside torch.utils.checkpoint's forward and its recompute, and only there: its
    # hooks are known by the module that makes them, a private detail this pins.
    seen = []

    def function(x):
        seen.append(_torch.saved_tensor_hooks_of_a_checkpoint(_never_ours))
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):  # the caller's, innermost
            seen.append(_torch.saved_tensor_hooks_of_a_checkpoint(_never_ours))
        return x.sin()

    x = torch.randn(3, requires_grad=True)
    torch.utils.checkpoint.checkpoint(function, x, use_reentrant=False).sum().backward()
    assert seen == [True, False, True, False]  # forward, then recompute
    assert not _torch.saved_tensor_hooks_of_a_checkpoint(_never_ours)
    for callers in (torch.autograd.graph.save_on_cpu, torch.autograd.graph.allow_mutation_on_saved_tensors):
        with callers():
            assert not _torch.saved_tensor_hooks_of_a_checkpoint(_never_ours)
            assert _torch.saved_tensor_hooks_of_a_checkpoint(lambda pack, unpack: True)  # what ``ours`` says


def test_a_sparse_tensors_components_are_its_indices_and_values_coalesced_or_not():
    embedding = torch.nn.Embedding(10, 4, sparse=True)
    embedding(torch.tensor([1, 2, 2])).sum().backward()
    gradient = embedding.weight.grad  # uncoalesced: index 2 twice
    assert not gradient.is_coalesced()
    indices, values = _torch.sparse_components(gradient)
    assert indices.tolist() == [[1, 2, 2]] and values.shape == (3, 4)
    csr = torch.eye(3).to_sparse_csr()
    assert [c.tolist() for c in _torch.sparse_components(csr)] == [[0, 1, 2, 3], [0, 1, 2], [1.0, 1.0, 1.0]]
    assert _torch.sparse_components(torch.zeros(2)) is None


def test_parametrize_cache_keys_are_the_keys_torch_caches_a_copys_weight_under():
    import copy as copying
    from torch import nn
    from torch.nn.utils import parametrizations, parametrize
    original = parametrizations.weight_norm(nn.Linear(4, 4))
    copy = copying.deepcopy(original)
    with parametrize.cached():
        copy.weight
        cached = set(_torch.parametrize_cache())
    assert cached <= _torch.parametrize_cache_keys(copy)
    assert (id(original), "weight") in cached  # the module the parametrization was registered on


def test_in_memory_tells_tensors_whose_elements_lie_in_memory_of_their_own():
    x = torch.randn(3, 4)
    assert _torch.in_memory(x) and _torch.in_memory(x.t())
    assert not _torch.in_memory(torch._efficientzerotensor((3, 4)))  # forward AD's zero tangent
    seen = []
    torch.func.vmap(lambda t: seen.append(_torch.in_memory(t)) or t)(x)
    torch.func.jvp(lambda t: seen.append(_torch.in_memory(t)) or t, (x,), (x,))
    assert seen == [False, False]


def test_tensors_made_outside_transforms_are_not_wrapped_by_them():
    made = []

    def function(t):
        with _torch.outside_transforms():
            made.append(torch.empty(4))
        made.append(torch.empty(4))
        return t

    x = torch.randn(3)
    torch.func.jvp(function, (x,), (x,))
    assert [_torch.in_memory(t) for t in made] == [True, False]
