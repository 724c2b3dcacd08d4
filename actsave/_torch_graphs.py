"""The private PyTorch APIs of compiled graphs that actsave touches, each behind a
feature check, as _torch.py keeps every other: AOTAutograd's saved-tensor hooks inlined
into its graphs (and the context that names the node a hook traces), FX annotations,
Dynamo's skipped frames and its caches, fake tensors, the module ``torch.compile`` returns.
runtime/graph_codecs.py and runtime/compiled_chain.py use the graphs'; a torch that
lacks one keeps codecs out of compiled graphs (graph_hooks_missing says which)."""
from __future__ import annotations

import contextlib
import importlib
import math
import operator
import re
from typing import Optional

import torch

from ._torch import _require
from .errors import ConfigError


# NOTE [ Saved-tensor hooks in a compiled graph ]
# AOTAutograd inlines the saved-tensor hooks active when it compiles into the graphs,
# where they are torch.fx.GraphModules (pytorch PR 150032): the pack hook after the
# forward's last use of each saved intermediate, the unpack hook before the backward's
# first, each traced with make_fx on the saved value's fake tensor. While it traces
# one, a private hook context (PR 166887) names the saved node and both graphs. Dynamo
# guards each compiled frame on the hooks' identity, so the same hook objects must be
# active at every call. A hook here is a GraphModule whose forward is replaced by a
# Python function that reads that context: the trace records the ops it runs for that
# node; called outside that trace (autograd calls it for what eager code saves while
# it is set), it finds no context and keeps the tensor as it is. Its nominal graph
# calls the function, an op AOTAutograd's cache cannot vouch for, so graphs compiled
# with it are never taken from that cache (whose key sees the hooks' graphs, not what
# the function does with the context).
def _optional_attribute(module_name: str, name: str):
    try:
        return getattr(importlib.import_module(module_name), name, None)
    except ImportError:
        return None


_hook_context = _optional_attribute("torch._functorch._aot_autograd.graph_compile", "_get_saved_tensor_hook_context")
_hooks_inlineable = _optional_attribute("torch._functorch._aot_autograd.utils", "saved_tensors_hooks_are_inlineable")
_annotate = _optional_attribute("torch.fx.traceback", "annotate")
_push_hooks = getattr(torch._C._autograd, "_push_saved_tensors_default_hooks", None)
_pop_hooks = getattr(torch._C._autograd, "_pop_saved_tensors_default_hooks", None)


def graph_hooks_missing() -> Optional[str]:
    """None where this torch inlines saved-tensor hooks into compiled graphs (NOTE [
    Saved-tensor hooks in a compiled graph ]); else the pieces it lacks, for a message."""
    missing = [name for name, feature in (
        ("torch._functorch._aot_autograd.graph_compile._get_saved_tensor_hook_context", _hook_context),
        ("torch._functorch._aot_autograd.utils.saved_tensors_hooks_are_inlineable", _hooks_inlineable),
        ("torch.fx.traceback.annotate", _annotate),
        ("torch._C._autograd._push_saved_tensors_default_hooks", _push_hooks),
        ("torch._C._autograd._pop_saved_tensors_default_hooks", _pop_hooks)) if feature is None]
    return ", ".join(missing) or None


def graph_hook(function) -> torch.fx.GraphModule:
    """A saved-tensor hook AOTAutograd inlines, which runs ``function(value)`` as it
    traces each saved node (NOTE [ Saved-tensor hooks in a compiled graph ])."""
    graph = torch.fx.Graph()
    graph.output(graph.call_function(function, (graph.placeholder("value"),)))
    hook = torch.fx.GraphModule(torch.nn.Module(), graph)
    # Each GraphModule has a class of its own. Autograd also calls the hook eagerly for
    # what eager code saves while it is set, where Dynamo, compiling the frames a
    # compiled region calls, would trace the hook and break at the private context:
    # run eagerly, it is not traced (AOTAutograd's make_fx traces it all the same).
    type(hook).forward = torch.compiler.disable(lambda self, value: function(value))
    return hook


