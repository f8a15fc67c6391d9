"""Fixtures of the kernel tests."""

from __future__ import annotations

import numpy as np
import pytest


@pytest.fixture
def rng(request) -> np.random.Generator:
    """A fresh seed per test run; it is printed on failure (pytest shows captured stdout)."""
    seed = int(np.random.SeedSequence().entropy % 2**32)
    print(f"{request.node.name}: seed={seed}")
    return np.random.default_rng(seed)
