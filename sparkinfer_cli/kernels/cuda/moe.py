"""MoE on the GPU: router softmax + top-k.

Expert GEMVs themselves are quant_gemv.gemv with slot_mat = the selected expert ids (flattened
(n_tokens, k)) and slot_x = the token of each slot, so only the chosen experts' rows are read; the
weighted combine of their outputs is fused into the next RMSNorm (norm.moe_add_rms_norm).
"""

from __future__ import annotations

import math

import numpy as np
from numba import cuda, float32, int32, uint32

from sparkinfer_cli.kernels.cuda.intrinsics import IS_SIMULATOR
from sparkinfer_cli.kernels.cuda.jit import device_function
from sparkinfer_cli.kernels.cuda.launch import cdiv, check_array
from sparkinfer_cli.kernels.cuda.warp import WARP_SIZE, block_max, block_sum, shfl_xor

MAX_EXPERTS = 1024  # router logits held in shared memory
# a token's block: up to 32 threads count each expert's rank together (the simulator runs a
# Python thread per CUDA thread: fewer there)
MAX_THREADS = 256 if IS_SIMULATOR else 1024
MIN_WEIGHT_SUM = 6.103515625e-5  # llama.cpp clamps the renormalising sum to the smallest f16 normal


@device_function
def _orders_before(o, j, v, e):
    """1 if expert j with logit o orders before expert e with logit v (larger, ties → lower id)."""
    return uint32(o > v) + uint32(o == v) * uint32(j < e)


@cuda.jit(fastmath=True)
def _router_topk_kernel(logits, n_experts, k, parts, ids, weights):
    # a block per token, `parts` neighbouring threads per expert slot (blockDim / parts slots,
    # ≥ n_experts): softmax over all experts, and each expert's rank = how many experts order
    # before it, each of its threads counting over its 1/parts of the logits in shared memory,
    # 8 per round written out so the shared loads overlap, the counts then summed by shuffles
    # (slots past the experts hold -inf, which orders after every logit); ranks < k are the
    # picks, written at their rank. Unsigned indices keep the counting loop free of
    # negative-index wraparound code.
    tok, e, part = cuda.blockIdx.x, cuda.threadIdx.x // parts, cuda.threadIdx.x % parts
    eu = uint32(e)
    live = e < n_experts
    vals = cuda.shared.array(MAX_EXPERTS, float32)
    scratch = cuda.shared.array(33, float32)
    v = logits[tok * n_experts + min(e, n_experts - 1)]  # idle threads repeat the last logit
    if part == 0:
        vals[e] = v if live else float32(-math.inf)
    m = block_max(v, scratch)  # its barriers also publish vals
    p = math.exp(v - m) if live else float32(0.0)
    denom = block_sum(p if part == 0 else float32(0.0), scratch)
    span = cuda.blockDim.x // parts // parts  # slots a thread counts over: a multiple of 8
    rank = uint32(0)
    for j0 in range(part * span, (part + 1) * span, 8):
        j = uint32(j0)
        rank += (_orders_before(vals[j], j, v, eu) + _orders_before(vals[j + 1], j + 1, v, eu)
                 + _orders_before(vals[j + 2], j + 2, v, eu)
                 + _orders_before(vals[j + 3], j + 3, v, eu)
                 + _orders_before(vals[j + 4], j + 4, v, eu)
                 + _orders_before(vals[j + 5], j + 5, v, eu)
                 + _orders_before(vals[j + 6], j + 6, v, eu)
                 + _orders_before(vals[j + 7], j + 7, v, eu))
    for offset in (16, 8, 4, 2, 1):  # the expert's parts are neighbouring lanes of one warp
        other = shfl_xor(int32(rank), offset)
        if offset < parts:
            rank += uint32(other)
    picked = live and rank < k
    total = block_sum(p if picked and part == 0 else float32(0.0), scratch)
    if picked and part == 0:  # renormalised: p / Σ_picks p, the sum clamped as llama.cpp does
        ids[tok * k + rank] = e
        weights[tok * k + rank] = (p / denom) / max(total / denom, float32(MIN_WEIGHT_SUM))


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
    parts, slots = _rank_parts(n_experts)
    _router_topk_kernel[n_tokens, slots * parts, stream](
        logits.reshape(logits.size), n_experts, k, parts, ids.reshape(ids.size),
        weights.reshape(ids.size))


def _rank_parts(n_experts: int) -> tuple[int, int]:
    """(threads per expert, expert slots) of the top-k block: the most threads (≤ WARP_SIZE, a
    power of two) that fit MAX_THREADS, with slots a multiple of 8 per thread (the counting
    loop's round) and the block whole warps. 256 experts: 4 threads each, 64 logits a thread."""
    parts = WARP_SIZE
    while True:
        unit = max(8 * parts, WARP_SIZE // parts)
        slots = cdiv(n_experts, unit) * unit
        if slots * parts <= MAX_THREADS or parts == 1:
            return parts, slots
        parts //= 2


def router_topk_reference(logits: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    z = logits.astype(np.float64)
    p = np.exp(z - z.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    ids = np.argsort(-z, axis=1, kind="stable")[:, :k]  # (n_tokens, k), ties → lower index
    w = np.take_along_axis(p, ids, axis=1)
    return ids.astype(np.int32), w / np.maximum(w.sum(axis=1, keepdims=True), MIN_WEIGHT_SUM)
