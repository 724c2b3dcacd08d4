"""Codec registry and the Packed container."""
import pytest
import torch

from actsave import ConfigError
from actsave.codecs import IDENTITY, available_codecs, get_codec


def test_none_and_its_name_are_the_exact_codec():
    assert get_codec(None) is get_codec("none") is IDENTITY
    assert available_codecs()[:2] == [None, "none"]


def test_identity_stores_the_tensor_itself():
    x = torch.randn(3, 5).t()
    packed = IDENTITY.encode(x)
    assert IDENTITY.decode(packed) is x
    assert packed.nbytes == x.numel() * 4 and packed.shape == x.shape and packed.dtype == x.dtype


@pytest.mark.parametrize("name", ["int4", "", 8, object()])
def test_unknown_names_are_refused_with_the_valid_ones(name):
    with pytest.raises(ConfigError, match="is not a codec; use one of"):
        get_codec(name)
