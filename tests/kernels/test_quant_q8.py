"""int8-activation decode matmul against float64 oracles: gguf.quants.dequantize(W) times x
quantized by this file's own numpy code (Q8_0 rule per 32 values), and against the float path."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
from quant_samples import FP16_FIELDS, N_ROWS, NE0, random_weight

from sparkinfer_cli.ggml_types import GGMLType
from sparkinfer_cli.kernels.cpu.quant import FUSED_MAX_TOKENS, matmul
from sparkinfer_cli.kernels.cpu.quant_q8 import Q8_MAX_TOKENS, Q8_TYPES, matmul_q8

TYPES = sorted(GGMLType(t) for t in Q8_TYPES)


def random_activations(T: int, rng: np.random.Generator) -> np.ndarray:
    """Normal values at block-varying magnitudes, one all-zero block (scale 0)."""
    x = rng.standard_normal((T, NE0)) * rng.uniform(0.01, 10, (T, NE0 // 32)).repeat(32, axis=1)
    x[:, 64:96] = 0
    return x.astype(np.float32)  # (T, NE0)


def q8_dequantized(x: np.ndarray) -> np.ndarray:
    """x after int8 quantization per 32 values (d = max|x| / 127, q = round-half-even(x / d)),
    in float64: the activations the int8 kernels multiply with."""
    blocks = x.reshape(x.shape[0], -1, 32)  # (T, n_blocks, 32)
    d = np.abs(blocks).max(axis=-1, keepdims=True) / np.float32(127)  # (T, n_blocks, 1) f32
    safe_d = np.where(d > 0, d, np.float32(1))
    q = np.where(d > 0, np.rint(blocks / safe_d), 0)  # (T, n_blocks, 32)
    assert np.abs(q).max() <= 127
    return (q.astype(np.float64) * d.astype(np.float64)).reshape(x.shape)


def dequantized_weight(raw: np.ndarray, t: GGMLType) -> np.ndarray:
    return gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(int(t))).astype(np.float64)


@pytest.mark.parametrize("T", [1, 3])
@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_matmul_q8_equals_dequantized_product(t: GGMLType, T: int,
                                              rng: np.random.Generator) -> None:
    raw, x = random_weight(t, rng), random_activations(T, rng)
    w, xq = dequantized_weight(raw, t), q8_dequantized(x)
    expected = xq @ w.T  # (T, N_ROWS)
    bound = np.abs(xq) @ np.abs(w).T  # float32 rounding scales with Σ|w·x|
    actual = matmul_q8(raw, int(t), NE0, x, max_tokens=FUSED_MAX_TOKENS)
    assert actual.dtype == np.float32 and actual.shape == (T, N_ROWS)
    np.testing.assert_array_less(np.abs(actual - expected), 1e-5 * bound + 1e-30)


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_matmul_q8_close_to_float_path(t: GGMLType, rng: np.random.Generator) -> None:
    raw = random_weight(t, rng)
    x = rng.standard_normal((2, NE0)).astype(np.float32)  # (2, NE0)
    exact = matmul(raw, int(t), NE0, x)
    actual = matmul_q8(raw, int(t), NE0, x, max_tokens=2)
    err = np.linalg.norm(actual - exact) / np.linalg.norm(exact)
    assert err < 2e-2  # int8 activations: ~0.5/127 of each block's max, relative


@pytest.mark.parametrize("t, T", [(GGMLType.Q8_0, Q8_MAX_TOKENS + 1), (GGMLType.F16, 1)])
def test_prefill_and_other_types_take_the_float_path(t: GGMLType, T: int,
                                                     rng: np.random.Generator) -> None:
    raw = (random_weight(t, rng) if t in FP16_FIELDS
           else rng.standard_normal((N_ROWS, NE0)).astype(np.float16))
    x = rng.standard_normal((T, NE0)).astype(np.float32)  # (T, NE0)
    np.testing.assert_array_equal(matmul_q8(raw, int(t), NE0, x), matmul(raw, int(t), NE0, x))


def test_wrong_shapes_raise_value_error(rng: np.random.Generator) -> None:
    raw = random_weight(GGMLType.Q5_0, rng)
    with pytest.raises(ValueError, match="x must be"):
        matmul_q8(raw, int(GGMLType.Q5_0), NE0, np.zeros((1, NE0 + 32), np.float32))
    with pytest.raises(ValueError, match="2-D"):
        matmul_q8(raw[None], int(GGMLType.Q5_0), NE0, np.zeros((1, NE0), np.float32))
