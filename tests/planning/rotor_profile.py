"""actsave's profile in the rotor reference's model (rotor_reference.py), and actsave's
plans as the reference's plan trees: what the planner is compared against.

The mapping, layer i of the profile = stage i of the chain (sizes in bytes, then
converted to integer units, see below):

    act[0]        the chain input X (held by the caller, as in actsave's peak X + ...).
    act[i], i>0   the layer's input as it is allocated (input_bytes): what a checkpoint
                  at i keeps, and the size of its gradient d_i.
    act[n]        0: the output is never a checkpoint, and it and its gradient are what
                  the caller holds through the backward, ``held`` below.
    saved[i]      abar_i: the layer's output act[i+1], plus the storages the layer is the
                  first to save for backward, less its input (the previous stage's output,
                  so counted there) and less its output (counted once). The profile
                  attributes a storage to its first saver and actsave's model frees it
                  after that layer's backward (Saved(a, i) counts storages with
                  first <= i), as rotor frees abar_i after B(i).
    fwd_overhead  forward_rise - saved[i]: Fs(i) peaks at its live bytes + the layer's
                  measured forward rise (actsave's stored-forward event), Fn(i) at
                  act[i+1] + that overhead.
    bwd_overhead  backward_rise - act[i]: B(i) allocates d_i = act[i] and peaks at the
                  measured rise, which includes the input gradient.
    held          output_bytes + output_grad_bytes: actsave's O, held from the first
                  backward operation to the end; the output is left out of the saves of
                  the layer that saves it (actsave's "O less the output where Saved
                  counts it").
    times         forward_s, backward_s: both models charge a checkpointed segment one
                  more forward of its layers.

Where the models differ (rotor's peak is then the larger unless a row says otherwise;
measured over every single-level plan of 80 random chains of tests/planning/chains.py,
rotor's peak is never below actsave's prediction, and 2-50% above it on the bench-like
chains):

- rotor keeps a stage's output a_{i+1} in abar_i until B(i). actsave's runtime frees it
  earlier when layer i does not save it: after layer i+1's backward when layer i+1
  saves it (a Linear's input), after layer i+1's forward when no layer saves it (the
  input of a ReLU, which saves its output). Rotor then counts a_{i+1} through the
  events in between. The models coincide on chains whose every layer saves its own
  output (e.g. blocks ending in Tanh, Sigmoid or a non-in-place ReLU).
- rotor keeps a checkpointed segment's input through its recompute and backward;
  actsave frees it once no layer holds it, and a segment that saves nothing keeps
  nothing.
- actsave's recompute stops at the segment's last saved tensor (runtime/function.py);
  rotor recomputes every stage of the segment, its output included.
- actsave leaves out the forward events of checkpointed segments (each at most the
  same layer's recompute event); rotor checks them (Fn). They never set the peak when
  the recompute event holds at least what the forward does.
- Not in rotor's model (actsave's events are then the larger): the private copy kept for
  a segment that starts with an in-place layer (Q), storages saved by layers further
  apart than neighbours and counted again on both sides of a boundary.
- An in-place layer's output is its input's storage: rotor counts it twice (as the
  previous stage's output and as this one's).
- Codecs, ReLU sign bits and offload: rotor has none; the comparison allows recompute
  only (plan(..., allow=("recompute",))).

Units: sizes are converted to integers of ``unit`` bytes, every composed term rounded
the same way: ``"up"`` (ceil) makes every event of a plan at least its bytes, so a
rotor plan that fits floor(B / unit) units fits B bytes and its time is an upper bound
of rotor's optimum at B; ``"down"`` (floor) makes every event at most its bytes, a
relaxation whose time is a lower bound. Where both agree, rounding changed nothing.
With ``unit`` a divisor of every byte count (:func:`exact_unit`) the two are equal.
"""
from __future__ import annotations

import dataclasses
import math
from functools import reduce

import torch
from planning.rotor_reference import RotorChain
from torch import nn

import actsave
from actsave.planning.checkpoint_host import NO_HOST_WORK

# Activations that save their output: chains of Linear + one of them are where the two
# models coincide (module docstring).
ACTIVATIONS = {"tanh": nn.Tanh, "sigmoid": nn.Sigmoid, "relu": nn.ReLU}


def output_saving_chain(widths: list, activation: str) -> nn.Sequential:
    """Blocks Linear + an activation that saves its output: each layer saves its own
    output (and its Linear reads the previous one's), where the two models coincide."""
    torch.manual_seed(0)
    blocks, width = [], 32
    for out in widths:
        blocks.append(nn.Sequential(nn.Linear(width, out), ACTIVATIONS[activation]()))
        width = out
    return nn.Sequential(*blocks)


