"""Gated DeltaNet decode on the GPU: causal conv step + SiLU, and the recurrent delta-rule step.

State layout per slot: conv (conv_dim, K-1) float32 (oldest sample first); recurrent
(H_v, dv, dk) float32 = S[h][j][i], i (the k index) contiguous, so a warp owning value column j
reads its dk rows coalesced; grid (H_v, n_seqs, dv / 4), a warp per column (ARCHITECTURES.md §8).
Sequences address their state through
state_slots[seq].
"""

from __future__ import annotations

import functools
import math

import numpy as np
from numba import cuda, float32

from sparkinfer_cli.kernels.cuda.launch import cdiv, check_array
from sparkinfer_cli.kernels.cuda.warp import warp_sum

THREADS = 256
WARPS = 4


@cuda.jit(fastmath=True)
def _conv_silu_kernel(mixed, conv_w, conv_state, state_slots, conv_dim, k_conv, out):
    i = cuda.grid(1)
    if i >= mixed.size:
        return
    seq = i // conv_dim
    c = i - seq * conv_dim
    hist = (state_slots[seq] * conv_dim + c) * (k_conv - 1)
    x = mixed[i]
    acc = conv_w[c * k_conv + k_conv - 1] * x
    for t in range(k_conv - 1):
        acc += conv_w[c * k_conv + t] * conv_state[hist + t]
    for t in range(k_conv - 2):
        conv_state[hist + t] = conv_state[hist + t + 1]
    conv_state[hist + k_conv - 2] = x
    out[i] = acc / (float32(1.0) + math.exp(-acc))


def conv_silu_step(mixed, conv_w, conv_state, state_slots, out, stream=0) -> None:
    """mixed (n_seqs, conv_dim) → out = silu(causal_conv(state ⧺ mixed)); state shifts by one."""
    n_seqs, conv_dim = mixed.shape
    k_conv = conv_w.shape[1]
    check_array("conv_w", conv_w, np.float32, (conv_dim, k_conv))
    check_array("out", out, np.float32, mixed.shape)
    check_array("state_slots", state_slots, np.int32, (n_seqs,))
    if conv_state.shape[1:] != (conv_dim, k_conv - 1):
        raise ValueError(f"conv_state {conv_state.shape} is not (slots, {conv_dim}, {k_conv - 1})")
    _conv_silu_kernel[cdiv(mixed.size, THREADS), THREADS, stream](
        mixed.reshape(mixed.size), conv_w.reshape(conv_w.size), conv_state.reshape(conv_state.size),
        state_slots, conv_dim, k_conv, out.reshape(out.size))


@functools.cache
def _delta_kernel(dk: int, dv: int):
    per_lane = dk // 32

    @cuda.jit(fastmath=True)
    def delta_step(u, a, b, ssm_a, dt_bias, state, state_slots, n_k_heads, head_map_mod, eps, out):
        # u = conv output (n_seqs, q | k | v); a, b: (n_seqs, H_v) pre-activations of decay and beta
        h, seq = cuda.blockIdx.x, cuda.blockIdx.y
        n_v_heads = cuda.gridDim.x
        warp, lane = cuda.threadIdx.x // 32, cuda.threadIdx.x % 32
        kh = h % n_k_heads if head_map_mod else h // (n_v_heads // n_k_heads)
        key_dim = n_k_heads * dk
        row = seq * (2 * key_dim + n_v_heads * dv)
        qv = cuda.local.array(per_lane, float32)  # (dk / 32,) this lane's rows i = lane + 32e
        kv = cuda.local.array(per_lane, float32)
        sq, sk = float32(0.0), float32(0.0)
        for e in range(per_lane):
            qv[e] = u[row + kh * dk + lane + 32 * e]
            kv[e] = u[row + key_dim + kh * dk + lane + 32 * e]
            sq += qv[e] * qv[e]
            sk += kv[e] * kv[e]
        q_scale = float32(1.0) / math.sqrt((warp_sum(sq) + eps) * float32(dk))
        k_scale = float32(1.0) / math.sqrt(warp_sum(sk) + eps)
        t = a[seq * n_v_heads + h] + dt_bias[h]
        softplus = t if t > float32(20.0) else math.log(float32(1.0) + math.exp(t))
        decay = math.exp(ssm_a[h] * softplus)
        beta = float32(1.0) / (float32(1.0) + math.exp(-b[seq * n_v_heads + h]))
        s_base = (state_slots[seq] * n_v_heads + h) * dv * dk
        j = cuda.blockIdx.z * WARPS + warp  # one value column per warp
        if j >= dv:
            return
        col = s_base + j * dk + lane
        proj = float32(0.0)
        for e in range(per_lane):
            proj += state[col + 32 * e] * decay * kv[e]
        delta = beta * (u[row + 2 * key_dim + h * dv + j] - warp_sum(proj) * k_scale)
        o = float32(0.0)
        for e in range(per_lane):
            s_new = state[col + 32 * e] * decay + kv[e] * k_scale * delta
            state[col + 32 * e] = s_new
            o += s_new * qv[e]
        o = warp_sum(o)
        if lane == 0:
            out[(seq * n_v_heads + h) * dv + j] = o * q_scale
    return delta_step


