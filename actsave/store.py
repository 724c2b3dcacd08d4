"""Kept segment inputs: what a checkpointed segment holds between its forward and
its recompute, and the ledger behind :func:`actsave.stored_bytes`.

See NOTE [ Lifetime of kept inputs ] in function.py for when entries are released.
"""
from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass

import torch
from torch.utils import _pytree as pytree

from .codecs import IDENTITY, Codec, get_codec
from .errors import ConfigError, RecomputeError


class _Ledger:
    """Bytes actsave holds for backward, by where they sit. Entries are added and
    removed from autograd's worker threads too, hence the lock."""

    def __init__(self):
        self._lock = threading.Lock()
        self._bytes = {"device": 0, "host": 0}

    def add(self, where: str, nbytes: int) -> None:
        with self._lock:
            self._bytes[where] += nbytes

    def snapshot(self) -> dict:
        with self._lock:
            return dict(self._bytes)


_LEDGER = _Ledger()


def account(owner, nbytes: int, where: str = "device") -> None:
    """Count ``nbytes`` in :func:`stored_bytes` for as long as ``owner`` lives."""
    _LEDGER.add(where, nbytes)
    weakref.finalize(owner, _LEDGER.add, where, -nbytes)


def stored_bytes() -> dict:
    """Bytes actsave currently holds for backward: ``{"device": int, "host": int}``.

    Counts the kept segment inputs (as stored: compressed bytes for a lossy codec,
    scales included). ``"device"`` is memory on the device the model runs on (the
    CPU for a CPU model); ``"host"`` is memory offloaded to the host. Both are zero
    after backward and under ``torch.no_grad()``.
    """
    return _LEDGER.snapshot()


@dataclass(frozen=True)
class KeepPolicy:
    """How one segment keeps its input: the codec, and whether it goes to the host."""

    codec: Codec = IDENTITY
    offload: bool = False

    @classmethod
    def resolve(cls, compress=None, offload=False) -> "KeepPolicy":
        if not isinstance(offload, bool):
            raise ConfigError(f"offload={offload!r} must be True or False")
        if offload:
            raise ConfigError(
                "offload=True is not available in this version of actsave; use offload=False"
            )
        return cls(codec=get_codec(compress), offload=offload)

    def describe(self) -> tuple:
        return (self.codec.name, "host" if self.offload else "-")


EXACT = KeepPolicy()


def _should_encode(t: torch.Tensor) -> bool:
    # Leaf tensors (parameters, the batch, anything autograd did not produce) are
    # held elsewhere anyway: encoding them would add memory and error, not remove it.
    return t.is_floating_point() and not t.is_leaf


class _KeptTensor:
    """One tensor input, stored by a codec until the recompute asks for it back."""

    def __init__(self, tensor: torch.Tensor, codec: Codec, private_copy: bool):
        self.requires_grad = tensor.requires_grad
        codec = codec if _should_encode(tensor) else IDENTITY
        source = tensor.detach()
        if private_copy and codec.aliases_input:
            source = source.clone()
        self.codec = codec
        self.modified_in_place = private_copy  # by the function's first layer
        self.private = private_copy or not codec.aliases_input
        self.packed = codec.encode(source)
        # An aliased input changed in place after this point would be recomputed
        # from the wrong values: remember its version to refuse that.
        self.version = None if self.private else source._version
        self.nbytes = self.packed.nbytes
        self._release = weakref.finalize(self, _LEDGER.add, "device", -self.nbytes)
        _LEDGER.add("device", self.nbytes)

    @property
    def lossy(self) -> bool:
        return not self.codec.lossless

    def check_unmodified(self, where: str) -> None:
        if self.version is not None and self.packed.data._version != self.version:
            raise RecomputeError(
                f"a checkpointed input was modified in place {where}, so the segment "
                "cannot be recomputed from it. Do not modify it in place (for an "
                "in-place first layer, set inplace=False or mark it with an "
                "`inplace = True` attribute so actsave keeps a private copy)."
            )

    def restore(self) -> torch.Tensor:
        self.check_unmodified("after the forward that kept it")
        x = self.codec.decode(self.packed).detach().requires_grad_(self.requires_grad)
        if self.modified_in_place and self.requires_grad:
            # A leaf that requires grad cannot be modified in place; a segment that
            # starts with an in-place layer needs a non-leaf input.
            x = x.clone()
        return x

    def release(self) -> None:
        self.packed = None
        self._release()


class KeptInputs:
    """All inputs of one segment call: tensors stored by the policy's codec,
    anything else (ints, strings, None) held as it is."""

    def __init__(self, args: tuple, kwargs: dict, policy: KeepPolicy, private_copy: bool):
        leaves, self._spec = pytree.tree_flatten((args, kwargs))
        self._leaves = [
            _KeptTensor(leaf, policy.codec, private_copy) if isinstance(leaf, torch.Tensor) else leaf
            for leaf in leaves
        ]
        self.released = False

    @property
    def tensors(self) -> list:
        return [leaf for leaf in self._leaves if isinstance(leaf, _KeptTensor)]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    @property
    def lossy(self) -> bool:
        """Whether a recompute from these inputs differs from the forward."""
        return any(t.lossy for t in self.tensors)

    def check_unmodified(self, where: str) -> None:
        for t in self.tensors:
            t.check_unmodified(where)

    def restore(self) -> tuple:
        """``(args, kwargs)`` for the recompute: detached tensors that require grad
        as the originals did."""
        if self.released:
            raise RecomputeError(
                "the kept inputs of this checkpoint were already released (an earlier "
                "recompute of it failed, or its graph was freed); run the forward again"
            )
        leaves = [leaf.restore() if isinstance(leaf, _KeptTensor) else leaf for leaf in self._leaves]
        return pytree.tree_unflatten(leaves, self._spec)

    def release(self) -> None:
        for t in self.tensors:
            t.release()
        self.released = True


def input_tensors(args: tuple, kwargs: dict) -> list:
    """The tensors among ``args`` and ``kwargs``, at any nesting depth."""
    return [x for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]


def any_requires_grad(tensors) -> bool:
    return any(t.requires_grad for t in tensors)


__all__ = ["KeepPolicy", "KeptInputs", "EXACT", "stored_bytes", "input_tensors"]
