"""The SwiGLU kernel against float64 numpy: gate and up as column ranges of one fused projection
(as the model hands them over), row lengths that are and are not multiples of 8, prompt-sized
passes split between two threads, values far into both tails of the sigmoid, and a row's result
the same alone as in a pass."""

from __future__ import annotations

import numpy as np
import pytest

from sparkinfer_cli.kernels.cpu import quant
from sparkinfer_cli.kernels.cpu import swiglu as swiglu_module
from sparkinfer_cli.kernels.cpu.swiglu import swiglu


def _reference(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    g = gate.astype(np.float64)
    with np.errstate(over="ignore"):  # exp(-g) = inf for g ≪ 0: silu(g) = -0
        return g / (1.0 + np.exp(-g)) * up.astype(np.float64)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("rows, cols", [(1, 1536), (4, 20), (5, 7), (300, 64)])
def test_column_ranges_of_a_fused_projection(rows: int, cols: int, threads: int,
                                             rng: np.random.Generator,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(swiglu_module, "_MIN_VALUES_PER_PART", 1 if threads > 1 else 1 << 60)
    monkeypatch.setattr(quant, "_num_threads", lambda: threads)
    fused = (rng.standard_normal((rows, 2 * cols)) * 6).astype(np.float32)
    gate, up = fused[:, :cols], fused[:, cols:]
    got = swiglu(gate, up)
    assert got.shape == (rows, cols) and got.dtype == np.float32
    np.testing.assert_allclose(got, _reference(gate, up), rtol=1e-6, atol=1e-30)
    one = slice(rows // 2, rows // 2 + 1)
    np.testing.assert_array_equal(swiglu(gate[one], up[one]), got[one])


def test_the_tails_of_the_sigmoid() -> None:
    """Large |g|: exp(-g) overflows float32 for g < -88, and silu(g) is g itself for g ≫ 0.
    (The kernel's exp flushes below e^-87: silu values under 1e-36 come out 0.)"""
    gate = np.array([[-1e4, -200, -87.5, -30, -1e-30, 0, 1e-30, 2.5, 30, 1e4, 1e38]], np.float32)
    up = np.full_like(gate, 1.5)
    np.testing.assert_allclose(swiglu(gate, up), _reference(gate, up), rtol=1e-6, atol=1e-35)


def test_bad_shapes_are_refused() -> None:
    with pytest.raises(ValueError, match="one"):
        swiglu(np.zeros((2, 8), np.float32), np.zeros((2, 9), np.float32))
    with pytest.raises(ValueError, match="one"):
        swiglu(np.zeros(8, np.float32), np.zeros(8, np.float32))
