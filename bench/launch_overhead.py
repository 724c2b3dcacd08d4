"""Host time per kernel launch: what the host spends to start each codec kernel and the
ReLU decision kernels (host_overhead's ``launcher_calls``), against the Python work
before the launch alone (a stub launcher, as bench/host_overhead.py measures it), and
three references: a torch operator, a one-program Triton kernel launched as
``kernel[grid](...)`` (Triton's own path), and the same through the package's launch.

Why: on a GPU at small batch a lossy step waits for the host, which starts several
kernels per kept input; the launch path's target is at most 6 us a launch (the
launch's share: the call's time less its Python work).

Per launcher: a small kept input's tensors (host_overhead.LAUNCHER_SHAPES), ``--calls``
calls in a row, best of 5 rounds, host wall time per call (host_overhead's
``microseconds_per_call``); on CUDA the device is synchronized between rounds (not
inside one: the kernels are tiny, so the host sets the pace). On CPU the kernels run under Triton's interpreter, whose times say nothing
of a GPU: there the script checks that every path runs (``--smoke`` for the tests).

    python bench/launch_overhead.py [--calls 500] [--smoke]
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernels are defined

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

import actsave  # noqa: E402
from actsave.text import format_table  # noqa: E402
from actsave.triton_kernels import _launch  # noqa: E402

import harness  # noqa: E402  (bench/ is on sys.path when this script runs)
from host_overhead import LAUNCHER_SHAPES, launcher_calls, microseconds_per_call, stub_launches  # noqa: E402


@triton.jit
def _one_store_kernel(out_ptr):
    tl.store(out_ptr, 1.0)


def measure(device: torch.device, calls: int) -> list:
    """``[(what, us per call, us of Python work before the launch or None)]``."""
    out = torch.zeros(1, device=device)
    rows = [("torch operator (x.add_(1))", microseconds_per_call(lambda: out.add_(1), calls, device=device), None),
            ("Triton kernel[grid](...), one program", microseconds_per_call(
                lambda: _one_store_kernel[(1,)](out), calls, device=device), None),
            ("the same through _launch.launch", microseconds_per_call(
                lambda: _launch.launch(_one_store_kernel, (1,), out), calls, device=device), None)]
    launchers = launcher_calls(device)
    with actsave.set_backend("triton"):
        for name, call in launchers:
            with stub_launches():
                python = microseconds_per_call(call, calls, device=device)
            rows.append((name, microseconds_per_call(call, calls, device=device), python))
    return rows


def table(rows: list) -> str:
    body = [(what, f"{total:.1f}", "-" if python is None else f"{python:.1f}",
             "-" if python is None else f"{total - python:.1f}") for what, total, python in rows]
    return format_table([("call", "us per call", "Python work", "launch")] + body)


def main(argv=None) -> list:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=None, help="calls per round (default 500; --smoke 3)")
    parser.add_argument("--smoke", action="store_true", help="a few calls: every path runs (the CPU tests)")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu":
        torch.set_num_threads(1)
    calls = args.calls or (3 if args.smoke else 500)
    shape = "x".join(map(str, LAUNCHER_SHAPES[device.type]))
    print(f"host time per launch on {harness.device_name(device)}, {shape} fp32 inputs, {calls} calls a round, "
          "best of 5" + ("" if device.type == "cuda" else " (Triton's interpreter: the times mean nothing)"))
    rows = measure(device, calls)
    print(table(rows))
    return rows


if __name__ == "__main__":
    harness.imports_frozen()  # NOTE [ A script's imports, frozen ]
    sys.exit(0 if main(sys.argv[1:]) else 1)
