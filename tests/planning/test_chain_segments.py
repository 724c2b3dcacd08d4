"""Where a CheckpointedSequential's segments come from (planning/chain_segments.py): its
segments= value, or the plan applied to it, the one source of its segments while applied."""
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
