"""What a run shows: the tables on stdout and the PNG."""
from __future__ import annotations

import math
from pathlib import Path
from typing import Optional

from .providers import REFERENCE
from .results import _median


def _medians(measurements: list) -> dict:
    return {(m.x_value, m.provider, m.metric): _median(m.values) for m in measurements}


def _cell(medians: dict, key: tuple, digits: int, ratio_to: Optional[tuple] = None) -> str:
    if key not in medians:
        return "-"
    text = f"{medians[key]:.{digits}f}"
    if ratio_to in medians and medians[ratio_to] > 0:
        text += f" ({medians[key] / medians[ratio_to]:.2f}x)"
    return text


def sweep_table(measurements: list, providers: list) -> str:
    """One line per depth and provider; ratios to torch at the same depth in parentheses,
    the meta estimate of the activation peak as its deviation from the measured one."""
    medians = _medians(measurements)
    lines = [("depth", "provider", "peak MiB", "act MiB", "est act MiB", "kept MiB", "time ms", "grad SQNR dB")]
    for depth in sorted({m.x_value for m in measurements}):
        lines += [_sweep_line(medians, depth, name) for name in providers if (depth, name, "peak_mem") in medians]
    return _fixed_width(lines, left_aligned={1})


def _sweep_line(medians: dict, depth: int, name: str) -> tuple:
    def cell(metric, digits, with_ratio=True):
        return _cell(medians, (depth, name, metric), digits, (depth, REFERENCE, metric) if with_ratio else None)

    measured, estimated = medians.get((depth, name, "peak_act_mem")), medians.get((depth, name, "est_act_mem"))
    deviation = "-" if not measured or estimated is None else f"{estimated:.2f} ({estimated / measured - 1:+.2%})"
    return (
        str(depth), name,
        cell("peak_mem", 2), cell("peak_act_mem", 2), deviation, cell("kept_bytes", 2, with_ratio=False),
        cell("time", 1), cell("grad_sqnr", 1, with_ratio=False),
    )


def estimate_deviation(measurements: list) -> tuple:
    """(largest |estimated / measured - 1| of the activation peaks, runs compared)."""
    medians = _medians(measurements)
    ratios = [medians[(x, p, "est_act_mem")] / v for (x, p, m), v in medians.items()
              if m == "peak_act_mem" and v > 0 and (x, p, "est_act_mem") in medians]
    return max((abs(r - 1) for r in ratios), default=math.nan), len(ratios)


def max_depth_table(results: list) -> str:
    reference = next((m.values[0] for m in results if m.provider == REFERENCE), 0)
    lines = [("provider", "max depth", "vs torch", "method")]
    for m in results:
        depth = m.values[0]
        bound = ">= " if m.config["method"].endswith("_lower_bound") else ""
        ratio = f"{depth / reference:.2f}x" if reference else "-"
        lines.append((m.provider, f"{bound}{depth}", ratio, _describe_search(m.config)))
    return _fixed_width(lines, left_aligned={0, 3})


def _describe_search(config: dict) -> str:
    method = config["method"]
    if config["does_not_fit"] is not None:
        method += f" (does not fit: {config['does_not_fit']})"
    elif config.get("depth_cap") is not None and method.endswith("_lower_bound"):
        method += f" (the search stops at depth {config['depth_cap']})"
    return method


def _fixed_width(lines: list, left_aligned: set) -> str:
    """Columns padded to their widest cell; numbers right-aligned, the columns in
    ``left_aligned`` (names) left-aligned."""
    widths = [max(len(line[c]) for line in lines) for c in range(len(lines[0]))]

    def padded(c: int, cell: str) -> str:
        return cell.ljust(widths[c]) if c in left_aligned else cell.rjust(widths[c])

    return "\n".join("  ".join(padded(c, cell) for c, cell in enumerate(line)).rstrip() for line in lines)


MATPLOTLIB_MISSING = "no PNG: matplotlib is not installed (pip install actsave[bench])"


def pyplot():
    """``matplotlib.pyplot`` drawing to files only, or None when it is not installed."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def save_figure(fig, path: Path) -> None:
    """Write ``fig`` to ``path``, making folders as needed, and free it."""
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    pyplot().close(fig)


PANELS = (  # metric, y label, y scale, title; a panel without rows is left out
    ("peak_act_mem", "peak activation memory (MiB)", "log", "memory, measured"),
    ("time_ratio", "step time / torch", "linear", "time ratio, measured"),
    ("est_device_peak", "device peak, meta estimate (MiB)", "log", "device peak at real scale"),
)


def plot(measurements: list, providers: list, title: str, path: Path) -> Optional[str]:
    """Activation memory and time ratio vs depth, and where a real-scale stage ran,
    the estimated device peak vs depth (log axes), one line per provider. Returns a
    note when it cannot, else None."""
    plt = pyplot()
    if plt is None:
        return MATPLOTLIB_MISSING
    medians = _medians(measurements)
    panels = [panel for panel in PANELS if any(m == panel[0] for _, _, m in medians)]
    fig, axes_row = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.5), squeeze=False)
    for axes, (metric, label, scale, panel_title) in zip(axes_row[0], panels):
        for name in providers:
            points = sorted((x, v) for (x, p, m), v in medians.items() if p == name and m == metric)
            if points:
                axes.plot(*zip(*points), marker="o", label=name)
        axes.set(xlabel="depth", ylabel=label, yscale=scale, title=panel_title)
        if metric == "est_device_peak":
            axes.set_xscale("log")
        axes.grid(True, which="both", alpha=0.3)
        axes.legend(fontsize="small")
    fig.suptitle(title)
    save_figure(fig, path)
    return None
