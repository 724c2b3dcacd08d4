"""Random chains of layers for the planning tests: Linear layers of chosen widths, each
followed by one layer of a chosen kind."""
import torch
from hypothesis import strategies as st
from torch import nn


class Residual(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width))

    def forward(self, x):
        return x + self.body(x)


WIDTHS = (16, 32, 64, 128)


LAYER_KINDS = {
    "relu": lambda w: nn.ReLU(),
    "gelu": lambda w: nn.GELU(),
    "tanh": lambda w: nn.Tanh(),
    "sigmoid": lambda w: nn.Sigmoid(),
    "dropout": lambda w: nn.Dropout(0.2),
    "batchnorm": lambda w: nn.BatchNorm1d(w),
    "layernorm": lambda w: nn.LayerNorm(w),
    "residual": Residual,
}


def chain(kinds: list, widths: list) -> list:
    """Linear layers of the given widths, each followed by one layer of ``kinds``."""
    torch.manual_seed(0)
    layers, width = [], 32
    for kind, out in zip(kinds, widths):
        layers += [nn.Linear(width, out), LAYER_KINDS[kind](out)]
        width = out
    return layers


random_chains = st.integers(1, 6).flatmap(lambda n: st.tuples(
    st.lists(st.sampled_from(sorted(LAYER_KINDS)), min_size=n, max_size=n),
    st.lists(st.sampled_from(WIDTHS), min_size=n, max_size=n)))
