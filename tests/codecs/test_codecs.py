"""Codec registry and the Packed container."""
import csv
import dataclasses
import inspect
import json
from pathlib import Path

import pytest
import torch

import actsave
from actsave import ConfigError
from actsave.codecs import EXPECTED_GRADIENT_SQNR_DB, IDENTITY, LOSSY_CODECS, Packed, available_codecs, get_codec
from support import DENSE_LAYOUTS, NOT_DENSE, same_bits

CPU_RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results" / "cpu.csv"


def test_none_and_its_name_are_the_exact_codec():
    assert get_codec(None) is get_codec("none") is IDENTITY
    assert available_codecs()[:2] == [None, "none"]


def test_identity_stores_the_tensor_itself():
    x = torch.randn(3, 5).t()
    packed = IDENTITY.encode(x)
    assert IDENTITY.decode(packed) is x
    assert packed.nbytes == x.numel() * 4 and packed.shape == x.shape and packed.dtype == x.dtype


@pytest.mark.parametrize("layout", DENSE_LAYOUTS)
def test_identity_keeps_the_layout(layout):
    x = DENSE_LAYOUTS[layout]()
    decoded = IDENTITY.decode(IDENTITY.encode(x))
    assert decoded.stride() == x.stride() and torch.equal(decoded, x)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("codec", LOSSY_CODECS)
@pytest.mark.parametrize("layout", DENSE_LAYOUTS)
def test_a_lossy_codec_decodes_into_the_inputs_layout_the_bits_of_its_contiguous_copy(layout, codec, backend):
    # NOTE [ Kept layouts ]: the codes stay row-major; decode gives the strides back.
    x = DENSE_LAYOUTS[layout]()
    with actsave.set_backend(backend):
        packed = get_codec(codec).encode(x)
        decoded = get_codec(codec).decode(packed)
        from_contiguous = get_codec(codec).decode(get_codec(codec).encode(x.contiguous()))
    assert packed.strides == x.stride()
    assert decoded.stride() == x.stride() and same_bits(decoded, from_contiguous)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("codec", LOSSY_CODECS)
@pytest.mark.parametrize("make", [lambda: torch.randn(4, 256), lambda: torch.randn(256, 4).t(),
                                  lambda: torch.randn(4, 256, dtype=torch.float64)],
                         ids=["contiguous", "transposed", "float64"])
def test_a_tensor_with_the_negative_bit_stores_the_bits_of_its_values(make, codec, backend):
    # torch._neg_view (publicly the .imag of a conj() view) negates what memory holds;
    # the kernels read memory, and stored the values' negation.
    base = make()
    negated = torch._neg_view(base)
    with actsave.set_backend(backend):
        packed, resolved = get_codec(codec).encode(negated), get_codec(codec).encode(negated.resolve_neg())
        decoded = get_codec(codec).decode(packed)
    for name, tensor in resolved.tensors().items():
        assert same_bits(packed.tensors()[name], tensor)
    assert not decoded.is_neg() and same_bits(decoded, get_codec(codec).decode(resolved))


@pytest.mark.parametrize("codec", LOSSY_CODECS)
def test_a_contiguous_input_records_no_strides_and_decodes_as_a_view(codec):
    packed = get_codec(codec).encode(torch.randn(2, 3, 4, 5))
    decoded = get_codec(codec).decode(packed)
    assert packed.strides is None and decoded.is_contiguous() and decoded._base is not None


@pytest.mark.parametrize("view", NOT_DENSE)
def test_a_tensor_that_is_not_dense_decodes_as_empty_like_lays_it_out(view):
    x = NOT_DENSE[view]()
    codec = get_codec("int8")
    decoded = codec.decode(codec.encode(x))
    assert decoded.stride() == torch.empty_like(x).stride()
    assert same_bits(decoded, codec.decode(codec.encode(x.contiguous())))


def test_the_strides_travel_with_the_metadata():
    # What an offloaded packed value is taken apart into and assembled from (runtime/store.py).
    packed = get_codec("int8").encode(DENSE_LAYOUTS["channels_last"]())
    again = Packed.assemble(packed.tensors(), packed.metadata())
    assert again.strides == packed.strides and again.metadata() == packed.metadata()


def test_packed_takes_its_fields_in_order_with_their_defaults_and_stays_frozen():
    # Packed writes its fields itself (a frozen dataclass's __init__ costs host work).
    data, shape = torch.zeros(3, dtype=torch.int8), torch.Size([3])
    assert list(inspect.signature(Packed).parameters) == [f.name for f in dataclasses.fields(Packed)]
    packed = Packed(data, None, shape, torch.float32)
    defaults = {f.name: f.default for f in dataclasses.fields(Packed) if f.default is not dataclasses.MISSING}
    assert defaults == {"unsigned": False, "offsets": None, "strides": None}
    assert {name: getattr(packed, name) for name in defaults} == defaults
    assert Packed(data, None, shape, torch.float32, True, data, (1,)) == Packed(
        data=data, scales=None, shape=shape, dtype=torch.float32, unsigned=True, offsets=data, strides=(1,))
    with pytest.raises(dataclasses.FrozenInstanceError):
        packed.unsigned = True
    assert dataclasses.replace(packed, unsigned=True).unsigned and not packed.unsigned


