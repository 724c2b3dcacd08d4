"""Checkpointed calls that Dynamo meets: an exact one becomes torch's checkpoint in the
compiled graph, any other runs eagerly at a graph break of its own, with one warning.
function.py's checkpointed_call routes each call here before its eager path.
"""
from __future__ import annotations

import warnings
from typing import Callable, Optional

import torch

from .._torch import fsdp_shards
from .._torch_graphs import dynamo_compiles_callees, is_compiled
from . import graph_codecs
from .keep_rules import KeepPolicy
from .layers import known_layers
from .recompute_options import RecomputeOptions


# NOTE [ torch.compile ]
# Dynamo must not trace actsave's checkpointed call. It would inline the bookkeeping
# and guard on global state that the same frame changes (every kept input registers a
# weakref.finalize, and Dynamo guards on the finalize registry's size), and a forward
# it traced with the saved-tensor hooks active saves other tensors than the eager
# recompute does. So a call Dynamo meets becomes torch's checkpoint where it is exact
# (NOTE [ Checkpoints in a compiled graph ]), and is otherwise disabled: a graph break
# that runs eagerly, forward and recompute alike. checkpointed_call routes every call
# Dynamo meets so, before the eager path: that path carries no disable wrapper of its
# own, whose entry and exit every eager segment would pay in host time. To keep
# codecs and offload with compiled code, compile the layers and then checkpoint them:
# forward and recompute then run the same code (NOTE [ Decisions in compiled layers ]
# says when that is the eager code).
#
# Compiled layers run eagerly in the planner's steps, on the planning thread only
# (isolated_steps in planning/step_isolation.py; _torch.py,
# NOTE [ Compiled code run eagerly on one thread ]), and torch.compile's modules are
# profiled as their eager ones: those steps run on meta tensors under module hooks,
# where Dynamo would compile graphs no training step uses, recompile at each layer
# until its limit and warn of the hooks. The plan then counts the eager code's saves,
# which a compiled layer's may differ from.


# NOTE [ Checkpoints in a compiled graph ]
# Where Dynamo traces a checkpointed call (torch.compile over a CheckpointedSequential
# or over a model with wrapped blocks), an exact one becomes torch's own checkpoint:
# Dynamo turns torch.utils.checkpoint into a higher-order op whose region the compiled
# backward recomputes, so the forward stays one graph. The region is the same as
# actsave's (the segment, the block); the compiled graph, not actsave, then decides
# what the region saves, so no kept bytes are reported (None). A call that keeps its
# input by a codec or on the host runs eagerly instead (a graph break, with one
# warning): the offload copies are not ops a compiled graph can hold, and a codec is
# held only where a whole CheckpointedSequential, or the root of a model whose blocks
# wrap() checkpointed, sets saved-tensor hooks around the graph (NOTE [ Codecs in a
# compiled graph ] in graph_codecs.py), which a single call could do only at a break
# of its own. A CheckpointedSequential with a layer set to keep on the host, or whose
# lossy segments make decisions, runs its whole forward eagerly instead, as one graph
# break (sequential.py), however many segments keep so.
# NOTE [ torch.export ]
# An exported program is the model's forward: what a backward keeps is no part of it
# (a training export makes its joint graph later, from that forward, and chooses what
# to save then). So under torch.export every actsave checkpoint runs its function as it
# is, traced without actsave's hooks and wrappers (which hold tensors that export's
# fake ones stand for), as non-strict export traces torch's own checkpoint: its region
# inlined, untagged (strict export fails on torch's, torch 2.13). The exported program
# keeps nothing of actsave's: wrap the module it gives back to train it with actsave.
# So does torch.jit.trace (TorchScript, ONNX's TorchScript exporter), which records the
# forward it runs, grad mode or not, and would record a checkpoint's bookkeeping in it.
# Checked where a call chooses its path: keep_modes.call_block, wrappers.Checkpoint,
# CheckpointedSequential.forward and a wrapped model's root forward (graph_codecs.py).


def compiles_in_graph(policy: KeepPolicy) -> bool:
    """Whether a checkpoint keeping its input by ``policy`` becomes torch's checkpoint
    in a compiled graph: it keeps it exactly, on the device. Judged by value: a
    deep-copied model has codec objects of its own."""
    return not policy.lossy and not policy.offload


def checkpoint_in_graph(function, args: tuple, kwargs: dict, options: RecomputeOptions, context_fn=None,
                        eager_call: Optional[Callable] = None, eager_args: tuple = ()):
    """``function(*args, **kwargs)`` as torch's non-reentrant checkpoint with the
    same recompute options, for a trace: NOTE [ Checkpoints in a compiled graph ].
    ``context_fn``: torch's, for a selective checkpoint (keep_modes.py).
    ``eager_call(function, args, kwargs, *eager_args)``: actsave's eager path, run
    (returning ``(output, kept bytes)``) where Dynamo cannot trace the checkpoint:
    NOTE [ A checkpoint Dynamo cannot trace ]."""
    if eager_call is None:
        extra = {} if context_fn is None else {"context_fn": context_fn}
        return torch.utils.checkpoint.checkpoint(
            function, *args, use_reentrant=False, preserve_rng_state=options.preserve_rng_state,
            determinism_check=options.determinism_check, debug=options.debug, **extra, **kwargs)
    return _checkpoint_or_eagerly(function, args, kwargs, options, context_fn, eager_call, eager_args)


def _torch_checkpoint(function, args, kwargs, options, context_fn, eager_call, eager_args):
    """What Dynamo traces in place of :func:`_checkpoint_or_eagerly`: torch's
    checkpoint (NOTE [ A checkpoint Dynamo cannot trace ])."""
    return checkpoint_in_graph(function, args, kwargs, options, context_fn)


