"""Planning in one thread leaves every other thread alone: the balanced plan's meta step
touches only its own model, forks no generator and runs no compiled code eagerly but
its own."""
import threading

import pytest
import torch
from torch import nn

import actsave

WAIT_S = 20  # far longer than any step here: only a broken test waits it out


class Pause(nn.Module):
    """The identity; its first call on meta tensors (a plan's meta step; any first
    call where not ``on_meta_only``) signals ``inside`` and waits for ``resume``, so
    that another thread's work overlaps it. ``armed=False``: the identity alone."""

    def __init__(self, armed: bool = True, on_meta_only: bool = True):
        super().__init__()
        self.inside, self.resume = threading.Event(), threading.Event()
        self.armed, self.on_meta_only = armed, on_meta_only

    def forward(self, x):
        if self.armed and (x.device.type == "meta" or not self.on_meta_only):
            self.armed = False
            self.inside.set()
            assert self.resume.wait(WAIT_S), "the other thread did not finish"
        return x


def bn_relu_chain(pause: nn.Module, width: int = 8, blocks: int = 3, seed: int = 0) -> nn.Sequential:
    """``blocks`` x (Linear, BatchNorm1d, ReLU) with ``pause`` after the first block."""
    torch.manual_seed(seed)
    layers = []
    for i in range(blocks):
        layers += [nn.Linear(width, width), nn.BatchNorm1d(width), nn.ReLU()]
        if i == 0:
            layers.append(pause)
    return nn.Sequential(*layers)


def run_in_thread(target):
    """Start ``target`` on a thread; the returned join re-raises what it raised."""
    errors = []

    def run():
        try:
            target()
        except BaseException as error:  # noqa: BLE001 - handed to the joining thread
            errors.append(error)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()

    def join():
        thread.join(WAIT_S)
        assert not thread.is_alive(), "the thread did not finish"
        if errors:
            raise errors[0]
    return join


def batchnorm_and_draws():
    """A plain BatchNorm1d forward in training mode, then draws from the global CPU
    generator: (the module, its input's draw, draws after)."""
    bn = nn.BatchNorm1d(4)
    x = torch.randn(6, 4)
    bn(x)
    return bn, x, torch.rand(5)


def test_random_operators_on_meta_tensors_draw_nothing():
    # Why a meta step forks no generator: NOTE [ Steps other threads do not see ].
    before = torch.get_rng_state()
    x = torch.empty(4, 8, device="meta", requires_grad=True)
    q = torch.empty(1, 2, 4, 8, device="meta")
    drawn = [torch.nn.functional.dropout(x, 0.5), torch.randn(3, device="meta"), torch.rand_like(x),
             x.new_empty(5).bernoulli_(0.5), x.new_empty(5).normal_(), torch.randint(0, 5, (3,), device="meta"),
             torch.nn.functional.scaled_dot_product_attention(q, q, q, dropout_p=0.5)]
    drawn[0].sum().backward()
    assert torch.equal(torch.get_rng_state(), before)


def plan_paused_in_another_thread():
    """A chain whose first step (its plan) another thread has begun and is paused
    in: the pause, the model, its batch and the thread's join."""
    pause = Pause()
    model = actsave.CheckpointedSequential(*bn_relu_chain(pause))
    x = torch.randn(4, 8)
    join = run_in_thread(lambda: model(x).sum().backward())
    assert pause.inside.wait(WAIT_S)
    return pause, model, x, join


def test_a_plan_in_another_thread_leaves_this_threads_batchnorm_and_random_numbers_alone():
    pause, model, x, join = plan_paused_in_another_thread()
    # The other thread is inside its meta step now.
    torch.manual_seed(7)
    bn, _, during = batchnorm_and_draws()
    pause.resume.set()
    join()
    after = torch.rand(5)

    torch.manual_seed(7)
    alone, _, expected_during = batchnorm_and_draws()
    expected_after = torch.rand(5)
    assert bn.num_batches_tracked.item() == 1
    assert torch.equal(bn.running_mean, alone.running_mean) and torch.equal(bn.running_var, alone.running_var)
    assert torch.equal(during, expected_during)
    assert torch.equal(after, expected_after)  # the other thread's plan did not put the generator back