def saved_node_being_traced():
    """``(node, backward_graph)`` while AOTAutograd traces a graph hook for a saved
    node, else None. A CPU RNG state gets its backward name first (NOTE [ RNG states
    under graph hooks ])."""
    context = _hook_context()
    if context is None:
        return None
    node, forward, backward = context["_node"], context["_fw_graph"], context["_bw_graph"]
    _give_rng_state_its_backward_name(node, forward, backward)
    return node, backward


# The module an op traced into a compiled graph runs in: while AOTAutograd traces
# Dynamo's graph it keeps the meta of the node that makes each op current
# (torch.fx.traceback.current_meta), whose ``nn_module_stack`` Dynamo recorded, outermost
# module first, each entry ``(path, type)`` with the path spelled from the compiled
# frame's locals ("L['self'].blocks.0.attn.qkv", an index in brackets in some
# releases). Optional: where a torch records none, nothing is found.
_DOTTED = re.compile(r"\[['\"]?([^\]'\"]*)['\"]?\]")


def module_of_traced_op() -> Optional[tuple]:
    """``(dotted path, type)`` of the innermost module whose forward runs the op
    AOTAutograd traces now, or None where it runs in none or torch records none."""
    meta = getattr(torch.fx.traceback, "current_meta", None) or {}
    stack = meta.get("nn_module_stack")
    if not stack:
        return None
    path, module_type = next(reversed(stack.values()))
    return _DOTTED.sub(r".\1", path), module_type


# NOTE [ RNG states under graph hooks ]
# A checkpointed region that draws random numbers on the CPU (dropout; the CPU's
# fused attention, whose op is tagged as seeded) is replayed from a saved RNG state:
# AOTAutograd's partitioner (functionalize_rng_ops) saves ``getitem(run_and_save_rng_
# state(...), 0)`` from the forward and names the backward's input for it
# ``rng_state_output_<k>``, not after the forward node as it names every other saved
# tensor. Inlining graph hooks finds each saved tensor's backward input by that name,
# and fails with "could not find saved tensor ... in bw_g_inputs" (torch 2.13). Both
# graphs keep the RNG states in the same order, so before the hook traces one, the
# forward node takes the name of the backward input in its place. (CUDA's states are
# graph inputs, not saved tensors: CUDA Graph Safe RNG Functionalization.)
def _give_rng_state_its_backward_name(node, forward, backward) -> None:
    inputs = {n.name for n in backward.find_nodes(op="placeholder")}
    if node.name in inputs or not _is_rng_state(node):
        return
    states = [n for n in forward.output_node().args[0] if isinstance(n, torch.fx.Node) and _is_rng_state(n)]
    named = [n for n in backward.find_nodes(op="placeholder") if n.name.startswith("rng_state_output_")]
    if len(states) == len(named):
        node._rename(named[states.index(node)].name)


def _is_rng_state(node) -> bool:
    source = node.args[0] if node.target is operator.getitem and node.args[1:] == (0,) else None
    run_and_save = getattr(getattr(torch._prims, "rng_prims", None), "run_and_save_rng_state", None)
    return isinstance(source, torch.fx.Node) and run_and_save is not None and source.target is run_and_save


def annotated(annotation: dict):
    """A context whose traced ops carry ``annotation`` in ``node.meta["custom"]``, into
    AOTAutograd's graphs and the copies its partitioner recomputes."""
    return _annotate(annotation)


def push_saved_tensor_hooks(pack, unpack) -> None:
    _push_hooks(pack, unpack)


def pop_saved_tensor_hooks() -> None:
    _pop_hooks()