def delta_rule_step(u, a, b, ssm_a, dt_bias, state, state_slots, out, *, n_k_heads: int,
                    head_map_mod: bool, eps: float, stream=0) -> None:
    """One token of the gated delta rule per sequence; state (slots, H_v, dv, dk) updated in place.

    out (n_seqs, H_v, dv) = S_newᵀ q̂ / sqrt(dk), q̂/k̂ L2-normalised (x / sqrt(Σx² + eps)).
    head_map_mod: v-head h reads k-head h % H_k (qwen35*), else h // (H_v / H_k) (qwen3next).
    """
    n_seqs, n_v_heads, dv = out.shape
    dk = state.shape[3]
    if dk % 32 or state.shape[1:3] != (n_v_heads, dv):
        raise ValueError(f"state {state.shape} is not (slots, {n_v_heads}, {dv}, dk % 32 == 0)")
    if u.shape != (n_seqs, 2 * n_k_heads * dk + n_v_heads * dv):
        raise ValueError(f"u {u.shape} is not (n_seqs, 2·H_k·dk + H_v·dv)")
    check_array("a", a, np.float32, (n_seqs, n_v_heads))
    check_array("b", b, np.float32, (n_seqs, n_v_heads))
    _delta_kernel(dk, dv)[(n_v_heads, n_seqs, cdiv(dv, WARPS)), 32 * WARPS, stream](
        u.reshape(u.size), a.reshape(a.size), b.reshape(b.size), ssm_a, dt_bias,
        state.reshape(state.size), state_slots, n_k_heads, head_map_mod, float32(eps),
        out.reshape(out.size))


def delta_rule_step_reference(u, a, b, ssm_a, dt_bias, state, n_k_heads, head_map_mod, eps):
    """float64 numpy twin of delta_rule_step, state (n_seqs, H_v, dv, dk) → (out, new state)."""
    n_seqs, n_v_heads, dv, dk = state.shape
    key_dim = n_k_heads * dk
    s = state.astype(np.float64).copy()
    out = np.zeros((n_seqs, n_v_heads, dv))
    for n in range(n_seqs):
        q = u[n, :key_dim].reshape(n_k_heads, dk).astype(np.float64)
        k = u[n, key_dim:2 * key_dim].reshape(n_k_heads, dk).astype(np.float64)
        v = u[n, 2 * key_dim:].reshape(n_v_heads, dv).astype(np.float64)
        q = q / np.sqrt((q * q).sum(1, keepdims=True) + eps)
        k = k / np.sqrt((k * k).sum(1, keepdims=True) + eps)
        t = a[n].astype(np.float64) + dt_bias
        decay = np.exp(ssm_a * np.where(t > 20, t, np.log1p(np.exp(np.minimum(t, 20)))))
        beta = 1 / (1 + np.exp(-b[n].astype(np.float64)))
        for h in range(n_v_heads):
            kh = h % n_k_heads if head_map_mod else h // (n_v_heads // n_k_heads)
            sh = s[n, h] * decay[h]  # (dv, dk) = S[j][i]
            delta = beta[h] * (v[h] - sh @ k[kh])
            sh += np.outer(delta, k[kh])
            s[n, h] = sh
            out[n, h] = sh @ q[kh] / np.sqrt(dk)
    return out, s


