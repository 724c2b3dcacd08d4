"""Test setup shared by every tier (see docs/architecture.md, "Testing without a GPU").

Triton reads TRITON_INTERPRET when ``@triton.jit`` decorates a kernel, so it must be
set before anything imports triton: without CUDA the kernels then run on CPU tensors
under Triton's interpreter and are compared bit for bit with their torch references.
"""
import gc
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from actsave import devices  # noqa: E402


@pytest.fixture(autouse=True)
def host_tier_on_cpu():
    """Offload runs its whole schedule on CPU tensors in the tests, the pool standing
    for a host tier (NOTE [ Separate host memory ]); a test of what a user's CPU model
    does opens ``devices.host_tier_simulated(False)``."""
    with devices.host_tier_simulated():
        yield


@pytest.fixture
def no_collector():
    """Python's cycle collector off: what a test frees, reference counting frees."""
    gc.collect()
    gc.disable()
    yield
    gc.enable()


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
