"""Attention over a paged F16 KV cache: split-K decode (one query per sequence); attention_input.py
stores new K/V.

Cache layout: (num_blocks, block_size, n_kv_heads, head_dim) float16 (float32 for exact runs); token
p of a sequence lives in block block_table[seq, p // block_size] at offset p % block_size. Decode
runs in two kernels so the graph shape never depends on the context length (a prefill runs as one
query row per token, row_seq naming each row's sequence and seq_lens = position + 1):
  1. grid (n_heads, n_seqs, n_splits): each block scans keys [split·split_len, +split_len) of its
     sequence with one online softmax per warp, and writes a partial (max, sum, unnormalised out);
  2. grid (n_heads, n_seqs): merge the partials of all splits (empty splits carry max = -inf).
"""

from __future__ import annotations

import functools
import math

import numpy as np
from numba import cuda, float32

from sparkinfer_cli.kernels.cuda.launch import cdiv, check_array
from sparkinfer_cli.kernels.cuda.warp import warp_sum

WARPS = 4


@functools.cache
def _split_kernel(head_dim: int):
    per_lane = head_dim // 32
    acc_len = WARPS * head_dim

    @cuda.jit(fastmath=True)
    def decode_split(q, k_cache, v_cache, block_table, max_blocks, row_seq, seq_lens, n_kv,
                     block_size, split_len, scale, part_m, part_l, part_acc):
        # seq = query row; its keys are those of sequence row_seq[seq] (block-table row)
        h, seq, split = cuda.blockIdx.x, cuda.blockIdx.y, cuda.blockIdx.z
        n_heads, n_splits = cuda.gridDim.x, cuda.gridDim.z
        warp, lane = cuda.threadIdx.x // 32, cuda.threadIdx.x % 32
        kv_head = h // (n_heads // n_kv)
        table = row_seq[seq] * max_blocks
        qv = cuda.local.array(per_lane, float32)  # (head_dim / 32,)
        acc = cuda.local.array(per_lane, float32)
        for e in range(per_lane):
            qv[e] = q[(seq * n_heads + h) * head_dim + lane * per_lane + e] * scale
            acc[e] = 0.0
        m, l_sum = float32(-math.inf), float32(0.0)
        start = split * split_len
        for t in range(start + warp, min(seq_lens[seq], start + split_len), WARPS):
            blk = block_table[table + t // block_size]
            base = ((blk * block_size + t % block_size) * n_kv + kv_head) * head_dim
            base += lane * per_lane
            s = float32(0.0)
            for e in range(per_lane):
                s += qv[e] * float32(k_cache[base + e])
            s = warp_sum(s)
            m_new = max(m, s)
            corr = math.exp(m - m_new)
            p = math.exp(s - m_new)
            l_sum = l_sum * corr + p
            for e in range(per_lane):
                acc[e] = acc[e] * corr + p * float32(v_cache[base + e])
            m = m_new
        sm_m = cuda.shared.array(WARPS, float32)
        sm_l = cuda.shared.array(WARPS, float32)
        sm_acc = cuda.shared.array(acc_len, float32)  # (warps, head_dim)
        if lane == 0:
            sm_m[warp] = m
            sm_l[warp] = l_sum
        for e in range(per_lane):
            sm_acc[warp * head_dim + lane * per_lane + e] = acc[e]
        cuda.syncthreads()
        m_all = sm_m[0]
        for w in range(1, WARPS):
            m_all = max(m_all, sm_m[w])
        part = (seq * n_heads + h) * n_splits + split
        for d in range(cuda.threadIdx.x, head_dim, cuda.blockDim.x):
            num, den = float32(0.0), float32(0.0)
            for w in range(WARPS):
                c = math.exp(sm_m[w] - m_all) if sm_m[w] > -math.inf else float32(0.0)
                num += c * sm_acc[w * head_dim + d]
                den += c * sm_l[w]
            part_acc[part * head_dim + d] = num
            if d == 0:
                part_m[part] = m_all
                part_l[part] = den
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
                           scale: float | None = None, stream=0, row_seq=None) -> None:
    """q (n_rows, n_heads, head_dim) f32 attends to the first seq_lens[r] cached tokens → out.

    row_seq: int32 (n_rows,) block-table row of each query row (default: row r uses row r), so the
    T query rows of one prefilled sequence share its table, with seq_lens = position + 1 (causal).
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
    _split_kernel(head_dim)[(n_heads, n_seqs, ws.n_splits), 32 * WARPS, stream](
        q.reshape(q.size), k_cache.reshape(k_cache.size), v_cache.reshape(v_cache.size),
        block_table.reshape(block_table.size), block_table.shape[1], row_seq, seq_lens, n_kv,
        block_size, ws.split_len,
        float32(scale), ws.part_m, ws.part_l, ws.part_acc)
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
