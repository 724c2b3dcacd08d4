"""bench/frontier.py's reports: a case's systems, measured, as CSV rows, and the
tables it prints of them."""
from __future__ import annotations

import collections
import json
import statistics
from dataclasses import dataclass
from typing import Optional

from actsave.text import format_table

from frontier_cases import Case
from frontier_systems import System
from host_overhead import paired_ratio

MiB = 2**20

COLUMNS = (
    "case", "system", "family", "point", "levers", "budget_bytes", "peak_bytes", "pred_peak_bytes", "step_s",
    "pred_step_s", "step_vs_plain", "peak_vs_plain", "planner_step_s", "planner_plain_step_s", "peer",
    "peak_vs_peer", "step_vs_peer", "step_vs_peer_paired", "plan", "note", "rounds", "device_name",
    "torch_version", "triton_version", "actsave_version", "git_sha", "timestamp_utc", "config_json",
)


@dataclass
class CaseResult:
    """A case's systems, measured, and the notes its run made."""

    case: Case
    systems: list
    notes: list


def saved_text(saved: collections.Counter) -> str:
    return ", ".join(f"{op.removeprefix('aten.')} {count}" for op, count in sorted(saved.items()))


def _paired(system: System) -> Optional[float]:
    if system.pair_times is None:
        return None
    return statistics.median(a / b for a, b in zip(*system.pair_times))


def _times(result: CaseResult) -> dict:
    return {s.name: s.times for s in result.systems}


def plain_of(result: CaseResult) -> System:
    return next(s for s in result.systems if s.name == "plain")


def predicted_step(system: System, plain: System) -> Optional[float]:
    """Plain's measured step plus what the planner predicts the plan adds to plain's."""
    if system.planner_step is None:
        return None
    return statistics.median(plain.times) + system.planner_step - system.planner_plain_step


def rows_of(result: CaseResult, metadata: dict, run_config: dict) -> list:
    plain = plain_of(result)
    times = _times(result)
    by_name = {s.name: s for s in result.systems}
    rows = []
    for s in result.systems:
        peer = by_name.get(s.peer)
        predicted = predicted_step(s, plain)
        rows.append({
            "case": result.case.description, "system": s.name, "family": s.family, "point": s.point,
            "levers": s.levers, "budget_bytes": s.budget, "peak_bytes": s.peak, "pred_peak_bytes": s.pred_peak,
            "step_s": statistics.median(s.times), "pred_step_s": predicted,
            "step_vs_plain": paired_ratio(times, s.name, plain.name), "peak_vs_plain": s.peak / plain.peak,
            "planner_step_s": s.planner_step, "planner_plain_step_s": s.planner_plain_step,
            "peer": s.peer, "peak_vs_peer": None if peer is None else s.peak / peer.peak,
            "step_vs_peer": None if peer is None else paired_ratio(times, s.name, peer.name),
            "step_vs_peer_paired": _paired(s),
            "plan": s.plan, "note": "; ".join(filter(None, [s.note, _saved_note(s)])),
            "rounds": len(s.times), **metadata,
            "config_json": json.dumps({**result.case.config, **run_config}, sort_keys=True),
        })
    return rows


def _saved_note(system: System) -> str:
    return f"saved a step: {saved_text(system.saved_a_step)}" if system.saved_a_step else ""


def _mib(nbytes) -> str:
    return "-" if nbytes is None or nbytes == "" else f"{float(nbytes) / MiB:.2f}"


def _ms(seconds) -> str:
    return "-" if seconds is None or seconds == "" else f"{float(seconds) * 1e3:.1f}"


def _x(ratio) -> str:
    return "-" if ratio is None or ratio == "" else f"{float(ratio):.3f}x"


def case_table(rows: list) -> str:
    lines = [["system", "budget MiB", "peak MiB", "pred peak", "step ms", "pred step", "x plain step",
              "x plain peak", "plan"]]
    for r in rows:
        lines.append([r["system"], _mib(r["budget_bytes"]), _mib(r["peak_bytes"]), _mib(r["pred_peak_bytes"]),
                      _ms(r["step_s"]), _ms(r["pred_step_s"]), _x(r["step_vs_plain"]), _x(r["peak_vs_plain"]),
                      r["plan"]])
    return format_table(lines)


def at_peer_table(rows: list, with_case: bool = False) -> str:
    """Each peer point against actsave planned within that peer's measured peak."""
    by_system = {(r["case"], r["system"]): r for r in rows}
    lines = [(["case"] if with_case else []) + ["peer", "peer peak MiB", "peer step ms", "actsave levers",
                                                "actsave peak / peer's", "actsave step / peer's",
                                                "in pair rounds", "actsave plan"]]
    for r in rows:
        if not r["peer"]:
            continue
        peer = by_system[(r["case"], r["peer"])]
        point = r["peer"] if r["point"] == r["peer"] else f"{r['peer']} ({r['point']})"
        lines.append(([r["case"].split(" ")[0]] if with_case else [])
                     + [point, _mib(peer["peak_bytes"]), _ms(peer["step_s"]), r["levers"],
                        _x(r["peak_vs_peer"]), _x(r["step_vs_peer"]), _x(r["step_vs_peer_paired"]), r["plan"]])
    return format_table(lines)


def noise_line(rows: list) -> str:
    again = next(r for r in rows if r["family"] == "again")
    paired = again["step_vs_peer_paired"]
    in_pairs = f"; in pair rounds, {_x(paired)}" if paired not in (None, "") else ""
    return (f"noise floor: plain timed twice in the same rounds, the second copy at {_x(again['step_vs_plain'])} "
            f"the first (median of paired ratios){in_pairs}; a difference of that size means nothing")


def summary_table(rows: list) -> str:
    return at_peer_table(rows, with_case=True)
