"""MoE on the GPU: router softmax + top-k.

Expert GEMVs themselves are quant_gemv.gemv with slot_mat = the selected expert ids (flattened
(n_tokens, k)) and slot_x = the token of each slot, so only the chosen experts' rows are read; the
weighted combine of their outputs is fused into the next RMSNorm (norm.moe_add_rms_norm).
"""

from __future__ import annotations

import math

import numpy as np
from numba import cuda, float32, int32

from sparkinfer_cli.kernels.cuda.launch import cdiv, check_array
from sparkinfer_cli.kernels.cuda.warp import shfl_xor, warp_max, warp_sum

WARPS_PER_BLOCK = 4
MAX_PER_LANE = 16  # router logits a lane holds: up to 512 experts
MIN_WEIGHT_SUM = 6.103515625e-5  # llama.cpp clamps the renormalising sum to the smallest f16 normal


@cuda.jit(device=True, inline=True)
def _ranks_before(v, i, best_v, best_i):
    """Order of the top-k scan: larger value first, then lower index."""
    return v > best_v or (v == best_v and i < best_i)


@cuda.jit
def _router_topk_kernel(logits, n_experts, k, ids, weights):
    # a warp per token; lane l holds experts l, l + 32, ... in registers: softmax over all experts,
    # then k rounds of "best not yet taken" (a warp argmax), the winner's lane marking it taken
    lane = cuda.threadIdx.x % 32
    tok = cuda.blockIdx.x * WARPS_PER_BLOCK + cuda.threadIdx.x // 32
    if tok >= logits.size // n_experts:
        return
    row = tok * n_experts
    vals = cuda.local.array(MAX_PER_LANE, float32)  # (n_experts / 32,)
    m = float32(-math.inf)
    for j in range(MAX_PER_LANE):
        e = lane + 32 * j
        vals[j] = logits[row + e] if e < n_experts else float32(-math.inf)
        m = max(m, vals[j])
    m = warp_max(m)
    denom = float32(0.0)
    for j in range(MAX_PER_LANE):
        if lane + 32 * j < n_experts:
            denom += math.exp(vals[j] - m)
    denom = warp_sum(denom)
    taken = int32(0)  # bit j: expert lane + 32j already picked
    picked = float32(0.0)
    my_id, my_p = int32(0), float32(0.0)  # lane r keeps the r-th pick
    for r in range(k):
        best_v, best_i = float32(-math.inf), int32(n_experts)
        for j in range(MAX_PER_LANE):
            e = lane + 32 * j
            if e < n_experts and not (taken >> j) & 1 and _ranks_before(vals[j], e, best_v, best_i):
                best_v, best_i = vals[j], int32(e)
        for offset in (16, 8, 4, 2, 1):
            ov = shfl_xor(best_v, offset)
            oi = shfl_xor(best_i, offset)
            if _ranks_before(ov, oi, best_v, best_i):
                best_v, best_i = ov, oi
        if best_i % 32 == lane:
            taken |= int32(1) << (best_i // 32)
        p = math.exp(best_v - m) / denom
        picked += p
        if lane == r:
            my_id, my_p = best_i, p
    if lane < k:
        ids[tok * k + lane] = my_id
        weights[tok * k + lane] = my_p / max(picked, float32(MIN_WEIGHT_SUM))


def router_topk(logits, k: int, ids, weights, stream=0) -> None:
    """logits (n_tokens, n_experts) f32 → ids int32 (n_tokens, k), renormalised weights f32."""
    n_tokens, n_experts = logits.shape
    if not 1 <= k <= min(32, n_experts):
        raise ValueError(f"top-k {k} must be in 1..min(32, n_experts={n_experts})")
    if n_experts > 32 * MAX_PER_LANE:
        raise ValueError(f"router top-k takes at most {32 * MAX_PER_LANE} experts, got {n_experts}")
    check_array("logits", logits, np.float32)
    check_array("ids", ids, np.int32, (n_tokens, k))
    check_array("weights", weights, np.float32, (n_tokens, k))
    _router_topk_kernel[cdiv(n_tokens, WARPS_PER_BLOCK), 32 * WARPS_PER_BLOCK, stream](
        logits.reshape(logits.size), n_experts, k, ids.reshape(ids.size), weights.reshape(ids.size))


def router_topk_reference(logits: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    z = logits.astype(np.float64)
    p = np.exp(z - z.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    ids = np.argsort(-z, axis=1, kind="stable")[:, :k]  # (n_tokens, k), ties → lower index
    w = np.take_along_axis(p, ids, axis=1)
    return ids.astype(np.int32), w / np.maximum(w.sum(axis=1, keepdims=True), MIN_WEIGHT_SUM)
