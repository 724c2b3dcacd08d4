"""actsave under torch.compile, measured (issue 35, item 4): what a step keeps for
backward, its time, and what Dynamo made of it, compiled against eager.

For each model: plain PyTorch, actsave's default CheckpointedSequential, the same
with ``compress="int8"``, and every block ``actsave.wrap``-ped with int8, each run
eagerly and under ``torch.compile(model)`` (--backend); for a Hugging Face Llama
(where transformers is installed), which is no Sequential: plain, and its decoder
layers wrapped, exactly and with int8. Compiled, int8 encodes the kept inputs in the
graph where no lossy segment makes ReLU or max-pool decisions (GPT, Llama), and runs
its forward eagerly at one graph break where one does (ResNet): NOTE [ Codecs in a
compiled graph ] in actsave/runtime/graph_codecs.py. Per mode:

- kept after forward: the bytes a forward leaves allocated, its output left out (the
  allocator's count, which sees a compiled graph's saves, encoded ones included, as
  it sees eager actsave's kept inputs; harness.allocator_rise on the CPU, the CUDA
  allocator on CUDA);
- the step's allocator peak over what was allocated before it (the parameters, their
  gradients from the warm-up freed, and the batch);
- the worst parameter gradient's SQNR against plain eager PyTorch's (dB; ``inf``:
  exact), one step from the same weights and batch;
- the step time, median of rounds that interleave the mode's eager and compiled
  steps and a second eager copy's ("again": the same code timed twice, whose ratio is
  the noise a difference must exceed), each round's order rotated by one; process
  CPU time on the CPU, wall time synchronized on CUDA; and its ratio to the eager
  step of the same round; one compiled model at a time, Dynamo's caches reset before
  each;
- Dynamo's graphs and graph breaks, counted over the warm-up steps.

The balanced plan's predicted peak is printed beside them: the planner profiles the
eager code (docs/limits.md, "torch.compile").

Inductor's layout optimization (``torch._inductor.config.layout_optimization``) runs a
convolutional model channels-last and saves a channels-last copy of each 3x3
convolution's weight and of the batch for the backward, plain or checkpointed alike;
``--no-layout-optimization`` turns it off, so that what a compiled step keeps is its
activations alone.

    python bench/compile_memory.py                         # ResNet-164, GPT-8, Llama-8; aot_eager
    python bench/compile_memory.py --backend inductor      # C++ builds on a CPU: minutes
    python bench/compile_memory.py --backend inductor --no-layout-optimization
    python bench/compile_memory.py --smoke                 # tiny, for the tests
    python bench/compile_memory.py --smoke --rounds 60     # tiny, where host work shows
"""
import argparse
import copy
import functools
import statistics
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import actsave  # noqa: E402
from actsave.devices import synchronize  # noqa: E402
from actsave.text import format_table  # noqa: E402
from harness import allocator_rise, imports_frozen  # noqa: E402
from harness.measure import worst_grad_sqnr  # noqa: E402
from host_overhead import interleaved_times, paired_ratio  # noqa: E402
from models import BasicBlock, PreActBottleneck, TransformerBlock, cifar_resnet, gpt  # noqa: E402

BLOCKS = (BasicBlock, PreActBottleneck, TransformerBlock)  # what "wrap int8" checkpoints


def cases(smoke: bool) -> dict:
    """name -> (model, batch, the block classes ``wrap`` checkpoints): the chains the
    other benches use, at sizes where the activations, not per-channel statistics, are
    what a step keeps, and a Hugging Face Llama of the GPT's size."""
    torch.manual_seed(0)
    if smoke:
        chains = {"resnet20 b2 8x8": (cifar_resnet(20), torch.randn(2, 3, 8, 8)),
                  "gpt4 w64 b8 t64": (gpt(4, width=64, heads=2, vocab_size=64, max_seq_len=64),
                                      torch.randint(0, 64, (8, 64)))}
    else:
        chains = {"resnet164 b8 32x32": (cifar_resnet(164), torch.randn(8, 3, 32, 32)),
                  "gpt8 w256 b4 t256": (gpt(8, max_seq_len=256), torch.randint(0, 1024, (4, 256)))}
    found = {name: (model, batch, BLOCKS) for name, (model, batch) in chains.items()}
    llama = hugging_face_llama(*((2, 64, 8, 64) if smoke else (8, 256, 4, 256)))
    if llama is None:
        print("transformers is not installed: no Hugging Face Llama (pip install transformers)")
    else:
        found.update(llama)
    return found


