"""RMSNorm and RoPE row by row as numba kernels; ops.py is their reference.

At T = 1 the numpy versions cost 15-45 µs each in call overhead and temporaries (a decode token
of Qwen2.5-0.5B runs about 150 of them); these allocate only their outputs, and a row's result
never depends on the other rows. (Attention over the paged cache: paged_attention.py.)
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
