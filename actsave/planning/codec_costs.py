"""What keeping a tensor costs under each codec, measured on a sample of its shape
(:class:`CodecCosts`): the bytes kept, the rises of live bytes while encoding and
decoding, the seconds of each, and on CUDA of the copies to pinned host memory and
back; and the rises of keeping and restoring a ReLU output's or a max pool's
decisions. The profile (profiler.py) reads them for each layer input, and
stored_saves.py for each save of a plain segment.
"""
from __future__ import annotations

import math
import statistics
from typing import NamedTuple

import torch

from ..codecs import LOSSY_CODECS, get_codec
from ..devices import host_is_separate
from ..runtime import bound_decisions, relu_signs
from ..runtime.bound_decisions import Bounds
from ..runtime.pool_decisions import pool_at_
from .instrumented_step import timer
from .live_bytes import LiveBytes, allocation_bytes
from .tensor_specs import PoolSample, TensorSpec


class _KeepCost(NamedTuple):
    """Keeping one input by one codec: bytes kept, rises of live bytes, seconds."""

    kept: int
    encode_rise: int
    decode_rise: int
    encode_s: float
    decode_s: float
    to_host_s: float
    to_device_s: float


class CodecCosts:
    """Bytes and seconds of keeping an input of a given shape by each codec, measured
    once per distinct (shape, dtype): encode, decode, and on CUDA the copies to a
    pinned host buffer and back. Medians of a few repeats. Tensors are made on
    ``tensors`` (meta: sizes only, no seconds); bytes are counted as on ``device``."""

    _REPEATS = 3

    def __init__(self, tensors: torch.device, device: torch.device):
        self.tensors = tensors
        self.device = device
        self.timed = tensors.type != "meta"
        self._by_shape = {}
        self._restore_rises = {}
        self._pool_restore_rises = {}
        self._sign_rises = {}
        self._bound_rises = {}  # (elements, restore) -> rise

    def of(self, spec: TensorSpec) -> dict:
        """{codec: _KeepCost}; a leaf or non-float input is kept as it is by every codec."""
        if not spec.encodable:
            kept = allocation_bytes(spec.storage_bytes, self.device)
            return {codec: _KeepCost(kept, 0, 0, 0.0, 0.0, 0.0, 0.0) for codec in ("none", *LOSSY_CODECS)}
        key = (spec.shape, spec.dtype)
        if key not in self._by_shape:
            self._by_shape[key] = {codec: self._measure(codec, spec) for codec in ("none", *LOSSY_CODECS)}
        return self._by_shape[key]

    def _measure(self, codec_name: str, spec: TensorSpec) -> _KeepCost:
        sample = torch.randn(spec.shape, device=self.tensors).to(spec.dtype)
        codec = get_codec(codec_name)
        tracker = LiveBytes(self.device, known=[sample])
        with tracker:
            with tracker.span() as encode_rise:
                packed = codec.encode(sample)
            with tracker.span() as decode_rise:
                codec.decode(packed)
        # The exact codec keeps the input's own storage, which may be larger than a sample.
        kept = allocation_bytes(spec.storage_bytes, self.device) if codec_name == "none" else sum(
            allocation_bytes(t.untyped_storage().nbytes(), self.device) for t in packed.tensors().values())
        encode_s = self._seconds(lambda: codec.encode(sample))
        decode_s = self._seconds(lambda: codec.decode(packed))
        return _KeepCost(kept, encode_rise[0], decode_rise[0], encode_s, decode_s, *self._copy_seconds(packed))

    def _seconds(self, work) -> float:
        if not self.timed:
            return 0.0
        runs = []
        for _ in range(self._REPEATS):
            with timer(self.device) as elapsed:
                work()
            runs.append(elapsed[0])
        return statistics.median(runs)

    def _copy_seconds(self, packed) -> tuple:
        if not host_is_separate(self.device) or not self.timed:
            return 0.0, 0.0
        parts = list(packed.tensors().values())
        hosts = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in parts]
        to_host = self._seconds(lambda: [h.copy_(t, non_blocking=True) for h, t in zip(hosts, parts)])
        to_device = self._seconds(lambda: [h.to(self.device, non_blocking=True) for h in hosts])
        return to_host, to_device

    def relu_restore_rise(self, elements: int) -> int:
        """The rise of live bytes while a lossy recompute re-imposes the forward's
        decisions on a ReLU output of ``elements`` elements (runtime/relu_signs.py)."""
        if elements == 0:
            return 0
        if elements not in self._restore_rises:
            output = torch.relu(torch.randn(elements, device=self.tensors))
            bits = relu_signs.pack_signs(output)
            relu_signs.restore_decisions_(output, bits)  # the tables a restore keeps, made before measuring
            tracker = LiveBytes(self.device, known=[output, bits])
            with tracker, tracker.span() as rise:
                relu_signs.restore_decisions_(output, bits)
            self._restore_rises[elements] = rise[0]
        return self._restore_rises[elements]

    def bound_restore_rise(self, elements: int) -> int:
        """The rise of live bytes while a lossy recompute moves a Hardtanh's or
        LeakyReLU's save of ``elements`` elements to the forward's decisions (NOTE
        [ Bound decisions ])."""
        return self._bound_rise(elements, restore=True)

    def bound_keep_rise(self, elements: int) -> int:
        """The rise of live bytes while those decisions are kept as bits, the bits included."""
        return self._bound_rise(elements, restore=False)

    def _bound_rise(self, elements: int, restore: bool) -> int:
        if elements == 0:
            return 0
        if (elements, restore) not in self._bound_rises:
            bounds = Bounds(0.0, 6.0)
            save = torch.randn(elements, device=self.tensors)
            bits = bound_decisions.keep(save, bounds)
            tracker = LiveBytes(self.device, known=[save, bits])
            with tracker, tracker.span() as rise:
                if restore:
                    bound_decisions.restore_(save, bits, bounds)
                else:
                    bound_decisions.keep(save, bounds)
            self._bound_rises[elements, restore] = rise[0]
        return self._bound_rises[elements, restore]

    def pool_restore_rise(self, pools: list) -> int:
        """The largest rise of live bytes while a lossy forward keeps a max pool's
        decisions or its recompute pools at them (runtime/pool_decisions.py), over a
        layer's max pools (``PoolSample`` s). The memory model charges it to the
        recompute, whose event holds all the forward's and more (memory_model.py):
        keeping takes more than restoring (an int64 temporary per window)."""
        return max((self._pool_restore_rise(pool) for pool in pools), default=0)

    def _pool_restore_rise(self, pool: "PoolSample") -> int:
        if pool not in self._pool_restore_rises:
            window, dims = pool.window, len(pool.window.kernel)
            planes = math.prod(pool.indices_shape[:-dims])  # as channels of one unbatched input
            x = torch.randn(planes, *pool.input_size, device=self.tensors)
            max_pool = getattr(torch.nn.functional, f"max_pool{dims}d")
            pooled, indices = max_pool(x, window.kernel, window.stride, window.padding, window.dilation,
                                       window.ceil_mode, return_indices=True)
            # The tables the implementations keep (triton_kernels/decisions/), made
            # before measuring: they outlive every call, and an earlier call may have made them.
            window.decode_into_(indices, window.encode(indices, pool.input_size), pool.input_size)
            tracker = LiveBytes(self.device, known=[x, pooled, indices])
            with tracker:
                with tracker.span() as encode_rise:
                    packed = window.encode(indices, pool.input_size)
                with tracker.span() as restore_rise:
                    window.decode_into_(indices, packed, pool.input_size)
                    pool_at_(pooled, x, indices, dims)
            self._pool_restore_rises[pool] = max(encode_rise[0], restore_rise[0])
        return self._pool_restore_rises[pool]

    def relu_sign_rise(self, elements: int) -> int:
        """The rise of live bytes while the decisions of a ReLU output of ``elements``
        elements are packed into bits (runtime/relu_signs.py), the bits included."""
        if elements not in self._sign_rises:
            output = torch.relu(torch.randn(elements, device=self.tensors))
            tracker = LiveBytes(self.device, known=[output])
            with tracker, tracker.span() as rise:
                relu_signs.pack_signs(output)
            self._sign_rises[elements] = rise[0]
        return self._sign_rises[elements]

    def sign_bytes(self, elements: int) -> int:
        """The bits a ReLU output of ``elements`` elements keeps its decisions in."""
        return allocation_bytes(-(-elements // 8), self.device)

