"""Deterministic counts of a training step's host work: aten operators, Triton kernel
launches and host-device synchronizations (bench/host_overhead.py, tests/bench).

Times of host work are noisy; these counts are not, so tests hold them as budgets.
They are taken in a step of their own: the counters themselves cost host time.

- Aten operators: a ``TorchDispatchMode`` sees every operator that reaches the Python
  dispatcher, forward, loss and backward (the recompute of a checkpoint included).
  Autograd runs a CUDA backward on its own device threads; the mode reaches them
  through autograd's thread-local state, and :class:`StepCounts` records the threads
  it saw ops on, so a run can check. Ops inside a Triton launch are not counted: under
  Triton's interpreter (CPU) the launch copies its arguments with aten ops that a GPU
  launch does not run.
- Triton launches: every ``kernel[grid](...)`` reaches ``JITFunction.run`` (GPU), and
  every interpreted launch is one call of the interpreter's ``GridExecutor`` (CPU);
  both are wrapped at the class, so every kernel is counted whatever path launched it
  (actsave's launchers, a single launch choke point, or anything else). On CUDA,
  Triton's launch-enter hook counts the launches that reached the driver, which also
  catches a launcher that calls a compiled kernel directly, past ``run``: where the
  two disagree the hook's count is the one reported.
- Syncs: operators whose result the host must wait for on CUDA (a value read back:
  ``.item()``, ``nonzero``, a boolean mask index...; a blocking copy between host and
  device), counted the same way on every device, so a CPU run counts the syncs a GPU
  run of the same code would make; plus explicit ``synchronize()`` calls on CUDA. On
  CUDA, ``torch.cuda.set_sync_debug_mode`` counts what the CUDA runtime itself flags,
  reported apart (``cuda_sync_warnings``).
"""
from __future__ import annotations

import contextlib
import threading
import warnings
from collections import Counter
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# Operators whose output size or value the host must read from the device: on CUDA
# each waits for the stream to drain. By overload packet name.
_READ_BACK = frozenset({
    "_local_scalar_dense",  # .item(), bool(t), int(t), float(t)
    "nonzero", "argwhere", "masked_select", "equal", "is_nonzero",
    "unique", "_unique", "_unique2", "unique_dim", "unique_consecutive", "unique_dim_consecutive",
    "bincount", "histc",
})
# Indexing by a boolean (or uint8) mask: the number of selected elements is read back.
_MASK_INDEXING = frozenset({"index", "index_put", "index_put_", "_index_put_impl_"})
# Copies: one between host and device syncs unless non_blocking (syncs_of).
_COPIES = frozenset({"copy_", "_to_copy", "_copy_from"})

_inside_launch = threading.local()  # depth of Triton launches on this thread


def _launch_depth() -> int:
    return getattr(_inside_launch, "depth", 0)


def _is_mask(value) -> bool:
    return isinstance(value, torch.Tensor) and value.dtype in (torch.bool, torch.uint8)


def _crosses_host_and_device(source: torch.Tensor, destination: torch.device) -> bool:
    kinds = {source.device.type, destination.type}
    return "cpu" in kinds and kinds != {"cpu"} and "meta" not in kinds


def syncs_of(func, args: tuple, kwargs: dict) -> bool:
    """Whether the operator call would make the host wait for a CUDA device."""
    packet = getattr(func, "overloadpacket", None)
    name = getattr(packet, "__name__", str(func))
    if name in _READ_BACK:
        return True
    if name in _MASK_INDEXING:
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        return any(_is_mask(index) for index in (indices or ()))
    if name == "repeat_interleave":  # a tensor of repeats without output_size: the total is read back
        repeats = args[0] if args else kwargs.get("repeats")
        return isinstance(repeats, torch.Tensor) and repeats.dim() > 0 and kwargs.get("output_size") is None
    if name in _COPIES:
        # A copy between host and device that is not non_blocking waits for it (torch's
        # CUDA copy synchronizes its stream); a non-blocking one is ordered by events.
        if kwargs.get("non_blocking", args[2] if name == "copy_" and len(args) > 2 else False):
            return False
        if name == "copy_":
            return _crosses_host_and_device(args[1], args[0].device)
        if name == "_copy_from":
            return _crosses_host_and_device(args[0], args[1].device)
        device = kwargs.get("device")
        return device is not None and _crosses_host_and_device(args[0], torch.device(device))
    return False


