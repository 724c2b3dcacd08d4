"""Host overhead of a training step: plain torch, torch's checkpointing and every
actsave mode, per step: its time, and counts that do not vary from run to run (aten
operators, Triton kernel launches, host-device syncs).

Why: on an H100 (ResNet-164 b512 fp32) actsave's default step took 1.67x plain where
torch.utils.checkpoint took 1.43x; the device work is the same, the gap is host work
per module and per saved tensor. A step on tiny tensors on a CPU is almost all host
work, so it shows that gap without a GPU; the counts are what tests hold as budgets
(tests/bench/test_host_overhead.py), since times are never asserted.

Cases (``--models``, comma-separated):
- ``resnet<depth>``: ``cifar_resnet(depth)``, batch 2, 8x8, fp32, each provider of
  ``harness.PROVIDERS`` (CheckpointedSequential against checkpoint_sequential).
- ``gpt<blocks>``: ``gpt(blocks)`` at width 64, 4 heads, vocabulary 128, sequence 16,
  batch 2; each provider of ``harness.BLOCK_PROVIDERS``: ``actsave.wrap(model,
  TransformerBlock, ...)`` against ``torch.utils.checkpoint.checkpoint(block, x,
  use_reentrant=False)`` per block, and plain.

A step is forward, cross-entropy and backward, gradients zeroed (kept allocated)
before it, outside what is measured.

Time: warm-up steps first (the default mode plans on meta tensors at its first call),
then ``--rounds`` rounds, each timing one step of every provider in turn (ABAB...:
a slow phase of a shared machine falls on all alike). On CPU the clock is
``time.process_time()`` with one intra-op thread (far steadier than wall time on a
shared machine: DESIGN.md, section 7); on CUDA wall time, the device synchronized
before and after. Reported: the median step, and the median over rounds of the step's
ratio to torch_ckpt's and to actsave's default mode of the same round (paired ratios).
On CPU, lossy codecs run their torch references (the ``auto`` backend): Triton's
interpreter costs about a millisecond per program, which says nothing about a GPU.

Counts: one step per provider of its own, after the timed ones, under the counters of
harness/counts.py (they cost host time). Codecs run their Triton kernels there, as on
a GPU (the interpreter on CPU; aten ops inside a launch are not counted), so the aten
operators are those a GPU step runs around the kernels.

Launchers: then the Python work of each codec and decision launcher per call, with a
stub in place of the package's one launch helper (triton_kernels/_launch.py): the
checks, sizes, grid, channel means and argument binding the host does before each
kernel, what a GPU waits for when the host is behind. Minimum over rounds of the mean
per call, microseconds; CPU tensors of a small kept input's shape (a CPU's tensor work
is tiny there), CUDA ones of a ResNet-164 b64 kept input's.

    python bench/host_overhead.py [--models resnet164,gpt8] [--providers torch,actsave_int8]
                                  [--rounds 20] [--device cpu] [--smoke]
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import os
import re
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernels are defined

import actsave  # noqa: E402
from actsave.devices import synchronize  # noqa: E402
from actsave.codecs import get_codec  # noqa: E402
from actsave.runtime import relu_signs  # noqa: E402
from actsave.text import format_table  # noqa: E402
from actsave.triton_kernels import _launch  # noqa: E402

import harness  # noqa: E402  (bench/ is on sys.path when this script runs)
from harness.counts import count_step  # noqa: E402
from harness.measure import step_loss  # noqa: E402
from models import TransformerBlock, cifar_resnet, gpt  # noqa: E402

BENCH = "host_overhead"
PROVIDER_NAMES = ("torch", "torch_ckpt", "actsave_none", "actsave_int8", "actsave_fp8", "actsave_offload",
                  "actsave_int8_offload")
# Every ratio is against these two, so they are always measured.
TORCH_CKPT, DEFAULT = "torch_ckpt", "actsave_none"
# The segments' budget of harness.PROVIDERS (only actsave_auto reads it, not measured here).
_NO_BUDGET = 2**40


@dataclass(frozen=True)
class Case:
    """A model and batch every provider trains: ``build()`` the plain model (the
    caller seeds), ``providers[name](plain, batch)`` the trained one."""

    name: str  # as --models names it: resnet164, gpt8
    description: str
    build: Callable[[], torch.nn.Module]
    make_batch: Callable[[torch.device], tuple]
    providers: dict
    x_name: str  # what the number in the name counts: depth, blocks
    x_value: int
    config: dict


def resnet_case(depth: int, batch: int = 2, image: int = 8) -> Case:
    def make_batch(device):
        generator = torch.Generator().manual_seed(harness.SEED)
        inputs = torch.randn(batch, 3, image, image, generator=generator)
        return inputs.to(device), torch.randint(0, 10, (batch,), generator=generator).to(device)

    providers = {name: (lambda plain, batch_, name=name: harness.PROVIDERS[name].build(plain, batch_, _NO_BUDGET))
                 for name in PROVIDER_NAMES}
    return Case(f"resnet{depth}", f"cifar_resnet({depth}) b{batch} {image}x{image} fp32",
                lambda: cifar_resnet(depth), make_batch, providers, "depth", depth,
                {"model": f"cifar_resnet({depth})", "batch": batch, "image": image, "dtype": "float32"})


GPT_SHAPE = {"width": 64, "heads": 4, "vocab": 128, "seq_len": 16, "batch": 2}


def gpt_case(blocks: int, width: int = 64, heads: int = 4, vocab: int = 128, seq_len: int = 16, batch: int = 2,
             dtype: torch.dtype = torch.float32) -> Case:
    def make_batch(device):
        tokens = torch.randint(0, vocab, (batch, seq_len + 1), generator=torch.Generator().manual_seed(harness.SEED))
        return tokens[:, :-1].to(device), tokens[:, 1:].to(device)  # predict the next token

    def build():
        return gpt(blocks, width=width, heads=heads, vocab_size=vocab, max_seq_len=seq_len).to(dtype)

    providers = {name: (lambda plain, batch_, name=name: harness.BLOCK_PROVIDERS[name].build(plain, TransformerBlock))
                 for name in PROVIDER_NAMES}
    dtype_name = str(dtype).removeprefix("torch.")
    return Case(f"gpt{blocks}", f"gpt({blocks}) w{width} h{heads} v{vocab} t{seq_len} b{batch} {dtype_name}",
                build, make_batch, providers, "blocks", blocks,
                {"model": f"gpt({blocks}) (pre-LN, causal SDPA)", "width": width, "heads": heads, "vocab": vocab,
                 "seq_len": seq_len, "batch": batch, "dtype": dtype_name})


def parse_case(text: str) -> Case:
    match = re.fullmatch(r"(resnet|gpt)(\d+)", text.strip())
    if not match:
        raise argparse.ArgumentTypeError(f"{text!r}: name a case resnet<depth> (9n + 2) or gpt<blocks>")
    if match[1] == "resnet":
        depth = int(match[2])
        if depth < 11 or (depth - 2) % 9:
            raise argparse.ArgumentTypeError(f"{text!r}: a CIFAR ResNet's depth is 9n + 2 (11, 29, 56, 164, ...)")
        return resnet_case(depth)
    return gpt_case(int(match[2]))


def parse_providers(text: str) -> list:
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in PROVIDER_NAMES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown provider(s) {unknown}; choose from {list(PROVIDER_NAMES)}")
    return [name for name in PROVIDER_NAMES if name in {TORCH_CKPT, DEFAULT, *names}]


def build_models(case: Case, names: list, device: torch.device) -> tuple:
    """``(models, batch)``: each provider's model, built from the same seeded plain
    model (its own copy), and the batch."""
    batch = case.make_batch(device)
    torch.manual_seed(harness.SEED)
    plain = case.build().to(device)
    return {name: case.providers[name](copy.deepcopy(plain), batch) for name in names}, batch


def forward_loss(model: torch.nn.Module, batch: tuple) -> torch.Tensor:
    inputs, targets = batch
    return step_loss(model(inputs), targets)


def train_step(model: torch.nn.Module, batch: tuple) -> None:
    model.zero_grad(set_to_none=False)
    forward_loss(model, batch).backward()


def interleaved_times(steps: dict, rounds: int, device: torch.device, rotate: bool = False) -> dict:
    """``{name: [seconds, ...]}``: ``rounds`` rounds, each timing one call of every
    ``steps[name]()`` in turn; with ``rotate``, each round starts one name later than
    the last, so that no step always holds the same place in a round (a place can run
    faster than another: docs/results.md, "torch.compile"). CPU: process time; CUDA:
    wall time, synchronized."""
    clock = time.perf_counter if device.type == "cuda" else time.process_time
    times = {name: [] for name in steps}
    order = list(steps.items())
    for round_ in range(rounds):
        shift = round_ % len(order) if rotate else 0
        for name, step in order[shift:] + order[:shift]:
            synchronize(device)
            start = clock()
            step()
            synchronize(device)
            times[name].append(clock() - start)
    return times


def paired_ratio(times: dict, name: str, reference: str) -> float:
    """Median over rounds of ``name``'s time over ``reference``'s in the same round."""
    return statistics.median(a / b for a, b in zip(times[name], times[reference]))


def count_backend() -> str:
    """The codec implementation the counts run: the Triton kernels, as on a GPU, where
    Triton is installed (on CPU under its interpreter), else the torch references."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return "torch"
    return "triton"


