"""Saves kept instead of recomputed: a call run once, every tensor its autograd saves
kept by a :class:`~actsave.runtime.keep_rules.KeepPolicy`, by its codec and, with
``offload``, in host memory. The entry point: :func:`call_with_kept_saves`.

Its users:

- A CheckpointedSequential's last segment, which is not recomputed (backward starts
  there, so the recompute would run at once): it keeps what autograd saves. At
  ``segments="sqrt"`` that is about as large as all the kept inputs together (with k =
  sqrt(n) segments of a chain of like layers, the last one's n / k layers save about
  as much as the k - 1 kept inputs; docs/results.md, "Figures behind the code's
  rules"). So a lossy codec set at the last segment's first layer stores those saves
  too, as ActNN stores every activation; without it the codec could cut at most the
  other half of the peak. Offload does not apply there: its backward needs them at once.
- A block kept instead of recomputed: it runs once, and its saves are kept
  by int8 or fp8 (all of them, or only the inputs of its Linear layers, as COAT and
  DeepSeek-V3 keep them), or on the host, copied while the next blocks run forward and
  brought back ahead of its backward.

NOTE [ Kept saves ]
What each save autograd makes during the call becomes (_SavesStore.pack):

- Held as it is, on the device: the leaves and their views (parameters, ``weight.t()``,
  the batch, BatchNorm's running and batch statistics), integer, bool and float8
  tensors, sparse and nested ones, empty ones: what keep_rules.should_encode refuses.
  Keeping them otherwise would copy what lives anyway, or what no codec reads. With
  ``scope="linear_inputs"``, also every save that is not a Linear input: autograd's
  own, exact.
- Kept by a lossy codec: every other floating-point save (``scope="all"``), but the
  statistics and divisors NOTE [ Saves a lossy codec leaves exact ] holds and the saves
  of attention calls and their storages NOTE [ Attention's saves agree ] holds, or those
  whose storage is an ``nn.Linear``'s input (``scope="linear_inputs"``). Encoded as it
  is saved, so that the exact tensor may go at once; stored once per contiguous range
  of a storage (stored_once_key: a tensor saved twice, the 2-D view a Linear saves of
  an N-D input), however many nodes save it.
  - ReLU outputs made in the call keep their decisions, one bit per element
    (relu_signs.py): a small positive output that the codec rounds to zero would
    otherwise block its gradient. Every ReLU output is stored on the codec's unsigned
    grid (one more bit of resolution). An in-place ReLU module on a view is known by
    watching it (NOTE [ In-place ReLUs on views ]).
  - The gradient error does not compound as in a recompute: each save is decoded on its
    own, so its error reaches only the gradients computed from it. That is why saves a
    backward reads together, whose terms cancel, are not decoded apart: an attention's.
  - A max pool's indices (int64, twice the size of its fp32 output) are stored as the
    offset of each window's winner, a few bits each (pool_decisions.py): exactly, as
    the backward needs them (``scope="all"``; otherwise held as they are).
- Kept exactly, with offload and the exact codec: the saves of the lossy case, each
  storage once, however many of its views were saved (a tensor, its transposes and
  slices: the span of bytes they cover crosses the bus once, and each comes back as
  the view it was). A view with the negative bit set is held as it is: its values are
  not its bytes (_copied_as_bytes).
- Linear inputs (``scope="linear_inputs"``; DeepSeek-V3: "cache the inputs of Linear
  layers in fp8"): found by forward pre-hooks on the ``nn.Linear`` modules under the
  function's known layers (layers.py, NOTE [ Known layers ]; a global one for another
  callable), which note the input's storage. The storage is the unit: every save of
  it is kept so, one copy, whatever op saves it, before the Linear runs (a ReLU's
  output, converted as the Linear starts) or after. Not an attention's output, which
  DeepSeek-V3 keeps in fp8 for the projection and the attention's backward: the
  attention holds it exactly, and the projection's save shares it (NOTE [ Attention's
  saves agree ]). A Linear whose input is reshaped by a copy saves that copy: not kept
  so.

Where the kept saves are, and when they go (_Entry, _HostGroup):

- Without offload, on the device, counted in ``kept_bytes()["device"]``; each freed
  with the last node that saved it (held weakly: autograd holds them).
- With offload, on the device until the call's forward ends, then host memory: all of
  them as one OffloadedTensors group (one buffer, one copy each way), one item of the
  forward thread's PrefetchTape (offload.current_tape()). The call marks its start on
  the tape (``segment_may_start``, unless its caller did), so that the device memory
  of what was offloaded before it goes; its own copy starts as its forward ends, so
  its device memory goes one block later (``free_later``; NOTE [ Offload stream
  ordering ], rule 2). Counted in ``kept_bytes()["host"]``, then ``["device"]`` from
  the first unpack of any of its saves, which fetches the group (and the tape
  prefetches the items registered before it: the blocks whose backward comes next).
  Released when the last node that saved them is freed: after its backward (so at the
  end of the block's backward, unless ``retain_graph=True``, which keeps them for the
  next), or when the graph is dropped without backward.
- The exact codec without offload keeps nothing: the saves are autograd's own (the
  call returns None for its kept bytes), so a planner may treat it as plain.

Autograd's in-place check holds as without hooks (where hooks are set, autograd checks
no version): each save records the version of the tensor it saves, and unpacking it
raises autograd's error if the tensor changed in place since (a weight changed between
forward and backward). A kept tensor is followed by an alias that shares its version
counter and none of its storage (_torch.version_counter_of).

Whose saves they are, where saved-tensor hooks are set as the call starts (innermost
hooks win, torch's rule):

- A checkpoint's forward or recompute hooks (actsave's, function.py; those of
  torch.utils.checkpoint; _torch.saved_tensor_hooks_of_a_checkpoint): the call sets
  none and keeps nothing. The checkpoint drops its saves and recomputes them, so
  keeping them too would only cost memory, and its recompute must see the saves its
  forward saw. So do the planner's measuring hooks (:func:`takes_kept_saves`): a
  profile counts the call's saves as autograd makes them, a price from above.
- Any others (the caller's, ``save_on_cpu``, ``allow_mutation_on_saved_tensors``):
  the call's hooks take over inside it, as a checkpoint's do, so what it saves is
  kept by its policy as without them; what is saved outside the call still goes to
  theirs. An exact call without offload sets none: its saves go to theirs, as a plain
  call's.
"""
from __future__ import annotations