class AtenOps(TorchDispatchMode):
    """Counts operators by phase (``phase`` is set by the caller: forward, backward),
    those that would sync a CUDA device, and the threads they ran on."""

    def __init__(self):
        super().__init__()
        self.phase = "forward"
        self.ops = Counter()  # phase -> operators
        self.syncs = Counter()  # operator name -> calls that would sync
        self.by_phase = Counter()  # (phase, operator name) -> calls
        self.threads = set()
        self._lock = threading.Lock()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _launch_depth() == 0:
            syncs = syncs_of(func, args, kwargs)
            with self._lock:
                self.ops[self.phase] += 1
                self.by_phase[self.phase, str(func)] += 1
                self.threads.add(threading.get_ident())
                if syncs:
                    self.syncs[str(func)] += 1
        return func(*args, **kwargs)


def _launches(kernel, kwargs: dict) -> bool:
    """Whether a ``run(..., grid=, warmup=)`` call launches (a warm-up only compiles)."""
    return not kwargs.get("warmup", False)


def _kernel_name(kernel) -> str:
    fn = getattr(kernel, "fn", None)
    return getattr(fn, "__name__", None) or getattr(kernel, "__name__", None) or repr(kernel)


class TritonLaunches:
    """Counts Triton launches by kernel name while active (module docstring).
    ``by_kernel``: launches through ``JITFunction.run`` or the interpreter; ``hooked``: launches the enter hook
    saw (CUDA only; None where this Triton has no launch hook or ran no compiled
    kernel). Works without Triton (nothing launches then)."""

    def __init__(self):
        self.by_kernel = Counter()
        self.hooked = None
        self._undo = []

    @property
    def total(self) -> int:
        hooked = sum(self.hooked.values()) if self.hooked is not None else None
        return hooked if hooked else sum(self.by_kernel.values())

    def __enter__(self):
        try:
            from triton.runtime import jit
        except ImportError:
            return self
        if "run" in vars(jit.JITFunction):
            self._wrap(jit.JITFunction, "run", _launches)
        try:
            from triton.runtime import interpreter
        except ImportError:
            interpreter = None
        # The interpreter's launch is one GridExecutor call, however the kernel was
        # reached (a bound ``run`` cached before this patch included); older Triton
        # without it: InterpretedFunction.run.
        if interpreter is not None and "__call__" in vars(getattr(interpreter, "GridExecutor", object)):
            self._wrap(interpreter.GridExecutor, "__call__", lambda executor, kwargs: True)
        elif interpreter is not None and "run" in vars(getattr(interpreter, "InterpretedFunction", object)):
            self._wrap(interpreter.InterpretedFunction, "run", _launches)
        self._add_launch_hook()
        return self

    def __exit__(self, *exc):
        while self._undo:
            self._undo.pop()()

    def _wrap(self, cls, method: str, launches) -> None:
        """Count each call of ``cls.method`` that ``launches(self, kwargs)``, by kernel
        name; the aten ops it runs are the launch's own (not counted by AtenOps)."""
        original = vars(cls)[method]
        counts = self.by_kernel

        def counted(kernel, *args, **kwargs):
            if launches(kernel, kwargs):
                counts[_kernel_name(kernel)] += 1
            _inside_launch.depth = _launch_depth() + 1
            try:
                return original(kernel, *args, **kwargs)
            finally:
                _inside_launch.depth -= 1

        setattr(cls, method, counted)
        self._undo.append(lambda: setattr(cls, method, original))

    def _add_launch_hook(self) -> None:
        """Triton's launch-enter hook: a chain with ``add`` (newer Triton) or a single
        callable, None when unset (older)."""
        try:
            from triton import knobs
        except ImportError:
            return
        runtime = getattr(knobs, "runtime", None)
        if runtime is None or not hasattr(runtime, "launch_enter_hook"):
            return
        self.hooked = Counter()
        hooked = self.hooked

        def hook(metadata, *rest):
            data = getattr(metadata, "data", None) or {}
            hooked[data.get("name", "?")] += 1

        current = runtime.launch_enter_hook
        if hasattr(current, "add") and hasattr(current, "remove"):
            current.add(hook)
            self._undo.append(lambda: current.remove(hook))
        elif current is None:
            runtime.launch_enter_hook = hook
            self._undo.append(lambda: setattr(runtime, "launch_enter_hook", None))
        else:
            def chained(*args):
                current(*args)
                hook(*args)
            runtime.launch_enter_hook = chained
            self._undo.append(lambda: setattr(runtime, "launch_enter_hook", current))


