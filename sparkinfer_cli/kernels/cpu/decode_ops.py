"""The small ops of a decode step (one new token per sequence) as numba kernels; ops.py is their
reference.

At T = 1 the numpy versions cost 15-45 µs each in call overhead and temporaries (a decode token
of Qwen2.5-0.5B runs about 150 of them), and attention gathered each sequence's whole K/V out of
the paged cache first. These read the cache in place and allocate only their outputs.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from sparkinfer_cli.kernels.cpu.ops import ROPE_NEOX, _inv_freq
from sparkinfer_cli.kernels.cpu.quant import parallel_ranges

_f32 = np.float32


@njit(cache=True, nogil=True)
def _rms_norm_row(x, w, eps, out):
    ss = 0.0  # float64 sum of squares, as ggml
    for i in range(x.shape[0]):
        ss += np.float64(x[i]) * np.float64(x[i])
    scale = _f32(1.0 / np.sqrt(ss / x.shape[0] + eps))
    for i in range(x.shape[0]):
        out[i] = (x[i] * scale) * w[i]


@njit(cache=True, nogil=True)
def _rms_norm_rows(x, w, eps, out):
    for r in range(x.shape[0]):
        _rms_norm_row(x[r], w, eps, out[r])


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """ops.rms_norm of x (..., n) float32, row by row: a row's result does not depend on the
    others."""
    rows = x.reshape(-1, x.shape[-1])  # (rows, n)
    out = np.empty(rows.shape, np.float32)  # (rows, n)
    _rms_norm_rows(rows, weight, eps, out)
    return out.reshape(x.shape)


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


@njit(cache=True, nogil=True)
def _rope_rows(x, positions, inv_freq, neox, out):
    for t in range(x.shape[0]):
        _rope_heads(x[t], np.float64(positions[t]), inv_freq, neox, out[t])


def rope(x: np.ndarray, positions: np.ndarray, n_rot: int, base: float,
         style: str) -> np.ndarray:
    """ops.rope of x (T, H, D), token t at positions[t]."""
    out = np.empty(x.shape, np.float32)  # (T, H, D)
    _rope_rows(x, positions, _inv_freq(n_rot, base), style == ROPE_NEOX, out)
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
    # NOTE: positions outermost: the cache is read in its own order, each slot's heads at once
    p = np.empty((H, length), np.float32)  # (H, length)
    for t in range(length):
        kt = k[block_table[t // block_size], t % block_size]  # (H_kv, D)
        for h in range(H):
            acc = _f32(0)
            for d in range(D):
                acc += q[h, d] * kt[h // group, d]
            p[h, t] = acc * scale
    for h in range(H):
        p_max, total = p[h].max(), _f32(0)
        for t in range(length):
            p[h, t] = np.exp(p[h, t] - p_max)
            total += p[h, t]
        p[h] /= total
    out[:] = 0
    for t in range(length):
        vt = v[block_table[t // block_size], t % block_size]  # (H_kv, D)
        for h in range(H):
            for d in range(D):
                out[h, d] += p[h, t] * vt[h // group, d]


# Handing sequences to a second thread cost ~0.1 ms on the 2-vCPU VM we measured on (its idle vCPU
# halts): split only when each thread gets more attention than that, in q·K and p·V multiply-adds.
_MIN_MACS_PER_THREAD = 1 << 21


def attend_paged(q: np.ndarray, k_new: np.ndarray, v_new: np.ndarray, k: np.ndarray,
                 v: np.ndarray, rows: list[int], block_tables: list[np.ndarray],
                 positions: list[int]) -> np.ndarray:
    """Decode tokens of several sequences, one each: token rows[i] of q (N, H, D), k_new, v_new
    (N, H_kv, D) is at positions[i] of the sequence with block_tables[i]. Stores its k_new, v_new
    in the layer's paged cache k, v (num_blocks, block_size, H_kv, D) (ModelCache's region map),
    then ops.causal_attention of its query over positions 0..positions[i]. Returns out (N, H, D),
    written in those rows only."""
    N, H, D = q.shape
    out = np.empty_like(q)  # (N, H, D)

    def attend(a: int, b: int) -> None:
        for i in range(a, b):
            r = rows[i]
            _attend_paged(q[r], k_new[r], v_new[r], k, v, block_tables[i], positions[i], out[r])

    macs = 2 * H * D * (sum(positions) + len(positions))
    parallel_ranges(attend, len(rows), macs // _MIN_MACS_PER_THREAD)
    return out
