"""Hugging Face transformers models with ``actsave.wrap`` around their decoder blocks.

Small randomly initialised GPT-2 and Llama models (no download). Their models call
the blocks with keyword arguments (attention mask, position ids, Llama's rotary
``position_embeddings`` tuple), which ``Checkpoint`` keeps and replays as non-reentrant
``torch.utils.checkpoint`` would. The recipe these tests pin down::

    config.use_cache = False          # as HF's activation_checkpointing_enable() does:
                                      # a recompute would append to the KV cache again
    model = AutoModelForCausalLM.from_config(config)   # or from_pretrained(...)
    actsave.wrap(model, GPT2Block)    # LlamaDecoderLayer, ...; compress="int8" optional
    # train as usual; state_dict / save_pretrained keys are those of the plain model.
    # HF's own activation_checkpointing_enable() is not needed; if it is on too,
    # each wrapped block is still recomputed once.
"""
import copy
import warnings

import pytest
import torch
from torch import nn

import actsave
from support import sqnr_db

transformers = pytest.importorskip("transformers")
from transformers.models.gpt2.modeling_gpt2 import GPT2Block  # noqa: E402
from transformers.models.llama.modeling_llama import LlamaDecoderLayer  # noqa: E402

INT8_SQNR_FLOOR_DB = 30.0
VOCAB = 100


def gpt2_config():
    # Default dropout (0.1) left on: the recompute must replay the same masks.
    return transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=64,
                                   bos_token_id=0, eos_token_id=0, use_cache=False)


def llama_config():
    return transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                    max_position_embeddings=64, bos_token_id=0, eos_token_id=0,
                                    use_cache=False)


MODELS = {"gpt2": (gpt2_config, GPT2Block), "llama": (llama_config, LlamaDecoderLayer)}


def plain_and_wrapped(name: str, compress=None):
    config, block = MODELS[name]
    torch.manual_seed(0)
    plain = transformers.AutoModelForCausalLM.from_config(config()).train()
    wrapped = actsave.wrap(copy.deepcopy(plain), block, compress=compress)
    return plain, wrapped


def padded_batch() -> dict:
    """Two sequences, the second with 3 padding tokens: a real 4-d attention mask."""
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(1, VOCAB, (2, 16), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, -3:] = 0
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def training_step(model: nn.Module, batch: dict, seed: int = 1):
    torch.manual_seed(seed)
    loss = model(**batch).loss
    loss.backward()
    return loss.detach(), [p.grad for p in model.parameters()]


@pytest.mark.parametrize("name", MODELS)
def test_wrap_checkpoints_every_decoder_block_and_keeps_state_dict_keys(name):
    plain, wrapped = plain_and_wrapped(name)
    blocks = [m for m in wrapped.modules() if isinstance(m, MODELS[name][1])]
    assert len(blocks) == 2
    wrappers = [m for m in wrapped.modules() if isinstance(m, actsave.Checkpoint)]
    assert [w.module for w in wrappers] == blocks
    assert list(wrapped.state_dict()) == list(plain.state_dict())


@pytest.mark.parametrize("compress", [None, "int8"])
@pytest.mark.parametrize("name", MODELS)
def test_training_step_matches_the_unwrapped_model(name, compress):
    plain, wrapped = plain_and_wrapped(name, compress)
    batch = padded_batch()
    loss_plain, grads_plain = training_step(plain, batch)
    loss, grads = training_step(wrapped, batch)
    assert torch.equal(loss, loss_plain)  # the forward is never lossy
    assert actsave.kept_bytes() == {"device": 0, "host": 0}
    assert [g is None for g in grads] == [g is None for g in grads_plain]
    if compress is None:
        for (param_name, _), g, h in zip(plain.named_parameters(), grads, grads_plain):
            assert torch.equal(g, h), param_name
    else:
        flat = [torch.cat([g.flatten() for g in gs if g is not None]) for gs in (grads_plain, grads)]
        assert sqnr_db(*flat) >= INT8_SQNR_FLOOR_DB


