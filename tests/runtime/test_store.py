"""Kept inputs and the stored_bytes() ledger."""
import gc

import pytest
import torch

import actsave
from actsave import ConfigError
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
