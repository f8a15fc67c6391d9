"""Gated DeltaNet on the CPU: causal conv + SiLU, q/k L2 norm, and the delta-rule state update.

As llama.cpp's delta-net (src/models/delta-net-base.cpp) and HF's torch_recurrent_gated_delta_rule.
The state of v-head h is S_h (dk × dv, HF index S[i][j]) in float32,
stored as `state[h, i, j]`. Per token, with kh the q/k head of v-head h:

    S_h ← exp(g_h)·S_h;  δ = β_h·(v_h − S_hᵀ k_kh);  S_h ← S_h + k_kh ⊗ δ;  o_h = S_hᵀ q_kh/√dk

`gated_delta_recurrent` runs that loop exactly (decode, and llama.cpp's own prefill);
`gated_delta_chunked` is the chunked WY form for long prefills, equal within float32 rounding.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit

HEAD_MAPS = ("mod", "div")  # mod: qwen35/qwen35moe (tiled v-heads); div: qwen3next (grouped)


def l2_normalize(x: np.ndarray, eps: float) -> np.ndarray:
    """x / sqrt(Σx² + eps) over the last axis (llama.cpp @0c1e57098 and HF form)."""
    sum_sq = np.einsum("...d,...d->...", x, x, dtype=np.float64)  # (...,)
    scale = (1.0 / np.sqrt(sum_sq + eps)).astype(np.float32)
    return (x * scale[..., None]).astype(np.float32)


@njit(cache=True)
def _conv1d_silu_kernel(m, conv_state, weight, out):  # pragma: no cover - compiled
    T, C = m.shape
    K = weight.shape[1]
    for c in range(C):
        for t in range(T):
            acc = np.float32(0.0)
            for k in range(K):
                src = t + k  # index into [state (K-1) | m (T)], tap 0 = oldest
                x = conv_state[c, src] if src < K - 1 else m[src - (K - 1), c]
                acc += weight[c, k] * x
            out[t, c] = acc / (np.float32(1.0) + np.exp(-acc))
        for k in range(K - 1):  # keep the last K-1 inputs of [state | m]
            src = T + k
            conv_state[c, k] = conv_state[c, src] if src < K - 1 else m[src - (K - 1), c]


def causal_conv1d_silu(m: np.ndarray, conv_state: np.ndarray, weight: np.ndarray) -> np.ndarray:
    """Depthwise causal conv over [conv_state | m] then SiLU; conv_state is updated in place.

    m: (T, C) f32; conv_state: (C, K-1) f32, oldest sample first; weight: (C, K) f32.
    """
    T, C = m.shape
    if weight.ndim != 2 or weight.shape[0] != C or conv_state.shape != (C, weight.shape[1] - 1):
        raise ValueError(f"conv shapes disagree: m {m.shape}, conv_state {conv_state.shape}, "
                         f"weight {weight.shape}")
    _require_f32_contiguous(m=m, conv_state=conv_state, weight=weight)
    out = np.empty((T, C), dtype=np.float32)  # (T, C)
    _conv1d_silu_kernel(m, conv_state, weight, out)
    return out


@njit(cache=True)
def _recurrent_kernel(q, k, v, g, beta, state, head_ratio, out):  # pragma: no cover - compiled
    T, n_k_heads, dk = q.shape
    n_v_heads, dv = v.shape[1], v.shape[2]
    scale = np.float32(1.0 / math.sqrt(dk))
    kv = np.empty(dv, dtype=np.float32)
    for h in range(n_v_heads):
        kh = h % n_k_heads if head_ratio == 0 else h // head_ratio
        S = state[h]  # (dk, dv)
        for t in range(T):
            decay = np.float32(math.exp(g[t, h]))
            kv[:] = 0.0
            for i in range(dk):
                ki = k[t, kh, i]
                for j in range(dv):
                    S[i, j] *= decay
                    kv[j] += S[i, j] * ki
            b = beta[t, h]
            for j in range(dv):
                kv[j] = b * (v[t, h, j] - kv[j])  # kv now holds δ
            for j in range(dv):
                out[t, h, j] = 0.0
            for i in range(dk):
                ki, qi = k[t, kh, i], q[t, kh, i]
                for j in range(dv):
                    S[i, j] += ki * kv[j]
                    out[t, h, j] += S[i, j] * qi
            for j in range(dv):
                out[t, h, j] *= scale


def gated_delta_recurrent(q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray,
                          beta: np.ndarray, state: np.ndarray, head_map: str) -> np.ndarray:
    """Token-by-token delta rule. q, k: (T, H_k, dk) L2-normalised; v: (T, H_v, dv);
    g (log-decay), beta: (T, H_v); state: (H_v, dk, dv) f32, updated in place → o (T, H_v, dv)."""
    head_ratio = _check_gdn_args(q, k, v, g, beta, state, head_map)
    out = np.empty(v.shape, dtype=np.float32)  # (T, H_v, dv)
    _recurrent_kernel(q, k, v, g, beta, state, head_ratio, out)
    return out


def gated_delta_chunked(q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray,
                        beta: np.ndarray, state: np.ndarray, head_map: str,
                        chunk: int = 64) -> np.ndarray:
    """Chunked (WY / UT-transform) form of `gated_delta_recurrent`, same arguments and result."""
    head_ratio = _check_gdn_args(q, k, v, g, beta, state, head_map)
    if chunk < 1:
        raise ValueError(f"chunk must be positive, got {chunk}")
    T, H = v.shape[0], v.shape[1]
    C = min(chunk, T)
    kh = _k_head_of_v_head(H, q.shape[1], head_ratio)
    scale = np.float32(1.0 / math.sqrt(q.shape[2]))
    # Padded tokens have k = β = g = 0: they neither decay nor write the state.
    qc, kc = (_to_chunks(x[:, kh], C) for x in (q, k))  # (H, N, C, dk)
    vc = _to_chunks(v, C)  # (H, N, C, dv)
    gc, bc = (_to_chunks(x[..., None], C)[..., 0] for x in (g, beta))  # (H, N, C)
    G = np.cumsum(gc, axis=-1, dtype=np.float32)  # (H, N, C) in-chunk cumulative log-decay
    decay = _intra_chunk_decay(G)  # (H, N, C, C): exp(G_i − G_j) for j ≤ i, else 0
    kb = kc * bc[..., None]  # (H, N, C, dk)
    U, W = _wy_transform(kb, kc, vc * bc[..., None], G, decay)
    qk = _matmul_t(qc, kc) * decay  # (H, N, C, C), causal incl. diagonal
    out = _scan_chunks(qc * np.exp(G)[..., None], qk, U, W, kc, G, state)
    return (out.reshape(H, -1, v.shape[2])[:, :T] * scale).transpose(1, 0, 2).copy()


def _wy_transform(kb, k, vb, G, decay):
    """U = (I+L)⁻¹ β·v and W = (I+L)⁻¹ (β·k ⊙ exp(G)), L[i,j] = β_i k_i·k_j exp(G_i−G_j), j < i."""
    C = k.shape[-2]
    L = _matmul_t(kb, k) * decay  # (H, N, C, C)
    rhs = np.concatenate([vb, kb * np.exp(G)[..., None]], axis=-1)  # (H, N, C, dv + dk)
    X = np.empty_like(rhs)
    for i in range(C):  # forward substitution: unit lower-triangular (I + strict L)
        X[..., i, :] = rhs[..., i, :] - np.einsum("...j,...jd->...d", L[..., i, :i], X[..., :i, :])
    dv = vb.shape[-1]
    return np.ascontiguousarray(X[..., :dv]), np.ascontiguousarray(X[..., dv:])


def _scan_chunks(q_decayed, qk, U, W, k, G, state):
    """Carry the state across chunks (the only sequential part). state: (H, dk, dv), in place."""
    H, N, C, dv = U.shape
    out = np.empty((H, N, C, dv), dtype=np.float32)  # (H, N, C, dv)
    G_last = G[..., -1:]  # (H, N, 1)
    k_to_end_t = np.ascontiguousarray((k * np.exp(G_last - G)[..., None]).swapaxes(-1, -2))
    # k_to_end_t: (H, N, dk, C)
    for n in range(N):
        new_v = U[:, n] - W[:, n] @ state  # (H, C, dv)
        out[:, n] = q_decayed[:, n] @ state + qk[:, n] @ new_v
        state *= np.exp(G_last[:, n])[..., None]
        state += k_to_end_t[:, n] @ new_v
    return out


def _matmul_t(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a @ bᵀ over the last two axes; numpy's batched matmul is ~30× slower on a transposed view."""
    return a @ np.ascontiguousarray(b.swapaxes(-1, -2))


