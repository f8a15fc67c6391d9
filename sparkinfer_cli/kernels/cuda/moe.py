"""MoE on the GPU: router softmax + top-k, and the weighted combine of the chosen experts' outputs.

Expert GEMVs themselves are quant_gemv.gemv with slot_mat = the selected expert ids (flattened
(n_tokens, k)) and slot_x = the token of each slot, so only the chosen experts' rows are read.
"""

from __future__ import annotations

import math

import numpy as np
from numba import cuda, float32, int32

from sparkinfer_cli.kernels.cuda.launch import cdiv, check_array
from sparkinfer_cli.kernels.cuda.warp import shfl_xor, warp_max, warp_sum

WARPS_PER_BLOCK = 4
MIN_WEIGHT_SUM = 6.103515625e-5  # llama.cpp clamps the renormalising sum to the smallest f16 normal
THREADS = 256


@cuda.jit(device=True, inline=True)
def _ranks_before(v, i, best_v, best_i):
    """Order of the top-k scan: larger value first, then lower index."""
    return v > best_v or (v == best_v and i < best_i)


@cuda.jit
def _router_topk_kernel(logits, n_experts, k, ids, weights):
    # a warp per token: softmax over all experts, then k rounds of "best below the previous pick"
    lane = cuda.threadIdx.x % 32
    tok = cuda.blockIdx.x * WARPS_PER_BLOCK + cuda.threadIdx.x // 32
    if tok >= logits.size // n_experts:
        return
    row = tok * n_experts
    m = float32(-math.inf)
    for e in range(lane, n_experts, 32):
        m = max(m, logits[row + e])
    m = warp_max(m)
    denom = float32(0.0)
    for e in range(lane, n_experts, 32):
        denom += math.exp(logits[row + e] - m)
    denom = warp_sum(denom)
    prev_v, prev_i = float32(math.inf), int32(-1)
    picked = float32(0.0)
    my_id, my_p = int32(0), float32(0.0)  # lane r keeps the r-th pick
    for r in range(k):
        best_v, best_i = float32(-math.inf), int32(n_experts)
        for e in range(lane, n_experts, 32):
            v = logits[row + e]
            if _ranks_before(prev_v, prev_i, v, e) and _ranks_before(v, e, best_v, best_i):
                best_v, best_i = v, int32(e)
        for offset in (16, 8, 4, 2, 1):
            ov = shfl_xor(best_v, offset)
            oi = shfl_xor(best_i, offset)
            if _ranks_before(ov, oi, best_v, best_i):
                best_v, best_i = ov, oi
        p = math.exp(best_v - m) / denom
        picked += p
        if lane == r:
            my_id, my_p = best_i, p
        prev_v, prev_i = best_v, best_i
    if lane < k:
        ids[tok * k + lane] = my_id
        weights[tok * k + lane] = my_p / max(picked, float32(MIN_WEIGHT_SUM))


@cuda.jit(fastmath=True)
def _combine_kernel(expert_out, weights, k, d, out, accumulate):
    # out[t, j] (+)= Σ_r weights[t, r] · expert_out[t·k + r, j]
    i = cuda.grid(1)
    if i >= out.size:
        return
    t = i // d
    j = i - t * d
    acc = float32(0.0)
    for r in range(k):
        acc += weights[t * k + r] * expert_out[(t * k + r) * d + j]
    out[i] = out[i] + acc if accumulate else acc


@cuda.jit(fastmath=True)
def _add_gated_kernel(out, shared, gate_logit, d):
    # out[t, j] += sigmoid(gate_logit[t]) · shared[t, j]  (the shared expert of Qwen3-Next/3.5)
    i = cuda.grid(1)
    if i < out.size:
        out[i] += shared[i] / (float32(1.0) + math.exp(-gate_logit[i // d]))


def router_topk(logits, k: int, ids, weights, stream=0) -> None:
    """logits (n_tokens, n_experts) f32 → ids int32 (n_tokens, k), renormalised weights f32."""
    n_tokens, n_experts = logits.shape
    if not 1 <= k <= min(32, n_experts):
        raise ValueError(f"top-k {k} must be in 1..min(32, n_experts={n_experts})")
    check_array("logits", logits, np.float32)
    check_array("ids", ids, np.int32, (n_tokens, k))
    check_array("weights", weights, np.float32, (n_tokens, k))
    _router_topk_kernel[cdiv(n_tokens, WARPS_PER_BLOCK), 32 * WARPS_PER_BLOCK, stream](
        logits.reshape(logits.size), n_experts, k, ids.reshape(ids.size), weights.reshape(ids.size))


def moe_combine(expert_out, weights, out, *, accumulate: bool = False, stream=0) -> None:
    """expert_out (n_tokens·k, d), weights (n_tokens, k) → out (n_tokens, d) (+= if accumulate)."""
    n_tokens, k = weights.shape
    d = tuple(out.shape)[-1]
    check_array("out", out, np.float32, (n_tokens, d))
    check_array("expert_out", expert_out, np.float32)
    if expert_out.size != n_tokens * k * d:
        raise ValueError(f"expert_out has {expert_out.size} values, expected {n_tokens * k * d}")
    _combine_kernel[cdiv(out.size, THREADS), THREADS, stream](
        expert_out.reshape(expert_out.size), weights.reshape(weights.size), k, d,
        out.reshape(out.size), accumulate)


def add_gated(out, shared, gate_logit, stream=0) -> None:
    """out (n_tokens, d) += sigmoid(gate_logit (n_tokens,)) · shared (n_tokens, d)."""
    check_array("shared", shared, np.float32, out.shape)
    _add_gated_kernel[cdiv(out.size, THREADS), THREADS, stream](
        out.reshape(out.size), shared.reshape(shared.size), gate_logit.reshape(gate_logit.size),
        tuple(out.shape)[-1])


def router_topk_reference(logits: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    z = logits.astype(np.float64)
    p = np.exp(z - z.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    ids = np.argsort(-z, axis=1, kind="stable")[:, :k]  # (n_tokens, k), ties → lower index
    w = np.take_along_axis(p, ids, axis=1)
    return ids.astype(np.int32), w / np.maximum(w.sum(axis=1, keepdims=True), MIN_WEIGHT_SUM)
