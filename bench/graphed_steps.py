"""Eager against CUDA-graphed training steps: the GPU speed stage's ``graphs`` phase
(bench/gpu_speed.py). At a small batch the host, not the device, sets a step's time;
a captured step replays with no host work between its kernels.

Each provider of host_overhead's ResNet case (torch's checkpoint and every actsave
mode) is built twice from one seeded model: one trains eagerly, the other is captured
as README's recipe says (warm-up steps on a side stream, then the whole step, forward
and backward, in one ``torch.cuda.graph``). Then:
- its gradients after a replay against the eager step's on the same batch, bit for bit
  (the recipe must never change what a step computes);
- rounds of one eager step and one replay per provider, in turn, each timed as wall
  time with the device synchronized before and after: the replay's time is the
  step's device time plus one graph launch.
CUDA only: elsewhere :func:`measure` says so and measures nothing.
"""
from __future__ import annotations

import copy
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

import host_overhead
from actsave.text import format_table

PROVIDERS = ("torch_ckpt", "actsave_none", "actsave_int8", "actsave_fp8", "actsave_offload", "actsave_int8_offload")


def capture(model: torch.nn.Module, batch: tuple, warmup: int = 3) -> tuple:
    """``(graph, static_batch)``: one whole training step of ``model`` captured after
    ``warmup`` eager steps on a side stream (actsave plans, Triton compiles); replay it
    after copying a batch into ``static_batch``."""
    static = tuple(t.clone() for t in batch)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            model.zero_grad(set_to_none=True)
            host_overhead.forward_loss(model, static).backward()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    model.zero_grad(set_to_none=True)
    with torch.cuda.graph(graph):
        host_overhead.forward_loss(model, static).backward()
    return graph, static


@dataclass
class GraphedResult:
    eager_s: list = field(default_factory=list)
    graphed_s: list = field(default_factory=list)
    same_gradients: Optional[bool] = None
    error: Optional[str] = None

    def ratio(self) -> Optional[float]:
        """Median over rounds of the replay's time over the eager step's."""
        pairs = list(zip(self.graphed_s, self.eager_s))
        return statistics.median(g / e for g, e in pairs) if pairs else None


def _timed(function: Callable[[], None]) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    function()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def measure(case: host_overhead.Case, names, rounds: int, device: torch.device, log) -> dict:
    """``{name: GraphedResult}`` (module docstring); ``{}`` without CUDA."""
    if device.type != "cuda":
        log("graphs: CUDA graphs need a CUDA device; nothing measured")
        return {}
    eager, batch = host_overhead.build_models(case, list(names), device)
    graphed = {name: copy.deepcopy(model) for name, model in eager.items()}
    results, replays = {name: GraphedResult() for name in names}, {}
    for name in names:
        try:
            graph, static = capture(graphed[name], batch)
            graph.replay()
            host_overhead.train_step(eager[name], batch)
            torch.cuda.synchronize()
            results[name].same_gradients = all(
                torch.equal(p.grad, q.grad) for p, q in zip(graphed[name].parameters(), eager[name].parameters()))
            replays[name] = graph.replay
        except Exception as error:  # one provider's refusal (torch's, named) leaves the others to measure
            results[name].error = f"{type(error).__name__}: {str(error).splitlines()[0][:120]}"
            log(f"graphs: {name} could not be captured: {results[name].error}")
    log(f"graphs: {rounds} rounds of an eager step and a replay for {len(replays)} providers")
    for _ in range(rounds):
        for name, replay in replays.items():
            results[name].eager_s.append(_timed(lambda: host_overhead.train_step(eager[name], batch)))
            results[name].graphed_s.append(_timed(replay))
    return results


def table(results: dict) -> str:
    rows = [("provider", "eager ms", "graphed ms", "graphed / eager", "gradients", "note")]
    for name, r in results.items():
        rows.append((name, _ms(r.eager_s), _ms(r.graphed_s), "-" if r.ratio() is None else f"{r.ratio():.3f}",
                     {None: "-", True: "bit-equal", False: "DIFFER"}[r.same_gradients], r.error or ""))
    return format_table(rows)


def _ms(seconds: list) -> str:
    return f"{statistics.median(seconds) * 1e3:.2f}" if seconds else "-"
