"""Fused dequant × activation GEMV / small-batch GEMM over weights in their GGUF byte layout.

y[slot, c, r] = Σ_k W[mat(slot)][r, k] · x[xgroup(slot), c, k] (+ bias[r])   for c < n_cols (1..8)

- Weights stay in GGUF bytes (a flat uint8 device buffer, rows of `row_bytes`, matrices of
  `n_rows` rows back to back: 3-D expert slabs work as-is). `slot_mat` picks the matrix of each
  grid.y slot, so a MoE layer touches only its selected experts; `slot_x` picks the activations.
- Rows may be split over up to MAX_PARTS outputs: several linears that read the same input are
  uploaded as one matrix (rows back to back) and run as one launch, each part landing in its own
  (n_slots, n_cols, part rows) array.
- Quantized types take activations quantized to int8 per 32 elements (llama.cpp's q8_1: scale d and
  d·Σq), and dot products run on dp4a; float types (F32/F16/BF16) take float32 activations.
- One warp per output row, lanes stride over "units" (a block or a fixed part of one); 16-byte loads
  wherever the block layout is 16-byte aligned, 2/4-byte loads where it is not (Q8_0, Q6_K, ...).

  unit layout per type (elements a lane handles at once):
    Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 IQ4_NL : one 32-element block
    Q4_K Q5_K : 64 elements (a pair of sub-blocks, 32 qs bytes)   IQ4_XS : one 32-element sub-block
    Q6_K : 64 elements (16 ql/qh columns × 4 groups)               F32: 4, F16/BF16: 8 elements
"""

from __future__ import annotations

import functools
import math

import numpy as np
from numba import cuda, float32, int32, int64, uint32

from sparkinfer_cli.gguf.ggml_types import BLOCK_GEOMETRY, GGMLType, row_bytes
from sparkinfer_cli.kernels.cuda.ggml_blocks import (
    M1,
    M2,
    M4,
    f16,
    scale_min_pair_k4,
    spread4,
    u32_from_u16s,
    words4_aligned,
    words4_unaligned,
)
from sparkinfer_cli.kernels.cuda.runtime.intrinsics import (
    bits_to_f32,
    byte_perm,
    chain_start,
    dp4a,
    ld_u16,
    ld_u32,
    ld_v4_u32,
)
from sparkinfer_cli.kernels.cuda.runtime.jit import device_function, kernel
from sparkinfer_cli.kernels.cuda.runtime.launch import cdiv, check_array, next_pow2
from sparkinfer_cli.kernels.cuda.runtime.warp import shfl_xor, warp_max, warp_sum

Q8_BLOCK = 32
WARPS_PER_BLOCK = 4
MAX_COLS = 8
MAX_GRID_Y = 65535  # CUDA's limit on gridDim.y
MAX_PARTS = 4
SPLIT_ROWS_BELOW = 1024  # rows (× slots) under which long rows are split over a block's warps
MULTI_ROW_MIN_ROWS = 8192  # rows (× slots) from which a lane loads two rows side by side
LANE_BUDGET = 131072  # rows × lanes a row of a GEMV that one wave of resident blocks holds
MIN_LANES, MAX_UNITS_A_LANE = 4, 8  # how far lanes_per_row narrows a row's lanes
_IQ4NL_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113],
                         np.int8)
IQ4NL_WORDS = tuple(int(w) for w in _IQ4NL_VALUES.view(np.uint32))  # the table as 4 LE words


# ---------------------------------------------------------------- small device helpers
@device_function
def _iq4_lookup(q):
    """8 nibbles of q → (IQ4_NL values of the low nibbles, of the high nibbles), 4 int8 each.

    prmt selects by a nibble's low 3 bits from table bytes 0-7 and 8-15; a second prmt keeps the
    right half by the nibble's bit 3; two more regroup the even (low) and odd (high) nibbles.
    """
    pick = 0x32103210 | ((q & 0x88888888) >> 1)
    sel = q & 0x77777777  # PTX prmt reads selector bit 3 as "replicate sign": keep it clear
    t0 = byte_perm(byte_perm(IQ4NL_WORDS[0], IQ4NL_WORDS[1], sel),
                   byte_perm(IQ4NL_WORDS[2], IQ4NL_WORDS[3], sel), pick)
    t1 = byte_perm(byte_perm(IQ4NL_WORDS[0], IQ4NL_WORDS[1], sel >> 16),
                   byte_perm(IQ4NL_WORDS[2], IQ4NL_WORDS[3], sel >> 16), pick >> 16)
    return byte_perm(t0, t1, 0x6420), byte_perm(t0, t1, 0x7531)


