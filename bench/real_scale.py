"""The depth sweep at real scale, on meta tensors: where users hurt, without the GPU.

For each provider and depth, :func:`actsave.estimate` runs one training step of the
model on meta tensors standing for a device (CUDA by default: its 512-byte blocks,
the Triton codecs' allocations, offload to a separate host memory) and reports the
device's activation peak and the host bytes offloaded. The models are built on the
meta device too, so ResNet-2000 costs neither memory nor initialisation.

Then, per provider, the deepest model whose device activation peak fits the one plain
PyTorch needs at ``reference_depth`` (ResNet-110): a budget made of activations only,
so that the search measures checkpointing, not parameters and gradients. The search is
harness.deepest_fitting's, seeded with the swept depths, and stops at ``depth_cap``
(a provider that still fits there gets a lower bound).

How far to trust the figures: the harness validates actsave.estimate against real
steps at small scale in the same run (the ``est act`` column, within 2% by the
issue's bar, measured within 0.01% on CPU). Figures are allocations, not what the
CUDA caching allocator reserves; device-specific kernels (cuDNN workspaces) are
not in them (actsave/estimate.py, "Limits").
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

import actsave
import harness


@dataclass(frozen=True)
class RealScale:
    """The real-scale stage of a sweep (see the module docstring)."""

    workload: harness.Workload  # its build(depth) and depth/blocks conversions
    input_shape: tuple
    depths: tuple
    reference_depth: int
    depth_cap: int
    device: str = "cuda"

    @property
    def case(self) -> str:
        shape = "x".join(str(d) for d in self.input_shape)
        return f"{self.workload.config['model']} {shape}, meta tensors, {self.device} accounting"

    def estimate(self, provider: harness.Provider, depth: int) -> actsave.MemoryEstimate:
        with torch.device("meta"):  # the parameters too: no memory, nothing to initialise
            chain = self.workload.build(depth)
        model = provider.build(chain, None, None)
        return actsave.estimate(model, self.input_shape, device=self.device)

    def run(self, providers: list, seconds: float, notes: list) -> tuple:
        """(device peak and host bytes of every simulable provider at every depth,
        their max depths within the reference's activation peak)."""
        simulable = [name for name in providers if not harness.PROVIDERS[name].timed_plan]
        notes += [f"{name}: plans from a timed step, so it has no meta-tensor figures"
                  for name in providers if name not in simulable]
        swept = self._sweep(simulable)
        return swept, self._max_depths(simulable, swept, seconds)

    def _sweep(self, providers: list) -> list:
        progress = harness.Progress(len(self.depths) * len(providers), "real scale, meta tensors")
        measurements = []
        for depth in self.depths:
            for name in providers:
                progress.describe(f"depth {depth} {name}")
                estimate = self.estimate(harness.PROVIDERS[name], depth)
                measurements += [self._measurement(name, "est_device_peak", depth, estimate.activation_peak_bytes),
                                 self._measurement(name, "est_host_bytes", depth, estimate.host_peak_bytes)]
                progress.advance()
        progress.close()
        return measurements

    def _measurement(self, name: str, metric: str, depth: int, nbytes: int) -> harness.Measurement:
        return harness.Measurement(name, metric, "depth", depth, (nbytes / harness.MiB,), self._config(), self.case)

    def _config(self) -> dict:
        return {"input_shape": list(self.input_shape), "accounting": self.device, "estimator": "actsave.estimate"}

    def _max_depths(self, providers: list, swept: list, seconds: float) -> list:
        budget = self.estimate(harness.PROVIDERS[harness.REFERENCE], self.reference_depth).activation_peak_bytes
        seeds = {name: {} for name in providers}
        seeds.setdefault(harness.REFERENCE, {})[self.reference_depth] = budget
        for m in swept:
            if m.metric == "est_device_peak":
                seeds[m.provider][m.x_value] = m.values[0] * harness.MiB
        search = harness.MaxDepthSearch(
            self.workload, budget, lambda name, depth: self.estimate(harness.PROVIDERS[name], depth).activation_peak_bytes,
            seeds, method="meta_estimate", x_name="act_budget_MiB", cap_depth=self.depth_cap)
        results = harness.search_max_depths(search, providers, seconds)
        return [harness.Measurement(m.provider, m.metric, m.x_name, m.x_value, m.values,
                                    {**m.config, **self._config(), "reference_depth": self.reference_depth}, self.case)
                for m in results]

    def report(self, swept: list, max_depths: list) -> str:
        """The real-scale table (device peak, host bytes, ratio to plain PyTorch), then
        the max depths."""
        medians = harness._medians(swept)
        providers = list(dict.fromkeys(m.provider for m in swept))
        lines = [("depth", "provider", "device peak MiB", "vs torch", "vs torch_ckpt", "host MiB")]
        for depth in sorted({m.x_value for m in swept}):
            for name in providers:
                peak = medians[(depth, name, "est_device_peak")]
                ratios = [medians.get((depth, other, "est_device_peak")) for other in (harness.REFERENCE, "torch_ckpt")]
                lines.append((str(depth), name, f"{peak:.1f}", *(f"{peak / r:.3f}x" if r else "-" for r in ratios),
                              f"{medians[(depth, name, 'est_host_bytes')]:.1f}"))
        budget = max_depths[0].x_value if max_depths else float("nan")
        return "\n".join([
            f"real scale on meta tensors ({self.case}): actsave.estimate",
            harness._fixed_width(lines, left_aligned={1}),
            f"\nmax depth whose device activation peak fits plain PyTorch's at depth {self.reference_depth} "
            f"({budget:.1f} MiB), meta estimates:",
            harness.max_depth_table(max_depths),
        ])

