"""A chain segment's ReLU output that the next segment keeps by a lossy codec is
encoded once with its decisions (runtime/boundaries.py, NOTE [ Decisions at a boundary ])."""
import pytest
import torch
from torch import nn

import actsave
from actsave.runtime import chain
from actsave.runtime.boundaries import Boundary
from actsave.triton_kernels import _launch


def conv_bn_relu_chain(blocks: int = 4) -> list:
    torch.manual_seed(0)
    layers = [nn.Conv2d(3, 4, 3, padding=1)]
    for _ in range(blocks):
        layers += [nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU()]
    return layers + [nn.Flatten(), nn.Linear(4 * 6 * 6, 3)]


# Boundaries after the first two ReLUs (layers 3 and 6: segments start at 4 and 7),
# then on a BatchNorm's output (segment at 9, after layer 8).
SEGMENTS = [0, 4, 7, 9]


def step(codec: str, **kwargs) -> tuple:
    """(parameter gradients, kept bytes after the forward) of one step."""
    model = actsave.CheckpointedSequential(*conv_bn_relu_chain(), segments=SEGMENTS, compress=codec, **kwargs)
    out = model(torch.randn(8, 3, 6, 6, generator=torch.Generator().manual_seed(1)))
    kept = actsave.kept_bytes()
    out.square().mean().backward()
    return [p.grad for p in model.parameters()], kept


def claims(monkeypatch) -> list:
    """The copies the segments claim from their boundaries (None where one did not)."""
    claimed, real = [], Boundary.claim
    monkeypatch.setattr(Boundary, "claim", lambda *a: claimed.append(real(*a)) or claimed[-1])
    return claimed


def launches(monkeypatch) -> list:
    launched, real = [], _launch.launch
    monkeypatch.setattr(_launch, "launch", lambda kernel, *a, **k: launched.append((_launch.kernel_name(kernel),
                                                                                     k.get("SIGNS")))
                        or real(kernel, *a, **k))
    return launched


@pytest.mark.parametrize("codec", ["int8", "fp8_e4m3"])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_gradients_and_kept_bytes_are_those_of_the_separate_calls(codec, backend, monkeypatch):
    claimed = claims(monkeypatch)
    with actsave.set_backend(backend):
        handed = step(codec)
        assert len([copy for copy in claimed if copy is not None]) == 1  # the second segment's output
        monkeypatch.setattr(chain, "_boundaries", lambda segments, policies, caller: [None] * len(segments))
        apart = step(codec)
    assert all(torch.equal(a, b) for a, b in zip(handed[0], apart[0]))
    assert handed[1] == apart[1]
    assert actsave.kept_bytes() == {"device": 0, "host": 0}


def test_a_boundary_on_a_relu_output_is_one_launch_for_codes_and_decisions(monkeypatch):
    # The first segment keeps its input by reference, so its recompute is exact and
    # keeps no decisions; the second segment's last ReLU output is the third's kept
    # input: encoded with its decisions, where apart it is packed and then encoded.
    # The last segment's saves are stored (its ReLUs with their decisions too).
    launched = launches(monkeypatch)
    with actsave.set_backend("triton"):
        step("int8")
        handed = list(launched)
        launched.clear()
        monkeypatch.setattr(chain, "_boundaries", lambda segments, policies, caller: [None] * len(segments))
        step("int8")
    assert len(handed) == len(launched) - 1
    assert handed.count(("_pack_relu_signs_kernel", None)) == launched.count(("_pack_relu_signs_kernel", None)) - 1
    assert handed.count(("_encode_int8_kernel", True)) == launched.count(("_encode_int8_kernel", True)) + 1
    assert ("_pack_relu_signs_kernel", None) not in handed


def test_a_boundary_before_an_exactly_kept_input_packs_its_decisions_apart(monkeypatch):
    # compress per segment: the third keeps its input exactly, so the second's last
    # ReLU packs its decisions as it saves them.
    launched = launches(monkeypatch)
    with actsave.set_backend("triton"):
        grads, _ = step({0: None, 4: "int8", 7: None, 9: "int8"})
    assert launched.count(("_pack_relu_signs_kernel", None)) == 1
    assert launched.count(("_encode_int8_kernel", True)) == 2  # the last segment's two ReLU saves
    assert all(g is not None for g in grads)


class _Subtract(nn.Module):
    """Changes its input in place, saving nothing: autograd refuses a ReLU output
    changed so; actsave's recompute stops before it, at the ReLU's save."""

    def forward(self, x):
        return x.sub_(0.5)


def test_a_relu_output_changed_in_place_after_its_save_keeps_the_decisions_it_was_saved_with(monkeypatch):
    # The second segment's last layer is not its ReLU: its decisions are packed as the
    # ReLU saves its output, before the subtraction changes their signs. Its output,
    # the next segment's kept input, is no ReLU's: a boundary that hands on no copy.
    def gradients():
        torch.manual_seed(0)
        layers = [nn.Conv2d(3, 4, 3, padding=1), nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
                  _Subtract(), nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(),
                  nn.Linear(4 * 6 * 6, 3)]
        model = actsave.CheckpointedSequential(*layers, segments=[0, 1, 5, 8], compress="int8")
        model(torch.randn(8, 3, 6, 6, generator=torch.Generator().manual_seed(1))).square().mean().backward()
        return [p.grad for p in model.parameters()]

    made = []
    real = chain._boundaries
    monkeypatch.setattr(chain, "_boundaries", lambda *a: made.append(real(*a)) or made[-1])
    handed = gradients()
    assert made[0][1] is not None  # after the second segment
    monkeypatch.setattr(chain, "_boundaries", lambda segments, policies, caller: [None] * len(segments))
    assert all(torch.equal(a, b) for a, b in zip(handed, gradients()))


