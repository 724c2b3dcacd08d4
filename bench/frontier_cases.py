"""bench/frontier.py's cases: the models and batches every system of the frontier
trains (a ResNet chain, GPT and Llama-style block stacks, a Hugging Face Llama built
from its config), and their sizes per device."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from actsave.planning.block_step import run_step

import harness
from models import LlamaBlock, TransformerBlock, cifar_resnet, gpt, llama, swiglu_width

SIZES = {  # profile -> the cases' sizes, the cases run by default, points, rounds, warm-up steps, pair rounds
    "cpu": {"resnet": {"depth": 164, "batch": 8, "image": 32},
            "blocks": {"blocks": 8, "width": 256, "heads": 4, "vocab": 1024, "seq_len": 256, "batch": 4,
                       "dtype": "float32"},
            "cases": ("resnet", "gpt", "llama", "hf_llama"), "points": 8, "rounds": 5, "warmup": 2,
            "pair_rounds": 7},
    "cuda": {"resnet": {"depth": 164, "batch": 512, "image": 32},
             "blocks": {"blocks": 16, "width": 2048, "heads": 16, "vocab": 8192, "seq_len": 2048, "batch": 4,
                        "dtype": "bfloat16"},
             "cases": ("resnet", "gpt"), "points": 8, "rounds": 5, "warmup": 2, "pair_rounds": 5},
    "smoke": {"resnet": {"depth": 11, "batch": 2, "image": 8},
              "blocks": {"blocks": 2, "width": 32, "heads": 2, "vocab": 64, "seq_len": 16, "batch": 2,
                         "dtype": "float32"},
              "cases": ("resnet", "gpt", "llama", "hf_llama"), "points": 3, "rounds": 2, "warmup": 1,
              "pair_rounds": 2},
}
CASES = ("resnet", "gpt", "llama", "hf_llama")



@dataclass
class Case:
    """A model and batch every system trains. ``loss(model)`` runs the forward and
    returns the loss; ``inputs`` are the example inputs as the planner takes them
    (``(x,)`` for a chain, whose targets the loss holds; a tuple or dict for blocks);
    ``counted`` the bytes of the inputs a budget counts."""

    name: str
    description: str
    plain: nn.Module
    inputs: object
    loss: Callable[[nn.Module], torch.Tensor]
    counted: int
    block: Optional[type] = None  # None: a chain (nn.Sequential)
    chain_loss: Optional[Callable] = None  # a chain's loss on its logits, as CheckpointedSequential takes it
    config: dict = field(default_factory=dict)


class NextTokenLoss(nn.Module):
    """A token model with its loss: ``forward(ids, targets)`` returns the cross-entropy
    of its logits (harness.step_loss), so that a block plan's example step is the
    training step."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return harness.measure.step_loss(self.model(ids), targets)


def _unique_bytes(tensors) -> int:
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def resnet_case(device: torch.device, depth: int, batch: int, image: int) -> Case:
    generator = torch.Generator().manual_seed(harness.SEED)
    x = torch.randn(batch, 3, image, image, generator=generator).to(device)
    y = torch.randint(0, 10, (batch,), generator=generator).to(device)
    torch.manual_seed(harness.SEED)
    with torch.device(device):  # built where it trains: a GPU-sized model is not made on the host first
        plain = cifar_resnet(depth)

    def chain_loss(logits):
        return F.cross_entropy(logits, y)

    return Case(f"resnet{depth}", f"cifar_resnet({depth}) b{batch} {image}x{image} fp32", plain, (x,),
                lambda model: chain_loss(model(x)), _unique_bytes([x]), chain_loss=chain_loss,
                config={"model": f"cifar_resnet({depth})", "batch": batch, "image": image, "dtype": "float32"})


def token_batch(device, vocab: int, batch: int, seq_len: int) -> tuple:
    tokens = torch.randint(0, vocab, (batch, seq_len + 1), generator=torch.Generator().manual_seed(harness.SEED))
    return tokens[:, :-1].contiguous().to(device), tokens[:, 1:].contiguous().to(device)  # predict the next token


def stack_case(kind: str, device: torch.device, blocks: int, width: int, heads: int, vocab: int, seq_len: int,
               batch: int, dtype: str) -> Case:
    builder, block = {"gpt": (gpt, TransformerBlock), "llama": (llama, LlamaBlock)}[kind]
    ids, targets = token_batch(device, vocab, batch, seq_len)
    torch.manual_seed(harness.SEED)
    with torch.device(device):
        plain = NextTokenLoss(builder(blocks, width=width, heads=heads, vocab_size=vocab, max_seq_len=seq_len))
    plain = plain.to(dtype=getattr(torch, dtype))
    described = f"{kind}({blocks}) w{width} h{heads} v{vocab} t{seq_len} b{batch} {dtype}"
    return Case(f"{kind}{blocks}", described, plain, (ids, targets), lambda model: model(ids, targets),
                _unique_bytes([ids, targets]), block=block,
                config={"model": f"bench/models.py {kind}", "blocks": blocks, "width": width, "heads": heads,
                        "vocab": vocab, "seq_len": seq_len, "batch": batch, "dtype": dtype})


def hf_llama_case(device: torch.device, blocks: int, width: int, heads: int, vocab: int, seq_len: int, batch: int,
                  dtype: str) -> Optional[Case]:
    """A Hugging Face Llama built from its config (no download), or None without
    transformers. Labels are the input ids (the model shifts them)."""
    try:
        import transformers
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer
    except ImportError:
        return None
    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=width, intermediate_size=swiglu_width(width),
                                      num_hidden_layers=blocks, num_attention_heads=heads, num_key_value_heads=heads,
                                      max_position_embeddings=seq_len, bos_token_id=0, eos_token_id=0,
                                      use_cache=False, attn_implementation="sdpa")
    torch.manual_seed(harness.SEED)
    with torch.device(device):
        plain = transformers.AutoModelForCausalLM.from_config(config).train()
    plain = plain.to(dtype=getattr(torch, dtype))
    plain.config.use_cache = False
    ids, _ = token_batch(device, vocab, batch, seq_len)
    inputs = {"input_ids": ids, "labels": ids}
    described = f"hf_llama({blocks}) w{width} h{heads} v{vocab} t{seq_len} b{batch} {dtype} (Hugging Face)"
    return Case(f"hf_llama{blocks}", described, plain, inputs, lambda model: run_step(model, inputs)[0],
                _unique_bytes([ids]), block=LlamaDecoderLayer,
                config={"model": f"transformers {transformers.__version__} LlamaForCausalLM", "blocks": blocks,
                        "width": width, "heads": heads, "vocab": vocab, "seq_len": seq_len, "batch": batch,
                        "dtype": dtype, "attention": plain.config._attn_implementation})


def build_case(name: str, sizes: dict, device: torch.device) -> Optional[Case]:
    if name == "resnet":
        return resnet_case(device, **sizes["resnet"])
    if name == "hf_llama":
        return hf_llama_case(device, **sizes["blocks"])
    return stack_case(name, device, **sizes["blocks"])
