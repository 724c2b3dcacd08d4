"""segments="balanced": the plans cached per input (planning/balanced_cache.py, NOTE [
Balanced segments ]). Its other tests, of the chain's training, are in test_sequential.py."""
import copy
import gc
import pickle
import warnings
import weakref

import pytest
import torch
from torch import nn

from actsave import CheckpointedSequential


def _linear_gelu_chain(blocks: int = 24, width: int = 64) -> CheckpointedSequential:
    torch.manual_seed(0)
    return CheckpointedSequential(*[m for _ in range(blocks) for m in (nn.Linear(width, width), nn.GELU())])


def _step(model: nn.Module, x: torch.Tensor) -> None:
    model(x).sum().backward()


def _freeze(layers, frozen: bool) -> None:
    for layer in layers:
        layer.requires_grad_(not frozen)


def test_unfreezing_a_frozen_prefix_plans_again():
    # Gradual unfreezing: a plan made while 40 of 48 layers were frozen keeps less
    # (their inputs need no gradient) than the chain needs once they train.
    x = torch.randn(64, 64)
    model = _linear_gelu_chain()
    _freeze(model[:40], True)
    _step(model, x)
    frozen_plan = model.balanced_plan
    _freeze(model[:40], False)
    _step(model, x)
    fresh = _linear_gelu_chain()
    _step(fresh, x)
    assert model.balanced_plan.starts == fresh.balanced_plan.starts != frozen_plan.starts
    assert model.balanced_plan.predicted_peak_bytes == fresh.balanced_plan.predicted_peak_bytes


class _Fixed(nn.Module):
    """A projection held as a buffer: it saves nothing unless its input needs grad."""

    def __init__(self, width: int):
        super().__init__()
        self.register_buffer("weight", torch.randn(width, width) / width ** 0.5)

    def forward(self, x):
        return x @ self.weight


def test_an_input_that_starts_requiring_grad_plans_again():
    # Input gradients (saliency, adversarial training) after steps without: the fixed
    # prefix saves its inputs now, which a plan made without keeps in one segment.
    def chain():
        torch.manual_seed(0)
        fixed = [m for _ in range(5) for m in (_Fixed(64), nn.GELU())]
        return CheckpointedSequential(*fixed, nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64))

    x = torch.randn(256, 64)
    model = chain()
    _step(model, x)
    without = model.balanced_plan
    _step(model, x.clone().requires_grad_())
    fresh = chain()
    _step(fresh, x.clone().requires_grad_())
    assert model.balanced_plan is not without
    assert model.balanced_plan.starts == fresh.balanced_plan.starts != without.starts
    assert model.balanced_plan.predicted_peak_bytes == fresh.balanced_plan.predicted_peak_bytes


def test_a_module_inside_a_layer_changing_mode_plans_again():
    # Dropouts inside the layers put in eval, then back in train: their masks are saved again.
    def chain():
        torch.manual_seed(0)
        blocks = [nn.Sequential(nn.Linear(64, 64), nn.Dropout(0.5), nn.GELU()) for _ in range(8)]
        return CheckpointedSequential(*blocks, nn.Linear(64, 64))

    def set_dropouts(model, training: bool) -> None:
        for module in model.modules():
            if isinstance(module, nn.Dropout):
                module.train(training)

    x = torch.randn(256, 64)
    model = chain()
    set_dropouts(model, False)
    _step(model, x)
    in_eval = model.balanced_plan
    set_dropouts(model, True)
    _step(model, x)
    fresh = chain()
    _step(fresh, x)
    assert model.balanced_plan is not in_eval
    assert model.balanced_plan.predicted_peak_bytes == fresh.balanced_plan.predicted_peak_bytes
    assert model.balanced_plan.predicted_peak_bytes > in_eval.predicted_peak_bytes


