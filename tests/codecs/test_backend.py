"""Choosing Triton kernels or torch references; the forced Triton backend (under the
interpreter on CPU) trains bit-identically to the torch one."""
import threading

import pytest
import torch
import triton
from torch import nn

import actsave
from actsave import CheckpointedSequential, ConfigError
from actsave.codecs import get_codec
from actsave.codecs.backend import forced_here, get_backend, implementation
from actsave.meta import simulating
from actsave.triton_kernels import general_path, kernel_table, on_general_path


def test_auto_uses_the_reference_on_cpu():
    assert implementation(kernel_table()["int8", "encode"], torch.zeros(1)).__name__ == "encode_int8_ref"


def test_meta_tensors_take_the_implementation_of_the_simulated_device():
    # A simulated CUDA step allocates what the Triton launchers allocate (no launch).
    x = torch.empty(1000, 300, dtype=torch.bfloat16, device="meta")
    with simulating("cuda"):
        assert implementation(kernel_table()["int8", "encode"], x).__name__ == "encode_int8"
        packed = get_codec("int8").encode(x)
        decoded = get_codec("int8").decode(packed)
    assert (packed.data.shape, packed.scales.shape, packed.data.device.type) == ((300_000,), (2344,), "meta")
    assert (decoded.shape, decoded.dtype) == (x.shape, x.dtype)
    with simulating("cpu"):
        assert implementation(kernel_table()["int8", "encode"], x).__name__ == "encode_int8_ref"


def test_backend_context_restores_the_previous_choice():
    assert get_backend() == "auto"
    with actsave.set_backend("triton"):
        assert get_backend() == "triton"
        with actsave.set_backend("torch"):
            assert implementation(kernel_table()["fp8_e4m3", "encode"], torch.zeros(1)).__name__ == "encode_fp8_ref"
        assert implementation(kernel_table()["fp8_e4m3", "encode"], torch.zeros(1)).__name__ == "encode_fp8"
    assert get_backend() == "auto"


def on_another_thread(function):
    """``function()``'s result, run on a thread of its own; what it raised, raised here."""
    outcome = []

    def run():
        try:
            outcome.append((True, function()))
        except Exception as error:  # noqa: BLE001 - raised on the calling thread
            outcome.append((False, error))
    thread = threading.Thread(target=run)
    thread.start()
    thread.join(20)
    returned, value = outcome[0]
    if not returned:
        raise value
    return value


def test_what_a_trace_forces_is_its_threads_alone():
    # runtime/graph_codecs.py traces the torch references on their general path; other
    # threads' codecs meanwhile run as the process chose.
    encode = kernel_table()["int8", "encode"]
    with actsave.set_backend("triton"), forced_here("torch"), general_path():
        assert implementation(encode, torch.zeros(1)).__name__ == "encode_int8_ref" and on_general_path()
        assert on_another_thread(lambda: (implementation(encode, torch.zeros(1)).__name__, on_general_path())) \
            == ("encode_int8", False)


def test_a_with_block_that_another_thread_changed_meanwhile_raises_at_its_end():
    # The backend is the process's: restoring the previous one would undo the other
    # thread's choice, as the offload setters say too.
    with pytest.raises(ConfigError, match="another thread chose the codec backend"):
        with actsave.set_backend("torch"):
            on_another_thread(lambda: actsave.set_backend("triton"))
    assert get_backend() == "triton"
    actsave.set_backend("auto")
    with actsave.set_backend("torch"):  # one thread after the other is fine
        pass
    assert on_another_thread(lambda: _in_a_backend_block("torch")) == "torch"
    assert get_backend() == "auto"


def _in_a_backend_block(name):
    with actsave.set_backend(name):
        return get_backend()


def test_set_backend_returns_the_handle_the_offload_setters_return():
    handle = actsave.set_backend("torch")
    assert get_backend() == "torch" and type(handle) is type(actsave.offload.set_prefetch_depth(1))
    actsave.offload.set_prefetch_depth(1)
    handle.close()
    assert get_backend() == "auto"


def test_the_old_backend_context_warns_and_still_restores():
    with pytest.warns(DeprecationWarning, match="use `with actsave.set_backend\\(name\\):`"):
        with actsave.backend("torch"):
            assert get_backend() == "torch"
    assert get_backend() == "auto"


def test_unknown_backend_is_refused():
    with pytest.raises(ConfigError, match=r"backend 'cuda' is not one of \['auto', 'triton', 'torch'\]"):
        actsave.set_backend("cuda")


def test_forcing_triton_on_cpu_without_the_interpreter_says_how_to_enable_it():
    # A kernel Triton defined with its interpreter off (TRITON_INTERPRET unset when
    # its module was imported): made here from the interpreted one's function.
    interpreted = kernel_table()["int8", "encode"]
    compiled = interpreted._replace(jit=triton.JITFunction(interpreted.jit.fn))
    assert interpreted.interpreted and not compiled.interpreted
    with actsave.set_backend("triton"), pytest.raises(actsave.ActsaveError, match="TRITON_INTERPRET=1"):
        implementation(compiled, torch.zeros(1))


def small_cnn():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
                         nn.Conv2d(4, 4, 3, padding=1), nn.GELU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 3))


@pytest.mark.parametrize("codec", ["int8", "fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forced_triton_trains_bit_identically_to_torch(codec, dtype):
    x = torch.randn(2, 3, 6, 6, dtype=dtype)
    grads = {}
    for name in ("torch", "triton"):
        model = CheckpointedSequential(*small_cnn(), segments=[0, 2, 4, 5], compress=codec).to(dtype)
        with actsave.set_backend(name):
            model(x * 1).float().square().sum().backward()
        grads[name] = [p.grad for p in model.parameters()]
    for a, b in zip(grads["torch"], grads["triton"]):
        assert torch.equal(a, b)