# ------------------------------------------------------------- whole sequences (prefill + decode)
# Sequence s owns rows seq_lo[s] .. seq_lo[s] + seq_n[s] − 1 of the token-major inputs; one launch
# runs its tokens in order with the state held in registers (decode is the case seq_n = 1).
@functools.cache
def _conv_seq_kernel(k_conv: int):
    @cuda.jit(fastmath=True)
    def conv_seq(mixed, conv_w, conv_state, state_slots, seq_lo, seq_n, conv_dim, out):
        i = cuda.grid(1)
        seq = i // conv_dim
        if seq >= seq_n.size or seq_n[seq] == 0:
            return
        c = i - seq * conv_dim
        hist = cuda.local.array(k_conv, float32)  # (K − 1 used,) oldest first
        base = (state_slots[seq] * conv_dim + c) * (k_conv - 1)
        for t in range(k_conv - 1):
            hist[t] = conv_state[base + t]
        for r in range(seq_lo[seq], seq_lo[seq] + seq_n[seq]):
            x = mixed[r * conv_dim + c]
            acc = conv_w[c * k_conv + k_conv - 1] * x
            for t in range(k_conv - 1):
                acc += conv_w[c * k_conv + t] * hist[t]
            for t in range(k_conv - 2):
                hist[t] = hist[t + 1]
            hist[k_conv - 2] = x
            out[r * conv_dim + c] = acc / (float32(1.0) + math.exp(-acc))
        for t in range(k_conv - 1):
            conv_state[base + t] = hist[t]
    return conv_seq


def conv_silu_seq(mixed, conv_w, conv_state, state_slots, seq_lo, seq_n, out, stream=0) -> None:
    """mixed (n_rows, conv_dim) → out = silu(causal conv) per sequence; state advances by seq_n."""
    conv_dim = mixed.shape[1]
    k_conv = conv_w.shape[1]
    n_seqs = seq_n.size
    check_array("conv_w", conv_w, np.float32, (conv_dim, k_conv))
    check_array("out", out, np.float32, mixed.shape)
    for name, arr in (("state_slots", state_slots), ("seq_lo", seq_lo), ("seq_n", seq_n)):
        check_array(name, arr, np.int32, (n_seqs,))
    if k_conv < 2 or conv_state.shape[1:] != (conv_dim, k_conv - 1):
        raise ValueError(f"conv_state {conv_state.shape} is not (slots, {conv_dim}, {k_conv - 1})")
    _conv_seq_kernel(k_conv)[cdiv(n_seqs * conv_dim, THREADS), THREADS, stream](
        mixed.reshape(mixed.size), conv_w.reshape(conv_w.size), conv_state.reshape(conv_state.size),
        state_slots, seq_lo, seq_n, conv_dim, out.reshape(out.size))


