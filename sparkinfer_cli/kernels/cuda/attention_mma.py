"""Split-K decode attention with a kv head's query heads packed on tensor cores (F16 KV cache).

A block serves all G = n_heads / n_kv query heads of one kv head (G ≤ 8) for one query row and one
split of its keys, so each K and V row is read once per (row, split) instead of once per head group
(attention.py's kernel serves ≤ 2 heads a block). Each of the 4 warps walks its own 16-key tiles
of the split with its own online softmax:

  S^T (16 keys × 8 heads) = K_tile (16 × head_dim) · (q·scale)^T   mma.sync m16n8k16, f16 → f32
      the keys are the m dimension, the heads n (rows ≥ G of the staged q are zero); K rows are
      staged in shared memory (16-byte loads, half a 256-wide row at a time) for ldmatrix;
  P = softmax weights of S (per head: shuffles over the 8 lanes that share a head column);
  acc_h += P[h, j]·V_j on CUDA cores: lane l owns dims [l·head_dim/32, ...) of every head, each
      V load feeds all G heads.

Then the warps' (max, sum, Σ p·V) merge into the split's partial (attention.py's layout). A
second kernel merges a row's split partials, one block per (row, head, MERGE_DIMS dims): the
merge spread over many blocks, not left to the last split's block (one block reading 8 heads ×
64 splits of partials took longer than the scan itself).
Scores use q·scale rounded to f16 (as llama.cpp's tensor-core flash attention does); the softmax
and P·V stay float32.
"""

from __future__ import annotations

import functools
import math

from numba import cuda, float32, int64, uint32

from sparkinfer_cli.kernels.cuda.attention import (
    CHUNK,
    KV_F16,
    WARPS,
    _split_weights,
    _store_out,
)
from sparkinfer_cli.kernels.cuda.runtime.intrinsics import (
    LDMATRIX_ALIGN,
    bits_to_f32,
    chain_start,
    f16_bits_to_f32,
    ld_v2_u32,
    ld_v4_u32,
    ldmatrix_x4,
    ldmatrix_x4_pairs,
    mma_f16_f32,
    pack_f16x2,
)
from sparkinfer_cli.kernels.cuda.runtime.jit import device_function, kernel
from sparkinfer_cli.kernels.cuda.runtime.warp import shfl_xor

MAX_GROUP = 8  # query heads a kv head may serve here (one n8 tile)
TILE_KEYS = 16  # keys a warp scores at once (the mma's m)
# Blocks a launch aims for (kv heads × rows × splits; attention.py's is 1024): at long contexts
# more splits help a model of few kv heads and cost one of more (more partials to merge); this
# is the best compromise between the Qwen3.6 and Qwen3-30B shapes after 32,768 tokens
# (bench/probes/cuda_decode_attention_bench.py).
SPLIT_BLOCKS = 256
MERGE_DIMS = 64  # output dims of one head a merge block sums (2 a lane; 2 q8 blocks)
_MERGE_LOADS = 4  # splits whose partials a merge lane has in flight at once
# u32 words of V a lane holds at once: its dims of 8 keys (head_dim 256) or 16 (128), the first
# batch loaded before the tile's scores so their latency overlaps the K loads
_V_WORDS = 32
ROUND_KEYS = WARPS * TILE_KEYS  # keys the block's warps take in one round
STAGE_DIMS = 128  # K dims staged at once (shared memory: 4 warps × 16 rows × 272 bytes)
_NEG = float32(-1e30)  # "no key yet" (finite: fast math assumes no infinities)


def tensor_core_group(n_heads: int, n_kv: int, kind: int, head_dim: int) -> bool:
    """Whether this kernel serves the launch: an F16 cache, 2..MAX_GROUP query heads a kv head
    (one head a kv head gains nothing from sharing loads) and head_dim 128 or 256 (whole
    STAGE_DIMS rounds, a lane's V dims one 8- or 16-byte load, shared memory under 48 KB)."""
    group = n_heads // n_kv
    return kind == KV_F16 and 2 <= group <= MAX_GROUP and head_dim in (128, 256)


