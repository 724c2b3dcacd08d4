"""Steps on meta tensors (actsave/meta.py). The replayed output metadata and attention on
a simulated device are tested through the planner: tests/planning."""
import warnings

import torch
from torch import nn

import actsave
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


def _embedding_chain(sparse: bool) -> list:
    torch.manual_seed(0)
    return [nn.Embedding(100, 32, sparse=sparse)] + [m for _ in range(6) for m in (nn.Linear(32, 32), nn.GELU())]


def test_a_meta_step_over_a_sparse_gradient_estimates_and_plans_as_over_a_dense_one():
    # Meta steps give each parameter a dense gradient: an embedding's sparse one is
    # accumulated into it, which torch's meta kernels cannot do by themselves.
    ids = torch.randint(0, 100, (4, 10), generator=torch.Generator().manual_seed(1))
    estimates = [actsave.estimate(actsave.CheckpointedSequential(*_embedding_chain(sparse), segments=[0, 5, 9]),
                                  ids).activation_peak_bytes for sparse in (False, True)]
    assert estimates[0] == estimates[1]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback to "sqrt"
        chain = actsave.CheckpointedSequential(*_embedding_chain(True))
        chain(ids).sum().backward()
    plain = nn.Sequential(*_embedding_chain(True))
    plain(ids).sum().backward()
    assert all(torch.equal(a.grad.to_dense(), b.grad.to_dense()) for a, b in zip(chain.parameters(), plain.parameters()))


def test_a_meta_step_over_batchnorm_counting_its_batches_plans_without_falling_back():
    # num_batches_tracked.add_(1) reaches the meta step's add_ with a number, not a
    # tensor: only a sparse tensor added to a dense one is taken apart there.
    torch.manual_seed(0)
    layers = [m for _ in range(6) for m in (nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU())]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        chain = CheckpointedSequential(*layers)
        chain(torch.randn(2, 4, 8, 8)).sum().backward()
    assert "fell back" not in str(chain.describe())


class _Recurrent(nn.Module):
    def __init__(self):
        super().__init__()
        self.rnn = nn.LSTM(16, 16, batch_first=True)

    def forward(self, x):
        return self.rnn(x)[0]


def test_a_meta_step_over_a_recurrent_layer_warns_once_that_it_misstates_its_memory(monkeypatch):
    # On meta tensors an LSTM runs torch's per-step composite, not the device's fused kernel.
    monkeypatch.setattr(actsave.meta, "_warned_recurrences", set())
    model = CheckpointedSequential(nn.Linear(16, 16), _Recurrent(), nn.GELU(), _Recurrent(), nn.Linear(16, 4))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            actsave.estimate(model, (2, 5, 16), device="cpu")
    messages = [str(w.message) for w in caught if "per-step composite" in str(w.message)]
    assert len(messages) == 1 and "runs LSTM" in messages[0] and "segments='auto'" in messages[0]
