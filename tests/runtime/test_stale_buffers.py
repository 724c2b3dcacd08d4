"""Buffers a checkpointed forward changed and then read (runtime/stale_buffers.py, NOTE
[ Buffers read after the forward changed them ]): read changed by the recompute too,
as in a plain step, or an error naming the module and the buffer; never silently stale."""
import pytest
import torch
from torch import nn

import actsave
from actsave.runtime.nested import Range, nested_call
from support import assert_same_steps

HOWS = ["sequential", "checkpoint_module", "checkpoint_lambda"]


class InitScale(nn.Module):
    """A scale set from its first batch's statistics (ActNorm's data-dependent init),
    behind a Python flag; ``how``: changed in place ("copy_") or replaced ("assign").
    The flag and the count of calls are kept in a dict changed in place, state the
    recompute reads as the forward left it (NOTE [ Python attributes a forward sets ]
    puts back attributes the forward set, not values changed in place); with
    ``flag_attribute``, the flag is an attribute the forward sets."""

    def __init__(self, width: int = 8, how: str = "copy_", flag_attribute: bool = False):
        super().__init__()
        self.how, self.flag_attribute, self.state = how, flag_attribute, {"initialized": False, "calls": 0}
        self.initialized = False
        self.register_buffer("scale", torch.ones(width))

    @property
    def calls(self) -> int:
        return self.state["calls"]

    def forward(self, h):
        self.state["calls"] += 1
        if not (self.initialized if self.flag_attribute else self.state["initialized"]):
            with torch.no_grad():
                s = 1.0 / (h.std(0) + 1e-6)
                if self.how == "copy_":
                    self.scale.copy_(s)
                else:
                    self.scale = s
            self.state["initialized"] = self.initialized = True
        return h * self.scale  # the product saves the scale


class BufferFlagInitScale(InitScale):
    """InitScale with its flag in a buffer, which the recompute finds as the forward did."""

    def __init__(self, width: int = 8):
        super().__init__(width)
        del self.initialized, self.state
        self.register_buffer("initialized", torch.tensor(False))

    def forward(self, h):
        if not self.initialized:
            with torch.no_grad():
                self.scale.copy_(1.0 / (h.std(0) + 1e-6))
                self.initialized.fill_(True)
        return h * self.scale


class GrowTable(nn.Module):
    """A table registered again, longer, when a longer input comes; its length a Python int."""

    def __init__(self, width: int = 8):
        super().__init__()
        self.linear, self.length = nn.Linear(width, width), 1
        self.register_buffer("table", torch.ones(1), persistent=False)

    def forward(self, x):
        if x.shape[-1] > self.length:
            self.length = x.shape[-1]
            self.register_buffer("table", torch.cos(torch.arange(self.length, dtype=x.dtype) * 0.1),
                                 persistent=False)
        return self.linear(x) * self.table[: x.shape[-1]]


def chain(make_middle):
    torch.manual_seed(0)
    return [nn.Linear(8, 8), nn.GELU(), make_middle(), nn.GELU(), nn.Linear(8, 2)]


def checkpointed(how: str, layers: list) -> nn.Module:
    """``layers`` with the first three checkpointed ``how``: a CheckpointedSequential's
    segment, ``actsave.checkpoint`` of a module (known layers) or of a function calling
    it (global hooks)."""
    if how == "sequential":
        return actsave.CheckpointedSequential(*layers, segments=[3])
    inner, rest = nn.Sequential(*layers[:3]), nn.Sequential(*layers[3:])
    call = inner if how == "checkpoint_module" else (lambda t: inner(t))
    model = nn.Sequential(inner, rest)
    model.forward = lambda x: rest(actsave.checkpoint(call, x))
    return model


def assert_trains_as_plain(make_middle, how: str, steps: int = 3) -> None:
    """``steps`` steps of the chain around ``make_middle()``, plain and checkpointed
    ``how``: the input's and every parameter's gradients, and the state, bit-identical."""
    plain, model = nn.Sequential(*chain(make_middle)), checkpointed(how, chain(make_middle))
    batches = torch.randn(steps, 6, 8, generator=torch.Generator().manual_seed(1)) * 3
    assert_same_steps(plain, model, [x + step for step, x in enumerate(batches)])


@pytest.mark.parametrize("how", HOWS)
@pytest.mark.parametrize("change", ["copy_", "assign"])
def test_a_buffer_initialized_behind_a_python_flag_trains_as_plain(change, how):
    # The flag is set as the recompute runs: it would read the scale as the forward found
    # it (ones), where the forward read the one it set. It starts over with the scale as
    # the forward left it, once, on the first step only.
    assert_trains_as_plain(lambda: InitScale(how=change), how)
    middle = InitScale(how=change)
    model = checkpointed(how, chain(lambda: middle))
    for calls in (3, 5):  # the forward, the recompute, its start over; then a forward and a recompute
        model(torch.randn(6, 8)).sum().backward()
        assert middle.calls == calls


