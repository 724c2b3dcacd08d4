"""Which tensors a checkpoint may keep by a codec or on the host, and how it keeps
them: the keep rules that the runtime (store.py, kept_saves.py, keep_modes.py) and
the planner (its profile, cost model and plans) both ask, so that they agree.

- :class:`KeepPolicy` (a codec and whether offloaded), resolved once; :data:`EXACT`.
- :func:`should_encode`: a dense tensor of a codec's dtypes nobody else holds; the caller's
  tensors (:class:`CallerTensors`) are kept by reference (NOTE [ Inputs kept by
  reference ], :func:`kept_as`).
- :func:`lossy_codec_stores`, :class:`AttentionSaves`: the saves a lossy codec keeping
  saves leaves exact (NOTE [ Saves a lossy codec leaves exact ], NOTE [ Attention's
  saves agree ]).
- :func:`modifies_input`, :func:`starts_in_place`: a first layer that changes its input
  in place, itself or after layers that hand it on (a private copy).
- :func:`placed`: a policy as it applies on a device (no offload where the host's
  memory is the device's).
- :func:`stored_once_key`: which saves of one forward share one stored copy.
"""
from __future__ import annotations

import contextlib
import itertools
import math
import warnings
import weakref
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
from torch import nn

from .._taps import ATTENTION
from .._torch import leaf_base, storage_identity, version
from ..codecs import IDENTITY, Codec, encodable, get_codec
from ..devices import offloads_from
from ..errors import ConfigError
from ..layouts import is_dense
from ..meta import simulated_device


@dataclass(frozen=True)
class KeepPolicy:
    """How one segment keeps its input: the codec, and whether it goes to the host.

    No field has a default: Dynamo (torch 2.11) inlines the constructor where a traced
    forward builds a policy, binds its defaults, and cannot wrap a codec held only there
    (a graph break per layer; :data:`EXACT` is the exact policy)."""

    codec: Codec
    offload: bool

    @classmethod
    def resolve(cls, compress=None, offload=False) -> "KeepPolicy":
        if not isinstance(offload, bool):
            raise ConfigError(f"offload={offload!r} must be True or False")
        return cls(codec=get_codec(compress), offload=offload)

    @property
    def lossy(self) -> bool:
        """Whether a recompute from what this policy keeps differs from the forward."""
        return not self.codec.lossless

    def describe(self) -> tuple:
        return (self.codec.name, "host" if self.offload else "-")


EXACT = KeepPolicy(IDENTITY, False)


class CallerTensors:
    """The tensors the caller of a chain of layers holds whatever actsave keeps: the
    chain's input, and the parameters and buffers of its layers (``module``)."""

    def __init__(self, chain_input, module: nn.Module):
        self._input = leaf_base(chain_input) if isinstance(chain_input, torch.Tensor) else None
        self._module = module
        self._buffers = None  # ids, gathered at the first question (frozen layers only)

    def hold(self, leaf: torch.Tensor) -> bool:
        """Whether ``leaf`` (a leaf tensor) is one of them."""
        if leaf is self._input or leaf.requires_grad or isinstance(leaf, nn.Parameter):
            return True  # a leaf that needs grad is the caller's: autograd makes none
        if self._buffers is None:
            self._buffers = {id(b) for b in self._module.buffers()}
        return id(leaf) in self._buffers


def should_encode(t: torch.Tensor, made_by: Optional[CallerTensors] = None) -> bool:
    """Whether a codec (and offload) applies to ``t``, a kept input: a dense tensor of
    a codec's dtypes that nobody else holds.

    That is a tensor autograd produced, not a view of a leaf. ``made_by``: ``t`` is
    the input of a segment after the first of a chain, the output of the layers before
    it; then a tensor that needs no grad (made by layers whose parameters need none: a
    frozen prefix, as in fine-tuning) is one too, unless it is, or is a view of, one of
    the tensors the chain's caller holds (the chain input, a parameter, a buffer). The
    planner's profile asks the same question of each layer input (LayerProfile.input_encodable).

    Only what a codec takes (codecs.encodable: a dense float32, bfloat16, float16 or
    float64 tensor) is encoded or offloaded; integer, bool and float8 tensors, sparse
    and nested ones are kept as they are, exactly, whatever the policy."""
    # The caller's tensors (parameters, the batch) and their views (``weight.t()``) are
    # held elsewhere anyway: encoding or offloading them would add memory, copies and
    # error, and free nothing. A tensor that needs no grad looks like a leaf, so
    # outside a chain, where its maker is unknown (a mask or rotary table made under
    # no_grad, shared by every block), it is taken for one.
    if not encodable(t):
        return False
    leaf = leaf_base(t)
    return leaf is None or (made_by is not None and not made_by.hold(leaf))


