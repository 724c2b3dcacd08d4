"""Global state a recompute must see exactly as the forward saw it.

- RNG: the CPU generator and those of every accelerator the inputs live on are
  captured before the forward and replayed in the recompute (same Dropout masks),
  inside ``fork_rng`` so the caller's generators do not move. With
  ``preserve_rng_state=False`` (recompute_options.py) neither happens, as in torch.
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

from .._torch import leaf_base, own_tensors, version
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
            default_device=torch.get_default_device(),
        )

    @contextlib.contextmanager
    def replayed(self):
        """Run the body with the captured RNG, autocast state and default device; the
        caller's RNG state is restored afterwards. Without a captured RNG state
        (``preserve_rng_state=False``) the body draws from the caller's generators and
        advances them, as torch's checkpoint does."""
        replays_rng = self.cpu_rng is not None
        with torch.random.fork_rng(devices=list(self.devices), device_type=self.device_type, enabled=replays_rng):
            if replays_rng:
                torch.set_rng_state(self.cpu_rng)
            if self.devices and replays_rng:
                module = torch.get_device_module(self.device_type)
                for index, state in zip(self.devices, self.device_rngs):
                    module.set_rng_state(state, index)
            with contextlib.ExitStack() as stack:
                if torch.get_default_device() != self.default_device:
                    stack.enter_context(self.default_device)
                for autocast in self.autocast:
                    stack.enter_context(autocast.context())
                yield


class TouchedState:
    """The parameters and buffers one checkpointed forward touched.

    NOTE [ State a forward reads and mutates ]
    While the forward runs, global module hooks (of this thread only) note each
    parameter and buffer of every module that runs, and which of them the module
    changed in place; the segment's saved leaves (parameters used outside any module,
    ``weight.t()``) are noted by the pack hook. Then:

    - Mutated buffers (versions moved during their module's forward) are mutated once:
      the recompute runs each call of those modules on scratch copies, put back to
      the originals as the call returns, so no copy outlives its call but what autograd
      saves of it (BatchNorm saves its running statistics).
      One rule for every module, BatchNorm included, with no list of module types.
      Turning ``track_running_stats`` off instead would change which tensors autograd
      saves, and the recompute must save what the forward saved.
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
        self._read = {}  # id -> (weakref, label for _describe); versions taken at end_forward
        self._versions = {}
        self._mutated = {}  # (module, kind, name) -> None: state changed by its module
        self._calls = []  # (module, {(kind, name): version}) of module calls running

    @contextlib.contextmanager
    def recording(self):
        """Note what the modules run in the body read and mutate."""
        pre = register_module_forward_pre_hook(self._before_module)
        post = register_module_forward_hook(self._after_module)
        try:
            yield
        finally:
            pre.remove()
            post.remove()

    def note_saved(self, tensor: torch.Tensor) -> None:
        """Note a leaf (or a view of one) that the forward saved for backward."""
        if torch.compiler.is_compiling():  # traced with fake tensors; real saves follow
            return
        base = leaf_base(tensor)
        if base is not None:
            self._note(base, ("a tensor of shape", list(base.shape)))

    def end_forward(self) -> None:
        """Take the versions the recompute must find."""
        mutated = {id(own_tensors(module, kind)[name]) for module, kind, name in self._mutated
                   if own_tensors(module, kind).get(name) is not None}
        self._versions = {key: version(ref()) for key, (ref, _) in self._read.items()
                          if ref() is not None and key not in mutated}
        self._calls = []

    def check_unchanged(self, function_name: str) -> None:
        """Raise, as autograd would, if a tensor the forward read changed in place."""
        for key, expected in self._versions.items():
            ref, label = self._read[key]
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
    def mutated_once(self):
        """While active, each call (in this thread) of a module whose state the forward
        mutated runs on scratch copies of that state, made as the call starts; the
        originals are put back as it returns. A recompute so holds no copy beyond the
        call that made it, except what autograd saves (BatchNorm's running statistics,
        which the profile counts among the layer's saves), wherever a nested pass
        starts or stops (memory_model.py counts no other copy)."""
        mutated = {}  # module -> [(kind, name)]
        for module, kind, name in self._mutated:
            mutated.setdefault(module, []).append((kind, name))
        if not mutated:
            yield
            return
        swapped, thread = [], threading.get_ident()  # a stack: (module, kind, name, original)

        def use_scratch_copies(module, args):
            if threading.get_ident() == thread and module in mutated:
                for kind, name in mutated[module]:
                    original = own_tensors(module, kind).get(name)
                    if original is not None:
                        swapped.append((module, kind, name, original))
                        own_tensors(module, kind)[name] = original.clone()

        def put_originals_back(module, args, output):
            if threading.get_ident() == thread:
                while swapped and swapped[-1][0] is module:
                    _, kind, name, original = swapped.pop()
                    own_tensors(module, kind)[name] = original

        pre = register_module_forward_pre_hook(use_scratch_copies)
        post = register_module_forward_hook(put_originals_back, always_call=True)
        try:
            yield
        finally:
            pre.remove()
            post.remove()
            while swapped:  # a call that raised before its module's hook
                module, kind, name, original = swapped.pop()
                own_tensors(module, kind)[name] = original

    def _note(self, tensor: torch.Tensor, label: tuple) -> None:
        # The label is formatted only for an error: this runs for every parameter and
        # buffer of every module call in a checkpointed forward.
        noted = self._read.get(id(tensor))
        if noted is None or noted[0]() is not tensor:  # ids of dead tensors are reused
            self._read[id(tensor)] = (weakref.ref(tensor), label)

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
            # All of the module's buffers, not the moved ones only: BatchNorm's kernel
            # updates its running statistics without moving their versions (only
            # num_batches_tracked moves). Buffers only: a scratch copy of a parameter
            # would take its gradient.
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


