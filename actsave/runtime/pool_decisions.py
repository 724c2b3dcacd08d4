"""Exact max-pool decisions in a lossy recompute.

NOTE [ Max-pool decisions ]
A segment recomputed from a compressed input may see another pixel win a max pool's
window than the forward saw; the pool's backward then routes that window's gradient
to the wrong pixel, and the pooled value downstream is another pixel's. Few windows
change, but each sends a whole gradient to the wrong place, so the worst
parameter-gradient SQNR of a max-pooling ResNet falls sharply without the
decisions (docs/results.md, "Gradient fidelity", Max-pool decisions).

So a lossy checkpoint keeps each window's decision, as it keeps ReLU decisions
(relu_signs.py), and its recompute pools at them:

- Which saves are decisions. ``max_pool{1,2,3}d_with_indices`` saves its input and then
  its ``indices`` output through the saved-tensor hooks. Module forward hooks
  (:class:`PoolWatch`) tell when a plain ``nn.MaxPool1d/2d/3d`` runs (that class, not
  a subclass or one with another ``forward`` set on the instance, which may pool
  otherwise or change what it pooled), and an int64 save made there,
  with the shape the pool's geometry gives for the input it just saved, is its
  indices. Metadata only: no device sync, no other integer save (embedding ids, gather
  indices, targets) mistaken for one. ``F.max_pool2d`` called outside such a module,
  subclasses, forwards set on instances that do not say they wrap the class's
  (forward_dispatch.runs_its_class_forward), and windows of more than 256 elements
  are recomputed as they come (lossy, never wrong).
- Compactly. The decision is the offset of the winning element within its window
  (``kernel_size``, ``stride``, ``padding``, ``dilation`` and ``ceil_mode`` place the
  window), packed in 1, 2, 4 or 8 bits: 4 bits for a 3x3 window, 1/8 of the fp32
  pooled output, where the int64 indices would be twice its size.
- Where and how long: attached to the kept inputs (store.py), so offloaded with them,
  released with them after the recompute; counted by :func:`actsave.kept_bytes` and
  the planner (planning/instrumented_step.py) like ReLU bits.
- The recompute writes the forward's indices into the indices it saves, in place
  (the backward scatters at the forward's choice; a ``return_indices=True`` caller
  downstream reads them too), and when the pool module returns sets its output to the
  input at those indices: exactly a pool that recomputes at the forward's decisions.
  Only where the module returned its pool's own output of its argument: a forward
  set on it (accelerate's hooks) or a hook may have changed either.

Exact checkpoints keep nothing: their recompute decides as the forward did. The last
segment of a CheckpointedSequential is not recomputed, so it has the forward's
indices; under a lossy codec it stores them in the same few bits (kept_saves.py).
"""
from __future__ import annotations

import contextlib
import math
import threading
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from .._torch import version
from ..codecs.backend import implementation
from ..triton_kernels import decision_table
from ..triton_kernels.bitfields import field_bits
from .forward_dispatch import runs_its_class_forward
from .layers import module_hooks, modules_among

# The plain max pools and the number of spatial dimensions each pools over.
_PLAIN_POOLS = {nn.MaxPool1d: 1, nn.MaxPool2d: 2, nn.MaxPool3d: 3}
_MAX_WINDOW = 256  # offsets fit one byte


