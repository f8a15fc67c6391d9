"""GEMM for Q8_0 weights on int8 tensor cores, over the GEMVs' q8 activations (any token count).

y[t, r] = Σ_b dw[r, b] · dx[t, b] · Σ_{i<32} qw[r, 32b + i] · qx[t, 32b + i]   (+ bias[r])

qw, dw: the Q8_0 blocks' int8 values and f16 scales; qx, dx: the activations quantized per 32
elements (quant_gemv.QuantizedActivations). Nothing is dequantized: each Q8_0 block is one k step
of mma.sync m16n8k32 (s8·s8 → s32) and its sums are scaled by dw·dx into float32 accumulators
(llama.cpp's MMQ). For batches of ≤ BN tokens, where mma_gemm (f16 tiles) spent its time in L1:
its threads read a 34-byte Q8_0 block as six 2-4-byte loads from 16 rows a warp instruction
(H200, 64 tokens, Q8_0 12,352 × 2,048: 117 µs, L1 68 % busy, DRAM 5 %).

- A block: BM = 64 weight rows × BN = 64 tokens; 8 warps of 16 rows × 32 tokens (4 n8 tiles);
  grid.y walks the tokens in tiles of BN (prefill passes), grid.x the row blocks, so the blocks
  in flight share one token tile and read the matrix through L2.
- Pipeline steps of CHUNK = 4 Q8_0 blocks (k 128): the threads load the 64 rows' 136-byte pieces
  as consecutive 8-byte words (rows of k % 128 == 0 are 8-byte multiples) and the tokens' 128 q8
  bytes as 16-byte words; the next step's loads go out before the warps multiply this one. The
  weight words go to shared memory as they are: a Q8_0 block's int8 values follow its 2-byte
  scale, 2-byte (not ldmatrix's 16) aligned, so a warp reads its A fragments with word loads and
  funnel shifts (intrinsics.ld_s8_fragments_x4) and the scales beside them.
- Split-K as mma_gemm: grids under SPLIT_BELOW_BLOCKS blocks (row blocks × token tiles) walk k
  in ranges on grid.z, raw sums to `partials`, then mma_gemm.add_partials. Fused SwiGLU (`up=`):
  a block's 64 rows are 32 gate rows and the same 32 rows of `up` (warps 0-1 and 4-5 / 2-3 and
  6-7), always through the partials, whose epilogue pairs them.
"""

from __future__ import annotations

import functools

import numpy as np
from numba import cuda, float32, int64, uint32

from sparkinfer_cli.gguf.ggml_types import GGMLType
from sparkinfer_cli.kernels.cuda.ggml_blocks import f16
from sparkinfer_cli.kernels.cuda.mma_fragments import mma_s8_biased, scaled_sum, sum_offset
from sparkinfer_cli.kernels.cuda.mma_gemm import add_partials, output_parts
from sparkinfer_cli.kernels.cuda.quant_gemv import (
    DeviceQuantMatrix,
    QuantizedActivations,
    store_part,
)
from sparkinfer_cli.kernels.cuda.runtime.intrinsics import (
    IS_SIMULATOR,
    LDMATRIX_ALIGN,
    chain_start,
    ld_s8_fragments_x4,
    ld_v2_u32,
    ld_v4_u32,
    ldmatrix_x4_b8_pairs,
)
from sparkinfer_cli.kernels.cuda.runtime.jit import device_function, kernel
from sparkinfer_cli.kernels.cuda.runtime.launch import cdiv, check_array

