"""Direct launches (triton_kernels/_direct_launch.py, NOTE [ Direct launches ]): a kernel
compiled for a specialization is launched again past Triton's per-call work, never for
arguments Triton would compile anew. The CPU runs the rules on a stand-in for a
compiled GPU kernel; the CUDA test checks the bits on a GPU."""
import types

import pytest
import torch
import triton.language as tl
from triton.runtime.jit import JITFunction

from actsave.triton_kernels import _direct_launch
from actsave.triton_kernels.decisions import relu_signs


def _scaled_copy(x_ptr, y_ptr, numel, factor, BLOCK: tl.constexpr, EVEN: tl.constexpr = False):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y_ptr + offsets, tl.load(x_ptr + offsets) * factor)


# Triton's own JITFunction, whichever mode the tests run in: its parameter table is
# what the key reads (under the interpreter @triton.jit gives another class).
PARAMS = JITFunction(_scaled_copy).params


class Compiled:
    """Stands for Triton's CompiledKernel: records each direct call of its launcher."""

    function, packed_metadata = "function handle", "packed metadata"

    def __init__(self):
        self.calls = []

    def run(self, *args):
        self.calls.append(args)


class StandIn:
    """Stands for a @triton.jit function on a GPU: each launch through Triton returns a
    new Compiled, as a first launch compiles; ``through_triton`` counts them."""

    params = PARAMS

    def __init__(self):
        self.through_triton = []

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            compiled = Compiled()
            self.through_triton.append((grid, args, kwargs, compiled))
            return compiled
        return run


@pytest.fixture
def triton_state(monkeypatch):
    """Triton's knobs and stream query, as a GPU run has them: no hooks, stream 7."""
    runtime = types.SimpleNamespace(launch_enter_hook=None, launch_exit_hook=None, debug=False)
    monkeypatch.setattr(_direct_launch, "_knobs", types.SimpleNamespace(runtime=runtime))
    monkeypatch.setattr(_direct_launch, "_stream_of", lambda index: 7)
    monkeypatch.setattr(_direct_launch, "ENABLED", True)
    return runtime


DEVICE = torch.device("cuda", 0)  # only named: the stand-ins launch nothing


def launch(kernel, x, y, numel, **kwargs):
    _direct_launch.launch(kernel, (4,), DEVICE, (x, y, numel, 2), {"BLOCK": 64, "num_warps": 4, **kwargs})


def test_the_first_launch_goes_through_triton_and_the_next_calls_the_compiled_kernel(triton_state):
    kernel, x, y = StandIn(), torch.zeros(64), torch.zeros(64)
    launch(kernel, x, y, 4096)
    (_, _, _, compiled), = kernel.through_triton
    launch(kernel, x, y, 8192)  # another multiple of 16: the same specialization
    assert len(kernel.through_triton) == 1
    # JITFunction.run's order: grid, stream, function, metadata, no hooks, then every
    # parameter in the kernel's order, the constexprs and their defaults too.
    assert compiled.calls == [(4, 1, 1, 7, "function handle", "packed metadata", None, None, None,
                               x, y, 8192, 2, 64, False)]


@pytest.mark.parametrize("change", ["misaligned tensor", "another dtype", "numel 1", "numel not a multiple of 16",
                                    "numel past int32", "another constexpr", "a default constexpr given",
                                    "another launch option", "another device"])
def test_arguments_triton_would_compile_anew_go_through_triton(triton_state, change):
    kernel, x, y = StandIn(), torch.zeros(64), torch.zeros(64)
    launch(kernel, x, y, 4096)
    arguments = {"x": x, "y": y, "numel": 4096}
    options, device = {}, DEVICE
    if change == "misaligned tensor":
        arguments["x"] = x[1:]
    elif change == "another dtype":
        arguments["y"] = y.double()
    elif change == "numel 1":
        arguments["numel"] = 1
    elif change == "numel not a multiple of 16":
        arguments["numel"] = 4100
    elif change == "numel past int32":
        arguments["numel"] = 2**31 + 16
    elif change == "another constexpr":
        options["BLOCK"] = 128
    elif change == "a default constexpr given":
        options["EVEN"] = True
    elif change == "another launch option":
        options["num_warps"] = 8
    else:
        device = torch.device("cuda", 1)
    _direct_launch.launch(kernel, (4,), device, (arguments["x"], arguments["y"], arguments["numel"], 2),
                          {"BLOCK": 64, "num_warps": 4, **options})
    assert len(kernel.through_triton) == 2
    assert kernel.through_triton[0][3].calls == []


@pytest.mark.parametrize("state", ["launch hook", "debug", "turned off", "a float argument"])
def test_every_launch_goes_through_triton_where_it_may_see_more_than_the_key(triton_state, state):
    kernel, x, y = StandIn(), torch.zeros(64), torch.zeros(64)
    numel = 4096
    if state == "launch hook":
        triton_state.launch_enter_hook = print
    elif state == "debug":
        triton_state.debug = True
    elif state == "turned off":
        _direct_launch.ENABLED = False  # restored by the fixture's monkeypatch
    else:
        numel = 4096.0
    for _ in range(3):
        launch(kernel, x, y, numel)
    assert len(kernel.through_triton) == 3
    assert all(compiled.calls == [] for *_, compiled in kernel.through_triton)


def test_a_kernel_without_a_parameter_table_goes_through_triton(triton_state):
    calls = []

    class Bare:  # a launchable without JITFunction.params
        def __getitem__(self, grid):
            return lambda *args, **kwargs: calls.append(args) or Compiled()
    bare = Bare()
    for _ in range(2):
        launch(bare, torch.zeros(64), torch.zeros(64), 4096)
    assert len(calls) == 2


@pytest.mark.cuda
def test_direct_launches_give_triton_launches_bits(monkeypatch):
    # The same decision bits launched through Triton, then directly (the second launch
    # of a specialization), on the GPU.
    y = torch.relu(torch.randn(64, 16, 8, 8, device="cuda"))
    monkeypatch.setattr(_direct_launch, "ENABLED", False)
    expected = relu_signs.pack_relu_signs(y)
    monkeypatch.setattr(_direct_launch, "ENABLED", True)
    first, second = relu_signs.pack_relu_signs(y), relu_signs.pack_relu_signs(y)
    assert torch.equal(first, expected) and torch.equal(second, expected)
    assert any(compiled is not None for kernel in _direct_launch._kernels.values() if kernel
               for compiled in kernel.compiled.values())
