"""The host work of a checkpointed segment in the time model (planning/checkpoint_host.py,
NOTE [ Host work counted on a CPU only ])."""
import dataclasses
import math

import pytest
import torch
from torch import nn

import actsave
from actsave.planning import checkpoint_host, plans
from actsave.planning.checkpoint_host import CheckpointHostWork


def _chain():
    torch.manual_seed(0)
    return nn.Sequential(*(layer for _ in range(6) for layer in (nn.Linear(32, 32), nn.ReLU())))


def test_a_cpu_measures_it_once_per_process_and_other_devices_count_none():
    measured = checkpoint_host.checkpoint_host_work(torch.device("cpu"))
    assert measured.call_s > 0 and measured.save_s >= 0
    assert checkpoint_host.checkpoint_host_work(torch.device("cpu")) is measured
    assert checkpoint_host.checkpoint_host_work(torch.device("cuda")) == checkpoint_host.NO_HOST_WORK
    assert checkpoint_host.checkpoint_host_work(torch.device("meta")) == checkpoint_host.NO_HOST_WORK


def test_a_profile_counts_each_layers_saves_and_carries_the_host_work_where_it_is_timed():
    chain = _chain()
    timed = actsave.profile(chain, (torch.randn(4, 32, requires_grad=True),))
    sizes = actsave.profile(chain, (torch.randn(4, 32, device="meta", requires_grad=True),))
    # A Linear saves its input and its weight, a ReLU its output.
    assert [layer.saves for layer in timed.layers] == [2, 1] * 6 == [layer.saves for layer in sizes.layers]
    assert timed.checkpoint_host == checkpoint_host.checkpoint_host_work(torch.device("cpu"))
    assert sizes.checkpoint_host == checkpoint_host.NO_HOST_WORK


def test_each_checkpointed_segment_adds_its_call_and_its_saves_to_the_predicted_step():
    prof = actsave.profile(_chain(), (torch.randn(4, 32, requires_grad=True),))
    without = dataclasses.replace(prof, checkpoint_host=checkpoint_host.NO_HOST_WORK)
    with_work = dataclasses.replace(prof, checkpoint_host=CheckpointHostWork(call_s=1.0, save_s=0.125))
    starts = [0, 4, 9]  # two checkpointed segments, [0, 4) and [4, 9), then the plain last
    added = plans.predict(with_work, starts).predicted_step_seconds - plans.predict(without, starts).predicted_step_seconds
    saves = sum(layer.saves for layer in prof.layers[:9])
    assert math.isclose(added, 2 * 1.0 + 0.125 * saves, rel_tol=1e-9)
