"""actsave.estimate: peak training memory from meta tensors, against MemTracker
measurements of the same step on CPU.

The simulation runs the model's own forward and backward, so it is exact where the
kernels are the same: measured on these models, estimate / MemTracker = 1.0000 for
nn.Sequential, CheckpointedSequential exact and int8, and planned models.
"""
import re

import pytest
import torch
import torch.nn.functional as F
from planning.chains import max_pool_chain
from support import PreActBlock, deep_mlp, load_bench_module, peak_activation_bytes
from torch import nn

import actsave
from actsave import CheckpointedSequential, ConfigError


def small_resnet() -> list:
    torch.manual_seed(0)
    return [nn.Conv2d(3, 16, 3, padding=1, bias=False), *[PreActBlock(16) for _ in range(6)],
            nn.BatchNorm2d(16), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10)]


MODELS = {
    "resnet plain": lambda: nn.Sequential(*small_resnet()),
    "resnet exact": lambda: CheckpointedSequential(*small_resnet()),
    "resnet int8": lambda: CheckpointedSequential(*small_resnet(), compress="int8"),
    "mlp plain": lambda: nn.Sequential(*deep_mlp(8)),
    "mlp int8": lambda: CheckpointedSequential(*deep_mlp(8), segments=8, compress="int8"),
    # On a CPU device the host pool is device memory too: both count its buffers.
    "mlp int8 offload": lambda: CheckpointedSequential(*deep_mlp(8), segments=8, compress="int8", offload=True),
    # Max-pool decisions kept and restored (runtime/pool_decisions.py), on meta tensors too.
    "maxpool int8": lambda: CheckpointedSequential(*max_pool_chain()[0], segments=[0, 2, 5, 8, 11], compress="int8"),
}
INPUTS = {"resnet": (16, 3, 16, 16), "mlp": (256, 64), "maxpool": (8, 3, 16, 16)}


@pytest.mark.parametrize("name", MODELS)
def test_estimate_matches_measured_peak_on_cpu(name):
    model = MODELS[name]()
    shape = INPUTS[name.split()[0]]
    estimated = actsave.estimate(model, shape, device="cpu")
    measured = peak_activation_bytes(model, torch.randn(shape))
    assert abs(estimated.activation_peak_bytes - measured) <= 0.10 * measured  # measured: equal


def test_estimate_agrees_with_the_plan_of_a_planned_model():
    x = torch.randn(128, 64)
    model = CheckpointedSequential(*deep_mlp(), segments="auto", budget=2**21, example_inputs=(x,))
    estimated = actsave.estimate(model, tuple(x.shape), device="cpu")
    assert estimated.activation_peak_bytes <= model.applied_plan.predicted_peak_bytes <= 2**21


def test_totals_and_the_model_left_as_it_was():
    model = nn.Sequential(*deep_mlp(2))
    parameters = [(p, p.clone()) for p in model.parameters()]
    estimated = actsave.estimate(model, (32, 64), device="cpu", optimizer="adam")
    assert all(p is q for p, (q, _) in zip(model.parameters(), parameters))
    assert all(torch.equal(p, value) and p.grad is None for p, value in parameters)
    parameter_bytes = sum(p.numel() * 4 for p in model.parameters())
    assert estimated.parameter_bytes == estimated.gradient_bytes == parameter_bytes
    assert estimated.optimizer_bytes == 2 * parameter_bytes
    assert estimated.total_peak_bytes == estimated.activation_peak_bytes + 4 * parameter_bytes
    assert "total (peak)" in str(estimated)


class _CachesAProjection(nn.Module):
    """Builds a random projection as a plain tensor attribute at its first forward."""

    def forward(self, x):
        if getattr(self, "projection", None) is None:
            self.projection = torch.randn(x.shape[-1], x.shape[-1], device=x.device)
        return x @ self.projection


def test_a_tensor_a_layer_caches_at_its_first_forward_is_made_by_the_real_step_not_the_estimate():
    model = nn.Sequential(nn.Linear(8, 8), _CachesAProjection(), nn.Linear(8, 2))
    actsave.estimate(model, (4, 8), device="cpu")
    assert "projection" not in vars(model[1])
    model(torch.randn(4, 8)).sum().backward()
    assert model[1].projection.device.type == "cpu"


def test_cuda_rounds_allocations_and_needs_no_gpu():
    model = nn.Sequential(nn.Linear(10, 10), nn.Tanh())  # 440 bytes of parameters in two tensors
    cpu = actsave.estimate(model, (3, 10), device="cpu")
    cuda = actsave.estimate(model, (3, 10), device="cuda")
    assert (cpu.parameter_bytes, cuda.parameter_bytes) == (440, 1024)
    assert cuda.activation_peak_bytes % 512 == 0 and cuda.activation_peak_bytes > cpu.activation_peak_bytes