# NOTE [ Saves a lossy codec leaves exact ]
# A lossy codec scales each group of elements by its largest magnitude, so an element
# far below it decodes to 0 (int8: below 1/254 of it). For an activation that is noise;
# for a tensor a backward divides by it is inf or NaN in the gradient. So the saves a
# lossy codec keeps (runtime/kept_saves.py) leave two kinds exact, held as they are:
# - Statistics a norm or a softmax saved, one element per row (a row's norm, the rsqrt
#   of its variance, a max or a sum): those whose last dimension is 1 and those
#   broadcast along a dimension (a stride of 0: ``norm.expand_as(x)``), where their
#   storage holds no more than the elements they read (F.normalize beside all-zero
#   padding rows, RMSNorm beside one massive activation). They cost little memory kept
#   exactly, and an encoding of a broadcast view would store every repeat. A view into
#   a larger storage (``y[..., :1]``, expanded or not) is encoded: held exactly, it
#   would keep all of ``y``. Known by their node too: a group norm's mean and rstd
#   (outputs 1 and 2 of _STATISTICS_OF, one per sample and group, whose rstd of a
#   constant group, ~1/sqrt(eps), would set the scale of its codec group). Batch and
#   layer norms return theirs as tensors autograd does not track, kept by reference.
# - The result of a node whose backward divides by it (_DIVIDES_BY_RESULT: a sqrt, a
#   norm, a standard deviation, a distance; ``torch.sqrt(x * x + eps)``, a smooth |x|,
#   has elements far below its largest), known by its autograd node as it is saved;
#   its other saves share the copy held. Decompositions too, whose backwards divide by
#   differences of their eigen- or singular values or by a factor's diagonal (eigh,
#   eig, svd, qr, cholesky, lu): decoded apart, nearby values are equal, and every
#   gradient NaN (docs/results.md, "A twenty-second adversarial run"). A node that
#   divides by an input it saves (``log(p)``, ``a / b``, ``x ** -0.5``) is not known
#   so: a save hook is told the tensor, not the node that saves it, and that node's
#   output does not exist yet (``torch.log_softmax`` saves its own output and divides
#   by nothing: the form to write a log of probabilities in).
# The planner's count of a plain segment's saves asks the same (planning/saves_as_stored.py).
_DIVIDES_BY_RESULT = frozenset({
    "SqrtBackward0", "StdBackward0", "StdMeanBackward0", "NormBackward0", "NormBackward1", "NormBackward2",
    "NormBackward3", "LinalgVectorNormBackward0", "DistBackward0", "CdistBackward0", "PdistBackward0",
    "EuclideanDistBackward0", "HypotBackward0", "WeightNormInterfaceBackward0",
    "LogsumexpBackward0",  # exp(x - result): divides by exp(result)
    "LinalgEighBackward0", "LinalgEigBackward0", "LinalgSvdBackward0", "LinalgQrBackward0",
    "LinalgCholeskyExBackward0", "LinalgLuFactorExBackward0", "LinalgLuBackward0"})
# Nodes whose outputs past the first are statistics (NOTE above), by output number.
_STATISTICS_OF = frozenset({"NativeGroupNormBackward0"})
_DIVIDES_BY_RESULT_OP = frozenset({  # the aten operators of those nodes, in a traced graph
    "sqrt", "std", "norm", "linalg_vector_norm", "dist", "_cdist_forward", "_pdist_forward", "_euclidean_dist",
    "hypot", "_weight_norm_interface", "logsumexp", "_linalg_eigh", "linalg_eig", "_linalg_svd", "linalg_qr",
    "linalg_cholesky_ex", "linalg_lu_factor_ex"})


