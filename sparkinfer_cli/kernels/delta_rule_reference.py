"""The gated delta rule in float64 numpy, straight from its definition: the one reference that the
CPU kernels (kernels/cpu/gated_delta.py) and the CUDA kernels (kernels/cuda/gated_delta.py) are
tested against."""

from __future__ import annotations

import numpy as np


def delta_rule(q, k, v, g, beta, state, head_map_mod: bool) -> tuple[np.ndarray, np.ndarray]:
    """T tokens of one sequence: per value head h (its key head h mod n_k, or h // (n_v / n_k)),
    S ← exp(g)·S, δ = β(v − Sᵀk), S ← S + k⊗δ, o = Sᵀq / √dk.

    q, k (T, n_k, dk); v (T, n_v, dv); g (log-decay), beta (T, n_v); state (n_v, dk, dv).
    Returns (out (T, n_v, dv), the new state), float64."""
    q, k, v, g, beta = (np.asarray(x, np.float64) for x in (q, k, v, g, beta))
    s = np.asarray(state, np.float64).copy()  # (n_v, dk, dv)
    n_tok, n_k, dk = q.shape
    n_v = v.shape[1]
    out = np.zeros(v.shape)
    for h in range(n_v):
        kh = h % n_k if head_map_mod else h // (n_v // n_k)
        for t in range(n_tok):
            s[h] *= np.exp(g[t, h])
            delta = beta[t, h] * (v[t, h] - s[h].T @ k[t, kh])
            s[h] += np.outer(k[t, kh], delta)
            out[t, h] = s[h].T @ q[t, kh] / np.sqrt(dk)
    return out, s


def fused_step(u, a, b, ssm_a, dt_bias, state, n_k_heads: int, head_map_mod: bool,
               eps: float) -> tuple[np.ndarray, np.ndarray]:
    """One token of each sequence from the projections the CUDA step kernel reads: u (n_seqs,
    q | k | v) with q and k L2-normalised here, log-decay ssm_a·softplus(a + dt_bias), β =
    sigmoid(b); state (n_seqs, n_v, dv, dk), as the CUDA cache keeps it. Returns (out (n_seqs,
    n_v, dv), the new state in that layout)."""
    n_seqs, n_v, dv, dk = state.shape
    key_dim = n_k_heads * dk
    u = np.asarray(u, np.float64)
    q = u[:, :key_dim].reshape(n_seqs, 1, n_k_heads, dk)
    k = u[:, key_dim:2 * key_dim].reshape(n_seqs, 1, n_k_heads, dk)
    v = u[:, 2 * key_dim:].reshape(n_seqs, 1, n_v, dv)
    q, k = (x / np.sqrt((x * x).sum(-1, keepdims=True) + eps) for x in (q, k))
    t = np.asarray(a, np.float64) + dt_bias
    g = ssm_a * np.where(t > 20, t, np.log1p(np.exp(np.minimum(t, 20))))  # (n_seqs, n_v)
    beta = 1 / (1 + np.exp(-np.asarray(b, np.float64)))
    out, new_state = np.zeros((n_seqs, n_v, dv)), np.zeros((n_seqs, n_v, dv, dk))
    for n in range(n_seqs):
        o, s = delta_rule(q[n], k[n], v[n], g[n:n + 1], beta[n:n + 1],
                          np.swapaxes(state[n], 1, 2), head_map_mod)
        out[n], new_state[n] = o[0], np.swapaxes(s, 1, 2)
    return out, new_state