def test_a_cuda_estimate_states_the_convolution_workspaces_it_leaves_out():
    # NOTE [ Workspaces an estimate leaves out ]: 3.4x the largest tensor a convolution
    # reads or writes, here the stem's 64-channel output of 8 x 64 x 32 x 32 fp32 (2 MiB).
    model = nn.Sequential(nn.Conv2d(3, 64, 3, padding=1), nn.ReLU(), nn.Conv2d(64, 8, 3, stride=2, padding=1))
    cuda = actsave.estimate(model, (8, 3, 32, 32), device="cuda")
    assert cuda.workspace_bytes_left_out == int(3.4 * 8 * 64 * 32 * 32 * 4)
    assert re.search(r"not counted: cuDNN workspaces, about\s+6\.8 MiB", str(cuda))
    # Not on a CPU (no cuDNN), nor for a model without convolutions.
    assert actsave.estimate(model, (8, 3, 32, 32), device="cpu").workspace_bytes_left_out == 0
    assert actsave.estimate(nn.Sequential(*deep_mlp(3)), (4, 64), device="cuda").workspace_bytes_left_out == 0
    assert "not counted" not in str(actsave.estimate(model, (8, 3, 32, 32), device="cpu"))


class Attention(nn.Module):
    """Causal self-attention over (batch, heads, tokens, head size) with a projection
    before it, so that its input's gradient is a leaf's (``mask`` given: masked)."""

    def __init__(self, width, mask=None):
        super().__init__()
        self.project, self.mask = nn.Linear(width, width), mask

    def forward(self, x):
        y = self.project(x)
        if self.mask is None:
            return nn.functional.scaled_dot_product_attention(y, y, y, is_causal=True)
        return nn.functional.scaled_dot_product_attention(y, y, y, attn_mask=self.mask)


T = 1024  # tokens: the math path keeps T x T weights per head, 2 MiB at bf16


# (dtype, mask, what CUDA's kernel keeps at most, in sets of the math path's weights):
# memory-efficient attention keeps the mask as a T x T bias, once for all heads.
@pytest.mark.parametrize("dtype, mask, kept", [(torch.bfloat16, None, 0.5),
                                               (torch.float32, torch.ones(T, T).tril().bool(), 1.0)],
                         ids=["flash", "efficient"])
@pytest.mark.parametrize("checkpointed", [False, True], ids=["plain", "checkpointed"])
def test_attention_on_cuda_is_estimated_as_a_fused_kernel_keeps_it(dtype, mask, kept, checkpointed):
    """NOTE [ Attention on a simulated device ]: on meta tensors scaled_dot_product_attention
    takes the math path, keeping T x T weights per head; a step estimated for CUDA keeps
    what flash (bf16, no mask) or memory-efficient attention (a mask) keep instead,
    also in a checkpoint's recompute, and the function is put back afterwards."""
    torch.manual_seed(0)
    model = Attention(64, mask if mask is None else mask.to("meta")).to(dtype)
    if checkpointed:
        model = CheckpointedSequential(model, segments=1)
    x = torch.empty(1, 4, T, 64, dtype=dtype, device="meta")
    weights = 4 * T * T * dtype.itemsize  # one set of the math path's attention weights
    math = actsave.estimate(model, x, device="meta").activation_peak_bytes  # a device with no fused kernel
    cuda = actsave.estimate(model, x, device="cuda").activation_peak_bytes
    assert math > 2 * weights and cuda < kept * weights
    assert nn.functional.scaled_dot_product_attention is torch._C._nn.scaled_dot_product_attention


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("mode", ["plain", "wrap", "wrap int8", "wrap selective"])
def test_a_transformers_estimate_matches_its_measured_peak_on_cpu(dtype, mode):
    """NOTE [ Attention on a simulated device ]: the CPU runs its flash kernel, and so
    does the meta step that stands for it, so the estimate is the measured peak in
    fp32 and at most 16 KiB above it in bf16."""
    models = load_bench_module("models")
    torch.manual_seed(0)
    model = models.gpt(2, width=64, heads=4, vocab_size=128, max_seq_len=256).to(dtype)
    if mode != "plain":
        actsave.wrap(model, models.TransformerBlock, compress="int8" if mode == "wrap int8" else None,
                     keep="selective" if mode == "wrap selective" else "inputs")
    tokens = torch.randint(0, 128, (2, 256))
    estimated = actsave.estimate(model, tokens, device="cpu").activation_peak_bytes
    measured = peak_activation_bytes(model, tokens)
    assert measured <= estimated <= measured + (0 if dtype == torch.float32 else 16 * 1024)


