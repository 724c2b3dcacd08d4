"""What a run shows: the tables on stdout and the PNG."""
from __future__ import annotations

import math
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from .providers import PROVIDERS, REFERENCE, display_name
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
    fig.savefig(path, dpi=120, bbox_inches="tight")  # captions and legends beside the axes included
    pyplot().close(fig)


# How each provider is drawn. compress="int8" and compress="fp8" keep the same bytes,
# so their memory lines coincide: different markers and dashes keep both visible.
STYLES = {
    "torch": {"color": "black", "marker": "o", "linestyle": "-"},
    "torch_ckpt": {"color": "tab:orange", "marker": "s", "linestyle": "-"},
    "actsave_none": {"color": "tab:blue", "marker": "^", "linestyle": "-"},
    "actsave_int8": {"color": "tab:red", "marker": "D", "linestyle": "--", "markersize": 7},
    "actsave_fp8": {"color": "tab:purple", "marker": "x", "linestyle": ":", "markersize": 10, "markeredgewidth": 2},
    "actsave_offload": {"color": "tab:brown", "marker": "v", "linestyle": "-."},
    "actsave_int8_offload": {"color": "tab:pink", "marker": "P", "linestyle": "--", "markersize": 8},
    "actsave_auto": {"color": "tab:green", "marker": "*", "linestyle": "-", "markersize": 11},
}
OFFLOADING = ("actsave_offload", "actsave_int8_offload")


def style(provider: str) -> dict:
    return STYLES.get(provider, {"marker": "o", "linestyle": "-"})


@dataclass(frozen=True)
class Panel:
    metric: str
    ylabel: str
    yscale: str
    title: str
    xscale: str = "linear"


PANEL_INCHES, LEGEND_INCHES = 5.6, 3.8
PANELS = (  # the line panels, left to right; one without rows is left out
    Panel("peak_mem", "step peak (MiB): parameters, gradients, activations", "linear",
          "memory of a training step, measured"),
    Panel("time_ratio", "step time / nn.Sequential's", "linear", "time, measured"),
    Panel("est_device_peak", "device activation peak (MiB)", "log", "at real scale on a GPU: meta estimate", "log"),
)


def _wrapped(text: str, width: int = 70) -> str:
    return "\n".join(textwrap.wrap(text, width))


def plot(measurements: list, providers: list, title: str, path: Path, max_depths: Sequence = (),
         budget_mib: Optional[float] = None, device_type: str = "cpu", depth_name: str = "depth {}") -> Optional[str]:
    """The sweep's picture. Above, where a max-depth search ran: how deep each provider
    trains in the same memory (bars, labelled with the multiple of plain PyTorch's
    depth). Below, against depth, one line per provider: the measured step peak (with
    ``budget_mib``, what ``segments="auto"`` plans for, as a line), the measured time
    ratio, and where a real-scale stage ran its estimated device peak (with the
    max-depth budget as a line). One legend beside them, in the API's names
    (``DISPLAY_NAMES``). ``depth_name`` formats a depth ("ResNet-{}"). Returns a note
    when it cannot draw, else None."""
    plt = pyplot()
    if plt is None:
        return MATPLOTLIB_MISSING
    from matplotlib import ticker
    medians = _medians(measurements)
    panels = [panel for panel in PANELS if any(m == panel.metric for _, _, m in medians)]
    rows = 2 if max_depths else 1
    fig = plt.figure(figsize=(PANEL_INCHES * len(panels) + LEGEND_INCHES, 5.4 * rows + 0.6))
    grid = fig.add_gridspec(rows, len(panels) + 1, width_ratios=[PANEL_INCHES] * len(panels) + [LEGEND_INCHES],
                            height_ratios=[0.8, 1][-rows:])
    if max_depths:
        _max_depth_panel(fig.add_subplot(grid[0, :]), max_depths, providers, device_type, depth_name)
    handles = {}
    for column, panel in enumerate(panels):
        axes = fig.add_subplot(grid[rows - 1, column])
        for name in providers:
            points = sorted((x, v) for (x, p, m), v in medians.items() if p == name and m == panel.metric)
            if points:
                (line,) = axes.plot(*zip(*points), label=display_name(name), **style(name))
                handles.setdefault(display_name(name), line)
        axes.set(xlabel="depth", ylabel=panel.ylabel, xscale=panel.xscale, yscale=panel.yscale, title=panel.title)
        depths = sorted({x for x, _, m in medians if m == panel.metric})
        axes.set_xticks(depths, [str(depth) for depth in depths])  # the depths measured
        axes.xaxis.set_minor_locator(ticker.NullLocator())
        axes.grid(True, which="both", alpha=0.3)
        caption = _decorate(axes, panel, medians, providers, max_depths, budget_mib, device_type, depth_name)
        if caption:
            axes.text(0, -0.14, _wrapped(caption, 62), transform=axes.transAxes, va="top", fontsize="small",
                      style="italic")
    legend = fig.add_subplot(grid[rows - 1, len(panels)])
    legend.axis("off")
    legend.legend(handles.values(), handles.keys(), loc="center left", frameon=False, fontsize="medium",
                  handlelength=3.5, title="CheckpointedSequential(...)\nand baselines")
    fig.suptitle(title, fontsize="large")
    save_figure(fig, path)
    return None


