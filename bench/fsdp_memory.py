"""actsave under FSDP2, measured (issue 35, item 5): a training step's activation peak,
sharded on 2 CPU ranks (gloo) against unsharded, beside the balanced plan's prediction.

A chain of (Linear, GELU) pairs, each Linear its own ``fully_shard`` unit, run as
``nn.Sequential`` (plain), ``CheckpointedSequential(segments="sqrt")``, with the
default segments (balanced), with the unsharded model's balanced segments (on the
sharded chain: a plan that counts no gathered parameters), balanced with the chain as
the one unit (no Linear its own: what no plan counts), and balanced compiled
(``model.compile()``, aot_eager, after sharding). Peak: how far the CPU allocator's
bytes rise over one training step (forward, backward from an output gradient of ones),
the step after the one that plans and allocates gradients, plus the batch: what a
plan's ``predicted_peak_bytes`` counts. The allocator's own total of the bytes every
thread allocated (harness.process_allocator_peak), the process's count, not actsave's:
FSDP2 frees and refills each unit's gathered parameters in place
(``storage.resize_``), and gloo's worker threads free some of a collective's tensors
(NOTE [ Frees on other threads ] in bench/harness/measure.py). Under FSDP2 the peak
includes what FSDP2 allocates itself (gathered parameters, unsharded gradients, its
communication buffers); the larger of the two ranks' is reported. Gloo frees some
buffers on its threads a moment after the collective, which the peak sometimes holds;
so the step is measured too as rank 0 of two over torch's fake process group (one
process, collectives that move no data, every free on the calling thread): FSDP2's own
allocations, run for run the same.

    python bench/fsdp_memory.py            # width 256, batch 512, 8 pairs
    python bench/fsdp_memory.py --smoke    # tiny, for the tests
"""
import argparse
import os
import socket
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import actsave  # noqa: E402
from actsave.planning import plans  # noqa: E402
from actsave.text import format_table  # noqa: E402
from harness import count_frees_on_every_thread, imports_frozen, process_allocator_peak  # noqa: E402

UNSHARDED_SEGMENTS = "unsharded plan's segments"
ONE_UNIT = "balanced, one unit"
MODES = ("plain", "sqrt", "balanced", UNSHARDED_SEGMENTS, ONE_UNIT, "balanced, compiled")
WORLD_SIZE = 2


def build(mode: str, width: int, pairs: int, starts: tuple, shard: bool = False) -> nn.Module:
    """The model of ``mode``, sharded first where ``shard``; a compiled mode is
    compiled after sharding (aot_eager), as FSDP2 and torch.compile compose.
    ``starts``: the unsharded model's balanced segments (UNSHARDED_SEGMENTS)."""
    torch.manual_seed(0)
    layers = [m for _ in range(pairs) for m in (nn.Linear(width, width), nn.GELU())]
    segments = {UNSHARDED_SEGMENTS: list(starts), ONE_UNIT: "balanced"}.get(mode, mode.removesuffix(", compiled"))
    model = nn.Sequential(*layers) if mode == "plain" else actsave.CheckpointedSequential(*layers, segments=segments)
    if shard:
        model = sharded(model, per_layer=mode != ONE_UNIT)
    if mode.endswith(", compiled"):
        model.compile(backend="aot_eager")
    return model


def step_peak(model: nn.Module, x: torch.Tensor, mode: str, starts: tuple) -> tuple:
    """(measured peak, the batch included; the plan's predicted peak or None): the
    balanced plan's, or for UNSHARDED_SEGMENTS those segments' as the model predicts
    them on this (maybe sharded) chain."""

    def step():
        out = model(x)
        out.backward(torch.ones_like(out))

    step()  # plans (balanced) and allocates the gradients
    peak = process_allocator_peak(step) + x.numel() * x.element_size()
    if mode == UNSHARDED_SEGMENTS:
        profile = actsave.profile(model, (torch.empty_like(x, device="meta").requires_grad_(),))
        return peak, plans.predict(profile, list(starts)).predicted_peak_bytes
    plan = getattr(model, "balanced_plan", None)
    return peak, None if plan is None else plan.predicted_peak_bytes


