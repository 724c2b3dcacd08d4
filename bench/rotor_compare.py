"""actsave's planner against the rotor reference on the CIFAR ResNet of the depth sweep
(issue 15): the solvers read the same profile (per-layer median times of a few profiled
steps), then sweep budgets in the dynamic programs only.

Per budget (peak activation bytes, the planner's budget): the predicted step time and
peak of ``"auto"`` (actsave.plan with the levers recompute, int8, fp8 and offload,
AUTO_LEVERS; no offload on CPU), of actsave with recompute only, and the step time of the rotor
reference (tests/planning/rotor_reference.py, Beaumont et al. 2019: plain segments
anywhere, nested recomputes; recompute only) on the same profile mapped into rotor's
model by tests/planning/rotor_profile.py. Rotor's sizes are in units of --unit-kib;
rounded up they give an upper bound of rotor's optimum (its plan fits in bytes),
rounded down a lower bound; "auto <= rotor" is judged against the lower bound. Also
rotor restricted to the plans actsave can express (single level, the last segment
stored), in rotor's model: the difference to rotor is what nesting and plain
segments mid-chain buy in rotor's own model. Times are the per-layer medians of
--profiles profiled steps, the same for every solver.

Each plan of actsave's (auto and recompute only) is then applied and one step of it
measured (MemTracker, the profiled step: backward from an output gradient of ones):
its peak against the prediction (issue 15: within 3%, never above); --no-measure
skips this.

Then, with --max-depth-budget, the deepest ResNet (9n + 2) whose "auto" plan fits
that budget for the whole step (parameters, their gradients and buffers taken off, as
the depth sweep's actsave_auto provider does), found from planned peaks (a profile
and a plan per probed depth, no training step), and one measured step (MemTracker) of
the deepest one to check it.

    python bench/rotor_compare.py                 # ResNet-164, batch 8, 16x16, 16 budgets
    python bench/rotor_compare.py --smoke         # tiny shapes, for the tests
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from pathlib import Path
from typing import Optional

import harness
import numpy as np
import torch
from models import cifar_blocks_per_stage, cifar_resnet, gpt

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from planning.rotor_profile import (
    ACTIVATIONS,
    exact_unit,
    nesting_depth,
    output_saving_chain,
    rotor_chain_from_profile,
)
from planning.rotor_reference import RotorTable, simulate

import actsave
from actsave.planning import plans
from actsave.text import format_table

BENCH = "rotor_compare"
RECOMPUTE_ONLY = ("recompute",)
# The sweep's "auto" column: the codecs too, which plan() uses only when named (its
# default levers are the exact ones, what the max-depth search and the depth sweep's
# actsave_auto provider plan with).
AUTO_LEVERS = ("recompute", "int8", "fp8", "offload")
DEFAULTS = {
    "cpu": {"image_size": 16, "points": 16, "unit_kib": 4.0, "max_depth_budget": "32MiB",
            "threads": 1, "chains": 40, "profiles": 5},
    "smoke": {"image_size": 8, "points": 6, "unit_kib": 0.25, "max_depth_budget": "2MiB",
              "threads": 1, "chains": 2, "profiles": 1},
}
MODELS = {"resnet": "cifar_resnet (pre-activation bottleneck)", "gpt": "gpt (pre-LN, causal SDPA)"}
MODEL_DEFAULTS = {("resnet", "cpu"): {"depth": 164, "batch": 8}, ("resnet", "smoke"): {"depth": 20, "batch": 2},
                  ("gpt", "cpu"): {"depth": 16, "batch": 4}, ("gpt", "smoke"): {"depth": 2, "batch": 2}}
GPT_SEQ_LEN, GPT_WIDTH, GPT_HEADS, GPT_VOCABULARY = 128, 128, 4, 512  # transformer_depth_sweep.py's CPU shape
UNITS = {"pred_step_time": "ms", "pred_peak": "MiB", "measured_peak": "MiB", "max_depth": "layers"}


def parse_arguments(argv) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, for the tests")
    parser.add_argument("--model", choices=sorted(MODELS), default="resnet",
                        help="resnet: bench/models.py's cifar_resnet; gpt: its gpt at transformer_depth_sweep's "
                             "CPU shape (seq 128, width 128, 4 heads, vocabulary 512)")
    parser.add_argument("--depth", type=int, help="ResNet depth, 9n + 2, or GPT blocks (default: cpu 164 or 16, "
                                                  "smoke 20 or 2)")
    parser.add_argument("--batch", type=int, help="batch size (default: cpu 8, smoke 2)")
    parser.add_argument("--image-size", type=int, help="input height and width (default: cpu 16, smoke 8)")
    parser.add_argument("--points", type=int, help="budgets in the sweep (default: cpu 16, smoke 6)")
    parser.add_argument("--unit-kib", type=float, help="rotor's memory unit in KiB (default: cpu 4, smoke 0.25)")
    parser.add_argument("--max-depth-budget", type=harness.parse_budget,
                        help="whole-step budget of the max-depth search, e.g. 32MiB; 0 skips it "
                             "(default: cpu 32MiB, smoke 2MiB)")
    parser.add_argument("--threads", type=int, help="intra-op CPU threads (default 1)")
    parser.add_argument("--profiles", type=int, help="profiled steps whose per-layer median times the solvers read "
                                                     "(default: cpu 5, smoke 1)")
    parser.add_argument("--chains", type=int, help="random chains per family for the gap distribution, 0 skips it "
                                                   "(default: cpu 40, smoke 2)")
    parser.add_argument("--measure", action=argparse.BooleanOptionalAction, default=True,
                        help="apply each of actsave's plans and measure one step's peak (default: on)")
    harness.add_output_arguments(parser, "CSV, <device>.csv")
    args = parser.parse_args(argv)
    for name, default in {**DEFAULTS["smoke" if args.smoke else "cpu"],
                          **MODEL_DEFAULTS[args.model, "smoke" if args.smoke else "cpu"]}.items():
        if getattr(args, name) is None:
            setattr(args, name, harness.parse_budget(default) if name == "max_depth_budget" else default)
    if args.model == "resnet":
        cifar_blocks_per_stage(args.depth)  # a depth the family cannot build fails now
    elif args.max_depth_budget:
        parser.error("the max-depth search is for --model resnet; pass --max-depth-budget 0 with --model gpt")
    return args


class RotorTables:
    """Rotor's optimum of one profile at any budget: sizes rounded up (an upper bound of
    the exact optimum) and down (a lower bound), and rounded up restricted to the plans
    actsave can express."""

    def __init__(self, prof: actsave.Profile, unit: int, top_bytes: int):
        self.unit = unit
        self.upper_chain = rotor_chain_from_profile(prof, unit, "up")
        memory = top_bytes // unit + 1
        self.upper = RotorTable(self.upper_chain, memory)
        self.lower = RotorTable(rotor_chain_from_profile(prof, unit, "down"), memory)
        self.single_level = RotorTable(self.upper_chain, memory, single_level=True)

    def row(self, budget: int) -> dict:
        units = budget // self.unit
        plan = self.upper.plan(units)
        return {"rotor": self.upper.step_time(units), "rotor_lower_bound": self.lower.step_time(units),
                "rotor_single_level": self.single_level.step_time(units),
                "rotor_nesting": None if plan is None else nesting_depth(plan),
                "rotor_early_stored": None if plan is None else early_stored_runs(plan)}


def early_stored_runs(tree: tuple) -> int:
    """Stored runs of a rotor plan that are not the last child of their range: what
    actsave's plans cannot do (only the last segment is stored)."""
    return sum((inner is None and k < len(tree) - 1) + (0 if inner is None else early_stored_runs(inner))
               for k, (_, _, inner) in enumerate(tree))