@pytest.mark.parametrize("how", HOWS)
@pytest.mark.parametrize("change", ["copy_", "assign"])
def test_a_buffer_initialized_behind_a_flag_attribute_is_initialized_again_by_the_recompute(change, how):
    # The flag is found as the forward found it, with the scale: the recompute runs the
    # initialization again on the snapshot, with no start over.
    assert_trains_as_plain(lambda: InitScale(how=change, flag_attribute=True), how)
    middle = InitScale(how=change, flag_attribute=True)
    model = checkpointed(how, chain(lambda: middle))
    for calls in (2, 4):
        model(torch.randn(6, 8)).sum().backward()
        assert middle.calls == calls and middle.initialized


@pytest.mark.parametrize("how", HOWS)
def test_a_table_registered_again_behind_a_python_int_trains_as_plain(how):
    # Its recompute would read the short table it started from (a shape the forward did not save).
    assert_trains_as_plain(GrowTable, how)


@pytest.mark.parametrize("how", HOWS)
def test_a_flag_kept_in_a_buffer_trains_as_plain(how):
    # The error's advice: the snapshot gives the recompute the flag as the forward found it.
    assert_trains_as_plain(BufferFlagInitScale, how)


class EmaThenUse(nn.Module):
    """Updates a running mean, then multiplies by it: the recompute replays the update."""

    def __init__(self, width: int = 8):
        super().__init__()
        self.calls = [0]  # changed in place: as the forward left it
        self.register_buffer("mu", torch.ones(width))

    def forward(self, h):
        self.calls[0] += 1
        with torch.no_grad():
            self.mu.mul_(0.5).add_(0.5 * h.mean(0))
        return h * self.mu


class ReadThenUpdateOnce(nn.Module):
    """Reads its buffer (saved), then replaces it behind a Python flag the forward clears:
    the recompute skips the update and reads the snapshot, which the forward read."""

    def __init__(self, width: int = 8):
        super().__init__()
        self.update = True
        self.register_buffer("mu", torch.ones(width))

    def forward(self, h):
        y = h * self.mu
        if self.update:
            self.mu = self.mu + h.detach().mean(0)
            self.update = False
        return y


@pytest.mark.parametrize("how", HOWS)
def test_a_buffer_updated_then_read_is_replayed_without_starting_over(how):
    assert_trains_as_plain(EmaThenUse, how)
    middle = EmaThenUse()
    checkpointed(how, chain(lambda: middle))(torch.randn(6, 8)).sum().backward()
    assert middle.calls == [2]


@pytest.mark.parametrize("how", HOWS)
def test_a_buffer_read_then_updated_behind_a_python_flag_is_read_as_the_forward_read_it(how):
    assert_trains_as_plain(ReadThenUpdateOnce, how, steps=1)


class ReadBeforeAndAfterInit(InitScale):
    """InitScale that also saves its scale before setting a new one: no one value of the
    scale gives both of its recompute's reads (plain autograd trains it)."""

    def __init__(self):
        super().__init__(how="assign")

    def forward(self, h):
        return super().forward(h * self.scale)


@pytest.mark.parametrize("how", HOWS)
def test_a_flagged_buffer_read_before_and_after_its_change_raises_naming_it(how):
    nn.Sequential(*chain(ReadBeforeAndAfterInit))(torch.randn(6, 8)).sum().backward()  # plain
    model = checkpointed(how, chain(ReadBeforeAndAfterInit))
    out = model(torch.randn(6, 8, requires_grad=True))
    with pytest.raises(actsave.RecomputeError, match=r"ReadBeforeAndAfterInit's buffer 'scale' was changed .* "
                                                     r"also read it before changing it.* Keep that state in a buffer"):
        out.sum().backward()


@pytest.mark.parametrize("how", HOWS)
def test_a_flagged_buffer_changed_after_the_forward_raises_naming_it(how):
    middle = InitScale()
    out = checkpointed(how, chain(lambda: middle))(torch.randn(6, 8, requires_grad=True))
    middle.scale.mul_(2)  # the value the forward read is gone
    with pytest.raises(actsave.RecomputeError, match=r"InitScale's buffer 'scale' .* changed after the forward "
                                                     r"read it.*initialize before checkpointing"):
        out.sum().backward()


def test_a_flagged_buffer_read_by_a_backward_inside_the_forward_raises_naming_it():
    # That recompute runs from the caller's inputs while the forward runs: it cannot start over.
    layers = chain(InitScale)
    inner = nn.Sequential(*layers[:3])

    def penalized(x):
        h = inner(x)
        (g,) = torch.autograd.grad(h.square().sum(), x, create_graph=True)
        return h + g

    with pytest.raises(actsave.RecomputeError, match="InitScale's buffer 'scale' .* cannot start over"):
        actsave.checkpoint(penalized, torch.randn(6, 8, requires_grad=True))


def test_a_flagged_buffer_in_a_nested_recompute_raises_naming_it():
    layers = chain(InitScale)
    out, _ = nested_call(layers, Range(0, 5, inner=(Range(0, 2), Range(2, 5, recomputed=False))),
                         torch.randn(6, 8, requires_grad=True))
    with pytest.raises(actsave.RecomputeError, match="InitScale's buffer 'scale' .* nested recompute's pass"):
        out.sum().backward()
