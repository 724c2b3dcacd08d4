"""Parameters across a recompute: those a checkpointed forward changed in place, checked
across it (NOTE [ Parameters a forward changes ]), and every parameter it read, which the
recompute must find as it was (NOTE [ Parameters a recompute reads ]); state.py notes
them, and TouchedState checks them and guards its recompute."""
from __future__ import annotations

import contextlib
from typing import Optional

import torch

from .._torch import is_sharded, own_tensors, storage_identity
from ..errors import RecomputeError


# NOTE [ Parameters a forward changes ]
# A forward may change a parameter in place under no_grad: Embedding's max_norm
# renormalizes the rows it looks up, a user's block clips its own weight. Parameters are
# not snapshotted (every forward would copy every weight), so the recompute starts from
# a parameter as the forward left it and changes it again. Where that change leaves the
# values as they were (max_norm's rows are already within the norm) the recompute reads
# what the forward read; otherwise it reads other values, and the parameter changes
# twice (torch.utils.checkpoint does both, silently). So the parameters the forward
# changed, and only those, are copied as a recompute starts and compared as it ends (or
# stops early), and put back as the forward left them. Changed by more than 4 units of
# rounding (relative: 4 eps), the recompute raises; by rounding alone it goes on (max_norm
# renormalizes a row whose norm came out an ulp above the limit by an ulp or two again).
# bfloat16's eps is 2^-7, so there a change under 3% passes. Where the layers are
# known the change is seen whichever module made it; under global hooks (a function of
# unknown layers) a change is seen where a module makes it to its own parameters during
# its own call; a parameter replaced (FSDP2 puts gathered ones in place) is not a change.
def _rounding_apart(now: torch.Tensor, then: torch.Tensor) -> bool:
    """Whether ``now`` is ``then`` within 4 units of its dtype's rounding: the change of an
    operation that leaves its result as it is but for rounding (max_norm's renormalization
    of a row whose norm came out one ulp above the limit)."""
    if not now.is_floating_point():
        return False
    return torch.allclose(now, then, rtol=4 * torch.finfo(now.dtype).eps, atol=0.0, equal_nan=True)


class GuardedParameters:
    """The parameters a forward changed in place, as a recompute starts: a recompute
    that changes them again must change them to the same values (``max_norm``'s
    renormalization does), or it read values the forward did not (NOTE [ Parameters a
    forward changes ])."""

    def __init__(self, moved: list, layers: Optional[range]):
        self._entries = []
        for index, module, name in moved:
            parameter = own_tensors(module, "parameters").get(name)
            if parameter is not None and (layers is None or index is None or index in layers):
                self._entries.append((module, name, parameter, parameter.detach().clone()))

    def check(self) -> None:
        """Put each parameter back as the forward left it; raise where the recompute
        changed one by more than rounding."""
        moved = [entry for entry in self._entries if not torch.equal(entry[2], entry[3])]
        changed = [(module, name) for module, name, parameter, value in moved if not _rounding_apart(parameter, value)]
        with torch.no_grad():
            for _, _, parameter, value in moved:
                parameter.copy_(value)
        if not changed:
            return
        module, name = changed[0]
        raise RecomputeError(
            f"a checkpointed forward changed parameter '{name}' of {type(module).__name__} in place, and its "
            "recompute changed it again, to other values: the recompute read values the forward did not, so its "
            "gradients would be wrong (the parameter is put back as the forward left it). Change the parameter "
            "outside the checkpointed call (before its forward, or after the backward), or do not checkpoint "
            "this module.")


# NOTE [ Parameters a recompute reads ]
# A recompute reads each module's parameters as they are at backward, where autograd's
# graph holds the tensors the forward read. Between the two they may differ without an
# in-place change, which the version check sees (NOTE [ State a forward reads and
# mutates ]): the module may hold another tensor (torch.func.functional_call over the
# checkpoint, load_state_dict(assign=True), a new nn.Parameter), or the same one other
# storage or another dtype (``p.data = ...``, ``model.double()``); or a parameter may be
# frozen or unfrozen. torch's checkpoint recomputes with them and gives wrong gradients,
# silently (or, where the shapes differ, an error about determinism). So the forward's
# parameters are noted as it ends, with storage, dtype and requires_grad:
# - another tensor, storage or dtype raises RecomputeError as the recompute starts;
#   a sharded one (a DTensor) is not compared, then or now: FSDP2 swaps its shard and
#   the gathered parameter in and out around each module call, the recompute's too;
# - requires_grad is set as the forward had it while the recompute runs (it decides
#   what the recompute saves, as it decided what the forward's graph holds), and put
#   back after.
class ForwardParameters:
    """The parameters of the modules a checkpointed forward ran, as it ran them (NOTE [
    Parameters a recompute reads ])."""

    __slots__ = ("_entries",)

    def __init__(self):
        self._entries = {}  # (module, name) -> (tensor, storage identity, dtype, requires_grad)

    def note(self, module: torch.nn.Module, name: str, tensor: torch.Tensor) -> None:
        """Note parameter ``name`` of ``module`` as the forward reads it (its first read)."""
        if (module, name) not in self._entries and not is_sharded(tensor):
            self._entries[(module, name)] = (tensor, storage_identity(tensor), tensor.dtype, tensor.requires_grad)

    def settle(self) -> None:
        """As the forward ends: forget a parameter the forward itself replaced."""
        self._entries = {key: entry for key, entry in self._entries.items()
                         if own_tensors(key[0], "parameters").get(key[1]) is entry[0]}

    def check(self, function_name: str) -> None:
        """Raise if a module now holds another parameter than the forward read."""
        for (module, name), (tensor, storage, dtype, _) in self._entries.items():
            now = own_tensors(module, "parameters").get(name)
            if now is tensor and storage_identity(now) == storage and now.dtype == dtype:
                continue
            if now is not None and is_sharded(now):  # FSDP2's shard, until its pre-forward gathers it
                continue
            what = "another tensor" if now is not tensor else \
                f"other storage ({dtype} then, {now.dtype} now)" if now.dtype != dtype else "other storage"
            raise RecomputeError(
                f"parameter '{name}' of {type(module).__name__} is {what} than the checkpointed {function_name} "
                "read in its forward (torch.func.functional_call over the checkpoint, load_state_dict(assign=True), "
                "a new nn.Parameter, p.data = ..., or model.to(dtype) between forward and backward): its recompute "
                "would read other values, so its gradients would be wrong. Change the model after the backward, or "
                "call functional_call inside the checkpointed function (actsave.checkpoint(lambda x: "
                "functional_call(model, params, x), x)).")

    @contextlib.contextmanager
    def flags_as_in_forward(self):
        """While active, each parameter's requires_grad is the forward's."""
        flipped = [tensor for tensor, _, _, flag in self._entries.values() if tensor.requires_grad != flag]
        for tensor in flipped:
            tensor.requires_grad_(not tensor.requires_grad)
        try:
            yield
        finally:
            for tensor in flipped:
                tensor.requires_grad_(not tensor.requires_grad)


__all__ = ["GuardedParameters", "ForwardParameters"]