@dataclass(frozen=True)
class Window:
    """Where a max pool's windows lie: per spatial dimension, kernel, stride, padding
    and dilation; and how many bits a window offset takes."""

    kernel: tuple
    stride: tuple
    padding: tuple
    dilation: tuple
    ceil_mode: bool

    @classmethod
    def of(cls, module: nn.Module) -> Optional["Window"]:
        """The windows of a plain ``nn.MaxPool1d/2d/3d`` whose decisions can be kept,
        or None: another module (a subclass, or one with a ``forward`` set on the
        instance that does not say it wraps the class's: it may pool otherwise, or do
        more), a window of one element, which
        decides nothing, or of more than 256."""
        dims = _PLAIN_POOLS.get(type(module))
        if dims is None or not runs_its_class_forward(module):
            return None

        def per_dim(value) -> tuple:
            return tuple(value) if isinstance(value, (tuple, list)) else (value,) * dims

        stride = module.stride if module.stride is not None else module.kernel_size
        window = cls(per_dim(module.kernel_size), per_dim(stride), per_dim(module.padding),
                     per_dim(module.dilation), bool(module.ceil_mode))
        return window if 1 < window.size <= _MAX_WINDOW else None

    @property
    def size(self) -> int:
        return math.prod(self.kernel)

    @property
    def bits(self) -> int:
        """Bits per offset: the fewest of 1, 2, 4, 8 that hold ``size`` values (whole
        offsets per byte keep packing to shifts; NOTE [ Bit fields ])."""
        return field_bits(self.size)

    def output_size(self, input_size: tuple) -> tuple:
        """The pooled spatial size of ``input_size``, as ATen's ``pooling_output_shape``."""
        return tuple(_pooled_length(*args, self.ceil_mode) for args in
                     zip(input_size, self.kernel, self.stride, self.padding, self.dilation))

    def packed_bytes(self, outputs: int) -> int:
        """Bytes of the packed decisions of ``outputs`` windows."""
        return -(-outputs * self.bits // 8)

    def encode(self, indices: torch.Tensor, input_size: tuple) -> torch.Tensor:
        """The offset of each window's winner, packed (uint8, 1-D). ``indices``: flat
        per plane over ``input_size``, as max pooling returns them. One kernel launch on
        CUDA (triton_kernels/decisions/max_pool.py), which allocates only the packed
        bytes; the torch reference's transients are what the planner charges
        (planning/codec_costs.py)."""
        kernel = decision_table()["max_pool", "encode"]
        return implementation(kernel, indices)(indices, tuple(input_size), *self._geometry())

    def decode_into_(self, indices: torch.Tensor, packed: torch.Tensor, input_size: tuple) -> None:
        """Overwrite ``indices`` (a recompute's, of the forward's shape) with the
        decisions :meth:`encode` packed. One kernel launch on CUDA."""
        kernel = decision_table()["max_pool", "decode"]
        with torch.no_grad():
            implementation(kernel, indices)(indices, packed, tuple(input_size), *self._geometry())

    def _geometry(self) -> tuple:
        return self.kernel, self.stride, self.padding, self.dilation


def _pooled_length(size: int, kernel: int, stride: int, padding: int, dilation: int, ceil_mode: bool) -> int:
    span = size + 2 * padding - dilation * (kernel - 1) - 1 + (stride - 1 if ceil_mode else 0)
    length = span // stride + 1
    if ceil_mode and (length - 1) * stride >= size + padding:
        length -= 1  # the last window would start in the right padding
    return length


@dataclass(frozen=True)
class PoolDecisions:
    """What a lossy checkpoint keeps of one max pool call: its packed decisions
    (``kept``: anything with ``fetch()``, store.py's attached tensor), the windows and
    the pooled input's spatial size."""

    kept: object
    window: Window
    input_size: tuple

    def restore_(self, indices: torch.Tensor) -> None:
        """Make a recompute's ``indices`` the forward's, in place."""
        self.window.decode_into_(indices, self.kept.fetch(), self.input_size)


class _Call:
    """One running call of a plain max pool."""

    __slots__ = ("module", "window", "input_shape", "restored")

    def __init__(self, module: nn.Module, window: Window):
        self.module, self.window = module, window
        self.input_shape = None  # of the floating-point tensor the pool saved (its input)
        self.restored = None  # the recompute's indices, once set to the forward's


class PoolWatch:
    """Follows the plain max pools that run on this thread while :meth:`watching`:
    tells their indices saves (:meth:`window_of`) and, in a recompute, pools at the
    restored decisions (:meth:`restored`). NOTE [ Max-pool decisions ].

    ``pools``: the plain max pools the watched function can run, when its layers are
    known (layers.py, NOTE [ Known layers ]): hooks go on those alone, and none at all
    where there are none. None: global module hooks watch every module call."""

    def __init__(self, pools: Optional[list] = None):
        self._thread = threading.get_ident()
        self._calls = []
        self._pools = pools

    @classmethod
    def among(cls, modules) -> "PoolWatch":
        """A watch of the plain max pools among ``modules`` (layers.modules_among)."""
        return cls(modules_among(modules, lambda module: Window.of(module) is not None))

    @contextlib.contextmanager
    def watching(self):
        """Register the module hooks for the body (none where no max pool can run)."""
        if self._pools == []:
            yield self
            return
        self._thread = threading.get_ident()
        try:
            with module_hooks(self._pools, self._before_module, self._after_module):
                yield self
        finally:
            self._calls = []  # a recompute stopped early leaves its pool running

    def window_of(self, tensor: torch.Tensor) -> Optional[tuple]:
        """For a tensor being saved: ``(window, input spatial size)`` when it is the
        indices of the plain max pool running now, else None. Sees every save of the
        pool: its input (floating point, saved first) is noted."""
        if not self._calls or threading.get_ident() != self._thread:
            return None
        call = self._calls[-1]
        if tensor.is_floating_point():
            call.input_shape = tuple(tensor.shape)
            return None
        dims = len(call.window.kernel)
        if (tensor.dtype != torch.int64 or tensor.requires_grad or call.input_shape is None
                or len(call.input_shape) != tensor.dim() or call.input_shape[:-dims] != tuple(tensor.shape[:-dims])):
            return None
        input_size = call.input_shape[-dims:]
        if call.window.output_size(input_size) != tuple(tensor.shape[-dims:]):
            return None
        return call.window, input_size

    def restored(self, indices: torch.Tensor, decisions: PoolDecisions) -> None:
        """In a recompute: set the running pool's ``indices`` (being saved) to the
        forward's decisions; its output follows when the pool returns."""
        decisions.restore_(indices)
        if self._calls and threading.get_ident() == self._thread:
            self._calls[-1].restored = indices

    def _before_module(self, module, args) -> None:
        if threading.get_ident() != self._thread:
            return
        window = Window.of(module)
        if window is not None:
            self._calls.append(_Call(module, window))

    def _after_module(self, module, args, output) -> None:
        if threading.get_ident() != self._thread or not self._calls or self._calls[-1].module is not module:
            return
        call = self._calls.pop()
        pooled = output[0] if isinstance(output, tuple) else output
        argument = args[0] if args else None  # pool(input=x): not known, not pooled at the decisions
        if call.restored is not None and _pooled_by_module(pooled, argument):
            pool_at_(pooled, argument, call.restored, len(call.window.kernel))


def _pooled_by_module(output, argument) -> bool:
    """Whether a pool module returned its pool's own output of its own argument, by the
    graph: not something a forward wrapper (accelerate's hooks) or a hook made of
    either. Only then is the output the argument at the decisions. Otherwise the output
    keeps the recompute's own values, its indices the forward's: a value off by the
    codec's error, never another pixel's gradient. (A MaxPool1d pools a 2-D view.)"""
    if not isinstance(output, torch.Tensor) or version(output) != 0:  # changed in place (no_grad, .data)
        return False
    node = output.grad_fn
    squeezed = _named(node, "Squeeze")
    if squeezed:
        node = node.next_functions[0][0]
    if not _named(node, "MaxPool"):
        return False
    source = node.next_functions[0][0]
    if squeezed and _named(source, "Unsqueeze"):
        source = source.next_functions[0][0]
    if not isinstance(argument, torch.Tensor) or source is None:
        return False
    if argument.grad_fn is not None:
        return source is argument.grad_fn
    return getattr(source, "variable", None) is argument  # a leaf's AccumulateGrad


def _named(node, prefix: str) -> bool:
    return node is not None and type(node).__name__.startswith(prefix)


def pool_at_(pooled: torch.Tensor, x: torch.Tensor, indices: torch.Tensor, dims: int) -> None:
    """Set ``pooled`` to ``x`` at ``indices`` (flat over the last ``dims`` dimensions
    of ``x``), in place: the value a max pool deciding at ``indices`` returns. One
    kernel launch on CUDA, one gather into ``pooled`` on the torch reference."""
    kernel = decision_table()["max_pool", "gather"]
    with torch.no_grad():  # a correction, not an operation of the graph: nothing saved
        implementation(kernel, pooled)(pooled.data, x, indices, dims)
