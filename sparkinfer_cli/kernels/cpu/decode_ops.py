"""The small ops of a decode step (one new token) as numba kernels; ops.py is their reference.

At T = 1 the numpy versions cost 15-45 µs each in call overhead and temporaries (a decode token
of Qwen2.5-0.5B runs about 150 of them), and attention gathered each sequence's whole K/V out of
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
def _rope_heads(x, position, inv_freq, neox, out):
    """out = x (H, D) rotated in its first 2·len(inv_freq) dims; neox pairs i with i + half."""
    half = inv_freq.shape[0]
    for i in range(half):
        angle = position * inv_freq[i]  # float64, as ops.rope
        c, s = np.float32(np.cos(angle)), np.float32(np.sin(angle))
        ia, ib = (i, i + half) if neox else (2 * i, 2 * i + 1)
        for h in range(x.shape[0]):
            a, b = x[h, ia], x[h, ib]
            out[h, ia] = a * c - b * s
            out[h, ib] = a * s + b * c
    for h in range(x.shape[0]):
        for d in range(2 * half, x.shape[1]):
            out[h, d] = x[h, d]


def rope(x: np.ndarray, position: int, n_rot: int, base: float, style: str) -> np.ndarray:
    """ops.rope of x (1, H, D) at one position."""
    out = np.empty_like(x)  # (1, H, D)
    _rope_heads(x[0], float(position), _inv_freq(n_rot, base), style == ROPE_NEOX, out[0])
    return out


@njit(cache=True, nogil=True, fastmath=True, error_model="numpy")
def _attend_paged(q, k_new, v_new, k, v, block_table, position, out):
    """Store k_new, v_new (H_kv, D) at `position` of a paged cache layer k, v (block, slot,
    H_kv, D), then out (H, D) = softmax(q·Kᵀ/√D)·V over positions 0..position; query head h
    reads KV head h // (H / H_kv)."""
    H, D = q.shape
    H_kv, block_size = k.shape[2], k.shape[1]
    group, length = H // H_kv, position + 1
    k[block_table[position // block_size], position % block_size] = k_new
    v[block_table[position // block_size], position % block_size] = v_new
    scale = _f32(1.0 / np.sqrt(D))
    p = np.empty((group, length), np.float32)  # (group, length)
    for kv in range(H_kv):
        heads = q[kv * group:(kv + 1) * group]  # (group, D): the heads that read this KV head
        for t in range(length):
            kt = k[block_table[t // block_size], t % block_size, kv]  # (D,)
            for g in range(group):
                acc = _f32(0)
                for d in range(D):
                    acc += heads[g, d] * kt[d]
                p[g, t] = acc * scale
        for g in range(group):
            p_max, total = p[g].max(), _f32(0)
            for t in range(length):
                p[g, t] = np.exp(p[g, t] - p_max)
                total += p[g, t]
            p[g] /= total
        o = out[kv * group:(kv + 1) * group]  # (group, D)
        o[:] = 0
        for t in range(length):
            vt = v[block_table[t // block_size], t % block_size, kv]  # (D,)
            for g in range(group):
                for d in range(D):
                    o[g, d] += p[g, t] * vt[d]


def attend_paged(q: np.ndarray, k_new: np.ndarray, v_new: np.ndarray, k: np.ndarray,
                 v: np.ndarray, block_table: np.ndarray, position: int) -> np.ndarray:
    """One new token: store its k_new, v_new (1, H_kv, D) in the layer's paged cache k, v
    (num_blocks, block_size, H_kv, D) at `position` (ModelCache's region map), then
    ops.causal_attention of its query q (1, H, D) over positions 0..position."""
    out = np.empty_like(q)  # (1, H, D)
    _attend_paged(q[0], k_new[0], v_new[0], k, v, block_table, position, out[0])
    return out
