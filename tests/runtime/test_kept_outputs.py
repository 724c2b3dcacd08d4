"""A selective recompute's kept outputs stored by a codec or on the host
(actsave/runtime/kept_outputs.py): exact where no codec is used, within each codec's
gradient floor where one is, stored once per storage, version-checked."""
import pytest
import torch
import torch.nn.functional as F
from support import OpCounter, sqnr_db
from transformer_blocks import GPTBlock, LlamaBlock, rope, stack
from torch import nn

import actsave
from actsave.codecs import EXPECTED_GRADIENT_SQNR_DB, get_codec
from actsave.errors import RecomputeError
from actsave.runtime.keep_rules import KeepPolicy
from actsave.runtime.recompute_options import DEFAULT_RECOMPUTE
from actsave.runtime.kept_ops import KeptOps
from actsave.runtime.selective import selective_call

KINDS = {"gpt": (GPTBlock, ()), "llama": (LlamaBlock, rope())}
ACTIVATION = 2 * 16 * 32 * 4  # bytes of one (2, 16, 32) fp32 activation


def gradients(blocks, x, policy=None, extra=()):
    """Parameter gradients of a step through ``blocks``: plain (``policy`` None) or
    each block selective with ``policy``; and what the selective forward kept."""
    torch.manual_seed(7)
    y, kept = x.clone().requires_grad_(), []
    for block in blocks:
        if policy is None:
            y = block(y, *extra)
        else:
            y, k = selective_call(block, (y, *extra), {}, KeptOps(), DEFAULT_RECOMPUTE, policy=policy)
            kept.append(k)
    stored = actsave.kept_bytes()
    with OpCounter() as backward:
        y.square().sum().backward()
    return [p.grad for p in blocks.parameters()], kept, stored, backward.counts


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_offloaded_kept_outputs_give_bit_identical_gradients_and_leave_the_device(kind):
    block, extra = KINDS[kind]
    x = torch.randn(2, 16, 32)
    expected, *_ = gradients(stack(block), x, extra=extra)
    got, kept, stored, backward = gradients(stack(block), x, KeepPolicy.resolve(None, True), extra)
    assert all(torch.equal(e, g) for e, g in zip(expected, got))
    # On the device: only the first block's input, the leaf the caller holds (and the
    # Llama's rotary tables, cos and sin, counted once though each of the 3 blocks keeps
    # them: NOTE [ One stored copy per kept tensor ]); everything else on the host.
    assert stored["device"] == ACTIVATION + (2 * 16 * 8 * 4 if kind == "llama" else 0)
    assert stored["host"] == sum(kept) - stored["device"]
    assert backward["aten.mm.default"] > 0 and backward["aten.addmm.default"] == 0  # no Linear ran again
    assert actsave.kept_bytes() == {"device": 0, "host": 0}


