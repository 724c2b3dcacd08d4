"""Global state a recompute must see exactly as the forward saw it.

- RNG: the CPU generator and those of every accelerator the inputs live on are
  captured before the forward and replayed in the recompute (same Dropout masks),
  inside ``fork_rng`` so the caller's generators do not move. With
  ``preserve_rng_state=False`` (recompute_options.py) neither happens, as in torch;
  nor for inputs on the meta device, where nothing draws. The generators are the
  process's: see :meth:`ReplayState.replayed` for what another thread sees.
- Autocast: whether it was on, its dtype and cache setting, for the CPU and for the
  inputs' device types. Backward may run outside the ``autocast`` block; the
  recompute re-enters the forward's state.
- The default device (``with torch.device(...)`` or ``torch.set_default_device``):
  factory calls without ``device=`` (``torch.arange(n)``) must make their tensors
  where the forward made them, though backward runs outside that block.
- Module state: what the forward mutated in place (BatchNorm's running statistics,
  InstanceNorm's, spectral norm's power-iteration vectors, a user's EMA buffer) is
  mutated once, not again by the recompute (torch.utils.checkpoint updates it twice);
  the parameters and buffers the forward read must not change before the recompute.
  See :class:`TouchedState`.
"""
from __future__ import annotations

import contextlib
import threading
import weakref
from dataclasses import dataclass
from typing import Optional

import torch
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

from .._torch import copies_of, default_device, leaf_base, own_tensors, version
from ..errors import RecomputeError


@dataclass(frozen=True)
class _AutocastState:
    device_type: str
    enabled: bool
    dtype: torch.dtype
    cache_enabled: bool

    @classmethod
    def capture(cls, device_type: str) -> "_AutocastState":
        return cls(
            device_type,
            torch.is_autocast_enabled(device_type),
            torch.get_autocast_dtype(device_type),
            torch.is_autocast_cache_enabled(),
        )

    def context(self):
        return torch.autocast(
            self.device_type, dtype=self.dtype, enabled=self.enabled, cache_enabled=self.cache_enabled
        )

    def is_current(self) -> bool:
        """Whether autocast is in this state now (then there is nothing to enter)."""
        return self == _AutocastState.capture(self.device_type)


@dataclass(frozen=True)
class ReplayState:
    """RNG and autocast state at the start of a checkpointed forward."""

    cpu_rng: Optional[torch.Tensor]  # None: preserve_rng_state=False, no RNG replay
    device_type: str  # the inputs' accelerator type, or "cpu" when there is none
    devices: tuple  # indices of the accelerators the inputs live on
    device_rngs: tuple
    autocast: tuple
    default_device: torch.device

    @classmethod
    def capture(cls, tensors, preserve_rng_state: bool = True) -> "ReplayState":
        """The state now, for a forward whose inputs are ``tensors``. Inputs all on the
        meta device (a planner's meta step) replay no RNG state: random operators on
        meta tensors draw nothing, and replaying one would set the process's generator,
        which other threads draw from (NOTE [ Steps other threads do not see ] in
        planning/instrumented_step.py)."""
        if tensors and tensors[0].is_meta and all(t.is_meta for t in tensors):  # cheap for real ones
            preserve_rng_state = False
        accelerators = sorted({(t.device.type, t.device.index or 0) for t in tensors
                               if t.device.type not in ("cpu", "meta")})
        device_type = accelerators[0][0] if accelerators else "cpu"
        devices = tuple(index for kind, index in accelerators if kind == device_type)
        module = torch.get_device_module(device_type) if devices else None
        autocast_types = ("cpu",) if device_type == "cpu" else ("cpu", device_type)
        return cls(
            cpu_rng=torch.get_rng_state() if preserve_rng_state else None,
            device_type=device_type,
            devices=devices,
            device_rngs=tuple(module.get_rng_state(i) for i in devices) if module and preserve_rng_state else (),
            autocast=tuple(_AutocastState.capture(kind) for kind in autocast_types),
            default_device=default_device(),
        )

    @contextlib.contextmanager
    def replayed(self):
        """Run the body with the captured RNG, autocast state and default device; the
        caller's RNG state is restored afterwards. Without a captured RNG state
        (``preserve_rng_state=False``, meta inputs) the body draws from the caller's
        generators and advances them, as torch's checkpoint does.

        The generators are the process's, shared by its threads (PyTorch has no
        per-thread default generator): while the body runs they hold the forward's
        state, and restoring the caller's afterwards drops whatever another thread drew
        meanwhile, as torch.utils.checkpoint does (docs/limits.md, "Threads")."""
        replays_rng = self.cpu_rng is not None
        with torch.random.fork_rng(devices=list(self.devices), device_type=self.device_type, enabled=replays_rng):
            if replays_rng:
                torch.set_rng_state(self.cpu_rng)
            if self.devices and replays_rng:
                module = torch.get_device_module(self.device_type)
                for index, state in zip(self.devices, self.device_rngs):
                    module.set_rng_state(state, index)
            with contextlib.ExitStack() as stack:
                if default_device() != self.default_device:
                    stack.enter_context(self.default_device)
                for autocast in self.autocast:
                    if not autocast.is_current():
                        stack.enter_context(autocast.context())
                yield


