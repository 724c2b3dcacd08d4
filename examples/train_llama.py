"""Train a Hugging Face Llama under an activation-memory budget with actsave.wrap.

    python examples/train_llama.py                  # 4 layers, hidden 64, batch 4 x 128 tokens: about 10 s on a CPU
    python examples/train_llama.py --real           # 16 layers, hidden 2048, batch 4 x 2048 tokens, bf16 (for a GPU)
    python examples/train_llama.py --budget-mib 40  # a budget of your own (the default: 60% of the plain step's peak)

The model is built from a config object (``LlamaConfig``, random weights): nothing is
downloaded. ``actsave.wrap(model, LlamaDecoderLayer, budget=..., example_inputs=batch)``
runs one profiled training step on the example batch, then checkpoints the decoder
layers (each recomputed in backward, its input kept exactly, or as the plan says) or
leaves them plain, the fastest choice whose predicted peak activation memory of the
whole step (embeddings, logits and loss included) fits the budget. ``print(plan)``
shows the choice. The same lines work on a pretrained model
(``AutoModelForCausalLM.from_pretrained(...)``) and under ``transformers.Trainer``.

The data: runs of consecutive token ids from random starts, so the loss falls as the
model learns that one token follows another. Needs ``pip install transformers``.
"""
import argparse
import time

import torch

import actsave
from transformers import AutoModelForCausalLM, LlamaConfig
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

SMOKE = dict(layers=4, hidden=64, heads=4, vocab=256, seq=128, batch=4, steps=8, dtype="float32")
REAL = dict(layers=16, hidden=2048, heads=16, vocab=32000, seq=2048, batch=4, steps=20, dtype="bfloat16")
NO_LIMIT = 2**60  # a budget no step reaches: the plan then reports the plain and the smallest peaks


def batch_of(sizes: dict, device) -> dict:
    start = torch.randint(0, sizes["vocab"], (sizes["batch"], 1), device=device)
    input_ids = (start + torch.arange(sizes["seq"], device=device)) % sizes["vocab"]
    return {"input_ids": input_ids, "labels": input_ids}  # the model shifts the labels itself


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--real", action="store_true", help=f"real sizes: {REAL} (default: {SMOKE})")
    parser.add_argument("--budget-mib", type=float, help="peak activation memory of a training step, MiB")
    parser.add_argument("--steps", type=int)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    if args.steps is not None and args.steps <= 0:
        parser.error(f"--steps must be positive, not {args.steps}")
    sizes = {**(REAL if args.real else SMOKE), **({"steps": args.steps} if args.steps is not None else {})}
    device = torch.device(args.device)

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=sizes["vocab"], hidden_size=sizes["hidden"],
                         intermediate_size=4 * sizes["hidden"], num_hidden_layers=sizes["layers"],
                         num_attention_heads=sizes["heads"], num_key_value_heads=sizes["heads"] // 2,
                         max_position_embeddings=sizes["seq"], use_cache=False)  # no KV cache in training
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, sizes["dtype"])).to(device).train()
    batch = batch_of(sizes, device)

    if args.budget_mib is None:
        probe = actsave.plan_blocks(model, LlamaDecoderLayer, budget=NO_LIMIT, example_inputs=batch)
        budget = max(probe.smallest_peak_bytes, int(0.6 * probe.plain_peak_bytes))
    else:
        budget = int(args.budget_mib * 2**20)
    try:
        plan = actsave.plan_blocks(model, LlamaDecoderLayer, budget=budget, example_inputs=batch)
    except actsave.ConfigError as error:  # no plan fits: the message gives the smallest budget that does
        raise SystemExit(f"error: {error}")
    print(plan)
    actsave.wrap(model, plan)  # in one call: actsave.wrap(model, LlamaDecoderLayer, budget=..., example_inputs=batch)

    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    start = time.perf_counter()
    for step in range(sizes["steps"]):
        batch = batch_of(sizes, device)
        loss = model(**batch).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step == 0 and device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            steady = torch.cuda.memory_allocated()  # parameters, gradients, optimizer state
        print(f"step {step + 1:3d}  loss {loss.item():.3f}")
    print(f"{(time.perf_counter() - start) / sizes['steps']:.3f} s per step")
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated() - steady
        print(f"measured activation peak {peak / 2**20:.1f} MiB, predicted {plan.predicted_peak_bytes / 2**20:.1f} "
              f"MiB (budget {budget / 2**20:.1f} MiB)")


if __name__ == "__main__":
    main()
