"""Channel centering: a lossy codec stores a convolution activation minus its
per-channel mean.

NOTE [ Channel centering ]

An 8-bit codec's error is relative to the values it stores: fp8 rounds each element
to about 2**-4 (e4m3) of its magnitude, int8 to a step of its group's largest
magnitude. What a network does next with a conv activation is mostly relative to its
channel's spread: a BatchNorm divides ``x - mean_c`` by ``std_c``, and its weight's
gradient, ``sum(dy * x_hat)``, sums that normalized value against the output
gradient with much cancellation. Where a channel's mean is comparable to its spread
(the residual stream of a pre-activation ResNet, a conv output before its
BatchNorm), most of the bits go to the offset. So a signed 4-D or 5-D tensor
(PyTorch's N, C, ... layout: dim 1 is the channel) is stored as ``x - m_c`` with
``m_c`` its channel means, kept exactly beside the codes (one fp32 per channel: the
channel's sum, which the kernels divide by its element count as they load it, the
bits of torch.mean on a CPU, for one operator on the host where a mean is two), and
decoded as ``decode(codes) + m_c``. The kernels do both, in fp32, as they load and
store (NOTE [ Channel means ] in triton_kernels/_channel_means.py).

Centered, a pre-activation ResNet's worst parameter gradient and that of a
conv-BN-ReLU chain whose last segment saves BatchNorm inputs gain under every lossy
codec (docs/results.md, "Gradient fidelity" and "Figures behind the code's rules").
The means are per channel, not per group: a group of 128 values straddles channels
at spatial sizes of 8x8 and below, and one mean for values of several channels fits
none of them (per-group means do worse than none there).

- Non-negative tensors are not centered: they go on the unsigned grid, which gains
  more (one bit) and which a subtracted mean would make signed again.
- Every float dtype the codecs take: float32, bfloat16 and float16 (AMP's
  activations), and float64 through float32: half types gain as float32 does
  (docs/results.md, "Figures behind the code's rules"). The means are of fp32 sums
  of the tensor's values. Decoding saturates ``decode + m`` at the output dtype's largest
  finite value, so a finite value comes back finite even where its mean carries it a
  rounding step past that value. A mean is subtracted only when ``|m| <= 2**100``,
  below half an ulp of fp32's largest binade (2**103), so ``x - m`` stays finite too.
- A channel whose mean is not finite (it holds an inf or a NaN) or beyond 2**100 is
  not centered (mean 0), so ``inf`` and NaN come back as they went in. The kernels
  (and references) take such a mean as 0 as they work it out: the sums are kept as the
  reduction gives them, with no pass of their own (NOTE [ Channel means ]).
- Cost: one read of the tensor for the means (one reduction). The kernels subtract them as they load
  and add them back as they store, so no centered copy is made: a copy would be live
  beside the tensor while it is encoded and raise the peak of a chain whose saves a
  lossy codec stores (tests/planning/test_memory_model.py). The planner's profile
  measures what is left (planning/codec_costs.py runs the codecs).
"""
from __future__ import annotations

from typing import Optional

import torch

from ..triton_kernels import SUPPORTED_DTYPES

# N, C, spatial...: conv activations, whose dim 1 is the channel; by rank, the
# dimensions a channel's mean reduces over.
_REDUCED_DIMS = {4: (0, 2, 3), 5: (0, 2, 3, 4)}


def channel_sums(x: torch.Tensor) -> Optional[torch.Tensor]:
    """The per-channel sums whose means to subtract from ``x`` (float32, shape ``(C,)``;
    the kernels' ``sums=``), or None where ``x`` is not centered: not a 4-D or 5-D
    float tensor the kernels take, or empty. One reduction, read back by nothing on the
    host; a mean that is not finite or beyond triton_kernels.MAX_MEAN is taken as 0 by
    the kernels that work it out (NOTE [ Channel means ])."""
    reduced = _REDUCED_DIMS.get(x.dim())
    if reduced is None or x.dtype not in SUPPORTED_DTYPES or x.numel() == 0:
        return None
    return torch.sum(x, reduced, dtype=torch.float32)
