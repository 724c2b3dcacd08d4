"""One training step: timing it, its peak memory (CUDA allocator or ``MemTracker``),
the gradient error against the reference."""
from __future__ import annotations

import atexit
import contextlib
import ctypes
import gc
import inspect
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed._tools import mem_tracker
from torch.distributed._tools.mem_tracker import MemTracker

import actsave
from actsave.codecs import sqnr_db
from actsave.devices import synchronize


def step_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The loss of every sweep's training step: cross-entropy over the last dimension."""
    return F.cross_entropy(logits.flatten(0, -2), targets.flatten())


def estimated_act_peak(model: nn.Module, batch: tuple, device) -> int:
    """``actsave.estimate``'s activation peak (the batch included) of the step that
    :func:`training_step` runs, its cross-entropy included, on meta tensors."""
    inputs, targets = (torch.empty(t.shape, dtype=t.dtype, device="meta") for t in batch)
    return actsave.estimate(model, [inputs], device=device,
                            loss=lambda logits: step_loss(logits, targets)).activation_peak_bytes


def training_step(model: nn.Module, batch: tuple) -> int:
    """Forward, cross-entropy loss, backward. Returns the bytes actsave keeps for
    backward at the end of the forward."""
    inputs, targets = batch
    before = _actsave_kept_bytes()
    logits = model(inputs)
    kept = _actsave_kept_bytes() - before
    step_loss(logits, targets).backward()
    return kept


def _actsave_kept_bytes() -> int:
    stored = actsave.kept_bytes()
    return stored["device"] + stored["host"]


def time_steps(model: nn.Module, batch: tuple, repeats: int, device: torch.device) -> list:
    """Milliseconds of ``repeats`` training steps, each timed alone."""
    times = []
    for _ in range(repeats):
        model.zero_grad(set_to_none=False)
        synchronize(device)
        start = time.perf_counter()
        training_step(model, batch)
        synchronize(device)
        times.append((time.perf_counter() - start) * 1e3)
    return times


class _GlobalPeakMemTracker(MemTracker):
    """``MemTracker`` without its per-module peaks.

    After every op MemTracker updates the peak of each module seen so far: O(modules)
    per op, quadratic in depth (one step of ResNet-164 took 33 s instead of 1 s on
    CPU). The global peak, all the benchmark reads, is kept exactly as MemTracker
    keeps it; tests/bench checks that both report the same peak. It overrides a private
    method: :func:`check_memtracker_override`, run at import, checks what it relies on.
    """

    def _update_peak_stats(self, peak_state) -> None:
        for device, snapshot in self._curr_mem_snap.items():
            if snapshot["Total"] > self._peak_mem.get(device, 0):
                self._peak_mem[device] = snapshot["Total"]
                self._peak_mem_snap[device] = dict(snapshot)


def check_memtracker_override(tracker_class: type = MemTracker) -> None:
    """Feature check of what :class:`_GlobalPeakMemTracker` relies on in PyTorch's
    private ``MemTracker``: ``_update_peak_stats(self, peak_state)``, the snapshot
    dicts it updates and the ``"Total"`` key. Raises ImportError naming the torch
    version where one is missing, rather than measuring wrong peaks."""
    method = getattr(tracker_class, "_update_peak_stats", None)
    try:
        parameters = list(inspect.signature(method).parameters) if callable(method) else None
    except (TypeError, ValueError):
        parameters = None
    problems = [] if parameters == ["self", "peak_state"] else [
        f"_update_peak_stats(self, peak_state) (found {parameters or 'none'})"]
    tracker = tracker_class() if not problems else None
    problems += [f"the dict attribute {name}" for name in ("_curr_mem_snap", "_peak_mem", "_peak_mem_snap")
                 if tracker is not None and not isinstance(getattr(tracker, name, None), dict)]
    if getattr(mem_tracker, "_TOTAL_KEY", None) != "Total":
        problems.append("the snapshot key 'Total' (_TOTAL_KEY)")
    if problems:
        raise ImportError(
            f"bench/harness needs, in torch {torch.__version__}'s private "
            f"torch.distributed._tools.mem_tracker.{tracker_class.__name__}: {'; '.join(problems)}. "
            "_GlobalPeakMemTracker (bench/harness/measure.py) overrides it to keep CPU peak tracking "
            "linear in depth; adapt the override to this torch version.")