class TouchedState:
    """The parameters and buffers one checkpointed forward touched.

    NOTE [ State a forward reads and mutates ]
    While the forward runs, actsave notes each parameter and buffer of the modules it
    runs, and which of them the forward changed in place; the segment's saved leaves
    (parameters used outside any module, ``weight.t()``) are noted by the pack hook.
    Where the function's layers are known (layers.py, NOTE [ Known layers ]) the
    modules under them are read before and after the forward, with no hook; for any
    other function, global module hooks (of this thread only) watch every module call
    (:class:`_HookedState`). Then:

    - Mutated buffers (versions moved during the forward) are mutated once: the
      recompute runs on scratch copies of them, made by one foreach copy per dtype,
      not a clone per buffer per module call, and puts the originals back after.
      The copies live while their layer runs: each layer of a LayerChain (function.py,
      ``_Frame._run_chain``) or part of a nested pass (nested.py) that owns mutated
      state runs on copies made as it starts; any other function, for its whole pass.
      So no copy outlives its layer but what autograd saves of it (BatchNorm saves its
      running statistics, which the profile counts among the layer's saves), as the
      memory model counts. One rule for every module, BatchNorm included, with no list
      of module types. Turning ``track_running_stats`` off instead would change which
      tensors autograd saves, and the recompute must save what the forward saved.
    - A module whose tensors moved has all of its buffers mutated, not the moved ones
      only: BatchNorm's kernel updates its running statistics without moving their
      versions (only ``num_batches_tracked`` moves). Buffers only: a scratch copy of a
      parameter would take its gradient.
    - Everything else noted must be unchanged when the recompute starts: a weight
      changed in place between forward and backward (a GAN's optimizer step before
      the other network's backward, an EMA of weights) would be recomputed with its
      new values and give silently wrong gradients, where plain autograd raises. So
      does actsave, with autograd's words. Mutated state is not checked: a second
      forward before this backward (two views of a batch) legitimately moves
      BatchNorm's statistics again.

    Tensors are held by weak reference: noting them keeps nothing alive.
    """

    def __init__(self):
        self._thread = threading.get_ident()
        self._read = {}  # id -> (weakref, label for _describe): saved leaves (and watched state)
        self._checked = []  # (weakref, version, label) taken at end_forward

    @staticmethod
    def of(layers: Optional[tuple], modules: Optional[list]) -> "TouchedState":
        """The noting that fits a function whose known ``layers`` and the ``modules``
        under them (layers.modules_under) are given, or None (NOTE [ Known layers ])."""
        return _HookedState() if layers is None else _LayerState(layers, modules)

    def recording(self):
        """Note what the modules run in the body read and mutate."""
        raise NotImplementedError

    def note_saved(self, tensor: torch.Tensor) -> None:
        """Note a leaf (or a view of one) that the forward saved for backward."""
        base = leaf_base(tensor)
        if base is not None and not torch.compiler.is_compiling():  # traced with fake tensors: real saves follow
            self._note(base, ("a tensor of shape", list(base.shape)))

    def end_forward(self) -> None:
        """Take the versions the recompute must find."""
        raise NotImplementedError

    def check_unchanged(self, function_name: str) -> None:
        """Raise, as autograd would, if a tensor the forward read changed in place."""
        for ref, expected, label in self._checked:
            tensor = ref()
            if tensor is not None and version(tensor) != expected:
                raise RecomputeError(
                    "one of the variables needed for gradient computation has been "
                    f"modified by an inplace operation: {_describe(label)} is at version "
                    f"{version(tensor)}; expected version {expected} instead. The "
                    f"checkpointed {function_name} read it in its forward and its "
                    "recompute would read the new values, so its gradients would be "
                    "wrong. Change it after the backward (an optimizer step, an EMA of "
                    "weights), or change a copy."
                )

    @contextlib.contextmanager
    def mutated_once(self, layers: Optional[range] = None):
        """While active, the buffers the forward mutated (of the known layers whose
        indices are in ``layers``; all of them by default) are scratch copies, made by one
        foreach copy per dtype as it starts, the originals put back as it ends. A
        recompute pass runs under it: the module state it mutates is the copies'."""
        present = []
        for module, name in self._mutated_buffers(layers):
            table = own_tensors(module, "buffers")
            if table.get(name) is not None:
                present.append((table, name, table[name]))
        for (table, name, _), copy in zip(present, copies_of([original for *_, original in present])):
            table[name] = copy
        try:
            yield
        finally:
            for table, name, original in present:
                table[name] = original

    def mutated_layers(self) -> set:
        """The indices of the known layers that own state the forward mutated (none
        where the layers are not known)."""
        return set()

    def _mutated_buffers(self, layers: Optional[range]) -> list:
        """``[(module, buffer name)]``, each once, that the forward mutated (so far,
        while it runs: a backward inside the forward recomputes too)."""
        raise NotImplementedError

    def _note(self, tensor: torch.Tensor, label: tuple) -> None:
        # The label is formatted only for an error: this runs for every saved leaf.
        noted = self._read.get(id(tensor))
        if noted is None or noted[0]() is not tensor:  # ids of dead tensors are reused
            self._read[id(tensor)] = (weakref.ref(tensor), label)

    def _take_versions(self, mutated_ids: set, extra: list = ()) -> None:
        """What check_unchanged compares: the versions now of every noted tensor
        (``self._read`` and ``extra``, (weakref, label) pairs) not in ``mutated_ids``."""
        checked = []
        for ref, label in (*self._read.values(), *extra):
            tensor = ref()
            if tensor is not None and id(tensor) not in mutated_ids:
                checked.append((ref, version(tensor), label))
        self._checked = checked
        self._read = {}


