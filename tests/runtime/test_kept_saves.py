"""The last segment's saves stored by its codec (actsave/runtime/kept_saves.py): what is
stored, what is held as it is, exact ReLU decisions, and other saved-tensor hooks."""
import pytest
import torch
from support import CallCounter, channel_means, codes_and_scales, sqnr_db
from torch import nn
from torch.utils.checkpoint import checkpoint as torch_checkpoint

import actsave
from actsave import CheckpointedSequential
from actsave.runtime import pool_decisions


def last_segment_only(*layers, compress="int8") -> CheckpointedSequential:
    """One segment: the last, so everything it saves is kept, none recomputed."""
    return CheckpointedSequential(*layers, segments=1, compress=compress)


def test_one_segment_with_a_codec_recomputes_nothing():
    # ActNN's mode: every save stored by the codec, each layer run once.
    model = last_segment_only(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    counter = CallCounter(model)
    model(torch.randn(4, 8, requires_grad=True) * 1).sum().backward()
    assert counter.counts == {"0": 1, "1": 1, "2": 1}
    assert model.describe().splitlines()[1].split()[4:6] == ["saves", "int8"]


def test_parameters_and_batchnorm_statistics_are_held_as_they_are():
    torch.manual_seed(0)
    model = last_segment_only(nn.Conv2d(4, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU())
    x = torch.randn(2, 4, 8, 8, requires_grad=True)
    out = model(x * 1)
    # Stored: the conv's input and the BatchNorm's input, each with its channel means
    # (signed conv activations are centered), the ReLU's output with 1 bit per element.
    # Held: the weights, running and batch statistics (leaves).
    conv_in, activation = 2 * 4 * 8 * 8, 2 * 8 * 8 * 8
    expected = (codes_and_scales(conv_in) + channel_means(4) + 2 * codes_and_scales(activation)
                + channel_means(8) + activation // 8)
    assert actsave.stored_bytes()["device"] == expected
    out.sum().backward()
    assert actsave.stored_bytes() == {"device": 0, "host": 0}


def test_a_relu_output_and_its_view_are_stored_once():
    torch.manual_seed(0)
    model = last_segment_only(nn.ReLU(), nn.Linear(128, 4))  # the Linear saves a (6, 128) view
    out = model(torch.randn(2, 3, 128, requires_grad=True) * 1)
    assert actsave.stored_bytes()["device"] == codes_and_scales(768) + 768 // 8
    out.sum().backward()


class Product(nn.Module):
    def forward(self, x):
        return (x * 2) * (x * 3)  # saves two tensors of one shape, alive together


@pytest.mark.parametrize("device", ["cpu", "meta"])  # meta: what actsave.estimate runs
def test_distinct_saves_of_one_shape_are_stored_apart(device):
    out = last_segment_only(Product())(torch.ones(4, 128, device=device, requires_grad=True) * 1)
    assert actsave.stored_bytes()["device"] == 2 * codes_and_scales(512)
    del out


def test_relu_decisions_are_the_forwards_where_the_codec_rounds_to_zero():
    # One group: 1000 sets the int8 step to about 7.9, so the small positives code to 0.
    x = torch.tensor([1000.0, 1e-3, 2.0, -1e-3, 3e-2, -5.0] * 8, requires_grad=True)
    last_segment_only(nn.ReLU())(x * 1).sum().backward()
    assert torch.equal(x.grad, (x > 0).float())


def test_gradients_are_close_and_training_runs_twice_with_retain_graph():
    torch.manual_seed(0)
    layers = [nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10)]
    plain, lossy = nn.Sequential(*layers), last_segment_only(*layers)
    x = torch.randn(32, 64)
    plain(x).square().sum().backward()
    expected = [p.grad.clone() for p in plain.parameters()]
    plain.zero_grad()
    out = lossy(x).square().sum()
    out.backward(retain_graph=True)
    once = [p.grad.clone() for p in lossy.parameters()]
    out.backward()
    for e, g, twice in zip(expected, once, lossy.parameters()):
        assert sqnr_db(e, g) >= 35  # measured 45.8 (worst tensor)
        assert torch.equal(twice.grad, 2 * g)


def test_an_exception_in_the_forward_keeps_nothing():
    class Boom(nn.Module):
        def forward(self, x):
            raise RuntimeError("boom")

    model = last_segment_only(nn.Linear(8, 8), nn.ReLU(), Boom())
    with pytest.raises(RuntimeError, match="boom"):
        model(torch.randn(4, 8, requires_grad=True) * 1)
    assert actsave.stored_bytes() == {"device": 0, "host": 0}


@pytest.mark.parametrize("outer", ["torch_checkpoint", "save_on_cpu"])
def test_saves_are_left_to_other_saved_tensor_hooks(outer):
    # An outer checkpoint recomputes the last segment and counts its saves: hiding them
    # behind our hooks would break it. The saves stay exact, as with compress=None there.
    torch.manual_seed(0)
    layers = [nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4)]
    x = torch.randn(8, 16, requires_grad=True)
    exact_last = CheckpointedSequential(*layers, segments=[0, 2], compress={0: "int8"})
    exact_last(x * 1).sum().backward()
    expected = [p.grad.clone() for p in exact_last.parameters()]
    exact_last.zero_grad()

    model = CheckpointedSequential(*layers, segments=[0, 2], compress="int8")
    if outer == "torch_checkpoint":
        out = torch_checkpoint(model, x * 1, use_reentrant=False)
    else:
        with torch.autograd.graph.save_on_cpu():
            out = model(x * 1)
    out.sum().backward()
    for e, p in zip(expected, model.parameters()):
        assert torch.equal(e, p.grad)


def test_relu_outputs_are_stored_on_the_unsigned_grid():
    grids = []

    class Recording(type(actsave.codecs.get_codec("int8"))):
        def encode(self, x, non_negative=False):
            grids.append((tuple(x.shape), non_negative))
            return super().encode(x, non_negative)

    recording = Recording("int8", 37.0)
    out = last_segment_only(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2), compress=recording)(
        torch.randn(4, 8, requires_grad=True) * 1)
    # The first Linear's input (signed); the ReLU output, saved by the ReLU and the
    # second Linear, stored once and unsigned.
    assert grids == [((4, 8), False), ((4, 16), True)]
    out.sum().backward()