@pytest.mark.parametrize("offload", [False, True])
def test_a_simulated_cuda_step_holds_the_bytes_it_held_apart(offload, monkeypatch):
    # On meta tensors standing for CUDA (actsave.estimate), where offload sends the
    # stored copies and the decisions to the host: the same peaks, device and host.
    def estimated():
        model = actsave.CheckpointedSequential(*conv_bn_relu_chain(), segments=[0, 4, 7, 10], compress="int8",
                                               offload=offload)
        estimate = actsave.estimate(model, (16, 3, 6, 6), device="cuda")
        return estimate.activation_peak_bytes, estimate.host_peak_bytes

    claimed = claims(monkeypatch)
    handed = estimated()
    assert len([copy for copy in claimed if copy is not None]) == 1  # the second segment's: the last stores its saves
    monkeypatch.setattr(chain, "_boundaries", lambda segments, policies, caller: [None] * len(segments))
    assert handed == estimated()
    assert (handed[1] > 0) == offload


@pytest.mark.parametrize("returns_a_copy", [False, True])
def test_a_relu_output_changed_in_place_by_a_hook_raises(returns_a_copy):
    # A forward hook on a segment's last layer, the ReLU, changes its saved output in
    # place: autograd refuses that in the backward; the decisions held for the boundary
    # would be the changed values', so the forward raises.
    layers = conv_bn_relu_chain()
    layers[6].register_forward_hook(lambda module, args, out: out.sub_(0.5) * 1 if returns_a_copy else out.sub_(0.5))
    model = actsave.CheckpointedSequential(*layers, segments=SEGMENTS, compress="int8")
    with pytest.raises(actsave.RecomputeError, match="changed in place after the ReLU saved it"):
        model(torch.randn(8, 3, 6, 6))
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        nn.Sequential(*layers)(torch.randn(8, 3, 6, 6)).sum().backward()


class _Block(nn.Module):
    """torchvision's post-activation basic block, its last op a ReLU: conv-BN-ReLU-conv-BN,
    plus the input, then ReLU (``then``: an op after that ReLU, inside the block)."""

    def __init__(self, then=None):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4)
        self.conv2, self.bn2 = nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4)
        self.relu, self.then = nn.ReLU(inplace=True), then

    def forward(self, x):
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)) + x)
        return out if self.then is None else self.then(out)


def block_chain(then=None) -> list:
    torch.manual_seed(0)
    return [nn.Conv2d(3, 4, 3, padding=1), *[_Block(then) for _ in range(4)], nn.Flatten(), nn.Linear(4 * 6 * 6, 3)]


def block_step(monkeypatch, apart: bool, then=None) -> list:
    with monkeypatch.context() as patched:
        if apart:
            patched.setattr(chain, "_boundaries", lambda segments, policies, caller: [None] * len(segments))
        model = actsave.CheckpointedSequential(*block_chain(then), segments=[0, 1, 2, 3, 4], compress="int8")
        model(torch.randn(8, 3, 6, 6, generator=torch.Generator().manual_seed(1))).square().mean().backward()
    return [p.grad for p in model.parameters()]


def test_blocks_that_end_on_a_relu_hand_their_output_on_with_its_decisions(monkeypatch):
    # Segments of one block each: the first keeps the chain's input exactly, the last
    # keeps its saves (ActNN's mode); the second's and third's outputs, each its last
    # ReLU's, are the next checkpointed segments' kept inputs.
    launched = launches(monkeypatch)
    with actsave.set_backend("triton"):
        handed = block_step(monkeypatch, apart=False)
        with_boundaries = list(launched)
        launched.clear()
        apart = block_step(monkeypatch, apart=True)
    assert all(torch.equal(a, b) for a, b in zip(handed, apart))
    assert with_boundaries.count(("_encode_int8_kernel", True)) == launched.count(("_encode_int8_kernel", True)) + 2
    assert with_boundaries.count(("_pack_relu_signs_kernel", None)) == launched.count(
        ("_pack_relu_signs_kernel", None)) - 2
    assert len(with_boundaries) == len(launched) - 2


def test_a_relu_output_changed_in_place_inside_a_last_block_raises(monkeypatch):
    # The block changes its ReLU output in place after the ReLU saved it: autograd
    # refuses that in the backward; its held decisions would be the changed values'.
    with pytest.raises(actsave.RecomputeError, match="changed in place after the ReLU saved it"):
        block_step(monkeypatch, apart=False, then=lambda out: out.sub_(0.5))
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        nn.Sequential(*block_chain(lambda out: out.sub_(0.5)))(torch.randn(8, 3, 6, 6)).sum().backward()


class _Raising(nn.Module):
    """A block that ends on a ReLU, then raises where ``fail`` is set."""

    def __init__(self):
        super().__init__()
        self.conv, self.bn, self.fail = nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4), False

    def forward(self, x):
        out = torch.relu(self.bn(self.conv(x)))
        if self.fail:
            raise ValueError("a failing last layer")
        return out


def test_a_last_layer_that_raises_after_its_relu_leaves_nothing_kept():
    # The ReLU's save is held for the boundary when the layer raises: released with its
    # frame, not packed into kept inputs already let go of.
    torch.manual_seed(0)
    last = _Raising()
    layers = [nn.Conv2d(3, 4, 3, padding=1), nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), last,
              nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 36, 3)]
    model = actsave.CheckpointedSequential(*layers, segments=[0, 1, 5, 8], compress="int8")
    x = torch.randn(2, 3, 6, 6)
    last.fail = True
    with pytest.raises(ValueError, match="a failing last layer"):
        model(x)
    assert actsave.kept_bytes() == {"device": 0, "host": 0}
    last.fail = False
    model(x).sum().backward()
    assert actsave.kept_bytes() == {"device": 0, "host": 0}
