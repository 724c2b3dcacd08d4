"""The time-memory frontier: step time against measured activation
peak, one curve per system, so that a user can read off, for the memory they have,
which system runs their step fastest.

Cases (``--cases``; sizes per device in ``SIZES``):

- ``resnet``: ResNet-164 (bench/models.py cifar_resnet), a flat chain: plain
  ``nn.Sequential``; ``torch.utils.checkpoint.checkpoint_sequential`` (use_reentrant=False)
  at k in {2, 4, round(sqrt(n)), n // 4} segments; actsave's default
  ``CheckpointedSequential``; actsave planned: what ``CheckpointedSequential(segments=
  "auto", budget=B, example_inputs=(x,), loss=...)`` does (profile the chain, plan,
  apply the plan; the profile made once, so that every budget reads the same times),
  at ``--points`` budgets from its smallest feasible peak to plain's, per lever set.
- ``gpt``, ``llama``: stacks of GPT blocks (bench/models.py gpt) and of Llama-style
  blocks (models.llama: RMSNorm, rotary, SwiGLU, SDPA), and ``hf_llama``: a Hugging
  Face Llama built from a ``LlamaConfig`` (use_cache=False, SDPA attention), each a
  training step from token ids to a next-token cross-entropy: plain;
  ``torch.utils.checkpoint.checkpoint(block, ..., use_reentrant=False)`` on every block,
  every 2nd and every 4th (torchtitan's layer-selective rule: block i when (i + 1) % k
  == 0); torch's selective checkpointing (SAC) on every block with torchtitan's op
  list, and with its "every other matmul" rule (``SAC_SAVED_OPS``); with
  ``--compile``, ``torch.compile`` (Inductor unless ``--compile-backend``) with
  ``torch._functorch.config.activation_memory_budget`` at 0.1, 0.3 and 0.5 (a compile
  that fails is skipped with a note); actsave planned: ``actsave.plan_blocks(model,
  Block, budget, example_inputs, allow=...)`` then ``actsave.wrap(model, plan)``, at
  ``--points`` budgets from its smallest feasible peak to plain's, per lever set.

Lever sets (``LEVER_SETS``, data that grows with the planner's levers): exact
recompute, int8 allowed and, on CUDA only, offload allowed; a set the planner rejects
(a lever it does not know) is skipped with a note. Then, for each peer point (every
torch system but plain), actsave planned (``AT_PEER_LEVERS``) with the peer's measured
peak as its budget, and with half of plain's peak (its peer: plain): its measured peak
and its step against the peer's, in the main rounds and in ``--pair-rounds`` rounds of
the two alone (NOTE [ Pair rounds ]).

What is measured, per system, in one process:

- step: forward, loss and backward; parameter gradients allocated before (from the
  warm-up) and zeroed in place in each step. All systems share one set of parameters
  (each wraps the same modules in containers of its own: ``shell``), so they train
  the same weights and the parameters are allocated once, as on a GPU they must be.
- time: ``--warmup`` steps each (plans, compiles, the default's balanced plan), then
  ``--rounds`` interleaved rounds of one step of every system, each round's order
  rotated by one; process CPU time on a CPU (one intra-op thread unless --threads),
  wall time synchronized on CUDA. Reported: the median step, and the median over
  rounds of the ratio to plain's step of the same round. A second copy of plain
  ("plain, again") is timed in the same rounds: its ratio to plain is the run's noise
  floor, which a difference must exceed to mean anything.
- peak: activation bytes as actsave's budgets count them: how far the allocator's
  bytes rise above their value at the step's start (CPU: torch.profiler's memory
  events, harness.allocator_peak; CUDA: max_memory_allocated less memory_allocated at
  the start), plus the bytes of the inputs the planner counts (the chain's input, or
  every tensor of the blocks' example inputs). One step each, after the warm-up.
- predicted, for each actsave planned point: the plan's predicted peak, and its
  predicted step: plain's measured step plus what the planner predicts the plan adds
  to plain's (``pred_step_s``; the planner's own figures are ``planner_step_s`` and
  ``planner_plain_step_s``: a block plan's cover only the blocks' part of the step,
  BlockPlan.predicted_step_seconds, so only their difference compares to a whole step).

Output: a table per case on stdout, the at-peer comparison and its summary; a CSV,
``<device>-frontier.csv``, one row per system (``COLUMNS``; rows of other cases in the
file are kept), and ``<device>-frontier.png`` beside it: per case, step time over
plain's against measured peak, one line per system family, each actsave point's
prediction as a hollow marker joined to its measurement. In bench/results/local/
unless ``--record`` (bench/results/) or ``--out``. ``--replot`` draws the PNG again
from the CSV.

Default sizes on a CPU: ResNet-164 b8 32x32; 8 blocks of width 256, 4 heads, batch 4
of 256 tokens, vocabulary 1024 (256 tokens rather than 512: a GPT step is host-bound
on a CPU and its time grows with them, so every case at 512 would take about twice as
long).
On CUDA, the GPU speed stage's sizes (bench/gpu_speed.py): ResNet-164 b512 32x32 fp32
and 16 GPT blocks of width 2048, sequence 2048, batch 4, bf16; ``--cases`` adds the
Llamas at the GPT's size. The CPU's numbers are host-bound and say nothing about a
GPU's absolute times.

The torch.compile systems each compile with a backend of their own
(``BudgetedBackend``): with one backend, Dynamo reused the first budget's graph for
the others.

    python bench/frontier.py                          # CPU, every case (its time: docs/results.md)
    python bench/frontier.py --cases gpt --compile    # + torch.compile's memory budgets
    python bench/frontier.py --device cuda            # the GPU stage (gpu_check.py --only frontier)
    python bench/frontier.py --smoke                  # tiny, for the tests
"""
from __future__ import annotations

