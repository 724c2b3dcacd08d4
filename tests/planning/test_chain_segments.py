"""Where a CheckpointedSequential's segments come from (planning/chain_segments.py): its
segments= value, or the plan applied to it, the one source of its segments while applied."""
import copy
import pickle
import warnings

import pytest
import torch
from support import deep_mlp

import actsave
from actsave import CheckpointedSequential
from actsave.planning import plans


def test_the_applied_plan_is_the_one_source_of_segments_until_others_are_set():
    def kept_by_segment(model):  # describe()'s "keeps" column: "input" where checkpointed
        rows = [line.split() for line in model.describe().splitlines()[1:]]
        return [row[4] for row in rows if len(row) > 4]

    model = CheckpointedSequential(*deep_mlp(6))
    x = torch.randn(16, 64)
    starts = [0, 4, 8]
    plan = plans.predict(actsave.profile(model, (x,)), starts, plain=[False, True])
    model.apply_plan(plan)
    assert model.segments == starts and model.applied_plan is plan
    assert kept_by_segment(model) == ["input", "saves", "saves"]  # the middle one plain
    model.segments = list(starts)  # its own segments: the plan stays
    assert model.applied_plan is plan and kept_by_segment(model) == ["input", "saves", "saves"]
    model.segments = [0, 8]
    assert model.applied_plan is None and model.segments == [0, 8]
    model.segments = list(starts)  # the plan's starts again, without the plan: no plain middle
    assert model.applied_plan is None and kept_by_segment(model) == ["input", "input", "saves"]


def _describe_rows(model) -> dict:
    """describe()'s rows where a segment starts: {layer: (keeps, codec, kept bytes)}."""
    rows = [line.split() for line in model.describe().splitlines()]
    return {int(row[0]): (row[4], row[5], row[-1]) for row in rows if len(row) > 6 and row[0].isdigit()}


def test_a_module_placed_twice_keeps_by_the_option_the_plan_gives_each_position():
    torch.manual_seed(0)
    shared = torch.nn.Linear(64, 64)
    model = CheckpointedSequential(*[m for _ in range(6) for m in (shared, torch.nn.GELU())])
    x = torch.randn(32, 64, requires_grad=True)
    # Segments start at the shared Linear at 2, 4 and 8 (the last): int8 at 2 only.
    plan = plans.predict(actsave.profile(model, (x,)), [0, 2, 4, 8], codecs=["none", "int8", "none"])
    model.apply_plan(plan)
    model(x).sum().backward()
    rows = _describe_rows(model)
    exact_input = 32 * 64 * 4
    assert rows[2][1] == "int8" and int(rows[2][2]) < exact_input / 3
    assert rows[4][1:] == ("none", str(exact_input))
    # A setting made after the plan applies at every position of its module.
    model.set_compression(2, None)
    model(x).sum().backward()
    assert _describe_rows(model)[2][1:] == ("none", str(exact_input))


def _shared_at_2_4_and_8(x):
    """A chain whose shared Linear starts segments at 2 (int8), 4 (exact) and 8 (the
    last, plain), with the plan applied and one step run."""
    torch.manual_seed(0)
    shared = torch.nn.Linear(64, 64)
    model = CheckpointedSequential(*[m for _ in range(6) for m in (shared, torch.nn.GELU())])
    model.apply_plan(plans.predict(actsave.profile(model, (x,)), [0, 2, 4, 8], codecs=["none", "int8", "none"]))
    model(x).sum().backward()
    return model


def test_a_setter_after_the_plan_changes_only_what_it_sets_at_each_position_of_a_module():
    x = torch.randn(32, 64, requires_grad=True)
    model = _shared_at_2_4_and_8(x)
    planned = _describe_rows(model)
    assert planned[2][1] == "int8" and planned[4][1] == "none"
    model.set_offload(4, False)  # the offload the plan has: no codec asked for
    model(x).sum().backward()
    assert _describe_rows(model) == planned
    model.set_compression(4, "int8")  # a codec: at every position of the module
    model(x).sum().backward()
    assert _describe_rows(model)[4][1] == "int8" and _describe_rows(model)[2] == planned[2]


