"""Attention over a paged KV cache: split-K decode (one query per sequence); attention_input.py
stores new K/V.

Cache layout: (num_blocks, block_size, n_kv_heads, head_dim) float16 (float32 for exact runs; int8
with one float32 scale per 32 values, llama.cpp's q8_0 scheme, under SPARKINFER_KV_INT8); token
p of a sequence lives in block block_table[seq, p // block_size] at offset p % block_size. A
prefill runs as one query row per token, row_seq naming each row's sequence and seq_lens =
position + 1.

Decode is one kernel whose grid (n_heads, n_rows, n_splits) never depends on the context length,
so a captured CUDA graph replays as the context grows:
  1. block (head, row, split) takes keys [split·L, (split + 1)·L) of the row, L = the row's
     seq_len / n_splits rounded up to whole CHUNKs (short contexts still spread over several
     blocks; splits past the end exit at once). It scans them CHUNK keys at a time (one per
     thread: every key's K row is read in parallel) with an online softmax, and stores a partial
     (max, sum, unnormalised out);
  2. each block then counts itself on its (row, head)'s counter; the last of the row's
     non-empty splits to arrive merges their partials into out and resets the counter to 0.
The loops are chains of dependent memory latencies, not bandwidth: the K dot and the p·V sum
keep eight loads in flight per round.
"""

from __future__ import annotations

import functools
import math

import numpy as np
from numba import cuda, float32, int8, int32, int64
from numba.cuda.types import float16

from sparkinfer_cli.kernels.cuda.intrinsics import (
    IS_SIMULATOR,
    bits_to_f32,
    f16_bits_to_f32,
    ld_u32,
    ld_v2_u32,
    ld_v4_u32,
)
from sparkinfer_cli.kernels.cuda.launch import cdiv, check_array
from sparkinfer_cli.kernels.cuda.quant_gemv import store_q8
from sparkinfer_cli.kernels.cuda.warp import block_max, block_sum, warp_max, warp_sum

CHUNK = 128  # keys scored at once: one per thread
KV_F32, KV_F16, KV_I8 = 0, 1, 2  # cache element types
WARPS = CHUNK // 32
# Told the block size and that an SM must hold 4 blocks, ptxas may use up to 128 registers and
# issues the eight loads of a round back to back (left alone it settles on 56 registers and
# interleaves the loads with the FMAs that use them). The simulator takes no launch bounds.
_LAUNCH_BOUNDS = {} if IS_SIMULATOR else {"launch_bounds": (CHUNK, 4)}


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
def _placeholder_i8():
    return cuda.to_device(np.zeros(1, np.int8))  # (1,)


@functools.cache
def _placeholder():
    return cuda.to_device(np.zeros(1, np.float32))  # (1,)


def kv_kind(cache) -> int:
    kinds = {np.dtype(np.float32): KV_F32, np.dtype(np.float16): KV_F16, np.dtype(np.int8): KV_I8}
    if np.dtype(cache.dtype) not in kinds:
        raise ValueError(f"KV cache of {cache.dtype}: float32, float16 or int8 expected")
    return kinds[np.dtype(cache.dtype)]


@cuda.jit(device=True, inline=True)
def _per16(kind):
    """Cache elements in 16 bytes."""
    return 16 if kind == KV_I8 else 8 if kind == KV_F16 else 4


@cuda.jit(device=True, inline=True)
def _dot16(q_sh, d, w, kind):
    """Σ q_sh[d + i]·x_i over the values x_i in the 16 bytes w: 4 floats, 8 halves or 16 int8."""
    s = float32(0.0)
    for j in range(4):
        if kind == KV_F16:
            s += q_sh[d + 2 * j] * f16_bits_to_f32(w[j] & 0xFFFF)
            s += q_sh[d + 2 * j + 1] * f16_bits_to_f32(w[j] >> 16)
        elif kind == KV_I8:
            for b in range(4):
                s += q_sh[d + 4 * j + b] * _s8(w[j], 8 * b)
        else:
            s += q_sh[d + j] * bits_to_f32(w[j])
    return s


