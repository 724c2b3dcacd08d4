"""Codec kernels: encode and decode per codec, input layout and dtype, each result
checked bit for bit against its torch reference before anything is timed; then the
decision kernels (pack a ReLU output's bits, restore a recomputed output to them,
rows ``relu_signs``; a ReLU6's save the same way, rows ``bounds``; a 2x2 max pool's
window decisions encoded from its indices, decoded into them and the pooled output
gathered at them, rows ``max_pool``) per dtype, checked and timed alike.

Layouts, the ones training stores (GroupCodec.encode; NOTE [ Channel centering ]):

  flat        a 1-D Gaussian tensor, signed grid, no channel means (the case measured
              before the others existed; its rows keep their old names, codec-dtype)
  c32x32      N, C, 32, 32 conv activations minus their channel means (channel_size a
              multiple of the group: one mean per thread's run)
  c8x8        N, C, 8, 8 (channel_size 64, not a multiple of 128: groups span channels)
  c14x14      N, C, 14, 14 (channel_size 196, not a multiple of 16: a run may cross
              into the next channel, RUN_CHANNELS 2)
  relu32x32   N, C, 32, 32 ReLU outputs on the unsigned grid (uint8, ue4m4, ue5m3);
              also encoded with their ReLU decisions from the same read (``signs=True``,
              NOTE [ Signs from the encoder's read ]: metrics ``encode_signs``), against
              an encode and a pack (rows ``relu_signs``) apart

On CUDA each measurement is the median over batches of GPU time per call: a batch is
``--repeats`` calls queued back to back behind a GPU sleep long enough for the host to
queue them all, so that Python and launch overhead (also reported, as host_us per call)
do not leave the GPU idle between calls; inputs rotate over enough copies that they do
not stay in L2. Bandwidth counts bytes read plus bytes written (values, codes, scales,
channel means), against a device-to-device copy of the same input (read + write)
measured in the same run (goal: at least 80% of it from 64 MiB up). On CPU the kernels
run under Triton's interpreter, whose times mean nothing: the script checks correctness
and reports bytes only.

    python bench/kernels.py [--sizes-mib 1,16,64,256] [--repeats 20] [--out PATH] [--quick | --smoke]
                            [--tiles 4096x8,2048x4]

``--tiles`` runs every case once per tile (elements x warps per program, encoders and
decoders alike), the layout column naming it: how the tiles of _tile.py were chosen.

``--quick`` (sizes 64 and 256 MiB, every codec and layout, fp32 and bf16) is the run for
a short GPU lease; ``--smoke`` one tiny size, for the CPU tests. Sizes are MiB of fp32
(half as many bytes for the half dtypes, as in the rows measured before).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import time
from dataclasses import dataclass
from functools import partial
from typing import Optional

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernels are defined

import harness  # noqa: E402  (bench/ is on sys.path when this script runs)

from actsave.text import format_table  # noqa: E402
from actsave.codecs import LOSSY_CODECS  # noqa: E402
from actsave.codecs.centering import channel_sums  # noqa: E402
from actsave.triton_kernels import UNSIGNED_VARIANT, _tile, channel_size, kernel_table  # noqa: E402
from actsave.triton_kernels.decisions import bounds, max_pool, relu_signs  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# Channels of the conv-shaped layouts, as in a ResNet's middle stages; the batch grows
# with the size asked for.
CHANNELS, SMOKE_CHANNELS = 64, 4


@dataclass(frozen=True)
class Layout:
    """An input as training stores it: ``spatial`` (H, W) for an N, C, H, W tensor
    (None: 1-D), centered by its channel means, or non-negative on the unsigned grid."""

    spatial: Optional[tuple]
    centered: bool
    unsigned: bool

    def make(self, numel: int, channels: int, device, dtype) -> torch.Tensor:
        if self.spatial is None:
            return torch.randn(numel, device=device).to(dtype)
        per_sample = channels * math.prod(self.spatial)
        shape = (max(1, round(numel / per_sample)), channels, *self.spatial)
        # Channel means several times the spread, as conv outputs before their BatchNorm.
        x = torch.randn(shape, device=device) + 4 * torch.randn(1, channels, 1, 1, device=device)
        return (x.relu_() if self.unsigned else x).to(dtype)


LAYOUTS = {
    "flat": Layout(None, centered=False, unsigned=False),
    "c32x32": Layout((32, 32), centered=True, unsigned=False),
    "c8x8": Layout((8, 8), centered=True, unsigned=False),
    "c14x14": Layout((14, 14), centered=True, unsigned=False),
    "relu32x32": Layout((32, 32), centered=False, unsigned=True),
}


def case_name(codec: str, layout: str, dtype: str) -> str:
    return f"{codec}-{dtype}" if layout == "flat" else f"{codec}-{layout}-{dtype}"


class Codec:
    """The kernels (or references) of a codec's format for one layout, as GroupCodec
    calls them: the channels' sums from ``channel_sums`` where centered, the unsigned variant of
    the format for non-negative tensors."""

    def __init__(self, codec: str, layout: Layout):
        self.layout = layout
        fmt = UNSIGNED_VARIANT[codec] if layout.unsigned else codec
        self.format = fmt
        self._encode, self._decode = (kernel_table()[fmt, direction] for direction in ("encode", "decode"))

    def sums(self, x):
        return channel_sums(x) if self.layout.centered else None

    def encode(self, x, sums, reference=False):
        function = self._encode.reference if reference else self._encode.launcher
        return function(x, **self._encode.format_args, sums=sums)

    def encode_with_signs(self, x, reference=False):
        """``(codes, scales, bits)`` of a ReLU output (the unsigned layout's)."""
        function = self._encode.reference if reference else self._encode.launcher
        return function(x, **self._encode.format_args, signs=True)

    def decode(self, codes, scales, x, sums, reference=False):
        function = self._decode.reference if reference else self._decode.launcher
        return function(codes, scales, **self._decode.format_args, dtype=x.dtype, sums=sums,
                        channel_size=channel_size(x.shape))


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits, so NaNs compare by pattern."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def check_against_reference(codec: Codec, x: torch.Tensor, sums) -> tuple:
    """Encode and decode with the kernels; raise unless they equal the references."""
    codes, scales = codec.encode(x, sums)
    ref_codes, ref_scales = codec.encode(x, sums, reference=True)
    decoded = codec.decode(codes, scales, x, sums)
    expected = codec.decode(ref_codes, ref_scales, x, sums, reference=True)
    if not (torch.equal(codes, ref_codes) and torch.equal(bits(scales), bits(ref_scales))
            and torch.equal(bits(decoded), bits(expected))):
        raise AssertionError(f"{codec.format} on {x.dtype} {tuple(x.shape)}: kernel differs from reference")
    if codec.layout.unsigned:
        check_signs_against_reference(codec, x)
    return codes, scales


def check_signs_against_reference(codec: Codec, x: torch.Tensor) -> None:
    """Encode a ReLU output with its decisions; raise unless codes, scales and bits equal
    the references'."""
    got, expected = codec.encode_with_signs(x), codec.encode_with_signs(x, reference=True)
    if not all(torch.equal(bits(a), bits(b)) for a, b in zip(got, expected)):
        raise AssertionError(f"{codec.format} with signs on {x.dtype} {tuple(x.shape)}: kernel differs from reference")


class GpuTimer:
    """GPU seconds per call of a function, its calls queued behind a GPU sleep (module
    docstring), and the host's seconds per call; ``l2_bytes`` is the device's L2."""

    def __init__(self, device: torch.device, repeats: int, batches: int = 5):
        self.repeats, self.batches = repeats, batches
        self.l2_bytes = torch.cuda.get_device_properties(device).L2_cache_size
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        cycles = 10**7
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
        end.synchronize()
        self.seconds_per_cycle = start.elapsed_time(end) / 1e3 / cycles

    def __call__(self, function) -> tuple:
        function()  # compile and warm outside the timing
        torch.cuda.synchronize()
        host_start = time.perf_counter()
        function()
        torch.cuda.synchronize()
        per_call = time.perf_counter() - host_start  # an upper bound of the host's time per call
        gpu, host = [], []
        while len(gpu) < self.batches:
            sleep = 2 * per_call * self.repeats + 1e-3
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda._sleep(int(sleep / self.seconds_per_cycle))
            start.record()
            host_start = time.perf_counter()
            for _ in range(self.repeats):
                function()
            queued = time.perf_counter() - host_start
            end.record()
            end.synchronize()
            if queued > sleep:  # the GPU may have waited for the host: sleep longer
                per_call = queued / self.repeats
                continue
            gpu.append(start.elapsed_time(end) / 1e3 / self.repeats)
            host.append(queued / self.repeats)
        return statistics.median(gpu), statistics.median(host)


def rotating(inputs: list):
    """A function of no argument that yields the inputs in turn."""
    state = {"next": 0}

    def take():
        item = inputs[state["next"] % len(inputs)]
        state["next"] += 1
        return item
    return take


def copies_beyond_l2(x: torch.Tensor, timer: GpuTimer) -> list:
    """``x`` and enough copies of it that a call taking them in turn finds none of it
    in L2 (4x its size, at most 8 tensors)."""
    copies = max(1, min(8, math.ceil(4 * timer.l2_bytes / (x.numel() * x.element_size()))))
    return [x] + [x.clone() for _ in range(copies - 1)]


def copy_gbps(inputs: list, timer: GpuTimer) -> float:
    """A device-to-device copy's GB/s (bytes read plus written) over ``inputs`` in turn:
    the yardstick of every ``*_pct_copy``, reported so that a reader can judge it."""
    pairs = rotating([(x, torch.empty_like(x)) for x in inputs])
    seconds, _ = timer(lambda: (lambda source, target: target.copy_(source))(*pairs()))
    return 2 * inputs[0].numel() * inputs[0].element_size() / seconds / 1e9


def timed(row: dict, name: str, run, moved: int, timer: GpuTimer) -> None:
    """``row``'s ``name``_ms, _gbps (``moved`` bytes), _pct_copy and _host_us of ``run``."""
    seconds, host = timer(run)
    row[f"{name}_ms"], row[f"{name}_gbps"] = seconds * 1e3, moved / seconds / 1e9
    row[f"{name}_pct_copy"], row[f"{name}_host_us"] = 100 * row[f"{name}_gbps"] / row["copy_gbps"], host * 1e6


def measure(codec_name: str, layout_name: str, dtype: torch.dtype, numel: int, channels: int,
            device: torch.device, timer: Optional[GpuTimer] = None) -> dict:
    """One case's row: the bytes stored, and with a ``timer`` (on CUDA) the copy, encode
    and decode times and bandwidths."""
    codec = Codec(codec_name, LAYOUTS[layout_name])
    torch.manual_seed(0)
    x = codec.layout.make(numel, channels, device, dtype)
    sums = codec.sums(x)
    codes, scales = check_against_reference(codec, x, sums)
    value_bytes = x.numel() * x.element_size()
    stored = codes.numel() * codes.element_size() + scales.numel() * 4 + (sums.numel() * 4 if sums is not None else 0)
    row = {"bytes_ratio": stored / value_bytes}
    if timer is None:
        return row
    inputs = copies_beyond_l2(x, timer)
    encoded = [(x, codes, scales)] + [(c, *codec.encode(c, sums)) for c in inputs[1:]]
    row["copy_gbps"] = copy_gbps(inputs, timer)
    moved = value_bytes + stored  # each direction reads one side and writes the other
    next_input, next_encoded = rotating(inputs), rotating(encoded)
    timed(row, "encode", lambda: codec.encode(next_input(), sums), moved, timer)
    timed(row, "decode", lambda: (lambda source, c, s: codec.decode(c, s, source, sums))(*next_encoded()), moved,
          timer)
    if codec.layout.centered:  # one read of the tensor, before encoding (channel_sums)
        row["means_ms"] = timer(lambda: codec.sums(next_input()))[0] * 1e3
    if codec.layout.unsigned:  # and one bit per value written
        timed(row, "encode_signs", lambda: codec.encode_with_signs(next_input()), moved + -(-x.numel() // 8), timer)
    return row


UNITS = {"bytes_ratio": "x", "copy_gbps": "GB/s",
         **{f"{step}_{metric}": unit for step in ("encode", "decode", "encode_signs", "pack", "restore", "gather")
            for metric, unit in (("ms", "ms"), ("gbps", "GB/s"), ("pct_copy", "%"), ("host_us", "us"))},
         "means_ms": "ms"}


def measure_relu_decisions(dtype: torch.dtype, numel: int, device: torch.device,
                           timer: Optional[GpuTimer] = None) -> dict:
    """The ReLU decision kernels (triton_kernels/decisions/relu_signs.py) on a ReLU
    output of ``numel`` values: see :func:`measure_decisions`."""
    torch.manual_seed(0)
    recomputed = torch.randn(numel, device=device).to(dtype)  # both signs: both corrections run
    return measure_decisions("ReLU", recomputed.relu(), recomputed, relu_signs.pack_relu_signs,
                             relu_signs.restore_relu_signs_, relu_signs.pack_relu_signs_ref,
                             relu_signs.restore_relu_signs_ref_, timer)


def measure_bound_decisions(dtype: torch.dtype, numel: int, device: torch.device,
                            timer: Optional[GpuTimer] = None) -> dict:
    """The bound decision kernels (triton_kernels/decisions/bounds.py) on a ReLU6's
    save of ``numel`` values, a recompute of it moved across both bounds in places:
    see :func:`measure_decisions`."""
    torch.manual_seed(0)
    forward = (torch.randn(numel, device=device) * 4).to(dtype)
    recomputed = forward + (torch.randn(numel, device=device) * 0.1).to(dtype)
    return measure_decisions("ReLU6", forward, recomputed, *(partial(kernel, low=0.0, high=6.0) for kernel in (
        bounds.pack_bounds, bounds.restore_bounds_, bounds.pack_bounds_ref, bounds.restore_bounds_ref_)),
        timer=timer)


# The pool measured: 2x2 windows at stride 2 over N, 16, H, W, as a ResNet's stem pool.
POOL_CHANNELS, POOL_WINDOW = 16, (2, 2)


def measure_max_pool_decisions(dtype: torch.dtype, numel: int, device: torch.device,
                               timer: Optional[GpuTimer] = None) -> dict:
    """The max-pool decision kernels (triton_kernels/decisions/max_pool.py) on a max
    pool of about ``numel`` values: each window's winner encoded from the int64 indices
    the pool returns, decoded back into them, and the pooled output gathered at them
    (what a lossy recompute runs), each checked against its reference; with a ``timer``
    (on CUDA) their times and bandwidths against a copy of the pool's input. An encode
    reads the indices and writes their bits; a decode the reverse; a gather reads the
    indices and a value per window and writes the pooled output."""
    torch.manual_seed(0)
    side = max(2, math.isqrt(max(1, numel // (2 * POOL_CHANNELS))) // 2 * 2)
    x = torch.randn(2, POOL_CHANNELS, side, side, device=device).to(dtype)
    pooled, indices = torch.nn.functional.max_pool2d(x, POOL_WINDOW, POOL_WINDOW, return_indices=True)
    geometry = (tuple(x.shape[-2:]), POOL_WINDOW, POOL_WINDOW, (0, 0), (1, 1))
    packed = max_pool.encode_max_pool(indices, *geometry)
    decoded, gathered = torch.empty_like(indices), torch.empty_like(pooled)
    max_pool.decode_max_pool_(decoded, packed, *geometry)
    max_pool.gather_max_pool_(gathered, x, indices, 2)
    if not (torch.equal(packed, max_pool.encode_max_pool_ref(indices, *geometry)) and torch.equal(decoded, indices)
            and torch.equal(bits(gathered), bits(pooled))):
        raise AssertionError(f"max-pool decisions on {dtype} ({x.numel()} values): kernel differs from reference")
    index_bytes, value_bytes = indices.numel() * indices.element_size(), pooled.numel() * pooled.element_size()
    row = {"bytes_ratio": packed.numel() / index_bytes}
    if timer is None:
        return row
    inputs = copies_beyond_l2(x, timer)
    row["copy_gbps"] = copy_gbps(inputs, timer)
    all_indices = copies_beyond_l2(indices, timer)
    next_indices = rotating(all_indices)
    next_decode = rotating([(torch.empty_like(i), max_pool.encode_max_pool(i, *geometry)) for i in all_indices])
    # The values a gather reads rotate with the indices, beyond L2 as they are.
    next_gather = rotating([(torch.empty_like(pooled), inputs[k % len(inputs)], i) for k, i in enumerate(all_indices)])
    timed(row, "encode", lambda: max_pool.encode_max_pool(next_indices(), *geometry), index_bytes + packed.numel(),
          timer)
    timed(row, "decode", lambda: max_pool.decode_max_pool_(*next_decode(), *geometry), index_bytes + packed.numel(),
          timer)
    timed(row, "gather", lambda: max_pool.gather_max_pool_(*next_gather(), 2), index_bytes + 2 * value_bytes, timer)
    return row


def measure_decisions(name: str, saved, recomputed, pack, restore_, pack_ref, restore_ref_,
                      timer: Optional[GpuTimer] = None) -> dict:
    """A pack of ``saved``'s decisions and a restore of ``recomputed`` to them, checked
    against the references; with a ``timer`` (on CUDA) their times and bandwidths
    against a copy. A pack reads the save and writes its bits; a restore reads a
    recomputed save and the bits and writes the save."""
    packed = pack(saved)
    restored, expected = recomputed.clone(), recomputed.clone()
    restore_(restored, packed)
    restore_ref_(expected, pack_ref(saved))
    if not (torch.equal(packed, pack_ref(saved)) and torch.equal(bits(restored), bits(expected))):
        raise AssertionError(f"{name} decisions on {saved.dtype} ({saved.numel()} values): kernel differs from "
                             "reference")
    value_bytes = saved.numel() * saved.element_size()
    row = {"bytes_ratio": packed.numel() / value_bytes}
    if timer is None:
        return row
    saves = copies_beyond_l2(saved, timer)
    row["copy_gbps"] = copy_gbps(saves, timer)
    next_save, next_restore = rotating(saves), rotating([(s, pack(s)) for s in saves])
    timed(row, "pack", lambda: pack(next_save()), value_bytes + packed.numel(), timer)
    timed(row, "restore", lambda: restore_(*next_restore()), 2 * value_bytes + packed.numel(), timer)
    return row


def parse_tiles(text: Optional[str]) -> list:
    """``--tiles``: [None] (the launchers' own tiles) or the Tiles it names."""
    if text is None:
        return [None]
    chosen = []
    for spec in text.split(","):
        elements, warps = (int(part) for part in spec.split("x"))
        if not (elements & (elements - 1) == 0 and elements <= _tile.LARGEST_TILE_ELEMENTS
                and warps in (1, 2, 4, 8, 16) and elements >= 32 * warps):
            raise SystemExit(f"--tiles: {spec!r} is not a power-of-two element count up to "
                             f"{_tile.LARGEST_TILE_ELEMENTS} over 1-16 warps of at least one element a thread")
        chosen.append(_tile.Tile(elements, warps))
    return chosen


@contextlib.contextmanager
def tiles(tile):
    """Encoders and decoders launched in programs of ``tile`` (None: their own) inside,
    on the GPU and under the interpreter alike."""
    saved = _tile.CUDA_TILE, _tile.INTERPRETER_TILE
    if tile is not None:
        _tile.CUDA_TILE = _tile.INTERPRETER_TILE = tile
    try:
        yield
    finally:
        _tile.CUDA_TILE, _tile.INTERPRETER_TILE = saved


def csv_rows(results: list, metadata: dict, config: dict) -> list:
    return [{
        "bench": "kernels", "case": case_name(codec, layout, dtype), "provider": codec, "metric": metric,
        "unit": UNITS[metric], "x_name": "MiB", "x_value": mib, "p20": value, "p50": value, "p80": value,
        "n_reps": config["repeats"],
        "config_json": json.dumps({**config, "dtype": dtype, "layout": layout}, sort_keys=True),
        **metadata,
    } for codec, layout, dtype, mib, row in results for metric, value in row.items()]


def table(results: list) -> str:
    metrics = [m for m in UNITS if any(m in row for *_, row in results)]
    lines = [("codec", "layout", "dtype", "MiB", *metrics)]
    lines += [(codec, layout, dtype, f"{mib:g}", *(f"{row[m]:.3f}" if m in row else "" for m in metrics))
              for codec, layout, dtype, mib, row in results]
    return format_table(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    cuda = torch.cuda.is_available()
    parser.add_argument("--sizes-mib", default="1,16,64,256" if cuda else "0.0625,0.25",
                        help="input sizes in MiB of fp32 (default: 1,16,64,256 on CUDA, 0.0625,0.25 on CPU)")
    parser.add_argument("--dtypes", default="fp32,bf16,fp16", help="of " + ",".join(DTYPES))
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help="of " + ",".join(LAYOUTS))
    parser.add_argument("--repeats", type=int, default=20, help="calls queued per timed batch")
    harness.add_output_arguments(parser, "CSV, <device>.csv")
    parser.add_argument("--quick", action="store_true", help="64 and 256 MiB, fp32 and bf16: a short GPU lease")
    parser.add_argument("--smoke", action="store_true", help="one tiny size, for the tests")
    parser.add_argument("--tiles", default=None,
                        help="elements x warps per program to try for both directions, e.g. 4096x8,2048x4 (the "
                             "rows' layout names them); default: the tiles the launchers use")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if cuda else "cpu")
    sizes = [1 / 256] if args.smoke else [64.0, 256.0] if args.quick else [float(s) for s in args.sizes_mib.split(",")]
    dtypes = ["fp32", "bf16"] if args.quick else args.dtypes.split(",")
    layouts = args.layouts.split(",")
    channels = SMOKE_CHANNELS if args.smoke else CHANNELS
    timer = GpuTimer(device, args.repeats) if cuda else None
    started, results = time.monotonic(), []
    for tile in parse_tiles(args.tiles):
        with tiles(tile):
            for codec in LOSSY_CODECS:
                for layout in layouts:
                    for dtype_name in dtypes:
                        for mib in sizes:
                            numel = int(mib * 2**20) // 4  # as many elements as that many MiB of fp32
                            row = measure(codec, layout, DTYPES[dtype_name], numel, channels, device, timer)
                            name = layout if tile is None else f"{layout}@{tile.elements}x{tile.warps}"
                            results.append((codec, name, dtype_name, mib, row))
    if args.tiles is None:  # the decision kernels have tiles of their own
        for dtype_name in dtypes:
            for mib in sizes:
                numel = int(mib * 2**20) // 4
                results.append(("relu_signs", "relu", dtype_name, mib,
                                measure_relu_decisions(DTYPES[dtype_name], numel, device, timer)))
                results.append(("bounds", "relu6", dtype_name, mib,
                                measure_bound_decisions(DTYPES[dtype_name], numel, device, timer)))
                results.append(("max_pool", "2x2", dtype_name, mib,
                                measure_max_pool_decisions(DTYPES[dtype_name], numel, device, timer)))
    print(table(results))
    if not cuda:
        print("CPU: every kernel equals its reference bit for bit (Triton interpreter); no timings")
    print(f"{time.monotonic() - started:.0f} s")
    out = harness.output_path(args, f"{harness.device_slug(device)}.csv")
    harness.write_csv(csv_rows(results, harness.run_metadata(device), {"repeats": args.repeats}), out)
    print(harness.wrote(out))


if __name__ == "__main__":
    harness.imports_frozen()  # NOTE [ A script's imports, frozen ]
    main()
