"""FSDP2's gathered parameters in a plan: how many bytes each layer's units gather
(:func:`gathered_bytes`), and what a step without FSDP2's hooks leaves out of a
profile's rises (:func:`with_plain_step_gathers`).

NOTE [ Gathered parameters ]
FSDP2 (``fully_shard``) keeps each unit's parameters sharded and gathers them whole
around the unit's use. In a training step (``FSDPParamGroup``, torch 2.11 to 2.13):

- forward: a unit is gathered before its forward and resharded after it (the
  default, ``reshard_after_forward``, for every unit but the root);
- backward: a unit is gathered before its backward, which also gathers the unit
  before it in forward order (a prefetch); after its backward it is resharded and its
  gradients are copied into a reduce-scatter input, kept until the next unit's
  reduce-scatter (one in flight);
- a recompute: a forward that runs inside the backward does not reshard
  (``post_forward``: ``if not is_bw()``), so every unit a checkpointed segment
  recomputes stays gathered until its own backward.

A layer's gathered bytes are the whole size, in the unit's ``param_dtype``, of the
sharded parameters managed by units at or inside the layer. A profile's step on device
tensors runs FSDP2's hooks, so its rises hold the first two kinds as that step does; a
profile on meta tensors runs without them (meta.on_meta), so
:func:`with_plain_step_gathers` adds them to its layers' rises: the layer's units
while it runs forward, and while it runs backward those units, the nearest earlier
gathering layer's (the prefetch) and the nearest later one's reduce-scatter input. The
memory model adds the third kind (layer_events.py): in a checkpointed segment [a, b)
layer i's recompute holds the units of layers a .. i-1 too, and its backward those of
a .. i-1 but the prefetched layer's, which its rise holds.

Not counted: the units that manage parameters of several layers (the root's), which
stay gathered for the whole step, their gradients accumulating through the backward;
a unit that does not reshard after its forward; the all-gather's staging buffer,
alive beside the gathered parameters while they are copied out; a backend's own
copies (gloo's reduce-scatter copies its input); the last layer's units, gathered by
its backward before a checkpointed segment's recompute reaches them.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch
from torch import nn

from .._torch import fsdp_param_dtype, is_fsdp_unit, is_sharded
from .live_bytes import allocation_bytes


def gathered_bytes(layer: nn.Module, device: torch.device) -> int:
    """The allocation bytes on ``device`` of the parameters that FSDP2 units at or
    inside ``layer`` gather for its forward (NOTE [ Gathered parameters ]); 0
    without FSDP2."""
    seen: set = set()

    def walk(module: nn.Module, dtype: Optional[torch.dtype], in_unit: bool) -> int:
        if is_fsdp_unit(module):
            in_unit, dtype = True, fsdp_param_dtype(module)
        total = 0
        for p in module._parameters.values():
            if p is None or id(p) in seen or not (in_unit and is_sharded(p)):
                continue
            seen.add(id(p))
            total += allocation_bytes(p.numel() * (dtype or p.dtype).itemsize, device)
        return total + sum(walk(child, dtype, in_unit) for child in module.children())

    return walk(layer, None, False)


def with_plain_step_gathers(layers: list) -> list:
    """``layers`` (LayerProfiles of a step that ran without FSDP2's hooks) with the
    gathered parameters a plain step holds added to their rises (NOTE [ Gathered
    parameters ]): a layer's own units while its forward runs; while its backward
    runs, its own, the prefetched ones (:func:`prefetched_layers`) and the
    reduce-scatter input of the nearest later gathering layer."""
    gathered = [layer.gathered_bytes for layer in layers]
    following = _nearest_earlier(gathered[::-1])[::-1]
    out = []
    for layer, own, source, after in zip(layers, gathered, prefetched_layers(gathered), following):
        prefetch = gathered[source] if source >= 0 else 0
        if own or prefetch or after:
            layer = dataclasses.replace(
                layer,
                forward_rise=layer.forward_rise + own,
                forward_rise_to_last_save=layer.forward_rise_to_last_save + own,
                no_grad_rise=layer.no_grad_rise + own,
                backward_rise=layer.backward_rise + own + prefetch + after)
        out.append(layer)
    return out


def prefetched_layers(gathered: list) -> list:
    """For each layer (``gathered``: each layer's gathered bytes), the layer whose
    units are gathered ahead while its backward runs, or -1: the nearest earlier
    gathering layer, prefetched by this layer's units or a later layer's (so none
    after the last gathering layer)."""
    last = max((i for i, g in enumerate(gathered) if g), default=-1)
    out, earlier = [], -1
    for i, g in enumerate(gathered):
        out.append(earlier if g or i < last else -1)
        if g:
            earlier = i
    return out


def _nearest_earlier(gathered: list) -> list:
    """For each layer, the gathered bytes of the nearest earlier layer that gathers
    any; 0 before the first."""
    out, last = [], 0
    for g in gathered:
        out.append(last)
        last = g or last
    return out


__all__ = ["gathered_bytes", "prefetched_layers", "with_plain_step_gathers"]
