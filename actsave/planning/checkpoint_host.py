"""The host work of a checkpointed segment, which its layers' profiled times leave out
(:class:`CheckpointHostWork`), measured once per process on a CPU.

A checkpointed segment runs actsave's runtime besides its layers: as it starts (its
frame, the snapshot of module state, the recompute's setup) and for each tensor it
saves (the pack hook in the forward; the unpack hook, the recompute's fill and its
early-stop check in the backward). On layers that take well under a millisecond that
work is most of the segment's cost, and a time model without it predicts several times
too fast a step and plans too many segments (docs/planner.md, "Limits of plans").

NOTE [ Host work counted on a CPU only ]
On a CPU the host is the device: the runtime's work adds to the step, whatever the
layers' sizes. On CUDA the host queues kernels ahead of the device and its work hides
behind theirs unless the layers are tiny, so counting it would charge time a
device-bound step does not spend; it is left out there (0), as on meta profiles, which
have no times at all.

The work is measured on a chain of its own, not the model's: a few element-wise layers
on a tensor of a few elements, whose own forward takes microseconds, run as one
checkpointed segment, as one checkpointed segment per layer, and plainly. Their
differences give the work per call and per save; both depend on the process (Python,
torch, the machine), not on the model, so they are measured once and kept.
"""
from __future__ import annotations

import time
from typing import NamedTuple

import torch
from torch import nn

from ..runtime.chain import run_chain
from ..runtime.keep_rules import EXACT
from .instrumented_step import own_saves
from .segments import Segment

# The calibration chain: its length, and interleaved rounds of a few steps each. Each
# kind of step takes its least time: the host's own work, which other processes'
# load only lengthens, and a load while it runs would otherwise stay in every profile
# of the process.
_LAYERS = 8
_ROUNDS = 9
_STEPS = 3


class CheckpointHostWork(NamedTuple):
    """Seconds of host work a checkpointed segment adds beyond its layers' recompute:
    ``call_s`` once per segment (or nested range) and ``save_s`` per tensor its layers
    save (each goes through the runtime's hooks in the forward, the recompute and the
    backward)."""

    call_s: float
    save_s: float


NO_HOST_WORK = CheckpointHostWork(0.0, 0.0)

_measured: dict = {}  # device type -> CheckpointHostWork: one per process (module docstring)


def checkpoint_host_work(device: torch.device) -> CheckpointHostWork:
    """The host work a checkpointed segment adds on ``device``: measured on a CPU,
    once per process, and :data:`NO_HOST_WORK` elsewhere (NOTE [ Host work counted on
    a CPU only ])."""
    if device.type != "cpu":
        return NO_HOST_WORK
    if "cpu" not in _measured:
        with own_saves(), torch.enable_grad():  # hooks around the caller do not see its saves
            _measured["cpu"] = _measure()
    return _measured["cpu"]


def _measure() -> CheckpointHostWork:
    chain = nn.Sequential(*(nn.Tanh() for _ in range(_LAYERS + 1)))  # one save each: its output
    layers = list(chain)
    x = torch.linspace(-1.0, 1.0, 8, device="cpu").view(1, 8).requires_grad_()  # draws no random numbers
    runs = {"plain": [Segment(0, _LAYERS + 1, False)],
            "one": [Segment(0, _LAYERS, True), Segment(_LAYERS, _LAYERS + 1, False)],
            "each": [*(Segment(i, i + 1, True) for i in range(_LAYERS)), Segment(_LAYERS, _LAYERS + 1, False)]}
    for segments in runs.values():  # warm-up: the first calls build caches
        _step_seconds(chain, layers, x, segments)
    seconds = {name: [] for name in runs}
    for _ in range(_ROUNDS):
        for name, segments in runs.items():
            seconds[name].append(_step_seconds(chain, layers, x, segments))
    plain, one, each = (min(seconds[name]) for name in runs)
    call_s = max(0.0, (each - one) / (_LAYERS - 1))
    forward_s = _forward_seconds(chain, x)  # the recompute the model counts already
    save_s = max(0.0, (one - plain - call_s - forward_s * _LAYERS / (_LAYERS + 1)) / _LAYERS)
    return CheckpointHostWork(call_s, save_s)


def _step_seconds(chain: nn.Module, layers: list, x: torch.Tensor, segments: list) -> float:
    """Seconds of a training step of ``chain`` run as ``segments``: the least of
    :data:`_STEPS` (the host's own noise only adds)."""
    policies = [EXACT] * len(segments)
    best = float("inf")
    for _ in range(_STEPS):
        start = time.perf_counter()
        output, _ = run_chain(chain, x, layers, segments, policies)
        output.sum().backward()
        best = min(best, time.perf_counter() - start)
    return best


def _forward_seconds(chain: nn.Module, x: torch.Tensor) -> float:
    with torch.no_grad():
        best = float("inf")
        for _ in range(_STEPS):
            start = time.perf_counter()
            chain(x)
            best = min(best, time.perf_counter() - start)
    return best
