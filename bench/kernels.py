"""Codec kernels: encode and decode per codec and dtype, each result checked bit for
bit against its torch reference before anything is timed.

On CUDA: median time over repeats (CUDA events), effective bandwidth (bytes read
plus bytes written) and its share of the measured device-to-device copy bandwidth
(``copy_`` of a buffer as large as the input; goal: at least 80% from 64 MiB up).
On CPU the kernels run under Triton's interpreter, whose times mean nothing: the
script checks correctness and reports bytes only.

    python bench/kernels.py [--sizes-mib 1,16,64,256] [--repeats 20] [--out PATH] [--smoke]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
from functools import partial
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernels are defined

import harness  # noqa: E402  (bench/ is on sys.path when this script runs)

from actsave.text import format_table  # noqa: E402
from actsave.codecs import LOSSY_CODECS  # noqa: E402
from actsave.triton_kernels import kernel_table  # noqa: E402


def _functions(codec: str) -> tuple:
    """(encode, decode, encode_ref, decode_ref) of a lossy codec (its kernel-table
    format has its name), each taking (x, ...) as in codecs.py."""
    encode, decode = (kernel_table()[codec, direction] for direction in ("encode", "decode"))
    return tuple(partial(function, **kernel.format_args)
                 for kernel, function in ((encode, encode.launcher), (decode, decode.launcher),
                                          (encode, encode.reference), (decode, decode.reference)))


CODECS = {codec: _functions(codec) for codec in LOSSY_CODECS}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits, so NaNs compare by pattern."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def check_against_reference(codec: str, x: torch.Tensor) -> tuple:
    """Encode and decode with the kernels; raise unless they equal the references."""
    encode, decode, encode_ref, decode_ref = CODECS[codec]
    codes, scales = encode(x)
    ref_codes, ref_scales = encode_ref(x)
    decoded = decode(codes, scales, dtype=x.dtype)
    if not (torch.equal(codes, ref_codes) and torch.equal(bits(scales), bits(ref_scales))
            and torch.equal(bits(decoded), bits(decode_ref(ref_codes, ref_scales, dtype=x.dtype)))):
        raise AssertionError(f"{codec} on {x.dtype}, {x.numel()} elements: kernel differs from reference")
    return codes, scales


def median_seconds(function, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        function()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def measure(codec: str, dtype: torch.dtype, numel: int, repeats: int, device: torch.device) -> dict:
    x = torch.randn(numel, dtype=dtype, device=device)
    codes, scales = check_against_reference(codec, x)
    stored = codes.numel() * codes.element_size() + scales.numel() * 4
    row = {"bytes_ratio": stored / (numel * x.element_size())}
    if device.type == "cuda":
        encode, decode = CODECS[codec][:2]
        moved = numel * x.element_size() + stored  # each direction reads one side, writes the other
        copy = median_seconds(lambda: torch.empty_like(x).copy_(x), repeats)
        copy_gbps = 2 * numel * x.element_size() / copy / 1e9
        row["copy_gbps"] = copy_gbps  # the yardstick of *_pct_copy, so that a reader can judge it
        for name, run in (("encode", lambda: encode(x)), ("decode", lambda: decode(codes, scales, dtype=dtype))):
            run()  # compile outside the timing
            seconds = median_seconds(run, repeats)
            row[f"{name}_ms"] = seconds * 1e3
            row[f"{name}_gbps"] = moved / seconds / 1e9
            row[f"{name}_pct_copy"] = 100 * row[f"{name}_gbps"] / copy_gbps
    return row


UNITS = {"bytes_ratio": "x", "copy_gbps": "GB/s", "encode_ms": "ms", "decode_ms": "ms", "encode_gbps": "GB/s",
         "decode_gbps": "GB/s", "encode_pct_copy": "%", "decode_pct_copy": "%"}


def csv_rows(results: list, metadata: dict, config: dict) -> list:
    return [{
        "bench": "kernels", "case": f"{codec}-{dtype}", "provider": codec, "metric": metric,
        "unit": UNITS[metric], "x_name": "MiB", "x_value": mib, "p20": value, "p50": value, "p80": value,
        "n_reps": config["repeats"], "config_json": json.dumps({**config, "dtype": dtype}, sort_keys=True),
        **metadata,
    } for codec, dtype, mib, row in results for metric, value in row.items()]


def table(results: list) -> str:
    metrics = [m for m in UNITS if any(m in row for *_, row in results)]
    lines = [("codec", "dtype", "MiB", *metrics)]
    lines += [(codec, dtype, f"{mib:g}", *(f"{row[m]:.3f}" for m in metrics)) for codec, dtype, mib, row in results]
    return format_table(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    cuda = torch.cuda.is_available()
    parser.add_argument("--sizes-mib", default="1,16,64,256" if cuda else "0.0625,0.25",
                        help="input sizes in MiB of fp32 (default: 1,16,64,256 on CUDA, 0.0625,0.25 on CPU)")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", type=Path, default=None, help="CSV (default bench/results/<device>.csv)")
    parser.add_argument("--smoke", action="store_true", help="one tiny size, for the tests")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if cuda else "cpu")
    sizes = [1 / 256] if args.smoke else [float(s) for s in args.sizes_mib.split(",")]
    results = []
    for codec in CODECS:
        for dtype_name, dtype in DTYPES.items():
            for mib in sizes:
                numel = int(mib * 2**20) // 4  # as many elements as that many MiB of fp32
                results.append((codec, dtype_name, mib, measure(codec, dtype, numel, args.repeats, device)))
    print(table(results))
    if not cuda:
        print("CPU: every kernel equals its reference bit for bit (Triton interpreter); no timings")
    out = args.out or harness.RESULTS_DIR / f"{harness.device_slug(device)}.csv"
    harness.write_csv(csv_rows(results, harness.run_metadata(device), {"repeats": args.repeats}), out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
