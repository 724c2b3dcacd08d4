"""Modules whose forward updates buffers through a kernel that moves no version.

NOTE [ Buffers a kernel updates unversioned ]
actsave finds the buffers a forward changed by their version counters, module by module
(NOTE [ State a forward reads and mutates ] in state.py): a module any of whose tensors
moved has all of its buffers snapshotted. BatchNorm's kernel updates its running
statistics without moving their versions, but its ``num_batches_tracked`` moves. A few
of torch's modules leave no such trace, and are named here by type, with the modules
whose buffers a call of theirs updates; a call of one counts as a call that moved
them all:

- torch.ao's ``FusedMovingAvgObsFakeQuantize``, what ``prepare_qat`` inserts for the
  default "x86", "fbgemm" and "qnnpack" QAT qconfigs: one fused operator updates its
  scale and zero point and its observer's running min and max in place (no version
  moves), the observer module itself never called. It updates them whenever its
  observer is enabled, in training or not, which is a tensor's value: every call
  counts, and where the observer is disabled the snapshot holds the values as they
  stay (four small tensors).

Without this the recompute would read the statistics as the forward left them and
update them a second time (as torch.utils.checkpoint does): other gradients from the
second step on. A module that updates a buffer unversioned by other means (a custom
norm calling ``F.batch_norm`` on buffers without a counter, ``buffer.data = new``) is
not seen (docs/limits.md, "The in-place check").
"""
from __future__ import annotations

import torch

_FUSED_FAKE_QUANTIZE = getattr(torch.ao.quantization, "FusedMovingAvgObsFakeQuantize", None)


def unversioned_updates(module: torch.nn.Module) -> tuple:
    """The modules whose buffers a call of ``module`` updates without moving a version,
    ``module`` first; () for every module not named in NOTE [ Buffers a kernel updates
    unversioned ]."""
    if _FUSED_FAKE_QUANTIZE is not None and isinstance(module, _FUSED_FAKE_QUANTIZE):
        return module, module.activation_post_process
    return ()