class _SyncCalls:
    """Explicit ``synchronize()`` calls on CUDA streams, events and devices."""

    def __init__(self):
        self.calls = Counter()
        self._undo = []

    def __enter__(self):
        if not torch.cuda.is_available():
            return self
        for owner, name in ((torch.cuda, "synchronize"), (torch.cuda.Event, "synchronize"),
                            (torch.cuda.Stream, "synchronize")):
            original = getattr(owner, name)
            label = f"{getattr(owner, '__name__', owner)}.{name}"

            def counted(*args, _original=original, _label=label, **kwargs):
                self.calls[_label] += 1
                return _original(*args, **kwargs)

            setattr(owner, name, counted)
            self._undo.append(lambda owner=owner, name=name, original=original: setattr(owner, name, original))
        return self

    def __exit__(self, *exc):
        while self._undo:
            self._undo.pop()()


@dataclass
class StepCounts:
    """One step's counts. ``aten_ops`` = forward + backward (the loss counts with the
    forward, a recompute with the backward)."""

    aten_ops_forward: int
    aten_ops_backward: int
    triton_launches: int
    syncs: int
    threads: int  # threads the dispatch mode saw operators on
    launches_by_kernel: dict = field(default_factory=dict)
    syncs_by_op: dict = field(default_factory=dict)
    cuda_sync_warnings: int = 0  # CUDA only: torch.cuda.set_sync_debug_mode's warnings
    launch_paths_agree: bool = True  # CUDA: the run wrapper and the launch hook counted alike

    @property
    def aten_ops(self) -> int:
        return self.aten_ops_forward + self.aten_ops_backward


@contextlib.contextmanager
def _cuda_sync_warnings(device: torch.device):
    """Yields a list that holds, after the block, the warnings torch's CUDA sync debug
    mode raised in it (warnings from autograd's device threads are re-raised on the
    calling thread when backward returns)."""
    if device.type != "cuda":
        yield []
        return
    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield caught
        finally:
            torch.cuda.set_sync_debug_mode(previous)


def count_step(forward, backward, device: torch.device) -> StepCounts:
    """Counts of one step: ``loss = forward()``, then ``backward(loss)``."""
    ops = AtenOps()
    with TritonLaunches() as launches, _SyncCalls() as sync_calls, _cuda_sync_warnings(device) as flagged:
        with ops:
            loss = forward()
            ops.phase = "backward"
            backward(loss)
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # ours, after the counters: not the step's
    hooked = sum(launches.hooked.values()) if launches.hooked is not None else 0
    ran = sum(launches.by_kernel.values())
    sync_flags = [w for w in flagged if "synchroniz" in str(w.message).lower()]
    return StepCounts(
        aten_ops_forward=ops.ops["forward"],
        aten_ops_backward=ops.ops["backward"],
        triton_launches=launches.total,
        syncs=sum(ops.syncs.values()) + sum(sync_calls.calls.values()),
        threads=len(ops.threads),
        launches_by_kernel=dict(launches.hooked if hooked else launches.by_kernel),
        syncs_by_op={**ops.syncs, **sync_calls.calls},
        cuda_sync_warnings=len(sync_flags),
        launch_paths_agree=not hooked or hooked == ran,
    )
