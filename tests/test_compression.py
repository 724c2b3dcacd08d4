"""Compressed checkpoints end to end: gradient fidelity (SQNR against the exact model),
bytes kept, peak memory, non-finite propagation, per-layer control.

Floors sit a few dB under what was measured (seeded, so deterministic); the measured
values are in the comments. SQNR is taken over every parameter and the worst tensor
counts. Conv and Linear layers that feed a BatchNorm have no bias: BatchNorm removes it,
so its true gradient is rounding noise and no SQNR of it means anything.
"""
import pytest
import torch
from torch import nn
from torch.distributed._tools.mem_tracker import MemTracker

import actsave
from actsave import CheckpointedSequential, checkpoint, wrap
from actsave.codecs import LOSSY_CODECS
from actsave.planning.segments import plan_segments
from actsave.runtime import relu_signs, store
from support import PreActBlock, codes_and_scales, sqnr_db


def resnet_cnn(blocks: int = 16, channels: int = 16) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, channels, 3, padding=1, bias=False),
                         *[PreActBlock(channels) for _ in range(blocks)],
                         nn.BatchNorm2d(channels), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(channels, 10))


def plain_cnn(blocks: int = 16, channels: int = 16) -> nn.Sequential:
    torch.manual_seed(0)
    layers = [nn.Conv2d(3, channels, 3, padding=1, bias=False)]
    for _ in range(blocks):
        layers += [nn.Conv2d(channels, channels, 3, padding=1, bias=False), nn.BatchNorm2d(channels), nn.ReLU()]
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, 10))


class PostActBlock(nn.Module):
    """torchvision's BasicBlock layout: conv-BN-ReLU-conv-BN, plus the input, then ReLU;
    so the block's output (the next segment's kept input) is a ReLU output."""

    def __init__(self, channels: int):
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)

    def forward(self, x):
        out = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(out)) + x)


def post_activation_cnn(blocks: int = 9, channels: int = 16) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, channels, 3, padding=1, bias=False), nn.BatchNorm2d(channels), nn.ReLU(),
                         *[PostActBlock(channels) for _ in range(blocks)],
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, 10))


def mlp(activation=nn.GELU, depth: int = 16, width: int = 64) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[m for _ in range(depth) for m in (nn.Linear(width, width), activation())],
                         nn.Linear(width, 10))


def worst_gradient_sqnr(build, input_shape, codec, seed=10, segments="sqrt") -> float:
    torch.manual_seed(seed)
    x, labels = torch.randn(*input_shape), torch.randint(0, 10, (input_shape[0],))

    def gradients(model):
        nn.functional.cross_entropy(model(x), labels).backward()
        return [p.grad for p in model.parameters()]

    exact = gradients(build())
    lossy = gradients(CheckpointedSequential(*build(), segments=segments, compress=codec))
    return min(sqnr_db(a, b) for a, b in zip(exact, lossy))


# Measured over seeds 5, 6 and 10-13 (the last segment's saves stored by the codec):
# resnet int8 36.3-39.6, e4m3 24.9-26.9, e5m2 18.1-20.9; mlp int8 42.3-45.8, e4m3
# 27.3-30.7, e5m2 22.0-24.1; plain conv-BN-ReLU int8 34.4-37.8.
@pytest.mark.parametrize("model, shape, codec, floor", [
    (resnet_cnn, (32, 3, 16, 16), "int8", 34.0),     # measured 37.8 at seed 10
    (resnet_cnn, (32, 3, 16, 16), "fp8_e4m3", 25.0),  # 26.9
    (resnet_cnn, (32, 3, 16, 16), "fp8_e5m2", 19.0),  # 20.2
    (plain_cnn, (32, 3, 16, 16), "int8", 32.0),      # 35.5
    (mlp, (64, 64), "int8", 39.0),                   # 42.3
    (mlp, (64, 64), "fp8_e4m3", 25.0),               # 28.1
    (mlp, (64, 64), "fp8_e5m2", 19.0),               # 22.0
], ids=lambda v: getattr(v, "__name__", str(v)))
def test_gradient_sqnr_floors(model, shape, codec, floor):
    assert worst_gradient_sqnr(model, shape, codec) >= floor


# A segment per block or two, so that every kept input is a block output, a ReLU output,
# stored on the codec's unsigned grid (codecs, NOTE [ Unsigned grids ]); the last segment
# is the head. Batch 8. Measured over seeds 5, 6 and 10-13: int8 38.8-42.9, e4m3
# 26.9-32.5, e5m2 20.7-26.2; with the signed grids at seeds 10 / 11: int8 34.2 / 39.1,
# e4m3 23.6 / 24.7, e5m2 18.7 / 18.3.
POST_ACT_SEGMENTS = [0, 3, 5, 7, 9, 11, 12]


@pytest.mark.parametrize("codec, floor", [("int8", 35.5), ("fp8_e4m3", 24.0), ("fp8_e5m2", 18.0)])
def test_post_activation_cnn_gradient_sqnr_floors(codec, floor):
    assert worst_gradient_sqnr(post_activation_cnn, (8, 3, 16, 16), codec, segments=POST_ACT_SEGMENTS) >= floor