def peaks(shape: tuple, starts: tuple, shard: bool) -> dict:
    """mode -> step_peak of each mode's model."""
    width, batch, pairs = shape
    x = torch.randn(batch, width).requires_grad_()
    return {mode: step_peak(build(mode, width, pairs, starts, shard), x, mode, starts) for mode in MODES}


def unsharded_starts(shape: tuple) -> tuple:
    """The segments the unsharded model's balanced plan chooses."""
    width, batch, pairs = shape
    model = build("balanced", width, pairs, ())
    model(torch.randn(batch, width).requires_grad_()).sum().backward()
    return model.balanced_plan.starts


def sharded(model: nn.Module, per_layer: bool = True) -> nn.Module:
    """``model`` sharded: each Linear a unit where ``per_layer``, and the model one."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (WORLD_SIZE,))
    for layer in model if per_layer else ():
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def rank_main(rank: int, port: int, shape: tuple, starts: tuple, queue) -> None:
    count_frees_on_every_thread()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD_SIZE)
    try:
        queue.put((rank, peaks(shape, starts, shard=True)))
    finally:
        dist.destroy_process_group()


def fake_rank_peaks(shape: tuple, starts: tuple) -> dict:
    """mode -> (rank 0's peak over the fake process group, its prediction)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=WORLD_SIZE)
    try:
        return peaks(shape, starts, shard=True)
    finally:
        dist.destroy_process_group()


def sharded_peaks(shape: tuple, starts: tuple) -> dict:
    """mode -> (the larger rank's peak, rank 0's prediction): the ranks run the same
    shapes and plan alike."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    context = mp.get_context("spawn")
    queue = context.Queue()
    ranks = [context.Process(target=rank_main, args=(rank, port, shape, starts, queue)) for rank in range(WORLD_SIZE)]
    for process in ranks:
        process.start()
    results = dict(queue.get(timeout=300) for _ in ranks)
    for process in ranks:
        process.join()
    return {mode: (max(results[rank][mode][0] for rank in results), results[0][mode][1]) for mode in MODES}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="width 64, batch 128, 4 pairs")
    args = parser.parse_args(argv)
    count_frees_on_every_thread()
    torch.set_num_threads(1)
    width, batch, pairs = (64, 128, 4) if args.smoke else (256, 512, 8)
    shape = width, batch, pairs
    starts = unsharded_starts(shape)
    unsharded = peaks(shape, starts, shard=False)
    fsdp, fake = sharded_peaks(shape, starts), fake_rank_peaks(shape, starts)
    rows = [["mode", "unsharded peak MiB", "predicted MiB", "FSDP2 peak MiB, gloo", "FSDP2 peak MiB, fake",
             "predicted MiB", "fake / predicted"]]
    for mode in MODES:
        (peak, predicted), (gloo_peak, _), (fake_peak, fsdp_predicted) = unsharded[mode], fsdp[mode], fake[mode]
        ratio = "-" if fsdp_predicted is None else f"{fake_peak / fsdp_predicted:.3f}"
        rows.append([mode, _mib(peak), _mib(predicted), _mib(gloo_peak), _mib(fake_peak), _mib(fsdp_predicted),
                     ratio])
    print(f"{pairs} x (Linear {width}, GELU), batch {batch}, fp32, CPU, {WORLD_SIZE} ranks (gloo, and fake); "
          f"one Linear's parameters: {(width * width + width) * 4 / 2**20:.3f} MiB")
    print(format_table(rows))


def _mib(nbytes) -> str:
    return "-" if nbytes is None else f"{nbytes / 2**20:.3f}"


if __name__ == "__main__":
    imports_frozen()  # NOTE [ A script's imports, frozen ]
    main()