@pytest.mark.parametrize("name", MODELS)
def test_save_pretrained_of_a_wrapped_model_loads_into_a_plain_model(name, tmp_path):
    plain, wrapped = plain_and_wrapped(name)
    with torch.no_grad():
        for p in wrapped.parameters():
            p.mul_(0.5)  # differ from `plain`, so loading is seen to happen
    wrapped.save_pretrained(tmp_path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert list(loaded.state_dict()) == list(plain.state_dict())
    for (key, expected), got in zip(wrapped.state_dict().items(), loaded.state_dict().values()):
        assert torch.equal(got, expected), key


@pytest.mark.parametrize("name, compress", [("gpt2", None), ("gpt2", "int8"), ("llama", None)])
def test_blocks_compiled_then_wrapped_compile_once_and_warn_nothing(name, compress):
    # The recipe for compiled blocks (NOTE [ torch.compile ] in runtime/compiled_calls.py):
    # compile each block, then wrap. The steps after the first reuse the graphs the
    # compiled blocks make without actsave, and nothing warns.
    def three_steps(model) -> tuple:
        torch._dynamo.reset()
        counters = torch._dynamo.utils.counters
        counters.clear()
        first = None
        with warnings.catch_warnings(record=True) as raised:
            warnings.simplefilter("always")
            for _ in range(3):
                loss, grads = training_step(model, padded_batch())
                first = first or (loss, [None if g is None else g.clone() for g in grads])
                model.zero_grad(set_to_none=True)
        return counters["stats"]["unique_graphs"], [str(w.message) for w in raised], first

    plain, wrapped = plain_and_wrapped(name, compress)
    for model in (plain, wrapped):
        for block in model.modules():
            if isinstance(block, MODELS[name][1]):
                block.compile(backend="aot_eager")
    graphs, raised, (loss, grads) = three_steps(wrapped)
    plain_graphs, _, (loss_plain, grads_plain) = three_steps(plain)
    assert (graphs, raised) == (plain_graphs, []) and graphs >= 1
    assert torch.equal(loss, loss_plain)
    if compress is None:
        assert all(g is h or torch.equal(g, h) for g, h in zip(grads, grads_plain))
    else:
        flat = [torch.cat([g.flatten() for g in gs if g is not None]) for gs in (grads_plain, grads)]
        assert sqnr_db(*flat) >= INT8_SQNR_FLOOR_DB


class _TakesACache(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x, past_key_values=None):
        keys = torch.tanh(self.lin(x))
        if past_key_values is not None:  # filled as an attention layer fills it (layer 0)
            past_key_values.update(keys[None, None], keys[None, None], 0)
        return keys


@pytest.mark.parametrize("keep", ["inputs", "selective"])
def test_a_cache_passed_in_training_warns_once_naming_use_cache(monkeypatch, keep):
    # use_cache=True, most configs' default: a recompute appends to the cache again
    # (docs/limits.md, "The recompute check"), so the forward warns, once.
    monkeypatch.setattr(actsave.runtime.keep_modes, "_WARNED_OF_A_CACHE", set())
    block = actsave.Checkpoint(_TakesACache(), keep=keep)
    with warnings.catch_warnings(record=True) as raised:
        warnings.simplefilter("always")
        for _ in range(2):
            block(torch.randn(4, 8, requires_grad=True), past_key_values=transformers.DynamicCache()).sum().backward()
    assert len([w for w in raised if "Hugging Face cache while training" in str(w.message)
                and "use_cache=False" in str(w.message)]) == 1


def test_a_checkpoint_over_a_llama_with_dynamic_rope_past_its_positions_trains_as_plain():
    # The rotary embedding grows its frequencies (a buffer registered again) behind the
    # length it keeps as a 0-d tensor attribute: the recompute must find that length as
    # the forward found it and grow them again (NOTE [ Python attributes a forward
    # sets ]); read as the forward left it, the recompute used the unscaled frequencies.
    def gradients(checkpointed: bool):
        torch.manual_seed(0)
        config = llama_config()
        config.max_position_embeddings = 16
        config.rope_parameters = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
        model = transformers.AutoModelForCausalLM.from_config(config).train()
        if checkpointed:
            model.model = actsave.Checkpoint(model.model)
        ids = torch.randint(1, VOCAB, (2, 40), generator=torch.Generator().manual_seed(1))
        model(input_ids=ids, labels=ids).loss.backward()
        return [p.grad for p in model.parameters()]

    for want, got in zip(gradients(False), gradients(True), strict=True):
        assert torch.equal(want, got)


def test_a_copy_of_an_accelerate_prepared_model_kept_by_int8_runs_its_own_weights_and_unwraps():
    # accelerate's mixed precision rebinds the model's forward to the model: a copy (an
    # EMA teacher) must run the copy, and unwrap_model(keep_fp32_wrapper=False) must
    # leave a forward that takes the model's own arguments.
    accelerate = pytest.importorskip("accelerate")
    _, wrapped = plain_and_wrapped("llama", compress="int8")
    try:
        accelerator = accelerate.Accelerator(cpu=True, mixed_precision="bf16")
        student = accelerator.prepare(wrapped)
        teacher = copy.deepcopy(student)
        batch = padded_batch()
        with torch.no_grad():
            for p in teacher.parameters():
                p.zero_()
            assert not teacher(input_ids=batch["input_ids"]).logits.any()
            assert student(input_ids=batch["input_ids"]).logits.any()
        unwrapped = accelerator.unwrap_model(student, keep_fp32_wrapper=False)
        assert unwrapped(**batch).loss.isfinite()
    finally:
        accelerate.state.AcceleratorState._reset_state(reset_partial_state=True)  # a process-wide singleton