@pytest.mark.parametrize("codec", LOSSY_CODECS)
def test_unsigned_grids_lift_post_activation_cnns(codec, monkeypatch):
    """The same run with every tensor stored on the signed grid loses 4.6 (int8), 5.3
    (e4m3) and 6.1 dB (e5m2) of worst-tensor SQNR at seed 10."""
    unsigned = worst_gradient_sqnr(post_activation_cnn, (8, 3, 16, 16), codec, segments=POST_ACT_SEGMENTS)
    for module in (relu_signs, store):
        monkeypatch.setattr(module, "known_non_negative", lambda tensor: False)
    signed = worst_gradient_sqnr(post_activation_cnn, (8, 3, 16, 16), codec, segments=POST_ACT_SEGMENTS)
    assert unsigned >= signed + 3.0


def conv_bn_relu_chain(inplace: bool):
    """A conv-BN-ReLU chain: 16 x (Conv2d(16, 16, 3), BatchNorm2d, ReLU), flat, then a Linear
    head (the convs without bias: see the module docstring)."""
    def build():
        torch.manual_seed(0)
        layers = []
        for _ in range(16):
            layers += [nn.Conv2d(16, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU(inplace=inplace)]
        return nn.Sequential(*layers, nn.Flatten(), nn.Linear(16 * 16 * 16, 10))
    return build


# Batch 8, "sqrt": starts [0, 9, 15, 21, 30, 36, 42] on ReLU outputs (planning/segments.py,
# NOTE [ Boundaries on ReLU outputs ]). Measured over seeds 5, 6 and 10-13, in-place and not
# alike: int8 36.1-40.7, e4m3 27.2-30.4, e5m2 21.8-24.1; with the even split's
# boundaries [0, 7, 14, ...] given as a list: 32.7-37.6, 22.7-27.7, 16.5-19.9.
EVEN_SPLIT = [0, 7, 14, 21, 28, 35, 42]


@pytest.mark.parametrize("inplace", [True, False])
@pytest.mark.parametrize("codec, floor", [("int8", 37.0), ("fp8_e4m3", 26.0), ("fp8_e5m2", 20.0)])
def test_conv_bn_relu_chain_gradient_sqnr_floors(codec, floor, inplace):
    assert worst_gradient_sqnr(conv_bn_relu_chain(inplace), (8, 16, 16, 16), codec) >= floor  # 40.7, 29.7, 22.1


@pytest.mark.parametrize("codec", LOSSY_CODECS)
def test_boundaries_on_relu_outputs_lift_the_chain(codec):
    # Seed 10: int8 40.7 vs 37.6, e4m3 29.7 vs 27.7, e5m2 22.1 vs 19.9 dB.
    on_relu = worst_gradient_sqnr(conv_bn_relu_chain(True), (8, 16, 16, 16), codec)
    even = worst_gradient_sqnr(conv_bn_relu_chain(True), (8, 16, 16, 16), codec, segments=EVEN_SPLIT)
    assert on_relu >= even + 1.5


def test_exact_relu_decisions_are_what_lift_relu_networks():
    # Without the forward's ReLU decisions this MLP measured 12.7-16.4 dB with int8.
    assert worst_gradient_sqnr(lambda: mlp(nn.ReLU), (64, 64), "int8") >= 35.0  # 38.7 (38.7-46.5)


def stem_then(model, dtype=torch.float32):
    """The chain's input is an activation (produced by autograd), as inside a network."""
    torch.manual_seed(1)
    x = torch.randn(256, 64, dtype=dtype, requires_grad=True)
    return model(x * 1)


@pytest.mark.parametrize("dtype, ratio", [(torch.float32, 0.27), (torch.bfloat16, 0.53)])
@pytest.mark.parametrize("codec", ["int8", "fp8_e4m3", "fp8_e5m2"])
def test_kept_bytes_ratio_of_kept_inputs(codec, dtype, ratio):
    # The exact last segment's saves are autograd's, not in kept_bytes: compare the
    # kept inputs alone (the last segment's saves are checked below).
    checkpointed_starts = [s.start for s in plan_segments(33, "sqrt") if s.checkpointed]
    kept = {}
    for compress in (None, {start: codec for start in checkpointed_starts}):
        out = stem_then(CheckpointedSequential(*mlp(), segments="sqrt", compress=compress).to(dtype), dtype)
        kept[compress is None] = actsave.kept_bytes()["device"]
        del out
    assert kept[False] <= ratio * kept[True]  # measured 0.258 (fp32), 0.516 (bf16)


# mlp() is 33 layers, Linear at even indices. At "sqrt": inputs kept at 0, 5, 10, 15
# and 20, and the last segment, 25-32, runs as it is.
ELEMENTS = 256 * 64
KEPT_INPUTS = 5 * codes_and_scales(ELEMENTS)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("codec", ["int8", "fp8_e5m2"])
def test_last_segment_saves_are_stored_by_the_codec(codec, dtype):
    out = stem_then(CheckpointedSequential(*mlp(), segments="sqrt", compress=codec).to(dtype), dtype)
    # Each of its 8 layers saves its input (GELU and Linear alike); weight.t() is a view
    # of a parameter and stays as it is.
    assert actsave.kept_bytes()["device"] == KEPT_INPUTS + 8 * codes_and_scales(ELEMENTS)
    del out
    assert actsave.kept_bytes() == {"device": 0, "host": 0}


def test_kept_bytes_add_one_bit_per_relu_output():
    out = stem_then(CheckpointedSequential(*mlp(nn.ReLU), segments="sqrt", compress="int8"))
    relu_bits = ELEMENTS // 8
    # 12 ReLUs (odd layers 1-23) in the recomputed segments keep 1 bit per output.
    # The last segment (ReLU at 25, 27, 29, 31) stores each ReLU output once, with its
    # bits, though the next Linear saves it too; the segment input is saved by no one.
    last_segment = 4 * (codes_and_scales(ELEMENTS) + relu_bits)
    assert actsave.kept_bytes()["device"] == KEPT_INPUTS + 12 * relu_bits + last_segment
    del out
    assert actsave.kept_bytes() == {"device": 0, "host": 0}


def peak_activation_bytes(model) -> int:
    torch.manual_seed(0)
    x = torch.randn(4096, 256)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    static = sum(2 * p.numel() * p.element_size() for p in model.parameters())
    tracker = MemTracker()
    tracker.track_external(model, x)
    with tracker:
        model(x).sum().backward()
    return max(v["Total"] for v in tracker.get_tracker_snapshot("peak").values()) - static


def deep_chain(activation):
    torch.manual_seed(0)
    return [m for _ in range(64) for m in (nn.Linear(256, 256), activation())]


@pytest.mark.parametrize("activation", [nn.GELU, nn.ReLU])
def test_int8_cuts_peak_activation_memory_at_sqrt(activation, ratio=0.7):
    # At checkpoint_sequential's split (the levers at "balanced": test_sequential.py).
    # Measured 0.553 (GELU) and 0.683 (ReLU, whose 1-bit decisions cost 6.8 MiB in the
    # recomputed segments). The peak is now a recompute in backward: its working set
    # is exact in both, so the ratio cannot approach the codec's 0.26.
    exact = peak_activation_bytes(CheckpointedSequential(*deep_chain(activation), segments="sqrt"))
    int8 = peak_activation_bytes(CheckpointedSequential(*deep_chain(activation), segments="sqrt", compress="int8"))
    assert int8 <= ratio * exact


@pytest.mark.parametrize("codec", ["int8", "fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_activations_reach_the_gradients(codec, bad):
    model = CheckpointedSequential(*mlp(nn.ReLU, depth=4), segments=4, compress=codec)
    x = torch.randn(8, 64)
    x[3, 5] = bad
    model(x * 1).sum().backward()
    assert not all(torch.isfinite(p.grad).all() for p in model.parameters())


def test_integer_and_bool_inputs_are_kept_as_they_are():
    def select(x, index, mask):
        return torch.tanh(x[index] * mask)

    x = torch.randn(6, 4, requires_grad=True)
    index, mask = torch.tensor([0, 2, 4]), torch.tensor([True, False, True, True])
    out = checkpoint(select, x * 1, index, mask, compress="int8")
    expected = 6 * 4 + 4 * 1 + 3 * 8 + 4  # int8 codes and one scale, then index and mask as they are
    assert actsave.kept_bytes()["device"] == expected
    out.sum().backward()


def test_per_layer_codecs_by_index_name_and_slice():
    model = CheckpointedSequential(*mlp(), segments=[0, 4, 8, 12, 16], compress={4: "int8", "8": "fp8"})
    model.set_compression(slice(12, 14), "fp8_e5m2")
    out = stem_then(model)
    rows = {line.split()[0]: line.split() for line in model.describe().splitlines()[1:]}
    assert [rows[i][5] for i in ("0", "4", "8", "12")] == ["none", "int8", "fp8_e4m3", "fp8_e5m2"]
    assert int(rows["4"][7]) == codes_and_scales(256 * 64)
    out.sum().backward()


def test_wrap_and_checkpoint_take_the_same_codecs():
    model = nn.Sequential(*mlp(depth=4))
    wrap(model, nn.Linear, compress="fp8")
    assert model[0].policy.codec.name == "fp8_e4m3"
    with pytest.raises(actsave.ConfigError, match="use one of"):
        wrap(nn.Sequential(nn.Linear(2, 2)), nn.Linear, compress="int4")


@pytest.mark.parametrize("options", [{"compress": "int8"}, {"compress": "fp8"}, {"offload": True}])
def test_a_chain_under_vmap_keeps_its_inputs_as_they_are(options):
    # vmap's tensors are wrappers with no memory of their own for a codec or a copy.
    torch.manual_seed(0)
    layers = [nn.Linear(8, 8) if i % 2 == 0 else nn.Tanh() for i in range(6)]
    chain = CheckpointedSequential(*layers, segments=3, **options)
    x = torch.randn(4, 5, 8)
    assert torch.equal(torch.func.vmap(chain)(x), torch.func.vmap(nn.Sequential(*layers))(x))
