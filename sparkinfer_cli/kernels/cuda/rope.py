"""Rotary embedding of the first n_rot dims of each head, in place: NEOX or normal (llama) pairs.

Pair i < n_rot/2 rotates elements (i, i + n_rot/2) (NEOX) or (2i, 2i + 1) (normal) by
θ = pos · base^(-2i/n_rot); the angle is
formed in float64 so positions up to 256k keep full float32 accuracy in cos/sin.
"""

from __future__ import annotations

import math

import numpy as np
from numba import cuda, float32, float64

from sparkinfer_cli.kernels.cuda.launch import cdiv, check_array

THREADS = 128


@cuda.jit
def _rope_kernel(x, positions, n_heads, head_dim, n_rot, log_base, neox):
    idx = cuda.grid(1)
    half = n_rot // 2
    if idx >= positions.size * n_heads * half:
        return
    i = idx % half
    row = idx // half  # token · n_heads + head
    theta = float64(positions[row // n_heads]) * math.exp(-2.0 * i / n_rot * log_base)
    c = float32(math.cos(theta))
    s = float32(math.sin(theta))
    a = row * head_dim + (i if neox else 2 * i)
    b = a + (half if neox else 1)
    x0 = x[a]
    x1 = x[b]
    x[a] = x0 * c - x1 * s
    x[b] = x0 * s + x1 * c


def rope_neox(x, positions, n_rot: int, base: float, stream=0, neox: bool = True) -> None:
    """x: float32 (n_tokens, n_heads, head_dim) rotated in place; positions: int32 (n_tokens,).

    neox=False: llama's adjacent pairs (2i, 2i + 1)."""
    n_tokens, n_heads, head_dim = x.shape
    check_array("x", x, np.float32)
    check_array("positions", positions, np.int32, (n_tokens,))
    if n_rot % 2 or n_rot > head_dim:
        raise ValueError(f"n_rot={n_rot} must be even and ≤ head_dim={head_dim}")
    n = n_tokens * n_heads * (n_rot // 2)
    _rope_kernel[cdiv(n, THREADS), THREADS, stream](
        x.reshape(x.size), positions, n_heads, head_dim, n_rot, math.log(base), neox)


def rope_neox_reference(x: np.ndarray, positions: np.ndarray, n_rot: int,
                        base: float) -> np.ndarray:
    half = n_rot // 2
    theta = positions[:, None].astype(np.float64) * base ** (-2.0 * np.arange(half) / n_rot)
    c, s = np.cos(theta)[:, None, :], np.sin(theta)[:, None, :]  # (n_tokens, 1, half)
    y = x.astype(np.float64).copy()
    x0, x1 = y[..., :half].copy(), y[..., half:n_rot].copy()
    y[..., :half] = x0 * c - x1 * s
    y[..., half:n_rot] = x0 * s + x1 * c
    return y
