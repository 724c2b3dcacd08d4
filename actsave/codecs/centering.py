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
``m_c`` its channel means, kept exactly beside the codes (one fp32 per channel), and
decoded as ``decode(codes) + m_c``. The kernels do both, in fp32, as they load and
store (NOTE [channel means] in triton_kernels/_rounding.py).

Measured with ``python bench/fidelity.py --batch-sizes 8 --models
convbnrelu16,resnet164`` (CPU, 8 seeded batches), before (19623fb) -> after
(f3d9ca9). ResNet-164 (pre-activation, 16x16, balanced): worst meaningful parameter
gradient int8 29.4 -> 31.3 dB, e4m3 17.0 -> 19.7, e5m2 12.6 -> 14.5; the median over
batches of the worst tensor 31.1 -> 33.4, 19.4 -> 21.1, 13.2 -> 15.8; all gradients
together 40.3 -> 41.8, 28.1 -> 30.3, 22.0 -> 24.3. Its balanced plan differs too: with
no centered copy the planner's profile charges encoding less. On the conv-BN-ReLU
chain with its segment inputs on ReLU outputs ("sqrt", sequential.py), the last
segment's saved BatchNorm inputs lift the worst tensor from 23.3 to 26.5 dB (e4m3)
and 17.5 to 20.4 (e5m2). Per-group means
(groups of 128 straddle channels at 8x8 and below) measured worse than none on
ResNet-164 (17.8 against 19.8 dB on one batch).

- Non-negative tensors are not centered: they go on the unsigned grid, which gains
  more (one bit) and which a subtracted mean would make signed again.
- Every float dtype the codecs take: float32, bfloat16 and float16 (AMP's
  activations), and float64 through float32. On bfloat16 models (``python
  bench/fidelity.py --batch-sizes 8 --models resnet56,resnet164 --dtype bfloat16``,
  CPU), before (c38bfe1, float32 only) -> after (dfd7c2f): all gradients together,
  ResNet-56 int8 / e4m3 / e5m2 36.4 / 31.3 / 26.6 -> 36.5 / 32.5 / 28.1 dB, ResNet-164
  30.4 / 26.4 / 22.0 -> 30.6 / 27.5 / 23.5; the median worst tensor 30.5 / 21.5 / 16.0
  -> 31.0 / 22.8 / 17.0 and 25.1 / 17.9 / 12.4 -> 25.6 / 19.6 / 14.5. The means are fp32 sums of the
  tensor's values. Decoding saturates ``decode + m`` at the output dtype's largest
  finite value, so a finite value comes back finite even where its mean carries it a
  rounding step past that value. A mean is subtracted only when ``|m| <= 2**100``,
  below half an ulp of fp32's largest binade (2**103), so ``x - m`` stays finite too.
- A channel whose mean is not finite (it holds an inf or a NaN) or beyond 2**100 is
  not centered (mean 0), so ``inf`` and NaN come back as they went in.
- Cost: one read of the tensor for the means. The kernels subtract them as they load
  and add them back as they store, so no centered copy is made: one was, first, and
  it rose the peak of a chain stored whole by int8 from 0.46 to 0.52 of exact
  (tests/planning/test_memory_model.py). The planner's profile measures what is left
  (planning/profiler.py runs the codecs).
"""
from __future__ import annotations

from typing import Optional

import torch

from ..triton_kernels import SUPPORTED_DTYPES

# Largest channel mean that is subtracted: see the NOTE (finite values stay finite).
MAX_OFFSET = 2.0**100
_CENTERED_RANKS = (4, 5)  # N, C, spatial...: conv activations, whose dim 1 is the channel


def channel_offsets(x: torch.Tensor) -> Optional[torch.Tensor]:
    """The per-channel means to subtract from ``x`` (float32, shape ``(C,)``), or None
    where ``x`` is not centered: not a 4-D or 5-D float tensor the kernels take, or
    empty. Reads no value back to the host."""
    if x.dim() not in _CENTERED_RANKS or x.dtype not in SUPPORTED_DTYPES or x.numel() == 0:
        return None
    means = torch.mean(x, dim=[0, *range(2, x.dim())], dtype=torch.float32)
    return torch.where(means.abs() <= MAX_OFFSET, means, torch.zeros((), dtype=means.dtype, device=means.device))
