import re
from pathlib import Path

import pytest
import torch

from actsave import devices
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