# NOTE [ A frame Dynamo skips ]
# actsave sets its graph hooks around a forward that Dynamo compiles, in one graph
# break: a traced caller breaks at a function whose own frame Dynamo does not trace
# and whose callees it compiles. torch.compiler.disable(recursive=False) makes such a
# function, but Dynamo decides its frame again at every call (its frame callback runs
# for it each time: trace rules, the frame's first instruction), host work that a short
# step shows (docs/results.md, "Inductor's layout copies, and the noise of a ratio").
# torch._dynamo.decorators.skip (private, in 2.11 and 2.13) marks the function's code
# skipped once (skip_code: this frame skipped, its callees as usual), and sets the
# attribute at which a traced caller breaks, as disable does. The mark lives on the
# code object; torch._dynamo.reset() clears only the codes Dynamo's callback has seen,
# which a skipped code never reaches. Where skip is missing, disable(recursive=False).
_skip = _optional_attribute("torch._dynamo.decorators", "skip")


def untraced_frame(function):
    """``function``, whose own frame Dynamo neither traces nor decides again at each
    call, while it compiles the frames ``function`` calls; a traced caller breaks the
    graph at it (NOTE [ A frame Dynamo skips ])."""
    if _skip is None:
        return torch.compiler.disable(function, recursive=False)
    return _skip(function)


# NOTE [ Eager hooks Dynamo leaves alone ]
# A module compiled on its own (module.compile(), torch.compile(module)) that runs inside
# an eager checkpoint runs while actsave's eager saved-tensor hooks are set, in its
# forward and in its recompute. Dynamo's frame callback is set for that compiled call,
# so it would compile the hooks' frames as the compiled code saves (torch's own
# checkpoint hooks live in torch's files, which Dynamo skips), break its graph inside
# them and resume on AOTAutograd's tracing tensors: a crash ("'NoneType' object has no
# attribute 'is_leaf'"), or a graph compiled again at every step on guards on actsave's
# state. These hooks are eager code by design (a compiled graph has hooks of its own:
# NOTE [ Saved-tensor hooks in a compiled graph ]), so Dynamo is told once to leave their
# code, and all it calls, alone: a frame strategy on the code object (private, in 2.11
# and 2.13), set once and read by Dynamo only, where torch.compiler.disable's wrapper
# would add a Python call to every save of every step (docs/results.md, "A twentieth
# adversarial run"). Where it is missing, the hooks are left as they are.
_set_strategy = _optional_attribute("torch._C._dynamo.eval_frame", "set_code_exec_strategy")
_Strategy = _optional_attribute("torch._C._dynamo.eval_frame", "_FrameExecStrategy")
_Action = _optional_attribute("torch._C._dynamo.eval_frame", "_FrameAction")


def eager_hooks(*functions) -> None:
    """Have Dynamo run ``functions`` (hooks autograd calls) and everything they call as
    they are, never compiled (NOTE [ Eager hooks Dynamo leaves alone ])."""
    if _set_strategy is None or _Strategy is None or _Action is None:
        return
    for function in functions:
        _set_strategy(function.__code__, _Strategy(_Action.SKIP, _Action.SKIP))


# Dynamo's frame callback on this thread (torch._C._dynamo.eval_frame, private, in 2.11
# and 2.13): set while code runs under torch.compile outside a graph, in a frame Dynamo
# ran eagerly after a graph break it could not resume from, whose callees it compiles.
_frame_callback = _optional_attribute("torch._C._dynamo.eval_frame", "get_eval_frame_callback")


def dynamo_compiles_callees() -> bool:
    """Whether Dynamo would compile the frames the running code calls (never while it
    traces: call this from eager code only)."""
    return _frame_callback is not None and _frame_callback() not in (None, False)


# NOTE [ Fake tensors in a probe ]
# Code written to be traced tells a tensor it cannot read from one it can: Hugging
# Face's mask code skips its data-dependent checks (``Tensor.item()``) for a
# FakeTensor, as it does under Dynamo, where a plain meta tensor makes it fail. A
# probe that runs a model to see what it saves, not what it computes, therefore
# runs on fake tensors where torch has them (torch._subclasses, private), and on
# plain meta tensors where it has not.
_FakeTensorMode = _optional_attribute("torch._subclasses.fake_tensor", "FakeTensorMode")