def _intra_chunk_decay(G: np.ndarray) -> np.ndarray:
    C = G.shape[-1]
    diff = G[..., :, None] - G[..., None, :]  # (H, N, C, C)
    causal = np.tril(np.ones((C, C), dtype=bool))
    return np.exp(np.where(causal, diff, -np.inf)).astype(np.float32)


def _to_chunks(x: np.ndarray, C: int) -> np.ndarray:
    """(T, H, d) → (H, N, C, d), zero-padded to a whole number of chunks."""
    T, H, d = x.shape
    N = -(-T // C)
    padded = np.zeros((N * C, H, d), dtype=np.float32)  # (N·C, H, d)
    padded[:T] = x
    return np.ascontiguousarray(padded.reshape(N, C, H, d).transpose(2, 0, 1, 3))


def _k_head_of_v_head(n_v_heads: int, n_k_heads: int, head_ratio: int) -> np.ndarray:
    h = np.arange(n_v_heads)
    return h % n_k_heads if head_ratio == 0 else h // head_ratio


def _check_gdn_args(q, k, v, g, beta, state, head_map: str) -> int:
    """Validate shapes/dtypes; return the kernel's head_ratio (0 = modulo map)."""
    if head_map not in HEAD_MAPS:
        raise ValueError(f"head_map must be one of {HEAD_MAPS}, got {head_map!r}")
    T, n_k_heads, dk = q.shape
    _, n_v_heads, dv = v.shape
    if k.shape != q.shape or v.shape[0] != T or g.shape != (T, n_v_heads) or \
            beta.shape != (T, n_v_heads) or state.shape != (n_v_heads, dk, dv):
        raise ValueError(f"gated delta shapes disagree: q {q.shape}, k {k.shape}, v {v.shape}, "
                         f"g {g.shape}, beta {beta.shape}, state {state.shape}")
    if n_v_heads % n_k_heads:
        raise ValueError(f"H_v={n_v_heads} is not a multiple of H_k={n_k_heads}")
    _require_f32_contiguous(q=q, k=k, v=v, g=g, beta=beta, state=state)
    return 0 if head_map == "mod" else n_v_heads // n_k_heads


def _require_f32_contiguous(**arrays: np.ndarray) -> None:
    for name, a in arrays.items():
        if a.dtype != np.float32 or not a.flags.c_contiguous:
            raise ValueError(f"{name} must be a C-contiguous float32 array "
                             f"(got {a.dtype}, contiguous={a.flags.c_contiguous})")
