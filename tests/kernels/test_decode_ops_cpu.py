"""Decode-step numba ops against float64 numpy references written here (RMSNorm, RoPE in both
styles, storing decode tokens' K/V in a paged cache with scattered block tables and their
queries' GQA attention there). They take several tokens: each row is what it is alone."""

from __future__ import annotations

import numpy as np
import pytest

from sparkinfer_cli.kernels.cpu import decode_ops, quant
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


def _attention_reference(q: np.ndarray, keys: np.ndarray, values: np.ndarray) -> np.ndarray:
    """float64 softmax(q·Kᵀ/√D)·V of one query q (H, D) over keys, values (length, H_kv, D)."""
    H, D = q.shape
    kv_head = np.arange(H) // (H // keys.shape[1])
    scores = np.einsum("hd,thd->ht", q, keys[:, kv_head]) / np.sqrt(D)  # (H, length)
    probs = np.exp(scores - scores.max(axis=1, keepdims=True))
    probs /= probs.sum(axis=1, keepdims=True)
    return np.einsum("ht,thd->hd", probs, values[:, kv_head])


@pytest.mark.parametrize("threads", [1, 2])
def test_attend_paged_stores_then_attends(threads: int, rng: np.random.Generator,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Three sequences' decode tokens (rows 2, 0, 1), at positions 36, 0 and 13, each in its own
    scattered blocks; on one thread, or split between two."""
    monkeypatch.setattr(decode_ops, "_MIN_MACS_PER_THREAD", 1 if threads == 2 else 1 << 40)
    monkeypatch.setattr(quant, "_num_threads", lambda: threads)
    H, H_kv, D, block_size, num_blocks = 6, 2, 32, 8, 12
    k = rng.standard_normal((num_blocks, block_size, H_kv, D)).astype(np.float32)
    v = rng.standard_normal((num_blocks, block_size, H_kv, D)).astype(np.float32)
    k_new, v_new = rng.standard_normal((2, 3, H_kv, D)).astype(np.float32)
    q = rng.standard_normal((3, H, D)).astype(np.float32)
    rows, positions, blocks = [2, 0, 1], [36, 0, 13], rng.permutation(num_blocks).astype(np.int32)
    tables = [blocks[:5], blocks[5:6], blocks[6:8]]
    wants, untouched = [], k.copy()
    for r, table, position in zip(rows, tables, positions):
        pos = np.arange(position + 1)
        slot = table[pos // block_size], pos % block_size
        keys, values = k[slot].astype(np.float64), v[slot].astype(np.float64)  # (length, H_kv, D)
        keys[-1], values[-1] = k_new[r], v_new[r]
        wants.append(_attention_reference(q[r], keys, values))
        untouched[slot[0][-1], slot[1][-1]] = k_new[r]
    got = decode_ops.attend_paged(q, k_new, v_new, k, v, rows, tables, positions)
    assert got.shape == (3, H, D)
    for r, table, position, want in zip(rows, tables, positions, wants):
        np.testing.assert_allclose(got[r], want, rtol=1e-5, atol=1e-5)
        last = table[position // block_size], position % block_size
        np.testing.assert_array_equal(k[last], k_new[r])
        np.testing.assert_array_equal(v[last], v_new[r])
    np.testing.assert_array_equal(k, untouched)  # nothing else written