import argparse
import collections
import csv
import gc
import math
import os
import sys
import time
from pathlib import Path
from typing import Callable, Optional

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernels are defined (codecs run references on CPU)

sys.path.insert(0, str(Path(__file__).resolve().parent))
import actsave  # noqa: E402

import harness  # noqa: E402
from frontier_cases import CASES, SIZES, Case, build_case  # noqa: E402
from frontier_report import (COLUMNS, CaseResult, MiB, at_peer_table, case_table, noise_line,  # noqa: E402
                             rows_of, saved_text, summary_table)
from frontier_systems import (AT_PEER_LEVERS, COMPILE_BUDGETS, CUDA_ONLY, DEFAULT_LEVER_SETS,  # noqa: E402
                              LEVER_SETS, Planner, System, compiled_at_peer, lever_sets, torch_systems)
from host_overhead import interleaved_times  # noqa: E402

BENCH = "frontier"


# ------------------------------------------------------------------ measuring


def step_of(case: Case, system: System) -> Callable[[], None]:
    """One training step of ``system``, gradients zeroed in place first."""
    def step():
        system.model.zero_grad(set_to_none=False)
        case.loss(system.model).backward()
    return step


def measure_peak(case: Case, system: System, device: torch.device) -> int:
    """The step's activation peak as actsave's budgets count it (module docstring)."""
    system.model.zero_grad(set_to_none=False)

    def forward_backward():
        case.loss(system.model).backward()

    if system.saved is not None:
        system.saved.clear()
    if device.type != "cuda":
        return harness.allocator_peak(forward_backward) + case.counted
    gc.collect()
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    forward_backward()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - before + case.counted


def warm_up(case: Case, systems: list, steps: int, log) -> list:
    """Each system's warm-up steps (plans, compiles); a compiled system that fails is
    left out with a note. Returns the systems that ran."""
    ran = []
    for system in systems:
        try:
            for _ in range(steps):
                step_of(case, system)()
        except Exception as error:  # noqa: BLE001 (a compile failure of any kind: skipped, said so)
            if not system.family.startswith("torch.compile"):
                raise
            log(f"{case.name}: {system.name} skipped: {type(error).__name__}: {str(error).splitlines()[0][:200]}")
            continue
        if system.compiled_by is not None and not system.compiled_by.compiles:
            raise RuntimeError(f"{system.name}: its backend compiled nothing; it ran another system's graph")
        ran.append(system)
    return ran


