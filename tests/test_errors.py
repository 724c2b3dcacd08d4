"""Every public function and class refuses a bad argument with a ConfigError that names
the argument and what it accepts (docs/architecture.md), never with an internal
AttributeError or TypeError, and never by silently doing nothing. Integral numbers of
any type (numpy's too) are accepted where an integer is, bools are not."""
import warnings

import numpy as np
import pytest
import torch
from torch import nn

import actsave
from actsave import CheckpointedSequential, ConfigError


def chain() -> nn.Sequential:
    return nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))


def checkpointed() -> CheckpointedSequential:
    return CheckpointedSequential(*chain(), segments=2)


def x():
    return torch.randn(2, 4, requires_grad=True)


_PROFILE = []


def profiled() -> actsave.Profile:
    if not _PROFILE:
        _PROFILE.append(actsave.profile(chain(), (torch.empty(2, 4, device="meta"),)))
    return _PROFILE[0]


# (call, substrings its message must contain: the argument and what it accepts)
BAD_CALLS = {
    # checkpoint(function, *args, ...)
    "checkpoint-function-str": (lambda: actsave.checkpoint("sin", x()), ["function='sin'", "callable"]),
    "checkpoint-function-none": (lambda: actsave.checkpoint(None, x()), ["function=None", "callable"]),
    "checkpoint-use_reentrant-true": (lambda: actsave.checkpoint(torch.sin, x(), use_reentrant=True),
                                      ["use_reentrant=True", "use_reentrant=False"]),
    "checkpoint-context_fn": (lambda: actsave.checkpoint(torch.sin, x(), context_fn=lambda: (None, None)),
                              ["context_fn=", "not supported"]),
    "checkpoint-determinism_check": (lambda: actsave.checkpoint(torch.sin, x(), determinism_check=None),
                                     ["determinism_check=None", "'default'", "'none'"]),
    "checkpoint-compress": (lambda: actsave.checkpoint(torch.sin, x(), compress="int4"), ["compress='int4'", "int8"]),
    "checkpoint-offload": (lambda: actsave.checkpoint(torch.sin, x(), offload=None), ["offload=None", "True or False"]),
    # Checkpoint(module, ...)
    "Checkpoint-class": (lambda: actsave.Checkpoint(nn.Linear), ["module=", "nn.Module instance"]),
    "Checkpoint-str": (lambda: actsave.Checkpoint("model"), ["module='model'", "nn.Module instance"]),
    "Checkpoint-preserve_rng_state": (lambda: actsave.Checkpoint(nn.ReLU(), preserve_rng_state="no"),
                                      ["preserve_rng_state='no'", "True or False"]),
    "Checkpoint-debug": (lambda: actsave.Checkpoint(nn.ReLU(), debug=None), ["debug=None", "True or False"]),
    # wrap(model, filter_fn, ...)
    "wrap-model-str": (lambda: actsave.wrap("model", nn.Linear), ["model='model'", "nn.Module instance"]),
    "wrap-model-none": (lambda: actsave.wrap(None, nn.Linear), ["model=None", "nn.Module instance"]),
    "wrap-model-class": (lambda: actsave.wrap(nn.Linear, nn.Linear), ["model=", "nn.Module instance"]),
    "wrap-filter-empty-tuple": (lambda: actsave.wrap(chain(), ()), ["filter_fn=()", "non-empty tuple"]),
    "wrap-filter-instance": (lambda: actsave.wrap(chain(), nn.Linear(2, 2)), ["filter_fn=", "not an instance"]),
    "wrap-filter-none": (lambda: actsave.wrap(chain(), None), ["filter_fn=None", "callable(module, fqn)"]),
    "wrap-determinism_check": (lambda: actsave.wrap(chain(), nn.Linear, determinism_check="strict"),
                               ["determinism_check='strict'", "'default'"]),
    # CheckpointedSequential
    "sequential-segments-bool": (lambda: CheckpointedSequential(*chain(), segments=True),
                                 ["segments=True", "1 <= k <= 3"]),
    "sequential-segments-float": (lambda: CheckpointedSequential(*chain(), segments=2.0),
                                  ["segments=2.0", "1 <= k <= 3"]),
    "sequential-segments-none": (lambda: CheckpointedSequential(*chain(), segments=None),
                                 ["segments=None", "'balanced'"]),
    "sequential-segments-negative": (lambda: CheckpointedSequential(*chain(), segments=-1),
                                     ["segments=-1", "1 <= k <= 3"]),
    "sequential-segments-float-start": (lambda: CheckpointedSequential(*chain(), segments=[0, 1.0]),
                                        ["segments=[0, 1.0]", "layer indices"]),
    "sequential-layer-not-module": (lambda: CheckpointedSequential("relu"), ["layer 0", "nn.Module"]),
    "sequential-compress": (lambda: CheckpointedSequential(*chain(), compress=8), ["compress=8", "int8"]),
    "sequential-offload": (lambda: CheckpointedSequential(*chain(), offload="yes"), ["offload='yes'", "True or False"]),
    "sequential-budget-unplanned": (lambda: CheckpointedSequential(*chain(), budget=10), ["budget=", "'memory'"]),
    "from_sequential": (lambda: CheckpointedSequential.from_sequential("model"), ["sequential='model'", "nn.Sequential"]),
    "set_compression-layer": (lambda: checkpointed().set_compression(1.0, "int8"), ["layer 1.0", "index in [0, 2]"]),
    "set_offload-flag": (lambda: checkpointed().set_offload(0, "yes"), ["offload='yes'", "True or False"]),
    "apply_plan": (lambda: checkpointed().apply_plan(None), ["plan=None", "actsave.plan"]),
    # estimate(model, input_shapes, device, optimizer)
    "estimate-model-str": (lambda: actsave.estimate("model", [(2, 4)]), ["model='model'", "nn.Module instance"]),
    "estimate-model-class": (lambda: actsave.estimate(nn.Linear, (2, 4)), ["model=", "nn.Module instance"]),
    "estimate-shapes-empty": (lambda: actsave.estimate(chain(), ()), ["input_shapes=()", "(128, 3, 32, 32)"]),
    "estimate-shapes-empty-list": (lambda: actsave.estimate(chain(), []), ["input_shapes=[]", "(128, 3, 32, 32)"]),
    "estimate-shapes-negative": (lambda: actsave.estimate(chain(), (2, -4)), ["input_shapes=(2, -4)", "one shape"]),
    "estimate-shapes-float": (lambda: actsave.estimate(chain(), (2.0, 4)), ["input_shapes=(2.0, 4)", "one shape"]),
    "estimate-device": (lambda: actsave.estimate(chain(), (2, 4), device="gpu"), ["device='gpu'", "'cuda'"]),
    "estimate-optimizer-list": (lambda: actsave.estimate(chain(), (2, 4), optimizer=["adam"]),
                                ["optimizer=['adam']", "'adamw'"]),
    # profile(model, example_inputs, device)
    "profile-model-str": (lambda: actsave.profile("model", (torch.randn(2, 4),)), ["model='model'", "nn.Sequential"]),
    "profile-model-empty": (lambda: actsave.profile(nn.Sequential(), (torch.randn(2, 4),)), ["model", "one layer"]),
    "profile-inputs-shape": (lambda: actsave.profile(chain(), (2, 4)), ["example_inputs", "(x,)"]),
    "profile-device-float": (lambda: actsave.profile(chain(), (torch.randn(2, 4),), device=1.5),
                             ["device=1.5", "'cuda'"]),
    "profile-device-bad-name": (lambda: actsave.profile(chain(), (torch.randn(2, 4),), device="gpu"),
                                ["device='gpu'", "'cuda'"]),
    # plan(profile, budget, min_sqnr_db, allow, objective)
    "plan-profile": (lambda: actsave.plan(None, 10**6), ["profile=None", "actsave.profile"]),
    "plan-budget-str": (lambda: actsave.plan(profiled(), "1e6", objective="memory"),
                        ["budget='1e6'", "positive, finite number of bytes"]),
    "plan-budget-bool": (lambda: actsave.plan(profiled(), True, objective="memory"),
                         ["budget=True", "positive, finite number of bytes"]),
    "plan-min_sqnr_db-nan": (lambda: actsave.plan(profiled(), None, min_sqnr_db=float("nan"), objective="memory"),
                             ["min_sqnr_db=nan", "number of dB or None"]),
    "plan-allow-none": (lambda: actsave.plan(profiled(), None, allow=None, objective="memory"),
                        ["allow=None", "'recompute'"]),
    "plan-allow-int": (lambda: actsave.plan(profiled(), None, allow=5, objective="memory"), ["allow=5", "'recompute'"]),
    "plan-objective": (lambda: actsave.plan(profiled(), 10**6, objective="fast"), ["objective='fast'", "'memory'"]),
    # Plan(...)
    "Plan-n_layers": (lambda: actsave.Plan("3", (0,), (), (), 0, 0.0, 0), ["n_layers='3'", "positive integer"]),
    "Plan-starts-none": (lambda: actsave.Plan(3, None, (), (), 0, 0.0, 0), ["starts=None", "layer indices"]),
    "Plan-starts-float": (lambda: actsave.Plan(3, (0, 1.5), ("int8",), (False,), 0, 0.0, 0),
                          ["starts=(0, 1.5)", "layer indices"]),
    "Plan-offload": (lambda: actsave.Plan(3, (0, 1), ("int8",), ("no",), 0, 0.0, 0),
                     ["offload=('no',)", "True or False"]),
    "Plan-codecs-none": (lambda: actsave.Plan(3, (0, 1), None, (False,), 0, 0.0, 0), ["codecs=None", "tuples"]),
    # backends
    "set_backend": (lambda: actsave.set_backend(None), ["backend None", "'torch'"]),
}


@pytest.mark.parametrize("name", list(BAD_CALLS))
def test_a_bad_argument_raises_a_config_error_that_names_it(name):
    call, expected = BAD_CALLS[name]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a balanced plan's fallback warning is not the point
        with pytest.raises(ConfigError) as raised:
            call()
    message = str(raised.value)
    assert all(part in message for part in expected), message


def test_integral_numbers_of_any_type_are_integers():
    model = CheckpointedSequential(*chain(), segments=np.int64(2))
    assert model.segments == 2 and type(model.segments) is int
    assert CheckpointedSequential(*chain(), segments=np.array([0, 2])).segments == [0, 2]
    model.set_compression(np.int64(1), "int8")
    assert model.describe() == CheckpointedSequential(*chain(), segments=2, compress={1: "int8"}).describe()
    shapes = actsave.estimate(chain(), (np.int64(2), 4), device="cpu")
    assert shapes == actsave.estimate(chain(), (2, 4), device="cpu")
    assert actsave.plan(profiled(), np.int64(10**9), objective="memory").n_layers == 3


def test_wrap_that_selects_nothing_warns():
    with pytest.warns(UserWarning, match="selected no submodule"):
        actsave.wrap(chain(), nn.Conv2d)
