"""Decode-step numba ops against float64 numpy references written here (RMSNorm, RoPE in both
styles, one query's GQA attention over a paged cache with a scattered block table)."""

from __future__ import annotations

import numpy as np
import pytest

from sparkinfer_cli.kernels.cpu import decode_ops
from sparkinfer_cli.kernels.cpu.ops import ROPE_NEOX, ROPE_NORMAL


def test_rms_norm(rng: np.random.Generator) -> None:
    x = (rng.standard_normal((1, 896)) * 3).astype(np.float32)
    w = rng.standard_normal(896).astype(np.float32)
    x64 = x.astype(np.float64)
    want = x64 / np.sqrt(np.mean(x64 ** 2) + 1e-6) * w
    got = decode_ops.rms_norm(x, w, 1e-6)
    assert got.shape == x.shape and got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("style", [ROPE_NEOX, ROPE_NORMAL])
@pytest.mark.parametrize("n_rot", [64, 32])
def test_rope(style: str, n_rot: int, rng: np.random.Generator) -> None:
    H, D, pos, base = 3, 64, 1234, 10000.0
    x = rng.standard_normal((1, H, D)).astype(np.float32)
    theta = pos * base ** (-np.arange(0, n_rot, 2) / n_rot)  # (n_rot/2,)
    ia = np.arange(n_rot // 2) if style == ROPE_NEOX else np.arange(0, n_rot, 2)
    ib = ia + n_rot // 2 if style == ROPE_NEOX else ia + 1
    want = x.astype(np.float64)
    a, b = want[..., ia].copy(), want[..., ib].copy()
    want[..., ia] = a * np.cos(theta) - b * np.sin(theta)
    want[..., ib] = a * np.sin(theta) + b * np.cos(theta)
    got = decode_ops.rope(x, pos, n_rot, base, style)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(got[..., n_rot:], x[..., n_rot:])  # unrotated dims pass


@pytest.mark.parametrize("length", [1, 37])
def test_attend_paged(length: int, rng: np.random.Generator) -> None:
    H, H_kv, D, block_size, num_blocks = 6, 2, 32, 8, 12
    k = rng.standard_normal((num_blocks, block_size, H_kv, D)).astype(np.float32)
    v = rng.standard_normal((num_blocks, block_size, H_kv, D)).astype(np.float32)
    table = rng.permutation(num_blocks)[:-(-length // block_size)].astype(np.int32)
    q = rng.standard_normal((1, H, D)).astype(np.float32)
    pos = np.arange(length)
    keys = k[table[pos // block_size], pos % block_size].astype(np.float64)  # (length, H_kv, D)
    values = v[table[pos // block_size], pos % block_size].astype(np.float64)
    kv_head = np.arange(H) // (H // H_kv)
    scores = np.einsum("hd,thd->ht", q[0], keys[:, kv_head]) / np.sqrt(D)  # (H, length)
    probs = np.exp(scores - scores.max(axis=1, keepdims=True))
    probs /= probs.sum(axis=1, keepdims=True)
    want = np.einsum("ht,thd->hd", probs, values[:, kv_head])
    got = decode_ops.attend_paged(q, k, v, table, length)
    assert got.shape == (1, H, D)
    np.testing.assert_allclose(got[0], want, rtol=1e-5, atol=1e-5)