def _meta(*shape, dtype=torch.bfloat16):
    return torch.empty(shape, dtype=dtype, device="meta", requires_grad=True)


@pytest.mark.parametrize("q, k, kwargs, kernel", [
    (_meta(2, 4, 64, 64), None, {"is_causal": True}, "FlashAttention"),
    (_meta(2, 4, 64, 256), None, {}, "FlashAttention"),
    (_meta(2, 4, 64, 64, dtype=torch.float32), None, {}, "EfficientAttention"),  # flash runs 16-bit floats only
    (_meta(2, 4, 64, 64), None, {"attn_mask": torch.ones(64, 64, dtype=torch.bool, device="meta")},
     "EfficientAttention"),
    (_meta(2, 4, 64, 512), None, {}, "EfficientAttention"),  # head size above flash's 256
    (_meta(2, 4, 64, 60), None, {}, None),  # head size not a multiple of 8
    (_meta(2, 8, 64, 64), _meta(2, 2, 64, 64), {"enable_gqa": True}, None),  # grouped queries
    (_meta(4, 64, 64), None, {}, None),  # 3-D
    (_meta(2, 4, 64, 64, dtype=torch.float64), None, {}, None),
], ids=["causal", "head256", "fp32", "mask", "head512", "head60", "gqa", "3d", "fp64"])
def test_simulated_cuda_attention_takes_the_kernel_cuda_would(q, k, kwargs, kernel):
    """NOTE [ Attention on a simulated device ]: the kernel by the output's autograd
    node; None: the math path, as unsimulated."""
    _assert_simulated_kernel("cuda", q, k, kwargs, kernel)


@pytest.mark.parametrize("q, kwargs, kernel", [
    (_meta(2, 4, 64, 60, dtype=torch.float32), {"is_causal": True}, "FlashAttentionForCpu"),
    (_meta(2, 4, 64, 64), {"attn_mask": torch.ones(64, 64, dtype=torch.bool, device="meta")}, "FlashAttentionForCpu"),
    (_meta(2, 4, 64, 64, dtype=torch.float64), {}, "FlashAttentionForCpu"),
    (_meta(2, 4, 64, 64), {"dropout_p": 0.1}, None),
    (_meta(4, 64, 64), {}, None),
], ids=["causal", "mask", "fp64", "dropout", "3d"])
def test_simulated_cpu_attention_takes_the_kernel_the_cpu_would(q, kwargs, kernel):
    _assert_simulated_kernel("cpu", q, None, kwargs, kernel)


def _assert_simulated_kernel(device, q, k, kwargs, kernel):
    from actsave.meta import simulating
    k = q if k is None else k
    with simulating(device):
        out = nn.functional.scaled_dot_product_attention(q, k, k, **kwargs)
    name = type(out.grad_fn).__name__
    if kernel is None:
        assert "Flash" not in name and "Efficient" not in name, name
    else:
        assert name == f"ScaledDotProduct{kernel}Backward0"


@pytest.mark.parametrize("mode", ["plain", "wrap int8"])
def test_an_estimate_with_the_steps_loss_matches_that_step_on_cpu(mode):
    """``loss=``: the step's cross-entropy runs in the estimate, its buffers (a
    log-softmax over the vocabulary, 256 KiB here) held and freed as the measured step
    holds and frees them. Without it the backward starts from a gradient of ones of the
    output's size, held to the end: the estimate then missed by 351 KiB below (plain)
    and 154 KiB above (wrapped int8, whose peak is in the backward). With the loss: 1
    KiB under the step (the CPU's loss kernels)."""
    models = load_bench_module("models")
    torch.manual_seed(0)
    model = models.gpt(2, width=64, heads=4, vocab_size=512, max_seq_len=64)
    if mode != "plain":
        actsave.wrap(model, models.TransformerBlock, compress="int8")
    tokens, targets = torch.randint(0, 512, (2, 64)), torch.randint(0, 512, (2, 64))
    measured = peak_activation_bytes(model, tokens, loss=lambda out: F.cross_entropy(out.flatten(0, 1),
                                                                                      targets.flatten()))
    with_loss = actsave.estimate(model, tokens, device="cpu", loss=lambda out: F.cross_entropy(
        out.flatten(0, 1), targets.to(out.device).flatten())).activation_peak_bytes
    without = actsave.estimate(model, tokens, device="cpu").activation_peak_bytes
    assert abs(with_loss - measured) <= 2048 and abs(without - measured) > 100 * 1024


