"""The sweep: every provider at every depth, timed in turn and measured."""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from actsave.planning.live_bytes import allocation_bytes

from .measure import (StepMemory, _release_memory, _unless_out_of_memory, estimated_act_peak, interleaved_times,
                      measure_step_memory, training_step, worst_grad_sqnr)
from .progress import Progress
from .providers import PROVIDERS, REFERENCE, Provider
from .results import _median
from .workload import Measurement, MiB, Workload, _batch, _seeded_model


@dataclass
class ProviderRun:
    times_ms: list
    memory: StepMemory
    grads: list  # on the CPU: the sweep holds the reference's while others run
    estimated_act: int  # peak activation bytes less the batch, predicted on meta tensors


def prepared(provider: Provider, base: nn.Sequential, batch: tuple, budget: int, device) -> nn.Module:
    """The provider's model after one training step, which allocates the gradients (so
    they count as resident) and lets a model that plans at its first call plan."""
    model = provider.build(copy.deepcopy(base).to(device), batch, budget)
    training_step(model, batch)
    return model


def measure_provider(model: nn.Module, batch: tuple, times: list, device) -> ProviderRun:
    """One step under the memory tracker, the same step estimated on meta tensors."""
    model.zero_grad(set_to_none=False)
    memory = measure_step_memory(model, batch, device)
    grads = [p.grad.detach().cpu() for p in model.parameters()]
    inputs = batch[0]
    # The estimate counts the batch as activation memory; the sweep counts it resident.
    estimated = estimated_act_peak(model, batch, device) - allocation_bytes(inputs.untyped_storage().nbytes(), device)
    return ProviderRun(times, memory, grads, estimated)


def provider_measurements(name: str, depth: int, run: ProviderRun, reference: Optional[ProviderRun]) -> list:
    def measured(metric, values):
        return Measurement(name, metric, "depth", depth, tuple(values))

    measurements = [
        measured("peak_mem", [run.memory.peak / MiB]),
        measured("peak_act_mem", [(run.memory.peak - run.memory.resident) / MiB]),
        measured("est_act_mem", [run.estimated_act / MiB]),
        measured("time", run.times_ms),
    ]
    if PROVIDERS[name].uses_actsave:
        measurements.append(measured("kept_bytes", [run.memory.kept / MiB]))
    if reference is not None:
        reference_ms = _median(reference.times_ms)
        measurements.append(measured("time_ratio", [t / reference_ms for t in run.times_ms]))
        measurements.append(measured("grad_sqnr", [worst_grad_sqnr(reference.grads, run.grads)]))
    return measurements


def sweep(workload: Workload, depths: list, providers: list, budget: int, repeats: int, device,
          notes: list) -> list:
    """Measurements of every provider at every depth (reference first at each depth)."""
    measurements = []
    progress = Progress(len(depths) * len(providers) * 2, workload.bench)
    for depth in depths:
        base, batch = _seeded_model(workload, depth), _batch(workload, device)
        models = {}
        for name in providers:
            progress.describe(f"depth {depth} {name}: warm-up")
            models[name] = _unless_out_of_memory(prepared, PROVIDERS[name], base, batch, budget, device)
            progress.advance()
            if models[name] is None:
                notes.append(f"{name} at depth {depth}: out of memory")
                del models[name]
        progress.describe(f"depth {depth}: timing, {repeats} rounds")
        times = interleaved_times(models, batch, repeats, device)
        reference = None
        for name in list(models):
            progress.describe(f"depth {depth} {name}: memory")
            run = measure_provider(models.pop(name), batch, times[name], device)
            _release_memory(device)
            progress.advance()
            reference = run if name == REFERENCE else reference
            measurements += provider_measurements(name, depth, run, reference)
    progress.close()
    return measurements
