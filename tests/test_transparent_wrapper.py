"""TransparentWrapper (Checkpoint's base) hides nothing of the module it wraps:
attributes set, deleted and registered after wrap reach the module, and what a
state-dict load reports is in the names of the state dict as saved."""
import pytest
import torch
from support import assert_same_training, twin
from torch import nn

import actsave


class _Adaptable(nn.Module):
    """A block that runs an adapter where one was set on it (LoRA-style injection)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        adapter = getattr(self, "adapter", None)
        scale = getattr(self, "scale", None)
        y = self.fc(x) if adapter is None else self.fc(x) + adapter(x)
        return y if scale is None else y * scale


def _both(setup):
    """A plain model and its wrapped twin, ``setup`` applied to each block after wrap."""
    plain = nn.Sequential(_Adaptable(), nn.Tanh(), _Adaptable())
    model = actsave.wrap(twin(plain), _Adaptable)
    for blocks in (plain, model):
        torch.manual_seed(0)
        setup(blocks[0])
    return plain, model


@pytest.mark.parametrize("setup", [
    lambda b: setattr(b, "adapter", nn.Linear(4, 4)),
    lambda b: b.add_module("adapter", nn.Linear(4, 4)),
    lambda b: b.register_module("adapter", nn.Linear(4, 4)),
    lambda b: b.register_buffer("scale", torch.full((4,), 3.0)),
    lambda b: b.register_parameter("scale", nn.Parameter(torch.full((4,), 3.0))),
    lambda b: (delattr(b, "fc"), setattr(b, "fc", nn.Linear(4, 4))),
    lambda b: setattr(b, "scale", 3.0),
    lambda b: (setattr(b, "adapter", None), setattr(b, "adapter", nn.Linear(4, 4))),
], ids=["setattr", "add_module", "register_module", "register_buffer", "register_parameter", "del_and_set",
        "a_public_flag", "none_then_a_module"])
def test_what_is_set_on_a_wrapped_block_after_wrap_is_set_on_the_block(setup):
    plain, model = _both(setup)
    assert "adapter" not in model[0]._modules and "scale" not in model[0]._buffers
    assert list(model.state_dict()) == list(plain.state_dict())
    model.load_state_dict(model.state_dict())  # strict: the block's own keys
    assert_same_training(plain, model, torch.randn(3, 4))


def _disabled_train(self, mode=True):
    return self  # a frozen encoder's train(), as latent diffusion sets it: it stays in eval


def test_a_block_whose_train_is_disabled_stays_in_eval_mode_when_wrapped():
    plain = nn.Sequential(nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5)), nn.Linear(4, 4))
    model = actsave.wrap(twin(plain), lambda module, name: name == "0")
    for blocks in (plain, model):
        blocks[0].eval()
        blocks[0].train = _disabled_train.__get__(blocks[0])
    model.train(), plain.train()
    assert not model[0].module.training
    assert_same_training(plain, model, torch.randn(3, 4))


def test_the_training_flag_set_on_a_wrapper_reaches_the_module():
    dropout = nn.Dropout(0.5)
    wrapper = actsave.Checkpoint(dropout)
    wrapper.training = False  # the flag alone, as on a plain module: not its children's
    assert not dropout.training and not wrapper.training
    x = torch.randn(3, 4, requires_grad=True)
    assert torch.equal(wrapper(x), x)


class _SeesItsModeChange(nn.Module):
    """Acts on a change of mode in its train() (a fused weight made for eval)."""

    def __init__(self):
        super().__init__()
        self.fc, self.changes = nn.Linear(4, 4), 0

    def forward(self, x):
        return self.fc(x)

    def train(self, mode=True):
        self.changes += self.training != mode
        return super().train(mode)


def test_a_blocks_train_sees_the_change_of_mode():
    model = actsave.wrap(nn.Sequential(_SeesItsModeChange()), _SeesItsModeChange)
    model.eval(), model.train()
    assert model[0].module.changes == 2


def test_the_wrappers_own_names_are_read_only_where_the_module_has_none():
    wrapper = actsave.Checkpoint(nn.Linear(4, 4))
    with pytest.raises(AttributeError, match="'module' of a Checkpoint is read-only"):
        wrapper.module = nn.Linear(4, 4)


def test_a_hook_that_replaces_the_wrappers_forward_keeps_what_it_set_on_the_wrapper():
    # As accelerate's add_hook_to_module: it keeps the forward it replaces beside it.
    model = actsave.wrap(nn.Sequential(_Adaptable(), nn.Linear(4, 4)), _Adaptable)
    wrapper = model[0]
    wrapper._old_forward = wrapper.forward
    wrapper.forward = lambda *args, **kwargs: wrapper._old_forward(*args, **kwargs) * 2
    assert "_old_forward" in vars(wrapper) and "_old_forward" not in vars(wrapper.module)
    x = torch.randn(3, 4)
    assert torch.equal(model(x), model[1](2 * wrapper.module(x)))


def test_a_wrapped_sequential_is_indexed_as_itself():
    sequential = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
    wrapper = actsave.Checkpoint(sequential)
    assert wrapper[0] is sequential[0] and list(wrapper) == list(sequential)


def test_a_load_reports_and_its_hooks_use_the_names_of_the_state_dict_as_saved():
    plain = nn.Sequential(_Adaptable(), nn.Linear(4, 4))
    model = actsave.wrap(twin(plain), _Adaptable)
    seen = []
    model[0].register_load_state_dict_pre_hook(lambda module, state, prefix, *args: seen.extend(state))
    state = plain.state_dict()
    state["0.extra"] = state.pop("0.fc.bias")
    assert model.load_state_dict(state, strict=False) == plain.load_state_dict(state, strict=False)
    assert seen == ["0.fc.weight", "0.extra"]
    state["0.fc.weight"] = torch.zeros(5, 4)
    with pytest.raises(RuntimeError, match=r"size mismatch for 0\.fc\.weight:") as raised:
        model.load_state_dict(state)
    assert actsave.runtime.layers.WRAPPED_CHILD not in str(raised.value)


def test_a_load_report_keeps_a_name_that_only_ends_like_the_wrappers_child():
    plain = nn.Sequential(_Adaptable())
    plain.add_module("pre_checkpoint_wrapped_module", nn.Linear(4, 4))
    model = actsave.wrap(twin(plain), _Adaptable)
    state = plain.state_dict()
    del state["pre_checkpoint_wrapped_module.bias"]
    assert model.load_state_dict(state, strict=False).missing_keys == ["pre_checkpoint_wrapped_module.bias"]


def test_a_wrapped_state_dict_carries_the_module_versions_a_plain_load_reads():
    plain = nn.Sequential(nn.BatchNorm1d(4), nn.Linear(4, 4))
    model = actsave.wrap(twin(plain), nn.BatchNorm1d)
    state = model.state_dict()
    del state["0.num_batches_tracked"]  # a key the module's version says it has
    with pytest.raises(RuntimeError, match="Missing key.*0.num_batches_tracked"):
        plain.load_state_dict(state)
    model.load_state_dict(model.state_dict())  # and the wrapped model reads its own


class _CountsRuns(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.runs = nn.Linear(4, 4), 0

    def forward(self, x):
        self.runs += 1
        return torch.tanh(self.fc(x))


def _runs_of_a_step(model: nn.Module, block: _CountsRuns) -> int:
    block.runs = 0
    model(torch.randn(3, 4, requires_grad=True)).sum().backward()
    return block.runs


def test_accelerate_hooks_on_a_block_and_on_its_wrapper_are_each_their_own():
    # Read through, the block's hook made the wrapper look hooked: a hook added to the
    # wrapper replaced the block's and ran the block without the checkpoint.
    hooks = pytest.importorskip("accelerate.hooks")
    block = _CountsRuns()
    model = actsave.wrap(nn.Sequential(block, nn.Linear(4, 4)), _CountsRuns)
    seen = []
    for module, name in ((block, "block"), (model[0], "wrapper")):
        hook = hooks.ModelHook()
        hook.pre_forward = lambda module, *args, _name=name, **kwargs: (seen.append(_name), (args, kwargs))[1]
        hooks.add_hook_to_module(module, hook)
    assert _runs_of_a_step(model, block) == 2  # forward and recompute: still checkpointed
    assert seen == ["wrapper", "block", "block"]
    hooks.remove_hook_from_module(model[0])
    assert "_hf_hook" in vars(block) and _runs_of_a_step(model, block) == 2


def test_accelerate_hooks_added_before_wrap_are_removed_from_the_block_after_it():
    hooks = pytest.importorskip("accelerate.hooks")
    block = _CountsRuns()
    model = nn.Sequential(block, nn.Linear(4, 4))
    hooks.add_hook_to_module(block, hooks.ModelHook())
    actsave.wrap(model, _CountsRuns)
    hooks.remove_hook_from_submodules(model)
    assert "_hf_hook" not in vars(block)
    assert _runs_of_a_step(model, block) == 2
