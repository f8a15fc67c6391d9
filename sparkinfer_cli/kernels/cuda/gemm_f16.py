"""Prefill GEMM over f16 copies of dense weights: cp.async stages, f16 tensor cores.

y[t, r] = Σ_k W16[r, k] · x16[t, k] (+ bias[r])   (mma.sync m16n8k16, f16·f16 → f32)

A long pass is compute-bound, and the quantized GEMMs spend most of their instructions beside the
mma: mma_gemm dequantizes each weight once per token tile and converts the activations in its
staging, mmq_q8 scales every int8 sum by two block scales (two FMAs an element) and rebuilds its
A fragments from 2-byte-aligned blocks. Here the weights were dequantized once, at load
(`dequantize`), and a pass converts its activations once per product (`to_f16`), so a k step's
staging is four 16-byte cp.async a thread and the warps only ldmatrix and mma.

- A block: BM = 128 weight rows × BN = 128 tokens; mma_gemm's 128-token tiling and `multiply`
  (8 warps of 64 rows × 32 tokens) and its store of the C fragments; two blocks an SM.
- STAGES k steps of BK = 32 in flight: the copies of step s + STAGES − 1 go out before the mma of
  step s, one barrier a step; the stages live in dynamic shared memory (past the 48 KiB a kernel
  may declare statically), rows padded to mma_gemm's ROW_STRIDE so ldmatrix meets no conflicts.
- Tokens past n_tok repeat the last token, rows past the matrix its last row (computed, never
  stored).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import numpy as np
from numba import cuda, float32, int64, uint32

from sparkinfer_cli.kernels.cuda import mma_gemm
from sparkinfer_cli.kernels.cuda.mma_gemm import output_parts
from sparkinfer_cli.kernels.cuda.quant_gemv import DeviceQuantMatrix
from sparkinfer_cli.kernels.cuda.runtime.intrinsics import (
    IS_SIMULATOR,
    chain_start,
    cp_async_16,
    cp_async_commit,
    cp_async_wait,
    pack_f16x2,
)
from sparkinfer_cli.kernels.cuda.runtime.jit import device_function, kernel
from sparkinfer_cli.kernels.cuda.runtime.launch import cdiv, check_array

BM, BN = mma_gemm.BM, 128  # weight rows × tokens a block (mma_gemm's 128-token tiling)
BK = mma_gemm.BK  # k a step: 64 bytes of a row, four 16-byte pieces
THREADS = mma_gemm.THREADS
STAGES = 4  # k steps in flight
ROW_STRIDE = mma_gemm.ROW_STRIDE  # bytes between staged rows: 64 of data, then padding
A_BYTES = BM * ROW_STRIDE  # one stage of weight rows
B_BYTES = BN * ROW_STRIDE  # one stage of tokens
B_BASE = STAGES * A_BYTES  # the token stages follow the weight stages
SHARED_BYTES = STAGES * (A_BYTES + B_BYTES)
PIECES = BK * 2 // 16  # 16-byte pieces of a row a step
ROWS_STEP = THREADS // PIECES  # rows apart of a thread's successive pieces
ROWS_APART = ROWS_STEP * ROW_STRIDE  # ... in staged bytes
LOADS = BM // ROWS_STEP  # pieces of weights (and as many of tokens: BN == BM) a thread copies
assert BN == BM, "_issue copies as many token rows as weight rows"
_IN_FLIGHT = STAGES - 2  # groups a thread may leave in flight at step s's wait
# two blocks an SM (≤ 128 registers a thread): with one block of a twice larger tile, nothing
# covered its barrier and loads (bench/results/2026-12-06-f16-prefill-gemm.md)
_LAUNCH_BOUNDS = {} if IS_SIMULATOR else {"launch_bounds": (THREADS, 2)}
CONVERT_THREADS = 256


class HalfMatrix(NamedTuple):
    """A dense matrix as f16 on the device: `words` (n_rows · k / 2,) u32, two f16 each."""
    words: object
    n_rows: int
    k: int


def supports(w: DeviceQuantMatrix) -> bool:
    """Whether `dequantize` takes this matrix: one matrix of a type mma_gemm stages, rows of
    whole k steps."""
    return w.n_mats == 1 and mma_gemm.supports(w)


# ---------------------------------------------------------------- conversions
@functools.cache
def _dequantize_kernel(ggml_type: int):
    piece = mma_gemm.dequant_piece(ggml_type)

    @kernel
    def dequantize_rows(w, row_bytes, k, n_pieces, out):
        chain_start()
        # thread i: 16 elements of one row, as 8 f16x2 words
        i = cuda.grid(1)
        if i < n_pieces:
            row, kk = i // (k // 16), (i % (k // 16)) * 16
            words = piece(w, int64(row) * row_bytes, kk)
            at = (int64(row) * k + kk) // 2
            for j in range(8):
                out[at + j] = words[j]
    return dequantize_rows


def dequantize(w: DeviceQuantMatrix, stream=0) -> HalfMatrix:
    """W's values as f16 (gguf's dequantization rounded once), in a new device array."""
    if not supports(w):
        raise ValueError(f"no f16 copy of {w.ggml_type.name} k={w.k} × {w.n_mats} matrices")
    out = cuda.device_array(w.n_rows * w.k // 2, np.uint32, stream=stream)
    n_pieces = w.n_rows * w.k // 16
    _dequantize_kernel(w.ggml_type)[cdiv(n_pieces, CONVERT_THREADS), CONVERT_THREADS, stream](
        w.data, w.row_bytes, w.k, n_pieces, out)
    return HalfMatrix(out, w.n_rows, w.k)


@kernel(fastmath=True)
def _to_f16_kernel(x, out, n_words):
    chain_start()
    i = cuda.grid(1)
    if i < n_words:
        out[i] = pack_f16x2(x[2 * i], x[2 * i + 1])


def to_f16(x, out, stream=0) -> None:
    """out (x.size / 2,) u32 ← x's float32 values as f16 pairs (round to nearest even)."""
    check_array("x", x, np.float32)
    check_array("out", out, np.uint32)
    if x.size % 2 or out.size < x.size // 2:
        raise ValueError(f"out holds {out.size} f16 pairs, x has {x.size} values")
    n_words = x.size // 2
    _to_f16_kernel[cdiv(n_words, CONVERT_THREADS), CONVERT_THREADS, stream](
        x.reshape(x.size), out, n_words)


