"""Steps on meta tensors (actsave/meta.py). The replayed output metadata and attention on
a simulated device are tested through the planner: tests/planning."""
import warnings

import torch
from torch import nn

from actsave import CheckpointedSequential


def _chain() -> CheckpointedSequential:
    torch.manual_seed(0)
    return CheckpointedSequential(*[m for _ in range(6) for m in (nn.Linear(16, 16), nn.GELU())])


def test_a_meta_step_under_anomaly_mode_plans_and_leaves_its_nan_check_on():
    # NOTE [ Anomaly mode in a meta step ]: its NaN check reads each gradient, which a
    # meta tensor cannot give; the plan fell back to "sqrt".
    x = torch.randn(4, 16, requires_grad=True)
    expected = _chain()
    expected(x).sum().backward()
    model = _chain()
    with torch.autograd.set_detect_anomaly(True), warnings.catch_warnings():
        warnings.simplefilter("error")
        model(x).sum().backward()
        assert torch.is_anomaly_enabled() and torch.is_anomaly_check_nan_enabled()
        nan = torch.tensor([1.0], requires_grad=True)
        try:
            (nan * float("nan")).sum().backward()
        except RuntimeError as error:
            assert "returned nan values" in str(error)
        else:
            raise AssertionError("anomaly mode's NaN check did not run after the meta step")
    assert model.balanced_plan is not None and model.balanced_plan.starts == expected.balanced_plan.starts
    assert not torch.is_anomaly_enabled()