check_memtracker_override()


@dataclass(frozen=True)
class StepMemory:
    peak: int  # bytes live at the peak of the step
    resident: int  # bytes live when the step began: parameters, buffers, gradients, batch
    kept: int  # bytes actsave kept at the end of forward


def measure_step_memory(
    model: nn.Module, batch: tuple, device: torch.device, tracker_class: type = _GlobalPeakMemTracker
) -> StepMemory:
    """Peak memory of one training step of ``model`` (its gradients already allocated)."""
    if device.type == "cuda":
        synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        resident = torch.cuda.memory_allocated(device)
        kept = training_step(model, batch)
        synchronize(device)
        return StepMemory(torch.cuda.max_memory_allocated(device), resident, kept)
    tracker = tracker_class()
    tracker.track_external(model, *batch)
    resident = tracker.get_tracker_snapshot("current")[device]["Total"]
    with tracker:
        kept = training_step(model, batch)
    return StepMemory(tracker.get_tracker_snapshot("peak")[device]["Total"], resident, kept)


def activation_peak(model: nn.Module, inputs: torch.Tensor) -> int:
    """The bytes live at the peak of one step of ``model`` on ``inputs`` as
    :func:`actsave.profile` steps it without a loss (forward, then backward from an
    output gradient of ones), less its parameters, their gradients (allocated first,
    as in training) and its buffers: what a plan's ``predicted_peak_bytes`` predicts,
    the batch included. CPU only (MemTracker)."""
    for p in model.parameters():
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    static = sum(t.numel() * t.element_size()
                 for t in (*model.parameters(), *model.buffers(), *(p.grad for p in model.parameters())))
    tracker = _GlobalPeakMemTracker()
    tracker.track_external(model, inputs)
    with tracker:
        out = model(inputs)
        out.backward(torch.ones_like(out))
    return tracker.get_tracker_snapshot("peak")[inputs.device]["Total"] - static


def allocator_peak(step) -> int:
    """How far the bytes held by the CPU allocator rose above their value at the start
    of ``step()`` at its peak, from the memory events of ``torch.profiler``.

    The process's own count, independent of actsave's: it sees every allocation,
    FSDP2's communication buffers and its in-place resizes (``storage.resize_``, how
    it frees and refills each unit's gathered parameters) included. MemTracker tracks
    a storage from the op that makes it until it dies, so it counts such a storage
    whole for as long as it lives. On plain tensors the allocator and LiveBytes agree
    (tests/bench/test_harness.py)."""
    return allocator_rise(step)[0]


def imports_frozen() -> None:
    """Exempt every object alive now from garbage collection, for good: a bench script
    calls it as it starts as a program, after its imports, before ``main``.

    NOTE [ A script's imports, frozen ]
    A full collection walks every object the collector tracks: once torch, actsave
    and transformers are imported, some hundreds of thousands that are never garbage
    (modules, functions, classes). Every memory measurement collects first
    (:func:`_collector_paused`), so a run of many short steps spent much of its time
    there (docs/results.md, "The host work and the test run at the twenty-first
    session's tree").
    ``gc.freeze()`` moves them to the permanent generation, which no collection walks;
    the models, tensors and cycles the script makes are collected as before. Not in
    ``main``: a test that calls ``main`` in its own process must not exempt the test
    session's objects. They are given back to the collector as the interpreter exits:
    nanobind (triton's bindings) reports as leaked any of its objects alive then."""
    gc.collect()
    gc.freeze()
    atexit.register(gc.unfreeze)


