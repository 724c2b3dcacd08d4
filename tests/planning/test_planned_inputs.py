"""A block plan's hidden state, checked where the blocks it wraps run (planning/
planned_inputs.py, NOTE [ A block plan's input ])."""
import copy
import pickle
import warnings

import torch
from torch import nn

import actsave


class Block(nn.Module):
    def __init__(self, width: int = 16):
        super().__init__()
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, h, scale=None):
        return h + self.down(torch.tanh(self.up(h)))


class Stack(nn.Module):
    def __init__(self, keyword: bool):
        super().__init__()
        torch.manual_seed(0)
        self.keyword = keyword
        self.blocks = nn.ModuleList(Block() for _ in range(4))

    def forward(self, x):
        for block in self.blocks:
            x = block(h=x) if self.keyword else block(x)
        return x.square().mean()


def _said(model, *shape: int) -> list:
    """The warnings of a training step on a hidden state of ``shape`` (then 16 features)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model(torch.randn(*shape, 16)).backward()
    return [str(w.message) for w in caught if "block plan runs on a hidden state" in str(w.message)]


def test_a_planned_block_warns_once_per_plan_on_a_larger_hidden_state_than_planned():
    for keyword in (False, True):
        model = Stack(keyword)
        smallest = actsave.plan_blocks(copy.deepcopy(model), Block, 2**40, (torch.randn(8, 16),)).smallest_peak_bytes
        plan = actsave.plan_blocks(model, Block, smallest, (torch.randn(8, 16),))
        assert any(option is not None for option in plan.options)
        actsave.wrap(model, plan)
        assert _said(model, 4) == [] and _said(model, 8) == []
        said = _said(model, 32)
        assert len(said) == 1 and "[32, 16]" in said[0] and "[8, 16]" in said[0]
        assert _said(model, 32) == []  # once per plan


def test_a_plan_pickled_with_its_inputs_checks_them_on_another_instance():
    model = Stack(keyword=False)
    smallest = actsave.plan_blocks(copy.deepcopy(model), Block, 2**40, (torch.randn(8, 16),)).smallest_peak_bytes
    plan = pickle.loads(pickle.dumps(actsave.plan_blocks(model, Block, smallest, (torch.randn(8, 16),))))
    other = Stack(keyword=False)
    actsave.wrap(other, plan)
    assert len(_said(other, 32)) == 1


def _planned(keyword: bool = False, example=(8, 16)):
    model = Stack(keyword)
    x = torch.randn(*example)
    smallest = actsave.plan_blocks(copy.deepcopy(model), Block, 2**40, (x,)).smallest_peak_bytes
    return actsave.wrap(model, actsave.plan_blocks(model, Block, smallest, (x,)))


def test_an_evaluation_under_no_grad_neither_warns_nor_uses_up_the_warning():
    model = _planned()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.no_grad():
            model(torch.randn(32, 16))  # keeps nothing: the plan's peak is not at stake
    assert not [w for w in caught if "block plan runs on a hidden state" in str(w.message)]
    assert len(_said(model, 32)) == 1


def test_a_hidden_state_larger_in_one_dimension_warns_at_as_many_elements():
    """The same tokens as fewer, longer sequences: attention written out grows with a
    sequence's square (NOTE [ A block plan's input ])."""
    said = _said(_planned(example=(4, 8, 16)), 2, 16)
    assert len(said) == 1 and "[2, 16, 16]" in said[0]


def test_fewer_tokens_in_a_bit_longer_sequences_do_not_warn():
    """An epoch's short batches: they lower the peak, and must not use up the warning a
    batch that outgrows the plan needs."""
    model = _planned(example=(8, 64, 16))
    said = _said(model, 4, 80) + _said(model, 16, 64)
    assert len(said) == 1 and "[16, 64, 16]" in said[0]


def test_a_wider_dtype_warns_at_fewer_elements_and_a_narrower_one_does_not():
    """model.double() doubles every activation: more bytes is larger (NOTE [ A block
    plan's input ]); a plan pickled before element sizes were recorded compares elements."""
    model = _planned()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.to(torch.bfloat16)(torch.randn(8, 16, dtype=torch.bfloat16)).float().backward()
        model.to(torch.float64)
        for _ in range(2):
            model(torch.randn(6, 16, dtype=torch.float64)).backward()
    said = [str(w.message) for w in caught if "block plan runs on a hidden state" in str(w.message)]
    assert len(said) == 1 and "[6, 16] (8 bytes an element)" in said[0] and "[8, 16] (4 bytes an element)" in said[0]
    recorded_before = actsave.planning.planned_inputs.PlannedInput(0, (8, 16), [False])
    assert recorded_before.element_size == 0
    recorded_before.check((torch.randn(6, 16, dtype=torch.float64),), {})
    assert not recorded_before.warned[0]
