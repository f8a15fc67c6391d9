"""Causal prefill attention on tensor cores over a paged F16 KV cache (flash attention, mma.sync).

attention_prefill.py computes a prompt's scores and P·V in float32 on CUDA cores; a long prompt
then spends most of its time there (attention work grows with the square of its length). This
kernel takes the same inputs and rows and does both products with mma.sync m16n8k16 (f16 inputs,
f32 sums), the way llama.cpp's and FlashAttention-2's kernels do:

- A block owns ROWS = 128 query rows, packed as attention_prefill packs them: the G = n_heads /
  n_kv q heads that share one kv head times 128 / G consecutive tokens, so every staged K/V tile
  serves all of a kv head's query heads. A warp owns 16 rows.
- Q (scaled, rounded to f16) is staged once, through the K/V tiles' space, and held in registers
  as A fragments.
- Per tile of KT keys, K and V rows are staged in shared memory as they lie in the cache (row
  stride padded by 16 bytes so that ldmatrix's 8 rows hit distinct banks). Each thread loads its
  share of the next tile into registers before the warps multiply this one, and stores it after
  (the loads' latency hides behind the mma work). Each warp computes
  S = Q·Kᵀ (K rows are B's columns: plain ldmatrix), masks keys at or past each row's seq_len,
  updates its rows' running max and sum (online softmax, the sum kept per lane and added across
  the row's 4 lanes at the end), rescales O, and adds P·V with P taken straight from S's
  accumulators (an m16n8 C tile pair is an m16k16 A fragment) and V read by ldmatrix .trans.
- A tile of rows may hold the end of one sequence and the start of the next: the block runs once
  per run of rows with one sequence (attention_prefill's group_end / query_rows).

Scores use q·scale rounded to f16 and P rounded to f16 (as llama.cpp's tensor-core flash attention
does); the softmax statistics and O stay float32.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import numpy as np
from numba import cuda, float32, int32, int64, uint32

from sparkinfer_cli.kernels.cuda.attention_prefill import (
    MASKED,
    checked_inputs,
    group_end,
    query_rows,
)
from sparkinfer_cli.kernels.cuda.mma_fragments import mma_into
from sparkinfer_cli.kernels.cuda.runtime.intrinsics import (
    IS_SIMULATOR,
    LDMATRIX_ALIGN,
    bits_to_f32,
    chain_start,
    ld_v4_u32,
    ldmatrix_x4,
    ldmatrix_x4_pairs,
    ldmatrix_x4_trans,
    pack_f16x2,
)
from sparkinfer_cli.kernels.cuda.runtime.jit import device_function, kernel
from sparkinfer_cli.kernels.cuda.runtime.launch import cdiv
from sparkinfer_cli.kernels.cuda.runtime.warp import shfl_xor

# keys a tile: the K and V tiles (padded rows) must fit the 48 KiB of static shared memory
KEYS_A_TILE = {128: 64, 256: 32}
HEAD_DIMS = tuple(KEYS_A_TILE)
# query rows a block, a warp per 16: the more rows share a staged K/V tile, the fewer loads a
# multiply-add; Q is staged through the tiles' space in passes of 2 · KEYS_A_TILE rows
ROWS = 128
# whether a thread loads the next K/V tile into registers while the warps multiply this one:
# measured on the H200, it pays at head_dim 256 (15 % at 4k and 32k tokens) and at 128 only for
# short prompts (16 % faster at 4k, 14 % slower at 32k: the extra registers)
PREFETCH = {128: False, 256: True}
WARPS = ROWS // 16
THREADS = 32 * WARPS


class _Geometry(NamedTuple):
    """A head_dim's tile sizes (compile-time constants of its kernel)."""

    head_dim: int
    kt: int  # keys a tile
    row_words: int  # u32 words of a staged f16 row: head_dim / 2 + 16 bytes of padding
    v_at: int  # word where the V tile starts (the K tile at 0)
    chunks: int  # 16-byte chunks of a cached row
    q_pass: int  # Q rows staged at once in the tiles' space
    per_thread: int  # 16-byte chunks of each of K and V a thread stages a tile
    prefetch: bool

    @property
    def row_bytes(self) -> int:
        return 4 * self.row_words