def sac_check(system: System) -> None:
    """A SAC policy that saved nothing names no op that runs (a packet for an
    overload): its curve would be per-block checkpointing mislabelled."""
    if not system.saved_a_step:
        raise RuntimeError(f"{system.name}: the policy saved no output in a step; it names none of the ops the blocks "
                           "run (policies must name overloads, aten.mm.default, not aten.mm)")


# ------------------------------------------------------------------ one case


def run_case(case: Case, args, device: torch.device, log) -> CaseResult:
    notes = []
    started = time.monotonic()
    # Gradients allocated before any step, as from the second step of training: every
    # system shares these parameters and so these gradients.
    for p in case.plain.parameters():
        if p.requires_grad and p.grad is None:
            p.grad = torch.zeros_like(p)
    peers = torch_systems(case, args.compile_backend if args.compile else None)
    if case.block is None:
        peers.insert(2, System("actsave default", "actsave default", "CheckpointedSequential()",
                               actsave.CheckpointedSequential(*case.plain)))
    log(f"{case.name}: {case.description}; warming up {len(peers)} systems")
    peers = warm_up(case, peers, args.warmup, log)
    for system in peers:
        system.peak = measure_peak(case, system, device)
        if system.saved is not None:
            system.saved_a_step = collections.Counter(system.saved)
            sac_check(system)
    log(f"{case.name}: peaks measured; planning ({time.monotonic() - started:.0f} s)")

    planner = Planner(case)
    planned = []
    for lever_name, allow in lever_sets(device, args.levers).items():
        try:
            smallest, top = planner.extremes(allow)
        except actsave.ConfigError as error:
            notes.append(f"lever set {lever_name} {allow} skipped: the planner rejects it ({error})")
            continue
        budgets = [round(smallest + (top - smallest) * i / (args.points - 1)) for i in range(args.points)]
        for i, budget in enumerate(budgets):
            share = (budget - smallest) / (top - smallest) if top > smallest else 1.0
            planned.append(planner.system(f"actsave {lever_name} @ {budget / MiB:.2f} MiB", f"actsave {lever_name}",
                                          f"{share:.0%} of smallest..plain", budget, allow, lever_name))
    planned += at_peer_systems(planner, peers, device, notes)
    for peer in [s for s in peers if s.compiled_by is not None]:
        planned.append(compiled_at_peer(planner, peer, device, args.compile_backend))
    log(f"{case.name}: {len(planned)} actsave plans made ({time.monotonic() - started:.0f} s); warming them up")
    planned = warm_up(case, planned, args.warmup, log)
    for system in planned:
        system.peak = measure_peak(case, system, device)
    systems = peers + planned
    log(f"{case.name}: timing {args.rounds} rounds of {len(systems)} systems ({time.monotonic() - started:.0f} s)")
    times = interleaved_times({s.name: step_of(case, s) for s in systems}, args.rounds, device, rotate=True)
    for system in systems:
        system.times = times[system.name]
    if args.pair_rounds:
        log(f"{case.name}: timing each pair in {args.pair_rounds} rounds of its own "
            f"({time.monotonic() - started:.0f} s)")
        time_pairs(case, systems, args.pair_rounds, device)
    log(f"{case.name}: done in {time.monotonic() - started:.0f} s")
    for system in peers:
        if system.saved_a_step is not None:
            notes.append(f"{system.name}: its policy saved, a step: {saved_text(system.saved_a_step)}")
    return CaseResult(case, systems, notes)


# ------------------------------------------------------------------ reports