# NOTE [ A checkpoint Dynamo cannot trace ]
# Dynamo traces torch's checkpoint as a higher-order op only where it can trace the
# block's forward whole: no graph break (a print, an .item(), a branch on a tensor's
# value) and no side effect it cannot undo (a Python attribute the forward sets).
# Elsewhere it breaks the graph at the call and runs torch.utils.checkpoint eagerly,
# whose recompute runs the forward again on the state the forward left: BatchNorm's
# statistics updated twice, a count read at another value; actsave's eager path lets
# neither happen (NOTE [ State a forward reads and mutates ], NOTE [ Python attributes a forward sets ]).
# So a checkpoint in a graph is a call of _checkpoint_or_eagerly, a disabled function
# that runs actsave's eager path, which Dynamo traces as _torch_checkpoint instead
# (torch.compiler.substitute_in_graph). Where the checkpoint traces, the graph holds it
# as before; where it does not, Dynamo breaks the graph at the call of the disabled
# function itself (restarting each frame above it, as at any graph break inside an
# inlined call), which then runs: actsave's eager path, at a graph break of its own.
# A parameter the forward changes in place is no graph break: the graph recomputes it
# changed, as torch's checkpoint does (docs/limits.md, "torch.compile").
@torch.compiler.disable
def _checkpoint_or_eagerly(function, args, kwargs, options, context_fn, eager_call, eager_args):
    """Runs only where Dynamo could not trace :func:`_torch_checkpoint` in its place:
    actsave's eager path (NOTE [ A checkpoint Dynamo cannot trace ]), but for layers
    FSDP2 shards, whose gathers Dynamo's own fallback, torch's checkpoint, orders as the
    other ranks do (actsave's eager path there desynchronized two gloo ranks' collectives)."""
    if _sharded(function):
        return _torch_checkpoint(function, args, kwargs, options, context_fn, eager_call, eager_args)
    warn_eager_under_compile("a checkpoint whose forward Dynamo cannot trace whole", "a graph break at each such call",
                             "its forward breaks the graph or has a side effect, and torch's checkpoint run eagerly "
                             "would recompute it on the state its forward changed",
                             "Keep graph breaks and Python side effects out of the checkpointed block to compile it.")
    with graph_codecs.hooks_paused():
        return eager_call(function, args, kwargs, *eager_args)[0]


torch.compiler.substitute_in_graph(_checkpoint_or_eagerly)(_torch_checkpoint)


def _sharded(function) -> bool:
    layers = known_layers(function)
    return layers is not None and any(map(fsdp_shards, layers))


def out_of_dynamo(eager_path: Callable) -> Callable:
    """``eager_path``, disabled for Dynamo where it would compile the frames it calls:
    a checkpoint reached from a frame Dynamo ran eagerly (it skips each frame of a block
    whose forward sets a new Python attribute) is actsave's eager code, which Dynamo,
    compiling it frame by frame, failed on (a guard assertion at the store's weakref
    finalizers)."""
    return torch.compiler.disable(eager_path) if dynamo_compiles_callees() else eager_path


_warned_eager_under_compile = False


_COMPILE_INSTEAD = ("Exact checkpoints compile (NOTE [ Checkpoints in a compiled graph ]); or compile the blocks and "
                    "then checkpoint them, which keeps codecs, decisions and offload.")


def warn_eager_under_compile(what: str, breaks: str, why: str, instead: str = _COMPILE_INSTEAD) -> None:
    """The one warning per process that actsave runs ``what`` eagerly under
    torch.compile, with ``breaks`` (where the graph breaks), ``why``, and what to do
    ``instead``."""
    global _warned_eager_under_compile
    if _warned_eager_under_compile:
        return
    _warned_eager_under_compile = True
    warnings.warn(f"actsave: {what} runs eagerly under torch.compile ({breaks}): {why}. {instead}", stacklevel=4)


@torch.compiler.disable
def checkpointed_call_under_compile(eager_call: Callable, function, args, kwargs, policy, private_copy, options,
                                    made_by, eager_because):
    """A checkpointed call Dynamo met that does not compile (NOTE [ Checkpoints in a
    compiled graph ]): ``eager_call`` (function.py's eager path) at a graph break of
    its own, with the one warning."""
    kept = " and ".join(([] if policy.codec.lossless else [f"by {policy.codec.name}"])
                        + (["on the host"] if policy.offload else []))
    why = eager_because or ("offload is not an op a compiled graph holds" if policy.offload else
                            "a codec is held in a compiled graph only inside a CheckpointedSequential or wrapped "
                            "blocks, whose saved-tensor hooks are set around the graph")
    warn_eager_under_compile(f"a checkpoint that keeps its input {kept}", "a graph break at each such call", why)
    with graph_codecs.hooks_paused():
        return eager_call(function, args, kwargs, policy, private_copy, options, made_by)

def compiled_modules_advice(function: Callable, modules: Optional[list]) -> str:
    """What the error of a recompute that did not do its forward's work adds where
    ``function`` or its ``modules`` (``(index, module)`` pairs, None where not known)
    are compiled on their own: their recompute may run other compiled code than their
    forward did."""
    if not any(is_compiled(m) for m in (function, *(module for _, module in modules or ()))):
        return ""
    return (" It runs modules compiled on their own (module.compile(), torch.compile(module)), whose recompute can "
            "run other code than their forward (Dynamo past its recompile limit, torch._dynamo.config."
            "recompile_limit, runs new guards eagerly): compile the whole model instead (torch.compile(model)), or "
            "raise that limit.")
