"""How deep a GPT-style transformer trains in the same memory: plain PyTorch,
torch's checkpoint_sequential and the actsave modes, side by side.

The transformer counterpart of resnet_depth_sweep.py (same providers, metrics and
outputs; see bench/harness/): a flat nn.Sequential of token + position embedding,
``depth`` pre-LN blocks with causal attention, final LayerNorm and head
(bench/models.py), trained one next-token step at a time on random token ids.

The CPU defaults are small (batch 4, 128 tokens, width 128, up to 16 blocks); on CUDA
the sweep uses GPT-2-small-like blocks (width 768, 12 heads) on 1024 tokens.

    python bench/transformer_depth_sweep.py
    python bench/transformer_depth_sweep.py --depths 12,24,48 --seq-len 2048 --budget 16GiB
"""
from __future__ import annotations

import sys

import torch

import harness
from models import gpt

DEFAULTS = {  # as typed on the command line; --help shows them
    "cpu": {"depths": "2,4,8,16", "batch": "4", "seq_len": "128", "width": "128", "heads": "4",
            "vocab": "512", "budget": "48MiB", "repeats": "3", "search_seconds": "60", "threads": "1"},
    "cuda": {"depths": "6,12,24,48", "batch": "8", "seq_len": "1024", "width": "768", "heads": "12",
             "vocab": "8192", "budget": "16GiB", "repeats": "10", "search_seconds": "300", "threads": "0"},
    "smoke": {"depths": "1,2", "batch": "2", "seq_len": "16", "width": "32", "heads": "2",
              "vocab": "64", "budget": "1MiB", "repeats": "1", "search_seconds": "5", "threads": "1"},
}
OPTIONS = {
    "seq_len": (int, "tokens per sequence"),
    "width": (int, "model width"),
    "heads": (int, "attention heads"),
    "vocab": (int, "vocabulary size"),
}


def workload(batch: int, seq_len: int, width: int, heads: int, vocab: int) -> harness.Workload:
    def make_batch(generator: torch.Generator) -> tuple:
        tokens = torch.randint(0, vocab, (batch, seq_len + 1), generator=generator)
        return tokens[:, :-1], tokens[:, 1:]  # predict the next token

    shape = {"batch": batch, "seq_len": seq_len, "width": width, "heads": heads, "vocab": vocab}
    return harness.Workload(
        bench="transformer_depth_sweep",
        case=f"gpt b{batch} t{seq_len} w{width} h{heads} v{vocab}",
        build=lambda depth: gpt(depth, width=width, heads=heads, vocab_size=vocab, max_seq_len=seq_len),
        make_batch=make_batch,
        depth_of_blocks=lambda blocks: blocks,
        blocks_of_depth=lambda depth: depth,
        config={"model": "gpt (pre-LN, causal SDPA)", **shape},
        depth_name="{} blocks",
    )


def main(argv=None) -> None:
    args = harness.parse_arguments(argv, __doc__, DEFAULTS, OPTIONS)
    harness.run_benchmark(workload(args.batch, args.seq_len, args.width, args.heads, args.vocab), args)


if __name__ == "__main__":
    harness.imports_frozen()  # NOTE [ A script's imports, frozen ]
    main(sys.argv[1:])