ROUNDINGS = {"up": lambda nbytes, unit: -(-int(nbytes) // unit), "down": lambda nbytes, unit: int(nbytes) // unit}


def chain_bytes(profile: actsave.Profile) -> dict:
    """The rotor chain's terms in bytes (module docstring), before any rounding:
    ``act`` (n + 1), ``saved``, ``forward_rise``, ``backward_rise`` (n each), ``held``."""
    layers, n = profile.layers, len(profile.layers)
    act = [profile.input_bytes, *(layer.input_bytes for layer in layers[1:]), 0]
    saved = []
    for i, layer in enumerate(layers):
        own = sum(s.nbytes for s in profile.saved if s.first == i)
        if layer.input_saved_by is not None and layer.input_saved_by[0] == i:
            own -= layer.input_bytes
        output_saved_by = layers[i + 1].input_saved_by if i + 1 < n else profile.output_saved_by
        output_bytes = layers[i + 1].input_bytes if i + 1 < n else profile.output_bytes
        if output_saved_by is not None and output_saved_by[0] == i and not layer.modifies_input:
            own -= output_bytes  # (an in-place layer's output is its input's storage, left out above)
        saved.append(act[i + 1] + own)
    return {"act": act, "saved": saved, "forward_rise": [layer.forward_rise for layer in layers],
            "backward_rise": [layer.backward_rise for layer in layers],
            "held": profile.output_bytes + profile.output_grad_bytes}


def profile_without_host_work(model, example_inputs) -> actsave.Profile:
    """``actsave.profile`` as rotor's model sees a chain: without the runtime's host work
    per checkpointed call and save (planning/checkpoint_host.py), which rotor has no
    term for."""
    return dataclasses.replace(actsave.profile(model, example_inputs), checkpoint_host=NO_HOST_WORK)


def without_module_state(profile: actsave.Profile) -> actsave.Profile:
    """``profile`` as rotor's model sees a chain: without the snapshot of module state
    (BatchNorm's statistics) a checkpointed segment keeps (LayerProfile.mutated_state_bytes),
    which rotor has no term for."""
    layers = tuple(dataclasses.replace(layer, mutated_state_bytes=0) for layer in profile.layers)
    return dataclasses.replace(profile, layers=layers)


def exact_unit(profile: actsave.Profile) -> int:
    """The largest unit dividing every byte count of the chain: no rounding at all."""
    terms = chain_bytes(profile)
    values = [*terms["act"], *terms["saved"], *terms["forward_rise"], *terms["backward_rise"], terms["held"]]
    return reduce(math.gcd, (int(v) for v in values if v), 0) or 1


def rotor_chain_from_profile(profile: actsave.Profile, unit: int, rounding: str = "up") -> RotorChain:
    """The profiled chain in rotor's model, sizes in units of ``unit`` bytes rounded
    ``rounding`` ("up" or "down"; module docstring, "Units")."""
    if rounding not in ROUNDINGS:
        raise ValueError(f"rounding={rounding!r} must be one of {list(ROUNDINGS)}")
    to_units = ROUNDINGS[rounding]
    terms = chain_bytes(profile)
    act = tuple(to_units(v, unit) for v in terms["act"])
    saved = tuple(to_units(v, unit) for v in terms["saved"])
    return RotorChain(
        fwd_time=tuple(layer.forward_s for layer in profile.layers),
        bwd_time=tuple(layer.backward_s for layer in profile.layers),
        act=act,
        saved=saved,
        fwd_overhead=tuple(to_units(rise, unit) - s for rise, s in zip(terms["forward_rise"], saved)),
        bwd_overhead=tuple(to_units(rise, unit) - a for rise, a in zip(terms["backward_rise"], act)),
        held=to_units(terms["held"], unit),
    )


def rotor_plan_of(plan: actsave.Plan) -> tuple:
    """An actsave plan (single level) as a rotor plan tree: each checkpointed segment
    recomputed with its saves, each stored one (the last among them) run with its saves."""
    if any(option is not None and (option.lossy or option.offload) for _, _, option in plan.segments):
        raise ValueError(f"rotor's model has no codec or offload: plan {plan.codecs}, {plan.offload}")
    return tuple((a, b, None if option is None else ((a, b, None),)) for a, b, option in plan.segments)


def is_single_level(tree: tuple) -> bool:
    """Whether a rotor plan tree is one actsave can express: checkpointed runs whose
    recompute stores every stage, and stored runs, the last among them."""
    *before_last, (_, _, last) = tree
    return last is None and all(inner is None or (len(inner) == 1 and inner[0][2] is None)
                                for _, _, inner in before_last)


def nesting_depth(tree: tuple) -> int:
    """0 for a plan without checkpoints, 1 for single-level checkpoints, ..."""
    return max((1 + nesting_depth(inner) for _, _, inner in tree if inner is not None), default=0)
