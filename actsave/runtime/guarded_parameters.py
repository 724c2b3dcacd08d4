"""Parameters a checkpointed forward changed in place, checked across each recompute
(NOTE [ Parameters a forward changes ]); state.py notes which, and TouchedState.as_in_forward
guards them."""
from __future__ import annotations

from typing import Optional

import torch

from .._torch import own_tensors
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


__all__ = ["GuardedParameters"]