def planned(prof: actsave.Profile, budget: int, allow) -> tuple:
    """(seconds, plan) of actsave's fastest plan within ``budget``, or (inf, None)
    when none fits."""
    try:
        chosen = actsave.plan(prof, budget, allow=allow)
    except actsave.ConfigError:
        return math.inf, None
    return chosen.predicted_step_seconds, chosen


def smallest_rotor_budget(table: RotorTable, unit: int) -> int:
    feasible = np.isfinite(table.opt[0, table.chain.n - 1])
    return (int(np.argmax(feasible)) + table.chain.act[0]) * unit if feasible.any() else math.inf


def sweep(prof: actsave.Profile, unit: int, points: int) -> tuple:
    """(rows, facts): one row per budget, ``points`` budgets from the smallest any
    solver fits to the larger of the plain peaks of the two models; rotor's sizes in
    units of ``unit`` bytes."""
    plain = plans.predict(prof, [0]).predicted_peak_bytes
    rotor_plain = simulate(rotor_chain_from_profile(prof, unit, "up"), ((0, len(prof.layers), None),))[1] * unit
    started = time.perf_counter()
    tables = RotorTables(prof, unit, max(plain, rotor_plain))
    facts = {"unit_bytes": unit, "plain_peak": plain, "rotor_plain_peak": rotor_plain,
             "rotor_tables_s": time.perf_counter() - started,
             "auto_smallest": actsave.plan(prof, None, objective="memory", allow=AUTO_LEVERS).predicted_peak_bytes,
             "recompute_smallest": actsave.plan(prof, None, objective="memory",
                                                allow=RECOMPUTE_ONLY).predicted_peak_bytes,
             "rotor_smallest": smallest_rotor_budget(tables.upper, unit)}
    low = min(facts["auto_smallest"], facts["recompute_smallest"], facts["rotor_smallest"])
    rows = []
    for budget in np.linspace(low, max(plain, rotor_plain), points):
        budget = int(budget) // unit * unit
        if budget < low:
            budget += unit
        auto_s, auto = planned(prof, budget, AUTO_LEVERS)
        recompute_s, recompute = planned(prof, budget, RECOMPUTE_ONLY)
        rows.append({"budget": budget, "auto": auto_s, "auto_plan": auto, "auto_peak": peak_of(auto),
                     "auto_codecs": None if auto is None else {c: auto.codecs.count(c) for c in sorted(set(auto.codecs))},
                     "auto_nesting": plan_nesting(auto),
                     "recompute": recompute_s, "recompute_plan": recompute, "recompute_peak": peak_of(recompute),
                     "recompute_nesting": plan_nesting(recompute),
                     **tables.row(budget)})
    return rows, facts