class Logits(nn.Module):
    """A Hugging Face causal language model as a map from token ids to logits, as the
    chains are."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids).logits


def hugging_face_llama(layers: int, width: int, batch: int, tokens: int) -> dict:
    """``{name: (model, batch, (its decoder layer class,))}`` for a Llama built from
    its config (no download, 4 heads, 1024 tokens of vocabulary), or None where
    transformers is not installed."""
    try:
        import transformers
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer
    except ImportError:
        return None
    config = transformers.LlamaConfig(vocab_size=1024, hidden_size=width, intermediate_size=4 * width,
                                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=4,
                                      max_position_embeddings=tokens, bos_token_id=0, eos_token_id=0,
                                      use_cache=False)
    torch.manual_seed(0)
    model = Logits(transformers.AutoModelForCausalLM.from_config(config).train())
    name = f"llama{layers} w{width} b{batch} t{tokens} (Hugging Face)"
    return {name: (model, torch.randint(0, 1024, (batch, tokens)), (LlamaDecoderLayer,))}


def modes(model: nn.Module, blocks: tuple) -> dict:
    """name -> the eager module of each mode. A CheckpointedSequential only of a
    Sequential."""
    eager = {"plain": copy.deepcopy(model)}
    if isinstance(model, nn.Sequential):
        eager["actsave"] = actsave.CheckpointedSequential(*copy.deepcopy(model))
        eager["actsave int8"] = actsave.CheckpointedSequential(*copy.deepcopy(model), compress="int8")
    else:
        eager["wrap"] = actsave.wrap(copy.deepcopy(model), blocks)
    eager["wrap int8"] = actsave.wrap(copy.deepcopy(model), blocks, compress="int8")
    return eager


def eager_and_compiled(name: str, module: nn.Module, backend: str) -> dict:
    """name -> (the module to call, the module whose parameters train): ``module``, a
    copy of it compiled, and another copy run eagerly ("again", the noise floor of the
    ratios), all made before any runs."""
    compiled, again = copy.deepcopy(module), copy.deepcopy(module)
    return {name: (module, module), f"{name}, compiled": (torch.compile(compiled, backend=backend), compiled),
            f"{name}, again": (again, again)}


def step(module, trained, batch) -> None:
    module(batch).float().square().mean().backward()
    trained.zero_grad(set_to_none=True)


def kept_after_forward(module, trained, batch, device) -> int:
    output = []

    def forward():
        output.append(module(batch))
    if device.type == "cuda":
        synchronize(device)
        before = torch.cuda.memory_allocated(device)
        forward()
        synchronize(device)
        kept = torch.cuda.memory_allocated(device) - before
    else:
        kept = allocator_rise(forward)[1]
    out = output.pop()
    kept -= out.untyped_storage().nbytes()
    out.float().square().mean().backward()
    trained.zero_grad(set_to_none=True)
    return kept


def step_peak(module, trained, batch, device) -> int:
    """The allocator peak of one step over what was allocated before it."""
    if device.type != "cuda":
        return allocator_rise(functools.partial(step, module, trained, batch))[0]
    synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    step(module, trained, batch)
    synchronize(device)
    return torch.cuda.max_memory_allocated(device) - before


def gradients(module, trained, batch) -> list:
    module(batch).float().square().mean().backward()
    grads = [p.grad.clone() for p in trained.parameters()]
    trained.zero_grad(set_to_none=True)
    return grads


def warm_up(runs: dict, batch, steps: int) -> dict:
    """Run each mode ``steps`` times; returns name -> (graphs, breaks) Dynamo made."""
    counts = {}
    for name, (module, trained) in runs.items():
        counters = torch._dynamo.utils.counters
        counters.clear()
        for _ in range(steps):
            step(module, trained, batch)
        counts[name] = (counters["stats"]["unique_graphs"], sum(counters["graph_break"].values()))
    return counts


def measure(model, batch, blocks: tuple, backend: str, rounds: int, device) -> tuple:
    model, batch = model.to(device), batch.to(device)
    eager = modes(model, blocks)
    reference = gradients(eager["plain"], eager["plain"], batch)
    rows = []
    for name, module in eager.items():
        # One compiled model at a time: Dynamo keeps compiled code per code object, and
        # a graph break in one compiled nn.Sequential makes the others run module by
        # module from then on (docs/limits.md).
        torch._dynamo.reset()
        runs = eager_and_compiled(name, module, backend)
        counts = warm_up(runs, batch, steps=3)  # plans, compiles; each input shape once
        times = interleaved_times({run: functools.partial(step, *modules, batch) for run, modules in runs.items()},
                                  rounds, device, rotate=True)
        for run, (called, trained) in runs.items():
            fidelity = worst_grad_sqnr(reference, gradients(called, trained, batch))
            peak = step_peak(called, trained, batch, device)
            graphs, breaks = counts[run]
            rows.append([run, f"{kept_after_forward(called, trained, batch, device) / 2**20:.2f}",
                         f"{peak / 2**20:.2f}", f"{fidelity:.1f}", f"{1e3 * statistics.median(times[run]):.1f}",
                         f"{paired_ratio(times, run, name):.3f}x", graphs, breaks])
    plan = getattr(eager.get("actsave"), "balanced_plan", None)
    return rows, None if plan is None else plan.predicted_peak_bytes


def chosen(found: dict, words: list) -> dict:
    """The cases whose names start with one of ``words``, in the words' order (every
    case, in its own order, where ``words`` is None); a word that names none is an error."""
    if words is None:
        return found
    picked = {}
    for word in words:
        names = [name for name in found if name.startswith(word)]
        if not names:
            raise SystemExit(f"--models: no case starts with {word!r}; the cases are {list(found)}")
        picked.update((name, found[name]) for name in names)
    return picked


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny models (two rounds unless --rounds)")
    parser.add_argument("--backend", default="aot_eager", help="torch.compile's backend (default aot_eager)")
    parser.add_argument("--rounds", type=int, default=None,
                        help="timed rounds per mode, its three runs interleaved (a multiple of 3 puts each first "
                             "alike; default 9, with --smoke 2)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--no-layout-optimization", action="store_true",
                        help="Inductor's layout optimization off: no channels-last copies of weights saved")
    parser.add_argument("--models", type=lambda text: text.split(","), default=None,
                        help="comma-separated words (resnet, gpt, llama): the cases whose names start with one, in "
                             "that order (default: every case)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if args.no_layout_optimization:
        from torch._inductor import config as inductor_config
        inductor_config.layout_optimization = False
    if device.type == "cpu":
        torch.set_num_threads(1)
    for name, (model, batch, blocks) in chosen(cases(args.smoke), args.models).items():
        rounds = args.rounds or (2 if args.smoke else 9)
        rows, predicted = measure(model, batch, blocks, args.backend, rounds, device)
        print(f"\n{name}, {args.backend}{', no layout optimization' * args.no_layout_optimization}, {device}:")
        header = ["mode", "kept after forward MiB", "step peak MiB", "worst grad dB", "step ms", "vs eager", "graphs",
                  "breaks"]
        print(format_table([header, *[[str(cell) for cell in row] for row in rows]]))
        if predicted is not None:
            print(f"balanced plan's predicted activation peak (eager code): {predicted / 2**20:.2f} MiB")


if __name__ == "__main__":
    imports_frozen()  # NOTE [ A script's imports, frozen ]
    main()