import contextlib
import threading
import warnings
import weakref
from typing import Callable, Optional

import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks
from torch.nn.modules.module import register_module_forward_pre_hook

from .._torch import default_device, saved_tensor_hooks_of_a_checkpoint, storage_identity
from .._torch_graphs import eager_hooks
from ..errors import ConfigError
from ..offload import current_tape
from . import relu_signs
from .function import CheckpointFrame, detached_or_same
from .placeholders import unchanged
from .layers import known_layers, modules_under
from .bound_decisions import BoundWatch
from .forward_decisions import torch_checkpoints_warned
from .pool_decisions import PoolWatch
from .kept_entries import _Encoded, _Entry, _ExactStorage, _HostGroup, _PoolIndices, _Saved
from .keep_rules import (AttentionSaves, KeepPolicy, compared_inputs, lossy_codec_stores, placed, should_encode,
                         stored_once_key)
from .store import input_tensors

SCOPES = ("all", "linear_inputs")


class _LinearInputs:
    """Tells ``note`` the input of each ``nn.Linear`` the function runs on this thread,
    as the Linear starts: pre-hooks on the Linear modules under its known layers
    (``modules``), or a global one where they are not known (None)."""

    def __init__(self, modules: Optional[list], note: Callable):
        self._linears = None if modules is None else [m for _, m in modules if isinstance(m, nn.Linear)]
        self._note, self._thread = note, threading.get_ident()
        self.ran = False  # whether a Linear ran: else the codec kept nothing (warn_none_ran)

    @contextlib.contextmanager
    def watching(self):
        if self._linears is None:
            handles = [register_module_forward_pre_hook(self._before)]
        else:
            handles = [linear.register_forward_pre_hook(self._before, with_kwargs=True) for linear in self._linears]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def _before(self, module: nn.Module, args: tuple, kwargs: Optional[dict] = None) -> None:
        # A global pre-hook sees no keywords: a Linear called as linear(input=x) there
        # keeps its input as autograd saves it.
        if not isinstance(module, nn.Linear) or threading.get_ident() != self._thread:
            return
        self.ran = True
        x = args[0] if args else (kwargs or {}).get("input")
        if isinstance(x, torch.Tensor):
            self._note(x)

    @staticmethod
    def warn_none_ran(function: Callable) -> None:
        """Warn, once per function, that it ran no nn.Linear, so its codec kept nothing."""
        name = getattr(function, "__qualname__", None) or type(function).__name__
        if name not in _WARNED_NO_LINEAR:
            _WARNED_NO_LINEAR.add(name)
            warnings.warn(
                f"actsave: keep='linear_inputs' on {name} kept nothing by its codec: no nn.Linear ran in its forward "
                "(Hugging Face's GPT-2 projects with transformers' Conv1D, for one), so autograd kept every save as "
                "it is, as plain does. Use keep='saves' to keep them all by the codec.", stacklevel=5)