@contextlib.contextmanager
def _collector_paused():
    """Garbage collected before, and not during: an earlier step's reference cycles
    (FSDP2 makes some) freed inside the measured one would lower its rise by bytes it
    never held."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def allocator_rise(step) -> tuple:
    """``(peak, end)``: how far the bytes held by the CPU allocator rose above their
    value at the start of ``step()``, at their peak and when it returned (what it left
    allocated: what a forward keeps for its backward, and its output); read as
    :func:`allocator_peak` reads them, so a compiled graph's saves count as eager ones."""
    from torch.profiler import ProfilerActivity, profile

    with _collector_paused(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events = sorted((event.start_ns(), event.nbytes()) for event in prof.profiler.kineto_results.events()
                    if event.name() == "[memory]" and event.device_type() == torch.autograd.DeviceType.CPU)
    held = peak = 0
    for _, nbytes in events:
        held += nbytes
        peak = max(peak, held)
    return peak, held


# NOTE [ Frees on other threads ]
# The CPU allocator keeps its total of allocated bytes (and reports a free to the
# profiler) only while the freeing thread profiles, unless c10's flag
# caffe2_report_cpu_memory_usage is set. A collective library's worker thread (gloo's)
# drops the last reference to some of a collective's tensors, so without the flag
# those frees are never counted and a count of the memory events runs high by them
# (docs/results.md, "FSDP2"). With the flag set the allocator keeps its total over
# every thread; each allocation event of the profiled thread carries it.


def count_frees_on_every_thread() -> None:
    """Set NOTE [ Frees on other threads ]'s flag: call it before allocating the
    tensors that :func:`process_allocator_peak` should see freed."""
    path = Path(torch.__file__).parent / "lib" / "libc10.so"
    try:
        flag = ctypes.c_bool.in_dll(ctypes.CDLL(str(path)), "FLAGS_caffe2_report_cpu_memory_usage")
    except (OSError, ValueError) as error:
        raise RuntimeError(f"cannot set c10's caffe2_report_cpu_memory_usage in {path} ({error}): "
                           "this build of torch hides it; measure with allocator_peak") from error
    flag.value = True


def process_allocator_peak(step) -> int:
    """How far the CPU allocator's total over every thread rose above its value at
    the start of ``step()``, at its largest as this thread allocated (NOTE [ Frees on
    other threads ]; :func:`count_frees_on_every_thread` first). Equal to
    :func:`allocator_peak` where every free is made on this thread."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with _collector_paused(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    allocations, pending = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while pending:
        node = pending.pop()
        if node.tag == _EventType.Allocation and node.extra_fields.device.type == "cpu":
            allocations.append((node.start_time_ns, node.extra_fields.alloc_size, node.extra_fields.total_allocated))
        pending.extend(node.children)
    if not allocations:
        return 0
    allocations.sort()
    _, first_size, first_total = allocations[0]
    return max(0, max(total for _, _, total in allocations) - (first_total - first_size))


def _release_memory(device: torch.device) -> None:
    """Free what the last run left, so that the next one's CUDA peak starts clean.
    Not needed on CPU, where the tracker counts only the tensors of the step it
    watches (and a full collection costs 0.2 s)."""
    if device.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()


def worst_grad_sqnr(reference: list, grads: list) -> float:
    """Lowest :func:`actsave.codecs.sqnr_db` over parameter gradients; ``inf`` when
    every gradient is exact, NaN when one is NaN."""
    values = [sqnr_db(ref, x) for ref, x in zip(reference, grads)]
    return math.nan if any(math.isnan(v) for v in values) else min(values, default=math.inf)


def interleaved_times(models: dict, batch: tuple, repeats: int, device) -> dict:
    """``{name: [ms, ...]}``: ``repeats`` rounds, each timing one step of every model
    in turn (ABAB...), so that the noise of a shared machine falls on all alike."""
    times = {name: [] for name in models}
    for _ in range(repeats):
        for name, model in models.items():
            times[name] += time_steps(model, batch, 1, device)
    return times


def _unless_out_of_memory(function, *args):
    """``function(*args)``, or None when the device runs out of memory."""
    try:
        return function(*args)
    except torch.cuda.OutOfMemoryError:
        return None
