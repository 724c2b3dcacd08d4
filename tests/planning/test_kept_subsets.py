"""Selective options that keep some of a block's calls (actsave/planning/kept_subsets.py,
NOTE [ Kept subsets ])."""
import copy

import pytest
import torch
from support import peak_activation_bytes
from transformer_blocks import GPTBlock
from torch import nn

import actsave
from actsave.planning.blocks import BlockPlanner
from actsave.planning.kept_subsets import KeptSubsets, called_units, subset_option
from actsave.runtime.keep_modes import BlockOption
from actsave.runtime.keep_rules import EXACT
from actsave.runtime.kept_ops import DEFAULT_KEPT_OPS, KeptOps

ATTENTION = ("function", "scaled_dot_product_attention")
GPT_UNITS = [("module", "qkv"), ATTENTION, ("module", "proj"), ("module", "fc1"), ("module", "fc2")]


def test_the_calls_are_found_in_the_order_the_forward_makes_them():
    block = GPTBlock()
    assert called_units(block, lambda: block(torch.randn(2, 16, 32))) == GPT_UNITS


class LowRankLinear(nn.Linear):
    """A Linear subclass holding Linears of its own: one call, whose output is kept."""

    def __init__(self, width: int):
        super().__init__(width, width)
        self.down, self.up = nn.Linear(width, 2, bias=False), nn.Linear(2, width, bias=False)

    def forward(self, x):
        return super().forward(x) + self.up(self.down(x))


def test_a_kept_module_inside_another_is_not_a_call_of_its_own():
    block = nn.Sequential(LowRankLinear(8), nn.GELU(), nn.Linear(8, 8))
    assert called_units(block, lambda: block(torch.randn(4, 8))) == [("module", "0"), ("module", "2")]


def test_a_subset_is_a_selective_option_keeping_the_calls_by_name():
    assert subset_option(GPT_UNITS, GPT_UNITS) == BlockOption("selective", EXACT, DEFAULT_KEPT_OPS)
    assert subset_option(GPT_UNITS, [("module", "qkv"), ATTENTION]).ops == KeptOps(module_names=("qkv",))
    assert subset_option(GPT_UNITS, [ATTENTION]).ops == KeptOps(modules=())
    assert subset_option(GPT_UNITS, [("module", "fc1")]).ops == KeptOps(functions=(), module_names=("fc1",))
    assert subset_option(GPT_UNITS, []) is None


class _Untimed:
    timed = False

    def signature(self, a):
        return a


def test_a_profile_without_times_offers_no_subsets():
    assert KeptSubsets(_Untimed()).at(0) == []


class GPTStack(nn.Module):
    def __init__(self, depth: int = 3):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(GPTBlock() for _ in range(depth))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x.square().mean()


def test_plans_choose_among_the_subsets_fit_their_budget_and_train_bit_identically():
    plain, x = GPTStack(), torch.randn(4, 32, 32)
    planned = copy.deepcopy(plain)
    planner = BlockPlanner(planned, [(f"blocks.{n}", b) for n, b in planned.blocks.named_children()], (x,),
                           allow=("recompute", "selective"))
    subsets = [o.ops for o in planner.table.labels[0]
               if o is not None and o.keep == "selective" and o.ops != DEFAULT_KEPT_OPS]
    # The path: qkv, proj and fc1 dropped, each one matmul again per output kept, the same
    # FLOPs per byte saved (forward order breaks the tie), attention last (the most). fc2
    # stays in every subset: its output is not kept (the early stop ends the recompute in
    # its call), and kept it spares its matmul, so the last subset keeps only the input.
    assert subsets == [KeptOps(module_names=("proj", "fc1", "fc2")), KeptOps(module_names=("fc1", "fc2")),
                       KeptOps(module_names=("fc2",)), KeptOps(module_names=("fc2",), functions=())]
    for share in (0.3, 0.7):
        budget = int(planner.smallest_peak_bytes + share * (planner.plain_peak_bytes - planner.smallest_peak_bytes))
        model, plan = copy.deepcopy((planned, planner.plan(budget)))  # the plan names the copy's blocks
        actsave.wrap(model, plan)
        assert peak_activation_bytes(model, x, loss=lambda out: out) <= plan.predicted_peak_bytes <= budget
        for m in (plain, model):
            for p in m.parameters():
                p.grad = None
            m(x.clone().requires_grad_()).backward()
        for (name, p), q in zip(plain.named_parameters(), model.parameters()):
            assert torch.equal(p.grad, q.grad), (share, name)


class _Measured:
    def __init__(self, seconds):
        self.seconds = seconds


class _Measurer:
    """Prices an option by how many of GPTBlock's five calls it drops: bytes fall and
    FLOPs rise by one with each, a timed step as ``seconds`` says (noisy: not
    monotone); notes the options it timed."""

    timed = True

    def __init__(self, seconds: dict):
        self.layers, self.seconds, self.prices, self.timed_options = [GPTBlock()], seconds, {}, []

    def signature(self, a):
        return a

    def example(self, a):
        return torch.randn(2, 16, 32)

    def _dropped(self, option) -> int:
        return 0 if option.ops == DEFAULT_KEPT_OPS else 5 - len(option.ops.names())

    def sized(self, a, option):
        dropped = self._dropped(option)
        return 100 - 10 * dropped, dropped

    def measured(self, a, option):
        if option not in self.prices:
            self.timed_options.append(self._dropped(option))
            self.prices[option] = self.seconds[self._dropped(option)]
        return _Measured(self.prices[option])

    def at_least(self, a, option, seconds):
        self.prices[option] = max(self.measured(a, option).seconds, seconds)

    def priced(self, a, option, seconds):
        self.prices[option] = seconds
        return _Measured(seconds)


@pytest.mark.parametrize("seconds, prices", [
    ({0: 5.0, 1: 4.0, 2: 9.0, 3: 1.0, 4: 12.0}, [6.75, 8.5, 10.25, 12.0]),  # on the line through 5 and 12
    ({0: 5.0, 4: 3.0}, [5.0, 5.0, 5.0, 5.0]),  # the last timed below "selective": priced as it
])
def test_the_path_is_priced_by_its_flops_between_selective_and_its_last_subset_timed(seconds, prices):
    measurer = _Measurer(seconds)
    path = KeptSubsets(measurer).at(0)
    assert [measurer.measured(0, option).seconds for option in path] == prices
    assert measurer.timed_options == [0, 4]  # "selective" and the last subset alone