@pytest.mark.parametrize("change", ["insert", "append", "delete", "replace"])
def test_a_plan_applied_to_a_chain_raises_once_its_layers_change(change):
    model = CheckpointedSequential(*deep_mlp(4))
    x = torch.randn(8, 64)
    model.apply_plan(plans.predict(actsave.profile(model, (x,)), [0, 2, 5], codecs=["none", "int8"]))
    if change == "insert":
        model.insert(0, torch.nn.Identity())
    elif change == "append":
        model.append(torch.nn.Identity())
    elif change == "delete":
        del model[6:]
    else:
        model[3] = torch.nn.Tanh()
    for call in (lambda: model(x), model.describe):
        with pytest.raises(actsave.ConfigError, match="changed after its plan was applied.*set model.segments"):
            call()
    model.segments = "balanced"  # drops the plan
    assert model.applied_plan is None
    model(x.requires_grad_()).sum().backward()


def test_a_plan_warns_once_when_parameters_frozen_in_its_profile_require_grad():
    # Gradual unfreezing: autograd saves more than the plan priced (1.72x its budget
    # on a 20-layer chain planned at its smallest peak, silently).
    model = CheckpointedSequential(*deep_mlp(4))
    x = torch.randn(8, 64)
    model[0].requires_grad_(False)
    plan = plans.predict(actsave.profile(model, (x,)), [0, 2, 5])
    assert plan.frozen == ((0, "weight"), (0, "bias"))
    model.apply_plan(plan)
    model(x).sum().backward()  # as profiled: nothing to say
    model[2].requires_grad_(False)  # frozen since: the peak only falls
    model(x).sum().backward()
    model[0].requires_grad_(True)
    with pytest.warns(UserWarning, match=r"frozen when its plan's chain was profiled require grad now \(layer 0's "
                                         r"'weight' and others\)"):
        model(x).sum().backward()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model(x).sum().backward()  # once
        model[2].requires_grad_(True)
        model.apply_plan(plans.predict(actsave.profile(model, (x,)), [0, 2, 5]))  # as it is now: nothing frozen
        model[4].requires_grad_(False)
        model(x).sum().backward()
    with pytest.warns(UserWarning, match="frozen when its plan's chain was profiled"):
        model.apply_plan(plan)  # unfrozen before it was applied


def test_a_plan_stays_applied_through_copies_pickles_and_a_layer_compiled_in_place():
    model = CheckpointedSequential(*deep_mlp(4))
    x = torch.randn(8, 64)
    model.apply_plan(plans.predict(actsave.profile(model, (x,)), [0, 2, 5], codecs=["none", "int8"]))
    model.set_compression(2, None)  # a setting changed after the plan travels too
    for copy_of in (copy.deepcopy, lambda m: pickle.loads(pickle.dumps(m))):
        copied = copy_of(model)
        assert copied.applied_plan == model.applied_plan
        assert _describe_rows(copied) == _describe_rows(model)  # same layers, same options: no ConfigError
        copied(x.clone().requires_grad_()).sum().backward()
    model[3] = torch.compile(model[3])  # the same layer
    assert model.applied_plan is not None and "segment" in model.describe()


def test_describe_after_the_layers_change_waits_for_the_next_balanced_plan():
    model = CheckpointedSequential(*deep_mlp(6))
    model(torch.randn(8, 64, requires_grad=True)).sum().backward()
    del model[2:]
    assert model.describe() == ("segments='balanced': chosen at the next training call (the layers changed since "
                                "the last)")


@pytest.mark.parametrize("value, message", [
    ("auto", "segments='auto' plans from a profiled step"),
    ([7], r"segments=\[7\] must be"),
])
def test_setting_segments_checks_them_at_once(value, message):
    model = CheckpointedSequential(*deep_mlp(2))
    with pytest.raises(actsave.ConfigError, match=message):
        model.segments = value
    assert model.segments == "balanced"
