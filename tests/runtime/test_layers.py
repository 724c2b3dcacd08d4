"""Known layers (runtime/layers.py, NOTE [ Known layers ]): which modules a function
runs, and that a checkpointed forward and recompute of them hook no global module
hooks."""

import enum
import functools
import types

import pytest
import torch
from support import OpCounter
from torch import nn
from torch.nn.modules import module as module_globals

import actsave
from actsave.runtime.layers import LayerChain, known_layers, modules_under


class Chain(LayerChain):
    def __init__(self, layers):
        self.layers = layers


def test_layers_are_known_for_chains_sequentials_modules_and_their_bound_forwards_only():
    a, b = nn.Linear(2, 2), nn.ReLU()
    assert known_layers(Chain([a, b])) == (a, b)
    assert known_layers(nn.Sequential(a, b)) == (a, b)  # a plain Sequential: its children
    assert known_layers(a) == (a,)

    class MySequential(nn.Sequential):  # its forward may run its children otherwise
        pass

    mine = MySequential(a, b)
    assert known_layers(mine) == (mine,)
    assert known_layers(lambda x: a(x)) is None
    assert known_layers(a.forward) == (a,)  # runs the module uncalled: no hook would see it
    assert known_layers(super(MySequential, mine).forward) == (mine,)
    assert known_layers(a.extra_repr) is None  # another method: watched through the modules it calls
    assert known_layers(functools.partial(a.forward)) == (a,)
    assert known_layers(functools.partial(mine)) == (mine,)


def test_a_forward_is_told_by_its_function_not_its_name():
    class Aliased(nn.Linear):
        def _run(self, x):
            return super().forward(x)

        forward = _run

    def centred(self, x):
        return x - x.mean()

    aliased, plain = Aliased(2, 2), nn.Linear(2, 2)
    assert known_layers(aliased.forward) == (aliased,)
    plain.forward = types.MethodType(centred, plain)
    assert known_layers(plain.forward) == (plain,)  # the instance's own forward
    assert known_layers(types.MethodType(centred, nn.Linear(2, 2))) is None  # another method
    other = nn.Linear(2, 2)
    assert known_layers(types.MethodType(nn.Sequential.forward, other)) == (other,)  # a forward, by its name


def test_a_partial_binding_a_module_has_no_known_layers():
    # The module bound is outside the function's tree: its own calls are watched by
    # hooks (a BatchNorm passed so counted its statistics twice, gradients off by 0.26).
    block, norm = nn.Linear(2, 2), nn.BatchNorm1d(2)
    assert known_layers(functools.partial(block.forward)) == (block,)
    assert known_layers(functools.partial(block, norm=norm)) is None
    assert known_layers(functools.partial(functools.partial(block), norm)) is None

    class Holder:  # an object pytree cannot see into, holding a module
        def __init__(self, module):
            self.module = module

    assert known_layers(functools.partial(block, aux=Holder(norm))) is None
    assert known_layers(functools.partial(block, scale=2.0, mask=torch.ones(2), dtype=torch.float32)) == (block,)
    plain_values = dict(act=torch.nn.functional.gelu, silu=torch.nn.functional.silu, rows=slice(None), rest=...)
    assert known_layers(functools.partial(block, **plain_values)) == (block,)  # keep="selective" runs it
    assert known_layers(functools.partial(block, act=lambda x: norm(x))) is None  # a function that may call one
    for reaching in (torch.enable_grad()(norm), [norm].__getitem__, enum.Enum("Holds", {"NORM": norm}).NORM):
        assert known_layers(functools.partial(block, act=reaching)) is None, reaching


def test_modules_under_layers_are_listed_once_with_their_first_layer():
    shared = nn.Linear(2, 2)
    first, second = nn.Sequential(shared, nn.ReLU()), nn.Sequential(nn.Tanh(), shared)
    found = modules_under((first, second))
    assert [(i, type(m).__name__) for i, m in found] == [
        (0, "Sequential"), (0, "Linear"), (0, "ReLU"), (1, "Sequential"), (1, "Tanh")]


class GlobalHooksSeen(nn.Module):
    """Notes, at every call, how many global module hooks are registered."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def forward(self, x):
        self.seen.append(len(module_globals._global_forward_pre_hooks) + len(module_globals._global_forward_hooks))
        return x * 2


@pytest.mark.parametrize("compress", [None, "int8"])
def test_a_checkpointed_chain_registers_no_global_module_hook(compress):
    # Any global hook sends every module call down _call_impl's slow path.
    probe = GlobalHooksSeen()
    model = actsave.CheckpointedSequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.ReLU(), probe, nn.Linear(8, 8),
                                           nn.MaxPool1d(2), nn.Flatten(), nn.Linear(4, 2),
                                           segments=[0, 6], compress=compress)
    model(torch.randn(4, 8)).sum().backward()
    assert len(probe.seen) == 2 and probe.seen == [0, 0]  # forward and recompute


def test_a_function_of_unknown_layers_is_watched_by_global_hooks():
    probe = GlobalHooksSeen()
    x = torch.randn(4, 8, requires_grad=True)
    actsave.checkpoint(lambda t: probe(torch.tanh(t)), x).sum().backward()
    assert probe.seen[0] > 0  # the forward's recording hooks


def test_a_chain_snapshots_its_module_state_in_one_foreach_op_and_the_recompute_copies_nothing():
    # Two segments of three BatchNorms each: the forward copies their eighteen buffers
    # (float statistics and int64 batch counts) in one foreach op, not eighteen clones,
    # and the recompute runs on that snapshot (NOTE [ State a forward reads and mutates ]).
    def block():
        return nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.BatchNorm1d(8), nn.BatchNorm1d(8), nn.Tanh())

    model = actsave.CheckpointedSequential(block(), block(), nn.Linear(8, 2), segments=[0, 1, 2])
    with OpCounter() as forward:
        out = model(torch.randn(4, 8)).sum()
    with OpCounter() as backward:
        out.backward()
    assert forward.counts["aten._foreach_mul.Scalar"] == 1
    assert forward.counts["aten.clone.default"] == backward.counts["aten.clone.default"] == 0
    assert backward.counts["aten._foreach_mul.Scalar"] == 0


def test_a_chain_that_places_a_block_twice_snapshots_each_segment_as_it_starts():
    # The block's state at the second segment's start is what the first leaves.
    block = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Tanh())
    model = actsave.CheckpointedSequential(block, block, nn.Linear(8, 2), segments=[0, 1, 2])
    with OpCounter() as forward:
        model(torch.randn(4, 8)).sum().backward()
    assert forward.counts["aten._foreach_mul.Scalar"] == 2