# NOTE [ Saves a backward compares ]
# Some backwards find the elements of the input they saved that equal the result they
# saved, and share the gradient among them: an amax or amin (``x.amax(dim)``, a softmax
# written by hand), a max, min or median over every element, an infinity norm.
# Decoded apart, the input equals its result nowhere where the reduction does not run
# along a codec's group (a group's largest magnitude alone decodes exactly): a count of
# 0, and a gradient of 0 / 0, NaN in every parameter before it (an adversarial run,
# CPU, 2026-11-30: docs/results.md). So a lossy codec keeping saves (kept_saves.py)
# holds both as they are: the result (every save of it, as a result a backward divides
# by), known by its node, and the input that node saved just before it. Autograd saves
# a node's inputs, runs its op, then saves its output; nothing is saved between, so the
# save before the result's first is that input (:func:`compared_inputs` checks it is
# the node's input: a later save of the result by another node follows that node's own
# input). A max or min scatter or index reduction compares its result with both its
# self and its source, and an infinity distance with both its points: the two saves
# before the result (decoded apart, they gave NaN in every gradient: docs/results.md,
# "A twenty-first adversarial run"). Later saves of the input's storage are held so too (it lives anyway);
# earlier ones keep their stored copy. In a compiled graph, a plain segment's saves made
# by such a reduction or read by one are kept exactly (graph_saves.compared_by_backward).
# The planner's count of a plain segment's saves asks the same (planning/saves_as_stored.py).
_COMPARES_WITH_INPUT = frozenset({"AmaxBackward0", "AminBackward0", "AminmaxBackward0", "MaxBackward1",
                                  "MinBackward1", "MedianBackward0", "NanmedianBackward0"})
# An infinity norm compares too, as a p-norm node (``torch.norm``, pairwise_distance)
# or a vector norm (``torch.linalg.vector_norm``, which ``torch.norm(p=inf)`` calls).
_NORM_ORDER = {"NormBackward0": "_saved_p", "NormBackward1": "_saved_p", "NormBackward2": "_saved_p",
               "NormBackward3": "_saved_p", "LinalgVectorNormBackward0": "_saved_ord"}
_COMPARES_WITH_INPUT_OP = frozenset({"amax", "amin", "aminmax", "max", "min", "median", "nanmedian"})  # traced
# Traced operators that compare where an argument says so: (its position, its name, the
# test of its value), an infinity order or a max or min reduction.
_COMPARES_BY_ARGUMENT_OP = {
    "linalg_vector_norm": (1, "ord", lambda order: isinstance(order, (int, float)) and math.isinf(order)),
    "norm": (1, "p", lambda order: isinstance(order, (int, float)) and math.isinf(order)),
    "dist": (2, "p", lambda order: isinstance(order, (int, float)) and math.isinf(order)),
    "scatter_reduce": (4, "reduce", lambda reduce: reduce in ("amax", "amin")),
    "index_reduce": (4, "reduce", lambda reduce: reduce in ("amax", "amin")),
}
# Nodes that compare their result with the two inputs saved just before it (a scatter's
# or index reduction's self and source, a distance's two points), where their argument
# makes them compare: a max or min reduction, an infinity norm.
_COMPARES_WITH_INPUTS = {
    "ScatterReduceBackward0": lambda node: node._saved_reduce in ("amax", "amin"),
    "IndexReduceBackward0": lambda node: node._saved_reduce in ("amax", "amin"),
    "DistBackward0": lambda node: math.isinf(node._saved_p),
    "CdistBackward0": lambda node: math.isinf(node._saved_p),
}


def compared_inputs(result: torch.Tensor, before: Sequence[Optional[torch.Tensor]]) -> list:
    """The positions in ``before``, the saves made just before ``result`` (the latest
    last), of the inputs that ``result``'s node compares it with: NOTE [ Saves a backward
    compares ]. Empty where ``result`` is no such node's, or a save there is not its
    input."""
    node = result.grad_fn
    count = _compared_input_count(node)
    if count == 0 or len(before) < count:
        return []
    candidates = range(len(before) - count, len(before))
    if any(before[i] is None for i in candidates):
        return []
    edges = [edge for edge, _ in node.next_functions if edge is not None]
    matched = [_is_input(before[i], edges) for i in candidates]
    # An input that needs no gradient has no edge to check it by (a constant self); one
    # at least must be the node's.
    unchecked = all(match or not before[i].requires_grad for i, match in zip(candidates, matched))
    return list(candidates) if unchecked and any(matched) else []