_WARNED_NO_LINEAR = set()  # names of functions warned about


class _SavesStore:
    """The pack and unpack hooks of one call's forward, and what it keeps: NOTE [ Kept
    saves ]."""

    def __init__(self, policy: KeepPolicy, scope: str, function: Callable, inputs: list):
        policy = placed(policy, inputs[0].device if inputs else default_device())
        self.codec, self.offload, self.everything = policy.codec, policy.offload, scope == "all"
        # The modules are walked only where something watches them: the max pools of a
        # lossy codec keeping every save, or the Linear layers whose inputs it keeps.
        watches = not self.everything or policy.lossy
        layers = known_layers(function) if watches else None  # NOTE [ Known layers ]
        modules = None if layers is None else modules_under(layers)
        self.pools = PoolWatch.among(modules) if self.everything and policy.lossy else PoolWatch([])
        # NOTE [ In-place ReLUs on views ]: their outputs keep decisions and go on the unsigned grid.
        self.relus = relu_signs.InplaceRelus.among(modules) if policy.lossy else relu_signs.InplaceRelus([])
        self.bounds = BoundWatch(active=policy.lossy)  # NOTE [ Bound decisions ]
        self.linears = None if self.everything else _LinearInputs(modules, self._linear_input)
        self.attention = AttentionSaves() if policy.lossy else None  # NOTE [ Attention's saves agree ]
        self._input_nodes = relu_signs.input_nodes(inputs)
        # Every dict below is keyed by a storage's identity, valid while the reference
        # beside it is alive (then the storage is too, and its address is no other's).
        self._seen = {}  # stored_once_key -> (weak storage, _Encoded): held through the forward
        self._storages = {}  # storage identity -> weak _ExactStorage, which holds the storage
        self._linear_storages = {}  # storage identity -> weak storage: a Linear's input
        self._pending = {}  # storage identity -> [(weak _Saved held, non-negative, keeps signs, bounds)]
        self._made = []  # weak references to every _Entry, for the host group
        self._last_saves = ((_dead_ref, _dead_ref),) * 2  # the last two saves and their tensors, weakly
        self._held = {}  # storage identity -> the weak save holding it exactly: NOTE [ Saves a backward compares ]

    @contextlib.contextmanager
    def watching(self):
        linears = contextlib.nullcontext() if self.linears is None else self.linears.watching()
        attention = contextlib.nullcontext() if self.attention is None else self.attention.watching()
        with saved_tensors_hooks(self.pack, self.unpack), self.pools.watching(), self.relus.watching(), \
                self.bounds.watching(), torch_checkpoints_warned(not self.codec.lossless), linears, attention:
            yield

    def pack(self, tensor: torch.Tensor) -> _Saved:
        if self.codec.lossless:
            return self._pack(tensor)
        recent = [(save(), before()) for save, before in self._last_saves]
        for i in compared_inputs(tensor, [before for _, before in recent]):  # NOTE [ Saves a backward compares ]
            if recent[i][0] is not None:
                self._hold_exactly(*recent[i])
        saved = self._pack(tensor)
        self._last_saves = (*self._last_saves[1:], (weakref.ref(saved), weakref.ref(tensor)))
        return saved

    def _hold_exactly(self, saved: _Saved, tensor: torch.Tensor) -> None:
        """``saved``, of ``tensor``, holds it as it is, and so does every later save of its
        storage while ``saved`` lives, the storage with it (NOTE [ Saves a backward
        compares ]; not after a detached result freed its node); a Linear that takes the
        storage later encodes none of them."""
        saved.hold(tensor)
        identity = storage_identity(tensor)
        self._held[identity] = weakref.ref(saved)
        pending = self._pending.get(identity, [])
        pending[:] = [waiting for waiting in pending if waiting[0]() is not saved]

    def _pack(self, tensor: torch.Tensor) -> _Saved:
        pool = self.pools.window_of(tensor)  # also notes a pool's input: called for every save
        if pool is not None:
            return self._kept(_PoolIndices(tensor, *pool), tensor)
        stores = _copied_as_bytes if self.codec.lossless else lossy_codec_stores
        if tensor.numel() == 0 or not stores(tensor):
            # By a detached alias where it has a node: a node's own output (sqrt's, a
            # norm's statistic) holding that node is a cycle through autograd's graph,
            # which the garbage collector does not see, so a graph dropped without a
            # backward would never be freed. One that needs no grad comes back as itself.
            return _Saved.held(detached_or_same(tensor))
        if self._held and self._held.get(storage_identity(tensor), _dead_ref)() is not None:
            return _Saved.held(tensor.detach())
        if self.attention is not None and self.attention.holds(tensor):
            # By a detached alias: the attention's output is the output of the node saving it.
            return _Saved.held(tensor.detach())
        if not self.everything and not self._is_linear_input(tensor):
            return self._held_for_now(tensor)
        return self._kept(self._entry(tensor, *self._decisions(tensor)), tensor)

    def unpack(self, saved: _Saved) -> torch.Tensor:
        saved.check_unchanged()
        if isinstance(saved.value, torch.Tensor):
            return saved.value
        return saved.value.unpacked(saved.layout)

    def _kept(self, entry: _Entry, tensor: torch.Tensor) -> _Saved:
        saved = _Saved(None, None, tensor, None)
        saved.keep(entry, tensor)
        return saved

    def _decisions(self, tensor: torch.Tensor) -> tuple:
        """``(non-negative, keeps ReLU signs, bounds)`` of a tensor being saved: a lossy
        codec stores a ReLU output on its unsigned grid, and keeps the decisions of one
        the call made (judged by its autograd node: NOTE [ ReLU outputs that keep
        decisions ]) or of a Hardtanh's or LeakyReLU's save (NOTE [ Bound decisions ])."""
        if self.codec.lossless:
            return False, False, None
        bounds = BoundWatch.bounds_of_save()
        return (relu_signs.known_non_negative(tensor), bounds is None and
                relu_signs.keeps_decisions(tensor, self._input_nodes), bounds)

    def _entry(self, tensor: torch.Tensor, non_negative: bool, keep_signs: bool, bounds=None) -> _Entry:
        """The entry that keeps ``tensor``: the one made for the same elements before,
        or a new one."""
        if self.codec.lossless:
            return self._exact_storage(tensor)
        key = stored_once_key(tensor)
        storage, entry = self._seen.get(key, (_dead_ref, None))
        if storage() is not None:
            if bounds is not None:  # a clamp's save of elements another op saved first
                entry.add_bounds(tensor, bounds)
            return entry
        entry = self._made_now(_Encoded(self.codec, tensor, non_negative, keep_signs, bounds))
        if key is not None:
            self._seen[key] = (weakref.ref(tensor.untyped_storage()), entry)
        return entry

    def _exact_storage(self, tensor: torch.Tensor) -> _ExactStorage:
        ref = self._storages.get(storage_identity(tensor), _dead_ref)
        entry = ref()
        if entry is None:
            entry = self._made_now(_ExactStorage(tensor))
            self._storages[storage_identity(tensor)] = weakref.ref(entry)
        else:
            entry.add(tensor)
        return entry

    def _made_now(self, entry: _Entry) -> _Entry:
        self._made.append(weakref.ref(entry))
        return entry

    # scope="linear_inputs": NOTE [ Kept saves ], Linear inputs.
    def _is_linear_input(self, tensor: torch.Tensor) -> bool:
        storage = self._linear_storages.get(storage_identity(tensor), _dead_ref)
        return storage() is not None

    def _held_for_now(self, tensor: torch.Tensor) -> _Saved:
        """Held as it is, unless a Linear later in the forward takes its storage as input.
        By a detached alias (same storage and version counter): the tensor itself, when
        it is the output of the node that saves it (a ReLU's), would hold that node, a
        cycle only the garbage collector frees."""
        saved = _Saved.held(tensor.detach())
        self._pending.setdefault(storage_identity(tensor), []).append(
            (weakref.ref(saved), *self._decisions(tensor)))
        return saved

    def _linear_input(self, x: torch.Tensor) -> None:
        """A Linear starts on ``x``: its storage's saves are kept from now on, and those
        held so far too."""
        if not should_encode(x):
            return
        self._linear_storages[storage_identity(x)] = weakref.ref(x.untyped_storage())
        for ref, *decisions in self._pending.pop(storage_identity(x), []):
            saved = ref()
            if saved is not None:  # its alias holds the storage: the same as x's
                saved.keep(self._entry(saved.value, *decisions), saved.value)

    def end_forward(self) -> dict:
        """What the forward kept, as counted in kept_bytes (NOTE [ Kept saves ]); with
        offload, sends it to the host as one group."""
        self.forget()
        entries = [entry for entry in (ref() for ref in self._made) if entry is not None]
        self._made = []
        if not (self.offload and entries):
            return {"device": sum(entry.nbytes for entry in entries), "host": 0}
        tape = current_tape()
        return {"device": 0, "host": _HostGroup(entries, tape).nbytes}

    def forget(self) -> None:
        # The hooks outlive the forward (autograd holds unpack): hold no entry here, so
        # each is freed with the last node that saved it; ids may be reused from now.
        self._seen, self._storages, self._linear_storages, self._pending, self._held = {}, {}, {}, {}, {}
        self._input_nodes = {}
        if self.attention is not None:
            self.attention.forget()


