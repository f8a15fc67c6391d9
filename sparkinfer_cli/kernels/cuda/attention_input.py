"""The attention block's input in one launch: per-head q/k RMSNorm, RoPE, and the K/V cache store.

Unfused this is up to five launches (q norm, k norm, two RoPEs, the store); per decode token and
attention layer each costs more than its work. One block per (token, head) of q, k and v:
q heads are normed and rotated in place; k heads too, then stored in the cache; v heads only
stored. RoPE rotates the first n_rot dims of each head: pair i < n_rot/2 is (i, i + n_rot/2) (NEOX)
or (2i, 2i + 1) (normal), by θ = pos · base^(-2i/n_rot), formed in float64 so positions up to 256k
keep full float32 accuracy in cos/sin.
"""

from __future__ import annotations

import functools
import math

import numpy as np
from numba import cuda, float32, float64

from sparkinfer_cli.kernels.cuda.attention import flat_scales, kv_kind, store_kv
from sparkinfer_cli.kernels.cuda.runtime.intrinsics import chain_start
from sparkinfer_cli.kernels.cuda.runtime.jit import device_function, kernel
from sparkinfer_cli.kernels.cuda.runtime.launch import check_array
from sparkinfer_cli.kernels.cuda.runtime.warp import block_sum


@device_function
def rope_cos_sin(pos, i, n_rot, log_base):
    """cos and sin of pair i's angle θ = pos · base^(-2i/n_rot)."""
    theta = float64(pos) * math.exp(-2.0 * i / n_rot * log_base)
    return float32(math.cos(theta)), float32(math.sin(theta))


@functools.cache
def _prepare_kernel(head_dim: int, kind: int):
    @kernel(fastmath=True)
    def prepare(q, k, v, q_norm, k_norm, has_norm, eps, positions, n_rot, log_base, neox,
                k_cache, v_cache, k_scales, v_scales, slot_mapping, n_heads, n_kv):
        chain_start()
        # grid (n_tokens, n_heads + 2·n_kv), block head_dim threads: thread i owns element i
        tok, head = cuda.blockIdx.x, cuda.blockIdx.y
        i = cuda.threadIdx.x
        vals = cuda.shared.array(head_dim, float32)
        scratch = cuda.shared.array(33, float32)
        is_q, is_v = head < n_heads, head >= n_heads + n_kv
        if is_v:
            at = (tok * n_kv + head - n_heads - n_kv) * head_dim + i
            dst = slot_mapping[tok] * n_kv * head_dim + at - tok * n_kv * head_dim
            store_kv(v_cache, v_scales, dst, v[at], kind)
            return
        x = q if is_q else k
        at = ((tok * n_heads + head) if is_q else (tok * n_kv + head - n_heads)) * head_dim + i
        # every global load up front, so their latencies overlap instead of following the sum
        y = x[at]
        norm_w = (q_norm[i] if is_q else k_norm[i]) if has_norm else float32(1.0)
        pos, slot = positions[tok], slot_mapping[tok]
        if has_norm:
            inv = float32(1.0) / math.sqrt(block_sum(y * y, scratch) / float32(head_dim) + eps)
            y = y * inv * norm_w
        vals[i] = y
        cuda.syncthreads()
        half = n_rot // 2
        if i < n_rot:  # element i pairs with i ± half (NEOX) or i ^ 1 (normal)
            pair = (i % half) if neox else i // 2
            c, s = rope_cos_sin(pos, pair, n_rot, log_base)
            first = i < half if neox else i % 2 == 0
            other = vals[(i + half) % n_rot] if neox else vals[i ^ 1]
            y = y * c - other * s if first else other * s + y * c
        x[at] = y
        if not is_q:
            dst = slot * n_kv * head_dim + at - tok * n_kv * head_dim
            store_kv(k_cache, k_scales, dst, y, kind)
    return prepare


def prepare_attention_input(q, k, v, q_norm, k_norm, eps: float, positions, n_rot: int,
                            base: float, k_cache, v_cache, slot_mapping, *, neox: bool = True,
                            scales=None, stream=0) -> None:
    """q (n_tokens, n_heads, D), k/v (n_tokens, n_kv, D) f32: q, k ← rope(rms_norm(·)·w) in
    place (no norm when q_norm is None), then k and v → the caches at slot_mapping (int8 caches:
    scales = (k_scales, v_scales), one float32 per 32 values)."""
    n_tokens, n_heads, head_dim = q.shape
    n_kv = k.shape[1]
    check_array("q", q, np.float32)
    for name, arr in (("k", k), ("v", v)):
        check_array(name, arr, np.float32, (n_tokens, n_kv, head_dim))
    check_array("positions", positions, np.int32, (n_tokens,))
    check_array("slot_mapping", slot_mapping, np.int32, (n_tokens,))
    if head_dim % 32 or head_dim > 1024 or n_rot % 2 or n_rot > head_dim:
        raise ValueError(f"head_dim {head_dim} (32·n ≤ 1024) and n_rot {n_rot} (even, ≤ head_dim)")
    kind = kv_kind(k_cache)
    if k_cache.shape[2:] != (n_kv, head_dim):
        raise ValueError(f"cache {k_cache.shape} cannot hold ({n_kv}, {head_dim})")
    has_norm = q_norm is not None
    q_norm, k_norm = (q_norm, k_norm) if has_norm else (q.reshape(q.size),) * 2
    _prepare_kernel(head_dim, kind)[(n_tokens, n_heads + 2 * n_kv), head_dim, stream](
        q.reshape(q.size), k.reshape(k.size), v.reshape(v.size), q_norm, k_norm, has_norm,
        float32(eps), positions, n_rot, math.log(base), neox, k_cache.reshape(k_cache.size),
        v_cache.reshape(v_cache.size), *flat_scales(kind, scales, k_cache.size), slot_mapping,
        n_heads, n_kv)