def _decorate(axes, panel: Panel, medians: dict, providers: list, max_depths: Sequence, budget_mib: Optional[float],
              device_type: str, depth_name: str) -> str:
    """The panel's reference lines; returns its caption ("" for none)."""
    if panel.metric == "peak_mem":
        axes.set_ylim(bottom=0)
        if budget_mib is not None:
            searched = any(m.x_name == "budget_MiB" for m in max_depths)
            what = 'segments="auto"' + (" and max depth" if searched else "")
            _budget_line(axes, budget_mib, f"B = {_mib(budget_mib)} MiB, {what}", right=True)
        offloads = [name for name in OFFLOADING if name in providers]
        if device_type == "cpu" and offloads:
            where = ("The real-scale panel and the max-depth bars count a GPU's memory, where it does."
                     if any(m == "est_device_peak" for _, _, m in medians) else "A GPU run shows what it saves.")
            return ("offload=True on a CPU: host memory is the device's own, so offload saves nothing here "
                    f"(its copies count against the same memory). {where}")
    if panel.metric == "time_ratio":
        axes.axhline(1.0, color="black", linewidth=0.8)
        if device_type == "cpu":
            return "CPU times, one thread: indicative only; GPU times are in docs/performance.md."
    if panel.metric == "est_device_peak":
        from matplotlib import ticker  # plot() has found matplotlib
        axes.yaxis.set_major_formatter(ticker.FuncFormatter(lambda value, _: _number(value)))
        axes.yaxis.set_minor_formatter(ticker.FuncFormatter(_two_and_five))
        real_scale = [m for m in max_depths if m.x_name == "act_budget_MiB"]
        if real_scale:
            reference = real_scale[0].config.get("reference_depth")
            _budget_line(axes, real_scale[0].x_value,
                         f"plain {depth_name.format(reference)}'s activations, {_mib(real_scale[0].x_value)} MiB:\n"
                         "the max-depth budget", below=True)
        shapes = {tuple(m.config.get("input_shape", ())) for m in max_depths} - {()}
        shape = f", input {'x'.join(map(str, *shapes))}" if len(shapes) == 1 else ""
        return (f"actsave.estimate on meta tensors{shape}, CUDA accounting (offload to host memory); "
                "validated against the measured steps (est act in the table).")
    return ""


def _mib(value: float) -> str:
    return f"{value:,.0f}" if value >= 10 else f"{value:.2g}"


def _two_and_five(value: float, _) -> str:
    """A log axis's minor label at 2 and 5 times a power of ten, else none."""
    leading = value / 10 ** math.floor(math.log10(value)) if value > 0 else 0
    return _number(value) if any(math.isclose(leading, d) for d in (2, 5)) else ""


def _number(value: float) -> str:
    return f"{value:,.0f}" if value >= 1 else f"{value:.2g}"


