"""Chains for the planning tests: random chains (Linear layers of chosen widths, each
followed by one layer of a chosen kind), small versions of the bench models, and a
profile made to look measured on CUDA."""
import dataclasses
import importlib.util
import sys
from pathlib import Path

import torch
from hypothesis import strategies as st
from support import deep_mlp
from torch import nn

import actsave


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


def with_host_copies(prof: actsave.Profile) -> actsave.Profile:
    """The profile as if measured on CUDA, where offload is a lever: copies that take
    1-4x as long as the layer's forward, so they are partly exposed."""
    layers = tuple(dataclasses.replace(layer,
                                       to_host_s={c: (1 + i % 4) * layer.forward_s for c in layer.kept_bytes},
                                       to_device_s={c: 2 * layer.forward_s for c in layer.kept_bytes})
                   for i, layer in enumerate(prof.layers))
    return dataclasses.replace(prof, layers=layers, device="cuda")


def bench_models():
    """bench/models.py (bench/ is no package)."""
    name = "bench_models"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().parents[2] / "bench" / "models.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def bench_like_chain(name: str) -> tuple:
    """(model, x): a small version of a bench model."""
    torch.manual_seed(0)
    models = bench_models()
    if name == "resnet":
        return models.cifar_resnet(20), torch.randn(2, 3, 16, 16)
    if name == "conv-bn-relu":
        return models.conv_bn_relu_chain(4, channels=8, image_size=8), torch.randn(4, 8, 8, 8)
    if name == "mlp":
        return nn.Sequential(*deep_mlp(6, 32)), torch.randn(16, 32)
    if name == "gpt":
        return models.gpt(3, width=32, heads=2, vocab_size=64, max_seq_len=16), torch.randint(0, 64, (2, 16))
    raise ValueError(name)


BENCH_LIKE_CHAINS = ("resnet", "conv-bn-relu", "mlp", "gpt")


def max_pool_chain(pools: int = 4) -> tuple:
    """(layers, x): a conv, then (3x3 max pool at stride 1, conv, Tanh) per pool, and a
    head, at 16x16. Stride 1 keeps every pool's output large: its decisions (4 bits per
    output, kept by a lossy segment) move the peak."""
    torch.manual_seed(0)
    layers = [nn.Conv2d(3, 16, 3, padding=1)]
    for _ in range(pools):
        layers += [nn.MaxPool2d(3, 1, 1), nn.Conv2d(16, 16, 3, padding=1), nn.Tanh()]
    return layers + [nn.Flatten(), nn.Linear(16 * 16 * 16, 10)], torch.randn(8, 3, 16, 16) * 1