def _is_input(tensor: torch.Tensor, edges: list) -> bool:
    """Whether ``tensor``'s gradient goes along one of a node's ``edges``."""
    return any(edge is tensor.grad_fn or getattr(edge, "variable", None) is tensor for edge in edges)


def _compared_input_count(node) -> int:
    """How many saves before its result ``node``'s backward compares with it."""
    if node is None:
        return 0
    name = node.name()
    if name in _COMPARES_WITH_INPUT or _infinity_norm(node, name):
        return 1
    if name in _COMPARES_WITH_INPUTS:
        return 2 if _COMPARES_WITH_INPUTS[name](node) else 0
    return 0


def _infinity_norm(node, name: str) -> bool:
    order = _NORM_ORDER.get(name)
    return order is not None and math.isinf(getattr(node, order, 0))


def compares_with_input_op(node) -> bool:
    """Whether the traced ``node`` (a compiled graph's) is such a reduction, known by its
    operator: NOTE [ Saves a backward compares ]."""
    name = getattr(node.target, "_opname", None) if node.op == "call_function" else None
    if name in _COMPARES_BY_ARGUMENT_OP:
        position, keyword, compares = _COMPARES_BY_ARGUMENT_OP[name]
        return compares(node.args[position] if len(node.args) > position else node.kwargs.get(keyword, 2))
    return name in _COMPARES_WITH_INPUT_OP


def lossy_codec_stores(t: torch.Tensor) -> bool:
    """Whether a lossy codec keeping saves encodes ``t``, a save: what should_encode
    takes, but per-row statistics, broadcast views of their own storage and results a
    backward divides by (NOTE [ Saves a lossy codec leaves exact ]) or compares with
    its input (NOTE [ Saves a backward compares ]: the input is the caller's to hold)."""
    if not should_encode(t) or _exact_result(t.grad_fn) or _node_statistic(t):
        return False
    # The elements it reads: a broadcast dimension reads one of its size.
    distinct = math.prod(size for stride, size in zip(t.stride(), t.shape) if stride != 0)
    return not _statistic(t) or t.untyped_storage().nbytes() > distinct * t.element_size()


def traced_save_stored(value: torch.Tensor, target, needs_grad: bool) -> bool:
    """lossy_codec_stores for a save of a compiled graph (graph_codecs.py): ``value``,
    its traced tensor, made by the operator ``target``; ``needs_grad``: whether it
    needs a gradient, which a traced tensor does not say (the graph tells: NOTE
    [ Traced saves that need no gradient ] in graph_saves.py). One that needs none is
    kept by reference, as should_encode keeps it (a leaf: a table computed from no
    input that needs a gradient). A traced save has no autograd node, so a result a
    backward divides by is known by its operator; and it is the graph's own tensor, so
    every statistic stays exact."""
    return needs_grad and encodable(value) and not _statistic(value) and \
        getattr(target, "_opname", None) not in _DIVIDES_BY_RESULT_OP


def _statistic(t: torch.Tensor) -> bool:
    """A 0-d save, one whose last dimension is 1, or one broadcast along a dimension."""
    broadcast = any(stride == 0 and size > 1 for stride, size in zip(t.stride(), t.shape))
    return t.dim() == 0 or t.shape[-1] == 1 or broadcast


def _node_statistic(t: torch.Tensor) -> bool:
    """A statistic known by its node: NOTE [ Saves a lossy codec leaves exact ]."""
    node = t.grad_fn
    return node is not None and t.output_nr > 0 and node.name() in _STATISTICS_OF


