"""Models and comparisons shared by the tests."""
import collections
import contextlib
import copy
import csv
import functools
import importlib.util
import io
import subprocess
import sys
from pathlib import Path

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.distributed._tools.mem_tracker import MemTracker

from actsave.codecs import GROUP_SIZE, sqnr_db  # noqa: F401  (sqnr_db: for the tests)
from actsave.meta import plans_at_first_call

BENCH = Path(__file__).resolve().parents[1] / "bench"


def mixed_chain(width: int = 16, repeats: int = 4) -> nn.Sequential:
    """Linear, in-place ReLU, Dropout, BatchNorm, GELU, repeated: every layer kind whose
    recompute needs care (RNG, running stats, in-place)."""
    torch.manual_seed(0)
    layers = []
    for _ in range(repeats):
        layers += [nn.Linear(width, width), nn.ReLU(inplace=True), nn.Dropout(0.3),
                   nn.BatchNorm1d(width), nn.GELU()]
    return nn.Sequential(*layers)


def deep_mlp(blocks: int = 16, width: int = 64) -> list:
    """``blocks`` x (Linear(width, width), ReLU), seeded."""
    torch.manual_seed(0)
    return [m for _ in range(blocks) for m in (nn.Linear(width, width), nn.ReLU())]


def train_step(model: nn.Module, x: torch.Tensor, seed: int = 1):
    """Forward and backward from a fixed RNG state; returns (output, input grad)."""
    x = x.detach().clone().requires_grad_(True)
    torch.manual_seed(seed)
    out = model(x)
    out.square().sum().backward()
    return out.detach(), x.grad


def assert_same_training(plain: nn.Module, other: nn.Module, x: torch.Tensor) -> None:
    """Outputs, input gradients, parameter gradients and buffers are bit-identical."""
    out_a, grad_a = train_step(plain, x)
    out_b, grad_b = train_step(other, x)
    assert torch.equal(out_a, out_b)
    assert torch.equal(grad_a, grad_b)
    for (name, p), q in zip(plain.named_parameters(), other.parameters()):
        assert torch.equal(p.grad, q.grad), name
    for (name, b), c in zip(plain.named_buffers(), other.buffers()):
        assert torch.equal(b, c), name


def assert_same_steps(plain: nn.Module, other: nn.Module, batches) -> None:
    """assert_same_training at each of ``batches`` in turn, gradients zeroed between:
    state carried from step to step (a buffer, a flag) must move as in ``plain``."""
    for x in batches:
        plain.zero_grad()
        other.zero_grad()
        assert_same_training(plain, other, x)


class ResidualBlock(nn.Module):
    """``x + dropout(activation(linear(layernorm(x))))``: a block that is not one chain,
    whose recompute must replay the RNG."""

    def __init__(self, width: int = 8, activation=torch.tanh, dropout: float = 0.2):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc = nn.Linear(width, width)
        self.drop = nn.Dropout(dropout)
        self.activation = activation

    def forward(self, x):
        return x + self.drop(self.activation(self.fc(self.norm(x))))


class ResidualNet(nn.Module):
    """Residual blocks then a linear head, seeded so twins start equal."""

    def __init__(self, depth: int = 3, width: int = 8, classes: int = 2, seed: int = 0, **block_options):
        super().__init__()
        torch.manual_seed(seed)
        self.blocks = nn.ModuleList(ResidualBlock(width, **block_options) for _ in range(depth))
        self.head = nn.Linear(width, classes)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class PreActBlock(nn.Module):
    """``x + conv(relu(bn(x)))``: the block of pre-activation ResNets."""

    def __init__(self, channels: int):
        super().__init__()
        self.body = nn.Sequential(nn.BatchNorm2d(channels), nn.ReLU(),
                                  nn.Conv2d(channels, channels, 3, padding=1, bias=False))

    def forward(self, x):
        return x + self.body(x)


def twin(model: nn.Module) -> nn.Module:
    return copy.deepcopy(model)


class CallCounter:
    """Counts forward calls of every submodule of a model."""

    def __init__(self, model: nn.Module):
        self.counts = {}
        for name, module in model.named_children():
            module.register_forward_hook(self._hook(name))

    def _hook(self, name):
        def count(module, args, output):
            self.counts[name] = self.counts.get(name, 0) + 1
        return count

    def reset(self):
        self.counts.clear()


# Dense layouts other than contiguous (NOTE [ Kept layouts ] in actsave/layouts.py):
# what offload and the codecs give back with the input's strides.
DENSE_LAYOUTS = {
    "channels_last": lambda: torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last),
    "channels_last_3d": lambda: torch.randn(2, 3, 2, 4, 5).to(memory_format=torch.channels_last_3d),
    "permuted_3d": lambda: torch.randn(3, 4, 5).permute(2, 0, 1),
    "channels_last_one_sample": lambda: torch.randn(1, 3, 4, 5).to(memory_format=torch.channels_last),
}
# Tensors that are not dense: they come back with the strides torch.empty_like gives them.
NOT_DENSE = {
    "strided_rows": lambda: torch.randn(6, 9)[:, ::3],
    "channels_last_slice": lambda: torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last)[:, :, ::2],
    "expanded": lambda: torch.randn(6, 9).expand(4, 6, 9),
}


