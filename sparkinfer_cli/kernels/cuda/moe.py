"""MoE on the GPU: router softmax + top-k.

Expert GEMVs themselves are quant_gemv.gemv with slot_mat = the selected expert ids (flattened
(n_tokens, k)) and slot_x = the token of each slot, so only the chosen experts' rows are read; the
weighted combine of their outputs is fused into the next RMSNorm (norm.moe_add_rms_norm).
"""

from __future__ import annotations

import functools
import math

import numpy as np
from numba import cuda, float32, int32

from sparkinfer_cli.kernels.cuda.runtime.intrinsics import chain_start
from sparkinfer_cli.kernels.cuda.runtime.jit import device_function, kernel
from sparkinfer_cli.kernels.cuda.runtime.launch import cdiv, check_array, next_pow2
from sparkinfer_cli.kernels.cuda.runtime.warp import WARP_SIZE, shfl_xor, warp_max, warp_sum

MAX_EXPERTS = 1024  # experts a router may have (a warp's lanes hold 32 logits each at most)
TOKENS_A_BLOCK = 4  # a warp per token
MIN_WEIGHT_SUM = 6.103515625e-5  # llama.cpp clamps the renormalising sum to the smallest f16 normal
_DEAD = float32(-3.0e38)  # a logit past n_experts or already picked (finite: fast math)


@functools.cache
def _router_topk_kernel(per_lane: int):
    """per_lane: logits a lane holds (experts l, l + 32, ...), a compile-time constant so they stay
    in registers."""

    @kernel(fastmath=True)
    def router_topk(logits, n_tokens, n_experts, k, ids, weights):
        chain_start()
        # a warp per token: softmax over all experts (max and sum by shuffles), then k rounds of
        # a warp argmax (larger logit, ties → lower id), each pick's logit dropped after its
        # round; lane r keeps pick r and writes it renormalised: p / Σ_picks p
        lane = cuda.threadIdx.x % WARP_SIZE
        tok = cuda.blockIdx.x * TOKENS_A_BLOCK + cuda.threadIdx.x // WARP_SIZE
        if tok >= n_tokens:
            return
        vals = cuda.local.array(per_lane, float32)
        for i in range(per_lane):
            e = lane + WARP_SIZE * i
            v = logits[tok * n_experts + min(e, n_experts - 1)]
            vals[i] = v if e < n_experts else _DEAD
        m = _DEAD
        for i in range(per_lane):
            m = max(m, vals[i])
        m = warp_max(m)
        denom = float32(0.0)
        for i in range(per_lane):
            if lane + WARP_SIZE * i < n_experts:
                denom += math.exp(vals[i] - m)
        denom = warp_sum(denom)
        total, mine_p, mine_e = float32(0.0), float32(0.0), int32(0)
        for r in range(k):
            best_v, best_e = _warp_argmax(vals, lane, per_lane)
            p = math.exp(best_v - m)
            total += p
            if lane == r:
                mine_p, mine_e = p, best_e
            for i in range(per_lane):  # drop the pick (static indices: vals stays in registers)
                if lane + WARP_SIZE * i == best_e:
                    vals[i] = _DEAD
        if lane < k:
            ids[tok * k + lane] = mine_e
            weights[tok * k + lane] = (mine_p / denom) / max(total / denom,
                                                             float32(MIN_WEIGHT_SUM))
    return router_topk


@device_function
def _warp_argmax(vals, lane, per_lane):
    """(logit, expert) of the warp's largest logit, ties → lower expert id, on every lane."""
    best_v, best_e = _DEAD, int32(MAX_EXPERTS)
    for i in range(per_lane):  # a lane's experts ascend: strict > keeps the lowest of ties
        if vals[i] > best_v:
            best_v, best_e = vals[i], int32(lane + WARP_SIZE * i)
    for offset in (16, 8, 4, 2, 1):
        other_v = shfl_xor(best_v, offset)
        other_e = shfl_xor(best_e, offset)
        if other_v > best_v or (other_v == best_v and other_e < best_e):
            best_v, best_e = other_v, other_e
    return best_v, best_e


def router_topk(logits, k: int, ids, weights, stream=0) -> None:
    """logits (n_tokens, n_experts) f32 → ids int32 (n_tokens, k), renormalised weights f32."""
    n_tokens, n_experts = logits.shape
    if not 1 <= k <= min(WARP_SIZE, n_experts):
        raise ValueError(f"top-k {k} must be in 1..min(32, n_experts={n_experts})")
    if n_experts > MAX_EXPERTS:
        raise ValueError(f"router top-k takes at most {MAX_EXPERTS} experts, got {n_experts}")
    check_array("logits", logits, np.float32)
    check_array("ids", ids, np.int32, (n_tokens, k))
    check_array("weights", weights, np.float32, (n_tokens, k))
    per_lane = next_pow2(cdiv(n_experts, WARP_SIZE))  # powers of two: few distinct kernels
    _router_topk_kernel(per_lane)[cdiv(n_tokens, TOKENS_A_BLOCK), TOKENS_A_BLOCK * WARP_SIZE,
                                  stream](logits.reshape(logits.size), n_tokens, n_experts, k,
                                          ids.reshape(ids.size), weights.reshape(ids.size))


def router_topk_reference(logits: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    z = logits.astype(np.float64)
    p = np.exp(z - z.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    ids = np.argsort(-z, axis=1, kind="stable")[:, :k]  # (n_tokens, k), ties → lower index
    w = np.take_along_axis(p, ids, axis=1)
    return ids.astype(np.int32), w / np.maximum(w.sum(axis=1, keepdims=True), MIN_WEIGHT_SUM)
