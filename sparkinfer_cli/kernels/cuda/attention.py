"""Attention over a paged KV cache: split-K decode (one query per sequence); attention_input.py
stores new K/V.

Cache layout: (num_blocks, block_size, n_kv_heads, head_dim) float16 (float32 for exact runs; int8
with one float32 scale per 32 values, llama.cpp's q8_0 scheme, under SPARKINFER_KV_INT8); token
p of a sequence lives in block block_table[seq, p // block_size] at offset p % block_size. A
prefill runs as one query row per token, row_seq naming each row's sequence and seq_lens =
position + 1.

Decode is one kernel whose grid (n_heads / heads, n_rows, n_splits) never depends on the context
length, so a captured CUDA graph replays as the context grows:
  1. block (head group, row, split) serves `heads` query heads of one kv head (heads_per_block:
     each K/V load feeds them all) and takes keys [split·L, (split + 1)·L) of the row, L = the
     row's seq_len / n_splits rounded up to whole CHUNKs (short contexts still spread over
     several blocks; splits past the end exit at once). It scans them CHUNK keys at a time (one
     per thread: every key's K row is read in parallel) with an online softmax, and stores a
     partial (max, sum, unnormalised out) per head;
  2. each block then counts itself on its (row, head group)'s counter; the last of the row's
     non-empty splits to arrive merges their partials into out (all its heads at once) and
     resets the counter to 0.
The loops are chains of dependent memory latencies: the K dot and the p·V sum keep eight loads in
flight per round. The splits per row are chosen at launch (DecodeWorkspace.splits): enough blocks
to spread one long sequence, few for many rows.

F16 caches whose kv heads serve 2-8 query heads (GQA, head_dim 128 or 256) take
attention_mma.py's kernels instead: one block a kv head, its query heads on tensor cores, the
same partials, merged by a second kernel spread over (row, head, 64 dims).
"""

from __future__ import annotations

import functools
import math

import numpy as np
from numba import cuda, float32, int8, int32, int64
from numba.cuda.types import float16

from sparkinfer_cli.kernels.cuda.quant_gemv import store_q8
from sparkinfer_cli.kernels.cuda.runtime.intrinsics import (
    IS_SIMULATOR,
    bits_to_f32,
    chain_start,
    f16_bits_to_f32,
    ld_u32,
    ld_v2_u32,
    ld_v4_u32,
)
from sparkinfer_cli.kernels.cuda.runtime.jit import device_function, kernel
from sparkinfer_cli.kernels.cuda.runtime.launch import cdiv, check_array
from sparkinfer_cli.kernels.cuda.runtime.warp import warp_max, warp_sum

CHUNK = 128  # keys scored at once: one per thread
KV_F32, KV_F16, KV_I8 = 0, 1, 2  # cache element types
WARPS = CHUNK // 32
# Told the block size and that an SM must hold 4 blocks, ptxas may use up to 128 registers and
# issues the eight loads of a round back to back (left alone it settles on 56 registers and
# interleaves the loads with the FMAs that use them). The simulator takes no launch bounds.
_LAUNCH_BOUNDS = {} if IS_SIMULATOR else {"launch_bounds": (CHUNK, 4)}