BM = 64  # staged weight rows a block
BN = 64  # tokens a block (all of a pass's)
THREADS = 256  # 8 warps: 4 of 16 rows × 2 of 32 tokens
WARP_TOKENS = 32
CHUNK = 4  # Q8_0 blocks a pipeline step
CHUNK_K = 32 * CHUNK
ROW_BYTES = 34 * CHUNK  # a row's bytes a step
ROW_WORDS = ROW_BYTES // 8  # ... as 8-byte words
W_LOADS = cdiv(BM * ROW_WORDS, THREADS)  # 8-byte weight words a thread loads a step
X_LOADS = BN * CHUNK_K // 16 // THREADS  # 16-byte q8 words a thread loads a step
D_LOADS = BN * CHUNK // THREADS  # activation scales a thread loads a step
# bytes between staged rows (weights: 136 of raw Q8_0 blocks; tokens: 128 int8): 144 = 36 words,
# so the 8 rows of a fragment load or ldmatrix start in distinct banks
TILE_STRIDE = 144
TILE_WORDS = BM * TILE_STRIDE // 4  # one buffer of a tile (BM == BN)
# two blocks an SM (≤ 128 registers a thread); the simulator takes no launch bounds
_LAUNCH_BOUNDS = {} if IS_SIMULATOR else {"launch_bounds": (THREADS, 2)}
SPLIT_BELOW_BLOCKS = 132  # one block an SM (H200)
SPLIT_TARGET_BLOCKS = 264
MAX_K_SPLITS = 16


def supports(w: DeviceQuantMatrix, n_tok: int) -> bool:
    """Whether this GEMM takes W × n_tok tokens: one Q8_0 matrix, k in whole steps."""
    return w.ggml_type == GGMLType.Q8_0 and w.n_mats == 1 and w.k % CHUNK_K == 0 and n_tok > 0


