"""What a recompute replays of the process's state as the forward found it: the RNG,
autocast and the default device (:class:`ReplayState`), and the generators' states
around one call a selective recompute skips (:class:`RandomState`).

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
- The settings that choose the kernels (the default dtype, oneDNN and cuDNN switches,
  deterministic algorithms, the attention backends ``sdpa_kernel`` enables): NOTE [
  Settings a recompute replays ].
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Optional

import torch

from .._torch import default_device


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


def autocast_now(device_type: str) -> tuple:
    """The autocast state of the CPU and of ``device_type``, as a checkpointed forward
    on that device captures it (:meth:`ReplayState.capture`)."""
    return tuple(_AutocastState.capture(kind) for kind in (("cpu",) if device_type == "cpu" else ("cpu", device_type)))


def autocast_as(states: tuple) -> contextlib.ExitStack:
    """Inside, autocast is as ``states`` (from :func:`autocast_now`) say."""
    stack = contextlib.ExitStack()
    for state in states:
        stack.enter_context(state.context())
    return stack


def _attribute(owner, name: str) -> tuple:
    """``(get, set)`` of a setting held as ``owner.name`` (torch.backends' flags)."""
    return (lambda: getattr(owner, name)), (lambda value: setattr(owner, name, value))


def _deterministic_algorithms() -> tuple:
    return torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()


def _set_deterministic_algorithms(value: tuple) -> None:
    torch.use_deterministic_algorithms(value[0], warn_only=value[1])


def _functions(owner, get: str, set_: str) -> Optional[tuple]:
    """``(get, set)`` of ``owner``'s functions of those names, or None where this torch
    lacks one."""
    pair = getattr(owner, get, None), getattr(owner, set_, None)
    return None if None in pair else pair


# NOTE [ Settings a recompute replays ]
# The process-wide settings that choose what a forward's kernels compute, as ``(get,
# set)`` pairs, all public: the default dtype (a factory without dtype=), the CPU's oneDNN
# and cuDNN switches and cuDNN's algorithm choice, deterministic algorithms, and which
# attention kernels ``scaled_dot_product_attention`` may take (``sdpa_kernel``, on the CPU
# too) and whether its math kernel reduces in half precision. A recompute outside the
# block the forward ran in would take another kernel: other saves (a RecomputeError that
# blames the function) or other bits where the shapes match (docs/limits.md, "The
# recompute check"). Read at every checkpointed call; set in a recompute only where they
# differ. Not replayed: TF32 and float32 matmul
# precision (torch refuses reads that mix its legacy and new precision APIs), the
# attention kernels' priority order (private), flush-to-zero (``set_flush_denormal``
# has no getter) and a user's function or dispatch modes (docs/limits.md).
_SETTINGS = tuple(pair for pair in (
    (torch.get_default_dtype, torch.set_default_dtype),
    _attribute(torch.backends.mkldnn, "enabled"),
    *(_attribute(torch.backends.cudnn, name) for name in ("enabled", "benchmark", "deterministic")),
    (_deterministic_algorithms, _set_deterministic_algorithms),
    *(_functions(torch.backends.cuda, f"{name}_sdp_enabled", f"enable_{name}_sdp")
      for name in ("flash", "mem_efficient", "math", "cudnn")),
    _functions(torch.backends.cuda, "fp16_bf16_reduction_math_sdp_allowed", "allow_fp16_bf16_reduction_math_sdp"),
) if pair is not None)


def _settings() -> tuple:
    """Each of _SETTINGS's values now."""
    return tuple(get() for get, _ in _SETTINGS)


@contextlib.contextmanager
def _settings_set(values: tuple):
    """_SETTINGS at ``values`` while the body runs, those that differ set back after."""
    found = _settings()
    changed = [(set_, value, was) for (_, set_), value, was in zip(_SETTINGS, values, found) if value != was]
    for set_, value, _ in changed:
        set_(value)
    try:
        yield
    finally:
        for set_, _, was in changed:
            set_(was)


# NOTE [ Casts autocast caches ]
# Under autocast with its cache on (torch.autocast's default), each cast of a leaf that
# needs a gradient (a weight cast to bf16 for a matmul) is cached on the thread until
# the outermost autocast region exits, and every use of the weight in the region shares
# that one cast: one ToCopyBackward node, at which the gradients of all its uses add up
# in the cast's dtype before one conversion to the weight's. A checkpoint leaves the
# cache as it is, as torch.utils.checkpoint does: dropping it as a checkpointed forward
# ends would free the weight copies its segment cast (memory the checkpoint exists to
# free), but a weight cast again after that (cast before the checkpoint and used after
# it, a layer shared by several checkpoints, a tied weight) gets a second node, the
# gradients of its uses then adding up in float32: not the plain step's bits
# (docs/results.md, "A nineteenth adversarial run"). So a checkpointed segment's weight
# casts stay alive to the region's end, and the planners count them as kept by the
# segment beside its input (LayerProfile.cached_cast_bytes, planning/profiler.py). A
# recompute under the region casts nothing new: its casts are the cache's.


@dataclass(frozen=True)
class ReplayState:
    """RNG, autocast, default device and kernel settings at the start of a checkpointed
    forward."""

    cpu_rng: Optional[torch.Tensor]  # None: preserve_rng_state=False, no RNG replay
    device_type: str  # the inputs' accelerator type, or "cpu" when there is none
    devices: tuple  # indices of the accelerators the inputs live on
    device_rngs: tuple
    autocast: tuple
    default_device: torch.device
    passed: tuple = ()  # (generator, its state) of each torch.Generator passed to the call
    settings: tuple = ()  # NOTE [ Settings a recompute replays ]

    @classmethod
    def capture(cls, tensors, preserve_rng_state: bool = True, generators=()) -> "ReplayState":
        """The state now, for a forward whose inputs are ``tensors`` and which is passed
        ``generators`` (passed_generators). Inputs all on the meta device (a planner's
        meta step) replay no RNG state: random operators on meta tensors draw nothing,
        and replaying one would set the process's generator, which other threads draw
        from (NOTE [ Steps other threads do not see ] in planning/step_isolation.py)."""
        if tensors and tensors[0].is_meta and all(t.is_meta for t in tensors):  # cheap for real ones
            preserve_rng_state = False
        accelerators = sorted({(t.device.type, t.device.index or 0) for t in tensors
                               if t.device.type not in ("cpu", "meta")})
        device_type = accelerators[0][0] if accelerators else "cpu"
        devices = tuple(index for kind, index in accelerators if kind == device_type)
        module = torch.get_device_module(device_type) if devices else None
        return cls(
            cpu_rng=torch.get_rng_state() if preserve_rng_state else None,
            device_type=device_type,
            devices=devices,
            device_rngs=tuple(module.get_rng_state(i) for i in devices) if module and preserve_rng_state else (),
            autocast=autocast_now(device_type),
            default_device=default_device(),
            passed=tuple((g, g.get_state()) for g in generators) if preserve_rng_state else (),
            settings=_settings(),
        )

    @property
    def generators(self) -> tuple:
        """The generators besides the process's whose states it replays."""
        return tuple(generator for generator, _ in self.passed)

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
        with torch.random.fork_rng(devices=list(self.devices), device_type=self.device_type, enabled=replays_rng), \
                generators_replayed(self.passed):
            if replays_rng:
                torch.set_rng_state(self.cpu_rng)
            if self.devices and replays_rng:
                module = torch.get_device_module(self.device_type)
                for index, state in zip(self.devices, self.device_rngs):
                    module.set_rng_state(state, index)
            with contextlib.ExitStack() as stack:
                if default_device() != self.default_device:
                    stack.enter_context(self.default_device)
                if self.settings and _settings() != self.settings:
                    stack.enter_context(_settings_set(self.settings))
                # Entered even where autocast is in that state already, as torch's checkpoint
                # enters it: its exit puts the enabled flag, dtype and cache setting back as
                # the recompute found them, whatever a layer of the recompute set and left (a
                # layer that enters autocast for the layers after it), and where its nesting
                # count reaches zero, clears the casts cached inside. The count itself is not
                # put back: a layer that enters or leaves autocast across segment bounds
                # leaves it off, as under torch's checkpoint.
                for autocast in self.autocast:
                    stack.enter_context(autocast.context())
                yield


def passed_generators(args: tuple, kwargs: dict) -> list:
    """The ``torch.Generator`` s passed to a call as arguments (``torch.rand(...,
    generator=g)`` inside it draws from one), whose state a recompute replays as it does
    the process's generators. Arguments themselves, not inside containers: a call's
    arguments are walked for them at every call."""
    found = [a for a in args if isinstance(a, torch.Generator)]
    return found + [v for v in kwargs.values() if isinstance(v, torch.Generator)] if kwargs else found


@contextlib.contextmanager
def generators_put_back(generators):
    """As it closes, each of ``generators`` holds the state it held as it opened."""
    states = [(generator, generator.get_state()) for generator in generators]
    try:
        yield
    finally:
        for generator, state in states:
            generator.set_state(state)


@contextlib.contextmanager
def generators_replayed(passed):
    """Each generator of ``passed`` (``(generator, state)`` pairs) in that state while
    the body runs, and in the caller's afterwards."""
    with generators_put_back([generator for generator, _ in passed]):
        for generator, state in passed:
            generator.set_state(state)
        yield


class RandomState:
    """The CPU generator's state, those of the accelerators a call's tensors are on, and
    those of the generators passed to it (``generator=g``): what a selective recompute
    sets as a call it skips left them (selective.py)."""

    __slots__ = ("cpu", "devices", "passed")

    def __init__(self, cpu: torch.Tensor, devices: tuple, passed: tuple = ()):
        self.cpu, self.devices, self.passed = cpu, devices, passed

    @classmethod
    def capture(cls, tensors: list, generators=()) -> "RandomState":
        devices = sorted({(t.device.type, t.device.index or 0) for t in tensors
                          if t.device.type not in ("cpu", "meta")})
        return cls(torch.get_rng_state(), tuple(
            (kind, index, torch.get_device_module(kind).get_rng_state(index)) for kind, index in devices),
            tuple((generator, generator.get_state()) for generator in generators))

    def again(self) -> "RandomState":
        """The same generators' states now."""
        return RandomState(torch.get_rng_state(), tuple(
            (kind, index, torch.get_device_module(kind).get_rng_state(index)) for kind, index, _ in self.devices),
            tuple((generator, generator.get_state()) for generator, _ in self.passed))

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        for kind, index, state in self.devices:
            torch.get_device_module(kind).set_rng_state(state, index)
        for generator, state in self.passed:
            generator.set_state(state)

    def __eq__(self, other) -> bool:
        return torch.equal(self.cpu, other.cpu) and all(
            torch.equal(a[2], b[2]) for a, b in zip(self.devices, other.devices)) and all(
            torch.equal(a[1], b[1]) for a, b in zip(self.passed, other.passed))

    __hash__ = None
