"""plan(), the presets of CheckpointedSequential, the levers, and bad input."""
import fractions
import re
import warnings

import numpy as np
import pytest
import torch
from support import (
    assert_same_training,
    deep_mlp,
    mixed_chain,
    peak_activation_bytes,
    twin,
)
from torch import nn

import actsave
from actsave import CheckpointedSequential, ConfigError
from actsave.errors import InternalError
from actsave.planning import memory_model, plan_record, plans
from actsave.planning.live_bytes import LiveBytes


def test_generous_budget_keeps_everything_and_trains_exactly():
    plain = nn.Sequential(*mixed_chain())
    model = CheckpointedSequential.from_sequential(twin(plain))
    x = torch.randn(8, 16)
    prof = actsave.profile(model, (x,))
    model.apply_plan(actsave.plan(prof, 10 * plans.predict(prof, [0]).predicted_peak_bytes))
    assert model.segments == [0] and model.applied_plan.codecs == ()
    assert_same_training(plain, model, x)


@pytest.mark.parametrize("strategy", ["auto", "speed", "memory"])
def test_presets_plan_at_construction(strategy):
    x = torch.randn(128, 64)
    budget = 2 * 2**20
    model = CheckpointedSequential(*deep_mlp(), segments=strategy, budget=budget, example_inputs=(x,))
    plan = model.applied_plan
    assert model.segments == list(plan.starts) and plan.predicted_peak_bytes <= budget
    assert peak_activation_bytes(model, x) <= 1.05 * budget
    if strategy == "memory":
        prof = actsave.profile(model, (x,))
        assert plan.predicted_peak_bytes == actsave.plan(prof, None, objective="memory").predicted_peak_bytes


EVERY_CODEC = ("recompute", "int8", "fp8", "fp8_e5m2")


def conv_chain(blocks: int = 8, channels: int = 16) -> list:
    torch.manual_seed(0)
    layers = [m for _ in range(blocks) for m in (nn.Conv2d(channels, channels, 3, padding=1),
                                                    nn.BatchNorm2d(channels), nn.ReLU(inplace=True))]
    return [*layers, nn.Flatten(), nn.Linear(channels * 16 * 16, 10)]


def smallest_in(error: ConfigError, what: str = r"the smallest feasible budget is") -> int:
    return int(re.search(what + r" ([\d,]+) bytes", str(error)).group(1).replace(",", ""))


@pytest.mark.parametrize("strategy, share", [("memory", None), ("auto", 0.5), ("auto", 0.4)])
def test_planned_segments_are_exact_unless_a_codec_is_allowed(strategy, share):
    # A budget never picks a lossy codec nobody asked for: "auto" is exact (README),
    # at 40% and 50% of plain's peak of this 26-layer CNN and at its smallest peak.
    layers, x = conv_chain(), torch.randn(8, 16, 16, 16)
    plain = nn.Sequential(*layers)
    budget = None if share is None else int(share * plans.predict(actsave.profile(plain, (x,)), [0]).predicted_peak_bytes)
    model = CheckpointedSequential(*twin(plain), segments=strategy, budget=budget, example_inputs=(x,))
    assert set(model.applied_plan.codecs) <= {"none"} and model.applied_plan.saves_codec == "none"
    assert_same_training(plain, model, x)
    if strategy == "memory":
        # More levers never raise the smallest peak (here nested exact checkpoints reach
        # lower than any codec's single-level plan).
        lossy = CheckpointedSequential(*twin(plain), segments=strategy, example_inputs=(x,), allow=EVERY_CODEC)
        assert lossy.applied_plan.predicted_peak_bytes <= model.applied_plan.predicted_peak_bytes


