"""actsave/runtime/graph_codecs.py: which segments make decisions a compiled recompute
cannot keep, and the saved-tensor hooks set and unset around a compiled forward (NOTE [
Codecs in a compiled graph ]). The compiled models themselves: tests/compile/."""
import copy
import gc
import inspect
import io
import threading
import weakref

import pytest
import torch
from torch.autograd.graph import saved_tensors_hooks

import actsave
from actsave import _torch, _torch_graphs
from actsave.runtime import graph_codecs
from actsave.runtime.keep_rules import KeepPolicy
from support import ResidualBlock, ResidualNet

INT8 = KeepPolicy.resolve("int8")


def test_hooks_on_sets_actsave_hooks_and_hooks_off_unsets_only_them():
    assert _torch.top_saved_tensor_hooks() is None
    assert graph_codecs.hooks_on()
    pack, unpack = _torch.top_saved_tensor_hooks()
    assert isinstance(pack, torch.fx.GraphModule) and isinstance(unpack, torch.fx.GraphModule)
    graph_codecs.hooks_off()
    assert _torch.top_saved_tensor_hooks() is None
    with saved_tensors_hooks(lambda t: t, lambda t: t):
        graph_codecs.hooks_off()  # not ours: left alone
        assert _torch.top_saved_tensor_hooks() is not None


def test_hooks_on_refuses_under_other_hooks_and_sets_nothing():
    with saved_tensors_hooks(lambda t: t, lambda t: t):
        theirs = _torch.top_saved_tensor_hooks()
        assert not graph_codecs.hooks_on()
        assert _torch.top_saved_tensor_hooks() == theirs


def test_hooks_a_failed_forward_left_set_are_unset_by_the_next_hooks_on():
    assert graph_codecs.hooks_on()
    assert graph_codecs.hooks_on()  # the first is taken for a failed forward's and replaced
    graph_codecs.hooks_off()
    assert _torch.top_saved_tensor_hooks() is None


def test_called_eagerly_the_hooks_keep_every_tensor_as_it_is():
    # Outside AOTAutograd's trace there is no saved node: nothing is encoded.
    pack, unpack = graph_codecs._the_hooks()
    x = torch.randn(4, 8)
    assert pack(x) is x and unpack(x) is x


@pytest.fixture(autouse=True)
def no_hooks_left():
    yield
    while _torch.top_saved_tensor_hooks() == graph_codecs._the_hooks():
        _torch_graphs.pop_saved_tensor_hooks()


def test_wrap_sets_a_lossy_model_roots_forward_once_and_eager_steps_probe_nothing():
    model = ResidualNet(depth=2)
    actsave.wrap(model, ResidualBlock, compress="int8")
    root_forward = model.forward
    actsave.wrap(model, ResidualBlock, compress="fp8")
    assert isinstance(root_forward, graph_codecs.RootForward) and model.forward is root_forward
    assert root_forward.previous is None and not model._forward_pre_hooks and not model._forward_hooks
    model(torch.randn(4, 8)).sum().backward()
    assert model not in graph_codecs._probed and not graph_codecs._set_for_blocks()
    exact = actsave.wrap(ResidualNet(depth=2), ResidualBlock)
    assert "forward" not in exact.__dict__  # nothing to set for exact blocks


def test_a_roots_forward_keeps_the_models_signature_and_calls_a_forward_set_on_it_before():
    model, calls = ResidualNet(depth=2), []

    def logged(x):
        calls.append(x.shape)
        return ResidualNet.forward(model, x)
    model.forward = logged
    actsave.wrap(model, ResidualBlock, compress="int8")
    model(torch.randn(4, 8))
    assert calls == [torch.Size([4, 8])] and model.forward.previous is logged
    assert inspect.signature(model.forward) == inspect.signature(logged)
    assert inspect.signature(actsave.wrap(ResidualNet(depth=2), ResidualBlock, compress="int8").forward) == \
        inspect.signature(ResidualNet(depth=2).forward)


class FalsyForward:
    """A forward that is falsy, as an empty container is."""

    def __init__(self, model):
        self.model = model

    def __len__(self):
        return 0

    def __call__(self, features):
        return ResidualNet.forward(self.model, features)


def test_a_roots_forward_takes_the_signature_of_a_falsy_forward_set_before():
    model = ResidualNet(depth=2)
    model.forward = FalsyForward(model)
    actsave.wrap(model, ResidualBlock, compress="int8")
    assert list(inspect.signature(model.forward).parameters) == ["features"]
    assert model(torch.randn(4, 8)).shape == (4, 2)


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_a_copied_wrapped_model_calls_its_own_forward(how):
    model = actsave.wrap(ResidualNet(depth=2, dropout=0.0), ResidualBlock, compress="int8")
    if how == "deepcopy":
        copied = copy.deepcopy(model)
    else:
        buffer = io.BytesIO()
        torch.save(model, buffer)
        buffer.seek(0)
        copied = torch.load(buffer, weights_only=False)
    assert isinstance(copied.forward, graph_codecs.RootForward) and copied.forward.model is copied
    with torch.no_grad():
        copied.head.weight.add_(1.0)  # the copy's own parameters are used, not the original's
        x = torch.randn(4, 8)
        torch.testing.assert_close(copied(x), ResidualNet.forward(copied, x))
        assert not torch.equal(copied(x), model(x))


def test_in_a_graph_only_what_a_codec_takes_is_copied_for_it():
    # As eagerly (keep_rules.should_encode): no codec reads a float8 tensor.
    kinds = [torch.float32, torch.float8_e4m3fn]
    args = [torch.zeros(4, dtype=dtype).requires_grad_() for dtype in kinds]
    (copied, kept), _ = graph_codecs.inputs_copied(tuple(args), {}, INT8)
    assert copied is not args[0] and kept is args[1]


def test_a_wrapped_model_is_freed_with_its_last_reference(no_collector):
    # Its forward (a RootForward on the instance) refers back to it weakly: a cycle
    # would hold the model's parameters, on a GPU its memory, until a garbage collection.
    model = actsave.wrap(ResidualNet(depth=2), ResidualBlock, compress="int8")
    model(torch.randn(4, 8)).sum().backward()
    weight = weakref.ref(model.head.weight)
    del model
    assert weight() is None


def test_a_roots_flag_is_its_threads_and_compiled_code_follows_it():
    # Set at a root's break for the blocks Dynamo traces on that thread only; Dynamo
    # must guard on it (it would take a threading.local subclass's class attribute for
    # a constant).
    policy = KeepPolicy.resolve("int8", False)
    compiled = torch.compile(lambda x: x + 1 if graph_codecs.blocks_in_graph(policy, None) else x - 1,
                             backend="eager")
    x = torch.zeros(1)
    assert compiled(x).item() == -1
    graph_codecs._this_thread.set_for_blocks = True
    try:
        assert compiled(x).item() == 1
        seen = []
        thread = threading.Thread(target=lambda: seen.append(compiled(x).item()))
        thread.start()
        thread.join(20)
        assert seen == [-1]
    finally:
        graph_codecs._this_thread.set_for_blocks = False
    assert compiled(x).item() == -1


def test_the_forward_of_a_freed_wrapped_model_says_so():
    forward = actsave.wrap(ResidualNet(depth=2), ResidualBlock, compress="int8").forward
    gc.collect()
    with pytest.raises(ReferenceError, match="hold the model"):
        forward(torch.randn(4, 8))
