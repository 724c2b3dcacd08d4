"""torch.export of models that contain actsave: NOTE [ torch.export ] in
runtime/compiled_calls.py. The exported program is the plain model's forward."""
import copy

import pytest
import torch
from torch import nn

import actsave
from actsave.codecs import EXPECTED_GRADIENT_SQNR_DB
from support import sqnr_db


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(16), nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(self.norm(x))))


def _stack() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(Block(), Block(), nn.Linear(16, 4))


WRAPPED = {
    "exact": lambda m: actsave.wrap(m, Block),
    "int8": lambda m: actsave.wrap(m, Block, compress="int8"),
    "selective": lambda m: actsave.wrap(m, Block, keep="selective"),
    "saves by fp8": lambda m: actsave.wrap(m, Block, keep="saves", compress="fp8"),
    "chain, int8": lambda m: actsave.CheckpointedSequential(*m, compress="int8", segments=[0, 1, 2]),
    "chain, exact": lambda m: actsave.CheckpointedSequential(*m, segments=[0, 1, 2]),
}


@pytest.mark.parametrize("strict", [False, True])
@pytest.mark.parametrize("mode", ["train", "eval"])
@pytest.mark.parametrize("name", list(WRAPPED))
def test_a_model_with_actsave_exports_the_plain_forward(name, mode, strict):
    plain = _stack()
    model = WRAPPED[name](copy.deepcopy(plain))
    getattr(model, mode)(), getattr(plain, mode)()
    x = torch.randn(8, 16)
    program = torch.export.export(model, (x,), strict=strict)
    assert torch.equal(program.module()(x), plain(x))
    assert actsave.kept_bytes() == {"device": 0, "host": 0}


def test_a_model_exported_with_codecs_trains_again_as_before():
    # The export left actsave's hooks and wrappers as they were: int8 keeps its blocks' inputs.
    plain, model = _stack(), actsave.wrap(_stack(), Block, compress="int8")
    x = torch.randn(8, 16)
    torch.export.export(model, (x,))
    out = model(x)
    assert 0 < actsave.kept_bytes()["device"] < 2 * x.numel() * x.element_size()
    out.sum().backward()
    plain(x).sum().backward()
    assert actsave.kept_bytes() == {"device": 0, "host": 0}
    worst = min(sqnr_db(p.grad, q.grad) for p, q in zip(plain.parameters(), model.parameters()))
    assert worst >= EXPECTED_GRADIENT_SQNR_DB["int8"]


@pytest.mark.parametrize("name", ["exact", "chain, exact"])
def test_torchscript_refuses_a_model_with_actsave_saying_what_to_use(name):
    model = WRAPPED[name](_stack())
    with pytest.raises(actsave.ConfigError, match=r"torch.jit.script cannot compile .*Script the plain model"):
        torch.jit.script(model)


@pytest.mark.parametrize("name", list(WRAPPED))
def test_a_trace_of_a_model_with_actsave_records_the_plain_forward(name):
    # torch.jit.trace records the forward it runs, grad mode on (its default), as ONNX's
    # TorchScript exporter does: NOTE [ torch.export ].
    plain = _stack().eval()
    model = WRAPPED[name](copy.deepcopy(plain)).eval()
    x = torch.randn(8, 16)
    traced = torch.jit.trace(model, (x,))  # checks the trace against a second run
    assert torch.equal(traced(x), plain(x))
    assert actsave.kept_bytes() == {"device": 0, "host": 0}