def test_a_frozen_chain_called_under_grad_mode_plans_nothing_and_warns_nothing():
    # A frozen teacher in a training loop: no backward will run through it.
    x = torch.randn(8, 64)
    model = _linear_gelu_chain().requires_grad_(False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = model(x)
    assert not out.requires_grad and model.balanced_plan is None
    with torch.no_grad():
        assert torch.equal(out, model(x))


def test_a_parameter_replaced_in_a_layer_is_followed_and_not_kept_alive():
    x = torch.randn(64, 64)
    model = _linear_gelu_chain(blocks=4)
    _step(model, x)
    trained = model.balanced_plan
    old = weakref.ref(model[0].weight)
    model[0].weight = nn.Parameter(model[0].weight.detach().clone(), requires_grad=False)
    gc.collect()
    assert old() is None
    _step(model, x)
    assert model.balanced_plan is not trained  # planned for the frozen weight


def test_a_parameter_replaced_is_followed_while_the_old_one_lives():
    x = torch.randn(64, 64)
    model = _linear_gelu_chain(blocks=4)
    _step(model, x)
    trained = model.balanced_plan
    old = model[0].weight  # held: an optimizer's copy, an EMA
    model[0].weight = nn.Parameter(old.detach().clone(), requires_grad=False)
    _step(model, x)
    assert model.balanced_plan is not trained


def test_a_trained_chain_converts_with_its_parameters_swapped():
    # module.to() under this flag swaps each parameter's contents in place
    # (torch.utils.swap_tensors), which refuses a tensor that a weak reference points to.
    x = torch.randn(16, 64)
    model = _linear_gelu_chain(blocks=4)
    plain = nn.Sequential(*copy.deepcopy(list(model)))
    _step(model, x)
    weight = model[0].weight
    swapping = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        model.to(torch.float64)
        plain.to(torch.float64)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swapping)
    assert model[0].weight is weight and weight.dtype == torch.float64
    for m in (model, plain):
        m.zero_grad()
        _step(m, x.double())
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(model.parameters(), plain.parameters()))


@pytest.mark.parametrize("change", ["replaced", "deleted"])
def test_a_layer_taken_out_of_the_chain_is_not_kept_alive_by_its_plans(change):
    # The cached plans hold their layers weakly: a pruned model only evaluated after
    # must not keep the old layer's weights until a training call.
    x = torch.randn(64, 64)
    model = _linear_gelu_chain(blocks=4)
    _step(model, x)
    old = weakref.ref(model[2])
    if change == "replaced":
        model[2] = nn.Linear(64, 64)
    else:
        del model[2:4]
    with torch.no_grad():
        model(x)
    gc.collect()
    assert old() is None
    _step(model, x)  # planned again for the layers it has


@pytest.mark.parametrize("copy_of", [copy.deepcopy, lambda m: pickle.loads(pickle.dumps(m))],
                         ids=["deepcopy", "pickle"])
def test_a_copied_chain_keeps_its_plans_for_its_own_layers(copy_of):
    x = torch.randn(64, 64)
    model = _linear_gelu_chain()
    _step(model, x)
    copied = copy_of(model)
    planned = copied.balanced_plan
    _step(copied, x)
    assert copied.balanced_plan is planned  # its layers: no plan made again


@pytest.mark.parametrize("copy_of", [copy.deepcopy, lambda m: pickle.loads(pickle.dumps(m))], ids=["deepcopy", "pickle"])
def test_a_copied_chain_follows_its_own_parameters(copy_of):
    x = torch.randn(64, 64)
    model = _linear_gelu_chain()
    _freeze(model[:40], True)
    _step(model, x)
    copied = copy_of(model)
    _freeze(copied[:40], False)  # the copy's, not the original's
    _step(copied, x)
    _step(model, x)
    fresh = _linear_gelu_chain()
    _step(fresh, x)
    assert copied.balanced_plan.starts == fresh.balanced_plan.starts != model.balanced_plan.starts


def test_a_chain_plans_again_when_its_parameters_change_dtype():
    # Token ids in: the input's key is the same after model.float(), the activations twice the bytes.
    torch.manual_seed(0)
    layers = [nn.Embedding(100, 64)] + [m for _ in range(6) for m in (nn.Linear(64, 64), nn.GELU())]
    ids = torch.randint(0, 100, (32, 16))
    model = CheckpointedSequential(*layers).to(torch.bfloat16)
    _step(model, ids)
    half = model.balanced_plan
    model.float()
    _step(model, ids)
    fresh = CheckpointedSequential(*copy.deepcopy(layers)).float()
    _step(fresh, ids)
    assert model.balanced_plan is not half
    assert model.balanced_plan.predicted_peak_bytes == fresh.balanced_plan.predicted_peak_bytes
    assert model.balanced_plan.predicted_peak_bytes > half.predicted_peak_bytes
