"""Kept inputs and the stored_bytes() ledger."""
import gc

import pytest
import torch

import actsave
from actsave import ConfigError
from actsave.codecs import sqnr_db
from actsave.runtime.store import EXACT, KeepPolicy, KeptInputs


def test_kept_inputs_count_tensors_and_keep_other_values():
    x = torch.randn(4, 4, requires_grad=True) * 1
    kept = KeptInputs((x, 3, "s"), {"mask": None, "bias": torch.ones(2, dtype=torch.float64)}, EXACT, False)
    assert kept.nbytes == 4 * 4 * 4 + 2 * 8 == actsave.stored_bytes()["device"]
    with torch.enable_grad():
        (y, n, s), kwargs = kept.restore()
    assert torch.equal(y, x) and y.requires_grad and y.grad_fn is None
    assert (n, s, kwargs["mask"]) == (3, "s", None)
    kept.release()
    assert actsave.stored_bytes() == {"device": 0, "host": 0}
    with pytest.raises(actsave.RecomputeError, match="already released"):
        kept.restore()


def test_ledger_is_settled_when_kept_inputs_are_garbage_collected():
    kept = KeptInputs((torch.randn(8),), {}, EXACT, False)
    assert actsave.stored_bytes()["device"] == 32
    del kept
    gc.collect()
    assert actsave.stored_bytes() == {"device": 0, "host": 0}


def test_private_copy_is_unaffected_by_later_in_place_changes():
    x = torch.randn(4)
    kept = KeptInputs((x,), {}, EXACT, private_copy=True)
    original = x.clone()
    x.zero_()
    (restored,), _ = kept.restore()
    assert torch.equal(restored, original)


@pytest.mark.parametrize("offload", [1, "yes", None])
def test_offload_must_be_a_bool(offload):
    with pytest.raises(ConfigError, match="offload=.* must be True or False"):
        KeepPolicy.resolve(offload=offload)


def _kept_packed(tensor, codec="int8"):
    kept = KeptInputs((tensor,), {}, KeepPolicy.resolve(compress=codec), False)
    return kept.tensors[0].storage.fetch()


def test_a_relu_output_is_kept_on_the_unsigned_grid():
    # Known by its autograd node, without reading it (codecs, NOTE [unsigned grids]).
    x = torch.randn(4, 64, requires_grad=True)
    assert _kept_packed(torch.relu(x)).unsigned
    assert _kept_packed(torch.relu(x), "fp8_e5m2").unsigned
    assert not _kept_packed(x * 1).unsigned
    changed = torch.relu(x)
    changed.sub_(1)  # no longer a ReLU output: its node is the subtraction's
    assert not _kept_packed(changed).unsigned


def test_unsigned_kept_input_restores_closer_with_the_same_bytes():
    x = torch.relu(torch.randn(16, 128, requires_grad=True))
    signed = KeptInputs((x * 1,), {}, KeepPolicy.resolve(compress="fp8_e4m3"), False)
    unsigned = KeptInputs((x,), {}, KeepPolicy.resolve(compress="fp8_e4m3"), False)
    assert unsigned.nbytes == signed.nbytes
    (from_signed,), _ = signed.restore()
    (from_unsigned,), _ = unsigned.restore()
    assert sqnr_db(x, from_unsigned) >= sqnr_db(x, from_signed) + 5.0  # 38 vs 32 dB
