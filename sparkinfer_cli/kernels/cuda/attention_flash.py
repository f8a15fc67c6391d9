"""Causal prefill attention on tensor cores over a paged F16 KV cache (flash attention, mma.sync).

attention_prefill.py computes a prompt's scores and P·V in float32 on CUDA cores; a long prompt
then spends most of its time there (attention work grows with the square of its length). This
kernel takes the same inputs and rows and does both products with mma.sync m16n8k16 (f16 inputs,
f32 sums), the way llama.cpp's and FlashAttention-2's kernels do:

- A block owns ROWS query rows (128 at head_dim 128, 64 at 256), packed as attention_prefill packs
  them: the G = n_heads / n_kv q heads that share one kv head times ROWS / G consecutive tokens,
  so every staged K/V tile serves all of a kv head's query heads. A warp owns 16 rows.
- Q (scaled, rounded to f16) is staged once and held in registers as A fragments.
- Per tile of KT keys, K and V rows are staged in shared memory as they lie in the cache (row
  stride padded by 16 bytes so that ldmatrix's 8 rows hit distinct banks); then each warp computes
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

import numpy as np
from numba import cuda, float32, int32, int64, uint32

from sparkinfer_cli.kernels.cuda.attention_prefill import (
    MASKED,
    checked_inputs,
    group_end,
    key_rows,
    query_rows,
)
from sparkinfer_cli.kernels.cuda.intrinsics import (
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
from sparkinfer_cli.kernels.cuda.jit import device_function, kernel
from sparkinfer_cli.kernels.cuda.launch import cdiv
from sparkinfer_cli.kernels.cuda.mma_gemm import mma_into
from sparkinfer_cli.kernels.cuda.warp import shfl_xor

# keys a tile: the K and V tiles (padded rows) must fit the 48 KiB of static shared memory
KEYS_A_TILE = {128: 64, 256: 32}
HEAD_DIMS = tuple(KEYS_A_TILE)
# query rows a block: as many as Q staged in the K and V tiles' space holds (the more rows share
# a staged tile, the fewer loads a multiply-add); a warp per 16 rows
ROWS = {d: 2 * kt for d, kt in KEYS_A_TILE.items()}
MAX_GROUP = min(ROWS.values())  # q heads a kv head: whole tokens in every block's rows


def _threads(head_dim: int) -> int:
    return 32 * ROWS[head_dim] // 16


def _row_words(head_dim: int) -> int:
    """u32 words of a staged f16 row: head_dim / 2 plus 16 bytes of padding."""
    return head_dim // 2 + 4


@functools.cache
def _flash_kernel(head_dim: int):
    kt = KEYS_A_TILE[head_dim]
    row_words = _row_words(head_dim)
    row_bytes = 4 * row_words
    v_at = kt * row_words  # word where the V tile starts (the K tile at 0)
    tile_words = 2 * v_at
    chunks = head_dim // 8  # 16-byte chunks of a cached row
    d16, k16 = head_dim // 16, kt // 16
    n_s, n_o, n_q = 4 * kt // 8, 4 * head_dim // 8, 4 * d16
    rows, threads = ROWS[head_dim], _threads(head_dim)

    @device_function(numba_inline=True)
    def stage_q(tiles, q, qrow_sh, scale):
        """The block's rows of the tiles ← scale·Q rounded to f16 (zeros for rows not live)."""
        for i in range(cuda.threadIdx.x, rows * chunks, threads):
            r, c = i // chunks, i % chunks
            off = qrow_sh[r]
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
    def stage_kv(tiles, k_cache, v_cache, krow_sh):
        """The K tile at word 0 and the V tile at v_at ← the cached rows of the tile's keys
        (zeros past the last key: a zero V row times p = 0 adds nothing)."""
        for i in range(cuda.threadIdx.x, kt * chunks, threads):
            j, c = i // chunks, i % chunks
            off = krow_sh[j]
            at = j * row_words + 4 * c
            if off >= 0:
                kw = ld_v4_u32(k_cache, 2 * (off + 8 * c))
                vw = ld_v4_u32(v_cache, 2 * (off + 8 * c))
                for e in range(4):
                    tiles[at + e] = kw[e]
                    tiles[v_at + at + e] = vw[e]
            else:
                for e in range(4):
                    tiles[at + e] = uint32(0)
                    tiles[v_at + at + e] = uint32(0)

    @device_function(numba_inline=True)
    def scores(s, qf, tiles, lane):
        """s (kt / 8 n8 tiles × 4) ← this warp's 16 rows of Q·Kᵀ over the staged K tile."""
        for e in range(n_s):
            s[e] = float32(0.0)
        for n in range(k16):
            for kk in range(d16):
                b = ldmatrix_x4_pairs(tiles, 16 * n * row_bytes + 32 * kk, row_bytes, lane)
                a = (qf[4 * kk], qf[4 * kk + 1], qf[4 * kk + 2], qf[4 * kk + 3])
                mma_into(s, 8 * n, a, b[0], b[1])
                mma_into(s, 8 * n + 4, a, b[2], b[3])

    @device_function(numba_inline=True)
    def row_max(s, k0, lim, half, t):
        """Mask this lane's keys at or past lim in its row `half` (0: row g, 1: g + 8) and return
        the row's max over the tile (the 4 lanes of a row agree)."""
        m = float32(MASKED)
        for nt in range(kt // 8):
            for e in range(2):
                i = 4 * nt + 2 * half + e
                if k0 + 8 * nt + 2 * t + e >= lim:
                    s[i] = float32(MASKED)
                m = max(m, s[i])
        m = max(m, shfl_xor(m, 1))
        return max(m, shfl_xor(m, 2))

    @device_function(numba_inline=True)
    def exponentiate(s, m, half):
        """s ← exp(s - m) in row `half`; returns the lane's sum of them."""
        total = float32(0.0)
        for nt in range(kt // 8):
            for e in range(2):
                i = 4 * nt + 2 * half + e
                s[i] = math.exp(s[i] - m)
                total += s[i]
        return total

    @device_function(numba_inline=True)
    def rescale(o, corr, half):
        for nd in range(head_dim // 8):
            o[4 * nd + 2 * half] *= corr
            o[4 * nd + 2 * half + 1] *= corr

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

    @device_function(numba_inline=True)
    def write_rows(out, o, qrow_sh, row, half, total, t):
        off = qrow_sh[row]
        if off >= 0:
            inv = float32(1.0) / total
            for nd in range(head_dim // 8):
                out[off + 8 * nd + 2 * t] = o[4 * nd + 2 * half] * inv
                out[off + 8 * nd + 2 * t + 1] = o[4 * nd + 2 * half + 1] * inv

    @kernel(fastmath=True, **({} if IS_SIMULATOR else {"launch_bounds": (threads, 1)}))
    def flash(q, k_cache, v_cache, block_table, max_blocks, row_seq, seq_lens, n_rows, n_kv,
              block_size, scale, out):
        chain_start()
        n_heads = q.size // (n_rows * head_dim)
        group = n_heads // n_kv
        base = (cuda.gridDim.x - 1 - cuda.blockIdx.x) * (rows // group)  # longest tiles first
        n_tok, kv_head = min(rows // group, n_rows - base), cuda.blockIdx.y
        warp, lane = cuda.threadIdx.x >> 5, cuda.threadIdx.x & 31
        g, t = lane >> 2, lane & 3
        tiles = cuda.shared.array(tile_words, uint32, alignment=LDMATRIX_ALIGN)
        krow_sh = cuda.shared.array(kt, int64)
        qrow_sh = cuda.shared.array(rows, int64)
        lim_sh = cuda.shared.array(rows, int32)
        qf = cuda.local.array(n_q, uint32)  # the warp's Q rows as A fragments, k16 chunks
        s = cuda.local.array(n_s, float32)  # S, then P, of the warp's rows × the tile's keys
        o = cuda.local.array(n_o, float32)  # O of the warp's rows × head_dim
        a = 0
        while a < n_tok:
            b = group_end(row_seq, base, a, n_tok)
            cuda.syncthreads()  # the previous run is done with the shared arrays
            kend = query_rows(qrow_sh, lim_sh, rows, seq_lens, base, a, b, n_heads, kv_head,
                              group, head_dim)
            table = row_seq[base + a] * max_blocks
            cuda.syncthreads()
            stage_q(tiles, q, qrow_sh, scale)
            cuda.syncthreads()
            for kk in range(d16):
                f = ldmatrix_x4(tiles, 16 * warp * row_bytes + 32 * kk, row_bytes, lane)
                for e in range(4):
                    qf[4 * kk + e] = f[e]
            lim_lo, lim_hi = lim_sh[16 * warp + g], lim_sh[16 * warp + g + 8]
            m_lo, m_hi = float32(MASKED), float32(MASKED)
            sum_lo, sum_hi = float32(0.0), float32(0.0)
            for e in range(n_o):
                o[e] = float32(0.0)
            for k0 in range(0, kend, kt):
                cuda.syncthreads()  # every warp is done with the previous tile (or Q)
                key_rows(krow_sh, kt, block_table, table, k0, kend, block_size, n_kv, kv_head,
                         head_dim)
                cuda.syncthreads()
                stage_kv(tiles, k_cache, v_cache, krow_sh)
                cuda.syncthreads()
                scores(s, qf, tiles, lane)
                new_lo = max(m_lo, row_max(s, k0, lim_lo, 0, t))
                new_hi = max(m_hi, row_max(s, k0, lim_hi, 1, t))
                corr_lo, corr_hi = math.exp(m_lo - new_lo), math.exp(m_hi - new_hi)
                m_lo, m_hi = new_lo, new_hi
                sum_lo = sum_lo * corr_lo + exponentiate(s, m_lo, 0)
                sum_hi = sum_hi * corr_hi + exponentiate(s, m_hi, 1)
                rescale(o, corr_lo, 0)
                rescale(o, corr_hi, 1)
                add_pv(o, s, tiles, lane)
            sum_lo += shfl_xor(sum_lo, 1)
            sum_lo += shfl_xor(sum_lo, 2)
            sum_hi += shfl_xor(sum_hi, 1)
            sum_hi += shfl_xor(sum_hi, 2)
            write_rows(out, o, qrow_sh, 16 * warp + g, 0, sum_lo, t)
            write_rows(out, o, qrow_sh, 16 * warp + g + 8, 1, sum_hi, t)
            a = b
    return flash


def supports(n_heads: int, n_kv: int, head_dim: int, cache_dtype) -> bool:
    """Whether this kernel takes the shape and cache (else attention_prefill's float32 kernel)."""
    return (head_dim in HEAD_DIMS and np.dtype(cache_dtype) == np.float16
            and n_heads % n_kv == 0 and MAX_GROUP % (n_heads // n_kv) == 0)


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
                         f"{HEAD_DIMS} and n_heads / n_kv dividing {MAX_GROUP}; got "
                         f"{k_cache.dtype}, head_dim {head_dim}, {n_heads} / {n_kv} heads")
    grid = (cdiv(n_rows, ROWS[head_dim] // (n_heads // n_kv)), n_kv)
    _flash_kernel(head_dim)[grid, _threads(head_dim), stream](
        q.reshape(q.size), k_cache.reshape(k_cache.size), v_cache.reshape(v_cache.size),
        block_table.reshape(block_table.size), block_table.shape[1], row_seq, seq_lens, n_rows,
        n_kv, block_size, float32(scale), out.reshape(out.size))