@functools.cache
def _geometry(head_dim: int) -> _Geometry:
    kt, row_words = KEYS_A_TILE[head_dim], head_dim // 2 + 4
    chunks = head_dim // 8
    return _Geometry(head_dim, kt, row_words, kt * row_words, chunks, 2 * kt,
                     kt * chunks // THREADS, PREFETCH[head_dim])


@functools.cache
def _q_staging(head_dim: int):
    """load_q_fragments: a warp's 16 rows of scale·Q as A fragments, staged through the tiles."""
    geo = _geometry(head_dim)
    chunks, q_pass, row_words, row_bytes = geo.chunks, geo.q_pass, geo.row_words, geo.row_bytes
    d16 = head_dim // 16

    @device_function(numba_inline=True)
    def stage_q(tiles, q, qrow_sh, first, scale):
        """Tile rows 0..q_pass-1 ← scale·Q of the block's rows first.. rounded to f16 (zeros for
        rows not live)."""
        for i in range(cuda.threadIdx.x, q_pass * chunks, THREADS):
            r, c = i // chunks, i % chunks
            off = qrow_sh[first + r]
            at = r * row_words + 4 * c
            for h in range(2):  # 4 floats → 2 f16x2 words, twice
                if off >= 0:
                    x = ld_v4_u32(q, 4 * (off + 8 * c + 4 * h))
                    tiles[at + 2 * h] = pack_f16x2(bits_to_f32(x[0]) * scale,
                                                   bits_to_f32(x[1]) * scale)
                    tiles[at + 2 * h + 1] = pack_f16x2(bits_to_f32(x[2]) * scale,
                                                       bits_to_f32(x[3]) * scale)
                else:
                    tiles[at + 2 * h] = uint32(0)
                    tiles[at + 2 * h + 1] = uint32(0)

    @device_function(numba_inline=True)
    def load_q_fragments(qf, tiles, q, qrow_sh, scale, warp, lane):
        for first in range(0, ROWS, q_pass):
            cuda.syncthreads()  # the tiles' space is free
            stage_q(tiles, q, qrow_sh, first, scale)
            cuda.syncthreads()
            if first <= 16 * warp < first + q_pass:
                for kk in range(d16):
                    f = ldmatrix_x4(tiles, (16 * warp - first) * row_bytes + 32 * kk, row_bytes,
                                    lane)
                    for e in range(4):
                        qf[4 * kk + e] = f[e]
    return load_q_fragments


@functools.cache
def _kv_staging(head_dim: int):
    """(fetch_kv, put_kv): a K/V tile from the paged cache into registers, then shared memory."""
    geo = _geometry(head_dim)
    chunks, per_thread, row_words, v_at = geo.chunks, geo.per_thread, geo.row_words, geo.v_at

    @device_function(numba_inline=True)
    def fetch_kv(pre, caches, block_table, table, k0, kend, block_size, n_kv, kv_head):
        """pre ← this thread's chunks of the K and V rows of keys k0..k0+kt (zeros past kend:
        a zero V row times p = 0 adds nothing); the loads stay in flight until put_kv."""
        for u in range(per_thread):
            i = cuda.threadIdx.x + u * THREADS
            key = k0 + i // chunks
            if key < kend:
                blk = int64(block_table[table + key // block_size])
                off = (((blk * block_size + key % block_size) * n_kv + kv_head) * head_dim
                       + 8 * (i % chunks))
                kw = ld_v4_u32(caches[0], 2 * off)
                vw = ld_v4_u32(caches[1], 2 * off)
                for e in range(4):
                    pre[8 * u + e] = kw[e]
                    pre[8 * u + 4 + e] = vw[e]
            else:
                for e in range(8):
                    pre[8 * u + e] = uint32(0)

    @device_function(numba_inline=True)
    def put_kv(tiles, pre):
        """The K tile at word 0 and the V tile at v_at ← the chunks fetch_kv loaded."""
        for u in range(per_thread):
            i = cuda.threadIdx.x + u * THREADS
            at = (i // chunks) * row_words + 4 * (i % chunks)
            for e in range(4):
                tiles[at + e] = pre[8 * u + e]
                tiles[v_at + at + e] = pre[8 * u + 4 + e]
    return fetch_kv, put_kv


@functools.cache
def _products(head_dim: int):
    """(scores, add_pv): a warp's S = Q·Kᵀ over the staged K tile and O += P·V."""
    geo = _geometry(head_dim)
    row_bytes, v_at = geo.row_bytes, geo.v_at
    d16, k16, n_s = head_dim // 16, geo.kt // 16, geo.kt // 2

    @device_function(numba_inline=True)
    def scores(s, qf, tiles, lane):
        """s (kt / 8 n8 tiles × 4) ← this warp's 16 rows of Q·Kᵀ."""
        for e in range(n_s):
            s[e] = float32(0.0)
        for n in range(k16):
            for kk in range(d16):
                b = ldmatrix_x4_pairs(tiles, 16 * n * row_bytes + 32 * kk, row_bytes, lane)
                a = (qf[4 * kk], qf[4 * kk + 1], qf[4 * kk + 2], qf[4 * kk + 3])
                mma_into(s, 8 * n, a, b[0], b[1])
                mma_into(s, 8 * n + 4, a, b[2], b[3])

    @device_function(numba_inline=True)
    def add_pv(o, s, tiles, lane):
        """o += P·V: P from s (two n8 tiles of keys = one k16 A fragment), V by ldmatrix .trans."""
        for j in range(k16):
            a = (pack_f16x2(s[8 * j], s[8 * j + 1]), pack_f16x2(s[8 * j + 2], s[8 * j + 3]),
                 pack_f16x2(s[8 * j + 4], s[8 * j + 5]), pack_f16x2(s[8 * j + 6], s[8 * j + 7]))
            for n in range(d16):
                b = ldmatrix_x4_trans(tiles, 4 * v_at + 16 * j * row_bytes + 32 * n, row_bytes,
                                      lane)
                mma_into(o, 8 * n, a, b[0], b[1])
                mma_into(o, 8 * n + 4, a, b[2], b[3])
    return scores, add_pv


@functools.cache
def _softmax(head_dim: int):
    """softmax_row: one of a lane's two rows through a tile's online-softmax update."""
    kt = KEYS_A_TILE[head_dim]

    @device_function(numba_inline=True)
    def softmax_row(s, o, k0, lim, m, total, half, t):
        """Row `half` (0: row g, 1: g + 8) of the tile: mask keys at or past lim, s ← exp(s − the
        new running max), O and the lane's running sum rescaled; returns (max, sum)."""
        tile_max = float32(MASKED)
        for nt in range(kt // 8):
            for e in range(2):
                i = 4 * nt + 2 * half + e
                if k0 + 8 * nt + 2 * t + e >= lim:
                    s[i] = float32(MASKED)
                tile_max = max(tile_max, s[i])
        tile_max = max(tile_max, shfl_xor(tile_max, 1))  # the row's 4 lanes agree
        new_m = max(m, max(tile_max, shfl_xor(tile_max, 2)))
        corr = math.exp(m - new_m)
        total *= corr
        for nt in range(kt // 8):
            for e in range(2):
                i = 4 * nt + 2 * half + e
                s[i] = math.exp(s[i] - new_m)
                total += s[i]
        for nd in range(head_dim // 8):
            o[4 * nd + 2 * half] *= corr
            o[4 * nd + 2 * half + 1] *= corr
        return new_m, total
    return softmax_row


@functools.cache
def _write_rows(head_dim: int):
    @device_function(numba_inline=True)
    def write_rows(out, o, qrow_sh, row, half, total, t):
        """out's row `row` ← O / the row's sum (total: this lane's; the row's 4 lanes add up)."""
        total += shfl_xor(total, 1)
        total += shfl_xor(total, 2)
        off = qrow_sh[row]
        if off >= 0:
            inv = float32(1.0) / total
            for nd in range(head_dim // 8):
                out[off + 8 * nd + 2 * t] = o[4 * nd + 2 * half] * inv
                out[off + 8 * nd + 2 * t + 1] = o[4 * nd + 2 * half + 1] * inv
    return write_rows


@functools.cache
def _flash_kernel(head_dim: int):
    geo = _geometry(head_dim)
    kt, prefetch, tile_words, n_pre = geo.kt, geo.prefetch, 2 * geo.v_at, 8 * geo.per_thread
    n_s, n_o, n_q = geo.kt // 2, head_dim // 2, head_dim // 4
    load_q_fragments, (fetch_kv, put_kv) = _q_staging(head_dim), _kv_staging(head_dim)
    (scores, add_pv), softmax_row = _products(head_dim), _softmax(head_dim)
    write_rows = _write_rows(head_dim)

    @kernel(fastmath=True, **({} if IS_SIMULATOR else {"launch_bounds": (THREADS, 1)}))
    def flash(q, k_cache, v_cache, block_table, max_blocks, row_seq, seq_lens, n_rows, n_kv,
              block_size, scale, out):
        chain_start()
        group = q.size // (n_rows * head_dim) // n_kv
        base = (cuda.gridDim.x - 1 - cuda.blockIdx.x) * (ROWS // group)  # longest tiles first
        n_tok, kv_head = min(ROWS // group, n_rows - base), cuda.blockIdx.y
        warp, lane = cuda.threadIdx.x >> 5, cuda.threadIdx.x & 31
        tiles = cuda.shared.array(tile_words, uint32, alignment=LDMATRIX_ALIGN)
        # NOTE: one shared array a line: the simulator tells them apart by their line
        qrow_sh = cuda.shared.array(ROWS, int64)
        lim_sh = cuda.shared.array(ROWS, int32)
        pre = cuda.local.array(n_pre, uint32)  # a tile's K/V chunks on their way to the tiles
        qf = cuda.local.array(n_q, uint32)  # the warp's Q rows as A fragments, k16 chunks
        s = cuda.local.array(n_s, float32)  # S, then P, of the warp's rows × the tile's keys
        o = cuda.local.array(n_o, float32)  # O of the warp's rows × head_dim
        row_lo, kv = 16 * warp + (lane >> 2), (k_cache, v_cache)
        a = 0
        while a < n_tok:
            b = group_end(row_seq, base, a, n_tok)
            cuda.syncthreads()  # the previous run is done with the shared arrays
            kend = query_rows(qrow_sh, lim_sh, ROWS, seq_lens, base, a, b, group * n_kv,
                              kv_head, group, head_dim)
            table = row_seq[base + a] * max_blocks
            if prefetch:
                fetch_kv(pre, kv, block_table, table, 0, kend, block_size, n_kv, kv_head)
            load_q_fragments(qf, tiles, q, qrow_sh, scale, warp, lane)
            m_lo, m_hi, sum_lo, sum_hi = float32(MASKED), float32(MASKED), float32(0), float32(0)
            for e in range(n_o):
                o[e] = float32(0.0)
            for k0 in range(0, kend, kt):
                cuda.syncthreads()  # every warp is done with the previous tile (or Q)
                if not prefetch:
                    fetch_kv(pre, kv, block_table, table, k0, kend, block_size, n_kv, kv_head)
                put_kv(tiles, pre)
                if prefetch and k0 + kt < kend:  # the next tile's loads fly during this one
                    fetch_kv(pre, kv, block_table, table, k0 + kt, kend, block_size, n_kv,
                             kv_head)
                cuda.syncthreads()
                scores(s, qf, tiles, lane)
                m_lo, sum_lo = softmax_row(s, o, k0, lim_sh[row_lo], m_lo, sum_lo, 0, lane & 3)
                m_hi, sum_hi = softmax_row(s, o, k0, lim_sh[row_lo + 8], m_hi, sum_hi, 1,
                                           lane & 3)
                add_pv(o, s, tiles, lane)
            write_rows(out, o, qrow_sh, row_lo, 0, sum_lo, lane & 3)
            write_rows(out, o, qrow_sh, row_lo + 8, 1, sum_hi, lane & 3)
            a = b
    return flash


def supports(n_heads: int, n_kv: int, head_dim: int, cache_dtype) -> bool:
    """Whether this kernel takes the shape and cache (else attention_prefill's float32 kernel)."""
    return (head_dim in HEAD_DIMS and np.dtype(cache_dtype) == np.float16
            and n_heads % n_kv == 0 and ROWS % (n_heads // n_kv) == 0)


def flash_prefill_attention(q, k_cache, v_cache, block_table, seq_lens, out,
                            scale: float | None = None, stream=0, row_seq=None,
                            scales=None) -> None:
    """attention_prefill.prefill_attention's contract on tensor cores, for F16 caches, head_dim
    128 or 256 and n_heads / n_kv dividing 64 (`supports`). scales must be None (no int8)."""
    n_rows, n_heads, head_dim = q.shape
    _, block_size, n_kv, _ = k_cache.shape
    row_seq, scale = checked_inputs(q, k_cache, v_cache, block_table, seq_lens, out, row_seq,
                                    scale)
    if not supports(n_heads, n_kv, head_dim, k_cache.dtype) or scales is not None:
        raise ValueError(f"tensor-core prefill attention takes an f16 cache, head_dim in "
                         f"{HEAD_DIMS} and n_heads / n_kv dividing {ROWS}; got "
                         f"{k_cache.dtype}, head_dim {head_dim}, {n_heads} / {n_kv} heads")
    grid = (cdiv(n_rows, ROWS // (n_heads // n_kv)), n_kv)
    _flash_kernel(head_dim)[grid, THREADS, stream](
        q.reshape(q.size), k_cache.reshape(k_cache.size), v_cache.reshape(v_cache.size),
        block_table.reshape(block_table.size), block_table.shape[1], row_seq, seq_lens, n_rows,
        n_kv, block_size, float32(scale), out.reshape(out.size))