def count_models(models: dict, batch: tuple, device: torch.device) -> dict:
    """``{name: StepCounts}`` of one step of each model, after one step under the same
    backend that is not counted (first launches set things up)."""
    counts = {}
    with actsave.set_backend(count_backend()):
        for name, model in models.items():
            train_step(model, batch)
            model.zero_grad(set_to_none=False)
            counts[name] = count_step(lambda: forward_loss(model, batch), lambda loss: loss.backward(), device)
    return counts


@dataclass(frozen=True)
class CaseResult:
    case: Case
    times: dict  # name -> seconds per round
    counts: dict  # name -> StepCounts


def measure_case(case: Case, names: list, rounds: int, warmup: int, device: torch.device,
                 log: Callable[[str], None] = print) -> CaseResult:
    models, batch = build_models(case, names, device)
    steps = {name: (lambda model=model: train_step(model, batch)) for name, model in models.items()}
    for _ in range(warmup):
        for step in steps.values():
            step()
    log(f"[host_overhead] {case.name}: {len(names)} providers warmed up, timing {rounds} rounds")
    times = interleaved_times(steps, rounds, device)
    counts = count_models(models, batch, device)
    for name, c in counts.items():
        # The mode must see the backward (a recompute included), on whatever thread
        # autograd ran it: a step without backward ops means the counter missed them.
        if c.aten_ops_backward == 0:
            raise RuntimeError(f"{case.name} {name}: the dispatch mode saw no backward operator; "
                               "the aten counts would be the forward's only")
    return CaseResult(case, times, counts)