def _budget_line(axes, mib: float, label: str, below: bool = False, right: bool = False) -> None:
    """A horizontal line at ``mib``, labelled at its left end (or ``right``), above it
    (or ``below``)."""
    axes.axhline(mib, color="tab:green", linestyle=(0, (6, 3)), linewidth=1.3)
    bottom, top = axes.get_ylim()
    if not bottom < mib < top * 0.95:  # a budget beyond the lines is still drawn, with room for its label
        log = axes.get_yscale() == "log"
        axes.set_ylim(min(bottom, mib / 1.3 if log else bottom), max(top, mib * (1.3 if log else 1.08)))
    axes.annotate(label, xy=(0.98 if right else 0.02, mib), xycoords=("axes fraction", "data"),
                  xytext=(0, -3 if below else 3), textcoords="offset points", ha="right" if right else "left",
                  va="top" if below else "bottom", fontsize="small", color="tab:green")


def _max_depth_panel(axes, max_depths: Sequence, providers: list, device_type: str, depth_name: str) -> None:
    """Horizontal bars, one per provider: its max depth, labelled with the depth and
    its multiple of plain PyTorch's (lower bounds, where the search stopped, hatched
    and marked ≥); a provider without one, and why."""
    found = {m.provider: m for m in max_depths}
    names = [name for name in providers if name in found] + [name for name in found if name not in providers]
    names += [name for name in providers if name not in found]  # a provider the search could not run, with why
    reference = found[REFERENCE].values[0] if REFERENCE in found else 0
    deepest = max((m.values[0] for m in max_depths), default=1)
    caps = set()
    for row, name in enumerate(names):
        if name not in found:
            timed = name in PROVIDERS and PROVIDERS[name].timed_plan
            axes.text(0, row, "  plans from a timed step: no meta-tensor estimate" if timed else "  not searched",
                      va="center", fontsize="small", style="italic", color="gray")
            continue
        m = found[name]
        depth, bound = m.values[0], m.config.get("method", "").endswith("_lower_bound")
        axes.barh(row, depth, height=0.65, color=style(name).get("color"), alpha=0.85, hatch="//" if bound else None,
                  edgecolor="white" if bound else None)
        at_least = "≥ " if bound else ""
        label = f"  {at_least}{depth_name.format(depth)}"
        if reference:
            sets_budget = name == REFERENCE and m.x_name == "act_budget_MiB"
            label += f"   {at_least}{depth / reference:.1f}x" + ("  (it sets the budget)" if sets_budget else "")
        axes.text(depth, row, label, va="center", fontsize="medium", fontweight="bold" if name != REFERENCE else None)
        if bound and m.config.get("depth_cap"):
            caps.add(m.config["depth_cap"])
    for cap in caps:
        axes.axvline(cap, color="gray", linestyle=":", linewidth=1)
        axes.annotate("the search stops here", xy=(cap, 1.0), xycoords=("data", "axes fraction"), xytext=(-4, -4),
                      textcoords="offset points", ha="right", va="top", fontsize="small", color="gray")
    axes.set_yticks(range(len(names)), [display_name(name) for name in names])
    axes.set_ylim(len(names) - 0.5, -0.5)  # top to bottom, a row without a bar included
    axes.set_xlim(0, deepest * 1.25)
    axes.set_xlabel(f"max depth ({depth_name.format('N')})")
    axes.grid(True, axis="x", alpha=0.3)
    axes.set_title(_max_depth_title(max_depths, device_type, depth_name), fontsize="large", fontweight="bold",
                   loc="left")


def _max_depth_title(max_depths: Sequence, device_type: str, depth_name: str) -> str:
    m = max_depths[0]
    if m.x_name == "act_budget_MiB":
        reference = depth_name.format(m.config.get("reference_depth"))
        shape = "x".join(map(str, m.config.get("input_shape", ())))
        return (f"How much deeper in the same memory: the deepest model whose activations fit in plain {reference}'s "
                f"({_mib(m.x_value)} MiB at input {shape}, GPU, meta estimate)")
    return (f"How much deeper in the same memory: the deepest model whose training step fits in {_mib(m.x_value)} MiB "
            f"(measured on {device_type.upper() if device_type == 'cpu' else 'the GPU'})")