@contextlib.contextmanager
def fake_tensors():
    """NOTE [ Fake tensors in a probe ]: while active, a function that turns a meta
    tensor into a fake one (the identity without FakeTensorMode); other tensors the
    ops meet are made fake as they come."""
    if _FakeTensorMode is None:
        yield lambda t: t
        return
    with _FakeTensorMode(allow_non_fake_inputs=True) as mode:
        yield mode.from_tensor


def traced_shape(like: torch.Tensor, codes: torch.Tensor) -> tuple:
    """The shape of the saved node ``like`` in terms the backward's trace follows. A
    size Dynamo made dynamic (a batch that changed between calls) is a symbol of the
    forward's graph, unknown to the backward's: one such size is the codes' count (one
    per element) over the others; more than one cannot be told apart."""
    dynamic = [i for i, size in enumerate(like.shape) if not isinstance(size, int)]
    if not dynamic:
        return tuple(like.shape)
    if len(dynamic) > 1:
        raise ConfigError(
            f"a tensor a codec keeps in a compiled graph has {len(dynamic)} dynamic sizes ({tuple(like.shape)}): "
            "actsave can rebuild one from the codes. Compile with dynamic=False, or mark all but one size static "
            "(torch._dynamo.mark_static), or run the codec eagerly (no torch.compile around it)")
    shape = list(like.shape)
    shape[dynamic[0]] = codes.numel() // math.prod(size for size in shape if isinstance(size, int))
    return tuple(shape)


_OptimizedModule = _require(getattr(getattr(torch._dynamo, "eval_frame", None), "OptimizedModule", None),
                            "torch._dynamo.eval_frame.OptimizedModule")


def is_compiled(function) -> bool:
    """Whether calling ``function`` (a module or any callable) runs compiled code:
    ``torch.compile(module)`` (an OptimizedModule), ``module.compile()`` (its
    ``_compiled_call_impl``), or ``torch.compile(fn)`` (Dynamo's wrapper, which names
    the function it wraps ``_torchdynamo_orig_callable``)."""
    return (isinstance(function, _OptimizedModule) or getattr(function, "_compiled_call_impl", None) is not None
            or hasattr(function, "_torchdynamo_orig_callable"))


def uncompiled_name(name: str) -> str:
    """A module's qualified name as in the eager model: without the ``_orig_mod`` that
    ``torch.compile(module)`` puts before the names of the modules it holds."""
    return ".".join(part for part in name.split(".") if part != "_orig_mod")


def uncompiled(module: torch.nn.Module) -> torch.nn.Module:
    """The eager module behind ``torch.compile(module)``; any other module as it is
    (``module.compile()`` compiles in place: run it under :func:`compiled_code_eager`
    for its eager code)."""
    return module._orig_mod if isinstance(module, _OptimizedModule) else module


# NOTE [ A meta step that failed inside Dynamo ]
# torch.cond compiles its branches with Dynamo, in eager code too. A meta step through
# one fails (a branch meets a real tensor beside the fake ones it traces), and left
# Dynamo's caches holding what it had traced: every later torch.cond of the process
# failed, plain PyTorch's too, until torch._dynamo.reset() (docs/results.md, "A
# twenty-second adversarial run"). So a meta step that raises through a higher-order
# operator's frames (cond, while_loop, ...) resets its caches so; code the user compiled
# compiles again at its next call. Not any frame of Dynamo's: every step passes through
# its ``disable`` wrappers, and a failed step of any other kind would recompile it all.
_HIGHER_ORDER_FRAMES = "/torch/_higher_order_ops/"


def reset_dynamo_after(error: BaseException) -> None:
    """torch._dynamo.reset() where ``error`` was raised through a higher-order operator."""
    frame = error.__traceback__
    while frame is not None:
        if _HIGHER_ORDER_FRAMES in frame.tb_frame.f_code.co_filename.replace("\\", "/"):
            torch._dynamo.reset()
            return
        frame = frame.tb_next