# ---------------------------------------------------------------- the GEMM
@device_function(numba_inline=True)
def _issue(smem, buf, step, w, x, w_at, x_at, s_at):
    """Start this thread's copies of k step `step` into stage `buf`: weight rows and tokens
    r + ROWS_STEP · j (byte offsets w_at, x_at), piece s_at of each staged row."""
    a = uint32(buf * A_BYTES) + s_at
    b = uint32(B_BASE + buf * B_BYTES) + s_at
    o = step * 2 * BK
    for j in range(LOADS):
        cp_async_16(smem, a + uint32(j * ROWS_APART), w, w_at[j] + o)
        cp_async_16(smem, b + uint32(j * ROWS_APART), x, x_at[j] + o)


@functools.cache
def _gemm_kernel():
    t = mma_gemm.tiling(BN, False)
    warps_n, warp_rows, n_acc = t.warps_n, t.warp_rows, 4 * t.nt * t.mt
    multiply = mma_gemm.multiply_fn(BN)
    store, _ = mma_gemm.store_fns(BN, False, False)

    @kernel(fastmath=True, **_LAUNCH_BOUNDS)
    def gemm_f16(w, n_rows, k, x, n_tok, order, bias, has_bias, y0, y1, y2, y3, ends):
        chain_start()
        row0, tok0 = cuda.blockIdx.x * BM, cuda.blockIdx.y * BN
        smem = cuda.shared.array(0, uint32)  # (STAGES, BM, ROW_STRIDE) then (STAGES, BN, ·)
        acc = cuda.local.array(n_acc, float32)  # mma_gemm's C fragments of a 128-token tile
        for i in range(n_acc):
            acc[i] = 0.0
        tid, row_bytes = cuda.threadIdx.x, 2 * k
        r, piece = tid // PIECES, (tid % PIECES) * 16  # this thread's first staged row, piece
        w_at = cuda.local.array(LOADS, int64)
        x_at = cuda.local.array(LOADS, int64)
        for j in range(LOADS):
            w_at[j] = int64(min(row0 + r + j * ROWS_STEP, n_rows - 1)) * row_bytes + piece
            x_at[j] = int64(min(tok0 + r + j * ROWS_STEP, n_tok - 1)) * row_bytes + piece
        s_at = uint32(r * ROW_STRIDE + piece)
        n_steps = k // BK
        for s in range(STAGES - 1):
            if s < n_steps:
                _issue(smem, s, s, w, x, w_at, x_at, s_at)
            cp_async_commit()
        warp, lane = tid >> 5, tid & 31
        a_frag_at = (warp // warps_n) * warp_rows * ROW_STRIDE
        b_frag_at = B_BASE + (warp % warps_n) * 32 * ROW_STRIDE
        for s in range(n_steps):
            cp_async_wait(_IN_FLIGHT)  # step s's copies (this thread's) have landed
            cuda.syncthreads()  # ... everyone's, and nobody still multiplies step s - 1
            if s + STAGES - 1 < n_steps:
                _issue(smem, (s + STAGES - 1) % STAGES, s + STAGES - 1, w, x, w_at, x_at, s_at)
            cp_async_commit()
            multiply(smem, smem, s % STAGES, a_frag_at, b_frag_at, lane, acc)
        store(acc, row0, n_rows, tok0, min(BN, n_tok - tok0), order, bias, has_bias, y0, y1, y2,
              y3, ends)
    return gemm_f16


def matmul(w: HalfMatrix, x, y, *, bias=None, stream=0) -> None:
    """y (n_tok, n_rows) f32 ← x (n_tok · k / 2,) u32 (to_f16's f16 pairs) @ Wᵀ (+ bias).

    y may be a sequence of up to MAX_PARTS arrays (n_tok, rows_p) with Σ rows_p = n_rows."""
    check_array("x", x, np.uint32)
    if w.k % BK or x.size % (w.k // 2):
        raise ValueError(f"x: {x.size} f16 pairs, not whole rows of k={w.k} (k % {BK} == 0)")
    n_tok = x.size // (w.k // 2)
    parts, ends = output_parts(y, n_tok, w.n_rows)
    if bias is not None:
        check_array("bias", bias, np.float32, (w.n_rows,))
    if n_tok == 0:
        return
    grid = (cdiv(w.n_rows, BM), cdiv(n_tok, BN))
    _gemm_kernel()[grid, THREADS, stream, SHARED_BYTES](
        w.words, w.n_rows, w.k, x, n_tok, mma_gemm.dummy_i32(), parts[0] if bias is None
        else bias, bias is not None, *parts, ends)
