"""The attention block's input in one launch: per-head q/k RMSNorm, RoPE, and the K/V cache store.

Unfused this is up to five launches (q norm, k norm, two RoPEs, the store); per decode token and
attention layer each costs more than its work. One block per (token, head) of q, k and v:
q heads are normed and rotated in place; k heads too, then stored in the cache; v heads only
stored. RoPE rotates the first n_rot dims of each head: pair i < n_rot/2 is (i, i + n_rot/2) (NEOX)
or (2i, 2i + 1) (normal), by θ = pos · base^(-2i/n_rot), formed in float64 so positions up to 256k
keep full float32 accuracy in cos/sin.

A decode pass (one query row a sequence) leaves this to the tensor-core decode kernel instead
(attention_mma.py, given the raw projections as NewTokens): its blocks norm and rotate their own
query heads with the device functions below (rope_table, norm_head, rotated), and the block that
holds a row's last key stores that key's K/V: one launch fewer per attention layer.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
from numba import cuda, float32, float64

from sparkinfer_cli.kernels.cuda.attention import flat_scales, kv_kind, store_kv
from sparkinfer_cli.kernels.cuda.intrinsics import chain_start
from sparkinfer_cli.kernels.cuda.jit import device_function, kernel
from sparkinfer_cli.kernels.cuda.launch import check_array
from sparkinfer_cli.kernels.cuda.warp import block_sum, warp_sum


@device_function
def rope_cos_sin(pos, i, n_rot, log_base):
    """cos and sin of pair i's angle θ = pos · base^(-2i/n_rot)."""
    theta = float64(pos) * math.exp(-2.0 * i / n_rot * log_base)
    return float32(math.cos(theta)), float32(math.sin(theta))


@device_function
def rope_table(cs, pos, n_rot, log_base):
    """cs[2i], cs[2i + 1] = cos, sin of pair i's angle at pos, i < n_rot / 2 (the block's
    threads a pair each: the angles every head of a token shares)."""
    for i in range(cuda.threadIdx.x, n_rot // 2, cuda.blockDim.x):
        cs[2 * i], cs[2 * i + 1] = rope_cos_sin(pos, i, n_rot, log_base)


@device_function
def norm_head(x, at, head_dim, norm_w, has_norm, eps, out, out_at):
    """Called by the 32 lanes of a warp: out[out_at + d] = x[at + d]·rms⁻¹·norm_w[d] for the
    head's head_dim (≤ 256) elements (just the copy without a norm); lane l takes d = l + 32e."""
    lane = cuda.threadIdx.x % 32
    vals = cuda.local.array(8, float32)
    squares = float32(0.0)
    for e in range(head_dim // 32):
        vals[e] = x[at + lane + 32 * e]
        squares += vals[e] * vals[e]
    inv = float32(1.0)
    if has_norm:  # warp-uniform
        inv = float32(1.0) / math.sqrt(warp_sum(squares) / float32(head_dim) + eps)
    for e in range(head_dim // 32):
        d = lane + 32 * e
        out[out_at + d] = vals[e] * inv * norm_w[d] if has_norm else vals[e]


@device_function
def rotated(vals, base, d, n_rot, neox, cs):
    """Element d of the head in vals[base:] after RoPE (cs: its token's rope_table)."""
    y = vals[base + d]
    if d >= n_rot:
        return y
    half = n_rot // 2
    pair = (d % half) if neox else d // 2
    first = d < half if neox else d % 2 == 0
    other = vals[base + (d + half) % n_rot] if neox else vals[base + (d ^ 1)]
    c, s = cs[2 * pair], cs[2 * pair + 1]
    return y * c - other * s if first else other * s + y * c


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


def check_input(q, k, v, positions, slot_mapping, n_rot: int, k_cache) -> None:
    """The checks every consumer of (q, k, v) as the projection leaves them makes."""
    n_tokens, _, head_dim = q.shape
    n_kv = k.shape[1]
    check_array("q", q, np.float32)
    for name, arr in (("k", k), ("v", v)):
        check_array(name, arr, np.float32, (n_tokens, n_kv, head_dim))
    check_array("positions", positions, np.int32, (n_tokens,))
    check_array("slot_mapping", slot_mapping, np.int32, (n_tokens,))
    if head_dim % 32 or n_rot % 2 or n_rot > head_dim:
        raise ValueError(f"head_dim {head_dim} (32·n) and n_rot {n_rot} (even, ≤ head_dim)")
    if k_cache.shape[2:] != (n_kv, head_dim):
        raise ValueError(f"cache {k_cache.shape} cannot hold ({n_kv}, {head_dim})")


def prepare_attention_input(q, k, v, q_norm, k_norm, eps: float, positions, n_rot: int,
                            base: float, k_cache, v_cache, slot_mapping, *, neox: bool = True,
                            scales=None, stream=0) -> None:
    """q (n_tokens, n_heads, D), k/v (n_tokens, n_kv, D) f32: q, k ← rope(rms_norm(·)·w) in
    place (no norm when q_norm is None), then k and v → the caches at slot_mapping (int8 caches:
    scales = (k_scales, v_scales), one float32 per 32 values)."""
    n_tokens, n_heads, head_dim = q.shape
    n_kv = k.shape[1]
    check_input(q, k, v, positions, slot_mapping, n_rot, k_cache)
    if head_dim > 1024:
        raise ValueError(f"head_dim {head_dim} > 1024")
    kind = kv_kind(k_cache)
    has_norm = q_norm is not None
    q_norm, k_norm = (q_norm, k_norm) if has_norm else (q.reshape(q.size),) * 2
    _prepare_kernel(head_dim, kind)[(n_tokens, n_heads + 2 * n_kv), head_dim, stream](
        q.reshape(q.size), k.reshape(k.size), v.reshape(v.size), q_norm, k_norm, has_norm,
        float32(eps), positions, n_rot, math.log(base), neox, k_cache.reshape(k_cache.size),
        v_cache.reshape(v_cache.size), *flat_scales(kind, scales, k_cache.size), slot_mapping,
        n_heads, n_kv)


@dataclass(frozen=True)
class NewTokens:
    """The attention input as the QKV projection leaves it, beside its q: k and v (n_rows, n_kv,
    head_dim) f32, the q/k norm weights (None: no norm), RoPE and each row's cache slot."""

    k: object
    v: object
    q_norm: object
    k_norm: object
    eps: float
    positions: object
    n_rot: int
    base: float
    slot_mapping: object
    neox: bool

    def prepare(self, q, k_cache, v_cache, scales, stream) -> None:
        """prepare_attention_input: q and k normed and rotated in place, k and v stored."""
        prepare_attention_input(q, self.k, self.v, self.q_norm, self.k_norm, self.eps,
                                self.positions, self.n_rot, self.base, k_cache, v_cache,
                                self.slot_mapping, neox=self.neox, scales=scales, stream=stream)

    def check(self, q, k_cache) -> None:
        check_input(q, self.k, self.v, self.positions, self.slot_mapping, self.n_rot, k_cache)

    def kernel_args(self) -> tuple:
        """(k, v, q_norm, k_norm, has_norm, eps, positions, n_rot, log_base, neox, slot_mapping)
        as a kernel takes them (flat arrays; without norms the weights are placeholders)."""
        has_norm = self.q_norm is not None
        k, v = self.k.reshape(self.k.size), self.v.reshape(self.v.size)
        q_norm, k_norm = (self.q_norm, self.k_norm) if has_norm else (k, k)
        return (k, v, q_norm, k_norm, has_norm, float32(self.eps), self.positions, self.n_rot,
                math.log(self.base), self.neox, self.slot_mapping)