def peak_of(plan: Optional[actsave.Plan]) -> Optional[int]:
    return None if plan is None else plan.predicted_peak_bytes


def plan_nesting(plan: Optional[actsave.Plan]) -> Optional[int]:
    """Levels of recompute, as rotor_profile.nesting_depth counts rotor's: 0 without
    checkpoints, 1 single-level, one more per level of a nested Range; None: no plan."""
    if plan is None:
        return None

    def levels(r) -> int:
        return 1 + max((levels(part) for part in r.inner if part.recomputed), default=0)

    checkpointed = len(plan.starts) - 1 - sum(plan.plain)
    return max((levels(r) for r in plan.nested if r is not None), default=min(checkpointed, 1))


def measure_plans(rows: list, model: torch.nn.Module, x: torch.Tensor) -> None:
    """Add each row's measured peaks (``auto_measured``, ``recompute_measured``; None
    where no plan fits): ``model``'s layers under the plan, one step (harness.activation_peak)."""
    checkpointed = actsave.CheckpointedSequential(*model)
    for r in rows:
        for solver in ("auto", "recompute"):
            plan = r[f"{solver}_plan"]
            if plan is not None:
                checkpointed.apply_plan(plan)
            r[f"{solver}_measured"] = None if plan is None else harness.activation_peak(checkpointed, x)


def auto_within_rotor(row: dict) -> bool:
    """Whether auto's time is at most rotor's lower bound (an infeasible rotor: yes)."""
    return row["auto"] <= row["rotor_lower_bound"]


def deepest_auto(args, resident_of) -> tuple:
    """(deepest depth whose auto plan fits, first depth that does not, probes): blocks
    per stage doubled from the swept depth until a plan fails, then bisected."""
    probes = {}

    def fits(n: int) -> bool:
        if n not in probes:
            model, x = build(9 * n + 2, args)
            prof = actsave.profile(model, (x,))
            try:
                actsave.plan(prof, args.max_depth_budget - resident_of(model))
                probes[n] = True
            except actsave.ConfigError:
                probes[n] = False
        return probes[n]

    good, bad = None, cifar_blocks_per_stage(args.depth)
    while fits(bad):
        good, bad = bad, 2 * bad
    if good is None:
        good = 1
        while not fits(good):
            if good >= bad - 1:
                return None, 9 * bad + 2, probes
            good += 1
    while bad - good > 1:
        middle = (good + bad) // 2
        good, bad = (middle, bad) if fits(middle) else (good, middle)
    return 9 * good + 2, 9 * bad + 2, {9 * n + 2: fit for n, fit in sorted(probes.items())}