def table(result: CaseResult) -> str:
    times, counts = result.times, result.counts
    ckpt_ops = counts[TORCH_CKPT].aten_ops
    rows = [("provider", "step ms", "x torch_ckpt", "x default", "aten ops", "x torch_ckpt", "of them bwd",
             "launches", "syncs")]
    for name in times:
        c = counts[name]
        rows.append((name, f"{statistics.median(times[name]) * 1e3:.2f}",
                     f"{paired_ratio(times, name, TORCH_CKPT):.3f}", f"{paired_ratio(times, name, DEFAULT):.3f}",
                     str(c.aten_ops), f"{c.aten_ops / ckpt_ops:.3f}",
                     str(c.aten_ops_backward), str(c.triton_launches), str(c.syncs)))
    return format_table(rows)


def notes(result: CaseResult, device: torch.device) -> list:
    """What a reader needs to trust the counts: threads seen, and on CUDA the two
    launch counts and the CUDA runtime's own sync flags."""
    lines = []
    threads = sorted({c.threads for c in result.counts.values()})
    lines.append(f"operators seen on {'/'.join(map(str, threads))} thread(s) per step")
    if device.type == "cuda":
        flagged = {name: c.cuda_sync_warnings for name, c in result.counts.items() if c.cuda_sync_warnings}
        lines.append(f"torch.cuda sync debug mode flagged: {flagged or 'nothing'}")
        disagree = [name for name, c in result.counts.items() if not c.launch_paths_agree]
        if disagree:
            lines.append(f"launch hook and JITFunction.run counted differently for {disagree} (hook's reported)")
    syncs = {name: c.syncs_by_op for name, c in result.counts.items() if c.syncs_by_op}
    if syncs:
        lines.append(f"syncs by operator: {syncs}")
    return lines


