"""Load-time int8 repack of ggml weights: lossless against gguf.quants.dequantize, and its
decode matmul against a float64 oracle built from gguf.quants.dequantize(W) and x quantized by
this file's own numpy code (Q8_0 rule per 32 values)."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
from quant_samples import N_ROWS, NE0, random_weight

from sparkinfer_cli.ggml_types import GGMLType
from sparkinfer_cli.kernels.cpu.quant_repack import (
    REPACK_TYPES,
    has_avx2,
    matmul_repacked,
    repack,
)

TYPES = sorted(GGMLType(t) for t in REPACK_TYPES)
KERNELS = [False] + ([True] if has_avx2() else [])  # use_ir: numba kernel, LLVM IR kernel


def q8_reference(x: np.ndarray) -> np.ndarray:
    """x float32 (T, ne0) → float64 dequantized int8 activations, d = max|x|/127 per 32."""
    blocks = x.reshape(x.shape[0], -1, 32)  # (T, n_blocks, 32)
    d = np.abs(blocks).max(axis=2, keepdims=True) / np.float32(127)  # float32, as the kernel
    q = np.rint(blocks / np.where(d > 0, d, 1))
    return (q.astype(np.float64) * d).reshape(x.shape)


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_repack_is_lossless(t: GGMLType, rng: np.random.Generator) -> None:
    raw = random_weight(t, rng)
    w = repack(raw, t, NE0)
    want = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(t))
    got = w.q.reshape(N_ROWS, -1, w.group).astype(np.float32) * w.d[:, :, None]
    if w.m.shape[1]:
        got = got + w.m[:, :, None]
    np.testing.assert_array_equal(got.reshape(N_ROWS, NE0).view(np.uint32), want.view(np.uint32))
    assert np.array_equal(w.dequantize(), want)
    assert w.q.dtype == np.int8 and w.d.dtype == w.m.dtype == np.float32


@pytest.mark.parametrize("use_ir", KERNELS, ids=lambda u: "ir" if u else "numba")
@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_matmul_matches_float64_oracle(t: GGMLType, use_ir: bool,
                                       rng: np.random.Generator) -> None:
    raw = random_weight(t, rng)
    w64 = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(t)).astype(np.float64)
    x = rng.standard_normal((2, NE0)).astype(np.float32)
    x[1, :32] = 0  # an all-zero activation block (d = 0)
    got = matmul_repacked(repack(raw, t, NE0), x, use_ir=use_ir)
    xq = q8_reference(x)
    want = xq @ w64.T  # (T, rows)
    scale = np.abs(xq) @ np.abs(w64).T
    assert got.shape == (2, N_ROWS) and got.dtype == np.float32
    assert np.all(np.abs(got - want) <= 1e-5 * scale), np.max(np.abs(got - want) / scale)


def test_rejects_bad_input(rng: np.random.Generator) -> None:
    raw = random_weight(GGMLType.Q8_0, rng)
    with pytest.raises(ValueError, match="ggml types"):
        repack(raw, int(GGMLType.IQ4_NL), NE0)
    with pytest.raises(ValueError, match="raw must be"):
        repack(raw[:, :-1], GGMLType.Q8_0, NE0)
    with pytest.raises(ValueError, match="x must be"):
        matmul_repacked(repack(raw, GGMLType.Q8_0, NE0), np.zeros((1, NE0 - 32), np.float32))