def test_a_profile_of_a_real_model_in_another_thread_does_not_put_the_generator_back():
    # Its steps draw as training steps do (Dropout here); putting the generator back
    # after them would undo this thread's draws made meanwhile.
    def model(pause):
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 8), pause, nn.Dropout(0.5), nn.Linear(8, 8))
    pause = Pause(on_meta_only=False)  # in the profile's first forward, before any draw
    x = torch.randn(4, 8)
    join = run_in_thread(lambda: actsave.profile(model(pause), (x,)))
    assert pause.inside.wait(WAIT_S)
    torch.manual_seed(7)
    during = torch.rand(5)
    pause.resume.set()
    join()
    after = torch.rand(5)
    # As on one thread: this thread's draws, then the profile's, then this thread's.
    alone = model(Pause(armed=False))
    torch.manual_seed(7)
    assert torch.equal(during, torch.rand(5))
    actsave.profile(alone, (x,))
    assert torch.equal(after, torch.rand(5))


def test_a_plan_in_another_thread_runs_this_threads_compiled_code_compiled():
    compiled = []

    def backend(graph, example_inputs):
        compiled.append(graph)
        return graph.forward

    @torch.compile(backend=backend)
    def double(t):
        return t * 2

    pause = Pause()
    model = actsave.CheckpointedSequential(*bn_relu_chain(pause))
    join = run_in_thread(lambda: model(torch.randn(4, 8)).sum().backward())
    assert pause.inside.wait(WAIT_S)
    try:
        double(torch.ones(3))
    finally:
        pause.resume.set()
        join()
    assert len(compiled) == 1  # not run eagerly for the other thread's meta step


@pytest.mark.parametrize("grad_mode", [torch.enable_grad, torch.no_grad, torch.inference_mode])
def test_a_model_called_on_another_thread_while_it_plans_says_so(grad_mode):
    pause, model, x, join = plan_paused_in_another_thread()
    try:
        with pytest.raises(actsave.ConfigError, match="while another thread plans its segments"), grad_mode():
            model(x)
    finally:
        pause.resume.set()
        join()
    assert all(t.device.type == "cpu" for t in [*model.parameters(), *model.buffers()])
    model(x).sum().backward()  # planned: any thread may call it now


OPTIONS = {"exact": {}, "int8": {"compress": "int8"}, "offload": {"offload": True}}


def train(model: nn.Module, batches: list) -> nn.Module:
    """Steps of SGD on ``batches``; the model."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for x in batches:
        optimizer.zero_grad()
        model(x).square().mean().backward()
        optimizer.step()
    return model


def trained_state(model: nn.Module) -> list:
    return ([(name, p.detach().clone()) for name, p in model.named_parameters()]
            + [(name + ".grad", p.grad.clone()) for name, p in model.named_parameters()]
            + [(name, b.clone()) for name, b in model.named_buffers()])


def assert_same_state(found: list, expected: list) -> None:
    assert [name for name, _ in found] == [name for name, _ in expected]
    for (name, a), (_, b) in zip(found, expected):
        assert a.device == b.device and torch.equal(a, b), name


@pytest.mark.parametrize("option", OPTIONS, ids=list(OPTIONS))
def test_two_threads_training_two_models_get_what_each_gets_alone(option):
    # Thread 0's plan pauses in its meta step until thread 1 has planned (its meta step
    # overlapping thread 0's) and trained all its steps.
    pause = Pause()
    models = [actsave.CheckpointedSequential(*bn_relu_chain(pause if i == 0 else Pause(armed=False), seed=i),
                                             **OPTIONS[option]) for i in range(2)]
    generator = torch.Generator().manual_seed(3)
    data = [[torch.randn(4, 8, generator=generator) for _ in range(3)] for _ in range(2)]
    expected = [trained_state(train(actsave.CheckpointedSequential(*bn_relu_chain(Pause(armed=False), seed=i),
                                                                   **OPTIONS[option]), data[i]))
                for i in range(2)]
    barrier = threading.Barrier(2, timeout=WAIT_S)

    def thread(i):
        def run():
            barrier.wait()  # both start together
            if i == 1:
                assert pause.inside.wait(WAIT_S)
            try:
                train(models[i], data[i])
            finally:
                if i == 1:
                    pause.resume.set()
        return run

    joins = [run_in_thread(thread(i)) for i in range(2)]
    for join in joins:
        join()
    for model, found in zip(models, expected):
        assert_same_state(trained_state(model), found)
