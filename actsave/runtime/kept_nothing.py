"""Why a selective checkpoint kept nothing (selective.py, NOTE [ Selective recompute ]):
one warning per reason and function, or the reasons noted for the planner, which
prices an option without warning of it (:func:`kept_nothing_noted`)."""
from __future__ import annotations

import contextlib
import threading
import warnings

from .kept_ops import TAPPED_FUNCTIONS, KeptOps

_warned = set()
_noting = threading.local()


@contextlib.contextmanager
def kept_nothing_noted():
    """While open, a selective checkpoint on this thread that keeps nothing appends its
    reason to the list yielded instead of warning: the planner pricing an option
    (planning/block_options.py) learns it, and the once-per-process warning is left
    for the training step."""
    previous, _noting.reasons = getattr(_noting, "reasons", None), []
    try:
        yield _noting.reasons
    finally:
        _noting.reasons = previous


def warn_kept_nothing(ops: KeptOps, function_name: str, reason: str) -> None:
    """Warn once per (ops, function, reason) that a selective checkpoint kept nothing;
    ``reason``: "changed", "state", "data set again", "tensorless", "decided", "differentiated", "none ran" or "lossy
    attention"."""
    noted = getattr(_noting, "reasons", None)
    if noted is not None:
        noted.append(reason)
        return
    key = (ops, function_name, reason)
    if key in _warned:
        return
    _warned.add(key)
    if reason == "changed":
        why = (f"every output of its calls of {ops.names()} was changed in place after the call (an in-place "
               "residual: out += x), or the call changed an argument in place, so those calls run again, and it "
               "recomputes everything, as a plain checkpoint does. Make the op after the call out of place "
               "(out = out + x) to keep its output")
    elif reason == "state":
        why = (f"its calls of {ops.names()} change their modules' buffers or parameters in place (a running "
               "statistic), which the code after them reads, so those calls run again, and it recomputes "
               "everything, as a plain checkpoint does. Keep such modules out of the kept calls "
               "(KeptOps(module_names=...)), or use keep='inputs'")
    elif reason == "data set again":
        why = (f"calls of {ops.names()} set a tensor attribute of more than one element on their module that another "
               "call of it sets again (a statistic of each call's input), which the code after each call may read, so "
               "those calls run again, and it recomputes everything, as a plain checkpoint does. Keep such modules out "
               "of the kept calls (KeptOps(module_names=...)), or use keep='inputs'")
    elif reason == "decided":
        why = (f"the outputs of its calls of {ops.names()} are read by a Hardtanh or LeakyReLU, whose decisions a lossy "
               "recompute takes from the forward's by running those calls again (NOTE [ Bound decisions ]), so it "
               "recomputes everything, as a plain checkpoint does. Keep exactly, or use keep='inputs'")
    elif reason == "tensorless":
        why = (f"no call of {ops.names()} returned a tensor (nn.LSTM and nn.MultiheadAttention return tuples), and a "
               "call's output is kept only where it is one tensor, so those calls run again, and it recomputes "
               "everything, as a plain checkpoint does. Name modules that return one tensor (nn.Linear), or use keep='inputs'")
    elif reason == "lossy attention":
        why = ("it keeps by a lossy codec, under which attention is recomputed from its decoded q, k and v, not "
               "kept (its output and log-sum-exp must agree with them: NOTE [ Attention's saves agree ]), and it "
               f"keeps the outputs of nothing else ({ops.names()}), so it recomputes everything, as a plain checkpoint "
               "does. Name the module types that make its matmuls (KeptOps(modules=(nn.Linear,))), or keep exactly")
    elif reason == "differentiated":
        why = ("its forward runs a backward of its own (autograd.grad: a gradient penalty), which the recompute "
               "runs again through every call, so it recomputes everything, as a plain checkpoint does. Use "
               "keep='inputs' for it")
    else:
        why = (f"no call of {ops.names()} ran in its forward, so it recomputes everything, as a plain checkpoint "
               "does. Name the module types that make its matmuls (KeptOps(modules=(nn.Linear, MyProjection))) "
               f"or the functions it calls ({sorted(TAPPED_FUNCTIONS)})")
    warnings.warn(f"actsave: the selective checkpoint of {function_name} kept nothing: {why}.", stacklevel=4)


def warn_unmatched(ops: KeptOps, function_name: str, unmatched: list) -> None:
    """Warn once per (ops, function) that a selective checkpoint kept some calls'
    outputs and that ``unmatched``, module types or functions ``ops`` names, matched no
    call of its forward: a name that never matches keeps nothing, and a policy that
    silently keeps less than it says recomputes what the user meant to keep. Not while
    the planner prices an option, whose subsets name only what ran."""
    if getattr(_noting, "reasons", None) is not None:
        return
    key = (ops, function_name, "unmatched")
    if key in _warned:
        return
    _warned.add(key)
    warnings.warn(
        f"actsave: the selective checkpoint of {function_name} keeps the outputs of {ops.names()}, and no call of "
        f"{unmatched} ran in its forward, so it keeps nothing for them. A projection written as F.linear, "
        "torch.matmul or einsum is no module call: name the module type that makes it (KeptOps(modules="
        f"(nn.Linear, MyProjection))) or one of the functions {sorted(TAPPED_FUNCTIONS)}", stacklevel=4)


__all__ = ["kept_nothing_noted", "warn_kept_nothing", "warn_unmatched"]
