"""Attention over a paged KV cache: split-K decode (one query per sequence); attention_input.py
stores new K/V.

Cache layout: (num_blocks, block_size, n_kv_heads, head_dim) float16 (float32 for exact runs; int8
with one float32 scale per 32 values, llama.cpp's q8_0 scheme, under SPARKINFER_KV_INT8); token
p of a sequence lives in block block_table[seq, p // block_size] at offset p % block_size. Decode
runs in two kernels so the graph shape never depends on the context length (a prefill runs as one
query row per token, row_seq naming each row's sequence and seq_lens = position + 1):
  1. grid (n_heads, n_seqs, n_splits): each block scans keys [split·split_len, +split_len) of its
     sequence, CHUNK keys at a time (one per thread: every key's K row is read in parallel) with
     an online softmax, and writes a partial (max, sum, unnormalised out);
  2. grid (n_heads, n_seqs): merge the partials of all splits (empty splits carry max = -inf).
"""

from __future__ import annotations

import functools
import math

import numpy as np
from numba import cuda, float32, int8, int32, int64
from numba.cuda.types import float16

from sparkinfer_cli.kernels.cuda.intrinsics import (
    bits_to_f32,
    f16_bits_to_f32,
    ld_u32,
    ld_v2_u32,
    ld_v4_u32,
)
from sparkinfer_cli.kernels.cuda.launch import cdiv, check_array
from sparkinfer_cli.kernels.cuda.warp import block_max, block_sum, warp_max

CHUNK = 128  # keys scored at once: one per thread
KV_F32, KV_F16, KV_I8 = 0, 1, 2  # cache element types
WARPS = CHUNK // 32


