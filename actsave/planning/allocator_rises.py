"""The allocator's own count over the spans of a measured step: :class:`AllocatorRises`
(instrumented_step.py's ``measure_allocator_rises`` runs the step).

NOTE [ Allocator rises ]
LiveBytes (live_bytes.py) counts the storages of the tensors a step makes. Some
kernels also take memory from the allocator that no tensor of the step holds: cuDNN's
convolution workspaces above all (docs/limits.md, "Memory no tensor holds"). Each
lives inside one operator, so it raises the peak of the layer that runs it and
nothing after. So where the allocator's count can be read, a profile reads it over
the same spans as LiveBytes (each layer's forward and backward, the loss, each layer's
forward under no_grad) and takes each span's rise as the larger of the two: a
workspace then prices the layer that takes it, in every event the model builds from
that rise (its forward, recompute and backward); where the counts agree nothing
changes. Rules:

- Read on CUDA, from torch.cuda's statistics: the bytes allocated as a span starts and
  their peak since, which needs the peak statistics reset at each span's start. So
  profiling a CUDA model resets the device's peak statistics (``max_memory_allocated``
  reads the peak since the profile; reset them before a step you measure).
- Not read on a CPU: c10 keeps a count of its CPU allocator for torch.profiler only,
  which would end a profiler the user has running and logs as it starts and stops.
  There a profile counts live storages alone (docs/limits.md says what it misses).
  Meta tensors have no allocator.
- Read in a step of its own, after the timed steps: a process's first steps take
  memory they keep for good (cuBLAS's workspace, cuDNN's handles), which is no
  activation memory of a later step; by then they hold it already.
"""
from __future__ import annotations

import contextlib

import torch

from ..devices import allocator_statistics


class AllocatorRises:
    """torch.cuda's count of ``device``'s allocated bytes: :meth:`span` yields a
    one-item list that holds, on exit, how far the count rose above its value as the
    span began; 0 where the count is not ``readable`` (not on CUDA). Spans may nest: a
    span's peak takes in those read as spans inside it begin and end."""

    def __init__(self, device):
        self._device = torch.device(device)
        self.readable = allocator_statistics(self._device)
        self._open = []  # [bytes allocated at its start, peak so far, its result], per open span

    @contextlib.contextmanager
    def span(self):
        if not self.readable:
            yield [0]
            return
        self._note_peak()
        torch.cuda.reset_peak_memory_stats(self._device)
        start = torch.cuda.memory_allocated(self._device)
        entry = [start, start, [0]]
        self._open.append(entry)
        try:
            yield entry[2]
        finally:
            self._note_peak()
            self._open = [other for other in self._open if other is not entry]  # two may hold equal values
            entry[2][0] = entry[1] - entry[0]

    def rise_so_far(self) -> int:
        """The innermost open span's rise until now (0 outside every span)."""
        if not self._open:
            return 0
        self._note_peak()
        start, peak, _ = self._open[-1]
        return peak - start

    def _note_peak(self) -> None:
        peak = torch.cuda.max_memory_allocated(self._device)
        for entry in self._open:
            entry[1] = max(entry[1], peak)


def larger_of_each(live: list, allocator: list) -> list:
    """Each span's rise: the larger of the live storages' and the allocator's."""
    return [max(a, b) for a, b in zip(live, allocator, strict=True)]


__all__ = ["AllocatorRises", "larger_of_each"]