LAUNCHER_SHAPES = {"cpu": (2, 16, 4, 4), "cuda": (64, 16, 32, 32)}  # a kept input: N, C, H, W


@contextlib.contextmanager
def stub_launches():
    """Every launch of the package's launchers does nothing while open."""
    real, _launch.launch = _launch.launch, lambda *args, **kwargs: None
    try:
        yield
    finally:
        _launch.launch = real


def microseconds_per_call(function: Callable, calls: int, rounds: int = 5,
                          device: Optional[torch.device] = None) -> float:
    """Best over ``rounds`` of the host time per call of ``calls`` calls in a row; with
    a ``device``, synchronized before the first round and after each (not inside one)."""
    function()
    best = float("inf")
    for _ in range(rounds):
        if device is not None:
            synchronize(device)
        start = time.perf_counter()
        for _ in range(calls):
            function()
        best = min(best, (time.perf_counter() - start) / calls)
    if device is not None:
        synchronize(device)
    return best * 1e6


def launcher_calls(device: torch.device) -> list:
    """``[(launcher, call)]``: a call of each codec and decision launcher on a small
    kept input's tensors (:data:`LAUNCHER_SHAPES`), to be run under the Triton backend."""
    x = torch.randn(LAUNCHER_SHAPES[device.type], device=device)
    relu, flat = x.relu(), x.flatten()
    calls = []
    with actsave.set_backend("triton"):
        for name in ("int8", "fp8_e4m3"):
            codec = get_codec(name)
            for layout, tensor, non_negative in (("centered", x, False), ("unsigned", relu, True),
                                                 ("flat", flat, False)):
                packed = codec.encode(tensor, non_negative=non_negative)
                calls.append((f"{name} encode, {layout}",
                              functools.partial(codec.encode, tensor, non_negative=non_negative)))
                calls.append((f"{name} decode, {layout}", functools.partial(codec.decode, packed)))
        bits = relu_signs.pack_signs(relu)
    calls.append(("ReLU signs packed", functools.partial(relu_signs.pack_signs, relu)))
    calls.append(("ReLU signs restored", functools.partial(relu_signs.restore_decisions_, relu.clone(), bits)))
    return calls


def launcher_host_work(device: torch.device, calls: int) -> list:
    """``[(launcher, microseconds per call)]``: each launcher's Python work before its
    launch (module docstring, "Launchers")."""
    launchers = launcher_calls(device)
    with actsave.set_backend("triton"), stub_launches():
        return [(name, microseconds_per_call(call, calls)) for name, call in launchers]


def launcher_table(measured: list) -> str:
    return format_table([("launcher", "us per call")] + [(name, f"{us:.1f}") for name, us in measured])


