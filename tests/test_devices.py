import re
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import actsave
from actsave import devices
from actsave.runtime import keep_rules
from actsave.planning.live_bytes import allocation_bytes

PACKAGES = [Path(__file__).resolve().parents[1] / name for name in ("actsave", "triton_kernels")]


def test_no_file_but_devices_py_tests_for_a_cuda_device():
    # devices.py is the one home of the rules that depend on a device's kind: a new
    # `device.type == "cuda"` elsewhere is a rule with a second home.
    test = re.compile(r"""\.type\s*[!=]=\s*["']cuda["']""")
    found = [f"{path.name}:{number}: {line.strip()}"
             for package in PACKAGES for path in sorted(package.rglob("*.py")) if path.name != "devices.py"
             for number, line in enumerate(path.read_text().splitlines(), 1) if test.search(line)]
    assert found == []


@pytest.mark.parametrize("device, granule", [("cuda", 512), ("cuda:1", 512), ("cpu", 1), ("meta", 1)])
def test_allocation_bytes_round_up_to_the_devices_granule(device, granule):
    assert devices.allocation_granule(device) == granule
    assert [allocation_bytes(n, device) for n in (0, 1, 512, 513)] == \
        [0, granule, 512, 513 if granule == 1 else 1024]


def test_only_cuda_runs_triton_by_default():
    for device in ("cpu", "meta", torch.device("cpu")):
        assert not devices.runs_triton_by_default(device)
        devices.synchronize(device)  # nothing queued: returns
    assert devices.runs_triton_by_default("cuda:0")


def test_offload_on_a_cpu_model_keeps_nothing_on_the_host_and_warns_once(monkeypatch):
    # NOTE [ Separate host memory ]: on a CPU the host's memory is the device's, so a
    # copy there would free nothing; the chain keeps what it keeps without offload.
    monkeypatch.setattr(keep_rules, "_offload_warned", [False])
    layers = [m for _ in range(6) for m in (nn.Linear(32, 32), nn.ReLU())]
    x = torch.randn(16, 32)
    with devices.host_tier_simulated(False), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for offload in (False, True, True):
            for compress in (None, "int8"):
                model = actsave.CheckpointedSequential(*layers, segments=3, compress=compress, offload=offload)
                model(x).sum().backward()
                out = model(x)
                kept = actsave.kept_bytes()
                assert kept["host"] == 0 and kept["device"] > 0, (offload, compress, kept)
                del out
        block = actsave.Checkpoint(nn.Sequential(nn.Linear(32, 32), nn.GELU()), keep="saves", offload=True)
        out = block(x.requires_grad_())
        assert actsave.kept_bytes()["host"] == 0
        del out
    offload_warnings = [w for w in caught if "offload=True keeps cpu tensors where they are" in str(w.message)]
    assert len(offload_warnings) == 1
    assert "on a CPU, compress= (int8, fp8) keeps less" in str(offload_warnings[0].message)


def test_offload_on_a_cpu_model_computes_what_it_computes_without():
    torch.manual_seed(0)
    layers = [m for _ in range(6) for m in (nn.Linear(32, 32), nn.ReLU())]
    x = torch.randn(16, 32)
    grads = []
    with devices.host_tier_simulated(False), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for offload in (False, True):
            model = actsave.CheckpointedSequential(*layers, segments=3, offload=offload)
            model.zero_grad()
            model(x).sum().backward()
            grads.append([p.grad.clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads))
