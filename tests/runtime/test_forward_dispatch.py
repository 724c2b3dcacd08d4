"""runtime/forward_dispatch.py: a kept module's forward replaced for one thread's calls
(NOTE [ Forwards replaced per thread ]), through the selective checkpoints that use it."""
import copy
import inspect
import threading

import torch
from torch import nn

import actsave
from actsave.runtime.forward_dispatch import forward_replaced, forward_set_on
from actsave.runtime.kept_ops import KeptOps


class _PausesOnce(nn.Module):
    """The identity; its first call signals ``inside`` and waits for ``resume``."""

    def __init__(self):
        super().__init__()
        self.inside, self.resume = threading.Event(), threading.Event()

    def forward(self, x):
        if not self.inside.is_set():
            self.inside.set()
            assert self.resume.wait(20), "the other thread did not finish"
        return x


def test_another_threads_step_of_the_same_model_neither_enters_this_threads_frame_nor_leaves_forwards_behind():
    # NOTE [ Forwards replaced per thread ]: the other thread's calls run the modules' own
    # forwards, and the instances hold none of their own once both threads are done.
    class Block(nn.Module):
        def __init__(self, pause: nn.Module):
            super().__init__()
            self.fc1, self.pause, self.fc2 = nn.Linear(8, 8), pause, nn.Linear(8, 8)

        def forward(self, x):
            return self.fc2(torch.tanh(self.pause(self.fc1(x))))

    def model(pause):
        torch.manual_seed(0)
        return nn.Sequential(Block(pause), Block(nn.Identity()))

    xs = torch.randn(4, 8), torch.randn(4, 8)
    plain = model(nn.Identity())
    for x in xs:
        plain(x).square().sum().backward()
    pause = _PausesOnce()
    wrapped = actsave.wrap(model(pause), Block, keep="selective")
    errors = []

    def first():
        try:
            wrapped(xs[0]).square().sum().backward()
        except BaseException as error:  # noqa: BLE001 - handed to the test's thread
            errors.append(error)

    thread = threading.Thread(target=first, daemon=True)
    thread.start()
    assert pause.inside.wait(20)
    wrapped(xs[1]).square().sum().backward()  # while the first thread is inside its first block
    pause.resume.set()
    thread.join(20)
    assert not errors
    for p, q in zip(plain.parameters(), wrapped.parameters()):
        assert torch.equal(p.grad, q.grad)
    assert not any("forward" in vars(module) for module in wrapped.modules())


class _Scaled(nn.Linear):
    def forward(self, x, scale=1.0):
        return super().forward(x) * scale


def test_a_kept_modules_forward_reads_as_its_own_to_a_block_that_inspects_it():
    # NOTE [ Forwards replaced per thread ]: the dispatcher stands for the module's forward.
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj, self.out = _Scaled(8, 8), nn.Linear(8, 8)

        def forward(self, x):
            takes_scale = "scale" in inspect.signature(self.proj.forward).parameters
            return self.out(torch.tanh(self.proj(x, scale=0.5) if takes_scale else self.proj(x)))

    torch.manual_seed(0)
    plain, x = Block(), torch.randn(4, 8)
    wrapped = actsave.Checkpoint(copy.deepcopy(plain), keep=KeptOps(modules=(_Scaled,)))
    plain(x).square().sum().backward()
    wrapped(x).square().sum().backward()
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(plain.parameters(), wrapped.parameters()))


def test_a_forward_set_on_the_instance_is_told_from_the_dispatcher_standing_for_the_class():
    plain, patched = nn.Linear(4, 4), nn.Linear(4, 4)
    patched.forward = lambda x: x
    for module, has_its_own in ((plain, False), (patched, True)):
        assert forward_set_on(module) == has_its_own
        with forward_replaced(module, lambda run: run):
            assert "forward" in vars(module) and forward_set_on(module) == has_its_own
        assert forward_set_on(module) == has_its_own


def test_a_module_runs_its_class_forward_through_wrappers_that_say_they_wrap_it():
    import functools
    from actsave.runtime.forward_dispatch import runs_its_class_forward
    relu = nn.ReLU()
    assert runs_its_class_forward(relu)
    relu.forward = functools.wraps(relu.forward)(lambda *args, _inner=relu.forward: _inner(*args))
    relu.forward = functools.wraps(relu.forward)(lambda *args, _inner=relu.forward: _inner(*args))  # two deep
    assert runs_its_class_forward(relu)
    with forward_replaced(relu, lambda run: run):  # selective's dispatcher over them
        assert runs_its_class_forward(relu)
    relu.forward = functools.partial(torch.relu)
    assert not runs_its_class_forward(relu)
