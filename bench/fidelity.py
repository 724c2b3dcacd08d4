"""Gradient fidelity of the 8-bit codecs: how far the parameter gradients of a
compressed checkpoint are from the exact ones, and whether that matters next to the
noise SGD already has.

Per case (a model from bench/models.py, a batch size, a segmentation) the same seeded
weights train on K seeded batches b_1..b_K, one step each, with no update in between:
``actsave.CheckpointedSequential(compress=codec)`` for each codec, and the reference,
the same chain with ``compress=None`` (exact: bit-identical to plain ``nn.Sequential``,
which is checked on b_1, else the script stops). A step is forward, cross-entropy
loss and backward, BatchNorm in training mode; the model's state_dict is restored
before every step, so every run sees the same running statistics. Per codec:

- ``worst_tensor_sqnr``: per batch, the lowest SQNR over the *meaningful* parameter
  gradients: those whose exact norm is at least 1e-4 of the largest (a conv bias
  before a BatchNorm has a true gradient of zero, and its SQNR measures rounding
  noise). The row's percentiles are over the K batches; the table shows the worst
  batch with its tensor's name, and the median.
- ``overall_sqnr``: per batch, the SQNR of all parameter gradients concatenated.
- ``codec_var_ratio``: codec noise over minibatch sampling noise (ActNN's argument:
  compression error matters only relative to the noise of SGD). With g(b) every
  parameter gradient concatenated:
  codec = mean_k ||g_codec(b_k) - g_exact(b_k)||^2 (a mean squared error: the codec's
  variance plus its squared bias), sampling = K/(K-1) mean_k ||g_exact(b_k) - mean_j
  g_exact(b_j)||^2 (the unbiased trace of the covariance of a minibatch gradient).

MaxPool decisions. A max pool recomputed from a lossy kept input may pick another
pixel of a window than the forward did, and route that window's gradient there; a
lossy checkpoint therefore keeps each window's decision (a few bits per pooled output)
and its recompute pools at them (actsave/runtime/pool_decisions.py, NOTE [ Max-pool
decisions ]). The cases with max pools (``pooledresnet``: bench/models.py) are measured
twice per codec:

- as actsave runs them (the rows of the main table);
- as is: the same model with each pool a :class:`PassThroughMaxPool2d`, which pools
  exactly like ``nn.MaxPool2d`` but which actsave does not recognise, so its recompute
  decides anew (what actsave did before it kept the decisions). A
  :class:`WindowDecisions` instrument counts ``maxpool_argmax_changed``, per batch the
  percentage of recomputed windows whose argmax differs from the forward's (max pools
  in the last segment, which is not recomputed, do not count), and the usual SQNRs
  are ``worst_tensor_sqnr_pools_as_is`` and ``overall_sqnr_pools_as_is``.

The per-batch difference of the two is what keeping the decisions buys. Where a
segment's plan leaves no max pool to a lossy recompute (at 32x32, batch 8 and 32,
``"balanced"`` keeps the batch exactly before the stem's pool and puts the other two
in the last segment), the gain is zero by construction; ``"sqrt"`` starts two segments
at a pool. Measured there (CPU, K = 8, batch 8): 0.38% of the windows change with
int8, 1.9% with e4m3, 3.7% with e5m2; the worst meaningful tensor goes from 16.6 to
36.5 dB (int8), 6.4 to 20.3 (e4m3) and 5.0 to 15.7 (e5m2) on the worst batch.

SQNR is ``harness.sqnr_db``: ``20*log10(|ref| / |ref - x|)``. Rows go to
<device>.csv (bench ``fidelity``) in bench/results/local/, or with --record in the
committed bench/results/; the targets of issue 13 are judged
at the end (on the worst batch), where the run has their cases.

    python bench/fidelity.py              # about 5 minutes on two loaded CPU cores, plus 4 for the pooled cases
    python bench/fidelity.py --batches 4 --batch-sizes 8
    python bench/fidelity.py --batch-sizes 8 --models pooledresnet14   # the MaxPool case alone
    python bench/fidelity.py --batch-sizes 8 --models resnet56,resnet164 --dtype bfloat16   # bf16 models
    python bench/fidelity.py --batch-sizes 8 --models resnet164 --segments finest   # every layer its own segment

``--segments`` runs every case at one segmentation instead of its own. ``finest``
gives every layer its own segment: the shortest recompute from each kept input, and
the most kept inputs. On the pre-activation ResNets, whose kept inputs are signed
block sums in every plan, comparing it with the balanced plan tells the codec's
precision from the plan's share of the error. Measured (CPU, batch 8, worst tensor
over 8 batches, at 1fd6915; balanced in brackets): ResNet-164 int8 31.7 (31.3), e4m3
21.3 (19.7), e5m2 13.4 (14.5) dB; ResNet-56 32.0 (32.0), 19.1 (19.3), 15.2 (13.6). On
the conv-BN-ReLU chain ``"sqrt"`` does better than either: its boundaries fall on ReLU
outputs, which the codec stores on its unsigned grid.

With ``--dtype bfloat16`` or ``float16`` the reference is the model in that dtype. There
the exact gradient of a conv bias before a BatchNorm, zero in exact arithmetic, is
rounding noise above the ``MEANINGFUL`` floor, so the conv-BN-ReLU chain's worst tensor
reads about -4 dB; read its overall SQNR (the ResNets' convs have no bias).
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import statistics
import sys
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

import harness
from models import cifar_resnet, conv_bn_relu_chain, pooled_resnet

import actsave
from actsave.text import format_table

BENCH = "fidelity"
CODECS = ("int8", "fp8_e4m3", "fp8_e5m2")
MEANINGFUL = 1e-4  # a gradient below this share of the largest norm is (numerically) zero
NUM_CLASSES = 10


@dataclass(frozen=True)
class Case:
    """A model, its input shape (without the batch) and a segmentation."""

    model: str  # as printed, e.g. "resnet164"
    build: Callable[[], nn.Sequential]
    input_shape: tuple
    segments: str  # "balanced", "sqrt" or FINEST


FINEST = "finest"  # every layer its own segment


def cases(smoke: bool) -> list:
    """ResNet-56 and ResNet-164 at 16x16 (the depth sweep's CPU shapes) at the default
    segmentation; the flat conv-BN-ReLU chain and the max-pooling ResNet (2 basic
    blocks per stage, 14 layers deep, at 32x32: its three pools leave 4x4 for the
    head) at the default and at ``"sqrt"``. Smoke: ResNet-11 and a 4-block chain at
    8x8, a pooled ResNet of one block per stage at 16x16 at ``"sqrt"``."""
    size = 8 if smoke else 16
    depths, blocks, pooled_blocks = ((11,), 4, 1) if smoke else ((56, 164), 16, 2)
    chain = f"convbnrelu{blocks}"
    found = [Case(f"resnet{d}", lambda d=d: cifar_resnet(d, NUM_CLASSES), (3, size, size), "balanced")
             for d in depths]
    for segments in ("balanced", "sqrt"):
        found.append(Case(chain, lambda: conv_bn_relu_chain(blocks, 16, size, NUM_CLASSES), (16, size, size), segments))
    # Balanced plans leave the smoke model's pools where nothing recomputes them.
    for segments in ("sqrt",) if smoke else ("balanced", "sqrt"):
        found.append(Case(f"pooledresnet{2 + 6 * pooled_blocks}",
                          lambda: pooled_resnet(pooled_blocks, num_classes=NUM_CLASSES),
                          (3, 2 * size, 2 * size), segments))
    return found


class PassThroughMaxPool2d(nn.MaxPool2d):
    """``nn.MaxPool2d`` with a ``forward`` of its own, which actsave does not recognise
    as a plain max pool: a lossy recompute of it decides its windows anew."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x)


def pools_as_is(base: nn.Sequential) -> nn.Sequential:
    """A deep copy of ``base`` whose max pools are :class:`PassThroughMaxPool2d`."""
    model = copy.deepcopy(base)
    for module in model.modules():
        if type(module) is nn.MaxPool2d:
            module.__class__ = PassThroughMaxPool2d
    return model


def max_pools(model: nn.Module) -> list:
    return [m for m in model.modules() if isinstance(m, nn.MaxPool2d)]


class WindowDecisions:
    """A bench instrument: records the window decisions (argmax indices) of each max
    pool's forward call and counts how many its recompute call, from its own input,
    takes otherwise (``changed`` of ``windows``). The caller says which call is which
    (``phase``): a segment's recompute runs the same module again, in backward."""

    def __init__(self, model: nn.Module):
        self.phase = "forward"
        self.changed = self.windows = 0
        self._decisions = {}
        for pool in max_pools(model):
            pool.register_forward_pre_hook(self._before_pool)

    def _before_pool(self, pool: nn.MaxPool2d, args: tuple) -> None:
        with torch.no_grad():
            _, indices = F.max_pool2d(args[0], pool.kernel_size, pool.stride, pool.padding, pool.dilation,
                                      pool.ceil_mode, return_indices=True)
        if self.phase == "forward":
            self._decisions[pool] = indices  # also a meta step's, overwritten by the real forward
            return
        forward = self._decisions.get(pool)
        if forward is None or forward.shape != indices.shape:
            raise RuntimeError("WindowDecisions: a recompute without its forward (set the phase per step)")
        self.windows += indices.numel()
        self.changed += int((indices != forward).sum())

    def take_percent(self):
        """The percentage of recomputed windows that changed since the last call (None
        if no pool was recomputed), then zero."""
        percent = 100 * self.changed / self.windows if self.windows else None
        self.changed = self.windows = 0
        return percent


def seeded_batches(shape: tuple, batch: int, count: int, device) -> list:
    generator = torch.Generator().manual_seed(harness.SEED)
    return [(torch.randn(batch, *shape, generator=generator).to(device),
             torch.randint(0, NUM_CLASSES, (batch,), generator=generator).to(device)) for _ in range(count)]


def step_gradients(model: nn.Module, state: dict, batch: tuple, decisions: WindowDecisions = None) -> dict:
    """Parameter gradients (name -> tensor) of one training step from ``state``."""
    model.load_state_dict(state)  # the same BatchNorm running statistics every step
    model.zero_grad(set_to_none=True)
    inputs, targets = batch
    if decisions is not None:
        decisions.phase = "forward"
    loss = F.cross_entropy(model(inputs), targets)
    if decisions is not None:
        decisions.phase = "recompute"
    loss.backward()
    return {name: p.grad.detach().clone() for name, p in model.named_parameters()}


def checkpointed(case: Case, base: nn.Sequential, compress, device) -> actsave.CheckpointedSequential:
    """A deep copy of ``base`` on ``device`` as a CheckpointedSequential at the case's
    segmentation, keeping by ``compress``."""
    segments = len(base) if case.segments == FINEST else case.segments
    return actsave.CheckpointedSequential.from_sequential(
        copy.deepcopy(base).to(device), segments=segments, compress=compress)


def run_gradients(case: Case, base: nn.Sequential, batches: list, compress, device,
                  count_windows: bool = False) -> tuple:
    """Per batch, the gradients of ``base`` (a deep copy) as a CheckpointedSequential,
    and with ``count_windows`` the percentage of recomputed max-pool windows whose
    decision changed (None where no max pool was recomputed)."""
    model = checkpointed(case, base, compress, device)
    decisions = WindowDecisions(model) if count_windows else None
    state = copy.deepcopy(model.state_dict())
    gradients, changed = [], []
    for batch in batches:
        gradients.append(step_gradients(model, state, batch, decisions))
        changed.append(decisions.take_percent() if decisions else None)
    return gradients, (None if None in changed else changed)


def check_exact(base: nn.Sequential, batch: tuple, reference: dict, device) -> None:
    """Stop unless the compress=None reference equals plain torch bit for bit."""
    plain = copy.deepcopy(base).to(device)
    grads = step_gradients(plain, copy.deepcopy(plain.state_dict()), batch)
    different = [name for name, g in grads.items() if not torch.equal(g, reference[name])]
    if different:
        raise SystemExit(f"the compress=None reference differs from nn.Sequential at {different[:4]}")


def worst_meaningful(exact: dict, lossy: dict) -> tuple:
    """``(dB, name)``: the lowest SQNR over tensors whose exact gradient norm is at
    least ``MEANINGFUL`` of the largest."""
    norms = {name: torch.linalg.vector_norm(g.double()).item() for name, g in exact.items()}
    floor = MEANINGFUL * max(norms.values())
    return min((harness.sqnr_db(exact[name], lossy[name]), name) for name in exact if norms[name] >= floor)


def flat(grads: dict) -> torch.Tensor:
    return torch.cat([g.flatten().double() for g in grads.values()])


def variance_ratio(exact: list, lossy: list) -> float:
    """mean_k |g_codec - g_exact|^2 over the unbiased minibatch sampling variance."""
    exact_flat = [flat(g) for g in exact]
    codec = statistics.fmean((flat(c) - e).square().sum().item() for c, e in zip(lossy, exact_flat))
    mean = torch.stack(exact_flat).mean(0)
    sampling = sum((e - mean).square().sum().item() for e in exact_flat) / (len(exact_flat) - 1)
    return codec / sampling


@dataclass(frozen=True)
class Result:
    case: Case
    batch: int
    codec: str
    worst: list  # per batch: (dB, tensor name)
    overall: list  # per batch: dB
    var_ratio: float
    # Cases with max pools, per batch, the pools recomputed as is (deciding anew): the %
    # of recomputed windows whose argmax changed, and the SQNRs.
    dtype: torch.dtype = torch.float32  # of the model and its inputs, reference included
    argmax_changed: list | None = None
    as_is_worst: list | None = None
    as_is_overall: list | None = None


def measure_case(case: Case, batch: int, count: int, device, progress: harness.Progress,
                 dtype: torch.dtype = torch.float32) -> list:
    """One :class:`Result` per codec for ``case`` at ``batch``, model and inputs in ``dtype``."""
    torch.manual_seed(harness.SEED)
    base = case.build().to(dtype)
    batches = [(inputs.to(dtype), targets)
               for inputs, targets in seeded_batches(case.input_shape, batch, count, device)]
    progress.describe(f"{case.model} b{batch} {case.segments}: exact")
    exact, _ = run_gradients(case, base, batches, None, device)
    check_exact(base, batches[0], exact[0], device)
    pooled = bool(max_pools(base))
    results = []
    for codec in CODECS:
        progress.describe(f"{case.model} b{batch} {case.segments}: {codec}")
        lossy, _ = run_gradients(case, base, batches, codec, device)
        result = Result(
            case, batch, codec, dtype=dtype,
            worst=[worst_meaningful(e, x) for e, x in zip(exact, lossy)],
            overall=[harness.sqnr_db(flat(e), flat(x)) for e, x in zip(exact, lossy)],
            var_ratio=variance_ratio(exact, lossy),
        )
        if pooled:  # the exact reference is the same: both pools compute max_pool2d
            as_is, changed = run_gradients(case, pools_as_is(base), batches, codec, device, count_windows=True)
            result = dataclasses.replace(
                result, argmax_changed=changed, as_is_worst=[worst_meaningful(e, x) for e, x in zip(exact, as_is)],
                as_is_overall=[harness.sqnr_db(flat(e), flat(x)) for e, x in zip(exact, as_is)])
        results.append(result)
        progress.advance()
    return results


# --------------------------------------------------------------------------- output


def table(results: list) -> str:
    lines = [("model", "segments", "batch", "codec", "worst tensor (worst batch)", "dB", "median dB",
              "overall dB", "codec/sampling var")]
    for r in results:
        db, name = min(r.worst)
        lines.append((r.case.model, r.case.segments, str(r.batch), r.codec, name, f"{db:.1f}",
                      f"{statistics.median(d for d, _ in r.worst):.1f}", f"{statistics.median(r.overall):.1f}",
                      _percent(r.var_ratio)))
    return format_table(lines)


def maxpool_table(results: list) -> str:
    """The cases with max pools: windows whose decision a recompute changes, and the
    SQNRs with the pools recomputed as is and as actsave recomputes them, at the
    forward's decisions (dB: worst batch; med: median over batches; gain: the median
    over batches of the per-batch difference)."""
    lines = [("model", "segments", "batch", "codec", "argmax changed", "worst tensor dB as is / kept",
              "med as is / kept", "gain dB", "overall dB as is / kept", "gain dB")]
    for r in results:
        if r.as_is_worst is None:
            continue
        worst_gain = statistics.median(k[0] - a[0] for k, a in zip(r.worst, r.as_is_worst))
        overall_gain = statistics.median(k - a for k, a in zip(r.overall, r.as_is_overall))
        changed = "-" if r.argmax_changed is None else f"{statistics.fmean(r.argmax_changed):.2f}%"
        lines.append((r.case.model, r.case.segments, str(r.batch), r.codec, changed,
                      f"{min(r.as_is_worst)[0]:.1f} / {min(r.worst)[0]:.1f}",
                      _median_pair([d for d, _ in r.as_is_worst], [d for d, _ in r.worst]), f"{worst_gain:+.2f}",
                      _median_pair(r.as_is_overall, r.overall),
                      f"{overall_gain:+.2f}"))
    return format_table(lines) if len(lines) > 1 else ""


def _median_pair(as_is: list, kept: list) -> str:
    return f"{statistics.median(as_is):.1f} / {statistics.median(kept):.1f}"


def _percent(ratio: float) -> str:
    return f"{100 * ratio:.2g}%"  # two digits: ratios span 1e-4 to 1e-1


def csv_rows(results: list, count: int, metadata: dict) -> list:
    rows = []
    for r in results:
        case = f"{r.case.model} b{r.batch} {'x'.join(map(str, r.case.input_shape[1:]))} {r.case.segments}"
        if r.dtype != torch.float32:
            case += f" {DTYPES_BY_TYPE[r.dtype]}"
        config = {"model": r.case.model, "segments": r.case.segments, "batch": r.batch, "batches": count,
                  "dtype": DTYPES_BY_TYPE[r.dtype],
                  "seed": harness.SEED, "threads": torch.get_num_threads(), "meaningful": MEANINGFUL,
                  "provider": f"actsave.CheckpointedSequential(segments={_segments_argument(r.case)}, "
                              f"compress={r.codec!r})",
                  "reference": "compress=None (checked bit-identical to nn.Sequential)"}
        values = {"worst_tensor_sqnr": [d for d, _ in r.worst], "overall_sqnr": r.overall,
                  "codec_var_ratio": [r.var_ratio]}
        extra = {"worst_tensor_sqnr": {"tensors": [name for _, name in r.worst]}}
        if r.as_is_worst is not None:
            values.update(worst_tensor_sqnr_pools_as_is=[d for d, _ in r.as_is_worst],
                          overall_sqnr_pools_as_is=r.as_is_overall)
            if r.argmax_changed is not None:
                values["maxpool_argmax_changed"] = r.argmax_changed
            extra["worst_tensor_sqnr_pools_as_is"] = {"tensors": [name for _, name in r.as_is_worst]}
        for metric, measured in values.items():
            rows.append(harness.csv_row(BENCH, case, f"actsave_{r.codec}", metric, "batch", r.batch, measured,
                                        {**config, **extra.get(metric, {})}, metadata))
    return rows


def _segments_argument(case: Case) -> str:
    return "len(model)" if case.segments == FINEST else repr(case.segments)


# Issue 13's targets: (model, segments, batch, codec) -> lowest worst-tensor dB;
# and the codec variance bound for int8 at batch 8 on the ResNets at their own plans.
SQNR_TARGETS = {
    ("convbnrelu16", "sqrt", 8, "int8"): 30.0,
    ("convbnrelu16", "sqrt", 8, "fp8_e4m3"): 25.0,
    ("convbnrelu16", "sqrt", 8, "fp8_e5m2"): 18.0,
    ("resnet164", "balanced", 8, "int8"): 30.0,
    ("resnet164", "balanced", 8, "fp8_e4m3"): 22.0,
}
VARIANCE_TARGET = 0.05
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPES_BY_TYPE = {dtype: name for name, dtype in DTYPES.items()}


def judged_targets(results: list) -> list:
    """One line per target that the run has a case for: pass or FAIL, and the value."""
    lines = []
    for r in results:
        if r.dtype != torch.float32:  # the targets are stated for float32 models
            continue
        key = (r.case.model, r.case.segments, r.batch, r.codec)
        if key in SQNR_TARGETS:
            db, target = min(r.worst)[0], SQNR_TARGETS[key]
            lines.append(f"{'pass' if db >= target else 'FAIL'}  {' '.join(map(str, key))}: worst tensor "
                         f"{db:.1f} dB (target >= {target:g})")
        if r.case.model.startswith("resnet") and r.case.segments == "balanced" and r.batch == 8 \
                and r.codec == "int8":
            ok = r.var_ratio <= VARIANCE_TARGET
            lines.append(f"{'pass' if ok else 'FAIL'}  {r.case.model} b8 int8: codec/sampling variance "
                         f"{_percent(r.var_ratio)} (target <= {VARIANCE_TARGET:.0%})")
    return lines


# --------------------------------------------------------------------------- command line


def parse_arguments(argv) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-sizes", default=None, help="comma-separated batch sizes (default: 8,32; smoke 2,4)")
    parser.add_argument("--batches", type=int, default=None, help="K, batches per case (default: 8; smoke 2)")
    parser.add_argument("--models", default=None,
                        help="comma-separated model names to run, as printed (default: all of the run's cases)")
    parser.add_argument("--device", type=harness.parse_device, default=None,
                        help="cpu or cuda[:index] (default: cuda when available, else cpu)")
    harness.add_output_arguments(parser, "CSV, <device>.csv")
    parser.add_argument("--threads", type=int, default=1,
                        help="intra-op CPU threads, 0 for PyTorch's default (default: 1, steadiest on a shared CPU)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32",
                        help="dtype of the models and inputs, the reference's too (default: float32); "
                             "issue 13's targets are judged in float32 only")
    parser.add_argument("--segments", choices=("balanced", "sqrt", FINEST), default=None,
                        help="run every case at this segmentation (default: each case's own; "
                             f"{FINEST}: every layer its own segment)")
    parser.add_argument("--smoke", action="store_true", help="tiny models and batches, for the tests")
    args = parser.parse_args(argv)
    args.batch_sizes = [int(b) for b in (args.batch_sizes or ("2,4" if args.smoke else "8,32")).split(",")]
    args.batches = args.batches or (2 if args.smoke else 8)
    if args.batches < 2:
        parser.error("--batches must be at least 2: the sampling variance needs two batches")
    known = {case.model for case in cases(args.smoke)}
    args.models = args.models.split(",") if args.models else sorted(known)
    if set(args.models) - known:
        parser.error(f"--models: unknown {sorted(set(args.models) - known)}; this run has {sorted(known)}")
    args.device = args.device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    args.out = harness.output_path(args, f"{harness.device_slug(args.device)}.csv")
    return args


def selected_cases(args: argparse.Namespace) -> list:
    """The run's cases of ``args.models``, at ``args.segments`` where it is given (once
    per model then: the cases of a model differ only in their segmentation)."""
    found = [case for case in cases(args.smoke) if case.model in args.models]
    if args.segments is None:
        return found
    by_model = {case.model: dataclasses.replace(case, segments=args.segments) for case in found}
    return list(by_model.values())


def main(argv=None) -> None:
    args = parse_arguments(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    runs = [(case, batch) for case in selected_cases(args) for batch in args.batch_sizes]
    progress = harness.Progress(len(runs) * len(CODECS), BENCH)
    dtype = DTYPES[args.dtype]
    results = [r for case, batch in runs
               for r in measure_case(case, batch, args.batches, args.device, progress, dtype)]
    progress.close()
    print(f"gradient fidelity against compress=None, {args.batches} batches per case, {args.dtype}, "
          f"on {harness.device_name(args.device)}")
    print(table(results))
    pooled = maxpool_table(results)
    if pooled:
        print("max pools recomputed from the codec's input, as is and keeping the forward's decisions (actsave):")
        print(pooled)
    for line in judged_targets(results):
        print(line)
    harness.write_csv(csv_rows(results, args.batches, harness.run_metadata(args.device)), args.out)
    print(harness.wrote(args.out))


if __name__ == "__main__":
    harness.imports_frozen()  # NOTE [ A script's imports, frozen ]
    main(sys.argv[1:])
