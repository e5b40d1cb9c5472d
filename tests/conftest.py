"""Fixtures shared by the test-suite: the device, the backend choice, seeding and the ``cuda`` marker.

Tests run on "cuda" when a GPU is present, else on "cpu". The Triton backend is exercised on CUDA tensors,
and on CPU tensors only when ``TRITON_INTERPRET=1`` was set before import (the Triton interpreter).
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from helpers import backends_for, spy, triton_usable  # noqa: E402

import maxsim  # noqa: E402

HAS_CUDA = torch.cuda.is_available()

# Under pytest-xdist (the README's `-n auto`) each worker takes its share of the cores for PyTorch's own threads:
# workers that each spawn a thread per core oversubscribe a 2-core CI machine.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // _WORKERS))


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def device() -> str:
    return "cuda" if HAS_CUDA else "cpu"


@pytest.fixture(autouse=True)
def _seed_and_restore_backend():
    """Every test starts from a fixed global seed, the default backend and no repeated CPU call kept, whatever the
    previous test did (a test that patches the CPU path's functions sees its first call take them)."""
    torch.manual_seed(0)
    maxsim.ops._cpu_repeats.clear()
    before = maxsim.get_backend()
    yield
    maxsim.set_backend(before)


@pytest.fixture
def any_size(monkeypatch):
    """Once-read scans stream at any size (STREAM_L2_RANGE's rule would exclude every small test shape); forward
    plans cleared before and after."""
    from maxsim.kernels import launch_forward, launch_settings

    monkeypatch.setattr(launch_settings, "STREAM_L2_RANGE", (0.0, math.inf))
    launch_forward.plans.clear()
    yield
    launch_forward.plans.clear()


@pytest.fixture(params=["torch", "triton"])
def backend(request, device):
    """Runs the test under ``maxsim.backend(name)``; "triton" is skipped where the kernels cannot run."""
    name = request.param
    if name == "triton" and not triton_usable(device):
        pytest.skip("Triton kernels need CUDA tensors or TRITON_INTERPRET=1 on CPU")
    with maxsim.backend(name):
        yield name


@pytest.fixture
def available_backends(device) -> list[str]:
    return backends_for(device)


# ---- repeated calls (tests/test_repeat_calls.py, tests/test_ragged_repeats.py) ----------------------------------


@pytest.fixture
def triton_only(device):
    """Runs the test under ``maxsim.backend("triton")``; skipped where the kernels cannot run."""
    if not triton_usable(device):
        pytest.skip("Triton kernels need CUDA tensors or TRITON_INTERPRET=1 on CPU")
    with maxsim.backend("triton"):
        yield


@pytest.fixture
def plan_keys(monkeypatch):
    """Counts how often the forward builds a plan's full key (what a repeat call does without); the forward plans
    start empty."""
    from maxsim.kernels import launch_forward

    maxsim.ops._triton_path()  # (before a first Triton call nothing is filed: the repeat keys are None)
    monkeypatch.setattr(launch_forward, "plans", {})
    return spy(monkeypatch, launch_forward, "plan_key")


@pytest.fixture
def backward_plans(monkeypatch):
    """Counts how often a backward plan is looked up by its full key (what a repeated step does without); the
    backward plans start empty."""
    from maxsim.kernels import launch_backward

    monkeypatch.setattr(launch_backward, "plans", {})
    return spy(monkeypatch, launch_backward, "backward_plan_of")
