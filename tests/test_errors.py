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


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, a):
        return a + torch.relu(self.linear(a))


def blocks() -> nn.Sequential:
    return nn.Sequential(Block(), Block(), nn.Linear(4, 2))


def plan_blocks(**options):
    return actsave.plan_blocks(blocks(), Block, 10**7, (torch.randn(2, 4),), **options)


def keyed_by_module(layers):
    """A codec set on a layer given as the module itself, not its index or name."""
    if isinstance(layers, CheckpointedSequential):
        return layers.set_compression(layers[2], "int8")
    return CheckpointedSequential(*layers, compress={layers[0]: "int8"})


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
                              ["context_fn=", "not supported", "keep='selective'", "KeptOps"]),
    "checkpoint-function-class": (lambda: actsave.checkpoint(nn.Linear, x()),
                                  ["function=", "nn.Module class", "nn.Module instance"]),
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
    "wrap-filter-one-argument": (lambda: actsave.wrap(chain(), lambda module: True),
                                 ["filter_fn=", "filter_fn(module, fqn)", "lambda module, fqn"]),
    "wrap-budget-loss-not-scalar": (lambda: actsave.wrap(blocks(), Block, budget=10**7, example_inputs=(x(),),
                                                         loss=lambda out: out), ["shape (2, 2)", "one-element"]),
    # plan_blocks(model, filter_fn, budget, example_inputs, loss=, allow=)
    "plan_blocks-loss-float": (lambda: plan_blocks(loss=lambda out: 1.0), ["gave a float", "one-element tensor"]),
    "plan_blocks-loss-detached": (lambda: plan_blocks(loss=lambda out: out.detach().sum()),
                                  ["needs no grad", "requires grad"]),
    "plan_blocks-loss-tuple": (lambda: plan_blocks(loss=lambda out: (out.sum(), out.mean())), ["gave a tuple"]),
    "plan_blocks-loss-class": (lambda: plan_blocks(loss=nn.MSELoss), ["loss=", "is a class", "model's output"]),
    "plan_blocks-allow": (lambda: plan_blocks(allow=("Selective",)), ["['Selective']", "'selective'"]),
    "plan_blocks-allow-not-a-tuple": (lambda: plan_blocks(allow=5), ["allow=5 must be a tuple of lever names"]),
    # KeptOps(modules, functions)
    "KeptOps-modules-str": (lambda: actsave.KeptOps(modules="Linear"), ["modules='Linear'", "tuple", "classes"]),
    "KeptOps-modules-none": (lambda: actsave.KeptOps(modules=None), ["modules=None", "() for none"]),
    "KeptOps-functions-none": (lambda: actsave.KeptOps(functions=None), ["functions=None", "() for none"]),
    "BlockPlan-option-str": (lambda: actsave.BlockPlan(("0",), ("inputs",), 1, 1, 1, 1, 0.0, 0.0, ()),
                             ["BlockPlan(options=...)", "'inputs'", "plan_blocks"]),
    "BlockPlan-lengths": (lambda: actsave.BlockPlan(("0", "1"), (None,), 1, 1, 1, 1, 0.0, 0.0, ()),
                          ["one option per block", "plan_blocks"]),
    "KeptOps-nothing": (lambda: actsave.KeptOps(modules=(), functions=()), ["keeps the outputs of nothing",
                                                                          "keep='inputs'"]),
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
    "sequential-segments-set": (lambda: CheckpointedSequential(*chain(), segments={2, 1}),
                                ["segments={1, 2}", "no order", "[1, 2]"]),
    "sequential-segments-plan": (lambda: CheckpointedSequential(*chain(), segments=actsave.plan(
        profiled(), objective="memory")), ["not a Plan", ".apply_plan(plan)"]),
    "sequential-compress-module-key": (lambda: keyed_by_module(chain()), ["is a module", "index", "child name"]),
    "sequential-layer-not-module": (lambda: CheckpointedSequential("relu"), ["layer 0", "nn.Module"]),
    "sequential-compress": (lambda: CheckpointedSequential(*chain(), compress=8), ["compress=8", "int8"]),
    "sequential-offload": (lambda: CheckpointedSequential(*chain(), offload="yes"), ["offload='yes'", "True or False"]),
    "sequential-budget-unplanned": (lambda: CheckpointedSequential(*chain(), budget=10), ["budget=", "'memory'"]),
    "from_sequential": (lambda: CheckpointedSequential.from_sequential("model"), ["sequential='model'", "nn.Sequential"]),
    "set_compression-layer": (lambda: checkpointed().set_compression(1.0, "int8"), ["layer 1.0", "index in [0, 2]"]),
    "set_compression-module": (lambda: keyed_by_module(checkpointed()), ["is a module", "index", "child name"]),
    "set_compression-empty-slice": (lambda: checkpointed().set_compression(slice(5, 2), "int8"),
                                    ["slice(5, 2, None)", "selects no layer"]),
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
    "profile-inputs-numpy": (lambda: actsave.profile(chain(), (np.ones((2, 4), "float32"),)),
                             ["(x,)", "numpy.ndarray", "torch.as_tensor"]),
    "profile-loss-str": (lambda: actsave.profile(chain(), (torch.randn(2, 4),), loss="cross_entropy"),
                         ["loss='cross_entropy'", "not callable", "function of the model's output"]),
    "profile-loss-module": (lambda: actsave.profile(chain(), (torch.randn(2, 4),), loss=nn.MSELoss()),
                            ["loss=MSELoss()", "targets too", "function of the model's output"]),
    "profile-stored_saves": (lambda: actsave.profile(chain(), (torch.randn(2, 4),), stored_saves="no"),
                             ["stored_saves='no'", "True or False"]),
    "estimate-loss-str": (lambda: actsave.estimate(chain(), (2, 4), device="cpu", loss="mse"),
                          ["loss='mse'", "function of the model's output"]),
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
    "plan-budget-fraction": (lambda: actsave.plan(profiled(), 2.5, objective="memory"), ["budget=2.5 bytes"]),
    "plan-renamed-with-new": (lambda: actsave.plan(profiled(), None, objective="memory", compress_stored=True,
                                                   compress_saves=False),
                              ["compress_stored=True", "compress_saves=False", "deprecated name"]),
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


def test_wrap_of_a_model_that_only_itself_matches_says_so():
    with pytest.warns(UserWarning, match=r"only the model itself.*actsave\.Checkpoint\(model\)"):
        actsave.wrap(Block(), Block)


def test_a_memory_plan_needs_no_budget():
    assert actsave.plan(profiled(), objective="memory").budget is None