def test_an_infeasible_exact_budget_names_the_codecs_that_fit_and_from_what_budget():
    # Sizes only (meta tensors), so single-level: there a codec lowers the smallest peak
    # (with times, nested exact checkpoints reach below any codec on these chains).
    prof = actsave.profile(nn.Sequential(*deep_mlp()), (torch.empty(128, 64, device="meta"),))
    exact = actsave.plan(prof, None, objective="memory").predicted_peak_bytes
    budget = exact - 1
    with pytest.raises(ConfigError, match="This budget fits with allow=\\('recompute', 'int8'\\)") as error:
        actsave.plan(prof, budget, objective="memory")
    assert smallest_in(error.value) == exact
    for codec in ("int8", "fp8_e4m3", "fp8_e5m2"):
        named = smallest_in(error.value, f"'{codec}' \\(expected gradient SQNR [\\d.]+ dB\\) to")
        assert named == actsave.plan(prof, None, objective="memory", allow=("recompute", codec)).predicted_peak_bytes
        assert named <= budget
    # min_sqnr_db leaves out the codecs below it, in the plan and in the error alike.
    with pytest.raises(ConfigError) as error:
        actsave.plan(prof, budget, objective="memory", min_sqnr_db=30)
    assert "'int8'" in str(error.value) and "fp8" not in str(error.value)


