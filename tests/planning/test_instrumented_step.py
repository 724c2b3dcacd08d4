"""The profile's measured steps (planning/instrumented_step.py): what they count."""
import pytest
import torch
from torch import nn

from actsave.planning.instrumented_step import measure_memory


def linear_relu_chain(inplace: bool) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[m for _ in range(3) for m in (nn.Linear(64, 64), nn.ReLU(inplace=inplace))])


@pytest.mark.parametrize("shape", [(8, 32, 64), (256, 64)], ids=["views", "plain"])
def test_the_step_counts_the_decisions_of_in_place_relu_modules_as_a_lossy_forward_keeps_them(shape):
    # A Linear on a 3-D input returns a view, and an in-place ReLU on it hides its ReLU
    # node (NOTE [ In-place ReLUs on views ]): the lossy forward watches the module and
    # keeps its bits, so the step counts them, as for ReLU(), and so do the saves a
    # plain segment's codec stores (saves_as_stored.py).
    x = torch.randn(*shape)
    counted = {}
    for inplace in (False, True):
        model = linear_relu_chain(inplace)
        found = measure_memory(list(model.named_children()), x, model, torch.device("cpu"))
        stored_relus = sum(entry.relu for entry in found.as_stored.entries.values())
        counted[inplace] = found.relu_sign_bytes, found.relu_elements, stored_relus
    assert counted[True] == counted[False]
    assert counted[True][0] == [0, 256 * 64 // 8] * 3 and counted[True][2] == 3


class _Residual(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.a, self.b = nn.Linear(width, width), nn.Linear(width, width)

    def forward(self, x):
        return x + self.b(torch.nn.functional.gelu(self.a(x)))


@pytest.mark.parametrize("keep", ["saves", "linear_inputs"])
def test_a_chain_of_calls_keeping_their_saves_plans_within_its_budget(keep):
    # The profile's hooks take the saves of a call keeping its saves, as a checkpoint's
    # do (kept_saves.takes_kept_saves): unseen, they were counted as nothing, and a plan
    # accepted a budget its step then went over.
    import actsave
    from support import peak_activation_bytes
    torch.manual_seed(0)
    layers = [actsave.Checkpoint(_Residual(128), keep=keep, compress="int8") for _ in range(6)]
    x, budget = torch.randn(64, 128), 350_000
    chain = actsave.CheckpointedSequential(*layers, segments="auto", budget=budget, example_inputs=x)
    assert peak_activation_bytes(chain, x) <= budget