def pooled_step() -> tuple:
    """(stored bytes after the forward, parameter gradients) of a last segment with a
    max pool, under int8."""
    torch.manual_seed(0)
    model = last_segment_only(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(3, 2, 1), nn.Flatten(),
                              nn.Linear(8 * 4 * 4, 2))
    out = model(torch.randn(2, 3, 8, 8, requires_grad=True) * 1)
    stored = actsave.stored_bytes()["device"]
    out.sum().backward()
    assert actsave.stored_bytes() == {"device": 0, "host": 0}
    return stored, [p.grad for p in model.parameters()]


def test_max_pool_indices_are_stored_as_window_decisions_exactly(monkeypatch):
    stored, gradients = pooled_step()
    monkeypatch.setattr(pool_decisions.Window, "of", classmethod(lambda cls, module: None))
    held_stored, held_gradients = pooled_step()  # the int64 indices held by autograd, uncounted
    assert all(torch.equal(a, b) for a, b in zip(gradients, held_gradients))  # decoded exactly
    # 4 bits per 3x3 window where the int64 indices took 64: 2 x 8 planes of 4 x 4.
    assert stored - held_stored == 2 * 8 * 4 * 4 * 4 // 8


@pytest.mark.parametrize("compress", ["int8", "fp8"])
@pytest.mark.parametrize("segments", [1, [0, 2]])
def test_a_weight_changed_before_backward_raises_as_nn_sequential_does(compress, segments):
    # Where hooks are set autograd checks no version: the store checks them itself.
    torch.manual_seed(0)
    model = CheckpointedSequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4), segments=segments,
                                   compress=compress)
    out = model(torch.randn(8, 16)).square().sum()
    with torch.no_grad():
        model[2].weight.mul_(0.5)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.backward()


def test_a_stored_activation_changed_in_place_raises_even_after_it_is_freed():
    # The Tanh's output is encoded; the store follows its version counter without
    # holding its storage, through a view that outlives it.
    model = last_segment_only(nn.Linear(16, 16), nn.Tanh())
    out = model(torch.randn(8, 16, requires_grad=True) * 1)
    view = out.view(-1)
    loss = out.sum()
    del out
    with torch.no_grad():
        view.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_saves_unchanged_since_the_forward_unpack_as_before():
    torch.manual_seed(0)
    model = last_segment_only(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))
    x = torch.randn(8, 16, requires_grad=True)
    model(x * 1).sum().backward()
    assert x.grad is not None and actsave.stored_bytes() == {"device": 0, "host": 0}