@pytest.mark.parametrize("loss, message", [
    (lambda out: out, "a tensor of shape (2, 64, 512)"),
    (lambda out: out.sum().detach(), "a tensor of shape () that needs no grad"),
    (lambda out: 1.0, "a float"),
])
def test_a_loss_that_gives_no_scalar_with_grad_says_what_to_return(loss, message):
    models = load_bench_module("models")
    model = models.gpt(1, width=32, heads=2, vocab_size=512, max_seq_len=64)
    with pytest.raises(ConfigError, match=re.escape(f"loss(output) gave {message}: it must return a one-element")):
        actsave.estimate(model, torch.randint(0, 512, (2, 64)), device="cpu", loss=loss)


def test_attention_on_other_tensors_runs_as_usual_while_cuda_is_simulated():
    from actsave.meta import simulating
    q = torch.randn(1, 2, 8, 16)
    expected = nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
    with simulating("cuda"):
        assert torch.equal(nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True), expected)


def test_integer_inputs_are_given_as_tensors():
    model = nn.Sequential(nn.Embedding(100, 32), nn.Linear(32, 32))
    tokens = torch.empty(4, 16, dtype=torch.long, device="meta")
    estimated = actsave.estimate(model, [tokens], device="cpu")
    measured = peak_activation_bytes(model, torch.randint(0, 100, (4, 16)))
    assert estimated.activation_peak_bytes == measured


@pytest.mark.parametrize("codec", [None, "int8"])
def test_offloaded_inputs_leave_the_simulated_device(codec):
    x = torch.randn(256, 64)
    exact = actsave.estimate(CheckpointedSequential(*deep_mlp(8), segments=8), tuple(x.shape), device="cuda")
    model = CheckpointedSequential(*deep_mlp(8), segments=8, compress=codec, offload=True)
    estimated = actsave.estimate(model, tuple(x.shape), device="cuda")
    # Six inputs go to the host (the first segment's is the batch, kept by reference),
    # int8 with one fp32 scale per 128 and the decisions of the segment's ReLU (1 bit each).
    per_segment = x.numel() * 4 if codec is None else x.numel() + x.numel() // 128 * 4 + x.numel() // 8
    assert estimated.host_peak_bytes == 6 * per_segment
    # On the device one input is fetched back at a time. Measured: exact 803,328 bytes,
    # offload 524,288, int8 + offload 529,408 (each input is 65,536 bytes in fp32).
    assert estimated.activation_peak_bytes <= exact.activation_peak_bytes - 4 * x.numel() * 4
    assert all(p.device.type == "cpu" for p in model.parameters())
    assert actsave.kept_bytes() == {"device": 0, "host": 0}


def test_bad_arguments_say_what_to_do():
    with pytest.raises(ConfigError, match="input_shapes='big' must be one shape"):
        actsave.estimate(nn.Linear(2, 2), "big")
    with pytest.raises(ConfigError, match="optimizer='lion' is not one of"):
        actsave.estimate(nn.Linear(2, 2), (1, 2), optimizer="lion")
    with pytest.raises(ConfigError, match="device='gpu' is not a torch device"):
        actsave.estimate(nn.Linear(2, 2), (1, 2), device="gpu")


class _ReadsAValue(nn.Module):
    def forward(self, x):
        return x * x.sum().item()


class _Conditional(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        return torch.cond(x.sum() > 0, lambda y: torch.relu(self.a(y)), lambda y: torch.sigmoid(self.b(y)), (x,))


def test_a_step_meta_tensors_cannot_run_says_so_and_names_torchs_error(monkeypatch):
    resets = []
    monkeypatch.setattr(torch._dynamo, "reset", lambda: resets.append(1))
    with pytest.raises(actsave.ActsaveError, match="ran one training step of the model on meta tensors") as raised:
        actsave.estimate(nn.Sequential(nn.Linear(8, 8), _ReadsAValue()), (4, 8), device="cpu")
    assert "item" in str(raised.value.__cause__)
    assert resets == []  # no higher-order operator: what the user compiled stays compiled


def test_torch_cond_works_after_an_estimate_through_it_failed():
    # NOTE [ A meta step that failed inside Dynamo ]: every later torch.cond of the
    # process failed, plain PyTorch's too.
    with pytest.raises(actsave.ActsaveError):
        actsave.estimate(nn.Sequential(nn.Linear(8, 8), _Conditional()), (64, 8), device="cpu")
    x = torch.randn(64, 8, requires_grad=True)
    _Conditional()(x).sum().backward()
    assert x.grad is not None