@device_function
def kv_value(cache, scales, idx, kind):
    """Element idx of a K or V cache as float32 (KV_I8: times its 32-block's scale)."""
    if kind == KV_I8:
        return float32(cache[idx]) * scales[idx // 32]
    return float32(cache[idx])


@device_function
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


@device_function
def _per16(kind):
    """Cache elements in 16 bytes."""
    return 16 if kind == KV_I8 else 8 if kind == KV_F16 else 4


@device_function
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


@device_function
def _dot_pair(q_sh, d, w0, w1, scales, idx, kind):
    """Σ q_sh[d + i]·x_i over the 32 bytes (w0, w1) holding cache elements idx, idx + 1, ...;
    KV_I8: they are one 32-block, times its scale."""
    s = _dot16(q_sh, d, w0, kind) + _dot16(q_sh, d + _per16(kind), w1, kind)
    if kind == KV_I8:
        return s * scales[idx // 32]
    return s


@device_function
def _dot_q(q_sh, cache, scales, off, head_dim, kind, heads, scores):
    """scores[h] = Σ_d q_sh[h·head_dim + d]·K[off + d] for the block's `heads` query heads, every
    K load shared by them, in rounds of eight 16-byte loads all issued before the first is used
    (written out: the compiler does not unroll a loop holding several loads); a head_dim that is
    not a multiple of the round ends with pairs of loads."""
    per16 = _per16(kind)
    size = 16 // per16  # bytes per element
    n = 2 * per16  # elements per pair of loads
    full = head_dim - head_dim % (4 * n)
    for h in range(heads):
        scores[h] = 0.0
    for d in range(0, full, 4 * n):
        b = size * (off + d)
        w0, w1 = ld_v4_u32(cache, b), ld_v4_u32(cache, b + 16)
        w2, w3 = ld_v4_u32(cache, b + 32), ld_v4_u32(cache, b + 48)
        w4, w5 = ld_v4_u32(cache, b + 64), ld_v4_u32(cache, b + 80)
        w6, w7 = ld_v4_u32(cache, b + 96), ld_v4_u32(cache, b + 112)
        for h in range(heads):
            qd = h * head_dim + d
            scores[h] += (_dot_pair(q_sh, qd, w0, w1, scales, off + d, kind)
                          + _dot_pair(q_sh, qd + n, w2, w3, scales, off + d + n, kind)
                          + _dot_pair(q_sh, qd + 2 * n, w4, w5, scales, off + d + 2 * n, kind)
                          + _dot_pair(q_sh, qd + 3 * n, w6, w7, scales, off + d + 3 * n, kind))
    for d in range(full, head_dim, n):
        b = size * (off + d)
        w0, w1 = ld_v4_u32(cache, b), ld_v4_u32(cache, b + 16)
        for h in range(heads):
            scores[h] += _dot_pair(q_sh, h * head_dim + d, w0, w1, scales, off + d, kind)


@device_function
def _s8(w, shift):
    """The signed byte at bit `shift` of the u32 w, as float32."""
    b = (w >> shift) & 0xFF
    return float32(int32(b) - 256 if b > 127 else int32(b))


@device_function
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


@device_function
def _p(p_sh, h, jj, live):
    """Head h's softmax weight of chunk key jj, 0 for a key past the chunk's end. The load is
    unconditional and the choice a select: a load under a branch would wait for it."""
    p = p_sh[h * CHUNK + jj]
    return p if live else float32(0.0)


@device_function
def _add_pv(acc, p_sh, row_sh, v_cache, v_scales, kind, j, n, dim0, per_lane, heads):
    """acc[h·per_lane + e] += p_h,j·V_j[dim0 + e] for each of the block's heads (one V load for
    all); a key j ≥ n re-reads key n - 1 with p = 0, so the loads never depend on a branch and
    the caller's unrolled rounds keep them all in flight."""
    jj = min(j, n - 1)
    live = j < n
    off = row_sh[jj] + dim0
    if per_lane % 4 == 0:
        for e in range(0, per_lane, 4):
            v = _value4(v_cache, v_scales, off + e, kind)
            for h in range(heads):
                ph = _p(p_sh, h, jj, live)
                for i in range(4):
                    acc[h * per_lane + e + i] += ph * v[i]
    else:
        for e in range(per_lane):
            v1 = kv_value(v_cache, v_scales, off + e, kind)
            for h in range(heads):
                acc[h * per_lane + e] += _p(p_sh, h, jj, live) * v1


@device_function
def _accumulate_pv(acc, corr, p_sh, row_sh, v_cache, v_scales, kind, n, warp, dim0, per_lane,
                   heads):
    """acc_h ← corr[h]·acc_h + Σ p_h,j·V_j[dim0 : dim0 + per_lane] over this warp's share of n
    chunk keys, eight keys per round written out (the loop is bound by load latency)."""
    for h in range(heads):
        for e in range(per_lane):
            acc[h * per_lane + e] *= corr[h]
    vc, vs, d0 = v_cache, v_scales, dim0
    for j in range(warp, n, 8 * WARPS):  # written out: a loop of loads is not unrolled
        _add_pv(acc, p_sh, row_sh, vc, vs, kind, j, n, d0, per_lane, heads)
        _add_pv(acc, p_sh, row_sh, vc, vs, kind, j + WARPS, n, d0, per_lane, heads)
        _add_pv(acc, p_sh, row_sh, vc, vs, kind, j + 2 * WARPS, n, d0, per_lane, heads)
        _add_pv(acc, p_sh, row_sh, vc, vs, kind, j + 3 * WARPS, n, d0, per_lane, heads)
        _add_pv(acc, p_sh, row_sh, vc, vs, kind, j + 4 * WARPS, n, d0, per_lane, heads)
        _add_pv(acc, p_sh, row_sh, vc, vs, kind, j + 5 * WARPS, n, d0, per_lane, heads)
        _add_pv(acc, p_sh, row_sh, vc, vs, kind, j + 6 * WARPS, n, d0, per_lane, heads)
        _add_pv(acc, p_sh, row_sh, vc, vs, kind, j + 7 * WARPS, n, d0, per_lane, heads)


@device_function
def _split_len(seq_len, n_splits):
    """Keys per split of a row: whole chunks, as few as let n_splits splits cover seq_len."""
    per_split = max(1, (seq_len + n_splits - 1) // n_splits)
    return (per_split + CHUNK - 1) // CHUNK * CHUNK


@device_function
def _sum_warps(acc_sh, h, d, head_dim):
    """Σ_w acc_sh[h, w, d] over the warps' rows of a (heads, WARPS, head_dim) shared array."""
    total = float32(0.0)
    for w in range(WARPS):
        total += acc_sh[(h * WARPS + w) * head_dim + d]
    return total


@device_function
def _spill_acc(acc, acc_sh, head_dim, per_lane, heads):
    """acc_sh[h, warp, lane·per_lane + e] = acc[h·per_lane + e], then a barrier (the block reads
    it after)."""
    warp, lane = cuda.threadIdx.x // 32, cuda.threadIdx.x % 32
    for h in range(heads):
        for e in range(per_lane):
            acc_sh[(h * WARPS + warp) * head_dim + lane * per_lane + e] = acc[h * per_lane + e]
    cuda.syncthreads()


@device_function
def _store_partials(acc, acc_sh, m, l_sum, part0, n_splits, part_m, part_l, part_acc, head_dim,
                    per_lane, heads):
    """Each head's running max, softmax sum and unnormalised Σ p·V (summed over warps) into its
    partial: head h's is part0 + h·n_splits."""
    _spill_acc(acc, acc_sh, head_dim, per_lane, heads)
    for i in range(cuda.threadIdx.x, heads * head_dim, CHUNK):
        h, d = i // head_dim, i % head_dim
        part_acc[(part0 + h * n_splits) * head_dim + d] = _sum_warps(acc_sh, h, d, head_dim)
    if cuda.threadIdx.x == 0:
        for h in range(heads):
            part_m[part0 + h * n_splits] = m[h]
            part_l[part0 + h * n_splits] = l_sum[h]


@device_function
def _arrives_last(arrivals, idx, n_active, flag_sh):
    """Count this block in as one of the n_active blocks of counter idx (a row's head group);
    True for the last to arrive, which then sees every split's partial and resets the counter
    for the next launch."""
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


@device_function
def _split_weights(row, n_active, n_splits, part_m, part_l, weight_sh, w0):
    """weight_sh[w0 + s] = e^(m_s - m) / Σ_s' e^(m_s' - m)·l_s' over the splits s < n_active of
    (row, head) `row` that hold keys (m: their max), so out = Σ_s weight_sh[w0 + s]·acc_s. One
    warp calls it; lane l takes splits l, l + 32, ..."""
    lane, first = cuda.threadIdx.x % 32, row * n_splits
    m_lane = float32(-math.inf)
    for s in range(lane, n_active, 32):
        m_lane = max(m_lane, part_m[first + s])
    m = warp_max(m_lane)
    den = float32(0.0)
    for s in range(lane, n_active, 32):
        c = math.exp(part_m[first + s] - m)
        weight_sh[w0 + s] = c
        den += c * part_l[first + s]
    den = warp_sum(den)
    for s in range(lane, n_active, 32):
        weight_sh[w0 + s] /= den


@device_function
def _add_split(out_acc, weight_sh, part_acc, row0, s, n_active, n_splits, head_dim, n_out,
               n_elems):
    """out_acc[k] += w_h,s·acc_h,s[d] for this thread's output elements (h, d) = divmod(t +
    k·CHUNK, head_dim) of the block's heads; s ≥ n_active re-reads split 0 with w = 0 and a
    thread past the heads' n_elems its last element (branch-free loads, as in _add_pv)."""
    ss = s if s < n_active else 0
    for k in range(n_out):
        i = min(cuda.threadIdx.x + k * CHUNK, n_elems - 1)
        h, d = i // head_dim, i % head_dim
        w = weight_sh[h * CHUNK + ss]
        w = w if s < n_active else float32(0.0)
        out_acc[k] += w * part_acc[((row0 + h) * n_splits + ss) * head_dim + d]


@device_function
def _merge_heads(out_acc, weight_sh, row0, heads, n_active, n_splits, part_m, part_l, part_acc,
                 out, head_dim, n_out, quantize, xq, xd, xs):
    """out rows row0 .. row0 + heads - 1 (one per head of the block): each the softmax-weighted
    mix of its n_active split partials. Warp w weighs heads w, w + WARPS, ...'s splits (weight_sh:
    (heads, CHUNK)); then thread t sums output elements t, t + CHUNK, ... of all the heads (n_out
    of them) over the splits, four splits a round written out. quantize: also as q8."""
    n_elems, warp = heads * head_dim, cuda.threadIdx.x // 32
    for h in range(warp, heads, WARPS):
        _split_weights(row0 + h, n_active, n_splits, part_m, part_l, weight_sh, h * CHUNK)
    cuda.syncthreads()
    for k in range(n_out):
        out_acc[k] = 0.0
    for s in range(0, n_active, 4):
        _add_split(out_acc, weight_sh, part_acc, row0, s, n_active, n_splits, head_dim, n_out,
                   n_elems)
        _add_split(out_acc, weight_sh, part_acc, row0, s + 1, n_active, n_splits, head_dim, n_out,
                   n_elems)
        _add_split(out_acc, weight_sh, part_acc, row0, s + 2, n_active, n_splits, head_dim, n_out,
                   n_elems)
        _add_split(out_acc, weight_sh, part_acc, row0, s + 3, n_active, n_splits, head_dim, n_out,
                   n_elems)
    for k in range(n_out):
        i = cuda.threadIdx.x + k * CHUNK
        if i < n_elems:  # warp-uniform: n_elems is a multiple of 32
            _store_out(out_acc[k], row0 * head_dim + i, out, quantize, xq, xd, xs)


@device_function
def merge_if_last(arrivals, counter, n_active, flag_sh, out_acc, weight_sh, row0, heads, n_splits,
                  part_m, part_l, part_acc, out, head_dim, n_out, quantize, xq, xd, xs):
    """After a block stored its split's partials: the last of the n_active splits of its (row,
    head group) `counter` to arrive merges them into out (_merge_heads)."""
    if _arrives_last(arrivals, counter, n_active, flag_sh):
        _merge_heads(out_acc, weight_sh, row0, heads, n_active, n_splits, part_m, part_l,
                     part_acc, out, head_dim, n_out, quantize, xq, xd, xs)


@device_function
def store_zero_rows(row0, n_elems, out, head_dim, quantize, xq, xd, xs):
    """A query row with no keys at all: attention over nothing is 0 (its q8 form too)."""
    for i in range(cuda.threadIdx.x, n_elems, CHUNK):
        _store_out(float32(0.0), row0 * head_dim + i, out, quantize, xq, xd, xs)


@device_function
def _store_out(v, i, out, quantize, xq, xd, xs):
    """out[i] = v, and its q8 form when quantize (the 32 lanes of a warp hold one 32-block: a
    head of 32·n elements, written with a CHUNK-thread stride)."""
    out[i] = v
    if quantize:
        store_q8(v, i, xq, xd, xs)


@device_function
def _chunk_softmax(scores, live, m, l_sum, corr, p_sh, red_sh, heads):
    """The online-softmax step of one chunk for each head h, thread t holding key t's score
    scores[h]: m[h] ← max(m[h], the chunk's max), corr[h] = e^(m_old - m_new), p_sh[h, t] =
    e^(s - m_new) (0 past the keys' end), l_sum[h] ← corr[h]·l_sum[h] + Σ_t p. Two barriers (the
    warps' maxima, then their sums: red_sh (2, heads, WARPS)); the second also publishes p_sh."""
    tid = cuda.threadIdx.x
    warp, lane = tid // 32, tid % 32
    for h in range(heads):
        chunk_max = warp_max(scores[h])
        if lane == 0:
            red_sh[h * WARPS + warp] = chunk_max
    cuda.syncthreads()
    for h in range(heads):
        m_new = m[h]
        for w in range(WARPS):
            m_new = max(m_new, red_sh[h * WARPS + w])
        corr[h] = math.exp(m[h] - m_new)  # m = -inf on the first chunk: corr = 0
        p = math.exp(scores[h] - m_new) if live else float32(0.0)
        p_sh[h * CHUNK + tid] = p
        p_sum = warp_sum(p)
        if lane == 0:
            red_sh[(heads + h) * WARPS + warp] = p_sum
        m[h] = m_new
    cuda.syncthreads()
    for h in range(heads):
        total = float32(0.0)
        for w in range(WARPS):
            total += red_sh[(heads + h) * WARPS + w]
        l_sum[h] = l_sum[h] * corr[h] + total


@device_function
def _scan_keys(q_sh, k_cache, v_cache, k_scales, v_scales, block_table, table, block_size, n_kv,
               kv_head, start, end, head_dim, kind, p_sh, row_sh, red_sh, acc, per_lane, heads,
               m, l_sum, corr, scores):
    """Online softmax of keys [start, end) of a row (block table at `table`) for the block's
    `heads` query heads (q_sh (heads, head_dim)), CHUNK keys at a time: thread t scores key t of
    the chunk (its whole K row, once for all heads), the block agrees on the running maxima, then
    warp w accumulates p·V over keys w, w + WARPS, ..., lane l owning dims [l·per_lane,
    +per_lane) of each head in acc. Leaves each head's max in m and Σ p in l_sum."""
    tid = cuda.threadIdx.x
    warp, lane = tid // 32, tid % 32
    for h in range(heads):
        m[h], l_sum[h] = -math.inf, 0.0
    for c0 in range(start, end, CHUNK):
        t = c0 + tid
        for h in range(heads):
            scores[h] = -math.inf
        if t < end:
            blk = block_table[table + t // block_size]
            row_sh[tid] = ((blk * block_size + t % block_size) * n_kv + kv_head) * head_dim
            _dot_q(q_sh, k_cache, k_scales, row_sh[tid], head_dim, kind, heads, scores)
        _chunk_softmax(scores, t < end, m, l_sum, corr, p_sh, red_sh, heads)
        _accumulate_pv(acc, corr, p_sh, row_sh, v_cache, v_scales, kind, min(CHUNK, end - c0),
                       warp, lane * per_lane, per_lane, heads)
        cuda.syncthreads()  # before the next chunk overwrites p_sh / row_sh


@functools.cache
def _split_kernel(head_dim: int, kind: int, quantize: bool, heads: int):
    """heads: query heads a block serves (of one kv head); quantize: the merge also writes the
    output as q8 activations (the next GEMV's input)."""
    per_lane = head_dim // 32
    # shared / local array sizes must be compile-time constants
    q_len, p_len, red_len, acc_sh_len = heads * head_dim, heads * CHUNK, 2 * heads * WARPS, \
        heads * WARPS * head_dim
    acc_len = heads * per_lane
    n_out = (heads * head_dim + CHUNK - 1) // CHUNK  # merged output elements a thread (≤ acc_len)

    @kernel(fastmath=True, **_LAUNCH_BOUNDS)
    def decode_split(q, k_cache, v_cache, k_scales, v_scales, block_table, max_blocks, row_seq,
                     seq_lens, n_kv, block_size, scale, part_m, part_l, part_acc, arrivals, out,
                     xq, xd, xs):
        chain_start()
        # One block per (head group, query row, split); the row's keys are cut into n_splits
        # splits of _split_len keys, each scanned by _scan_keys. Splits past the row's end exit;
        # of the others, the last to store its partials merges them all.
        g, seq, split = cuda.blockIdx.x, cuda.blockIdx.y, cuda.blockIdx.z
        n_groups, n_splits = cuda.gridDim.x, cuda.gridDim.z
        tid, n_heads = cuda.threadIdx.x, cuda.gridDim.x * heads
        row0 = seq * n_heads + g * heads  # the (row, head) index of the block's first head
        q_sh = cuda.shared.array(q_len, float32)
        p_sh = cuda.shared.array(p_len, float32)  # (heads, CHUNK); merge: split weights
        row_sh = cuda.shared.array(CHUNK, int64)  # element offset of each chunk key's row
        red_sh = cuda.shared.array(red_len, float32)
        acc_sh = cuda.shared.array(acc_sh_len, float32)  # (heads, warps, head_dim)
        flag_sh = cuda.shared.array(1, int32)
        acc = cuda.local.array(acc_len, float32)  # (heads, head_dim / 32)
        m, l_sum = cuda.local.array(heads, float32), cuda.local.array(heads, float32)
        corr, scores = cuda.local.array(heads, float32), cuda.local.array(heads, float32)
        seq_len = seq_lens[seq]
        split_len = _split_len(seq_len, n_splits)
        n_active = (seq_len + split_len - 1) // split_len  # splits that hold keys
        if split < n_active:  # block-uniform
            for i in range(tid, heads * head_dim, CHUNK):
                q_sh[i] = q[row0 * head_dim + i] * scale
            for e in range(acc_len):
                acc[e] = 0.0
            cuda.syncthreads()
            _scan_keys(q_sh, k_cache, v_cache, k_scales, v_scales, block_table,
                       row_seq[seq] * max_blocks, block_size, n_kv, g * heads // (n_heads // n_kv),
                       split * split_len, min(seq_len, (split + 1) * split_len), head_dim, kind,
                       p_sh, row_sh, red_sh, acc, per_lane, heads, m, l_sum, corr, scores)
            _store_partials(acc, acc_sh, m, l_sum, row0 * n_splits + split, n_splits, part_m,
                            part_l, part_acc, head_dim, per_lane, heads)
            merge_if_last(arrivals, seq * n_groups + g, n_active, flag_sh, acc, p_sh, row0, heads,
                          n_splits, part_m, part_l, part_acc, out, head_dim, n_out, quantize, xq,
                          xd, xs)
        elif split == 0:
            store_zero_rows(row0, heads * head_dim, out, head_dim, quantize, xq, xd, xs)
    return decode_split


def heads_per_block(n_heads: int, n_kv: int, kind: int = KV_F16) -> int:
    """Query heads one decode block serves: up to MAX_BLOCK_HEADS of a kv head's group, all fed
    by each K/V load. An int8 cache keeps one: unpacking its bytes for 4 heads spills registers
    (ptxas sm_90: 300-720 bytes a thread at the 128 cap)."""
    heads = 1 if kind == KV_I8 else MAX_BLOCK_HEADS
    while (n_heads // n_kv) % heads:
        heads //= 2
    return heads


# Two heads a block, not four: a block is bound by its own chain of latencies and instructions
# more than by the K/V traffic that sharing saves, so four heads ran slower at short and long
# contexts alike (bench/probes/cuda_decode_attention_bench.py; figures in the decode write-up,
# bench/results/2026-11-30-cuda-decode-latency.md).
MAX_BLOCK_HEADS = 2
MAX_SPLITS = CHUNK  # splits per query row a workspace holds (the merge weighs them in CHUNK floats)
# This module's kernel takes at most 64: 128 splits ran slower above (attention_mma's kernel,
# one block a kv head, goes to MAX_SPLITS).
FLOAT_KERNEL_SPLITS = 64
# Blocks a launch aims for (rows × head groups × splits): one sequence spreads a long context
# over FLOAT_KERNEL_SPLITS splits, many rows take few (every split past a row's end still
# launches). attention_mma has its own (its SPLIT_BLOCKS).
SPLIT_BLOCKS = 1024
# The fewest keys a workspace plans a split for: attention_mma's ROUND_KEYS (one round of its
# warps' tiles; not imported: it imports this module), so a small cache still gives that kernel
# one-round splits (in CHUNKs, 548 tokens planned 5 splits: 512 keys ran as 4 of two rounds).
# This module's kernel rounds its splits up to CHUNKs itself.
MIN_SPLIT_KEYS = 64


class DecodeWorkspace:
    """Split-K decode state for up to n_seqs query rows: each (row, head, split)'s partial (max,
    sum, unnormalised out) and the counters of this module's kernel: per (row, head group) (one
    slot a head), how many splits have stored theirs (zero between launches: the last split
    resets it; attention_mma's merge kernel needs none).

    max_splits = min(MAX_SPLITS, ⌈max_context / split_len⌉) bounds the splits per row (split_len:
    the fewest keys a split gets at max_context, at least MIN_SPLIT_KEYS); a launch takes
    fewer when its rows × head groups fill the GPU anyway (`splits`), and sizes them to each row's
    own context (_split_len). Partials are kept for n_seqs rows at ≤ ⌈SPLIT_BLOCKS /
    split_rows⌉ splits: what a launch whose splits are counted for split_rows rows uses
    (paged_decode_attention's split_rows; default n_seqs).
    """

    def __init__(self, n_seqs: int, n_heads: int, head_dim: int, max_context: int,
                 split_len: int = MIN_SPLIT_KEYS, split_rows: int | None = None):
        split_len = max(split_len, MIN_SPLIT_KEYS)
        self.max_splits = max(1, min(MAX_SPLITS, cdiv(max_context, split_len)))
        n_parts = n_seqs * n_heads * min(self.max_splits,
                                         cdiv(SPLIT_BLOCKS, split_rows or n_seqs))
        self.part_m = cuda.device_array(n_parts, np.float32)  # (seqs, heads, splits)
        self.part_l = cuda.device_array(n_parts, np.float32)
        self.part_acc = cuda.device_array(n_parts * head_dim, np.float32)  # (..., head_dim)
        self.arrivals = cuda.to_device(np.zeros(n_seqs * n_heads, np.int32))  # (seqs, heads)

    def splits(self, n_rows: int, n_heads: int, n_groups: int, cap: int = FLOAT_KERNEL_SPLITS,
               target: int = SPLIT_BLOCKS, split_rows: int | None = None) -> int:
        """Splits per row of a launch over n_rows query rows of n_heads heads in n_groups: about
        `target` blocks in all for split_rows rows (default n_rows), at most cap a row (the
        kernel's own limits). ValueError where split_rows asks for more than the partials hold:
        fewer splits would change the rows' sums, which split_rows is there to keep."""
        fit = self.part_m.size // (n_rows * n_heads)  # what the partials hold
        rows = split_rows or n_rows
        wanted = max(1, min(self.max_splits, cap, cdiv(target, rows * n_groups)))
        if split_rows is not None and wanted > fit:
            raise ValueError(f"{n_rows} rows at the splits of {split_rows} need {wanted} "
                             f"partials a head, the workspace holds {fit}")
        return max(1, min(wanted, fit))


def paged_decode_attention(q, k_cache, v_cache, block_table, seq_lens, out, ws: DecodeWorkspace,
                           scale: float | None = None, stream=0, row_seq=None,
                           scales=None, act=None, split_rows: int | None = None) -> None:
    """q (n_rows, n_heads, head_dim) f32 attends to the first seq_lens[r] cached tokens → out.

    row_seq: int32 (n_rows,) block-table row of each query row (default: row r uses row r), so the
    T query rows of one prefilled sequence share its table, with seq_lens = position + 1 (causal).
    split_rows: count the splits for this many rows instead of n_rows. A row's sums depend on its
    split count, so rows that must equal a decode pass of split_rows sequences (several new tokens
    of a sequence: drafts to check) take that pass's splits (the workspace sized for them).
    scales: (k_scales, v_scales) f32, one per 32 cached values, for int8 caches.
    act: a quant_gemv.QuantizedActivations of out's size, filled with out's q8 form in the same
    launch (saves the quantize launch before the output projection).
    """
    n_seqs, n_heads, head_dim = q.shape
    _, block_size, n_kv, _ = k_cache.shape
    if head_dim % 32 or n_heads % n_kv:
        raise ValueError(f"head_dim {head_dim} must be a multiple of 32, n_heads % n_kv == 0")
    kind = kv_kind(k_cache)
    # attention_mma builds on this module's device functions: imported here, not at the top
    from sparkinfer_cli.kernels.cuda import attention_mma

    packed = attention_mma.tensor_core_group(n_heads, n_kv, kind, head_dim)
    heads = n_heads // n_kv if packed else heads_per_block(n_heads, n_kv, kind)
    # each kernel's split cap and block target
    cap, target = (MAX_SPLITS, attention_mma.SPLIT_BLOCKS) if packed else \
        (FLOAT_KERNEL_SPLITS, SPLIT_BLOCKS)
    n_splits = ws.splits(n_seqs, n_heads, n_heads // heads, cap, target, split_rows)
    if n_seqs * n_heads > ws.arrivals.size or q.size * n_splits > ws.part_acc.size:
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
    k_scales, v_scales = flat_scales(kind, scales, k_cache.size)
    if act is not None and int(np.prod(act.shape)) != out.size:
        raise ValueError(f"q8 activations of shape {act.shape} do not hold out {out.shape}")
    q8 = (act.xq, act.xd, act.xs) if act is not None else (_placeholder_i8(),) + \
        (_placeholder(),) * 2
    k_flat, v_flat = k_cache.reshape(k_cache.size), v_cache.reshape(v_cache.size)
    table = block_table.reshape(block_table.size)
    if packed:
        attention_mma.paged_decode(q, k_flat, v_flat, table, block_table.shape[1], row_seq,
                                   seq_lens, n_kv, block_size, float32(scale), ws, n_splits, out,
                                   act is not None, q8, stream)
        return
    _split_kernel(head_dim, kind, act is not None, heads)[(n_heads // heads, n_seqs, n_splits),
                                                          CHUNK, stream](
        q.reshape(q.size), k_flat, v_flat, k_scales, v_scales, table, block_table.shape[1],
        row_seq, seq_lens, n_kv, block_size, float32(scale), ws.part_m, ws.part_l, ws.part_acc,
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
