"""How deep a ResNet trains in the same memory: plain PyTorch, torch's
checkpoint_sequential and the actsave modes, side by side.

Two stages (bench/harness/, bench/real_scale.py):

1. Measured. Trains CIFAR-style pre-activation bottleneck ResNets (depth 9n + 2, flat
   nn.Sequential from bench/models.py) one step at a time and reports, per depth and
   provider: peak memory, peak activation memory and its prediction on meta tensors
   (actsave.estimate, to validate stage 2), bytes actsave keeps, step time and its
   ratio to plain PyTorch (providers interleaved, medians), and the worst gradient
   SQNR against plain PyTorch.
2. Real scale, on meta tensors: ResNet-164 to ResNet-2000 at batch 128 on 32x32
   images, as on a CUDA device: device peak and host bytes per provider; then per
   provider the deepest ResNet whose device activation peak fits what plain ResNet-110
   needs ("N times deeper in the same activation memory").

The CPU defaults of stage 1 are small (batch 8, 16x16 images, depths 29 to 164, one
intra-op thread) so that it finishes in a few minutes on two cores and still shows the
memory curves; CPU times are indicative only. On CUDA stage 1 goes to ResNet-1001 at
batch 64 on 32x32 images (a depth that does not fit is reported and skipped).

The CSV and the PNG go to bench/results/local/ (ignored by git); --record updates the
committed bench/results/<device>.csv and its PNG instead.

    python bench/resnet_depth_sweep.py                      # the defaults of this device
    python bench/resnet_depth_sweep.py --record             # the committed results (make bench BENCH_ARGS=--record)
    python bench/resnet_depth_sweep.py --replot --record    # the committed PNG drawn again from the committed CSV
    python bench/resnet_depth_sweep.py --depths 164,1001 --batch 64 --scale-depths 1001,2000
"""
from __future__ import annotations

import sys

import torch

import harness
from models import cifar_blocks_per_stage, cifar_resnet
from real_scale import RealScale

NUM_CLASSES = 10
_REAL_SCALE = {"scale_depths": "164,542,1001,2000", "scale_batch": "128", "scale_image_size": "32",
               "reference_depth": "110", "depth_cap": "4403"}  # 40x ResNet-110
DEFAULTS = {  # as typed on the command line; --help shows them
    "cpu": {"depths": "29,56,110,164", "batch": "8", "image_size": "16", "budget": "32MiB",
            "repeats": "5", "search_seconds": "600", "threads": "1", **_REAL_SCALE},
    "cuda": {"depths": "110,164,272,542,1001", "batch": "64", "image_size": "32", "budget": "8GiB",
             "repeats": "10", "search_seconds": "600", "threads": "0", **_REAL_SCALE},
    "smoke": {"depths": "11,20", "batch": "2", "image_size": "8", "budget": "2MiB",
              "repeats": "1", "search_seconds": "20", "threads": "1",
              "scale_depths": "11,20", "scale_batch": "2", "scale_image_size": "8", "reference_depth": "11",
              "depth_cap": "47"},
}
OPTIONS = {
    "image_size": (int, "input height and width"),
    "scale_depths": (harness.parse_depths, "depths of the real-scale stage, on meta tensors"),
    "scale_batch": (int, "batch of the real-scale stage"),
    "scale_image_size": (int, "image height and width of the real-scale stage"),
    "reference_depth": (int, "plain ResNet whose activation peak is the real-scale max-depth budget"),
    "depth_cap": (int, "deepest ResNet the real-scale max-depth search probes"),
}


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
        depth_name="ResNet-{}",
    )


def real_scale(args) -> RealScale:
    for depth in (*args.scale_depths, args.reference_depth, args.depth_cap):
        cifar_blocks_per_stage(depth)  # a depth the family cannot build fails now, not mid-run
    shape = (args.scale_batch, 3, args.scale_image_size, args.scale_image_size)
    return RealScale(workload(args.scale_batch, args.scale_image_size), shape, tuple(args.scale_depths),
                     args.reference_depth, args.depth_cap)


def main(argv=None) -> None:
    args = harness.parse_arguments(argv, __doc__, DEFAULTS, OPTIONS)
    harness.run_benchmark(workload(args.batch, args.image_size), args, real_scale(args))


if __name__ == "__main__":
    harness.imports_frozen()  # NOTE [ A script's imports, frozen ]
    main(sys.argv[1:])