def test_an_infeasible_budget_names_the_smallest_budget_its_search_reaches_nested_included():
    # The error names the smallest budget the search reaches, nested plans included:
    # that budget plans, and one byte less does not.
    prof = actsave.profile(nn.Sequential(*deep_mlp(16, 64)), (torch.randn(256, 64),))
    plain = plans.predict(prof, [0]).predicted_peak_bytes
    with pytest.raises(ConfigError, match=r"\(nested checkpoints included\)") as error:
        actsave.plan(prof, plain // 20, allow=("recompute",))
    smallest = smallest_in(error.value)
    plan = actsave.plan(prof, smallest, allow=("recompute",))
    assert any(r is not None for r in plan.nested) and plan.predicted_peak_bytes <= smallest
    with pytest.raises(ConfigError) as error:
        actsave.plan(prof, smallest - 1, allow=("recompute",))
    assert smallest_in(error.value) == smallest


@pytest.mark.parametrize("layers", [lambda: deep_mlp(16, 64), lambda: list(mixed_chain(64)), lambda: conv_chain(6)],
                         ids=["mlp, where nesting helps", "mixed", "conv"])
def test_the_smallest_plan_is_the_one_the_error_states(layers):
    # One "smallest" everywhere: objective="memory" and an infeasible budget's error.
    model = nn.Sequential(*layers())
    x = torch.randn(8, 16, 16, 16) if isinstance(model[0], nn.Conv2d) else torch.randn(256, 64)
    prof = actsave.profile(model, (x,))
    smallest = actsave.plan(prof, None, objective="memory").predicted_peak_bytes
    for objective in ("time", "memory"):
        with pytest.raises(ConfigError) as error:
            actsave.plan(prof, smallest - 1, objective=objective)
        assert smallest_in(error.value) == smallest, objective
        assert "offload" not in str(error.value).split("bytes")[0]  # a CPU has no offload lever


def test_min_sqnr_and_allow_choose_the_codecs():
    # Sizes only, so single-level: there the smallest peak needs a codec (with times,
    # nested exact checkpoints reach below it on this chain).
    prof = actsave.profile(nn.Sequential(*deep_mlp()), (torch.empty(128, 64, device="meta"),))
    tight = actsave.plan(prof, None, objective="memory", allow=EVERY_CODEC).predicted_peak_bytes

    def codecs(**levers):
        levers.setdefault("allow", EVERY_CODEC)
        return {c for p in (actsave.plan(prof, None, objective="memory", **levers),) for c in p.codecs}

    # Lossy codecs are opt-in: the default levers are exact.
    assert codecs(allow=plans.DEFAULT_ALLOW) == {"none"} and actsave.plan(prof, None, objective="memory").codecs \
        == actsave.plan(prof, None, objective="memory", allow=("recompute",)).codecs
    assert codecs() - {"none"}, "at the smallest peak some inputs are compressed"
    assert codecs(min_sqnr_db=30) <= {"none", "int8"}
    assert codecs(min_sqnr_db=40) == codecs(allow=("recompute",)) == {"none"}
    assert actsave.plan(prof, None, objective="memory", allow=()).starts == (0,)
    with pytest.raises(ConfigError, match="smallest feasible budget"):
        actsave.plan(prof, tight // 4, objective="memory", allow=("recompute",))


def test_offload_is_a_lever_on_cuda_only_and_codecs_are_opt_in():
    cpu = plans.keep_options(plans.DEFAULT_ALLOW, None, "cpu")
    cuda = plans.keep_options(plans.DEFAULT_ALLOW, None, "cuda:0")
    assert {(o.codec.name, o.offload) for o in cpu} == {("none", False)}
    assert {(o.codec.name, o.offload) for o in cuda} == {("none", False), ("none", True)}
    codecs = ("none", "int8", "fp8_e4m3")
    named = plans.keep_options(("recompute", "int8", "fp8", "offload"), None, "cuda:0")
    assert {(o.codec.name, o.offload) for o in named} == {(c, f) for c in codecs for f in (False, True)}


@pytest.fixture(scope="module")
def small_profile():
    return actsave.profile(nn.Sequential(*deep_mlp(2)), (torch.randn(8, 64),))


@pytest.mark.parametrize("arguments, message", [
    (dict(budget=None), "budget .* is required"),
    (dict(budget=-5), "budget=-5 must be a positive, finite number of bytes"),
    (dict(budget=float("inf")), "budget=inf must be a positive, finite number of bytes"),
    (dict(budget=True), "budget=True must be"),
    (dict(budget="1GB"), "budget='1GB' must be"),
    (dict(budget=2**30, objective="fast"), "objective='fast' must be one of"),
    (dict(budget=2**30, allow="int8"), "allow='int8' must be a tuple of lever names"),
    (dict(budget=2**30, allow=("int4",)), r"unknown levers \['int4'\]"),
    (dict(budget=2**30, allow=("int8",)), "need 'recompute' in allow"),
    (dict(budget=2**30, min_sqnr_db="high"), "min_sqnr_db='high' must be a number"),
    (dict(budget=2**30, max_checkpointed_layers=0), "max_checkpointed_layers=0 must be None .* or an integer >= 1"),
    (dict(budget=2**30, max_checkpointed_layers=1.5), "max_checkpointed_layers=1.5 must be"),
])


def test_bad_plan_arguments_say_what_to_do(small_profile, arguments, message):
    with pytest.raises(ConfigError, match=message):
        actsave.plan(small_profile, **arguments)


def test_a_budget_of_any_number_type_plans_as_its_whole_bytes(small_profile):
    # A budget is taken as a Python number: numpy's unsigned integers wrap around below
    # zero (a budget below the chain's input would plan from a wrapped headroom), a
    # Fraction does not format as a size, and an int beyond a float's range overflows.
    smallest = actsave.plan(small_profile, objective="memory").predicted_peak_bytes
    for budget in (np.uint8(200), np.uint16(1500), np.uint32(1500), np.uint64(1500)):
        with pytest.raises(ConfigError, match="no plan fits"):
            actsave.plan(small_profile, budget)
    with pytest.raises(ConfigError, match="must be a positive, finite number of bytes"):
        actsave.plan(small_profile, 10**400)
    assert actsave.plan(small_profile, torch.tensor(2 * smallest)) == actsave.plan(small_profile, 2 * smallest)
    assert actsave.plan(small_profile, torch.tensor(2.0 * smallest, dtype=torch.float64)) == \
        actsave.plan(small_profile, 2 * smallest)
    for not_a_number in (True, torch.tensor(True), torch.tensor(1e6, device="meta"), torch.tensor(10**6, device="meta")):
        # a bool is never a count of bytes, and a meta tensor has no value
        with pytest.raises(ConfigError, match="must be a positive, finite number of bytes"):
            actsave.plan(small_profile, not_a_number)
    planned = actsave.plan(small_profile, fractions.Fraction(3 * smallest + 1, 2))
    assert planned.budget == (3 * smallest + 1) / 2 and type(planned.budget) is float
    assert planned == actsave.plan(small_profile, (3 * smallest + 1) / 2)
    assert f"{planned.budget / 2**20:.2f}" in str(planned)


def test_bad_profile_and_preset_arguments_say_what_to_do(small_profile):
    x = torch.randn(8, 64)
    with pytest.raises(ConfigError, match="expects an nn.Sequential"):
        actsave.profile(nn.Linear(64, 64), (x,))
    with pytest.raises(ConfigError, match=r"example_inputs must be \(x,\)"):
        actsave.profile(nn.Sequential(nn.Linear(64, 64)), (x, x))
    with pytest.raises(ConfigError, match="plan expects a Profile"):
        actsave.plan("profile", 2**30)
    with pytest.raises(ConfigError, match="the plan is for 4 layers"):
        CheckpointedSequential(*deep_mlp(3)).apply_plan(actsave.plan(small_profile, None, objective="memory"))
    with pytest.raises(ConfigError, match="segments='auto' needs budget="):
        CheckpointedSequential(*deep_mlp(2), segments="auto", example_inputs=(x,))
    with pytest.raises(ConfigError, match=r"segments='speed' chooses codecs and offload itself.*allow="):
        CheckpointedSequential(*deep_mlp(2), segments="speed", budget=2**20, example_inputs=(x,),
                               compress="int8")
    with pytest.raises(ConfigError, match="^budget= plan a profiled training step, which only segments=.* run, "
                                          "not segments='sqrt'"):
        CheckpointedSequential(*deep_mlp(2), segments="sqrt", budget=2**20)
    with pytest.raises(ConfigError, match="^allow= plan .* not segments=2"):
        CheckpointedSequential(*deep_mlp(2), segments=2, allow=("recompute",))
    # loss= is an argument of the class, but the default segments plan no step to run it
    # in; the error says which segments use it and how.
    with pytest.raises(ConfigError, match="^loss= plan .* not segments='balanced': .* pass segments='auto', "
                                          "budget= and example_inputs= \\(and loss="):
        CheckpointedSequential(*deep_mlp(2), loss=lambda y: y.sum())


@pytest.mark.parametrize("plain, codecs, offload, message", [
    ((True,), ("none", "none"), (False, False), "needs 2 plain flags"),
    ((1, 0), ("none", "none"), (False, False), "must be a tuple of True or False"),
    ((False, True), ("none", "none"), (False, True), "segment 1 is plain .* offload False"),
    ((True, False), ("int8", "none"), (True, False), "segment 0 is plain .* offload False"),
])
def test_bad_plain_flags_say_what_to_do(plain, codecs, offload, message):
    with pytest.raises(ConfigError, match=message):
        plan_record.Plan(4, (0, 1, 2), codecs, offload, 0, 0.0, 0, plain=plain)


def test_plain_middle_false_plans_as_before_and_true_is_never_slower(small_profile):
    everything = plans.predict(small_profile, [0]).predicted_peak_bytes
    smallest = actsave.plan(small_profile, None, objective="memory").predicted_peak_bytes
    for budget in (smallest, (smallest + everything) // 2, everything):
        last_only = actsave.plan(small_profile, budget, plain_middle=False)
        assert not any(last_only.plain)
        assert actsave.plan(small_profile, budget).predicted_step_seconds <= last_only.predicted_step_seconds
    with pytest.raises(ConfigError, match="plain_middle=1 must be True or False"):
        actsave.plan(small_profile, everything, plain_middle=1)


def test_plan_refuses_a_plan_its_own_prediction_does_not_fit(small_profile):
    honest = memory_model.CostModel.predict

    def one_byte_over(model, segments, *nested):
        peak, seconds, peak_segment = honest(model, segments, *nested)
        return peak + 1, seconds, peak_segment

    tightest = actsave.plan(small_profile, None, objective="memory").predicted_peak_bytes
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(memory_model.CostModel, "predict", one_byte_over)
        with pytest.raises(InternalError, match="the dynamic program and the model disagree"):
            actsave.plan(small_profile, tightest)


def test_auto_segments_given_the_loss_fit_a_budget_that_a_plan_without_it_overruns():
    # Wide logits: cross-entropy keeps a logits-sized log-softmax, and its backward makes
    # two more, on top of what the forward left. A plan that fills its budget without
    # knowing that overruns it; given loss=, the profiled step runs the loss.
    torch.manual_seed(0)
    layers = [*deep_mlp(6, 64), nn.Linear(64, 1024)]
    x, targets = torch.randn(128, 64), torch.randint(0, 1024, (128,))

    def loss(logits):
        return nn.functional.cross_entropy(logits, targets)

    unaware = actsave.profile(CheckpointedSequential(*layers), (x,))
    smallest = actsave.plan(unaware, None, objective="memory").predicted_peak_bytes
    overrun = []
    for budget in range(smallest, 3 * smallest, smallest // 8):
        blind = CheckpointedSequential(*layers, segments="auto", budget=budget, example_inputs=(x,))
        if peak_activation_bytes(blind, x, loss) > budget:
            overrun.append(budget)
    assert overrun, "no budget at which a plan without the loss overruns: the test shows nothing"
    fitted = 0
    for budget in overrun:
        try:
            aware = CheckpointedSequential(*layers, segments="auto", budget=budget, example_inputs=(x,), loss=loss)
        except ConfigError:  # the loss does not fit beside any plan: refused, not overrun
            continue
        assert peak_activation_bytes(aware, x, loss) <= budget
        fitted += 1
    assert fitted, "every overrun budget was refused: no plan given the loss was measured"


def test_checkpointed_sequential_takes_min_sqnr_db_as_the_planners_do():
    # One set of planning arguments: budget, example_inputs, loss, allow, min_sqnr_db.
    layers, x = deep_mlp(), torch.randn(128, 64)
    prof = actsave.profile(nn.Sequential(*layers), (x,))
    budget = actsave.plan(prof, None, objective="memory", allow=EVERY_CODEC).predicted_peak_bytes
    for floor in (None, 30, 40):
        model = CheckpointedSequential(*layers, segments="memory", example_inputs=(x,), allow=EVERY_CODEC,
                                       min_sqnr_db=floor)
        expected = actsave.plan(actsave.profile(model, (x,)), None, objective="memory", allow=EVERY_CODEC,
                                min_sqnr_db=floor)
        assert model.applied_plan.codecs == expected.codecs
    assert set(CheckpointedSequential(*layers, segments="memory", example_inputs=(x,), allow=EVERY_CODEC,
                                      min_sqnr_db=40).applied_plan.codecs) == {"none"}
    assert budget > 0
    with pytest.raises(ConfigError, match="^min_sqnr_db= plan .* not segments=2"):
        CheckpointedSequential(*layers, segments=2, min_sqnr_db=30)


def test_a_deep_plan_prints_a_summary_unless_asked_for_every_segment():
    # A plan of hundreds of segments prints a summary, not a line per segment, and a
    # plan made on meta tensors prints no step time ("step 0.000 ms").
    layers = [m for _ in range(100) for m in (nn.Linear(64, 64), nn.ReLU())]
    prof = actsave.profile(nn.Sequential(*layers), (torch.empty(32, 64, device="meta"),))
    plan = actsave.plan(prof, None, objective="memory")
    summary, full = str(plan).splitlines(), plan.table(every_segment=True).splitlines()
    assert len(plan.starts) > 10 and len(full) == 2 + len(plan.starts) and len(summary) <= 6, str(plan)
    assert "no step time (profiled on meta tensors)" in summary[0] and "ms" not in summary[0]
    covered = []  # each summary row names a run of segments, "first-last (count)"
    for row in summary[2:]:
        first, _, last = row.split()[0].partition("-")
        covered += range(int(first), int(last or first) + 1)
    assert covered == list(range(len(plan.starts)))
    timed = actsave.plan(actsave.profile(nn.Sequential(*layers), (torch.randn(32, 64),)), None, objective="memory")
    assert " ms" in str(timed).splitlines()[0]


def test_the_runtime_and_a_balanced_plan_keep_the_last_segment_alike():
    # balanced_cache.py, NOTE [ Balanced segments ]: plans.balanced_last_policy answers
    # for both, whatever the last segment's first layer asks (int8 here).
    torch.manual_seed(0)
    model = CheckpointedSequential(*[m for _ in range(6) for m in (nn.Linear(64, 64), nn.ReLU())], compress="int8")
    model(torch.randn(32, 64, requires_grad=True) * 1).sum().backward()
    last = plans.balanced_last_policy()
    stored_rows = [line.split() for line in model.describe().splitlines()[2:] if line.split()[4:5] == ["saves"]]
    assert [row[5] for row in stored_rows] == [last.codec.name]  # the runtime's
    assert model.balanced_plan.saves_codec == last.codec.name  # the plan's
    assert not last.lossy


def test_the_old_names_of_plain_segments_still_work_and_warn(small_profile):
    # Plan.stored / stored_codec and plan(store_middle=, compress_stored=) were renamed
    # plain / saves_codec / plain_middle / compress_saves: the old names said "stored" for
    # run plainly, where actsave's word for held for backward is "kept" (kept_bytes()).
    # They work for one release, with a warning.
    budget = actsave.plan(small_profile, None, objective="memory").predicted_peak_bytes * 2
    new = actsave.plan(small_profile, budget, plain_middle=False, compress_saves=False)
    with pytest.warns(DeprecationWarning) as caught:
        old = actsave.plan(small_profile, budget, store_middle=False, compress_stored=False)
    messages = [str(w.message) for w in caught]
    assert any("plan(store_middle=...) is deprecated" in m and "plan(plain_middle=...)" in m for m in messages)
    assert any("plan(compress_stored=...) is deprecated" in m for m in messages)
    assert old == new
    with pytest.warns(DeprecationWarning, match=r"Plan.stored is deprecated"):
        assert old.stored == new.plain
    with pytest.warns(DeprecationWarning, match=r"Plan.stored_codec is deprecated"):
        assert old.stored_codec == new.saves_codec == "none"
    with pytest.warns(DeprecationWarning, match=r"Plan\(stored=...\)"):
        made = plan_record.Plan(4, (0, 2), ("none",), (False,), 0, 0.0, 0, stored=(True,))
    assert made.plain == (True,)
    with pytest.raises(ConfigError, match="both stored= and plain="):
        plan_record.Plan(4, (0, 2), ("none",), (False,), 0, 0.0, 0, stored=(True,), plain=(True,))
    with pytest.raises(TypeError, match="unexpected keyword argument 'stored_middle'"):
        actsave.plan(small_profile, budget, stored_middle=False)


def _embedding_chain(sparse: bool) -> list:
    torch.manual_seed(0)
    return [nn.Embedding(1000, 64, sparse=sparse)] + [m for _ in range(6) for m in (nn.Linear(64, 64), nn.GELU())]


def _live_step_peak(model: nn.Module, ids: torch.Tensor) -> int:
    """The peak of one training step, its input included, by the planner's own count
    (LiveBytes): MemTracker reads no sparse gradient's storage. As
    peak_activation_bytes, over gradients already allocated."""
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    tracker = LiveBytes("cpu", known=(list(model.parameters()), [p.grad for p in model.parameters()], ids))
    with tracker:
        out = model(ids)
        out.backward(torch.ones_like(out))
    return tracker.peak + ids.untyped_storage().nbytes()


@pytest.mark.parametrize("sparse", [False, True])
def test_a_chain_with_a_sparse_embedding_plans_to_its_measured_peak_and_trains_as_plain(sparse):
    # Its gradient is a sparse tensor, counted by its indices' and values' storages
    # (NOTE [ Sparse tensors' storages ] in live_bytes.py): planned as the dense one is.
    ids = torch.randint(0, 1000, (16, 64))
    unplanned = plans.predict(actsave.profile(nn.Sequential(*_embedding_chain(sparse)), (ids,)), [0])
    budget = unplanned.predicted_peak_bytes * 2 // 3
    model = CheckpointedSequential(*_embedding_chain(sparse), segments="auto", budget=budget, example_inputs=(ids,))
    assert len(model.segments) > 1
    measured = _live_step_peak(model, ids)
    assert model.applied_plan.predicted_peak_bytes == measured <= budget
    assert sparse or measured == peak_activation_bytes(model, ids)  # the count is MemTracker's where it reads one
    plain = nn.Sequential(*_embedding_chain(sparse))
    for m in (plain, model):
        m.zero_grad(set_to_none=True)
        m(ids).square().sum().backward()
    assert torch.equal(plain(ids), model(ids))
    assert model[0].weight.grad.is_sparse == sparse
    for (name, p), q in zip(plain.named_parameters(), model.parameters()):
        assert p.grad.layout == q.grad.layout, name
        assert all(map(torch.equal, _grad_parts(p), _grad_parts(q))), name


def _grad_parts(p: torch.Tensor) -> tuple:
    if not p.grad.is_sparse:
        return (p.grad,)
    grad = p.grad.coalesce()
    return grad.indices(), grad.values()


def test_a_chain_warns_once_where_it_runs_its_plan_on_a_larger_input_than_it_was_planned_for():
    torch.manual_seed(0)
    layers = [module for _ in range(4) for module in (nn.Linear(16, 16), nn.GELU())]
    x = torch.randn(8, 16)
    model = actsave.CheckpointedSequential(*layers, segments="auto", budget=2**30, example_inputs=(x,))
    assert model.applied_plan.input_shape == (8, 16)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model(torch.randn(4, 16)).sum().backward()  # smaller: the plan holds
        for _ in range(2):
            model(torch.randn(32, 16)).sum().backward()
    said = [str(w.message) for w in caught if "plan was made for an input of shape [8, 16]" in str(w.message)]
    assert len(said) == 1 and "[32, 16]" in said[0]


def test_a_chain_warns_where_its_input_is_larger_in_bytes_at_fewer_elements():
    # A wider dtype (model.double()) doubles every activation.
    torch.manual_seed(0)
    layers = [module for _ in range(4) for module in (nn.Linear(16, 16), nn.GELU())]
    model = actsave.CheckpointedSequential(*layers, segments="auto", budget=2**30, example_inputs=(torch.randn(8, 16),))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.to(torch.bfloat16)(torch.randn(8, 16, dtype=torch.bfloat16)).float().sum().backward()
        model.to(torch.float64)(torch.randn(6, 16, dtype=torch.float64)).sum().backward()
    said = [str(w.message) for w in caught if "plan was made for an input of shape [8, 16]" in str(w.message)]
    assert len(said) == 1 and "[6, 16] (8 bytes an element)" in said[0]


def test_a_chain_warns_where_its_input_is_larger_in_one_dimension_at_as_many_elements():
    """The same tokens as fewer, longer sequences (NOTE [ A block plan's input ])."""
    torch.manual_seed(0)
    layers = [module for _ in range(4) for module in (nn.Linear(16, 16), nn.GELU())]
    model = actsave.CheckpointedSequential(*layers, segments="auto", budget=2**30,
                                           example_inputs=(torch.randn(4, 8, 16),))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model(torch.randn(2, 16, 16)).sum().backward()
    assert len([w for w in caught if "plan was made for an input of shape [4, 8, 16]" in str(w.message)]) == 1