class _LayerState(TouchedState):
    """The state under known layers, read before and after the forward (NOTE [ State a
    forward reads and mutates ], NOTE [ Known layers ])."""

    def __init__(self, layers: tuple, modules: list):
        super().__init__()
        self._layers = layers
        self._modules = modules
        self._before = []  # (layer index, module, kind, name, tensor, version) as the forward starts
        self._state_ids = set()
        self._mutated = {}  # layer index -> [(module, name)]: buffers the forward mutated

    @contextlib.contextmanager
    def recording(self):
        before = []
        for index, module in self._modules:
            for kind, name, tensor in _own_state(module):
                before.append((index, module, kind, name, tensor, version(tensor)))
        self._before = before
        self._state_ids = {id(entry[4]) for entry in before}
        yield

    def note_saved(self, tensor: torch.Tensor) -> None:
        base = leaf_base(tensor)
        if base is not None and id(base) not in self._state_ids and not torch.compiler.is_compiling():
            self._note(base, ("a tensor of shape", list(base.shape)))

    def end_forward(self) -> None:
        mutated = self._mutated_by_layer(self._moved())
        mutated_ids = {id(own_tensors(module, "buffers")[name]) for buffers in mutated.values()
                       for module, name in buffers}
        state = [(weakref.ref(tensor), (kind[:-1], name, type(module)))
                 for _, module, kind, name, tensor, _ in self._before
                 if own_tensors(module, kind).get(name) is tensor]
        self._take_versions(mutated_ids, state)
        self._mutated = mutated
        self._before, self._state_ids = [], set()

    def _moved(self) -> dict:
        """``{module: its layer index}`` of the modules whose state moved since the
        forward started: a tensor changed in place, or replaced."""
        moved = {}
        for index, module, kind, name, tensor, was in self._before:
            now = own_tensors(module, kind).get(name)
            if now is not tensor or (now is not None and version(now) != was):
                moved[module] = index
        return moved

    @staticmethod
    def _mutated_by_layer(moved: dict) -> dict:
        """``{layer index: [(module, buffer name)]}``: every buffer of a moved module
        (NOTE [ State a forward reads and mutates ])."""
        mutated = {}
        for module, index in moved.items():
            for name, buffer in own_tensors(module, "buffers").items():
                if buffer is not None:
                    mutated.setdefault(index, []).append((module, name))
        return mutated

    def mutated_layers(self) -> set:
        return set(self._mutated_now())

    def _mutated_buffers(self, layers: Optional[range]) -> list:
        return [buffer for index, buffers in self._mutated_now().items() if layers is None or index in layers
                for buffer in buffers]

    def _mutated_now(self) -> dict:
        return self._mutated if not self._before else self._mutated_by_layer(self._moved())


