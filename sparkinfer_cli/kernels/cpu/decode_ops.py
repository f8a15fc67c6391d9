"""The small ops of a decode step (one new token) as numba kernels; ops.py is their reference.

At T = 1 the numpy versions cost 15-45 µs each in call overhead and temporaries (a decode token
of Qwen2.5-0.5B runs about 100 of them), and attention gathered each sequence's whole K/V out of
the paged cache first. These read the cache in place and allocate only their outputs.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from sparkinfer_cli.kernels.cpu.ops import ROPE_NEOX, _inv_freq

_f32 = np.float32


@njit(cache=True, nogil=True)
def _rms_norm_row(x, w, eps, out):
    ss = 0.0  # float64 sum of squares, as ggml
    for i in range(x.shape[0]):
        ss += np.float64(x[i]) * np.float64(x[i])
    scale = _f32(1.0 / np.sqrt(ss / x.shape[0] + eps))
    for i in range(x.shape[0]):
        out[i] = (x[i] * scale) * w[i]


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """ops.rms_norm of x (1, n) float32."""
    out = np.empty_like(x)  # (1, n)
    _rms_norm_row(x[0], weight, eps, out[0])
    return out


@njit(cache=True, nogil=True)
def _rope_heads(x, cos, sin, neox, out):
    """out = x (H, D) rotated in its first 2·len(cos) dims; neox pairs i with i + half."""
    half = cos.shape[0]
    for h in range(x.shape[0]):
        for d in range(2 * half, x.shape[1]):
            out[h, d] = x[h, d]
        for i in range(half):
            ia, ib = (i, i + half) if neox else (2 * i, 2 * i + 1)
            a, b = x[h, ia], x[h, ib]
            out[h, ia] = a * cos[i] - b * sin[i]
            out[h, ib] = a * sin[i] + b * cos[i]


def rope(x: np.ndarray, position: int, n_rot: int, base: float, style: str) -> np.ndarray:
    """ops.rope of x (1, H, D) at one position."""
    angles = position * _inv_freq(n_rot, base)  # (n_rot/2,) float64
    out = np.empty_like(x)  # (1, H, D)
    _rope_heads(x[0], np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32),
                style == ROPE_NEOX, out[0])
    return out


@njit(cache=True, nogil=True, fastmath=True)
def _attend_paged(q, k, v, block_table, length, out):
    """out (H, D) = softmax(q·Kᵀ/√D)·V over positions 0..length-1 of a paged cache layer
    k, v (block, slot, H_kv, D); query head h reads KV head h // (H / H_kv)."""
    H, D = q.shape
    block_size, group = k.shape[1], H // k.shape[2]
    scale = _f32(1.0 / np.sqrt(D))
    p = np.empty(length, np.float32)  # (length,)
    for h in range(H):
        kv = h // group
        for t in range(length):
            b, s = block_table[t // block_size], t % block_size
            acc = _f32(0)
            for d in range(D):
                acc += q[h, d] * k[b, s, kv, d]
            p[t] = acc * scale
        p_max, total = p.max(), _f32(0)
        for t in range(length):
            p[t] = np.exp(p[t] - p_max)
            total += p[t]
        out[h, :] = 0
        for t in range(length):
            b, s, wt = block_table[t // block_size], t % block_size, p[t] / total
            for d in range(D):
                out[h, d] += wt * v[b, s, kv, d]


def attend_paged(q: np.ndarray, k: np.ndarray, v: np.ndarray, block_table: np.ndarray,
                 length: int) -> np.ndarray:
    """ops.causal_attention of one new query q (1, H, D) at position length - 1, reading the
    layer's paged cache k, v (num_blocks, block_size, H_kv, D) through block_table."""
    out = np.empty_like(q)  # (1, H, D)
    _attend_paged(q[0], k, v, block_table, length, out[0])
    return out