def k_splits(w: DeviceQuantMatrix, n_tok: int, swiglu: bool = False) -> int:
    """The k ranges matmul walks W in: 1 for grids of ≥ SPLIT_BELOW_BLOCKS blocks, else enough
    to reach SPLIT_TARGET_BLOCKS (≤ MAX_K_SPLITS, ≥ one step each)."""
    n_blocks = cdiv(w.n_rows, BM // 2 if swiglu else BM) * cdiv(n_tok, BN)
    if n_blocks >= SPLIT_BELOW_BLOCKS:
        return 1
    return max(1, min(cdiv(SPLIT_TARGET_BLOCKS, n_blocks), MAX_K_SPLITS, w.k // CHUNK_K))


def partials_size(w: DeviceQuantMatrix, n_tok: int, swiglu: bool = False) -> int:
    """Floats of the partials buffer matmul needs (0: it writes y directly)."""
    n_splits = k_splits(w, n_tok, swiglu)
    if n_splits == 1 and not swiglu:
        return 0
    return n_splits * n_tok * w.n_rows * (2 if swiglu else 1)


# ---------------------------------------------------------------- the kernel
@functools.cache
def _stage_fns(swiglu: bool):
    """(fetch, put): a step's global loads into registers, then from them into shared memory."""
    half = BM // 2 if swiglu else BM  # with SwiGLU, staged rows ≥ half are up rows

    @device_function(numba_inline=True)
    def fetch(c, w, w2, row0, n_rows, row_bytes, k, xq, xd, tok0, n_tok, wv, xv, dv):
        """Step c's words: weight rows' 8-byte words (wv), the q8 16-byte words of tokens tok0 …
        tok0 + BN - 1 (xv) and their scales (dv). Rows past the matrix repeat its last row, tokens
        past n_tok the last token (computed, never stored)."""
        tid = cuda.threadIdx.x
        for i in range(W_LOADS):
            p = min(tid + THREADS * i, BM * ROW_WORDS - 1)  # the last word may be fetched twice
            r = p // ROW_WORDS
            row = min(row0 + r % half, n_rows - 1)
            off = int64(row) * row_bytes + c * ROW_BYTES + 8 * (p % ROW_WORDS)
            v = ld_v2_u32(w2, off) if swiglu and r >= half else ld_v2_u32(w, off)
            wv[2 * i] = v[0]
            wv[2 * i + 1] = v[1]
        for i in range(X_LOADS):
            q = tid + THREADS * i
            tok = min(tok0 + q // (CHUNK_K // 16), n_tok - 1)
            v = ld_v4_u32(xq, int64(tok) * k + c * CHUNK_K + 16 * (q % (CHUNK_K // 16)))
            for e in range(4):
                xv[4 * i + e] = v[e]
        for i in range(D_LOADS):
            q = tid + THREADS * i
            tok = min(tok0 + q // CHUNK, n_tok - 1)
            dv[i] = xd[int64(k // 32) * tok + c * CHUNK + q % CHUNK]

    @device_function(numba_inline=True)
    def put(buf, sa, sb, sx, wv, xv, dv):
        """fetch's words into buffer `buf`: the weights' Q8_0 blocks as they are (rows of
        TILE_STRIDE bytes), the tokens' int8 values and scales."""
        tid = cuda.threadIdx.x
        for i in range(W_LOADS):
            p = min(tid + THREADS * i, BM * ROW_WORDS - 1)
            at = buf * TILE_WORDS + (p // ROW_WORDS) * (TILE_STRIDE // 4) + 2 * (p % ROW_WORDS)
            sa[uint32(at)] = wv[2 * i]
            sa[uint32(at) + uint32(1)] = wv[2 * i + 1]
        for i in range(X_LOADS):
            q = tid + THREADS * i
            at = uint32(buf * TILE_WORDS + (q // (CHUNK_K // 16)) * (TILE_STRIDE // 4)
                        + 4 * (q % (CHUNK_K // 16)))
            for e in range(4):
                sb[at + uint32(e)] = xv[4 * i + e]
        for i in range(D_LOADS):
            q = tid + THREADS * i  # token q // CHUNK, block q % CHUNK
            sx[uint32(buf * BN * CHUNK + (q % CHUNK) * BN + q // CHUNK)] = dv[i]
    return fetch, put


ROW_WORDS_STAGED = TILE_STRIDE // 4  # words between staged rows


@device_function(numba_inline=True)
def _add_scaled(acc, sx, dx_at, n, c, dw, offsets):
    """acc of the warp's n8 tile n += its s32 sums c of one Q8_0 block, times dw (rows g, g + 8:
    dw[0], dw[1], with their sum_offset) · dx (tokens 2t, 2t + 1 of the tile: sx[dx_at + 8n],
    the next)."""
    dx0 = sx[dx_at + uint32(8 * n)]
    dx1 = sx[dx_at + uint32(8 * n + 1)]
    acc[4 * n] += scaled_sum(c[0], dw[0], offsets[0]) * dx0
    acc[4 * n + 1] += scaled_sum(c[1], dw[0], offsets[0]) * dx1
    acc[4 * n + 2] += scaled_sum(c[2], dw[1], offsets[1]) * dx0
    acc[4 * n + 3] += scaled_sum(c[3], dw[1], offsets[1]) * dx1


@device_function(numba_inline=True)
def _two_tiles(acc, a, sb, sx, b_at, dx_at, p, dw, offsets, lane):
    """acc of the warp's n8 tiles 2p, 2p + 1 (one ldmatrix of 16 tokens: (b0, b1), (b2, b3))."""
    b = ldmatrix_x4_b8_pairs(sb, b_at + uint32(16 * p * TILE_STRIDE), TILE_STRIDE, lane)
    c = mma_s8_biased(a, b[0], b[1])
    _add_scaled(acc, sx, dx_at, 2 * p, c, dw, offsets)
    c = mma_s8_biased(a, b[2], b[3])
    _add_scaled(acc, sx, dx_at, 2 * p + 1, c, dw, offsets)


@device_function(numba_inline=True)
def _block(sa, sb, sx, acc, rows_word, scale_word, b_at, dx_at, lane, j):
    """acc += this warp's 16 rows × 32 tokens over Q8_0 block j (a constant) of the step.

    A staged row holds block j's f16 scale at byte 34j, its int8 values from byte 34j + 2: 2
    bytes into a word for even j, at a word's start for odd j."""
    a = ld_s8_fragments_x4(sa, rows_word + uint32((34 * j + 2) // 4), ROW_WORDS_STAGED, lane,
                           j % 2 == 0)
    at, shift = uint32(scale_word + (34 * j) // 4), 16 * (j % 2)
    dw = (f16(sa[at] >> shift), f16(sa[at + uint32(8 * ROW_WORDS_STAGED)] >> shift))
    offsets = (sum_offset(dw[0]), sum_offset(dw[1]))
    # NOTE: two calls, not a loop: acc's indices must be constants for it to stay in registers
    _two_tiles(acc, a, sb, sx, b_at + uint32(32 * j), dx_at + uint32(j * BN), 0, dw, offsets,
               lane)
    _two_tiles(acc, a, sb, sx, b_at + uint32(32 * j), dx_at + uint32(j * BN), 1, dw, offsets,
               lane)


@device_function(numba_inline=True)
def _multiply(buf, sa, sb, sx, acc):
    """acc += this warp's 16 rows × 32 tokens over step buffer `buf` (CHUNK int8 mma k steps).
    Each lane's shared-memory indices are computed once here, every block's are these plus
    constants."""
    lane, warp = cuda.threadIdx.x & 31, cuda.threadIdx.x >> 5
    rows_word = uint32(buf * TILE_WORDS + 16 * (warp & 3) * ROW_WORDS_STAGED)  # warp's first row
    scale_word = rows_word + uint32((lane >> 2) * ROW_WORDS_STAGED)  # this lane's row g
    tokens = WARP_TOKENS * (warp >> 2)  # the warp's first token
    b_at = uint32(4 * buf * TILE_WORDS + tokens * TILE_STRIDE)  # its byte in sb
    dx_at = uint32(buf * CHUNK * BN + tokens + 2 * (lane & 3))  # token 2t's scale, block 0
    # NOTE: one call a block, not a loop: constant j folds each block's offsets into the loads
    _block(sa, sb, sx, acc, rows_word, scale_word, b_at, dx_at, lane, 0)
    _block(sa, sb, sx, acc, rows_word, scale_word, b_at, dx_at, lane, 1)
    _block(sa, sb, sx, acc, rows_word, scale_word, b_at, dx_at, lane, 2)
    _block(sa, sb, sx, acc, rows_word, scale_word, b_at, dx_at, lane, 3)


@functools.cache
def _gemm_kernel(swiglu: bool):
    fetch, put = _stage_fns(swiglu)
    half = BM // 2 if swiglu else BM  # output rows a block: with SwiGLU, rows ≥ half are up rows
    n_acc = 4 * WARP_TOKENS // 8
    # shared / local array sizes as closure constants (numba needs literals)
    tile_words, x_scales = 2 * TILE_WORDS, 2 * BN * CHUNK
    w_words, x_words = 2 * W_LOADS, 4 * X_LOADS

    @kernel(fastmath=True, **_LAUNCH_BOUNDS)
    def gemm_q8(w, w2, row_bytes, n_rows, k, n_tok, xq, xd, bias, has_bias, y0, y1, y2, y3,
                ends, part, use_part):
        chain_start()
        row0, tok0 = cuda.blockIdx.x * half, cuda.blockIdx.y * BN
        sa = cuda.shared.array(tile_words, uint32)  # (2 buffers, BM rows, TILE_STRIDE bytes)
        sb = cuda.shared.array(tile_words, uint32, alignment=LDMATRIX_ALIGN)  # (2, BN, ·)
        sx = cuda.shared.array(x_scales, float32)  # (2, CHUNK, BN) activation scales
        wv = cuda.local.array(w_words, uint32)
        xv = cuda.local.array(x_words, uint32)
        dv = cuda.local.array(D_LOADS, float32)
        acc = cuda.local.array(n_acc, float32)  # (4 n8 tiles, 4) C fragments
        for i in range(n_acc):
            acc[i] = 0.0
        n_steps, n_splits = k // CHUNK_K, cuda.gridDim.z
        c0 = cuda.blockIdx.z * n_steps // n_splits
        c1 = (cuda.blockIdx.z + 1) * n_steps // n_splits
        fetch(c0, w, w2, row0, n_rows, row_bytes, k, xq, xd, tok0, n_tok, wv, xv, dv)
        put(0, sa, sb, sx, wv, xv, dv)
        cuda.syncthreads()
        for s in range(c1 - c0):
            # step s + 1's loads go out before step s's mma (the last step fetches itself again)
            fetch(c0 + min(s + 1, c1 - c0 - 1), w, w2, row0, n_rows, row_bytes, k, xq, xd, tok0,
                  n_tok, wv, xv, dv)
            _multiply(s & 1, sa, sb, sx, acc)
            put((s + 1) & 1, sa, sb, sx, wv, xv, dv)
            cuda.syncthreads()
        lane, warp = cuda.threadIdx.x & 31, cuda.threadIdx.x >> 5
        staged = 16 * (warp & 3) + (lane >> 2)  # + 8 for elements 2, 3
        for n in range(WARP_TOKENS // 8):
            for e in range(4):
                r = staged + 8 * (e >> 1)
                row = row0 + r % half
                tok = tok0 + WARP_TOKENS * (warp >> 2) + 8 * n + 2 * (lane & 3) + (e & 1)
                if row < n_rows and tok < n_tok:
                    v = acc[4 * n + e]
                    if use_part:  # (splits, n_tok, rows · (2 with SwiGLU: gate, then up))
                        at = (int64(cuda.blockIdx.z) * n_tok + tok) * (n_rows * (2 if swiglu
                                                                                 else 1)) + row
                        part[at + (n_rows if r >= half else 0)] = v
                    else:
                        store_part(y0, y1, y2, y3, ends, tok, row, v + bias[row] if has_bias
                                   else v)
    return gemm_q8


# ---------------------------------------------------------------- launch
def matmul(w: DeviceQuantMatrix, x: QuantizedActivations, y, *, bias=None,
           up: DeviceQuantMatrix | None = None, partials=None, stream=0) -> None:
    """y (n_tok, n_rows) f32 ← q8 activations x (n_tok = groups · cols tokens) @ W[0]ᵀ (+ bias).

    up: a second Q8_0 matrix of W's shape; then y = silu(x·Wᵀ) ⊙ (x·upᵀ) (bias after).
    y may be a sequence of up to MAX_PARTS arrays (n_tok, rows_p) with Σ rows_p = n_rows.
    partials: float32 device scratch of ≥ partials_size(w, n_tok, up is not None) floats, needed
    when that is > 0. Raises ValueError for what `supports` rejects.
    """
    n_tok = x.shape[0] * x.shape[1]
    if not supports(w, n_tok) or x.shape[2] != w.k:
        raise ValueError(f"no int8 tensor-core GEMM for {w.ggml_type.name} k={w.k} × "
                         f"{n_tok} tokens of {x.shape[2]}")
    if up is not None and (up.ggml_type, up.k, up.n_rows, up.n_mats) != (
            w.ggml_type, w.k, w.n_rows, w.n_mats):
        raise ValueError("gate and up matrices must share type and shape for the fused SwiGLU")
    swiglu = up is not None
    needed = partials_size(w, n_tok, swiglu)
    if needed:
        if partials is None:
            raise ValueError(f"this product needs a partials buffer of {needed} floats")
        check_array("partials", partials, np.float32)
        if partials.size < needed:
            raise ValueError(f"partials: {partials.size} floats, needs {needed}")
    parts, ends = output_parts(y, n_tok, w.n_rows)
    if bias is not None:
        check_array("bias", bias, np.float32, (w.n_rows,))
    n_splits = k_splits(w, n_tok, swiglu)
    grid = (cdiv(w.n_rows, BM // 2 if swiglu else BM), cdiv(n_tok, BN), n_splits)
    _gemm_kernel(swiglu)[grid, THREADS, stream](
        w.data, w.data if up is None else up.data, w.row_bytes, w.n_rows, w.k, n_tok, x.xq, x.xd,
        parts[0] if bias is None else bias, bias is not None, *parts, ends,
        partials if needed else parts[0], needed > 0)
    if needed:
        add_partials(partials, n_splits, n_tok, w.n_rows, swiglu, bias, parts, ends, stream)