@functools.cache
def _delta_seq_kernel(dk: int, dv: int):
    per_lane = dk // 32

    @cuda.jit(fastmath=True)
    def delta_seq(u, a, b, ssm_a, dt_bias, state, state_slots, seq_lo, seq_n, n_k_heads,
                  head_map_mod, eps, out):
        h, seq = cuda.blockIdx.x, cuda.blockIdx.y
        n_v_heads = cuda.gridDim.x
        warp, lane = cuda.threadIdx.x // 32, cuda.threadIdx.x % 32
        j = cuda.blockIdx.z * WARPS + warp  # one value column per warp
        if j >= dv or seq_n[seq] == 0:
            return
        kh = h % n_k_heads if head_map_mod else h // (n_v_heads // n_k_heads)
        key_dim = n_k_heads * dk
        width = 2 * key_dim + n_v_heads * dv
        col = ((state_slots[seq] * n_v_heads + h) * dv + j) * dk + lane
        s = cuda.local.array(per_lane, float32)  # (dk / 32,) S[j][lane + 32e]
        qv = cuda.local.array(per_lane, float32)
        kv = cuda.local.array(per_lane, float32)
        for e in range(per_lane):
            s[e] = state[col + 32 * e]
        for r in range(seq_lo[seq], seq_lo[seq] + seq_n[seq]):
            sq, sk = float32(0.0), float32(0.0)
            for e in range(per_lane):
                qv[e] = u[r * width + kh * dk + lane + 32 * e]
                kv[e] = u[r * width + key_dim + kh * dk + lane + 32 * e]
                sq += qv[e] * qv[e]
                sk += kv[e] * kv[e]
            q_scale = float32(1.0) / math.sqrt((warp_sum(sq) + eps) * float32(dk))
            k_scale = float32(1.0) / math.sqrt(warp_sum(sk) + eps)
            t = a[r * n_v_heads + h] + dt_bias[h]
            softplus = t if t > float32(20.0) else math.log(float32(1.0) + math.exp(t))
            decay = math.exp(ssm_a[h] * softplus)
            beta = float32(1.0) / (float32(1.0) + math.exp(-b[r * n_v_heads + h]))
            proj = float32(0.0)
            for e in range(per_lane):
                s[e] *= decay
                proj += s[e] * kv[e]
            delta = beta * (u[r * width + 2 * key_dim + h * dv + j] - warp_sum(proj) * k_scale)
            o = float32(0.0)
            for e in range(per_lane):
                s[e] += kv[e] * k_scale * delta
                o += s[e] * qv[e]
            o = warp_sum(o)
            if lane == 0:
                out[(r * n_v_heads + h) * dv + j] = o * q_scale
        for e in range(per_lane):
            state[col + 32 * e] = s[e]
    return delta_seq


def delta_rule_seq(u, a, b, ssm_a, dt_bias, state, state_slots, seq_lo, seq_n, out, *,
                   n_k_heads: int, head_map_mod: bool, eps: float, stream=0) -> None:
    """The gated delta rule over each sequence's rows (see delta_rule_step for the math).

    u (n_rows, 2·H_k·dk + H_v·dv), a/b (n_rows, H_v), out (n_rows, H_v, dv); state (slots, H_v,
    dv, dk) of slot state_slots[s] advances over rows seq_lo[s] .. + seq_n[s]."""
    n_rows, n_v_heads, dv = out.shape
    dk = state.shape[3]
    n_seqs = seq_n.size
    if dk % 32 or state.shape[1:3] != (n_v_heads, dv):
        raise ValueError(f"state {state.shape} is not (slots, {n_v_heads}, {dv}, dk % 32 == 0)")
    if u.shape != (n_rows, 2 * n_k_heads * dk + n_v_heads * dv):
        raise ValueError(f"u {u.shape} is not (n_rows, 2·H_k·dk + H_v·dv)")
    check_array("a", a, np.float32, (n_rows, n_v_heads))
    check_array("b", b, np.float32, (n_rows, n_v_heads))
    _delta_seq_kernel(dk, dv)[(n_v_heads, n_seqs, cdiv(dv, WARPS)), 32 * WARPS, stream](
        u.reshape(u.size), a.reshape(a.size), b.reshape(b.size), ssm_a, dt_bias,
        state.reshape(state.size), state_slots, seq_lo, seq_n, n_k_heads, head_map_mod,
        float32(eps), out.reshape(out.size))
