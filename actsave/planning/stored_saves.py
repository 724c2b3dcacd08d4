"""What a plain segment's saves cost under each lossy codec (:class:`StoredSaves`),
priced from the byte-counting step's record of its saves (instrumented_step.py,
``SavesAsStored``) and each save shape's codec costs (codec_costs.py), with no step
of its own. The memory model's stored events read it (memory_model.py).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import numpy as np

from ..codecs import LOSSY_CODECS
from .codec_costs import CodecCosts
from .instrumented_step import CountedStep
from .live_bytes import allocation_bytes
from .saves_as_stored import StoredEntry


@dataclass(frozen=True)
class StoredTensor:
    """One tensor of the profiled step's saves as a plain segment whose saves a lossy
    codec keeps stores it (runtime/kept_saves.py): a floating-point save autograd
    made (keep_rules.should_encode) by the codec, once per ``stored_once_key``, else held as
    it is, once per storage. A ReLU output keeps its decisions, one bit per element,
    where the segment made it: where its first save is in the segment (relu_signs.py,
    made_by_segment_relu; an earlier save means it is the segment's input)."""

    first: int  # the first and last layer saving it
    last: int
    kept_bytes: dict  # lossy codec -> bytes kept: the encoding and the ReLU bits, or the storage held as it is
    sign_bytes: int  # the ReLU bits among kept_bytes
    encode_s: dict  # lossy codec -> seconds encoding it once


@dataclass(frozen=True)
class StoredSaves:
    """A plain segment's saves kept by each lossy codec, derived from the profiled step
    (no step of its own): the tensors as stored, and per layer what encoding and decoding
    its saves adds. Byte and second values come from encoding and decoding a sample of
    each save's shape (as for layer inputs); the memory model's stored events read them
    (memory_model.py, "stored [s, n), saves kept by k")."""

    tensors: tuple  # of StoredTensor
    # Per layer, {codec: the layer's rise of live bytes while it encodes one of its saves,
    # beyond what stays}: the rise as the save was made in the profiled step, plus
    # the encoding's temporaries.
    encode_rise: tuple
    # Per layer, {codec: its backward's rise while one of its autograd nodes decodes its
    # saves}: the rise as the node started in the profiled step, plus the node's saves
    # decoded and one decoding's temporaries.
    decode_rise: tuple
    # Per layer, {codec: its backward's rise, its nodes' decoded saves included}: the
    # profiled rise of each stretch of it, plus what the codec would not have freed of
    # the saves the step freed before the stretch ended, plus its node's decoded saves.
    backward_rise: tuple
    decode_s: tuple  # per layer, {codec: seconds decoding its saves, once per save}
    input_held_by: tuple  # per layer, (first, last) layer holding its input's storage as a save as it is, or None
    output_held_by: Optional[tuple]  # the same for the chain output


def price_stored_saves(found: CountedStep, costs: CodecCosts) -> StoredSaves:
    """What a plain segment's saves cost under each lossy codec, from the profiled
    step's record of them and each save shape's codec costs (no step of its own).

    Encoding runs as a save is made (at most once per stored tensor), one at a time: a
    save made when the layer's live bytes had risen by r in the profiled step is
    charged r plus its encoding's temporaries; the packed bytes are in Saved_k. In
    backward each autograd node decodes its saves as it starts, and they live until
    it ends: a node that started at a rise of d is charged d plus its decoded saves
    and one decoding's temporaries, and the stretch of the layer's backward from it
    to the next such node its highest rise plus its decoded saves (memory_model.py).
    Both hold the profiled step's tensors as if the codec freed none, so they bound
    the codec's step from above; but where the step freed a save the codec encodes
    (its last node done), it freed the whole tensor, and the codec only its encoding:
    what that leaves is added back, from the saves freed before the node started
    (decoding) or before its stretch ended (the stretch's rise). A ReLU output's
    decisions are counted as restored at every decode; a max pool's indices are kept
    as its window decisions, whatever the codec, and restored to int64 at decode."""
    recorded, n = found.as_stored, len(found.inputs)
    encode_rise = [dict.fromkeys(LOSSY_CODECS, 0) for _ in range(n)]
    decode_s = [dict.fromkeys(LOSSY_CODECS, 0.0) for _ in range(n)]
    for key, layer, rise in recorded.saves:
        entry = recorded.entries[key]
        if entry.coded:
            for codec in LOSSY_CODECS:
                encoding = rise + _encode_extra(entry, codec, costs)
                encode_rise[layer][codec] = max(encode_rise[layer][codec], encoding)
                decode_s[layer][codec] += 0.0 if entry.pool is not None else costs.of(entry.spec)[codec].decode_s
    tensors = {key: _stored_tensor(entry, costs) for key, entry in recorded.entries.items()}
    decode_rise, backward_rise = _backward_rises(found, costs, tensors)
    return StoredSaves(
        tensors=tuple(tensors.values()),
        encode_rise=tuple(encode_rise), decode_rise=tuple(decode_rise),
        backward_rise=tuple(backward_rise), decode_s=tuple(decode_s),
        input_held_by=tuple(span if as_it_is else None
                            for as_it_is, span in zip(found.inputs_saved_as_they_are, found.input_saved_by)),
        output_held_by=None if found.output_encodable else found.output_saved_by,
    )


def _stored_tensor(entry: StoredEntry, costs: CodecCosts) -> StoredTensor:
    decided = entry.relu or entry.bounded
    signs = costs.sign_bytes(math.prod(entry.spec.shape)) if decided and entry.spec.encodable else 0
    return StoredTensor(first=entry.first, last=entry.last,
                        kept_bytes={codec: _kept(entry, codec, costs) + signs for codec in LOSSY_CODECS},
                        sign_bytes=signs,
                        encode_s={codec: 0.0 if entry.pool is not None else costs.of(entry.spec)[codec].encode_s
                                  for codec in LOSSY_CODECS})


def _kept(entry: StoredEntry, codec: str, costs: CodecCosts) -> int:
    """What the codec keeps of the tensor: a max pool's indices as its window's
    decisions (every codec alike), else as the codec encodes it."""
    if entry.pool is not None:
        return allocation_bytes(entry.pool.window.packed_bytes(math.prod(entry.spec.shape)), costs.device)
    return costs.of(entry.spec)[codec].kept


def _encode_extra(entry: StoredEntry, codec: str, costs: CodecCosts) -> int:
    """The rise while a save is stored (encoded, then its ReLU bits packed; a max
    pool's indices packed as decisions, charged the larger of packing and restoring
    them: CodecCosts.pool_restore_rise), beyond what stays."""
    kept = _kept(entry, codec, costs)
    if entry.pool is not None:
        return max(0, costs.pool_restore_rise([entry.pool]) - kept)
    rise = costs.of(entry.spec)[codec].encode_rise
    if entry.relu or entry.bounded:
        elements = math.prod(entry.spec.shape)
        keeping = costs.bound_keep_rise(elements) if entry.bounded else costs.relu_sign_rise(elements)
        rise, kept = max(rise, kept + keeping), kept + costs.sign_bytes(elements)
    return max(0, rise - kept)


def _decode_rise(entry: StoredEntry, codec: str, costs: CodecCosts) -> int:
    """The rise while a save is decoded (and its ReLU decisions restored; a max pool's
    indices restored from its decisions), the decoded tensor included."""
    if entry.pool is not None:
        return allocation_bytes(entry.spec.dense_bytes, costs.device) + costs.pool_restore_rise([entry.pool])
    rise = costs.of(entry.spec)[codec].decode_rise
    if entry.relu or entry.bounded:
        dense, elements = allocation_bytes(entry.spec.dense_bytes, costs.device), math.prod(entry.spec.shape)
        restore = costs.bound_restore_rise(elements) if entry.bounded else costs.relu_restore_rise(elements)
        rise = max(rise, dense + restore)
    return rise


def _backward_rises(found: CountedStep, costs: CodecCosts, tensors: dict) -> tuple:
    """(decode_rise, backward_rise) of StoredSaves: per layer, {codec: the rise}, from
    the stretches of the layers' backward (saves_as_stored.py, SavesAsStored);
    ``tensors``: the StoredTensor of each entry, by key."""
    recorded = found.as_stored
    decode_rise = [dict.fromkeys(LOSSY_CODECS, 0) for _ in found.backward_rise]
    # [codec][j]: what the codec would not have freed of the first j storages the step freed.
    unfreed = {codec: np.cumsum([0] + [max(0, nbytes - sum(tensors[key].kept_bytes[codec] for key in keys))
                                       for nbytes, keys in recorded.freed])
               for codec in LOSSY_CODECS}
    # Each layer's own rise where no stretch of it was seen (no saves, or its backward
    # began elsewhere).
    backward_rise = [dict.fromkeys(LOSSY_CODECS, rise) for rise in found.backward_rise]
    for stretch in recorded.stretches:
        layer = stretch.layer
        entries = [recorded.entries[recorded.saves[save][0]] for save in stretch.saves]
        entries = [entry for entry in entries if entry.coded]
        dense = [allocation_bytes(entry.spec.dense_bytes, costs.device) for entry in entries]
        # A stretch whose layer's start was not seen (its backward began elsewhere) is
        # charged the layer's whole backward rise.
        started_at = found.backward_rise[layer] if stretch.started_at is None else stretch.started_at
        highest = found.backward_rise[layer] if stretch.highest is None else stretch.highest
        first, last = stretch.freed_before
        for codec in LOSSY_CODECS:
            left = int(unfreed[codec][last] - unfreed[codec][first])
            if stretch.decodes:
                temporaries = max((_decode_rise(entry, codec, costs) - size for entry, size in zip(entries, dense)),
                                  default=0)
                decode_rise[layer][codec] = max(decode_rise[layer][codec], started_at + left + sum(dense) + temporaries)
            backward_rise[layer][codec] = max(backward_rise[layer][codec], highest + left + sum(dense))
    return decode_rise, backward_rise