@cuda.jit(device=True, inline=True)
def kv_value(cache, scales, idx, kind):
    """Element idx of a K or V cache as float32 (KV_I8: times its 32-block's scale)."""
    if kind == KV_I8:
        return float32(cache[idx]) * scales[idx // 32]
    return float32(cache[idx])


@cuda.jit(device=True, inline=True)
def store_kv(cache, scales, idx, y, kind):
    """cache[idx] = y in the cache's type. KV_I8: int8 per 32-element block with d = max|y|/127
    (q8_0's scheme); the 32 lanes of the warp that holds the block call it together."""
    if kind == KV_I8:
        amax = warp_max(abs(y))
        d = amax / float32(127.0)
        cache[idx] = int8(math.floor(y / d + float32(0.5)) if amax > 0 else 0)
        if idx % 32 == 0:
            scales[idx // 32] = d
    elif kind == KV_F16:
        cache[idx] = float16(y)
    else:
        cache[idx] = y


def flat_scales(kind: int, scales, cache_size: int) -> tuple:
    """The (k, v) scale arrays a kernel takes: the int8 caches' own, else placeholders."""
    if kind != KV_I8:
        return _placeholder(), _placeholder()
    if scales is None or any(s.size * 32 != cache_size for s in scales):
        raise ValueError("an int8 KV cache needs (k_scales, v_scales) with one per 32 values")
    return tuple(s.reshape(s.size) for s in scales)


@functools.cache
def _placeholder():
    return cuda.to_device(np.zeros(1, np.float32))  # (1,)


def kv_kind(cache) -> int:
    kinds = {np.dtype(np.float32): KV_F32, np.dtype(np.float16): KV_F16, np.dtype(np.int8): KV_I8}
    if np.dtype(cache.dtype) not in kinds:
        raise ValueError(f"KV cache of {cache.dtype}: float32, float16 or int8 expected")
    return kinds[np.dtype(cache.dtype)]


@cuda.jit(device=True, inline=True)
def _dot16(q_sh, d, cache, byte_off, kind):
    """Σ q_sh[d + i]·K_i over the 8 halves / 4 floats of the 16 bytes at byte_off."""
    w = ld_v4_u32(cache, byte_off)
    s = float32(0.0)
    for j in range(4):
        if kind == KV_F16:
            s += q_sh[d + 2 * j] * f16_bits_to_f32(w[j] & 0xFFFF)
            s += q_sh[d + 2 * j + 1] * f16_bits_to_f32(w[j] >> 16)
        else:
            s += q_sh[d + j] * bits_to_f32(w[j])
    return s


@cuda.jit(device=True, inline=True)
def _dot_q(q_sh, cache, scales, off, head_dim, kind):
    """Σ_d q_sh[d]·K[off + d]. f16/f32 rows: four 16-byte loads per round, written out so all
    four are in flight at once (the compiler does not unroll this loop by itself)."""
    s = float32(0.0)
    if kind == KV_I8:
        for b in range(0, head_dim, 32):
            part = float32(0.0)
            for d in range(b, b + 32):
                part += q_sh[d] * float32(cache[off + d])
            s += part * scales[(off + b) // 32]
        return s
    per16 = 8 if kind == KV_F16 else 4  # elements per 16 bytes
    size = 2 if kind == KV_F16 else 4
    for d in range(0, head_dim, 4 * per16):
        b = size * (off + d)
        s += (_dot16(q_sh, d, cache, b, kind) + _dot16(q_sh, d + per16, cache, b + 16, kind)
              + _dot16(q_sh, d + 2 * per16, cache, b + 32, kind)
              + _dot16(q_sh, d + 3 * per16, cache, b + 48, kind))
    return s


@cuda.jit(device=True, inline=True)
def _s8(w, shift):
    """The signed byte at bit `shift` of the u32 w, as float32."""
    b = (w >> shift) & 0xFF
    return float32(int32(b) - 256 if b > 127 else int32(b))


@cuda.jit(device=True, inline=True)
def _value4(cache, scales, idx, kind):
    """cache[idx : idx + 4] as four float32 (idx % 4 == 0): one 16-, 8- or 4-byte load."""
    if kind == KV_F32:
        w = ld_v4_u32(cache, 4 * idx)
        return bits_to_f32(w[0]), bits_to_f32(w[1]), bits_to_f32(w[2]), bits_to_f32(w[3])
    if kind == KV_F16:
        lo, hi = ld_v2_u32(cache, 2 * idx)
        return (f16_bits_to_f32(lo & 0xFFFF), f16_bits_to_f32(lo >> 16),
                f16_bits_to_f32(hi & 0xFFFF), f16_bits_to_f32(hi >> 16))
    w, d = ld_u32(cache, idx), scales[idx // 32]
    return _s8(w, 0) * d, _s8(w, 8) * d, _s8(w, 16) * d, _s8(w, 24) * d


@cuda.jit(device=True, inline=True)
def _add_pv(acc, p_sh, row_sh, v_cache, v_scales, kind, j, n, dim0, per_lane):
    """acc += p_j·V_j[dim0 : dim0 + per_lane]; a key j ≥ n re-reads key n - 1 with p = 0, so the
    loads never depend on a branch and the caller's unrolled rounds keep them all in flight."""
    jj = min(j, n - 1)
    pj = p_sh[jj] if j < n else float32(0.0)
    off = row_sh[jj] + dim0
    if per_lane % 4 == 0:
        for e in range(0, per_lane, 4):
            v = _value4(v_cache, v_scales, off + e, kind)
            for i in range(4):
                acc[e + i] += pj * v[i]
    else:
        for e in range(per_lane):
            acc[e] += pj * kv_value(v_cache, v_scales, off + e, kind)


@cuda.jit(device=True, inline=True)
def _accumulate_pv(acc, corr, p_sh, row_sh, v_cache, v_scales, kind, n, warp, dim0, per_lane):
    """acc ← corr·acc + Σ p_j·V_j[dim0 : dim0 + per_lane] over this warp's share of n chunk keys,
    four keys per round written out (the loop is bound by load latency, not bandwidth)."""
    for e in range(per_lane):
        acc[e] *= corr
    for j in range(warp, n, 4 * WARPS):
        _add_pv(acc, p_sh, row_sh, v_cache, v_scales, kind, j, n, dim0, per_lane)
        _add_pv(acc, p_sh, row_sh, v_cache, v_scales, kind, j + WARPS, n, dim0, per_lane)
        _add_pv(acc, p_sh, row_sh, v_cache, v_scales, kind, j + 2 * WARPS, n, dim0, per_lane)
        _add_pv(acc, p_sh, row_sh, v_cache, v_scales, kind, j + 3 * WARPS, n, dim0, per_lane)


@functools.cache
def _split_kernel(head_dim: int, kind: int):
    per_lane = head_dim // 32
    acc_len = WARPS * head_dim

    @cuda.jit(fastmath=True)
    def decode_split(q, k_cache, v_cache, k_scales, v_scales, block_table, max_blocks, row_seq,
                     seq_lens, n_kv, block_size, split_len, scale, part_m, part_l, part_acc):
        # One block per (head, query row, split), keys in chunks of CHUNK: thread t scores key
        # t of the chunk (its whole K row), the block agrees on the running max, then warp w
        # accumulates p·V over keys w, w + WARPS, ..., lane l owning dims [l·per_lane, +per_lane).
        h, seq, split = cuda.blockIdx.x, cuda.blockIdx.y, cuda.blockIdx.z
        n_heads, n_splits = cuda.gridDim.x, cuda.gridDim.z
        tid = cuda.threadIdx.x
        warp, lane = tid // 32, tid % 32
        kv_head = h // (n_heads // n_kv)
        table = row_seq[seq] * max_blocks
        q_sh = cuda.shared.array(head_dim, float32)
        p_sh = cuda.shared.array(CHUNK, float32)
        row_sh = cuda.shared.array(CHUNK, int64)  # element offset of each chunk key's row
        scratch = cuda.shared.array(33, float32)
        acc_sh = cuda.shared.array(acc_len, float32)  # (warps, head_dim)
        for d in range(tid, head_dim, CHUNK):
            q_sh[d] = q[(seq * n_heads + h) * head_dim + d] * scale
        acc = cuda.local.array(per_lane, float32)  # (head_dim / 32,)
        for e in range(per_lane):
            acc[e] = 0.0
        m, l_sum = float32(-math.inf), float32(0.0)
        end = min(seq_lens[seq], (split + 1) * split_len)
        cuda.syncthreads()
        for c0 in range(split * split_len, end, CHUNK):
            t = c0 + tid
            s = float32(-math.inf)
            if t < end:
                blk = block_table[table + t // block_size]
                row_sh[tid] = ((blk * block_size + t % block_size) * n_kv + kv_head) * head_dim
                s = _dot_q(q_sh, k_cache, k_scales, row_sh[tid], head_dim, kind)
            m_new = max(m, block_max(s, scratch))
            corr = math.exp(m - m_new)  # m = -inf on the first chunk: corr = 0
            p = math.exp(s - m_new) if t < end else float32(0.0)
            p_sh[tid] = p
            l_sum = l_sum * corr + block_sum(p, scratch)  # its barriers publish p_sh, row_sh
            _accumulate_pv(acc, corr, p_sh, row_sh, v_cache, v_scales, kind,
                           min(CHUNK, end - c0), warp, lane * per_lane, per_lane)
            m = m_new
            cuda.syncthreads()  # before the next chunk overwrites p_sh / row_sh
        for e in range(per_lane):
            acc_sh[warp * head_dim + lane * per_lane + e] = acc[e]
        cuda.syncthreads()
        part = (seq * n_heads + h) * n_splits + split
        for d in range(tid, head_dim, CHUNK):
            total = float32(0.0)
            for w in range(WARPS):
                total += acc_sh[w * head_dim + d]
            part_acc[part * head_dim + d] = total
        if tid == 0:
            part_m[part] = m
            part_l[part] = l_sum
    return decode_split


@cuda.jit(fastmath=True)
def _merge_kernel(part_m, part_l, part_acc, n_splits, head_dim, out):
    row = cuda.blockIdx.y * cuda.gridDim.x + cuda.blockIdx.x  # seq · n_heads + head
    m_all = float32(-math.inf)
    for s in range(n_splits):
        m_all = max(m_all, part_m[row * n_splits + s])
    for d in range(cuda.threadIdx.x, head_dim, cuda.blockDim.x):
        num, den = float32(0.0), float32(0.0)
        for s in range(n_splits):
            ms = part_m[row * n_splits + s]
            if ms > -math.inf:
                c = math.exp(ms - m_all)
                num += c * part_acc[(row * n_splits + s) * head_dim + d]
                den += c * part_l[row * n_splits + s]
        out[row * head_dim + d] = num / den


class DecodeWorkspace:
    """Partial results of split-K decode for up to n_seqs sequences and max_context keys."""

    def __init__(self, n_seqs: int, n_heads: int, head_dim: int, max_context: int,
                 split_len: int = 512):
        self.split_len = split_len
        self.n_splits = cdiv(max_context, split_len)
        n_parts = n_seqs * n_heads * self.n_splits
        self.part_m = cuda.device_array(n_parts, np.float32)  # (seqs, heads, splits)
        self.part_l = cuda.device_array(n_parts, np.float32)
        self.part_acc = cuda.device_array(n_parts * head_dim, np.float32)  # (..., head_dim)


def paged_decode_attention(q, k_cache, v_cache, block_table, seq_lens, out, ws: DecodeWorkspace,
                           scale: float | None = None, stream=0, row_seq=None,
                           scales=None) -> None:
    """q (n_rows, n_heads, head_dim) f32 attends to the first seq_lens[r] cached tokens → out.

    row_seq: int32 (n_rows,) block-table row of each query row (default: row r uses row r), so the
    T query rows of one prefilled sequence share its table, with seq_lens = position + 1 (causal).
    scales: (k_scales, v_scales) f32, one per 32 cached values, for int8 caches.
    """
    n_seqs, n_heads, head_dim = q.shape
    _, block_size, n_kv, _ = k_cache.shape
    if head_dim % 32 or n_heads % n_kv:
        raise ValueError(f"head_dim {head_dim} must be a multiple of 32, n_heads % n_kv == 0")
    check_array("out", out, np.float32, q.shape)
    check_array("block_table", block_table, np.int32)
    check_array("seq_lens", seq_lens, np.int32, (n_seqs,))
    if row_seq is None:
        if block_table.shape[0] != n_seqs:
            raise ValueError("block_table needs one row per sequence")
        row_seq = _identity_rows(n_seqs)
    check_array("row_seq", row_seq, np.int32, (n_seqs,))
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    kind = kv_kind(k_cache)
    k_scales, v_scales = flat_scales(kind, scales, k_cache.size)
    _split_kernel(head_dim, kind)[(n_heads, n_seqs, ws.n_splits), CHUNK, stream](
        q.reshape(q.size), k_cache.reshape(k_cache.size), v_cache.reshape(v_cache.size),
        k_scales, v_scales, block_table.reshape(block_table.size), block_table.shape[1], row_seq,
        seq_lens, n_kv, block_size, ws.split_len, float32(scale), ws.part_m, ws.part_l,
        ws.part_acc)
    _merge_kernel[(n_heads, n_seqs), min(head_dim, 256), stream](
        ws.part_m, ws.part_l, ws.part_acc, ws.n_splits, head_dim, out.reshape(out.size))


@functools.cache
def _identity_rows(n: int):
    return cuda.to_device(np.arange(n, dtype=np.int32))  # (n,)


def paged_decode_attention_reference(q, k_cache, v_cache, block_table, seq_lens, scale=None):
    n_seqs, n_heads, head_dim = q.shape
    block_size, n_kv = k_cache.shape[1], k_cache.shape[2]
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    out = np.zeros(q.shape)
    for s in range(n_seqs):
        pos = np.arange(seq_lens[s])
        blocks = block_table[s][pos // block_size]
        keys = k_cache[blocks, pos % block_size].astype(np.float64)  # (L, n_kv, head_dim)
        vals = v_cache[blocks, pos % block_size].astype(np.float64)
        for h in range(n_heads):
            kv = h // (n_heads // n_kv)
            z = keys[:, kv] @ q[s, h].astype(np.float64) * scale
            p = np.exp(z - z.max())
            out[s, h] = p @ vals[:, kv] / p.sum()
    return out
