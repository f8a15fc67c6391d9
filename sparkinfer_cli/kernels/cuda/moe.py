"""MoE on the GPU: router softmax + top-k.

Expert GEMVs themselves are quant_gemv.gemv with slot_mat = the selected expert ids (flattened
(n_tokens, k)) and slot_x = the token of each slot, so only the chosen experts' rows are read; the
weighted combine of their outputs is fused into the next RMSNorm (norm.moe_add_rms_norm).
"""

from __future__ import annotations

import math

import numpy as np
from numba import cuda, float32

from sparkinfer_cli.kernels.cuda.intrinsics import IS_SIMULATOR
from sparkinfer_cli.kernels.cuda.launch import check_array
from sparkinfer_cli.kernels.cuda.warp import block_max, block_sum

MAX_EXPERTS = 1024  # router logits held in shared memory
THREADS = 32 if IS_SIMULATOR else 256
MIN_WEIGHT_SUM = 6.103515625e-5  # llama.cpp clamps the renormalising sum to the smallest f16 normal


@cuda.jit(device=True, inline=True)
def _ranks_before(v, i, best_v, best_i):
    """Order of the top-k: larger value first, then lower index."""
    return v > best_v or (v == best_v and i < best_i)


@cuda.jit
def _router_topk_kernel(logits, n_experts, k, ids, weights):
    # a block per token, thread t for experts t, t + blockDim, ...: softmax over all experts, and
    # each expert's rank = how many experts order before it (all in parallel, no k rounds);
    # experts of rank < k are the picks, written at their rank.
    tok = cuda.blockIdx.x
    tid, n_threads = cuda.threadIdx.x, cuda.blockDim.x
    vals = cuda.shared.array(MAX_EXPERTS, float32)
    scratch = cuda.shared.array(33, float32)
    row = tok * n_experts
    m = float32(-math.inf)
    for e in range(tid, n_experts, n_threads):
        vals[e] = logits[row + e]
        m = max(m, vals[e])
    m = block_max(m, scratch)  # its barriers also publish vals
    denom = float32(0.0)
    for e in range(tid, n_experts, n_threads):
        denom += math.exp(vals[e] - m)
    denom = block_sum(denom, scratch)
    picked = float32(0.0)
    for e in range(tid, n_experts, n_threads):
        v, rank = vals[e], 0
        for other in range(n_experts):
            rank += _ranks_before(vals[other], other, v, e)
        if rank < k:
            picked += math.exp(v - m) / denom
            ids[tok * k + rank] = e
            weights[tok * k + rank] = math.exp(v - m) / denom
    picked = block_sum(picked, scratch)
    for r in range(tid, k, n_threads):  # renormalise over the picks
        weights[tok * k + r] /= max(picked, float32(MIN_WEIGHT_SUM))


def router_topk(logits, k: int, ids, weights, stream=0) -> None:
    """logits (n_tokens, n_experts) f32 → ids int32 (n_tokens, k), renormalised weights f32."""
    n_tokens, n_experts = logits.shape
    if not 1 <= k <= min(32, n_experts):
        raise ValueError(f"top-k {k} must be in 1..min(32, n_experts={n_experts})")
    if n_experts > MAX_EXPERTS:
        raise ValueError(f"router top-k takes at most {MAX_EXPERTS} experts, got {n_experts}")
    check_array("logits", logits, np.float32)
    check_array("ids", ids, np.int32, (n_tokens, k))
    check_array("weights", weights, np.float32, (n_tokens, k))
    _router_topk_kernel[n_tokens, THREADS, stream](
        logits.reshape(logits.size), n_experts, k, ids.reshape(ids.size), weights.reshape(ids.size))


def router_topk_reference(logits: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    z = logits.astype(np.float64)
    p = np.exp(z - z.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    ids = np.argsort(-z, axis=1, kind="stable")[:, :k]  # (n_tokens, k), ties → lower index
    w = np.take_along_axis(p, ids, axis=1)
    return ids.astype(np.int32), w / np.maximum(w.sum(axis=1, keepdims=True), MIN_WEIGHT_SUM)