def _exact_result(node) -> bool:
    """Whether a tensor whose autograd node is ``node`` is its output, which a lossy codec
    leaves exact: the node's backward divides by it or compares it with its input."""
    if node is None:
        return False
    name = node.name()
    # An infinity norm is a norm, an infinity distance a distance.
    return name in _DIVIDES_BY_RESULT or name in _COMPARES_WITH_INPUT or \
        (name in _COMPARES_WITH_INPUTS and _COMPARES_WITH_INPUTS[name](node))


# NOTE [ Attention's saves agree ]
# An attention backward reads its saves together and subtracts what they give: the
# probabilities P = exp(q k^T * scale - lse) from q, k and the softmax's log-sum-exp
# (lse), the row sums D = rowsum(dO * O) from its output O, and dS = P * (dO v^T - D),
# whose terms cancel, since O = P v and each row of P sums to 1. Near-uniform
# attention (a block at its initialization: every v_j close to their mean) and sharp
# attention (P close to one-hot) leave a difference far smaller than its terms. Each
# save decoded apart breaks those identities: decoded q, k beside the forward's exact
# lse make rows that do not sum to 1, a decoded O is not P times the decoded v, and the
# error, a codec's step of the terms, lands on their small difference: several times
# the error of a recompute from the same decoded q, k and v, which agree. So:
# - A call that keeps saves by a lossy codec (kept_saves.py, keep="saves" and
#   "linear_inputs") holds every save an attention call makes exactly: q, k, v, its
#   output, lse and whatever else its kernel saves (each fused kernel's, CPU's and CUDA's;
#   the math path's probabilities), known by the call (:class:`AttentionSaves`: a tap
#   on ``F.scaled_dot_product_attention``, _taps.ATTENTION), not by its node, which a
#   save hook does not see for q, k and v. A later save of a storage held so (the
#   output projection's input, a view of the attention's output) is held so too: the
#   storage lives anyway, and its encoding would add memory and error, freeing nothing.
# - A selective recompute under a lossy codec recomputes attention from its decoded
#   q, k, v rather than keeping its output (selective.py, NOTE [ Selective recompute ]).
# - In a compiled graph, a plain segment's saves that graph codecs store are judged
#   by the graph (graph_saves.py, attention_holds): a save made by an op traced from
#   the attention call, or sharing a storage, by views, with a tensor it took or made.
# Attention reached otherwise (a name bound before the tap, another kernel) is not
# known, and its saves are encoded as any others. The planner's count of a plain
# segment's saves asks the same (planning/saves_as_stored.py).
class AttentionSaves:
    """Which saves of a forward an attention call made, or share a storage with one
    held exactly (NOTE [ Attention's saves agree ]): active on this thread while
    :meth:`watching`."""

    def __init__(self):
        self._depth = 0  # attention calls running
        self._storages = {}  # storage identity -> weak reference to the storage, held exactly

    @contextlib.contextmanager
    def watching(self):
        with ATTENTION.handled(self._call):
            yield

    def _call(self, call_next, *args, **kwargs):
        self._depth += 1
        try:
            return call_next(*args, **kwargs)
        finally:
            self._depth -= 1

    def holds(self, t: torch.Tensor) -> bool:
        """Whether ``t``, a save being made, is held exactly: an attention call is making
        it, or it shares a storage such a save holds (noted as it is asked)."""
        identity = storage_identity(t)
        if self._depth:
            self._storages[identity] = weakref.ref(t.untyped_storage())
            return True
        storage = self._storages.get(identity)
        return storage is not None and storage() is not None

    def forget(self) -> None:
        """Hold no reference past the forward (identities may be reused from now)."""
        self._storages = {}


# NOTE [ Inputs kept by reference ]
# A kept input that should_encode refuses (the caller's tensors and their views, a
# non-float tensor) is kept as it is, on the device, whatever the policy asks: a codec
# or offload would add memory, copies and error and free nothing. The runtime
# (_KeptTensor) and the planner (memory_model.effective_option, the cost model's
# allowed options, plans.balanced and plans.predict) ask kept_as; the planner's
# LayerProfile.input_encodable is should_encode's answer for the layer's input.
def kept_as(policy: KeepPolicy, encodable: bool) -> KeepPolicy:
    """What a kept input is stored by when ``policy`` is asked for it and should_encode
    answered ``encodable``: NOTE [ Inputs kept by reference ]."""
    return policy if encodable else EXACT