def codes_and_scales(elements: int) -> int:
    """Bytes an 8-bit group codec stores for ``elements`` values: one byte each and an
    fp32 scale per group of GROUP_SIZE (128)."""
    return elements + 4 * elements // GROUP_SIZE


def channel_means(channels: int) -> int:
    """Bytes a lossy codec keeps beside the codes of a centered (signed 4-D or 5-D
    float32) tensor: one fp32 mean per channel (NOTE [ Channel centering ])."""
    return 4 * channels


def peak_activation_bytes(model: nn.Module, x: torch.Tensor, loss=None) -> int:
    """MemTracker peak of one training step, less parameters, buffers and gradients: the
    backward from ``loss(out)``, or without a loss from a gradient of ones. A model that
    plans at its first call does so in an unmeasured step first, which also makes what
    a first step caches for good (the CPU's ReLU decision tables, 4 KiB).

    MemTracker counts a tensor made before the step once a view of it is made in the
    step (a loss's ``targets.flatten()``: their storage, which the allocator does not
    allocate), and never sees the CPU generator states checkpointed segments hold
    (docs/limits.md, "Memory no tensor holds")."""
    if plans_at_first_call(model):
        out = model(x)
        out.backward(torch.ones_like(out))
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    static = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    static += sum(p.numel() * p.element_size() for p in model.parameters())
    tracker = MemTracker()
    tracker.track_external(model, x)
    with tracker:
        out = model(x)
        if loss is None:
            out.backward(torch.ones_like(out))
        else:
            loss(out).backward()
    return max(v["Total"] for v in tracker.get_tracker_snapshot("peak").values()) - static


def cuda_activation_peak(model: nn.Module, x: torch.Tensor) -> int:
    """What peak_activation_bytes measures, from CUDA's allocator: the peak of one step
    beyond what was allocated before it (parameters, gradients, buffers), plus the
    batch in 512-byte blocks. After a warm-up step, which allocates what persists
    (cuBLAS workspaces, pinned host buffers)."""
    for p in model.parameters():
        p.grad = torch.zeros_like(p)

    def step():
        out = model(x)
        out.backward(torch.ones_like(out))

    step()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before + -(-x.untyped_storage().nbytes() // 512) * 512


@functools.cache
def load_bench_module(name: str):
    """A script or package of bench/, loaded from its file (pytest runs with
    --import-mode=importlib and bench/ is no package; bench/harness/ is one)."""
    path = BENCH / name
    if path.is_dir():  # a package, e.g. bench/harness/
        spec = importlib.util.spec_from_file_location(
            f"bench_{name}", path / "__init__.py", submodule_search_locations=[str(path)])
    else:
        spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    # The scripts import their neighbours (harness, models, frontier's parts) from bench/.
    sys.path.insert(0, str(BENCH))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(BENCH))
    return module


class OpCounter(TorchDispatchMode):
    """Counts the aten operators run inside it, by name (``aten.mm.default``)."""

    def __init__(self):
        super().__init__()
        self.counts = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[str(func)] += 1
        return func(*args, **(kwargs or {}))


def random_bits(shape, dtype):
    """Every bit pattern is fair game, NaN payloads and negative zeros included."""
    numel = torch.Size(shape).numel()
    raw = torch.randint(0, 256, (numel * dtype.itemsize,), dtype=torch.uint8)
    return raw.view(dtype).view(shape)


def same_bits(a, b):
    """Same dtype, shape and bits (NaN payloads, negative zeros), any layout."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8)
    )


# ----------------------------------------------------------------- bench runs

CSV_COLUMNS = [
    "bench", "case", "provider", "metric", "unit", "x_name", "x_value", "p20", "p50", "p80",
    "n_reps", "config_json", "device_name", "torch_version", "triton_version",
    "actsave_version", "git_sha", "timestamp_utc",
]


def run_script(script: str, *args: str) -> str:
    """A bench script's stdout, run as a user runs it, at smoke scale; it must succeed."""
    result = subprocess.run(
        [sys.executable, str(BENCH / script), "--smoke", *args], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def bench_exit(script: str, *args: str) -> tuple:
    """``(exit status, stdout, stderr)`` of bench script ``script``'s ``main(args)``, run
    in this process: for what a script decides before it measures anything (its
    --help, its refusals), without the fresh interpreter and import of torch that
    run_script pays."""
    module = load_bench_module(Path(script).stem)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            status = module.main(list(args))
        except SystemExit as exit_:
            status = exit_.code
    if isinstance(status, str):  # sys.exit(message): Python prints it and exits with 1
        err.write(status)
        status = 1
    return status or 0, out.getvalue(), err.getvalue()


def read_rows(path: Path) -> tuple:
    """``(columns, rows)`` of a results CSV."""
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        return reader.fieldnames, list(reader)


def value(rows: list, provider: str, metric: str, depth: str) -> float:
    """The median of the one row of ``provider`` and ``metric`` at ``depth``."""
    (row,) = [r for r in rows if (r["provider"], r["metric"], r["x_value"]) == (provider, metric, depth)]
    return float(row["p50"])
