"""ldmatrix + mma.sync fragments against the PTX ISA's layouts, for the f16 and the int8 tests.

One kernel shape serves both element types: a warp stages A (16 × 32 bytes, row-major (m, k)) and
B (16 × 32 bytes, (n, k)) in shared memory, loads A with `ldmatrix`, B once with `ldmatrix` (n 0-7
from registers 0, 2) and once with its B-pair twin (n 8-15 from registers 2, 3), and multiplies.
"""

from __future__ import annotations

import functools

import numpy as np
from numba import cuda

from sparkinfer_cli.kernels.cuda.runtime.intrinsics import LDMATRIX_ALIGN

ROW_WORDS = 12  # a staged row: 32 bytes of data + 16 of padding (16-byte aligned rows)
TILE_WORDS = 16 * ROW_WORDS  # a global constant: shared.array needs a literal size on the GPU


@functools.cache
def _fragments_kernel(ldmatrix, ldmatrix_pairs, mma, zero):
    @cuda.jit
    def fragments(a_words, b_words, regs, c):
        # a_words, b_words (16, 8) u32: the tiles' rows; regs (32, 4) u32: A's registers;
        # c (16, 16): A·Bᵀ from the two n8 tiles' mma
        lane = cuda.threadIdx.x
        sa = cuda.shared.array(TILE_WORDS, np.uint32, alignment=LDMATRIX_ALIGN)
        sb = cuda.shared.array(TILE_WORDS, np.uint32, alignment=LDMATRIX_ALIGN)
        row, col = lane // 2, (lane % 2) * 4  # two lanes a row, 4 words each
        for i in range(4):
            sa[row * ROW_WORDS + col + i] = a_words[row, col + i]
            sb[row * ROW_WORDS + col + i] = b_words[row, col + i]
        cuda.syncthreads()
        a = ldmatrix(sa, 0, 4 * ROW_WORDS, lane)
        b = ldmatrix(sb, 0, 4 * ROW_WORDS, lane)
        bp = ldmatrix_pairs(sb, 0, 4 * ROW_WORDS, lane)
        for i in range(4):
            regs[lane, i] = a[i]
        d0 = mma(a[0], a[1], a[2], a[3], b[0], b[2], zero, zero, zero, zero)  # n 0-7
        d1 = mma(a[0], a[1], a[2], a[3], bp[2], bp[3], zero, zero, zero, zero)  # n 8-15
        g, t = lane // 4, lane % 4
        for e in range(4):
            c[g + 8 * (e // 2), 2 * t + e % 2] = d0[e]
            c[g + 8 * (e // 2), 8 + 2 * t + e % 2] = d1[e]
    return fragments


def check_fragments(ldmatrix, ldmatrix_pairs, mma, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Run the kernel on a (16, 32 bytes) and b (16, 32 bytes) of f16 or int8, assert A's registers
    follow the PTX layout (register i of lane l: bytes 4·(l%4) (+16 for i ≥ 2) .. +3 of row l//4
    (+8 for i = 1, 3)), and return the kernel's product (16 m, 16 n) for the caller to check."""
    acc = np.float32 if a.dtype == np.float16 else np.int32
    regs = np.zeros((32, 4), np.uint32)
    c = np.zeros((16, 16), acc)
    _fragments_kernel(ldmatrix, ldmatrix_pairs, mma, acc(0))[1, 32](
        a.view(np.uint32), b.view(np.uint32), regs, c)
    rows = a.view(np.uint8).reshape(16, 32)
    for lane in range(32):
        g, t = divmod(lane, 4)
        for i in range(4):
            row, col = g + 8 * (i % 2), 4 * t + 16 * (i // 2)
            assert regs[lane, i] == rows[row, col:col + 4].view(np.uint32)[0], (lane, i)
    return c