@device_function
def _udiv(a, b):
    """a // b for 0 ≤ a, b < 2^32 in unsigned math: no floor-division sign fixups, and a result
    known to be ≥ 0, so array indexing with it drops the negative-index wraparound code."""
    return int64(uint32(a) // uint32(b))


@device_function
def _dot_nibbles16(lo_src, hi_src, xlo, xhi, acc_lo, acc_hi):
    """dp4a of low nibbles of 4 words with xlo and high nibbles with xhi."""
    for i in range(4):
        acc_lo = dp4a(lo_src[i] & M4, xlo[i], acc_lo)
        acc_hi = dp4a((hi_src[i] >> 4) & M4, xhi[i], acc_hi)
    return acc_lo, acc_hi


# ---------------------------------------------------------------- 32-element blocks
# Each unit returns the contribution of one block to one column; xo = element offset of the
# block's first element in that column of the activations (so xo // 32 indexes xd / xs).
@device_function
def _sum_q4_legacy(q, xq, xo):
    """Σ q·x over a 32-element block from its 16 nibble bytes (4 words)."""
    xa = ld_v4_u32(xq, xo)
    xb = ld_v4_u32(xq, xo + 16)
    s = 0
    for j in range(4):
        s = dp4a(q[j] & M4, xa[j], s)
        s = dp4a((q[j] >> 4) & M4, xb[j], s)
    return s


@device_function
def _unit_q4_0(w, bo, part, xq, xd, xs, xo):
    b = _udiv(xo, Q8_BLOCK)
    s = float32(_sum_q4_legacy(words4_unaligned(w, bo + 2), xq, xo))
    return f16(ld_u16(w, bo)) * (xd[b] * s - float32(8.0) * xs[b])


@device_function
def _unit_q4_1(w, bo, part, xq, xd, xs, xo):
    b = _udiv(xo, Q8_BLOCK)
    dm = ld_u32(w, bo)
    s = float32(_sum_q4_legacy(words4_aligned(w, bo + 4), xq, xo))
    return f16(dm) * xd[b] * s + f16(dm >> 16) * xs[b]


@device_function
def _sum_q5_legacy(q, qh, xq, xo):
    """Σ q5·x from 16 nibble bytes (4 words); 5th bits of elements j in bit j of qh."""
    xa = ld_v4_u32(xq, xo)
    xb = ld_v4_u32(xq, xo + 16)
    s = 0
    for j in range(4):
        lo = (q[j] & M4) | (spread4((qh >> (4 * j)) & 0xF) << 4)
        hi = ((q[j] >> 4) & M4) | (spread4((qh >> (16 + 4 * j)) & 0xF) << 4)
        s = dp4a(hi, xb[j], dp4a(lo, xa[j], s))
    return s


@device_function
def _unit_q5_0(w, bo, part, xq, xd, xs, xo):
    b = _udiv(xo, Q8_BLOCK)
    s = float32(_sum_q5_legacy(words4_unaligned(w, bo + 6), u32_from_u16s(w, bo + 2), xq, xo))
    return f16(ld_u16(w, bo)) * (xd[b] * s - float32(16.0) * xs[b])


@device_function
def _unit_q5_1(w, bo, part, xq, xd, xs, xo):
    b = _udiv(xo, Q8_BLOCK)
    dm = ld_u32(w, bo)
    s = float32(_sum_q5_legacy(words4_aligned(w, bo + 8), ld_u32(w, bo + 4), xq, xo))
    return f16(dm) * xd[b] * s + f16(dm >> 16) * xs[b]


@device_function
def _unit_q8_0(w, bo, part, xq, xd, xs, xo):
    xa = ld_v4_u32(xq, xo)
    xb = ld_v4_u32(xq, xo + 16)
    qa = words4_unaligned(w, bo + 2)
    qb = words4_unaligned(w, bo + 18)
    s = 0
    for j in range(4):
        s = dp4a(qb[j], xb[j], dp4a(qa[j], xa[j], s))
    return f16(ld_u16(w, bo)) * xd[_udiv(xo, Q8_BLOCK)] * float32(s)


@device_function
def _sum_iq4(q, xq, xo):
    xa = ld_v4_u32(xq, xo)
    xb = ld_v4_u32(xq, xo + 16)
    s = 0
    for j in range(4):
        lo, hi = _iq4_lookup(q[j])
        s = dp4a(hi, xb[j], dp4a(lo, xa[j], s))
    return s


@device_function
def _unit_iq4_nl(w, bo, part, xq, xd, xs, xo):
    s = float32(_sum_iq4(words4_unaligned(w, bo + 2), xq, xo))
    return f16(ld_u16(w, bo)) * xd[_udiv(xo, Q8_BLOCK)] * s


@device_function
def _unit_iq4_xs(w, bo, ib, xq, xd, xs, xo):
    head = ld_u32(w, bo)  # d (f16) | scales_h (u16)
    ls = int32(((ld_u32(w, bo + 4) >> (4 * ib)) & 0xF) | (((head >> (16 + 2 * ib)) & 3) << 4)) - 32
    xo += 32 * ib
    s = float32(_sum_iq4(words4_aligned(w, bo + 8 + 16 * ib), xq, xo))
    return f16(head) * float32(ls) * xd[_udiv(xo, Q8_BLOCK)] * s


# ---------------------------------------------------------------- 256-element super-blocks
@device_function
def _k4_combine(w, bo, c, xd, xs, b, s_lo, s_hi):
    """Q4_K/Q5_K epilogue: (d·sc)·xd·Σqx − (dmin·m)·xs for sub-blocks 2c (s_lo) and 2c+1 (s_hi)."""
    dm = ld_u32(w, bo)
    s0 = ld_u32(w, bo + 4)
    s1 = ld_u32(w, bo + 8)
    s2 = ld_u32(w, bo + 12)
    sc_lo, sc_hi, m_lo, m_hi = scale_min_pair_k4(c, s0, s1, s2)
    lo = float32(sc_lo) * xd[b] * float32(s_lo) + float32(sc_hi) * xd[b + 1] * float32(s_hi)
    return f16(dm) * lo - f16(dm >> 16) * (float32(m_lo) * xs[b] + float32(m_hi) * xs[b + 1])


@device_function
def _unit_q4_k(w, bo, c, xq, xd, xs, xo):
    qa = ld_v4_u32(w, bo + 16 + 32 * c)
    qb = ld_v4_u32(w, bo + 32 + 32 * c)
    x0 = xo + 64 * c
    s_lo, s_hi = _dot_nibbles16(qa, qa, ld_v4_u32(xq, x0), ld_v4_u32(xq, x0 + 32), 0, 0)
    s_lo, s_hi = _dot_nibbles16(qb, qb, ld_v4_u32(xq, x0 + 16), ld_v4_u32(xq, x0 + 48), s_lo, s_hi)
    return _k4_combine(w, bo, c, xd, xs, _udiv(x0, Q8_BLOCK), s_lo, s_hi)


@device_function(numba_inline=True)  # through NVVM its tuples went to local memory (32 B)
def _sum_q5_k16(q, qh, c, xlo, xhi, s_lo, s_hi):
    """16 qs bytes (4 words) + their qh bytes: sub-block 2c from low nibbles, 2c+1 from high."""
    for i in range(4):
        lo = (q[i] & M4) | (((qh[i] >> (2 * c)) & M1) << 4)
        hi = ((q[i] >> 4) & M4) | (((qh[i] >> (2 * c + 1)) & M1) << 4)
        s_lo = dp4a(lo, xlo[i], s_lo)
        s_hi = dp4a(hi, xhi[i], s_hi)
    return s_lo, s_hi


@device_function
def _unit_q5_k(w, bo, c, xq, xd, xs, xo):
    x0 = xo + 64 * c
    s_lo, s_hi = _sum_q5_k16(ld_v4_u32(w, bo + 48 + 32 * c), ld_v4_u32(w, bo + 16), c,
                             ld_v4_u32(xq, x0), ld_v4_u32(xq, x0 + 32), 0, 0)
    s_lo, s_hi = _sum_q5_k16(ld_v4_u32(w, bo + 64 + 32 * c), ld_v4_u32(w, bo + 32), c,
                             ld_v4_u32(xq, x0 + 16), ld_v4_u32(xq, x0 + 48), s_lo, s_hi)
    return _k4_combine(w, bo, c, xd, xs, _udiv(x0, Q8_BLOCK), s_lo, s_hi)


@device_function
def _unit_q6_k(w, bo, part, xq, xd, xs, xo):
    # part = 2n + h: half n of the block, ql/qh columns l in [16h, 16h + 16); groups g = 0..3 are
    # elements 128n + 32g + l, 6-bit values (ql nibble | 2 qh bits) − 32, scale sc[8n + 2g + h].
    n = part >> 1
    h = part & 1
    ql_lo = words4_unaligned(w, bo + 64 * n + 16 * h)        # ql[l]
    ql_hi = words4_unaligned(w, bo + 64 * n + 32 + 16 * h)   # ql[l + 32]
    qh = words4_unaligned(w, bo + 128 + 32 * n + 16 * h)
    xbase = xo + 128 * n + 16 * h
    total = float32(0.0)
    for g in range(4):
        xw = ld_v4_u32(xq, xbase + 32 * g)
        s = 0
        for i in range(4):
            ql = ql_hi[i] if g & 1 else ql_lo[i]
            v = ((ql >> (4 * (g >> 1))) & M4) | (((qh[i] >> (2 * g)) & M2) << 4)
            s = dp4a(((v | 0x80808080) - 0x20202020) ^ 0x80808080, xw[i], s)  # bytes − 32
        sc = int32((ld_u16(w, bo + 192 + 8 * n + 2 * g) >> (8 * h)) & 0xFF)  # signed int8 scale
        sc = sc - 256 if sc > 127 else sc
        total += float32(sc) * xd[_udiv(xbase, Q8_BLOCK) + g] * float32(s)
    return f16(ld_u16(w, bo + 208)) * total


# ---------------------------------------------------------------- float weights (x in float32)
@device_function
def _unit_f32(w, bo, part, x, xd, xs, xo):
    wv = ld_v4_u32(w, bo)
    xv = ld_v4_u32(x, 4 * xo)
    s = float32(0.0)
    for i in range(4):
        s += bits_to_f32(wv[i]) * bits_to_f32(xv[i])
    return s


@device_function
def _unit_f16(w, bo, part, x, xd, xs, xo):
    wv = ld_v4_u32(w, bo)
    xa = ld_v4_u32(x, 4 * xo)
    xb = ld_v4_u32(x, 4 * xo + 16)
    s = float32(0.0)
    for i in range(2):
        s += f16(wv[i]) * bits_to_f32(xa[2 * i]) + f16(wv[i] >> 16) * bits_to_f32(xa[2 * i + 1])
        s += (f16(wv[i + 2]) * bits_to_f32(xb[2 * i])
              + f16(wv[i + 2] >> 16) * bits_to_f32(xb[2 * i + 1]))
    return s


@device_function
def _unit_bf16(w, bo, part, x, xd, xs, xo):
    wv = ld_v4_u32(w, bo)
    xa = ld_v4_u32(x, 4 * xo)
    xb = ld_v4_u32(x, 4 * xo + 16)
    s = float32(0.0)
    for i in range(2):
        s += (bits_to_f32(wv[i] << 16) * bits_to_f32(xa[2 * i])
              + bits_to_f32(wv[i] & 0xFFFF0000) * bits_to_f32(xa[2 * i + 1]))
        s += (bits_to_f32(wv[i + 2] << 16) * bits_to_f32(xb[2 * i])
              + bits_to_f32(wv[i + 2] & 0xFFFF0000) * bits_to_f32(xb[2 * i + 1]))
    return s


# type → (unit fn, elements per unit-block, bytes per unit-block, units per block)
_UNITS = {
    GGMLType.Q4_0: (_unit_q4_0, 32, 18, 1),
    GGMLType.Q4_1: (_unit_q4_1, 32, 20, 1),
    GGMLType.Q5_0: (_unit_q5_0, 32, 22, 1),
    GGMLType.Q5_1: (_unit_q5_1, 32, 24, 1),
    GGMLType.Q8_0: (_unit_q8_0, 32, 34, 1),
    GGMLType.IQ4_NL: (_unit_iq4_nl, 32, 18, 1),
    GGMLType.IQ4_XS: (_unit_iq4_xs, 256, 136, 8),
    GGMLType.Q4_K: (_unit_q4_k, 256, 144, 4),
    GGMLType.Q5_K: (_unit_q5_k, 256, 176, 4),
    GGMLType.Q6_K: (_unit_q6_k, 256, 210, 4),
    GGMLType.F32: (_unit_f32, 4, 16, 1),
    GGMLType.F16: (_unit_f16, 8, 16, 1),
    GGMLType.BF16: (_unit_bf16, 8, 16, 1),
}
FLOAT_TYPES = frozenset({GGMLType.F32, GGMLType.F16, GGMLType.BF16})


@functools.cache
def _row_reduction(n_acc: int):
    """Device fn: each row's n_acc sums over the lanes that share it (shuffles) and, when the
    block's warps share the rows (row_warps > 1), over the warps: warp 0's lanes get the totals."""

    @device_function
    def reduce_rows(acc, lanes_per_row, row_warps):
        lane, warp = cuda.threadIdx.x % 32, cuda.threadIdx.x // 32
        for c in range(n_acc):
            for offset in (16, 8, 4, 2, 1):
                if offset < lanes_per_row:
                    acc[c] += shfl_xor(acc[c], offset)
        if row_warps > 1:
            partial = cuda.shared.array((WARPS_PER_BLOCK, 32, n_acc), float32)
            for c in range(n_acc):
                partial[warp, lane, c] = acc[c]
            cuda.syncthreads()
            for c in range(n_acc):
                for other in range(1, WARPS_PER_BLOCK):
                    acc[c] += partial[other, lane, c]
    return reduce_rows


@functools.cache
def _unit_adder(ggml_type: GGMLType, n_cols: int, swiglu: bool, rows_per_lane: int):
    """accumulate(acc, base, ...): unit u of each of a lane's rows dotted with the n_cols
    columns, added to row j's sums at acc[base + j·n_acc:] (gate then up sums with swiglu)."""
    unit, blk_elems, blk_bytes, parts = _UNITS[ggml_type]
    n_acc = 2 * n_cols if swiglu else n_cols

    @device_function
    def accumulate(acc, base, bases, w, w2, u, xcol, xq, xd, xs):
        blk = _udiv(u, parts)
        for c in range(n_cols):
            xo = xcol[c] + blk * blk_elems
            for j in range(rows_per_lane):
                at = bases[j] + blk * blk_bytes
                acc[base + j * n_acc + c] += unit(w, at, u - blk * parts, xq, xd, xs, xo)
                if swiglu:
                    acc[base + j * n_acc + n_cols + c] += unit(w2, at, u - blk * parts, xq, xd,
                                                               xs, xo)

    return accumulate


@functools.cache
def _lane_sums(accumulate, virtual: int, acc_len: int):
    """(sum_units, fold_virtual_lanes): a lane's walk over a row's units from `sub` in steps of
    `stride`, two units in flight; with virtual > 1, unit u + v·stride of a round goes to virtual
    lane v's sums (see gemv), which the fold then adds in the xor tree's order for the offsets
    ≥ lanes_per_row, pairs within the lane."""

    @device_function
    def sum_units(acc, bases, w, w2, sub, stride, n_units, xcol, xq, xd, xs):
        u = sub
        if virtual == 1:
            while u + stride < n_units:
                accumulate(acc, 0, bases, w, w2, u, xcol, xq, xd, xs)
                accumulate(acc, 0, bases, w, w2, u + stride, xcol, xq, xd, xs)
                u += 2 * stride
            if u < n_units:
                accumulate(acc, 0, bases, w, w2, u, xcol, xq, xd, xs)
        else:
            while u + (virtual - 1) * stride < n_units:
                for v in range(virtual):
                    accumulate(acc, v * acc_len, bases, w, w2, u + v * stride, xcol, xq, xd, xs)
                u += virtual * stride
            for v in range(virtual):
                if u + v * stride < n_units:
                    accumulate(acc, v * acc_len, bases, w, w2, u + v * stride, xcol, xq, xd, xs)

    @device_function
    def fold_virtual_lanes(acc):
        half = virtual // 2
        while half >= 1:
            for v in range(half):
                for c in range(acc_len):
                    acc[v * acc_len + c] += acc[(v + half) * acc_len + c]
            half //= 2

    return sum_units, fold_virtual_lanes


@functools.cache
def _block_rows(ggml_type: GGMLType, n_cols: int, swiglu: bool, rows_per_lane: int,
                virtual: int = 1):
    """The GEMV kernel's device body: this block's rows of the matrix at byte mat_base, dotted with
    n_cols activation columns; column c reads x from element xcol[c] and lands in output column
    ycol[c] (the kernel maps its grid.x slot to those columns).

    swiglu: also dot the same rows of a second matrix w2 (up) and write silu(W·x) · (W2·x).
    rows_per_lane: rows whose units a lane loads side by side (2: twice the loads in flight).
    virtual: lanes of the row's reduction order each lane stands for (gemv's batch invariance):
    a lane keeps a sum per virtual lane and folds them in the xor tree's order.
    """
    _, blk_elems, _, parts = _UNITS[ggml_type]
    n_acc = 2 * n_cols if swiglu else n_cols
    acc_len = rows_per_lane * n_acc  # a compile-time constant for the local array
    lane_acc_len = virtual * acc_len  # and the sums of all virtual lanes
    reduce_rows = _row_reduction(acc_len)
    store_rows = _row_stores(n_cols, swiglu, rows_per_lane)
    accumulate = _unit_adder(ggml_type, n_cols, swiglu, rows_per_lane)
    sum_units, fold_virtual_lanes = _lane_sums(accumulate, virtual, acc_len)

    @device_function
    def block_rows(w, w2, row_bytes, n_rows, mat_base, k, lanes_per_row, row_warps, row_block,
                   xcol, ycol, xq, xd, xs, bias, has_bias, y0, y1, y2, y3, ends):
        # a row per `lanes_per_row` lanes (32, fewer for short rows) of `row_warps` warps (1, or
        # all WARPS_PER_BLOCK for matrices of few long rows), times rows_per_lane: the lanes of
        # row r also take rows r + rows_per_warp, ...; two units a row in flight per lane
        lane, warp = cuda.threadIdx.x % 32, cuda.threadIdx.x // 32
        rows_per_warp = 32 // lanes_per_row
        first = (row_block * (WARPS_PER_BLOCK // row_warps) + warp // row_warps) \
            * rows_per_warp * rows_per_lane
        if first >= n_rows:
            return
        row = first + lane // lanes_per_row
        sub = lane % lanes_per_row + (warp % row_warps) * lanes_per_row
        stride = lanes_per_row * row_warps
        # (virtual lanes, rows, n_cols or gate + up)
        acc = cuda.local.array(lane_acc_len, float32)
        bases = cuda.local.array(rows_per_lane, int64)
        for c in range(lane_acc_len):
            acc[c] = 0.0
        for j in range(rows_per_lane):  # rows past the end re-read the last (never stored)
            bases[j] = mat_base + min(row + j * rows_per_warp, n_rows - 1) * row_bytes
        if row < n_rows:
            sum_units(acc, bases, w, w2, sub, stride, k // blk_elems * parts, xcol, xq, xd, xs)
        fold_virtual_lanes(acc)
        reduce_rows(acc, lanes_per_row, row_warps)
        if sub == 0:
            store_rows(acc, row, rows_per_warp, n_rows, ycol, bias, has_bias, y0, y1, y2, y3, ends)
    return block_rows


@functools.cache
def _row_stores(n_cols: int, swiglu: bool, rows_per_lane: int):
    """Device fn: a lane's reduced sums (rows_per_lane rows × n_cols, and the up sums when swiglu)
    → the outputs, with silu(gate)·up and the bias applied; rows past n_rows are dropped."""
    n_acc = 2 * n_cols if swiglu else n_cols

    @device_function
    def store_rows(acc, row, rows_per_warp, n_rows, ycol, bias, has_bias, y0, y1, y2, y3, ends):
        for j in range(rows_per_lane):
            r = row + j * rows_per_warp
            if r < n_rows:
                for c in range(n_cols):
                    total = acc[j * n_acc + c]
                    if swiglu:
                        total = total / (float32(1.0) + math.exp(-total)) \
                            * acc[j * n_acc + n_cols + c]
                    if has_bias:
                        total += bias[r]
                    store_part(y0, y1, y2, y3, ends, ycol[c], r, total)
    return store_rows


@functools.cache
def _gemv_kernel(ggml_type: GGMLType, n_cols: int, swiglu: bool = False,
                 rows_per_lane: int = 1, virtual: int = 1):
    """grid.x = slot: matrix slot_mat[slot], the n_cols columns of activation group slot_x[slot];
    grid.y: row blocks (grid-stride over n_row_blocks).

    The slot is the fastest grid index so that the slots reading the same rows run together: the
    groups of a batched linear, or the tokens that picked the same expert, share one DRAM read
    of those rows through L2 (with row blocks fastest, a slot's re-read came after the whole
    matrix had passed through L2)."""
    block_rows = _block_rows(ggml_type, n_cols, swiglu, rows_per_lane, virtual)

    @kernel(fastmath=True)
    def gemv(w, w2, row_bytes, n_rows, mat_bytes, k, lanes_per_row, row_warps, n_row_blocks,
             slot_mat, slot_x, xq, xd, xs, bias, has_bias, y0, y1, y2, y3, ends):
        chain_start()
        slot = cuda.blockIdx.x
        xcol = cuda.local.array(n_cols, int32)  # (n_cols,) element offsets into x
        ycol = cuda.local.array(n_cols, int32)  # (n_cols,) output columns
        for c in range(n_cols):
            xcol[c] = (slot_x[slot] * n_cols + c) * k
            ycol[c] = slot * n_cols + c
        for row_block in range(cuda.blockIdx.y, n_row_blocks, cuda.gridDim.y):
            block_rows(w, w2, row_bytes, n_rows, slot_mat[slot] * mat_bytes, k, lanes_per_row,
                       row_warps, row_block, xcol, ycol, xq, xd, xs, bias, has_bias, y0, y1, y2,
                       y3, ends)
            if row_warps > 1:
                cuda.syncthreads()  # reduce_rows' shared partials are rewritten next round
    return gemv


@device_function
def store_part(y0, y1, y2, y3, ends, col, row, v):
    """Row `row` of the stacked matrix → its part's array (part p: rows [ends[p-1], ends[p]))."""
    if row < ends[0]:
        y0[col * ends[0] + row] = v
    elif row < ends[1]:
        y1[col * (ends[1] - ends[0]) + row - ends[0]] = v
    elif row < ends[2]:
        y2[col * (ends[2] - ends[1]) + row - ends[1]] = v
    else:
        y3[col * (ends[3] - ends[2]) + row - ends[2]] = v


def units_per_row(ggml_type: GGMLType, k: int) -> int:
    """The units (see _UNITS) a row of k elements splits into over its lanes."""
    _, blk_elems, _, parts = _UNITS[ggml_type]
    return k // blk_elems * parts


def lanes_per_row(ggml_type: GGMLType, k: int, n_rows: int) -> int:
    """Lanes sharing one row: 32, or the power of two ≥ the row's unit count for short rows.

    GEMVs of more than LANE_BUDGET lanes (n_rows, × slots, times lanes a row) take several waves
    of blocks: there a row's lanes halve (to MIN_LANES, at most MAX_UNITS_A_LANE units a lane)
    until the GEMV fits the budget and its units split evenly over a row's lanes. Fewer, busier
    lanes keep more loads in flight each, which made the LM head and the experts' GEMVs faster on
    the H200 (bench/probes/cuda_gemv_bench.py)."""
    n_units = units_per_row(ggml_type, k)
    lanes = next_pow2(min(n_units, 32))
    if n_rows * lanes <= LANE_BUDGET:
        return lanes
    while (lanes > MIN_LANES and n_units // (lanes // 2) <= MAX_UNITS_A_LANE
           and (n_rows * lanes > LANE_BUDGET or n_units % lanes)):
        lanes //= 2
    return lanes


def row_warps(ggml_type: GGMLType, k: int, n_rows: int) -> int:
    """Warps sharing each row: all of the block's when a warp per row would leave the GPU with
    few blocks while each lane loops over ≥ 8 units (the router: 128-257 F32 rows of 2048, one
    memory latency per 2 units), else 1."""
    units_per_lane = units_per_row(ggml_type, k) // 32
    few_blocks = n_rows < SPLIT_ROWS_BELOW
    return WARPS_PER_BLOCK if few_blocks and units_per_lane >= 8 else 1


def rows_per_lane(n_cols: int, n_rows: int, row_warps: int, units_a_lane: int) -> int:
    """2 for one-column GEMVs of ≥ MULTI_ROW_MIN_ROWS rows (× slots) whose lanes hold ≤ 2 units
    of a row: matrices that take several waves of blocks, where loads in flight rather than launch
    latency bound the time (Qwen3.6's experts' down projections); else 1. Lanes that hold more
    units of one row (lanes_per_row narrowed them) measured slower with a second row."""
    multi = n_cols == 1 and row_warps == 1 and n_rows >= MULTI_ROW_MIN_ROWS and units_a_lane <= 2
    return 2 if multi else 1


@device_function
def store_q8(v, i, xq, xd, xs):
    """Called by the 32 lanes of a warp holding element i = 32·blk + lane: q8_1 of block blk,
    d = max|x|/127, q = round(x/d), s = d·Σq (so fused producers quantize in the same pass)."""
    amax = warp_max(abs(v))
    d = amax / float32(127.0)
    q = math.floor(v / d + float32(0.5)) if amax > 0 else float32(0.0)
    total = warp_sum(q)
    xq[i] = q
    if i % 32 == 0:
        xd[i // 32] = d
        xs[i // 32] = d * total


@kernel(fastmath=True)  # the division as in the fused producers (norm, SwiGLU, attention)
def _quantize_q8_kernel(x, n_blocks, xq, xd, xs):
    chain_start()
    # a warp per 32-element block (grid-stride)
    lane = cuda.threadIdx.x % 32
    n_warps = cuda.gridDim.x * cuda.blockDim.x // 32
    for blk in range(cuda.grid(1) // 32, n_blocks, n_warps):
        store_q8(x[blk * 32 + lane], blk * 32 + lane, xq, xd, xs)


class QuantizedActivations:
    """Workspace for activations quantized to int8 per 32 elements: shape (n_groups, n_cols, k)."""

    def __init__(self, n_groups: int, n_cols: int, k: int):
        if k % Q8_BLOCK:
            raise ValueError(f"activation length {k} is not a multiple of {Q8_BLOCK}")
        self.shape = (n_groups, n_cols, k)
        self.xq = cuda.device_array(n_groups * n_cols * k, np.int8)  # (n_groups·n_cols·k,)
        self.xd = cuda.device_array(n_groups * n_cols * k // Q8_BLOCK, np.float32)  # (.../32,)
        self.xs = cuda.device_array(n_groups * n_cols * k // Q8_BLOCK, np.float32)  # (.../32,)


def quantize_activations(x, out: QuantizedActivations, stream=0) -> None:
    """x: float32 device array of out.shape → out.xq / xd / xs."""
    check_array("x", x, np.float32, out.shape)
    n_blocks = x.size // Q8_BLOCK
    grid = min(cdiv(n_blocks, 4), 1024)
    _quantize_q8_kernel[grid, 128, stream](x.reshape(x.size), n_blocks, out.xq, out.xd, out.xs)


class DeviceQuantMatrix:
    """GGUF tensor bytes on the device: (n_mats, n_rows, k) of ggml_type, rows of row_bytes."""

    def __init__(self, data, ggml_type: int, k: int, n_rows: int, n_mats: int = 1):
        self.ggml_type = GGMLType(ggml_type)
        if self.ggml_type not in _UNITS:
            raise ValueError(f"no CUDA GEMV for ggml type {self.ggml_type.name}")
        blk_elems = _UNITS[self.ggml_type][1]
        if k % blk_elems:
            raise ValueError(f"{self.ggml_type.name} GEMV needs k % {blk_elems} == 0, got k={k}")
        self.k, self.n_rows, self.n_mats = k, n_rows, n_mats
        self.row_bytes = row_bytes(self.ggml_type, k)
        needs16 = BLOCK_GEOMETRY[self.ggml_type][1] % 16 == 0 or self.ggml_type in FLOAT_TYPES
        if needs16 and self.row_bytes % 16:
            raise ValueError(f"{self.ggml_type.name} rows must be 16-byte multiples for the CUDA "
                             f"GEMV, got {self.row_bytes} bytes")
        if data.size < n_mats * n_rows * self.row_bytes:
            raise ValueError("device buffer smaller than the matrix")
        self.data = data

    @property
    def takes_float_activations(self) -> bool:
        return self.ggml_type in FLOAT_TYPES


_ONE_SLOT = {}


def _default_slots():
    # NOTE: cached device array [0] reused by every single-matrix GEMV (graph-capture safe).
    if "slots" not in _ONE_SLOT:
        _ONE_SLOT["slots"] = cuda.to_device(np.zeros(1, np.int32))
    return _ONE_SLOT["slots"]


def gemv(w: DeviceQuantMatrix, x, y, *, slot_mat=None, slot_x=None,
         up: DeviceQuantMatrix | None = None, bias=None, stream=0,
         fixed_order: bool = True) -> None:
    """y (n_slots, n_cols, n_rows) f32 ← W[slot_mat[s]] · x[slot_x[s]] (+ bias (n_rows,) f32).

    x is a QuantizedActivations for quantized weights, a float32 (n_groups, n_cols, k) device array
    for F32/F16/BF16 weights. slot_mat/slot_x: int32 device arrays of length n_slots (default [0]).
    up: a second matrix of the same type and shape; then y = silu(W·x) ⊙ (up·x) (fused SwiGLU).
    y may be a sequence of up to MAX_PARTS arrays (n_slots, n_cols, rows_p) with Σ rows_p = n_rows:
    the stacked matrix's rows in order, one part per array.
    fixed_order: each row sums in the order its matrix alone fixes, whatever n_slots
    (reduction_layout); False: the launch shape's order (faster at many slots).
    """
    _check_up(w, up)
    slot_mat = _default_slots() if slot_mat is None else slot_mat
    slot_x = _default_slots() if slot_x is None else slot_x
    n_slots = slot_mat.size
    xq, xd, xs, n_cols = _activation_args(w, x)
    parts, ends = output_parts(y, n_slots, n_cols, w.n_rows)
    if bias is not None:
        check_array("bias", bias, np.float32, (w.n_rows,))
    lanes, virtual, warps = reduction_layout(w, n_slots, fixed_order)
    units_a_lane = cdiv(units_per_row(w.ggml_type, w.k), lanes)
    lane_rows = rows_per_lane(n_cols, w.n_rows * n_slots, warps, units_a_lane)
    n_row_blocks = cdiv(w.n_rows, WARPS_PER_BLOCK // warps * (32 // lanes) * lane_rows)
    grid = (n_slots, min(n_row_blocks, MAX_GRID_Y))
    kernel = _gemv_kernel(w.ggml_type, n_cols, up is not None, lane_rows, virtual)
    kernel[grid, 32 * WARPS_PER_BLOCK, stream](
        w.data, w.data if up is None else up.data, w.row_bytes, w.n_rows, w.n_rows * w.row_bytes,
        w.k, lanes, warps, n_row_blocks, slot_mat, slot_x, xq, xd, xs,
        parts[0] if bias is None else bias, bias is not None, *parts, ends)


def reduction_layout(w: DeviceQuantMatrix, n_slots: int,
                     fixed_order: bool = True) -> tuple[int, int, int]:
    """(lanes a row, virtual lanes a lane, warps a row) of a GEMV of w over n_slots slots.

    A row's float sum must not depend on the slots beside it (a greedy answer may not change with
    the batch), but the launch shape does: lanes_per_row narrows a row's lanes once rows × slots
    pass the lane budget. So with fixed_order the order of a row's sum is fixed by the matrix
    alone: the lanes (and warps) one slot would get, V = `lanes · virtual`; a narrowed launch's
    lane keeps one sum per virtual lane it stands for (the units V lanes would take, in the same
    order) and folds them in the xor tree's order before the shuffles: bit for bit the sums of V
    lanes. Warps share a row only for matrices of few rows (row_warps of the matrix's rows, not ×
    slots); those keep V. Without fixed_order: the launch shape's own layout."""
    if not fixed_order:
        rows = w.n_rows * n_slots
        return lanes_per_row(w.ggml_type, w.k, rows), 1, row_warps(w.ggml_type, w.k, rows)
    warps = row_warps(w.ggml_type, w.k, w.n_rows)
    own = lanes_per_row(w.ggml_type, w.k, w.n_rows)
    if warps > 1:
        return own, 1, warps
    lanes = min(own, lanes_per_row(w.ggml_type, w.k, w.n_rows * n_slots))
    return lanes, own // lanes, warps


def _check_up(w: DeviceQuantMatrix, up: DeviceQuantMatrix | None) -> None:
    if up is not None and (up.ggml_type, up.k, up.n_rows, up.n_mats) != (
            w.ggml_type, w.k, w.n_rows, w.n_mats):
        raise ValueError("gate and up matrices must share type and shape for the fused SwiGLU")


def _activation_args(w: DeviceQuantMatrix, x) -> tuple:
    """(xq, xd, xs, n_cols) kernel arguments of activations x of shape (n_groups, n_cols, w.k)."""
    _, n_cols, k = x.shape
    if w.takes_float_activations:
        check_array("x", x, np.float32)
        xq, xd, xs = x.reshape(x.size), _default_slots(), _default_slots()
    else:
        xq, xd, xs = x.xq, x.xd, x.xs
    if k != w.k or not 1 <= n_cols <= MAX_COLS:
        raise ValueError(f"activations (·, {n_cols}, {k}) do not fit W (k={w.k}, ≤{MAX_COLS} cols)")
    return xq, xd, xs, n_cols


def output_parts(y, n_slots: int, n_cols: int, n_rows: int) -> tuple[list, tuple[int, ...]]:
    """The GEMV's output arrays flattened and padded to MAX_PARTS, and each part's end row."""
    ys = list(y) if isinstance(y, (list, tuple)) else [y]
    if not 1 <= len(ys) <= MAX_PARTS:
        raise ValueError(f"a GEMV writes 1..{MAX_PARTS} outputs, got {len(ys)}")
    ends, end = [], 0
    for i, part in enumerate(ys):
        check_array(f"y[{i}]", part, np.float32)
        if tuple(part.shape[:2]) != (n_slots, n_cols) or len(part.shape) != 3:
            raise ValueError(f"y[{i}]: shape {tuple(part.shape)}, expected "
                             f"({n_slots}, {n_cols}, ·)")
        end += part.shape[2]
        ends.append(end)
    if end != n_rows:
        raise ValueError(f"outputs hold {end} rows, the matrix has {n_rows}")
    flat = [part.reshape(part.size) for part in ys]
    pad = MAX_PARTS - len(flat)
    return flat + [flat[-1]] * pad, tuple(ends + [end] * pad)


# ---------------------------------------------------------------- numpy references
def quantize_q8_reference(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(q int8, d f32, s = d·Σq f32) per 32 elements along the last axis, as the kernel does."""
    blocks = x.astype(np.float32).reshape(*x.shape[:-1], -1, Q8_BLOCK)  # (..., k/32, 32)
    d = np.abs(blocks).max(axis=-1) / np.float32(127.0)  # (..., k/32)
    safe = np.where(d > 0, d, np.float32(1.0))[..., None]
    q = np.where(d[..., None] > 0, np.floor(blocks / safe + np.float32(0.5)), 0).astype(np.int8)
    s = d * q.astype(np.float32).sum(axis=-1)
    return q.reshape(x.shape), d.astype(np.float32), s.astype(np.float32)


def gemv_reference(w_bytes: np.ndarray, ggml_type: int, k: int, x: np.ndarray) -> np.ndarray:
    """dequantize(W) (n_rows, k) @ x (n_cols, k)ᵀ → (n_cols, n_rows), in float64."""
    from gguf.quants import dequantize

    w = dequantize(w_bytes.reshape(-1, row_bytes(ggml_type, k)), ggml_type).astype(np.float64)
    return x.astype(np.float64) @ w.reshape(-1, k).T
