"""Host microseconds per call of actsave's kernel launches on CUDA, through Triton and
directly (NOTE [ Direct launches ] in triton_kernels/_direct_launch.py).

Small tensors, so that each call is host work: the device keeps up. For each call, the
median over rounds of (host time of N calls) / N, the two paths interleaved in one
process (``_direct_launch.ENABLED`` switched between rounds), a torch operator beside
them for scale.

    python bench/launch_overhead.py [--calls 2000] [--rounds 7] [--out FILE]

Without CUDA it says so and exits with status 2.
"""
import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

NO_GPU_EXIT = 2


def cases() -> dict:
    """name -> a call (no arguments) of each launcher, on its own small tensors."""
    from actsave import codecs
    from actsave.triton_kernels import int8
    from actsave.triton_kernels.decisions import relu_signs

    torch.manual_seed(0)
    activation = torch.randn(64, 16, 8, 8, device="cuda")
    relu_out = torch.relu(activation)
    bits = relu_signs.pack_relu_signs(relu_out)
    codes, scales = int8.encode_int8(relu_out.view(-1))
    codec = codecs.get_codec("int8")
    centered, unsigned = codec.encode(activation), codec.encode(relu_out, non_negative=True)
    copy_to = torch.empty_like(activation)
    return {
        "torch copy_ (for scale)": lambda: copy_to.copy_(activation),
        "pack_relu_signs": lambda: relu_signs.pack_relu_signs(relu_out),
        "restore_relu_signs_": lambda: relu_signs.restore_relu_signs_(relu_out, bits),
        "encode_int8 (flat)": lambda: int8.encode_int8(relu_out.view(-1)),
        "decode_int8 (flat)": lambda: int8.decode_int8(codes, scales, torch.float32),
        "int8 codec encode, centered": lambda: codec.encode(activation),
        "int8 codec decode, centered": lambda: codec.decode(centered),
        "int8 codec encode, unsigned": lambda: codec.encode(relu_out, non_negative=True),
        "int8 codec decode, unsigned": lambda: codec.decode(unsigned),
    }


def microseconds_per_call(call, calls: int) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        call()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--out", type=Path, default=None, help="also write the table here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("launch_overhead.py needs a CUDA GPU: it measures CUDA launches", file=sys.stderr)
        return NO_GPU_EXIT
    import triton

    from actsave.triton_kernels import _direct_launch

    calls = cases()
    times = {(name, path): [] for name in calls for path in ("triton", "direct")}
    for call in calls.values():  # compiles every kernel, and warms both paths
        for enabled in (False, True, True):
            _direct_launch.ENABLED = enabled
            call()
    for _ in range(args.rounds):
        for name, call in calls.items():
            for path in ("triton", "direct"):
                _direct_launch.ENABLED = path == "direct"
                times[name, path].append(microseconds_per_call(call, args.calls))
    _direct_launch.ENABLED = True
    lines = [f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, Triton {triton.__version__}, "
             f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}",
             f"# python bench/launch_overhead.py --calls {args.calls} --rounds {args.rounds}: host us per call, "
             "medians of interleaved rounds",
             f"{'call':32s} {'through Triton':>15s} {'direct':>8s} {'saved':>7s}"]
    for name in calls:
        triton_us, direct_us = (statistics.median(times[name, path]) for path in ("triton", "direct"))
        lines.append(f"{name:32s} {triton_us:15.1f} {direct_us:8.1f} {triton_us - direct_us:7.1f}")
    text = "\n".join(lines)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
