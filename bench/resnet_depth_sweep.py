"""How deep a ResNet trains in the same memory: plain PyTorch, torch's
checkpoint_sequential and the actsave modes, side by side.

Trains CIFAR-style pre-activation bottleneck ResNets (depth 9n + 2, flat
nn.Sequential from bench/models.py) one step at a time and reports, per depth and
provider: peak memory, peak activation memory, bytes actsave keeps, step time and
its ratio to plain PyTorch, and the worst gradient SQNR against plain PyTorch. Then,
per provider, the deepest ResNet whose training step fits --budget ("N times deeper
in the same memory"), found by real measurements.

The CPU defaults are small (batch 8, 16x16 images, depths 29 to 164, budget 32 MiB,
one intra-op thread) so that the sweep finishes in about a minute and a half on two
cores and still shows the memory curves; CPU times are indicative only. On CUDA the
sweep goes to ResNet-1001 at batch 64 on 32x32 images (a depth that does not fit is
reported and skipped).

    python bench/resnet_depth_sweep.py                      # the defaults of this device
    python bench/resnet_depth_sweep.py --depths 164,1001 --batch 64 --budget 8GiB
"""
from __future__ import annotations

import sys

import torch

import harness
from models import cifar_blocks_per_stage, cifar_resnet

NUM_CLASSES = 10
DEFAULTS = {  # as typed on the command line; --help shows them
    "cpu": {"depths": "29,56,110,164", "batch": "8", "image_size": "16", "budget": "32MiB",
            "repeats": "3", "search_seconds": "150", "threads": "1"},
    "cuda": {"depths": "110,164,272,542,1001", "batch": "64", "image_size": "32", "budget": "8GiB",
             "repeats": "10", "search_seconds": "300", "threads": "0"},
    "smoke": {"depths": "11,20", "batch": "2", "image_size": "8", "budget": "2MiB",
              "repeats": "1", "search_seconds": "5", "threads": "1"},
}
OPTIONS = {"image_size": (int, "input height and width")}


def workload(batch: int, image_size: int) -> harness.Workload:
    def make_batch(generator: torch.Generator) -> tuple:
        images = torch.randn(batch, 3, image_size, image_size, generator=generator)
        return images, torch.randint(0, NUM_CLASSES, (batch,), generator=generator)

    return harness.Workload(
        bench="resnet_depth_sweep",
        case=f"cifar_resnet b{batch} {image_size}x{image_size}",
        build=lambda depth: cifar_resnet(depth, num_classes=NUM_CLASSES),
        make_batch=make_batch,
        depth_of_blocks=lambda n: 9 * n + 2,
        blocks_of_depth=cifar_blocks_per_stage,
        config={"model": "cifar_resnet (pre-activation bottleneck)", "batch": batch, "image_size": image_size},
    )


def main(argv=None) -> None:
    args = harness.parse_arguments(argv, __doc__, DEFAULTS, OPTIONS)
    harness.run_benchmark(workload(args.batch, args.image_size), args)


if __name__ == "__main__":
    main(sys.argv[1:])