_offload_warned = [False]  # NOTE [ Separate host memory ]: one warning a process


def placed(policy: KeepPolicy, device: torch.device) -> KeepPolicy:
    """``policy`` as it applies to tensors on ``device``: offload only where it moves
    them off the device (NOTE [ Separate host memory ]); elsewhere they stay where they
    are, and the first such call of the process warns. Meta tensors follow the device
    they stand for in a simulated step (meta.py), and outside one go to meta buffers."""
    if not policy.offload:
        return policy
    if device.type == "meta":
        device = simulated_device() or device
    if offloads_from(device):
        return policy
    if not _offload_warned[0]:
        _offload_warned[0] = True
        warnings.warn(
            f"actsave: offload=True keeps {device.type} tensors where they are: offload moves "
            "tensors to host memory, and there the host's memory is the device's own, so a copy would free "
            "nothing. It takes effect for CUDA tensors; on a CPU, compress= (int8, fp8) keeps less.",
            UserWarning, stacklevel=2)
    return KeepPolicy(policy.codec, False)


def stored_once_key(tensor: torch.Tensor):
    """What makes saves of one forward share one stored copy: equal keys (the same
    elements of one storage, unchanged since: a tensor saved twice, or a contiguous
    view of a contiguous one; a dense tensor in another layout, channels_last, with the
    same sizes and strides, which its copy decodes into); None for a tensor that is not
    dense, stored anew at each save. The runtime keeps a plain segment's saves by it
    (kept_saves.py), and the planner's profile counts them by it
    (planning/saves_as_stored.py)."""
    if not tensor.is_contiguous():
        if not is_dense(tensor):
            return None
        return (storage_identity(tensor), tensor.storage_offset(), tuple(tensor.shape), tensor.stride(),
                tensor.dtype, version(tensor), tensor.is_neg())
    # The storage object's address, not its data pointer: meta tensors (actsave.estimate)
    # all have data pointer 0. The version: a tensor changed in place between two saves
    # holds other values at the second (h saved, h.tanh_(), h saved again), so the copy
    # stored at the first must not stand for it. The negative bit: a view with it set
    # (``torch._neg_view(h)``, the ``.imag`` of a ``conj()`` view) reads the same
    # memory as its negation.
    return (storage_identity(tensor), tensor.storage_offset(), tensor.numel(), tensor.dtype, version(tensor),
            tensor.is_neg())


def modifies_input(function) -> bool:
    """Whether ``function`` (a layer, or the first layer of a segment) changes its
    input in place, so that a segment starting with it keeps a private copy of its
    input: ``nn.ReLU(inplace=True)`` and friends say so with ``inplace = True``, and
    an ``nn.Sequential`` that starts so (its input is its first layers')."""
    if getattr(function, "inplace", False) is True:
        return True
    return isinstance(function, nn.Sequential) and starts_in_place(function, 0)


def starts_in_place(layers, start: int) -> bool:
    """Whether a segment of ``layers`` starting at ``start`` changes its input in place
    (:func:`modifies_input`): its first layer does, or hands its input on
    (:func:`_passes_on`) to a layer that does."""
    for layer in itertools.islice(layers, start, None):
        if not _passes_on(layer):
            return modifies_input(layer)
    return False


def _passes_on(layer) -> bool:
    """Whether ``layer`` hands its input on as it is, or as a view of it, so that what
    the layer after it changes in place is its input: nn.Identity, nn.Flatten and
    nn.Unflatten; a dropout that drops nothing (p=0, or in eval mode); an nn.Sequential
    of such layers. (A module of another type that returns its input says so with
    ``inplace = True``.)"""
    if isinstance(layer, (nn.Identity, nn.Flatten, nn.Unflatten)):
        return True
    if isinstance(layer, nn.modules.dropout._DropoutNd):
        return layer.p == 0 or not layer.training
    return isinstance(layer, nn.Sequential) and all(_passes_on(inner) for inner in layer)


__all__ = ["KeepPolicy", "EXACT", "CallerTensors", "should_encode", "lossy_codec_stores", "AttentionSaves", "kept_as",
           "placed", "stored_once_key", "modifies_input", "starts_in_place"]