def _copied_as_bytes(tensor: torch.Tensor) -> bool:
    """Whether exact offload keeps ``tensor``, a save, as the bytes of its storage
    (_ExactStorage): what should_encode takes, but a view with the negative bit set
    (``torch._neg_view``, the ``.imag`` of a ``conj()`` view), whose values are the
    negation of those bytes; it is held as it is."""
    return should_encode(tensor) and not tensor.is_neg()


def _dead_ref():
    return None


def takes_kept_saves(pack: Callable) -> Callable:
    """Mark ``pack``, a saved-tensor hook of actsave's that measures what a step saves
    (the planner's profile), as one a call keeping its saves leaves them to, as to a
    checkpoint's: the profile counts them as that call's (NOTE [ Kept saves ])."""
    pack.takes_kept_saves = True
    return pack


def _actsave_takes_them(pack: Callable, unpack: Callable) -> bool:
    """Whether these saved-tensor hooks are an actsave checkpoint's (function.py): its
    forward's, bound to its frame, or its recompute's, whose unpack is ``unchanged``;
    or a measuring hook marked by :func:`takes_kept_saves`."""
    return (unpack is unchanged or isinstance(getattr(unpack, "__self__", None), CheckpointFrame)
            or getattr(pack, "takes_kept_saves", False))