@cuda.jit(device=True, inline=True)
def _dot_pair(q_sh, d, w0, w1, scales, idx, kind):
    """Σ q_sh[d + i]·x_i over the 32 bytes (w0, w1) holding cache elements idx, idx + 1, ...;
    KV_I8: they are one 32-block, times its scale."""
    s = _dot16(q_sh, d, w0, kind) + _dot16(q_sh, d + _per16(kind), w1, kind)
    if kind == KV_I8:
        return s * scales[idx // 32]
    return s


@cuda.jit(device=True, inline=True)
def _dot_q(q_sh, cache, scales, off, head_dim, kind):
    """Σ_d q_sh[d]·K[off + d] in rounds of eight 16-byte loads, all issued before the first is
    used (written out: the compiler does not unroll a loop holding several loads); a head_dim
    that is not a multiple of the round ends with pairs of loads."""
    per16 = _per16(kind)
    size = 16 // per16  # bytes per element
    n = 2 * per16  # elements per pair of loads
    full = head_dim - head_dim % (4 * n)
    s = float32(0.0)
    for d in range(0, full, 4 * n):
        b = size * (off + d)
        w0, w1 = ld_v4_u32(cache, b), ld_v4_u32(cache, b + 16)
        w2, w3 = ld_v4_u32(cache, b + 32), ld_v4_u32(cache, b + 48)
        w4, w5 = ld_v4_u32(cache, b + 64), ld_v4_u32(cache, b + 80)
        w6, w7 = ld_v4_u32(cache, b + 96), ld_v4_u32(cache, b + 112)
        s += (_dot_pair(q_sh, d, w0, w1, scales, off + d, kind)
              + _dot_pair(q_sh, d + n, w2, w3, scales, off + d + n, kind)
              + _dot_pair(q_sh, d + 2 * n, w4, w5, scales, off + d + 2 * n, kind)
              + _dot_pair(q_sh, d + 3 * n, w6, w7, scales, off + d + 3 * n, kind))
    for d in range(full, head_dim, n):
        b = size * (off + d)
        s += _dot_pair(q_sh, d, ld_v4_u32(cache, b), ld_v4_u32(cache, b + 16), scales, off + d,
                       kind)
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
    pj = p_sh[jj]
    pj = pj if j < n else float32(0.0)  # a select: a load under a branch would wait for it
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
    eight keys per round written out (the loop is bound by load latency, not bandwidth)."""
    for e in range(per_lane):
        acc[e] *= corr
    for j in range(warp, n, 8 * WARPS):
        _add_pv(acc, p_sh, row_sh, v_cache, v_scales, kind, j, n, dim0, per_lane)
        _add_pv(acc, p_sh, row_sh, v_cache, v_scales, kind, j + WARPS, n, dim0, per_lane)
        _add_pv(acc, p_sh, row_sh, v_cache, v_scales, kind, j + 2 * WARPS, n, dim0, per_lane)
        _add_pv(acc, p_sh, row_sh, v_cache, v_scales, kind, j + 3 * WARPS, n, dim0, per_lane)
        _add_pv(acc, p_sh, row_sh, v_cache, v_scales, kind, j + 4 * WARPS, n, dim0, per_lane)
        _add_pv(acc, p_sh, row_sh, v_cache, v_scales, kind, j + 5 * WARPS, n, dim0, per_lane)
        _add_pv(acc, p_sh, row_sh, v_cache, v_scales, kind, j + 6 * WARPS, n, dim0, per_lane)
        _add_pv(acc, p_sh, row_sh, v_cache, v_scales, kind, j + 7 * WARPS, n, dim0, per_lane)


@cuda.jit(device=True, inline=True)
def _split_len(seq_len, n_splits):
    """Keys per split of a row: whole chunks, as few as let n_splits splits cover seq_len."""
    per_split = max(1, (seq_len + n_splits - 1) // n_splits)
    return (per_split + CHUNK - 1) // CHUNK * CHUNK


@cuda.jit(device=True, inline=True)
def _sum_warps(acc_sh, d, head_dim):
    """Σ_w acc_sh[w, d] over the warps' rows of a (WARPS, head_dim) shared array."""
    total = float32(0.0)
    for w in range(WARPS):
        total += acc_sh[w * head_dim + d]
    return total


@cuda.jit(device=True, inline=True)
def _spill_acc(acc, acc_sh, head_dim, per_lane):
    """acc_sh[warp, lane·per_lane + e] = acc[e], then a barrier (the block reads it after)."""
    warp, lane = cuda.threadIdx.x // 32, cuda.threadIdx.x % 32
    for e in range(per_lane):
        acc_sh[warp * head_dim + lane * per_lane + e] = acc[e]
    cuda.syncthreads()


@cuda.jit(device=True, inline=True)
def _store_partial(acc, acc_sh, m, l_sum, part, part_m, part_l, part_acc, head_dim, per_lane):
    """Split `part`'s running max, softmax sum and unnormalised Σ p·V (summed over warps)."""
    _spill_acc(acc, acc_sh, head_dim, per_lane)
    for d in range(cuda.threadIdx.x, head_dim, CHUNK):
        part_acc[part * head_dim + d] = _sum_warps(acc_sh, d, head_dim)
    if cuda.threadIdx.x == 0:
        part_m[part] = m
        part_l[part] = l_sum


@cuda.jit(device=True, inline=True)
def _arrives_last(arrivals, idx, n_active, flag_sh):
    """Count this block in as one of the n_active blocks of (row, head) idx; True for the last
    to arrive, which then sees every split's partial and resets the counter for the next launch."""
    cuda.threadfence()  # release: this thread's partial stores are visible before it counts
    cuda.syncthreads()
    if cuda.threadIdx.x == 0:
        is_last = cuda.atomic.add(arrivals, idx, 1) == n_active - 1
        if is_last:
            arrivals[idx] = 0
        flag_sh[0] = int32(is_last)
    cuda.syncthreads()
    is_last = flag_sh[0] != 0
    if is_last:
        cuda.threadfence()  # acquire: read the other blocks' partials after their count
    return is_last


@cuda.jit(device=True, inline=True)
def _split_weights(row, n_active, n_splits, part_m, part_l, weight_sh):
    """weight_sh[s] = e^(m_s - m) / Σ_s' e^(m_s' - m)·l_s' over the splits s < n_active that hold
    keys (m: their max), so out = Σ_s weight_sh[s]·acc_s. Warp 0 calls it (n_splits ≤ 32)."""
    lane = cuda.threadIdx.x % 32
    live = lane < n_active
    m_s = part_m[row * n_splits + lane] if live else float32(-math.inf)
    m = warp_max(m_s)
    c = math.exp(m_s - m) if live else float32(0.0)
    den = warp_sum(c * part_l[row * n_splits + lane] if live else float32(0.0))
    weight_sh[lane] = c / den


@cuda.jit(device=True, inline=True)
def _add_partial(acc, weight_sh, part_acc, first, s, n_active, dim0, head_dim, per_lane):
    """acc += w_s·acc_s[dim0 : dim0 + per_lane] of partial first + s; s ≥ n_active re-reads split
    0 with w = 0 (branch-free loads, as in _add_pv)."""
    ss = s if s < n_active else 0
    w = weight_sh[ss]
    w = w if s < n_active else float32(0.0)
    off = (first + ss) * head_dim + dim0
    for e in range(per_lane):
        acc[e] += w * part_acc[off + e]


@cuda.jit(device=True, inline=True)
def _merge_splits(acc, acc_sh, weight_sh, row, n_active, n_splits, part_m, part_l, part_acc,
                  out, head_dim, per_lane, quantize, xq, xd, xs):
    """out[row] = the softmax-weighted mix of the row's n_active non-empty split partials; warp w
    sums splits w, w + WARPS, ..., two per round. quantize: out[row] also as q8 (xq, xd, xs)."""
    warp, lane = cuda.threadIdx.x // 32, cuda.threadIdx.x % 32
    if warp == 0:
        _split_weights(row, n_active, n_splits, part_m, part_l, weight_sh)
    cuda.syncthreads()
    for e in range(per_lane):
        acc[e] = 0.0
    first = row * n_splits
    for s in range(warp, n_active, 2 * WARPS):
        _add_partial(acc, weight_sh, part_acc, first, s, n_active, lane * per_lane, head_dim,
                     per_lane)
        _add_partial(acc, weight_sh, part_acc, first, s + WARPS, n_active, lane * per_lane,
                     head_dim, per_lane)
    _spill_acc(acc, acc_sh, head_dim, per_lane)
    for d in range(cuda.threadIdx.x, head_dim, CHUNK):
        _store_out(_sum_warps(acc_sh, d, head_dim), row * head_dim + d, out, quantize, xq, xd, xs)


@cuda.jit(device=True, inline=True)
def _store_out(v, i, out, quantize, xq, xd, xs):
    """out[i] = v, and its q8 form when quantize (the 32 lanes of a warp hold one 32-block: a
    head of 32·n elements, written with a CHUNK-thread stride)."""
    out[i] = v
    if quantize:
        store_q8(v, i, xq, xd, xs)


@cuda.jit(device=True, inline=True)
def _scan_keys(q_sh, k_cache, v_cache, k_scales, v_scales, block_table, table, block_size, n_kv,
               kv_head, start, end, head_dim, kind, p_sh, row_sh, scratch, acc, per_lane):
    """Online softmax of keys [start, end) of a row (block table at `table`) against q_sh, CHUNK
    keys at a time: thread t scores key t of the chunk (its whole K row), the block agrees on the
    running max, then warp w accumulates p·V over keys w, w + WARPS, ..., lane l owning dims
    [l·per_lane, +per_lane) in acc. Returns (max, Σ p)."""
    tid = cuda.threadIdx.x
    warp, lane = tid // 32, tid % 32
    m, l_sum = float32(-math.inf), float32(0.0)
    for c0 in range(start, end, CHUNK):
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
        _accumulate_pv(acc, corr, p_sh, row_sh, v_cache, v_scales, kind, min(CHUNK, end - c0),
                       warp, lane * per_lane, per_lane)
        m = m_new
        cuda.syncthreads()  # before the next chunk overwrites p_sh / row_sh
    return m, l_sum


@functools.cache
def _split_kernel(head_dim: int, kind: int, quantize: bool):
    """quantize: the merge also writes the output as q8 activations (the next GEMV's input)."""
    per_lane = head_dim // 32
    acc_len = WARPS * head_dim

    @cuda.jit(fastmath=True, **_LAUNCH_BOUNDS)
    def decode_split(q, k_cache, v_cache, k_scales, v_scales, block_table, max_blocks, row_seq,
                     seq_lens, n_kv, block_size, scale, part_m, part_l, part_acc, arrivals, out,
                     xq, xd, xs):
        # One block per (head, query row, split); the row's keys are cut into n_splits splits of
        # _split_len keys, each scanned by _scan_keys. Splits past the row's end exit; of the
        # others, the last to store its partial merges them all.
        h, seq, split = cuda.blockIdx.x, cuda.blockIdx.y, cuda.blockIdx.z
        n_heads, n_splits = cuda.gridDim.x, cuda.gridDim.z
        tid = cuda.threadIdx.x
        head_row = seq * n_heads + h
        q_sh = cuda.shared.array(head_dim, float32)
        p_sh = cuda.shared.array(CHUNK, float32)
        row_sh = cuda.shared.array(CHUNK, int64)  # element offset of each chunk key's row
        scratch = cuda.shared.array(33, float32)
        acc_sh = cuda.shared.array(acc_len, float32)  # (warps, head_dim)
        flag_sh = cuda.shared.array(1, int32)
        acc = cuda.local.array(per_lane, float32)  # (head_dim / 32,)
        seq_len = seq_lens[seq]
        split_len = _split_len(seq_len, n_splits)
        n_active = (seq_len + split_len - 1) // split_len  # splits that hold keys
        end = min(seq_len, (split + 1) * split_len)
        if split < n_active:  # block-uniform
            kv_head = h // (n_heads // n_kv)
            table = row_seq[seq] * max_blocks
            for d in range(tid, head_dim, CHUNK):
                q_sh[d] = q[head_row * head_dim + d] * scale
            for e in range(per_lane):
                acc[e] = 0.0
            cuda.syncthreads()
            m, l_sum = _scan_keys(q_sh, k_cache, v_cache, k_scales, v_scales, block_table, table,
                                  block_size, n_kv, kv_head, split * split_len, end, head_dim,
                                  kind, p_sh, row_sh, scratch, acc, per_lane)
            _store_partial(acc, acc_sh, m, l_sum, head_row * n_splits + split, part_m, part_l,
                           part_acc, head_dim, per_lane)
            if _arrives_last(arrivals, head_row, n_active, flag_sh):
                _merge_splits(acc, acc_sh, p_sh, head_row, n_active, n_splits, part_m, part_l,
                              part_acc, out, head_dim, per_lane, quantize, xq, xd, xs)
        elif split == 0:  # no keys at all: attention over nothing is 0
            for d in range(tid, head_dim, CHUNK):
                _store_out(float32(0.0), head_row * head_dim + d, out, quantize, xq, xd, xs)
    return decode_split


MAX_SPLITS = 32  # splits per query row: the merge weighs them with one warp's lanes


class DecodeWorkspace:
    """Split-K decode state for up to n_seqs query rows: each split's partial (max, sum,
    unnormalised out) and, per (row, head), how many splits have stored theirs (zero between
    launches: the last split resets it).

    n_splits = min(MAX_SPLITS, ⌈max_context / split_len⌉) splits per row; a launch sizes them
    to each row's own context (_split_len), so split_len only bounds their number: the fewest
    keys a split gets at max_context (at least CHUNK, a split's unit).
    """

    def __init__(self, n_seqs: int, n_heads: int, head_dim: int, max_context: int,
                 split_len: int = CHUNK):
        self.n_splits = max(1, min(MAX_SPLITS, cdiv(max_context, max(split_len, CHUNK))))
        n_parts = n_seqs * n_heads * self.n_splits
        self.part_m = cuda.device_array(n_parts, np.float32)  # (seqs, heads, splits)
        self.part_l = cuda.device_array(n_parts, np.float32)
        self.part_acc = cuda.device_array(n_parts * head_dim, np.float32)  # (..., head_dim)
        self.arrivals = cuda.to_device(np.zeros(n_seqs * n_heads, np.int32))  # (seqs, heads)


def paged_decode_attention(q, k_cache, v_cache, block_table, seq_lens, out, ws: DecodeWorkspace,
                           scale: float | None = None, stream=0, row_seq=None,
                           scales=None, act=None) -> None:
    """q (n_rows, n_heads, head_dim) f32 attends to the first seq_lens[r] cached tokens → out.

    row_seq: int32 (n_rows,) block-table row of each query row (default: row r uses row r), so the
    T query rows of one prefilled sequence share its table, with seq_lens = position + 1 (causal).
    scales: (k_scales, v_scales) f32, one per 32 cached values, for int8 caches.
    act: a quant_gemv.QuantizedActivations of out's size, filled with out's q8 form in the same
    launch (saves the quantize launch before the output projection).
    """
    n_seqs, n_heads, head_dim = q.shape
    _, block_size, n_kv, _ = k_cache.shape
    if head_dim % 32 or n_heads % n_kv:
        raise ValueError(f"head_dim {head_dim} must be a multiple of 32, n_heads % n_kv == 0")
    if q.size * ws.n_splits > ws.part_acc.size or n_seqs * n_heads > ws.arrivals.size:
        raise ValueError(f"q {q.shape} does not fit the decode workspace")
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
    if act is not None and int(np.prod(act.shape)) != out.size:
        raise ValueError(f"q8 activations of shape {act.shape} do not hold out {out.shape}")
    q8 = (act.xq, act.xd, act.xs) if act is not None else (_placeholder_i8(),) + \
        (_placeholder(),) * 2
    _split_kernel(head_dim, kind, act is not None)[(n_heads, n_seqs, ws.n_splits), CHUNK, stream](
        q.reshape(q.size), k_cache.reshape(k_cache.size), v_cache.reshape(v_cache.size),
        k_scales, v_scales, block_table.reshape(block_table.size), block_table.shape[1], row_seq,
        seq_lens, n_kv, block_size, float32(scale), ws.part_m, ws.part_l, ws.part_acc,
        ws.arrivals, out.reshape(out.size), *q8)


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
