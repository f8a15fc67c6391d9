"""CPU implementations of the non-matmul ops of the forward pass (float32, llama.cpp semantics)."""

from __future__ import annotations

import functools

import numpy as np

ROPE_NORMAL, ROPE_NEOX = "normal", "neox"


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """x · w / sqrt(mean(x²) + eps) over the last axis; sum of squares in float64 like ggml."""
    mean_sq = np.mean(np.square(x, dtype=np.float64), axis=-1, keepdims=True)
    scale = (1.0 / np.sqrt(mean_sq + eps)).astype(np.float32)
    return (x * scale) * weight


def silu(x: np.ndarray) -> np.ndarray:
    return x / (np.float32(1.0) + np.exp(-x))


def sigmoid(x: np.ndarray) -> np.ndarray:
    return np.float32(1.0) / (np.float32(1.0) + np.exp(-x))


def softplus(x: np.ndarray) -> np.ndarray:
    """log(1 + e^x), linear above 20 like ggml."""
    return np.where(x > 20, x, np.log1p(np.exp(np.minimum(x, 20)))).astype(np.float32)


@functools.lru_cache(maxsize=64)
def _inv_freq(n_rot: int, base: float) -> np.ndarray:
    return base ** (-np.arange(0, n_rot, 2, dtype=np.float64) / n_rot)  # (n_rot/2,)


def rope(x: np.ndarray, positions: np.ndarray, n_rot: int, base: float, style: str) -> np.ndarray:
    """Rotary embedding of the first n_rot dims of each head. x: (T, H, D); positions: (T,).

    neox pairs dim i with i + n_rot/2; normal (llama) pairs 2i with 2i+1. Dims ≥ n_rot pass through.
    """
    angles = positions.astype(np.float64)[:, None] * _inv_freq(n_rot, base)[None, :]  # (T, n_rot/2)
    cos = np.cos(angles).astype(np.float32)[:, None, :]  # (T, 1, n_rot/2)
    sin = np.sin(angles).astype(np.float32)[:, None, :]
    out = x.copy()
    half = n_rot // 2
    if style == ROPE_NEOX:
        a, b = x[..., :half], x[..., half:n_rot]
        out[..., :half] = a * cos - b * sin
        out[..., half:n_rot] = a * sin + b * cos
    else:
        a, b = x[..., 0:n_rot:2], x[..., 1:n_rot:2]
        out[..., 0:n_rot:2] = a * cos - b * sin
        out[..., 1:n_rot:2] = a * sin + b * cos
    return out


def causal_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, start: int) -> np.ndarray:
    """Softmax attention of new queries over all keys of one sequence.

    q: (T, H, D) at positions start..start+T-1; k, v: (S, H_kv, D) with S = start + T.
    Query head h uses KV head h // (H / H_kv). Returns (T, H, D).
    """
    T, H, D = q.shape
    S, H_kv, _ = k.shape
    group = H // H_kv
    qg = q.reshape(T, H_kv, group, D).transpose(1, 2, 0, 3)  # (H_kv, group, T, D)
    scores = np.matmul(qg, k.transpose(1, 2, 0)[:, None]) * np.float32(1.0 / np.sqrt(D))
    # (H_kv, group, T, S); query t sees keys 0..start+t
    visible = np.arange(S)[None, :] <= (start + np.arange(T))[:, None]  # (T, S)
    scores = np.where(visible, scores, np.float32(-np.inf))
    scores -= scores.max(axis=-1, keepdims=True)
    probs = np.exp(scores)
    probs /= probs.sum(axis=-1, keepdims=True)
    out = np.matmul(probs, v.transpose(1, 0, 2)[:, None])  # (H_kv, group, T, D)
    return out.transpose(2, 0, 1, 3).reshape(T, H, D)
