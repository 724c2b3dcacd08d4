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

# One intra-op thread for every test, whichever file runs first: the tests' tensors are
# small, where a second thread costs more than it computes on a shared two-core machine
# (the bench scripts the tests run set one thread too), and a file run alone then runs
# as in the whole suite, where a bench fixture used to set it for the files after it.
torch.set_num_threads(1)

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


def pytest_collection_finish(session):
    """Python's full collections skip what exists once the tests are collected.

    A full collection (automatic, or a test's ``gc.collect()`` that frees what reference
    counting cannot) walks every object the collector tracks: after torch, transformers
    and triton are imported and the tests collected, a few hundred thousand objects that
    are never garbage. ``gc.freeze()`` moves them to the
    permanent generation, which no collection walks; what the tests make is collected
    as before."""
    gc.collect()
    gc.freeze()


def pytest_unconfigure(config):
    # The interpreter's last collection sees them again: nanobind (triton's bindings)
    # reports as leaked any of its objects still alive at exit.
    gc.unfreeze()


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
