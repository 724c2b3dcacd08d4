"""The recompute of a selective checkpoint (actsave/runtime/selective_replay.py): kept
calls skipped, standing for the forward's only where the recompute does the same work."""
import pytest
import torch
from torch import nn

import actsave


class _SlidingMemory(nn.Module):
    """Reads and appends to state it holds as a plain attribute (a sliding window, as
    Hugging Face's caches under use_cache=True): its recompute passes its Linear a
    longer input than the forward did."""

    def __init__(self):
        super().__init__()
        self.fc, self.memory = nn.Linear(4, 4), None

    def forward(self, x):
        h = x if self.memory is None else torch.cat([self.memory, x])
        self.memory = x.detach()[-2:]
        return torch.tanh(self.fc(h)[-x.shape[0]:])


def test_a_kept_call_passed_other_shapes_in_the_recompute_raises():
    # Its saves' views would be made again of the longer input, reading other rows:
    # gradients silently wrong where keep="inputs" and torch's checkpoint raise.
    block = actsave.Checkpoint(_SlidingMemory(), keep="selective")
    out = block(torch.randn(4, 4, requires_grad=True))
    with pytest.raises(actsave.RecomputeError, match=r"passed Linear tensors of shapes \[\(6, 4\)\] where the "
                                                     r"forward passed \[\(4, 4\)\].*use_cache"):
        out.sum().backward()


class _NearTieRouter(nn.Module):
    """Routes each row to one of two experts by a gate whose two logits nearly tie."""

    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(16, 2)
        self.experts = nn.ModuleList(nn.Linear(16, 16) for _ in range(2))
        with torch.no_grad():
            self.gate.weight[1] = self.gate.weight[0] + 1e-3 * torch.randn(16)
            self.gate.bias.zero_()

    def forward(self, x):
        choice = self.gate(x).argmax(-1)
        out = torch.zeros_like(x)
        for i, expert in enumerate(self.experts):
            rows = choice == i
            out[rows] = torch.tanh(expert(x[rows]))
        return out


def test_a_route_taken_again_from_decoded_values_raises_naming_the_codec():
    # The gate's kept output comes back from int8 codes: near ties flip, and the
    # experts are passed other rows than in the forward.
    torch.manual_seed(0)
    router, x = _NearTieRouter(), torch.randn(64, 16, requires_grad=True)
    actsave.Checkpoint(router, keep="selective")(x).sum().backward()  # exact: the same route
    out = actsave.Checkpoint(router, keep="selective", compress="int8")(x)
    with pytest.raises(actsave.RecomputeError, match=r"router's top-k.*compress=None.*keep='saves'"):
        out.sum().backward()


@pytest.fixture
def fake_mesh():
    """A 2-rank device mesh of this process alone: collectives do nothing, so every
    rank's numbers are rank 0's, the same for a plain and a checkpointed model."""
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available():
        pytest.skip("needs torch.distributed")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        yield init_device_mesh("cpu", (2,))
    finally:
        dist.destroy_process_group()


def _tensor_parallel_mlp(mesh) -> nn.Module:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))
    return parallelize_module(model, mesh, {"1": ColwiseParallel(), "3": RowwiseParallel()})


def test_a_tensor_parallel_block_recomputes_its_kept_calls_arguments_as_dtensors(fake_mesh):
    # A 3-D input's Linear saves a 2-D view of it: a DTensor, which as_strided cannot
    # make again from the recomputed argument. Such saves are kept as they are.
    x = torch.randn(2, 3, 8)
    plain, model = _tensor_parallel_mlp(fake_mesh), _tensor_parallel_mlp(fake_mesh)
    plain(x).square().sum().backward()
    actsave.Checkpoint(model, keep="selective")(x).square().sum().backward()
    for p, q in zip(plain.parameters(), model.parameters()):
        assert torch.equal(_local(p.grad), _local(q.grad))


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor; any other tensor as it is."""
    return t.to_local() if hasattr(t, "to_local") else t