def resident_bytes(model: torch.nn.Module) -> int:
    """Parameters, their gradients and buffers: what the sweep's actsave_auto provider
    takes off the whole-step budget before planning (bench/harness/providers.py)."""
    return (sum(2 * p.numel() * p.element_size() for p in model.parameters())
            + sum(b.numel() * b.element_size() for b in model.buffers()))


def measured_peak(depth: int, args) -> int:
    """The whole-step peak (MemTracker) of ``depth`` under the sweep's actsave_auto
    provider, after a warm-up step."""
    model, x = build(depth, args)
    batch = (x, torch.randint(0, 10, (args.batch,), generator=torch.Generator().manual_seed(1)))
    planned_model = harness.PROVIDERS["actsave_auto"].build(model, batch, args.max_depth_budget)
    harness.training_step(planned_model, batch)
    return harness.measure_step_memory(planned_model, batch, torch.device("cpu")).peak


def median_times(profiles: list) -> actsave.Profile:
    """The first profile with each layer's times (forward, backward, codecs) the median
    over ``profiles`` of the same model and batch: one step's times are noisy on a
    shared CPU, and every solver reads the same ones."""
    def median(values):
        return float(np.median(values))

    layers = []
    for versions in zip(*(prof.layers for prof in profiles)):
        first = versions[0]
        layers.append(dataclasses.replace(
            first, forward_s=median([v.forward_s for v in versions]), backward_s=median([v.backward_s for v in versions]),
            encode_s={c: median([v.encode_s[c] for v in versions]) for c in first.encode_s},
            decode_s={c: median([v.decode_s[c] for v in versions]) for c in first.decode_s}))
    return dataclasses.replace(profiles[0], layers=tuple(layers))


def build(depth: int, args) -> tuple:
    """(model, batch input) of --model at ``depth``, seeded."""
    torch.manual_seed(harness.SEED)
    if args.model == "gpt":
        return (gpt(depth, width=GPT_WIDTH, heads=GPT_HEADS, vocab_size=GPT_VOCABULARY, max_seq_len=GPT_SEQ_LEN),
                torch.randint(0, GPT_VOCABULARY, (args.batch, GPT_SEQ_LEN)))
    return cifar_resnet(depth), torch.randn(args.batch, 3, args.image_size, args.image_size)


def case_name(args) -> str:
    if args.model == "gpt":
        return f"gpt{args.depth} b{args.batch} t{GPT_SEQ_LEN} w{GPT_WIDTH} h{GPT_HEADS} v{GPT_VOCABULARY}"
    return f"cifar_resnet{args.depth} b{args.batch} {args.image_size}x{args.image_size}"


def chain_gaps(count: int, seed: int, points: int) -> dict:
    """{family: [(actsave recompute-only time / rotor time - 1, rotor single-level time /
    rotor time - 1), ...] over the budgets both solve}, and how many budgets only one
    solves, over ``count`` random chains per family: Linear + output-saving activation
    blocks (where the models coincide) and tests/planning/chains.py's random chains
    (Linear + Tanh, ReLU, BatchNorm, residual blocks ...; batch 64, width 32 in)."""
    from planning.chains import LAYER_KINDS, WIDTHS, chain

    rng = np.random.default_rng(seed)

    def output_saving():
        n = int(rng.integers(3, 11))
        return output_saving_chain([int(w) for w in rng.choice(WIDTHS, n)], str(rng.choice(sorted(ACTIVATIONS))))

    def mixed():
        n = int(rng.integers(2, 7))
        kinds = [str(k) for k in rng.choice(sorted(LAYER_KINDS), n)]
        return torch.nn.Sequential(*chain(kinds, [int(w) for w in rng.choice(WIDTHS, n)]))

    results = {}
    for family, make in (("output-saving (models coincide)", output_saving), ("chains.py random", mixed)):
        gaps, only = [], {"rotor": 0, "actsave": 0}
        for _ in range(count):
            prof = actsave.profile(make(), (torch.randn(64, 32),))
            for r in sweep(prof, exact_unit(prof), points)[0]:
                solved = math.isfinite(r["recompute"]), math.isfinite(r["rotor"])
                if all(solved):
                    gaps.append((r["recompute"] / r["rotor"] - 1, r["rotor_single_level"] / r["rotor"] - 1))
                elif any(solved):
                    only["actsave" if solved[0] else "rotor"] += 1
        results[family] = gaps, only
    return results