@torch.compiler.disable  # saved-tensor hooks are a graph break; see NOTE [ torch.compile ]
def call_with_kept_saves(function: Callable, args: tuple, kwargs: dict, policy: KeepPolicy,
                         scope: str = "all") -> tuple:
    """Run ``function(*args, **kwargs)`` once, every save autograd makes kept by
    ``policy`` (NOTE [ Kept saves ]): all of them (``scope="all"``) or those of the
    ``nn.Linear`` inputs (``scope="linear_inputs"``), the others autograd's own.

    Returns ``(output, kept_bytes)``: the output, untouched, and ``{"device": int,
    "host": int}``, the bytes kept for its backward as the forward ends, counted so in
    :func:`actsave.kept_bytes` (encoded saves and their decisions; with offload, the
    host group: ``"device"`` is then 0); both 0 under ``torch.no_grad()``. None where
    actsave keeps nothing: the exact codec without offload (a plain call, autograd
    holds the saves), or inside a checkpoint's forward or recompute, whose hooks take
    them (NOTE [ Kept saves ], last paragraph).
    """
    if scope not in SCOPES:
        raise ConfigError(f"scope={scope!r}: keep the saves of {' or '.join(map(repr, SCOPES))}")
    if not torch.is_grad_enabled():
        return function(*args, **kwargs), {"device": 0, "host": 0}
    if saved_tensor_hooks_of_a_checkpoint(_actsave_takes_them):  # it takes the saves: NOTE [ Kept saves ]
        return function(*args, **kwargs), None
    current_tape().segment_may_start()  # NOTE [ Kept saves ]: what was offloaded before goes
    if policy.codec.lossless and not policy.offload:
        return function(*args, **kwargs), None
    store = _SavesStore(policy, scope, function, input_tensors(args, kwargs))
    try:
        with store.watching():
            output = function(*args, **kwargs)
    except BaseException:
        store.forget()
        raise
    if store.linears is not None and not store.linears.ran:
        _LinearInputs.warn_none_ran(function)
    return output, store.end_forward()

eager_hooks(_SavesStore.pack, _SavesStore.unpack)  # NOTE [ Eager hooks Dynamo leaves alone ]


__all__ = ["SCOPES", "call_with_kept_saves"]
