"""Decode-step numba ops against float64 numpy references written here (RMSNorm, RoPE in both
styles). They take several tokens: each row is what it is alone."""

from __future__ import annotations

import numpy as np
import pytest

from sparkinfer_cli.kernels.cpu import decode_ops
from sparkinfer_cli.kernels.cpu.ops import ROPE_NEOX, ROPE_NORMAL


def test_rms_norm(rng: np.random.Generator) -> None:
    x = (rng.standard_normal((5, 896)) * [[3], [1], [1e-3], [30], [1]]).astype(np.float32)
    w = rng.standard_normal(896).astype(np.float32)
    x64 = x.astype(np.float64)
    want = x64 / np.sqrt(np.mean(x64 ** 2, axis=1, keepdims=True) + 1e-6) * w
    got = decode_ops.rms_norm(x, w, 1e-6)
    assert got.shape == x.shape and got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(got[3:4], decode_ops.rms_norm(x[3:4], w, 1e-6))
    heads = x.reshape(5, 14, 64)  # per-head norm: each (token, head) row on its own
    np.testing.assert_array_equal(decode_ops.rms_norm(heads, w[:64], 1e-6)[2, 7],
                                  decode_ops.rms_norm(heads[2, 7:8], w[:64], 1e-6)[0])


@pytest.mark.parametrize("style", [ROPE_NEOX, ROPE_NORMAL])
@pytest.mark.parametrize("n_rot", [64, 32])
def test_rope(style: str, n_rot: int, rng: np.random.Generator) -> None:
    H, D, base = 3, 64, 10000.0
    pos = np.array([1234, 0, 7], np.int32)  # one token per sequence
    x = rng.standard_normal((3, H, D)).astype(np.float32)
    theta = pos[:, None, None] * base ** (-np.arange(0, n_rot, 2) / n_rot)  # (T, 1, n_rot/2)
    ia = np.arange(n_rot // 2) if style == ROPE_NEOX else np.arange(0, n_rot, 2)
    ib = ia + n_rot // 2 if style == ROPE_NEOX else ia + 1
    want = x.astype(np.float64)
    a, b = want[..., ia].copy(), want[..., ib].copy()
    want[..., ia] = a * np.cos(theta) - b * np.sin(theta)
    want[..., ib] = a * np.sin(theta) + b * np.cos(theta)
    got = decode_ops.rope(x, pos, n_rot, base, style)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(got[..., n_rot:], x[..., n_rot:])  # unrotated dims pass
    np.testing.assert_array_equal(got[2:], decode_ops.rope(x[2:], pos[2:], n_rot, base, style))