def gap_table(results: dict) -> str:
    lines = [["chains", "budgets", "equal", "rotor faster", "actsave faster", "gap p50 %", "gap p90 %", "gap max %",
              "min %", "single-level gap p50 %", "only rotor fits", "only actsave fits"]]
    for family, (gaps, only) in results.items():
        gap = np.array([g for g, _ in gaps]) * 100
        single = np.array([s for _, s in gaps]) * 100
        close = np.isclose(gap, 0, atol=1e-7)
        lines.append([family, str(len(gap)), str(int(close.sum())), str(int((gap > 0)[~close].sum())),
                      str(int((gap < 0)[~close].sum())),
                      *(f"{np.percentile(gap, q):.2f}" for q in (50, 90, 100)), f"{gap.min():.2f}",
                      f"{np.percentile(single, 50):.2f}", str(only["rotor"]), str(only["actsave"])])
    return format_table(lines)


def ms(seconds: float) -> str:
    return "-" if not math.isfinite(seconds) else f"{seconds * 1e3:.1f}"


def mib(nbytes) -> str:
    return "-" if nbytes is None else f"{nbytes / 2**20:.2f}"


def count(value: Optional[int]) -> str:
    return "-" if value is None else str(value)


def measured_share(r: dict, solver: str) -> str:
    """The solver's measured peak / its predicted one, or "-" (no plan, or not measured)."""
    measured = r.get(f"{solver}_measured")
    return "-" if measured is None else f"{measured / r[f'{solver}_peak']:.4f}"


def table(rows: list) -> str:
    head = ["budget MiB", "auto ms", "auto peak MiB", "auto measured/peak", "auto codecs", "auto nesting",
            "recompute ms", "recompute peak MiB", "recompute measured/peak", "recompute nesting", "rotor ms",
            "rotor lower ms", "rotor nesting", "rotor early stored", "rotor single-level ms", "auto <= rotor"]
    lines = [head] + [[mib(r["budget"]), ms(r["auto"]), mib(r["auto_peak"]), measured_share(r, "auto"),
                       "-" if r["auto_codecs"] is None else " ".join(f"{c}:{k}" for c, k in r["auto_codecs"].items()),
                       count(r["auto_nesting"]),
                       ms(r["recompute"]), mib(r["recompute_peak"]), measured_share(r, "recompute"),
                       count(r["recompute_nesting"]), ms(r["rotor"]), ms(r["rotor_lower_bound"]),
                       count(r["rotor_nesting"]),
                       count(r["rotor_early_stored"]),
                       ms(r["rotor_single_level"]),
                       "yes" if auto_within_rotor(r) else "NO"] for r in rows]
    return format_table(lines)


def csv_row(case: str, provider: str, metric: str, x_mib: float, value: float, config: dict, metadata: dict) -> dict:
    """One long-format row of bench/results/<device>.csv (the harness's columns)."""
    return {"bench": BENCH, "case": case, "provider": provider, "metric": metric, "unit": UNITS[metric],
            "x_name": "budget_MiB", "x_value": x_mib, "p20": value, "p50": value, "p80": value, "n_reps": 1,
            "config_json": json.dumps(config, sort_keys=True), **metadata}


# provider -> (the sweep row's time key, its peak key or None)
SOLVERS = {"actsave_auto": ("auto", "auto_peak"), "actsave_recompute": ("recompute", "recompute_peak"),
           "rotor": ("rotor", None), "rotor_lower_bound": ("rotor_lower_bound", None),
           "rotor_single_level": ("rotor_single_level", None)}