@pytest.mark.parametrize("name", ["int4", "", 8, object()])
def test_unknown_names_are_refused_with_the_valid_ones(name):
    with pytest.raises(ConfigError, match="is not a codec; use one of"):
        get_codec(name)


def test_expected_gradient_sqnr_is_the_fidelity_bench_figure_rounded_down():
    # The planner's min_sqnr_db reads these figures: each is the lowest median worst
    # tensor SQNR of bench/fidelity.py's float32 cases at their own plans, rounded down.
    with CPU_RESULTS.open(newline="") as f:
        rows = [r for r in csv.DictReader(f) if r["bench"] == "fidelity" and r["metric"] == "worst_tensor_sqnr"]
    lowest = {}
    for row in rows:
        config = json.loads(row["config_json"])
        dtype = config.get("dtype", "float32")  # rows from before --dtype are float32
        if dtype == "float32" and config["segments"] in ("balanced", "sqrt"):
            codec = row["provider"].removeprefix("actsave_")
            lowest[codec] = min(lowest.get(codec, float("inf")), float(row["p50"]))
    assert set(lowest) == set(LOSSY_CODECS)
    for codec in LOSSY_CODECS:
        assert lowest[codec] - 1 < EXPECTED_GRADIENT_SQNR_DB[codec] <= lowest[codec], codec


@pytest.mark.parametrize("codec", LOSSY_CODECS)
@pytest.mark.parametrize("shape", [(8, 16, 16, 16), (5000,)], ids=["4d", "1d_partial_group"])
def test_non_negative_encoding_allocates_no_more_than_signed(codec, shape):
    """The planner profiles each codec's encode on signed samples
    (planning/codec_costs.py); a ReLU output, on the unsigned grid with all-zero
    groups, must rise no higher (torch references, which CPU steps run)."""
    from actsave.planning.live_bytes import LiveBytes

    def rise(x, non_negative):
        tracker = LiveBytes("cpu", known=[x])
        with tracker, tracker.span() as peak:
            get_codec(codec).encode(x, non_negative=non_negative)
        return peak[0]

    torch.manual_seed(0)
    signed = torch.randn(shape)
    relu = torch.randn(shape).relu_()
    relu.view(-1)[: 4 * 128] = 0  # whole groups of zeros
    assert rise(relu, non_negative=True) <= rise(signed, non_negative=False)


@pytest.mark.parametrize("name", ["int8", "fp8_e4m3", "fp8_e5m2"])
def test_a_codec_traced_into_one_graph_stores_the_bits_it_stores_eagerly(name):
    # NOTE [ Codecs in a compiled graph ]: the references run traced, where no branch
    # may read a value; tiny groups (pre-scaled), zero groups and non-finite values
    # take their own paths eagerly.
    codec = get_codec(name)
    x = torch.randn(4, 8, 3, 3)
    x[0] *= 2.0**-80  # tiny groups
    x[1] = 0.0
    x[2, 0, 0, 0], x[2, 1, 0, 0], x[3, 0, 0, 0] = float("inf"), float("nan"), -float("inf")

    def round_trip(t):
        packed = codec.encode(t)
        return packed.data, packed.scales, packed.offsets, codec.decode(packed)
    torch._dynamo.reset()
    traced = torch.compile(round_trip, backend="aot_eager", fullgraph=True)(x)
    for got, expected in zip(traced, round_trip(x)):
        assert torch.equal(got.view(torch.uint8), expected.view(torch.uint8))


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("codec", LOSSY_CODECS)
def test_float64_values_beyond_float32s_range_decode_finite_and_infinities_stay(codec, backend):
    # float64 goes through float32: a finite value beyond its range is kept at its largest,
    # never as inf; an inf stays one.
    largest = torch.finfo(torch.float32).max
    x = torch.tensor([1.0, 2.0, 1e39, -1e300, *[0.5] * 124], dtype=torch.float64)
    x = torch.cat([x, torch.tensor([float("inf"), 1.0, -1e39, 3.0] * 32, dtype=torch.float64)])
    with actsave.set_backend(backend):
        decoded = get_codec(codec).decode(get_codec(codec).encode(x))
    assert decoded.dtype == torch.float64 and decoded[128] == float("inf")
    finite = x.isfinite()
    assert decoded[finite].isfinite().all()
    assert decoded[2] > largest / 2 and decoded[3] < -largest / 2  # the group's largest, as its codes round