@pytest.mark.parametrize("codec", ["int8", "fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("offload", [False, True])
def test_encoded_kept_outputs_keep_less_within_the_codecs_gradient_floor(kind, codec, offload):
    block, extra = KINDS[kind]
    x = torch.randn(2, 16, 32)
    expected, exact, *_ = gradients(stack(block), x, KeepPolicy.resolve(), extra)
    got, kept, stored, backward = gradients(stack(block), x, KeepPolicy.resolve(codec, offload), extra)
    floor = EXPECTED_GRADIENT_SQNR_DB[get_codec(codec).name]
    assert min(sqnr_db(e, g) for e, g in zip(expected, got)) >= floor
    # The blocks after the first keep their input and outputs at 1 byte an element and
    # their scales, less than a third of the exact 4 (the attention statistics stay exact).
    assert kept[1] < exact[1] / 3
    assert stored["host" if offload else "device"] >= sum(kept[1:])
    assert backward["aten.addmm.default"] == 0
    assert actsave.kept_bytes() == {"device": 0, "host": 0}


def test_views_of_one_output_are_stored_once_and_come_back_as_the_views_they_were():
    torch.manual_seed(0)
    block = GPTBlock()
    x = torch.randn(2, 16, 32, requires_grad=True)
    _, exact = selective_call(block, (x * 1,), {}, KeptOps(), DEFAULT_RECOMPUTE)
    _, offloaded = selective_call(block, (x * 1,), {}, KeptOps(), DEFAULT_RECOMPUTE,
                                  policy=KeepPolicy.resolve(None, True))
    # The exact count counts each storage once (qkv's output, which attention's q, k, v
    # view; fc1's output, which GELU saves): so does the host copy, byte for byte.
    assert offloaded == exact
    assert actsave.kept_bytes() == {"device": 0, "host": exact}  # its input (made by x * 1) too


class ChangesItsOutputAfterwards(nn.Module):
    """A block whose caller changes a kept tensor (fc's output, which GELU saves and
    the block returns) in place before backward."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        h = self.fc(x)
        return h, F.gelu(h)


@pytest.mark.parametrize("policy", [KeepPolicy.resolve("int8"), KeepPolicy.resolve(None, True)])
def test_a_stored_tensor_changed_in_place_before_backward_raises_as_nn_sequential_does(policy):
    x = torch.randn(4, 8, requires_grad=True)
    (h, out), _ = selective_call(ChangesItsOutputAfterwards(), (x * 1,), {}, KeptOps(), DEFAULT_RECOMPUTE,
                                 policy=policy)
    with torch.no_grad():
        h.add_(1)  # the stored copy is the forward's value; autograd's rule still holds
    with pytest.raises(RecomputeError, match="modified by an inplace operation"):
        out.sum().backward()


@pytest.mark.parametrize("how", ["Checkpoint", "wrap"])
def test_selective_with_a_codec_is_a_keep_option_of_the_wrappers(how):
    torch.manual_seed(0)
    plain = stack(GPTBlock)
    model = stack(GPTBlock)
    if how == "wrap":
        actsave.wrap(model, GPTBlock, keep="selective", compress="fp8")
        assert "keep='selective'" in repr(model[0]) and "fp8" in repr(model[0])
    else:
        model = nn.ModuleList(actsave.Checkpoint(b, keep="selective", compress="int8") for b in model)
    x = torch.randn(2, 16, 32)
    expected = gradients(plain, x)[0]
    got = gradients(model, x)[0]
    assert min(sqnr_db(e, g) for e, g in zip(expected, got)) >= EXPECTED_GRADIENT_SQNR_DB["fp8_e4m3"]


class _WrappedOutput(nn.Linear):
    """A Linear whose output is a wrapper subclass (DTensor's kind): its elements lie in
    the tensors it wraps, not in a storage of its own."""

    def forward(self, x):
        two_tensor = pytest.importorskip("torch.testing._internal.two_tensor")
        out = super().forward(x)
        return two_tensor.TwoTensor(out, out * 1)


class _ReadsItsWrappedOutput(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc, self.ln = _WrappedOutput(8, 8), nn.LayerNorm(8)

    def forward(self, x):
        return self.ln(self.fc(x) + 1)


@pytest.mark.parametrize("stored", [{"offload": True}, {"compress": "int8"}], ids=["offloaded", "by int8"])
def test_a_kept_output_of_a_wrapper_subclass_is_kept_as_it_is(stored):
    # Copied or encoded as a storage, it read memory it does not have (the process died).
    x = torch.randn(4, 8)
    plain, model = _ReadsItsWrappedOutput(), _ReadsItsWrappedOutput()
    plain(x).square().sum().backward()
    actsave.Checkpoint(model, keep="selective", **stored)(x).square().sum().backward()
    assert [p.grad is None for p in plain.parameters()] == [p.grad is None for p in model.parameters()]
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(plain.parameters(), model.parameters())
               if p.grad is not None)