def at_peer_systems(planner: Planner, peers: list, device: torch.device, notes: list) -> list:
    """actsave planned with each peer's measured peak as its budget (``AT_PEER_LEVERS``),
    and with half of plain's: the issue's target points, each timed against its peer
    (plain, for the half) in rounds of their own (NOTE [ Pair rounds ])."""
    plain = next(s for s in peers if s.family == "plain")
    targets = [(peer, peer.name, peer.peak) for peer in peers if peer.is_peer]
    targets.append((plain, "half of plain's peak", plain.peak // 2))
    systems = []
    for lever_name, allow in lever_sets(device, AT_PEER_LEVERS).items():
        for peer, point, budget in targets:
            name = f"actsave {lever_name} at {point}" if peer is plain else f"actsave {lever_name} at {point}'s peak"
            try:
                system = planner.system(name, f"actsave {lever_name} at a peer's peak", point, budget, allow,
                                        lever_name)
            except actsave.ConfigError as error:
                notes.append(f"{name}: no plan fits {budget / MiB:.2f} MiB ({str(error).splitlines()[0][:160]})")
                continue
            system.peer = peer.name
            systems.append(system)
    return systems


# NOTE [ Pair rounds ]
# Steps timed seconds apart differ by more than the targets' margins on a shared CPU:
# in one round of some 50 systems, the same plain step read 5-12% apart. So each
# target point (actsave at a peer's peak, at half of plain's) is also timed against its
# peer alone, in rounds of their own right after the main ones, the two steps adjacent
# and their order alternating (AB, BA, ...: neither always runs first); its
# step_vs_peer_paired is the median of those rounds' ratios. plain and "plain, again"
# are paired the same way: the noise floor of a pair.
def time_pairs(case: Case, systems: list, rounds: int, device: torch.device) -> None:
    """Each target point's ``pair_times`` against its peer, and the noise floor's: NOTE [
    Pair rounds ]."""
    by_name = {s.name: s for s in systems}
    again = next(s for s in systems if s.family == "again")
    pairs = [(s, by_name[s.peer]) for s in systems if s.peer] + [(again, by_name["plain"])]
    for system, peer in pairs:
        steps = {"system": step_of(case, system), "peer": step_of(case, peer)}
        times = interleaved_times(steps, rounds, device, rotate=True)
        system.pair_times = (times["system"], times["peer"])


# ------------------------------------------------------------------ files


def write_rows(rows: list, path: Path) -> None:
    """Write ``rows`` to ``path``, keeping the rows of other cases already there (a file
    with other columns is replaced)."""
    cases = {r["case"] for r in rows}
    kept = []
    if path.exists():
        with path.open(newline="") as f:
            reader = csv.DictReader(f)
            if tuple(reader.fieldnames or ()) == COLUMNS:
                kept = [r for r in reader if r["case"] not in cases]
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(kept + [{k: ("" if v is None else v) for k, v in r.items()} for r in rows])


def read_rows(path: Path) -> list:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


# How each family is drawn: (colour, marker, line style). Unknown families (a lever
# set added to LEVER_SETS) get the default cycle's colour and a circle.
FAMILY_STYLES = {
    "plain": ("black", "o", ""),
    "again": ("grey", "x", ""),
    "torch checkpoint_sequential": ("tab:orange", "s", "-"),
    "torch checkpoint per block": ("tab:orange", "s", "-"),
    "torch SAC (torchtitan's ops)": ("tab:purple", "P", "-"),
    "torch.compile memory budget": ("tab:brown", "v", "-"),
    "actsave default": ("tab:green", "*", ""),
    "actsave recompute": ("tab:blue", "o", ":"),
    "actsave exact": ("tab:green", "o", "-"),
    "actsave int8": ("tab:red", "D", "--"),
    "actsave offload": ("tab:cyan", "^", "-."),
    "actsave int8+offload": ("tab:pink", "^", "--"),
    "actsave exact at a peer's peak": ("tab:green", "d", ""),
    "actsave int8+offload at a peer's peak": ("tab:pink", "d", ""),
    "actsave exact compiled at a compiled peer's peak": ("tab:olive", "D", ""),
}


def _number(text) -> Optional[float]:
    return None if text in ("", None) else float(text)


def plot(rows: list, path: Path, title: str) -> Optional[str]:
    """Per case, step time over plain's against measured peak, one line per family;
    each actsave point's prediction a hollow marker joined to its measurement. Returns
    a note instead when matplotlib is missing."""
    plt = harness.pyplot()
    if plt is None:
        return harness.MATPLOTLIB_MISSING
    from matplotlib.lines import Line2D
    cases = list(dict.fromkeys(r["case"] for r in rows))
    columns = min(2, len(cases))
    lines = math.ceil(len(cases) / columns)
    fig, axes = plt.subplots(lines, columns, figsize=(7.5 * columns + 3.5, 5.2 * lines), squeeze=False)
    handles = {}
    for ax, case in zip(axes.flat, cases):
        case_rows = [r for r in rows if r["case"] == case]
        for family in dict.fromkeys(r["family"] for r in case_rows):
            members = sorted((r for r in case_rows if r["family"] == family), key=lambda r: float(r["peak_bytes"]))
            color, marker, linestyle = FAMILY_STYLES.get(family, (None, "o", "-"))
            xs = [float(r["peak_bytes"]) / MiB for r in members]
            ys = [float(r["step_vs_plain"]) for r in members]
            (line,) = ax.plot(xs, ys, marker=marker, linestyle=linestyle or "none", color=color, label=family,
                              markersize=7 if marker != "*" else 12)
            handles.setdefault(family, line)
            plain_step = next(float(r["step_s"]) for r in case_rows if r["family"] == "plain")
            for r, x, y in zip(members, xs, ys):
                predicted_peak, predicted = _number(r["pred_peak_bytes"]), _number(r["pred_step_s"])
                if predicted_peak is None or predicted is None:
                    continue
                px, py = predicted_peak / MiB, predicted / plain_step
                ax.plot([x, px], [y, py], color=line.get_color(), linewidth=0.6, linestyle=":")
                ax.plot([px], [py], marker=marker, linestyle="none", markerfacecolor="none", color=line.get_color(),
                        markersize=7)
                handles.setdefault("actsave's prediction (hollow), dotted to its measurement", Line2D(
                    [], [], marker="o", linestyle=":", linewidth=0.6, markerfacecolor="none", color="black"))
        ax.set_title(case, fontsize=10)
        ax.set_xlabel("measured activation peak (MiB), as actsave's budgets count it")
        ax.set_ylabel("step time / plain's (median of paired rounds)")
        ax.grid(True, alpha=0.3)
    for ax in list(axes.flat)[len(cases):]:
        ax.axis("off")
    fig.legend(list(handles.values()), list(handles), loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=9)
    fig.suptitle(title, fontsize=11)
    harness.save_figure(fig, path)
    return None


# ------------------------------------------------------------------ main


def parse_arguments(argv) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", type=lambda text: [c.strip() for c in text.split(",") if c.strip()], default=None,
                        help=f"comma-separated, from {','.join(CASES)} (default: cpu and smoke all of them, "
                             "cuda resnet,gpt)")
    parser.add_argument("--device", type=harness.parse_device, default=None,
                        help="cpu or cuda (default: cuda when available, else cpu)")
    parser.add_argument("--points", type=int, default=None,
                        help="budgets per actsave lever set, from its smallest feasible peak to plain's (default 8; "
                             "--smoke 3)")
    parser.add_argument("--levers", type=lambda text: [c.strip() for c in text.split(",") if c.strip()],
                        default=list(DEFAULT_LEVER_SETS),
                        help=f"actsave's lever sets, from {','.join(LEVER_SETS)} (default "
                             f"{','.join(DEFAULT_LEVER_SETS)}; "
                             f"{','.join(sorted(CUDA_ONLY))} on CUDA only)")
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds (default 5; --smoke 2)")
    parser.add_argument("--pair-rounds", type=int, default=None,
                        help="rounds of each target point against its peer alone, after the main rounds "
                             "(NOTE [ Pair rounds ]; default 7 on a CPU, 5 on CUDA, --smoke 2; 0: none)")
    parser.add_argument("--warmup", type=int, default=None, help="warm-up steps per system (default 2; --smoke 1)")
    parser.add_argument("--compile", action="store_true",
                        help="add torch.compile with activation_memory_budget at "
                             f"{', '.join(map(str, COMPILE_BUDGETS))} (the block stacks)")
    parser.add_argument("--compile-backend", default="inductor", help="torch.compile's backend (default inductor)")
    parser.add_argument("--threads", type=int, default=1, help="intra-op CPU threads on a CPU (default 1)")
    harness.add_output_arguments(parser, "CSV, <device>-frontier.csv; the PNG is written next to it")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, few rounds, for the tests")
    parser.add_argument("--replot", action="store_true", help="measure nothing: draw the PNG again from the CSV")
    args = parser.parse_args(argv)
    if args.device is None:
        args.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    profile = "smoke" if args.smoke else args.device.type
    sizes = SIZES[profile]
    args.sizes = sizes
    args.cases = args.cases or list(sizes["cases"])
    unknown = sorted(set(args.cases) - set(CASES)) + sorted(set(args.levers) - set(LEVER_SETS))
    if unknown:
        parser.error(f"unknown case(s) or lever set(s) {unknown}; cases: {list(CASES)}, lever sets: "
                     f"{list(LEVER_SETS)}")
    args.points = args.points or sizes["points"]
    if args.points < 2:
        parser.error("--points: at least 2 (the smallest feasible peak and plain's)")
    args.rounds = args.rounds or sizes["rounds"]
    args.pair_rounds = args.pair_rounds if args.pair_rounds is not None else sizes["pair_rounds"]
    args.warmup = args.warmup if args.warmup is not None else sizes["warmup"]
    if args.device.type == "cuda" and not torch.cuda.is_available():
        args.out = None  # main says why it stops; the device's name, in the path, is unknown
    else:
        args.out = harness.output_path(args, f"{harness.device_slug(args.device)}-frontier.csv")
    return args


def main(argv=None) -> int:
    args = parse_arguments(argv)
    if args.device.type == "cuda" and not torch.cuda.is_available():
        print("frontier: --device cuda needs a CUDA GPU; none is available here (run it on the CPU, or --smoke)",
              file=sys.stderr)
        return 2
    png = args.out.with_suffix(".png")
    if args.replot:
        if not args.out.exists():
            raise SystemExit(f"--replot: no {args.out}")
        rows = read_rows(args.out)
        note = plot(rows, png, f"time-memory frontier on {rows[0]['device_name']}")
        print(f"note: {note}" if note else harness.wrote(png))
        return 0
    if args.device.type == "cpu":
        torch.set_num_threads(args.threads)
    started = time.monotonic()

    def log(message: str) -> None:
        print(f"[frontier +{time.monotonic() - started:6.1f} s] {message}", flush=True)

    metadata = harness.run_metadata(args.device)
    clock = "wall time, synchronized" if args.device.type == "cuda" else "process CPU time"
    run_config = {"rounds": args.rounds, "pair_rounds": args.pair_rounds, "warmup": args.warmup, "points": args.points, "clock": clock,
                  "threads": torch.get_num_threads(), "compile": args.compile_backend if args.compile else None}
    title = f"time-memory frontier on {metadata['device_name']}"
    print(f"{title}, torch {metadata['torch_version']}, at {metadata['git_sha']}; {clock}, "
          f"{torch.get_num_threads()} thread(s); medians of {args.rounds} interleaved rounds", flush=True)
    every_row = []
    for name in args.cases:
        case = build_case(name, args.sizes, args.device)
        if case is None:
            print(f"\n{name}: skipped, transformers is not installed (pip install transformers)")
            continue
        result = run_case(case, args, args.device, log)
        rows = rows_of(result, metadata, run_config)
        every_row += rows
        print(f"\n{case.description}  (peaks: activation bytes as actsave's budgets count them; pred step: plain's "
              "measured step plus the plan's predicted extra)")
        print(case_table(rows))
        print(noise_line(rows))
        if any(r["peer"] for r in rows):
            print("at each peer's measured peak, actsave planned with that peak as its budget:")
            print(at_peer_table(rows))
        for note in result.notes:
            print(f"note: {note}")
        write_rows(rows, args.out)  # after each case: a run cut short keeps what it measured
        del result, case
        gc.collect()
        if args.device.type == "cuda":
            torch.cuda.empty_cache()
    if every_row:
        print("\nsummary: each peer point against actsave planned within its measured peak")
        print(summary_table(every_row))
    note = plot(read_rows(args.out), png, title) if args.out.exists() else None
    if note:
        print(f"note: {note}")
    log(harness.wrote(args.out, *([] if note else [png])))
    return 0


if __name__ == "__main__":
    harness.imports_frozen()  # NOTE [ A script's imports, frozen ]
    sys.exit(main(sys.argv[1:]))
