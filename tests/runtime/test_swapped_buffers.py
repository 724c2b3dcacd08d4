"""Buffers a call swaps in for the forward, ``torch.func.functional_call`` inside a
checkpointed function (runtime/swapped_buffers.py, NOTE [ Buffers swapped in for a
call ]): updated once, by the forward, and read by the recompute as the forward read
them, as in a plain step (torch.utils.checkpoint updates them twice)."""
import torch
from torch import nn
from torch.func import functional_call

import actsave


class Center(nn.Module):
    """Subtracts a running mean, then updates it: a buffer read, then changed."""

    def __init__(self, width: int = 8):
        super().__init__()
        self.register_buffer("ema", torch.zeros(width))

    def forward(self, x):
        y = x - self.ema
        with torch.no_grad():
            self.ema.mul_(0.9).add_(0.1 * x.mean(0))
        return y


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Tanh(), Center(), nn.Linear(8, 8), nn.Tanh(),
                         nn.Linear(8, 1))


def _steps(run, steps: int = 2) -> tuple:
    """Two steps of ``run(function, x)`` over ``functional_call`` with the parameters
    and buffers passed in: ``(parameter gradients, input gradients, the buffers passed,
    the module's own buffers)`` after them."""
    model = _model()
    params = {k: v.detach().clone().requires_grad_() for k, v in model.named_parameters()}
    buffers = {k: v.detach().clone() for k, v in model.named_buffers()}

    def function(x):
        return functional_call(model, (params, buffers), (x,))

    input_grads = []
    for step in range(steps):
        torch.manual_seed(step + 1)
        x = torch.randn(6, 8, requires_grad=True)
        run(function, x).pow(2).sum().backward()
        input_grads.append(x.grad)
    return ({k: p.grad for k, p in params.items()}, input_grads, buffers, dict(model.named_buffers()))


def test_buffers_passed_to_functional_call_are_updated_once_and_read_as_the_forward_read_them():
    plain = _steps(lambda function, x: function(x))
    checkpointed = _steps(lambda function, x: actsave.checkpoint(function, x))
    for expected, got in zip(plain, checkpointed):
        if isinstance(expected, dict):
            assert expected.keys() == got.keys()
            expected, got = list(expected.values()), list(got.values())
        for a, b in zip(expected, got):
            assert torch.equal(a, b)
    assert checkpointed[2]["1.num_batches_tracked"].item() == 2  # one update a step
    assert checkpointed[3]["1.num_batches_tracked"].item() == 0  # the model's own: not run


def test_a_forward_that_swaps_nothing_watches_no_module_call_in_its_recompute(monkeypatch):
    from actsave.runtime import swapped_buffers

    installed = []
    real = swapped_buffers._installing
    monkeypatch.setattr(swapped_buffers, "_installing", lambda *a: installed.append(a) or real(*a))
    model = _model()
    x = torch.randn(6, 8, requires_grad=True)
    actsave.checkpoint(model, x).sum().backward()
    assert installed == []
    _steps(lambda function, x: actsave.checkpoint(function, x), steps=1)
    assert len(installed) == 1


def _equal_states(expected: tuple, got: tuple) -> bool:
    return all(torch.equal(a, b) for a, b in zip(expected, got))


def test_a_dict_passed_alone_keeps_the_callers_tensors_and_their_updates():
    """``functional_call(module, buffers, ...)`` writes each slot's tensor back into a dict
    passed alone as it returns: the recompute's stand-ins must not end up there (the
    buffers of another module, a teacher's, were updated only by the first step)."""
    def run(wrap):
        torch.manual_seed(0)
        bn, other = nn.BatchNorm1d(4), nn.BatchNorm1d(4)
        buffers = dict(other.named_buffers())
        for _ in range(3):
            x = torch.randn(8, 4, requires_grad=True)
            wrap(lambda t: functional_call(bn, buffers, (t,)), x).square().sum().backward()
        assert all(buffers[name] is tensor for name, tensor in other.named_buffers())
        return tuple(other.buffers())

    assert _equal_states(run(lambda function, x: function(x)), run(actsave.checkpoint))


def test_a_qat_models_fused_fake_quantization_swapped_in_is_updated_once():
    """The default QAT qconfigs' fused fake quantization updates its observer's buffers,
    never called themselves: swapped in, they get their stand-ins with the calling
    module's (the x86 qconfig's per-channel weights raised an IndexError in the
    recompute, qnnpack's gradients were 2.7e-3 off)."""
    import torch.ao.quantization as quantization

    def run(wrap, qconfig):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
        model.qconfig = quantization.get_default_qat_qconfig(qconfig)
        quantization.prepare_qat(model.train(), inplace=True)
        buffers, params = {k: v.clone() for k, v in model.named_buffers()}, dict(model.named_parameters())
        grads = []
        for _ in range(3):
            x = torch.randn(8, 16, requires_grad=True)
            wrap(lambda t: functional_call(model, (params, buffers), (t,)), x).square().sum().backward()
            grads.append(x.grad)
        return (*grads, *buffers.values())

    for qconfig in ("x86", "qnnpack"):
        assert _equal_states(run(lambda function, x: function(x), qconfig), run(actsave.checkpoint, qconfig))


def test_two_checkpointed_calls_over_swapped_buffers_before_one_backward():
    """The second call updates the buffers the first one's recompute reads from its
    snapshot: they are mutated state, not state read and then changed (which raises)."""
    def run(wrap):
        torch.manual_seed(0)
        bn = nn.BatchNorm1d(4)
        params = dict(bn.named_parameters())
        buffers = {k: v.clone() for k, v in bn.named_buffers()}
        x1, x2 = (torch.randn(8, 4, requires_grad=True) for _ in range(2))

        def function(t):
            return functional_call(bn, (params, buffers), (t,))

        (wrap(function, x1) * 2 + wrap(function, x2)).square().sum().backward()
        return (x1.grad, x2.grad, *buffers.values())

    assert _equal_states(run(lambda function, x: function(x)), run(actsave.checkpoint))


class _ReplacedEma(nn.Module):
    """Sets a new tensor in its buffer's slot, read first: ``functional_call`` given one
    dict writes it back into the dict."""

    def __init__(self):
        super().__init__()
        self.register_buffer("ema", torch.zeros(8))

    def forward(self, x):
        y = x - self.ema
        self.ema = (0.9 * self.ema + 0.1 * x.mean(0)).detach()
        return y


def test_a_buffer_a_module_replaces_in_a_dict_passed_alone_is_updated_once():
    # The recompute swaps in what the forward left in the dict: it reads the stand-in
    # there too (was: the forward's result, updated a second time, as under torch's checkpoint).
    def run(wrap):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 8), _ReplacedEma(), nn.Tanh(), nn.Linear(8, 1))
        state = {**{k: v.detach().clone().requires_grad_() for k, v in model.named_parameters()},
                 **{k: v.clone() for k, v in model.named_buffers()}}
        for _ in range(2):
            wrap(lambda x: functional_call(model, state, (x,)), torch.randn(6, 8)).square().sum().backward()
        return (state["0.weight"].grad, state["1.ema"])

    assert _equal_states(run(lambda function, x: function(x)), run(actsave.checkpoint))