def sweep_csv_rows(rows: list, case: str, config: dict, metadata: dict) -> list:
    out = []
    for r in rows:
        x = r["budget"] / 2**20
        for provider, (time_key, peak_key) in SOLVERS.items():
            plan = r["auto_plan"]
            stored = None if plan is None else plan.saves_codec
            # The codecs keeping plain segments' saves, the last one's and those before it.
            saved_by = None if plan is None else sorted({c for c in plan.saves_codecs if c not in (None, "none")})
            details = {"actsave_auto": {"codecs": r["auto_codecs"], "nesting": r["auto_nesting"], "stored_codec": stored,
                                        "plain_saves_codecs": saved_by},
                       "actsave_recompute": {"nesting": r["recompute_nesting"]},
                       "rotor": {"nesting": r["rotor_nesting"], "early_stored_runs": r["rotor_early_stored"]}}
            out.append(csv_row(case, provider, "pred_step_time", x, r[time_key] * 1e3,
                               {**config, **details.get(provider, {})}, metadata))
            if peak_key is not None and r[peak_key] is not None:
                out.append(csv_row(case, provider, "pred_peak", x, r[peak_key] / 2**20, config, metadata))
                measured = r.get(f"{time_key}_measured")
                if measured is not None:
                    out.append(csv_row(case, provider, "measured_peak", x, measured / 2**20, config, metadata))
    return out


def main(argv=None) -> None:
    args = parse_arguments(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device("cpu")
    case = case_name(args)
    model, x = build(args.depth, args)
    started = time.perf_counter()
    prof = median_times([actsave.profile(model, (x,)) for _ in range(args.profiles)])
    profile_s = (time.perf_counter() - started) / args.profiles
    rows, facts = sweep(prof, int(args.unit_kib * 1024), args.points)
    if args.measure:
        measure_plans(rows, model, x)
    print(f"{case}: {len(prof.layers)} layers, {args.profiles} profiles of {profile_s:.1f} s (median layer times); rotor unit {facts['unit_bytes']} B, "
          f"its three tables in {facts['rotor_tables_s']:.1f} s")
    print(f"plain peak {mib(facts['plain_peak'])} MiB (rotor's model: {mib(facts['rotor_plain_peak'])}); smallest "
          f"feasible: auto {mib(facts['auto_smallest'])}, recompute only {mib(facts['recompute_smallest'])}, "
          f"rotor {mib(facts['rotor_smallest'])} MiB")
    print(table(rows))
    verdict = all(auto_within_rotor(r) for r in rows)
    print(f"auto's predicted step time <= rotor's (lower bound) at every budget of the sweep: {'yes' if verdict else 'NO'}")
    config = {"model": MODELS[args.model], "depth": args.depth, "batch": args.batch,
              **({"image_size": args.image_size} if args.model == "resnet" else {}), "rotor_unit_bytes": facts["unit_bytes"], "threads": args.threads,
              "times": f"per-layer medians of {args.profiles} profiled steps, the same for every solver"}
    metadata = harness.run_metadata(device)
    out_rows = sweep_csv_rows(rows, case, config, metadata)
    if args.max_depth_budget:
        deepest, failing, probes = deepest_auto(args, resident_bytes)
        peak = measured_peak(deepest, args) if deepest is not None else None
        print(f"deepest ResNet whose auto plan fits {mib(args.max_depth_budget)} MiB (whole step, planned): "
              f"{deepest} (ResNet-{failing} does not; probed {probes}); its measured step peak "
              f"{mib(peak)} MiB")
        search = {"method": "planned (predicted peak of the auto plan per probed depth)", "does_not_fit": failing,
                  "probes": probes, "measured_peak_MiB": None if peak is None else peak / 2**20}
        out_rows.append(csv_row(case, "actsave_auto", "max_depth", args.max_depth_budget / 2**20,
                                math.nan if deepest is None else deepest, {**config, **search}, metadata))
    if args.chains:
        print(f"actsave (recompute only) against rotor on {args.chains} random chains per family, "
              f"{args.points} budgets each; gap = actsave's time / rotor's - 1:")
        print(gap_table(chain_gaps(args.chains, harness.SEED, args.points)))
    out = harness.output_path(args, f"{harness.device_slug(device)}.csv")
    harness.write_csv(out_rows, out)
    print(harness.wrote(out))


if __name__ == "__main__":
    harness.imports_frozen()  # NOTE [ A script's imports, frozen ]
    main(sys.argv[1:])
