"""RNG / autocast capture and replay; BatchNorm statistics frozen in recompute."""
import torch
from torch import nn

from actsave.state import ReplayState, batchnorm_stats_frozen


def test_replay_gives_the_same_random_numbers_and_leaves_the_caller_rng_alone():
    torch.manual_seed(3)
    state = ReplayState.capture([torch.zeros(1)])
    first = torch.rand(5)
    after = torch.get_rng_state()
    with state.replayed():
        again = torch.rand(5)
    assert torch.equal(first, again)
    assert torch.equal(torch.get_rng_state(), after)


def test_replay_restores_autocast_state_of_the_forward():
    with torch.autocast("cpu", dtype=torch.bfloat16):
        state = ReplayState.capture([torch.zeros(1)])
    assert not torch.is_autocast_enabled("cpu")
    with state.replayed():
        assert torch.is_autocast_enabled("cpu")
        assert torch.get_autocast_dtype("cpu") == torch.bfloat16
    plain = ReplayState.capture([torch.zeros(1)])
    with torch.autocast("cpu", dtype=torch.bfloat16), plain.replayed():
        assert not torch.is_autocast_enabled("cpu")


def test_batchnorm_in_training_uses_batch_statistics_but_keeps_its_running_ones():
    torch.manual_seed(0)
    bn = nn.BatchNorm1d(4)
    x = torch.randn(8, 4)
    before = {name: b.clone() for name, b in bn.named_buffers()}
    with batchnorm_stats_frozen():
        out = bn(x)
        bn(x)  # a module run twice gets its original statistics back too
    for name, buffer in bn.named_buffers():
        assert torch.equal(buffer, before[name]), name
    assert torch.equal(out, nn.BatchNorm1d(4)(x))


def test_batchnorm_outside_the_context_updates_as_usual():
    bn = nn.BatchNorm1d(4)
    with batchnorm_stats_frozen():
        pass
    bn(torch.randn(8, 4))
    assert int(bn.num_batches_tracked) == 1