@device_function
def _split_len(seq_len, n_splits):
    """Keys per split of a row: whole rounds of the 4 warps' tiles (64 keys), as few as let
    n_splits splits cover seq_len (finer than attention.py's 128-key chunks: 512 keys spread over
    8 splits, not 4)."""
    per_split = max(1, (seq_len + n_splits - 1) // n_splits)
    return (per_split + ROUND_KEYS - 1) // ROUND_KEYS * ROUND_KEYS


@device_function
def _stage_q(q, row0, group, scale, head_dim, q_sh, q_words):
    """q_sh (16 rows × q_words u32): rows < group hold q·scale of the block's heads as f16 pairs,
    the rest zero. A thread takes 4 dims at a time, its loads all issued before their stores
    (a fixed trip count, rows ≥ group re-read the last head's and store zeros)."""
    quads = head_dim // 4
    x = cuda.local.array(4, float32)
    for it in range(16 * quads // CHUNK):
        i = it * CHUNK + cuda.threadIdx.x
        r, c = i // quads, i % quads
        w = ld_v4_u32(q, 4 * ((row0 + min(r, group - 1)) * head_dim + 4 * c))
        live = r < group
        for e in range(4):
            x[e] = bits_to_f32(w[e]) * scale if live else float32(0.0)
        at = uint32(r * q_words + 2 * c)
        q_sh[at] = pack_f16x2(x[0], x[1])
        q_sh[at + U1] = pack_f16x2(x[2], x[3])


@device_function
def _key_rows(row_sh, base, block_table, table, block_size, n_kv, kv_head, head_dim, k0, start,
              end):
    """row_sh[base + j] = element offset of key k0 + j's K/V row (keys past the split's end
    re-read its last key; lanes 0..15 of the warp write them)."""
    lane = cuda.threadIdx.x % 32
    if lane < TILE_KEYS:
        t, bs = uint32(max(min(k0 + lane, end - 1), start)), uint32(block_size)  # t ≥ 0
        blk = block_table[uint32(table + t // bs)]
        row_sh[uint32(base + lane)] = ((blk * block_size + t % bs) * n_kv + kv_head) * head_dim


@device_function
def _stage_k(k_cache, row_sh, rbase, d0, k_sh, kbase, k_words):
    """K dims [d0, d0 + STAGE_DIMS) of the warp's 16 keys → k_sh rows: lane l loads 16-byte piece
    l % 16 of rows l // 16, + 2, ..., + 14, all eight loads issued before the first store (a
    store right after its load would wait out each one's latency)."""
    lane = cuda.threadIdx.x % 32
    r, c = lane // 16, lane % 16  # STAGE_DIMS = 128: 16 pieces a row, 2 rows per 32 lanes
    off, rows = d0 + 8 * c, uint32(rbase + r)
    w0 = ld_v4_u32(k_cache, 2 * (row_sh[rows] + off))
    w1 = ld_v4_u32(k_cache, 2 * (row_sh[rows + uint32(2)] + off))
    w2 = ld_v4_u32(k_cache, 2 * (row_sh[rows + uint32(4)] + off))
    w3 = ld_v4_u32(k_cache, 2 * (row_sh[rows + uint32(6)] + off))
    w4 = ld_v4_u32(k_cache, 2 * (row_sh[rows + uint32(8)] + off))
    w5 = ld_v4_u32(k_cache, 2 * (row_sh[rows + uint32(10)] + off))
    w6 = ld_v4_u32(k_cache, 2 * (row_sh[rows + uint32(12)] + off))
    w7 = ld_v4_u32(k_cache, 2 * (row_sh[rows + uint32(14)] + off))
    at = kbase + r * k_words + 4 * c
    _store4(k_sh, at, w0)
    _store4(k_sh, at + 2 * k_words, w1)
    _store4(k_sh, at + 4 * k_words, w2)
    _store4(k_sh, at + 6 * k_words, w3)
    _store4(k_sh, at + 8 * k_words, w4)
    _store4(k_sh, at + 10 * k_words, w5)
    _store4(k_sh, at + 12 * k_words, w6)
    _store4(k_sh, at + 14 * k_words, w7)


# unsigned shared-memory indices: numba wraps signed ones around for negative values (a compare
# and select an access); these kernels' indices are never negative
U1, U2, U3 = uint32(1), uint32(2), uint32(3)


@device_function
def _store4(words, at, w):
    i = uint32(at)
    words[i], words[i + U1], words[i + U2], words[i + U3] = w[0], w[1], w[2], w[3]


@device_function
def _scores(k_cache, row_sh, rbase, head_dim, k_sh, kbase, k_words, q_sh, q_words):
    """The warp's S^T tile: (c0, c1) keys g, heads 2t, 2t+1; (c2, c3) key g + 8 (g, t = lane
    // 4, lane % 4). Barriers between staging rounds: every warp calls it."""
    c0, c1, c2, c3 = float32(0.0), float32(0.0), float32(0.0), float32(0.0)
    lane = cuda.threadIdx.x % 32
    for d0 in range(0, head_dim, STAGE_DIMS):
        _stage_k(k_cache, row_sh, rbase, d0, k_sh, kbase, k_words)
        cuda.syncthreads()
        for kk in range(0, STAGE_DIMS, 16):
            a = ldmatrix_x4(k_sh, 4 * kbase + 2 * kk, 4 * k_words, lane)
            b = ldmatrix_x4_pairs(q_sh, 2 * (d0 + kk), 4 * q_words, lane)  # heads 0-7: b0, b1
            c0, c1, c2, c3 = mma_f16_f32(a[0], a[1], a[2], a[3], b[0], b[1], c0, c1, c2, c3)
        cuda.syncthreads()  # before the next round restages k_sh
    return c0, c1, c2, c3


@device_function
def _group_max(v):
    """Max over the 8 lanes sharing lane % 4 (a head column of the tile)."""
    for offset in (4, 8, 16):
        v = max(v, shfl_xor(v, offset))
    return v


@device_function
def _group_sum(v):
    for offset in (4, 8, 16):
        v += shfl_xor(v, offset)
    return v


@device_function
def _softmax_column(s_top, s_bottom, live_top, live_bottom, m_run, l_run):
    """One head column's online-softmax step over the tile's keys g and g + 8: the new running
    max and sum, the rescale of the old accumulators, and the two weights."""
    s_top = s_top if live_top else _NEG
    s_bottom = s_bottom if live_bottom else _NEG
    m_new = max(m_run, _group_max(max(s_top, s_bottom)))
    corr = math.exp(m_run - m_new)
    p_top = math.exp(s_top - m_new) if live_top else float32(0.0)
    p_bottom = math.exp(s_bottom - m_new) if live_bottom else float32(0.0)
    return m_new, l_run * corr + _group_sum(p_top + p_bottom), corr, p_top, p_bottom


@device_function
def _load_v(v, v_cache, row_sh, rbase, j0, dim0, words):
    """v[words·j ...] ← the lane's V dims [dim0, dim0 + 2·words) of the batch's keys j0 + j,
    one 16- or 8-byte load a key, all issued before any is used."""
    for j in range(_V_WORDS // words):
        at = 2 * (row_sh[uint32(rbase + j0 + j)] + dim0)
        if words == 4:
            w = ld_v4_u32(v_cache, at)
            v[4 * j], v[4 * j + 1], v[4 * j + 2], v[4 * j + 3] = w[0], w[1], w[2], w[3]
        else:
            v[2 * j], v[2 * j + 1] = ld_v2_u32(v_cache, at)


@device_function
def _add_pv(acc, v, v_cache, row_sh, rbase, p_sh, pbase, dim0, per_lane, group):
    """acc[h·per_lane + e] += P[j, h]·V_j[dim0 + e] over the tile's 16 keys j (P = 0 past the
    end), in batches of _V_WORDS words: the first already in v (_load_v before the scores)."""
    words = per_lane // 2  # f16 pairs a lane takes of a V row
    batch = _V_WORDS // words  # keys a batch
    x = cuda.local.array(8, float32)  # one key's dims
    for j0 in range(0, TILE_KEYS, batch):
        if j0 > 0:
            _load_v(v, v_cache, row_sh, rbase, j0, dim0, words)
        for j in range(batch):
            for i in range(words):
                x[2 * i] = f16_bits_to_f32(v[words * j + i] & 0xFFFF)
                x[2 * i + 1] = f16_bits_to_f32(v[words * j + i] >> 16)
            for h in range(group):
                p = p_sh[pbase + (j0 + j) * MAX_GROUP + h]
                for e in range(per_lane):
                    acc[h * per_lane + e] += p * x[e]


@device_function
def _merge_warps(acc, m_run, l_run, ml_sh, acc_sh, row0, split, n_splits, group, head_dim,
                 per_lane, part_m, part_l, part_acc):
    """The 4 warps' softmax states → the split's partial per head: max M over the warps, sum
    Σ_w e^(m_w - M)·l_w, accumulator Σ_w e^(m_w - M)·acc_w. Each warp rescales its own
    accumulators, then a two-round tree adds them in registers, (w0 + w2) + (w1 + w3) (a fixed
    order: the same sums every run), through acc_sh (2 warps' accumulators); warp 0 stores."""
    tid, warp, lane = cuda.threadIdx.x, cuda.threadIdx.x // 32, cuda.threadIdx.x % 32
    t = lane % 4
    if lane < 4:  # lanes 0..3 hold head columns 2t, 2t + 1
        for i in range(2):
            ml_sh[warp * MAX_GROUP + 2 * t + i] = m_run[i]
            ml_sh[(WARPS + warp) * MAX_GROUP + 2 * t + i] = l_run[i]
    cuda.syncthreads()
    for h in range(group):
        top = _NEG
        for o in range(WARPS):
            top = max(top, ml_sh[o * MAX_GROUP + h])
        f = math.exp(ml_sh[warp * MAX_GROUP + h] - top)
        for e in range(per_lane):
            acc[h * per_lane + e] *= f
    dims = lane * per_lane
    for half in (WARPS // 2, WARPS // 4):  # warps [half, 2·half) hand theirs to warps [0, half)
        if half <= warp < 2 * half:
            for h in range(group):
                at = ((warp - half) * group + h) * head_dim + dims
                for e in range(per_lane):
                    acc_sh[at + e] = acc[h * per_lane + e]
        cuda.syncthreads()
        if warp < half:
            for h in range(group):
                at = (warp * group + h) * head_dim + dims
                for e in range(per_lane):
                    acc[h * per_lane + e] += acc_sh[at + e]
        cuda.syncthreads()  # read before the next round rewrites acc_sh
    if warp == 0:
        for h in range(group):
            for e in range(per_lane):
                part_acc[((row0 + h) * n_splits + split) * head_dim + dims + e] = \
                    acc[h * per_lane + e]
    if tid < group:
        top = _NEG
        for o in range(WARPS):
            top = max(top, ml_sh[o * MAX_GROUP + tid])
        total = float32(0.0)
        for o in range(WARPS):
            total += math.exp(ml_sh[o * MAX_GROUP + tid] - top) * ml_sh[(WARPS + o) * MAX_GROUP
                                                                         + tid]
        part_m[(row0 + tid) * n_splits + split] = top
        part_l[(row0 + tid) * n_splits + split] = total


@device_function
def _scan_tiles(q_sh, q_words, k_cache, v_cache, block_table, table, block_size, n_kv, kv_head,
                head_dim, group, start, end, row_sh, k_sh, k_words, p_sh, corr_sh, acc, m_run,
                l_run):
    """Warp w's online softmax over tiles w, w + 4, ... of keys [start, end); every warp makes
    the same number of rounds (tiles past the end score nothing) for the barriers inside."""
    warp, lane = cuda.threadIdx.x // 32, cuda.threadIdx.x % 32
    g, t = lane // 4, lane % 4
    per_lane = head_dim // 32
    rbase, kbase, pbase = warp * TILE_KEYS, warp * TILE_KEYS * k_words, warp * TILE_KEYS * MAX_GROUP
    n_tiles = (end - start + TILE_KEYS - 1) // TILE_KEYS
    v = cuda.local.array(_V_WORDS, uint32)  # a batch of the lane's V words
    for r in range(0, n_tiles, WARPS):
        k0 = start + (r + warp) * TILE_KEYS
        _key_rows(row_sh, rbase, block_table, table, block_size, n_kv, kv_head, head_dim, k0,
                  start, end)
        cuda.syncthreads()
        _load_v(v, v_cache, row_sh, rbase, 0, lane * per_lane, per_lane // 2)
        c0, c1, c2, c3 = _scores(k_cache, row_sh, rbase, head_dim, k_sh, kbase, k_words, q_sh,
                                 q_words)
        live_top, live_bottom = k0 + g < end, k0 + g + 8 < end
        m0, l0, corr0, p00, p10 = _softmax_column(c0, c2, live_top, live_bottom, m_run[0],
                                                  l_run[0])
        m1, l1, corr1, p01, p11 = _softmax_column(c1, c3, live_top, live_bottom, m_run[1],
                                                  l_run[1])
        m_run[0], l_run[0], m_run[1], l_run[1] = m0, l0, m1, l1
        p = uint32(pbase + g * MAX_GROUP + 2 * t)  # p_sh: (warps, 16 keys, MAX_GROUP heads)
        p_sh[p], p_sh[p + U1] = p00, p01
        p_sh[p + uint32(8 * MAX_GROUP)], p_sh[p + uint32(8 * MAX_GROUP + 1)] = p10, p11
        c = uint32(warp * MAX_GROUP + 2 * t)
        if g == 0:
            corr_sh[c], corr_sh[c + U1] = corr0, corr1
        cuda.syncthreads()  # p_sh, corr_sh written
        for h in range(group):  # every lane rescales its dims of every head
            corr = corr_sh[uint32(warp * MAX_GROUP + h)]
            for e in range(per_lane):
                acc[h * per_lane + e] *= corr
        _add_pv(acc, v, v_cache, row_sh, rbase, p_sh, pbase, lane * per_lane, per_lane, group)
        cuda.syncthreads()  # before the next round rewrites row_sh / p_sh


@functools.cache
def gqa_kernel(head_dim: int, group: int):
    per_lane = head_dim // 32
    q_words, k_words = head_dim // 2 + 4, STAGE_DIMS // 2 + 4  # padded rows: ldmatrix, no conflicts
    acc_len = MAX_GROUP * per_lane
    # shared / local array sizes must be compile-time constants
    q_len, k_len, rows_len = 16 * q_words, ROUND_KEYS * k_words, ROUND_KEYS
    p_len, corr_len = ROUND_KEYS * MAX_GROUP, WARPS * MAX_GROUP
    ml_len = 2 * corr_len
    acc_sh_len = WARPS // 2 * group * head_dim  # the merge tree's first round

    @kernel(fastmath=True)
    def decode_gqa(q, k_cache, v_cache, block_table, max_blocks, row_seq, seq_lens, n_kv,
                   block_size, scale, part_m, part_l, part_acc):
        chain_start()
        # One block per (kv head, query row, split), as attention.py's decode_split with `group`
        # heads a block: it stores the split's partials (merge_kernel adds them up).
        kv_head, seq, split = cuda.blockIdx.x, cuda.blockIdx.y, cuda.blockIdx.z
        n_splits = cuda.gridDim.z
        row0 = seq * n_kv * group + kv_head * group
        q_sh = cuda.shared.array(q_len, uint32, alignment=LDMATRIX_ALIGN)
        k_sh = cuda.shared.array(k_len, uint32, alignment=LDMATRIX_ALIGN)
        row_sh = cuda.shared.array(rows_len, int64)
        p_sh = cuda.shared.array(p_len, float32)
        ml_sh = cuda.shared.array(ml_len, float32)  # the warps' (max, sum)
        corr_sh = cuda.shared.array(corr_len, float32)
        acc_sh = cuda.shared.array(acc_sh_len, float32)
        acc = cuda.local.array(acc_len, float32)
        m_run, l_run = cuda.local.array(2, float32), cuda.local.array(2, float32)
        seq_len = seq_lens[seq]
        split_len = _split_len(seq_len, n_splits)
        if split * split_len < seq_len:  # block-uniform: the split holds keys
            _stage_q(q, row0, group, scale, head_dim, q_sh, q_words)
            for e in range(acc_len):
                acc[e] = 0.0
            for i in range(2):
                m_run[i], l_run[i] = _NEG, 0.0
            _scan_tiles(q_sh, q_words, k_cache, v_cache, block_table, row_seq[seq] * max_blocks,
                        block_size, n_kv, kv_head, head_dim, group, split * split_len,
                        min(seq_len, (split + 1) * split_len), row_sh, k_sh, k_words, p_sh,
                        corr_sh, acc, m_run, l_run)
            _merge_warps(acc, m_run, l_run, ml_sh, acc_sh, row0, split, n_splits, group,
                         head_dim, per_lane, part_m, part_l, part_acc)
    return decode_gqa


@functools.cache
def merge_kernel(head_dim: int, quantize: bool):
    sum_len = WARPS * MERGE_DIMS  # shared / local array sizes must be compile-time constants

    @kernel(fastmath=True)
    def merge_splits(seq_lens, part_m, part_l, part_acc, n_splits, out, xq, xd, xs):
        chain_start()
        # One block per (head, query row, MERGE_DIMS dims of the head): out = Σ_s w_s·acc_s over
        # the row's splits that hold keys (_split_weights: w_s = e^(m_s - m) / Σ e^(m_s' - m)·l_s';
        # none: 0). Warp w sums splits w, w + 4, ... for 2 dims a lane, _MERGE_LOADS at once.
        head, seq, z = cuda.blockIdx.x, cuda.blockIdx.y, cuda.blockIdx.z
        row = seq * cuda.gridDim.x + head
        warp, lane = cuda.threadIdx.x // 32, cuda.threadIdx.x % 32
        weight_sh = cuda.shared.array(CHUNK, float32)
        sum_sh = cuda.shared.array(sum_len, float32)  # (warps, dims)
        seq_len = seq_lens[seq]
        split_len = _split_len(seq_len, n_splits)
        n_active = (seq_len + split_len - 1) // split_len
        if warp == 0:
            _split_weights(row, n_active, n_splits, part_m, part_l, weight_sh, 0)
        cuda.syncthreads()
        at = row * n_splits * head_dim + z * MERGE_DIMS + 2 * lane  # split 0's dims
        a0, a1 = float32(0.0), float32(0.0)
        for s0 in range(warp, n_active, _MERGE_LOADS * WARPS):
            for u in range(_MERGE_LOADS):
                s = s0 + u * WARPS
                live = s < n_active
                ss = s if live else s0  # past the end: re-read a live split with weight 0
                lo, hi = ld_v2_u32(part_acc, 4 * (at + ss * head_dim))
                w = weight_sh[ss] if live else float32(0.0)
                a0 += w * bits_to_f32(lo)
                a1 += w * bits_to_f32(hi)
        sum_sh[warp * MERGE_DIMS + 2 * lane] = a0
        sum_sh[warp * MERGE_DIMS + 2 * lane + 1] = a1
        cuda.syncthreads()
        if warp < MERGE_DIMS // 32:  # warp-uniform: each stores one 32-dim q8 block
            i = warp * 32 + lane
            v = float32(0.0)
            for w in range(WARPS):
                v += sum_sh[w * MERGE_DIMS + i]
            _store_out(v, row * head_dim + z * MERGE_DIMS + i, out, quantize, xq, xd, xs)
    return merge_splits


def paged_decode(q, k_cache, v_cache, block_table, max_blocks, row_seq, seq_lens, n_kv,
                 block_size, scale, ws, n_splits: int, out, quantize: bool, q8: tuple,
                 stream) -> None:
    """attention.paged_decode_attention on tensor cores (flat caches and table as it passes
    them): the scan's partials in ws, then their merge into out (and its q8 form q8 = (xq, xd,
    xs) when quantize)."""
    n_seqs, n_heads, head_dim = q.shape
    group = n_heads // n_kv
    gqa_kernel(head_dim, group)[(n_kv, n_seqs, n_splits), CHUNK, stream](
        q.reshape(q.size), k_cache, v_cache, block_table, max_blocks, row_seq, seq_lens, n_kv,
        block_size, scale, ws.part_m, ws.part_l, ws.part_acc)
    merge_kernel(head_dim, quantize)[
        (n_heads, n_seqs, head_dim // MERGE_DIMS), CHUNK, stream](
        seq_lens, ws.part_m, ws.part_l, ws.part_acc, n_splits, out.reshape(out.size), *q8)