class _HookedState(TouchedState):
    """The state a function of unknown layers touches, watched by global module hooks
    on this thread while its forward runs (NOTE [ Known layers ])."""

    def __init__(self):
        super().__init__()
        self._mutated = {}  # (module, kind, name) -> None: state changed by its module
        self._calls = []  # (module, {(kind, name): version}) of module calls running

    @contextlib.contextmanager
    def recording(self):
        pre = register_module_forward_pre_hook(self._before_module)
        post = register_module_forward_hook(self._after_module)
        try:
            yield
        finally:
            pre.remove()
            post.remove()

    def end_forward(self) -> None:
        mutated = {id(own_tensors(module, kind)[name]) for module, kind, name in self._mutated
                   if own_tensors(module, kind).get(name) is not None}
        self._take_versions(mutated)
        self._calls = []

    def _mutated_buffers(self, layers: Optional[range]) -> list:
        return [(module, name) for module, _, name in self._mutated]

    def _before_module(self, module, args) -> None:
        if threading.get_ident() != self._thread:
            return
        versions = {}
        for kind, name, tensor in _own_state(module):
            versions[(kind, name)] = version(tensor)
            self._note(tensor, (kind[:-1], name, type(module)))
        self._calls.append((module, versions))

    def _after_module(self, module, args, output) -> None:
        if threading.get_ident() != self._thread:
            return
        while self._calls:  # a module that raised left its entry behind
            called, versions = self._calls.pop()
            if called is module:
                break
        else:
            return
        moved = any(versions.get((kind, name), version(tensor)) != version(tensor)
                    for kind, name, tensor in _own_state(module))
        if moved:
            # All of the module's buffers: NOTE [ State a forward reads and mutates ].
            for name in own_tensors(module, "buffers"):
                self._mutated[(module, "buffers", name)] = None


_KINDS = ("parameters", "buffers")


def _describe(label: tuple) -> str:
    """``("a tensor of shape", shape)`` or ``(kind, name, module type)`` as text."""
    if len(label) == 2:
        return f"{label[0]} {label[1]}"
    kind, name, module_type = label
    return f"{kind} '{name}' of {module_type.__name__}"


def _own_state(module: torch.nn.Module):
    for kind in _KINDS:
        for name, tensor in own_tensors(module, kind).items():
            if tensor is not None:
                yield kind, name, tensor