def csv_rows(result: CaseResult, metadata: dict, run_config: dict) -> list:
    case, rows = result.case, []
    for name, seconds in result.times.items():
        c = result.counts[name]
        config = {**case.config, **run_config, "provider": _description(case, name)}
        values = {
            "time": [s * 1e3 for s in seconds],
            "time_vs_torch_ckpt": [a / b for a, b in zip(seconds, result.times[TORCH_CKPT])],
            "time_vs_default": [a / b for a, b in zip(seconds, result.times[DEFAULT])],
            "aten_ops": [c.aten_ops], "aten_ops_backward": [c.aten_ops_backward],
            "triton_launches": [c.triton_launches], "syncs": [c.syncs],
        }
        rows += [harness.csv_row(BENCH, case.description, name, metric, case.x_name, case.x_value, v, config,
                                 metadata) for metric, v in values.items()]
    return rows


def _description(case: Case, name: str) -> str:
    if case.name.startswith("gpt"):
        return harness.BLOCK_PROVIDERS[name].description
    return harness.PROVIDERS[name].description


SMOKE = {"models": "resnet11,gpt1", "rounds": 2, "warmup": 1, "calls": 20}


def parse_arguments(argv) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=None, help="comma-separated cases, resnet<depth> and gpt<blocks> "
                                                       f"(default resnet164,gpt8; --smoke {SMOKE['models']})")
    parser.add_argument("--providers", type=parse_providers, default=list(PROVIDER_NAMES),
                        help=f"comma-separated, from {','.join(PROVIDER_NAMES)} (default all); "
                             f"{TORCH_CKPT} and {DEFAULT} are always measured, as the ratios' references")
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds (default 20; --smoke 2)")
    parser.add_argument("--warmup", type=int, default=None, help="warm-up steps per provider (default 2; --smoke 1)")
    parser.add_argument("--device", type=harness.parse_device, default=None,
                        help="cpu or cuda (default: cuda when available, else cpu)")
    parser.add_argument("--threads", type=int, default=1, help="intra-op CPU threads on CPU (default 1)")
    harness.add_output_arguments(parser, "CSV, <device>.csv")
    parser.add_argument("--smoke", action="store_true", help="tiny models and 2 rounds, for the tests")
    args = parser.parse_args(argv)
    args.models = [parse_case(name) for name in (args.models or (SMOKE["models"] if args.smoke else "resnet164,gpt8"))
                   .split(",")]
    args.rounds = args.rounds or (SMOKE["rounds"] if args.smoke else 20)
    args.warmup = args.warmup if args.warmup is not None else (SMOKE["warmup"] if args.smoke else 2)
    if args.device is None:
        args.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    args.out = harness.output_path(args, f"{harness.device_slug(args.device)}.csv")
    return args


def main(argv=None) -> list:
    args = parse_arguments(argv)
    if args.device.type == "cpu":
        torch.set_num_threads(args.threads)
    clock = "wall time, device synchronized" if args.device.type == "cuda" else "process CPU time"
    print(f"host overhead per training step on {harness.device_name(args.device)}, {clock}, "
          f"{torch.get_num_threads()} thread(s); medians of {args.rounds} interleaved rounds; "
          f"counts of one step, codecs by backend {count_backend()!r}", flush=True)
    results, rows = [], []
    metadata = harness.run_metadata(args.device)
    for case in args.models:
        result = measure_case(case, args.providers, args.rounds, args.warmup, args.device)
        print(f"\n{case.description}")
        print(table(result))
        for line in notes(result, args.device):
            print(f"  {line}")
        results.append(result)
        rows += csv_rows(result, metadata, {"rounds": args.rounds, "warmup": args.warmup, "clock": clock,
                                            "threads": torch.get_num_threads(), "count_backend": count_backend()})
    shape = "x".join(map(str, LAUNCHER_SHAPES[args.device.type]))
    print(f"\nPython work per launcher call before its launch, stub launcher, {shape} fp32 (microseconds)")
    print(launcher_table(launcher_host_work(args.device, SMOKE["calls"] if args.smoke else 2000)))
    harness.write_csv(rows, args.out)
    print("\n" + harness.wrote(args.out))
    return results


if __name__ == "__main__":
    harness.imports_frozen()  # NOTE [ A script's imports, frozen ]
    main(sys.argv[1:])
