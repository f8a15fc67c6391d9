"""Prefill GEMM on tensor cores over weights in their GGUF byte layout.

y[slot, r] = Σ_k W[mat][r, k] · x[xrow(slot), k] (+ bias[r])   (mma.sync m16n8k16, f16·f16 → f32)

- `matmul`: dense, slot = token (x and y are (n_tok, ·)). `grouped_matmul`: MoE prefill, the token
  tiles of an ExpertRoute (each tile's slots all use one expert matrix), x rows picked by slot_x.
- A block computes BM = 128 weight rows × BN tokens, stepping k by BK = 32 through two
  shared-memory buffers (one barrier per step: each thread loads its share of step s+1, the warps
  multiply step s from one buffer while those loads are in flight, then store step s+1 into the
  other). Staging dequantizes each weight row's 16-element piece straight from the GGUF bytes to
  f16 and converts the float32 activations to f16.
- BN: 64 or 128 (dense); grouped tiles also 16 or 32 (`expert_tile`: a mixed serving step routes
  a few tokens to each expert, and a 64-token tile would multiply mostly padding). A block of
  such a tile stages 2-4 k steps between two barriers (`_stages`): its next steps' loads all go
  out before the warps multiply the current ones, since a tile of few tokens waits on loads, not
  on the mma.
- 8 warps as WARPS_M × WARPS_N, a warp owning (BM / WARPS_M) rows × min(BN, 32) tokens, i.e. MT
  m16 tiles × NT n8 tiles of f32 accumulators.
- Fused SwiGLU (`up=`): the 128 staged rows are 64 gate rows and the same 64 rows of `up`,
  interleaved so that every warp holds the gate and up accumulators of the same output rows
  (with one m16 tile a warp: its rows 0-7 gate, 8-15 up, paired within each lane).
- Outputs may be split over up to MAX_PARTS arrays by row range, like quant_gemv.gemv.
- Split-K (dense, given a `partials` buffer): a grid of too few blocks to fill the GPU (a decode
  batch of 32-64 tokens is one token tile: a 2,048-row matrix makes 16 blocks) walks k in up to
  MAX_K_SPLITS ranges on grid.z, each block storing its raw sums; `_splitk_epilogue` adds them up
  and applies SwiGLU / bias. A block's k walk is a chain of ~1-2 µs steps, so without the split a
  64-token linear takes as long as its k is wide whatever its row count.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import numpy as np
from numba import cuda, float32, int32, int64, uint32

from sparkinfer_cli.gguf.ggml_types import GGMLType
from sparkinfer_cli.kernels.cuda import fragment_gemm
from sparkinfer_cli.kernels.cuda import quant_gemv as qg
from sparkinfer_cli.kernels.cuda.ggml_blocks import (
    M1,
    M2,
    M4,
    f16,
    scale_min_k4,
    spread4,
    u32_from_u16s,
    words4_aligned,
    words4_unaligned,
)
from sparkinfer_cli.kernels.cuda.mma_fragments import (
    block_tile,
    gemm_epilogue,
    k_range,
    mma_into,
)
from sparkinfer_cli.kernels.cuda.quant_gemv import DeviceQuantMatrix, store_part
from sparkinfer_cli.kernels.cuda.runtime.intrinsics import (
    bits_to_f32,
    byte_perm,
    chain_start,
    ld_u16,
    ld_u32,
    ld_v4_u32,
    ldmatrix_x4,
    ldmatrix_x4_pairs,
    pack_f16x2,
)
from sparkinfer_cli.kernels.cuda.runtime.jit import device_function, kernel
from sparkinfer_cli.kernels.cuda.runtime.launch import cdiv, check_array

BM = 128  # weight rows staged per block
BK = 32  # k elements per pipeline step
THREADS = 256
ROW_WORDS = 20  # u32 per staged row: 32 f16 + 16 pad bytes, so ldmatrix's 8 rows hit distinct banks
ROW_STRIDE = 4 * ROW_WORDS
TOKEN_TILES = (16, 32, 64, 128)  # BN choices: grouped tiles of a few tokens, dense 64 / 128
DENSE_TILES = TOKEN_TILES[-2:]
STAGE_CHOICES = (4, 2)  # k steps a grouped block stages between barriers, if k and smem allow
MAX_STAGED_TILE = 32  # larger tiles keep the double-buffered walk (staged, they spill registers)
MAX_STATIC_SHARED = 48 * 1024  # bytes of static shared memory a block may declare
_MAGIC = float32(8388608.0)  # 2^23: the float with bits 0x4B000000
# Split-K: a grid of few row blocks leaves most of the GPU's 132 SMs idle while each block walks
# all of k, so splitting k pays; a grid of ~100 row blocks already fills them, and splitting it
# only adds blocks an SM and the partials' write and read. So: grids under SPLIT_BELOW_BLOCKS
# blocks split k up to SPLIT_TARGET_BLOCKS blocks (measured with bench/probes/cuda_gemv_bench.py
# --batch-only; figures in bench/results/2026-11-30-cuda-decode-latency.md).
SPLIT_BELOW_BLOCKS = 64
SPLIT_TARGET_BLOCKS = 256
MAX_K_SPLITS = 16
MIN_SPLIT_STEPS = 4  # BK steps a k range holds at least


# ---------------------------------------------------------------- 16 weights → 8 f16x2 words
@device_function(numba_inline=True)
def _pair(word, i, scale, shift):
    """Bytes i, i+1 of `word` → f16x2 of scale·byte + shift. prmt builds the float bits
    0x4B0000bb = 2^23 + byte, so subtracting 2^23 gives the byte exactly."""
    lo = bits_to_f32(byte_perm(word, 0x4B000000, 0x7440 | i)) - _MAGIC
    hi = bits_to_f32(byte_perm(word, 0x4B000000, 0x7441 + i)) - _MAGIC
    return pack_f16x2(scale * lo + shift, scale * hi + shift)


@device_function(numba_inline=True)
def _affine16(q, scale, shift):
    """16 unsigned byte values (4 words) → 8 f16x2 words of scale·q + shift, in element order."""
    return (_pair(q[0], 0, scale, shift), _pair(q[0], 2, scale, shift),
            _pair(q[1], 0, scale, shift), _pair(q[1], 2, scale, shift),
            _pair(q[2], 0, scale, shift), _pair(q[2], 2, scale, shift),
            _pair(q[3], 0, scale, shift), _pair(q[3], 2, scale, shift))


@device_function(numba_inline=True)
def _nibbles(q, shift):
    return ((q[0] >> shift) & M4, (q[1] >> shift) & M4, (q[2] >> shift) & M4, (q[3] >> shift) & M4)


@device_function(numba_inline=True)
def _pack4(v):
    """4 float32 bit patterns → 2 f16x2 words."""
    return (pack_f16x2(bits_to_f32(v[0]), bits_to_f32(v[1])),
            pack_f16x2(bits_to_f32(v[2]), bits_to_f32(v[3])))


# Each codes function: (weight bytes, byte offset of the row, element kk of the row, kk % 16 == 0)
# → the row's elements kk..kk+15 as (q: 16 unsigned byte codes in 4 words, scale, shift), element
# e = scale·q_e + shift in float32 (gguf's dequantize value, up to its last rounding); a piece
# function gives them as 8 f16x2 words (the tensor-core GEMM's staging).
@device_function(numba_inline=True)
def _codes_q4_0(w, off, kk):
    bo = off + (kk >> 5) * 18
    d = f16(ld_u16(w, bo))
    q = _nibbles(words4_unaligned(w, bo + 2), 4 * ((kk >> 4) & 1))
    return q, d, float32(-8.0) * d


@device_function(numba_inline=True)
def _codes_q4_1(w, off, kk):
    bo = off + (kk >> 5) * 20
    dm = ld_u32(w, bo)
    q = _nibbles(words4_aligned(w, bo + 4), 4 * ((kk >> 4) & 1))
    return q, f16(dm), f16(dm >> 16)


@device_function(numba_inline=True)
def _q5_legacy(qs, qh, h):
    """Element i of half h: nibble h of qs byte i, 5th bit = bit 16h + i of qh."""
    hb = qh >> (16 * h)
    return (((qs[0] >> (4 * h)) & M4) | (spread4(hb & 0xF) << 4),
            ((qs[1] >> (4 * h)) & M4) | (spread4((hb >> 4) & 0xF) << 4),
            ((qs[2] >> (4 * h)) & M4) | (spread4((hb >> 8) & 0xF) << 4),
            ((qs[3] >> (4 * h)) & M4) | (spread4((hb >> 12) & 0xF) << 4))


@device_function(numba_inline=True)
def _codes_q5_0(w, off, kk):
    bo = off + (kk >> 5) * 22
    d = f16(ld_u16(w, bo))
    q = _q5_legacy(words4_unaligned(w, bo + 6), u32_from_u16s(w, bo + 2), (kk >> 4) & 1)
    return q, d, float32(-16.0) * d


@device_function(numba_inline=True)
def _codes_q5_1(w, off, kk):
    bo = off + (kk >> 5) * 24
    dm = ld_u32(w, bo)
    q = _q5_legacy(words4_aligned(w, bo + 8), ld_u32(w, bo + 4), (kk >> 4) & 1)
    return q, f16(dm), f16(dm >> 16)


@device_function(numba_inline=True)
def _codes_q8_0(w, off, kk):
    bo = off + (kk >> 5) * 34
    q = words4_unaligned(w, bo + 2 + 16 * ((kk >> 4) & 1))
    flipped = (q[0] ^ 0x80808080, q[1] ^ 0x80808080, q[2] ^ 0x80808080, q[3] ^ 0x80808080)
    d = f16(ld_u16(w, bo))
    return flipped, d, float32(-128.0) * d  # int8 b = (b ^ 0x80) − 128


@device_function(numba_inline=True)
def _k4_scales(w, bo, j):
    """(d·sc_j, dmin·m_j) of sub-block j of a Q4_K/Q5_K super-block."""
    dm = ld_u32(w, bo)
    sc, mn = scale_min_k4(j, ld_u32(w, bo + 4), ld_u32(w, bo + 8), ld_u32(w, bo + 12))
    return f16(dm) * float32(sc), f16(dm >> 16) * float32(mn)


@device_function(numba_inline=True)
def _codes_q4_k(w, off, kk):
    # sub-block j = elements 32j..32j+31: nibble j&1 of qs bytes 32(j//2)..+31
    bo = off + (kk >> 8) * 144
    j = (kk >> 5) & 7
    q = _nibbles(ld_v4_u32(w, bo + 16 + 32 * (j >> 1) + 16 * ((kk >> 4) & 1)), 4 * (j & 1))
    scale, mn = _k4_scales(w, bo, j)
    return q, scale, -mn


@device_function(numba_inline=True)
def _with_high_bits(lo, qh, shift, mask):
    """Per byte of 4 words: the low nibble lo | ((qh >> shift) & mask) << 4 (Q5_K's 5th bit,
    Q6_K's top two)."""
    return (lo[0] | (((qh[0] >> shift) & mask) << 4), lo[1] | (((qh[1] >> shift) & mask) << 4),
            lo[2] | (((qh[2] >> shift) & mask) << 4), lo[3] | (((qh[3] >> shift) & mask) << 4))


@device_function(numba_inline=True)
def _codes_q5_k(w, off, kk):
    # as Q4_K, plus the 5th bit of element i of sub-block j = bit j of qh byte i
    bo = off + (kk >> 8) * 176
    j = (kk >> 5) & 7
    h = (kk >> 4) & 1
    lo = _nibbles(ld_v4_u32(w, bo + 48 + 32 * (j >> 1) + 16 * h), 4 * (j & 1))
    qh = ld_v4_u32(w, bo + 16 + 16 * h)
    q = _with_high_bits(lo, qh, j, M1)
    scale, mn = _k4_scales(w, bo, j)
    return q, scale, -mn


@device_function(numba_inline=True)
def _codes_q6_k(w, off, kk):
    # element 128n + 32g + l (l < 32): nibble g//2 of ql[64n + 32(g&1) + l], bits 2g of qh[32n + l],
    # minus 32, scale sc[8n + 2g + l//16]; a 16-element piece has l = 16h..16h+15.
    bo = off + (kk >> 8) * 210
    n = (kk >> 7) & 1
    g = (kk >> 5) & 3
    h = (kk >> 4) & 1
    ql = _nibbles(words4_unaligned(w, bo + 64 * n + 32 * (g & 1) + 16 * h), 4 * (g >> 1))
    qh = words4_unaligned(w, bo + 128 + 32 * n + 16 * h)
    q = _with_high_bits(ql, qh, 2 * g, M2)
    sc = int32((ld_u16(w, bo + 192 + 8 * n + 2 * g) >> (8 * h)) & 0xFF)  # signed int8 scale
    scale = f16(ld_u16(w, bo + 208)) * float32(sc - 256 if sc > 127 else sc)
    return q, scale, float32(-32.0) * scale


@device_function(numba_inline=True)
def _piece_f16(w, off, kk):
    a = ld_v4_u32(w, off + 2 * kk)
    b = ld_v4_u32(w, off + 2 * kk + 16)
    return (a[0], a[1], a[2], a[3], b[0], b[1], b[2], b[3])


@device_function(numba_inline=True)
def _bf16_pair(u):
    return pack_f16x2(bits_to_f32(u << 16), bits_to_f32(u & 0xFFFF0000))


@device_function(numba_inline=True)
def _piece_bf16(w, off, kk):
    a = ld_v4_u32(w, off + 2 * kk)
    b = ld_v4_u32(w, off + 2 * kk + 16)
    return (_bf16_pair(a[0]), _bf16_pair(a[1]), _bf16_pair(a[2]), _bf16_pair(a[3]),
            _bf16_pair(b[0]), _bf16_pair(b[1]), _bf16_pair(b[2]), _bf16_pair(b[3]))


@device_function(numba_inline=True)
def _piece_f32(w, off, kk):
    p0 = _pack4(ld_v4_u32(w, off + 4 * kk))
    p1 = _pack4(ld_v4_u32(w, off + 4 * kk + 16))
    p2 = _pack4(ld_v4_u32(w, off + 4 * kk + 32))
    p3 = _pack4(ld_v4_u32(w, off + 4 * kk + 48))
    return (p0[0], p0[1], p1[0], p1[1], p2[0], p2[1], p3[0], p3[1])


def _piece_of(codes):
    @device_function(numba_inline=True)
    def piece(w, off, kk):
        q, scale, shift = codes(w, off, kk)
        return _affine16(q, scale, shift)
    return piece


_CODES = {
    GGMLType.Q4_0: _codes_q4_0, GGMLType.Q4_1: _codes_q4_1, GGMLType.Q5_0: _codes_q5_0,
    GGMLType.Q5_1: _codes_q5_1, GGMLType.Q8_0: _codes_q8_0, GGMLType.Q4_K: _codes_q4_k,
    GGMLType.Q5_K: _codes_q5_k, GGMLType.Q6_K: _codes_q6_k,
}
_PIECES = {**{t: _piece_of(codes) for t, codes in _CODES.items()},
           GGMLType.F16: _piece_f16, GGMLType.BF16: _piece_bf16, GGMLType.F32: _piece_f32}
SUPPORTED_TYPES = frozenset(_PIECES)


def dequant_piece(ggml_type: int):
    """The device function (row bytes, row's byte offset, kk) → elements kk..kk+15 of the row as
    8 f16x2 words, for a type this GEMM stages; None for others."""
    return _PIECES.get(GGMLType(ggml_type))


def dequant_codes(ggml_type: int):
    """The device function (row bytes, row's byte offset, kk) → elements kk..kk+15 of the row as
    (4 words of unsigned byte codes q, scale, shift): float32 scale·q + shift; for the quantized
    types this GEMM stages, None for others."""
    return _CODES.get(GGMLType(ggml_type))


def supports(w: DeviceQuantMatrix) -> bool:
    """Whether the tensor-core GEMM takes this matrix: a type it dequantizes, rows of whole
    BK-element steps (else fall back to quant_gemv)."""
    return w.ggml_type in _PIECES and w.k % BK == 0


# ---------------------------------------------------------------- the kernel
class _Tiling(NamedTuple):
    """How a block of THREADS splits BM rows × bn tokens (all compile-time constants)."""

    warps_n: int  # warps side by side over tokens (nt · 8 tokens each)
    nt: int  # n8 token tiles a warp: 4, or 2 in a 16-token tile
    warp_rows: int  # staged rows per warp: 64 (bn 128), 32 (bn 64) or 16 (bn ≤ 32)
    mt: int  # m16 tiles per warp
    mt_out: int  # ... of them holding outputs (with SwiGLU over several, the rest hold up rows)
    half_tile: bool  # SwiGLU inside a warp's one m16 tile: rows 0-7 gate, 8-15 the same rows of up
    rows_block: int  # output rows per block
    tok_threads: int  # threads staging one token's BK activations
    tok_elems: int  # floats each of them stages: 16 (bn 128) or 8
    x_threads: int  # threads that stage activations (the block's first ones; a warp multiple)


def tiling(bn: int, swiglu: bool) -> _Tiling:
    warp_tokens = min(bn, 32)
    warps_n = bn // warp_tokens
    warp_rows = BM * warps_n // (THREADS // 32)
    mt = warp_rows // 16
    half_tile = swiglu and mt == 1
    tok_elems = max(8, BK * bn // THREADS)
    return _Tiling(warps_n, warp_tokens // 8, warp_rows, mt,
                   mt // 2 if swiglu and not half_tile else mt, half_tile,
                   BM // 2 if swiglu else BM, BK // tok_elems, tok_elems, bn * BK // tok_elems)


def _stages(bn: int, n_steps: int) -> int:
    """k steps a block stages between two barriers in the grouped GEMM: more weight loads in
    flight a wait (a tile of a few tokens is latency-bound, not compute-bound), as many shared
    buffers as steps; 1: the double-buffered walk of one step a barrier."""
    if bn > MAX_STAGED_TILE:
        return 1
    for u in STAGE_CHOICES:
        if n_steps % u == 0 and 4 * u * (BM + bn) * ROW_WORDS <= MAX_STATIC_SHARED:
            return u
    return 1


@functools.cache
def _stage_fns(ggml_type: GGMLType, bn: int):
    """(fetch, put): a k step's staging in two halves, so that the main loop can issue the next
    steps' global loads, multiply the current ones while they are in flight, then store them.
    Both keep a step's words in slot u of the caller's register arrays qw (8 words) / xw."""
    piece = _PIECES[ggml_type]
    a_words, b_words = BM * ROW_WORDS, bn * ROW_WORDS
    x_words = tiling(bn, False).tok_elems // 2

    @device_function(numba_inline=True)
    def fetch(k0, w_src, w_off, x, x_off, qw, xw, u, stages_x):
        """This thread's share of k0..k0+BK: its weight piece as 8 f16x2 words and (stages_x) its
        activations as f16x2 words."""
        q = piece(w_src, w_off, k0 + (cuda.threadIdx.x & 1) * 16)
        for i in range(8):
            qw[8 * u + i] = q[i]
        if stages_x:
            for i in range(x_words // 2):
                p = _pack4(ld_v4_u32(x, x_off + 4 * (k0 + 4 * i)))
                xw[x_words * u + 2 * i] = p[0]
                xw[x_words * u + 2 * i + 1] = p[1]

    @device_function(numba_inline=True)
    def put(sa, sb, buf, qw, xw, u, a_at, b_at, stages_x):
        """fetch's slot u into buffer `buf` of the shared tiles."""
        base = uint32(buf * a_words + a_at)
        for i in range(8):
            sa[base + uint32(i)] = qw[8 * u + i]
        if stages_x:
            base = uint32(buf * b_words + b_at)
            for i in range(x_words):
                sb[base + uint32(i)] = xw[x_words * u + i]
    return fetch, put


@functools.cache
def multiply_fn(bn: int):
    t = tiling(bn, False)
    a_bytes, b_bytes, mt, nt = 4 * BM * ROW_WORDS, 4 * bn * ROW_WORDS, t.mt, t.nt

    @device_function(numba_inline=True)
    def multiply(sa, sb, buf, a_at, b_at, lane, acc):
        """acc += this warp's rows × nt·8 tokens over the BK of buffer `buf` (two k16 steps)."""
        for kh in range(2):
            b_lo = ldmatrix_x4_pairs(sb, buf * b_bytes + b_at + 32 * kh, ROW_STRIDE, lane)
            b_hi = b_lo
            if nt == 4:
                b_hi = ldmatrix_x4_pairs(sb, buf * b_bytes + b_at + 16 * ROW_STRIDE + 32 * kh,
                                         ROW_STRIDE, lane)
            for mi in range(mt):
                a = ldmatrix_x4(sa, buf * a_bytes + a_at + mi * 16 * ROW_STRIDE + 32 * kh,
                                ROW_STRIDE, lane)
                mma_into(acc, 4 * nt * mi, a, b_lo[0], b_lo[1])
                mma_into(acc, 4 * nt * mi + 4, a, b_lo[2], b_lo[3])
                if nt == 4:
                    mma_into(acc, 4 * nt * mi + 8, a, b_hi[0], b_hi[1])
                    mma_into(acc, 4 * nt * mi + 12, a, b_hi[2], b_hi[3])
    return multiply


@functools.cache
def _operands_fn(bn: int, swiglu: bool, grouped: bool):
    t = tiling(bn, swiglu)
    warp_rows, half = t.warp_rows, t.warp_rows // 2
    tok_threads, tok_elems, x_threads = t.tok_threads, t.tok_elems, t.x_threads

    @device_function(numba_inline=True)
    def operands(row0, mat, lo, n_valid, n_rows, row_bytes, mat_bytes, k, order, slot_x):
        """What this thread stages: (is an up row, weight row byte offset, its smem word, x byte
        offset, its smem word, whether it stages activations). Staged row r: with SwiGLU, each
        warp's first half of rows are gate rows and its second half the same rows of up. Tokens
        past the tile's end repeat its last token and rows past the matrix its last row
        (computed, never stored)."""
        tid = cuda.threadIdx.x
        r = tid >> 1
        w_row = row0 + r
        is_up = False
        if swiglu:
            w_row = row0 + (r // warp_rows) * half + (r % warp_rows) % half
            is_up = r % warp_rows >= half
        w_off = int64(mat) * mat_bytes + int64(min(w_row, n_rows - 1)) * row_bytes
        tok = tid // tok_threads
        j = min(tok, n_valid - 1)
        xrow = slot_x[order[lo + j]] if grouped else lo + j
        x_off = 4 * (int64(xrow) * k + (tid % tok_threads) * tok_elems)
        b_at = tok * ROW_WORDS + (tid % tok_threads) * (tok_elems // 2)
        return is_up, w_off, r * ROW_WORDS + (tid & 1) * 8, x_off, b_at, tid < x_threads
    return operands


@functools.cache
def _chunk_fns(bn: int, swiglu: bool, grouped: bool):
    """(store_chunk, sums_chunk): a chunk of the C fragments → y through the epilogue, or (split
    k) their raw sums → the partials. Two loops, not one with a branch inside: ptxas gave the
    one loop 166 registers (1 block an SM) against 128.

    A lane holds rows lane//4 (+8: elements e ≥ 2) × tokens 2·(lane%4) (+1) of each m16×n8 tile.
    SwiGLU pairs a gate sum with the up sum of the same row: mt_out m16 tiles further on, or in a
    half tile (mt = 1) the same tile's element e + 2 (row + 8), each warp then owning 8 rows."""
    t = tiling(bn, swiglu)
    warps_n, mt_out, nt, half_tile = t.warps_n, t.mt_out, t.nt, t.half_tile
    rows_warp = 8 if half_tile else 16 * mt_out
    up_at = 2 if half_tile else 4 * nt * mt_out  # an output's up sum: this far on in acc
    staged = 2 if swiglu else 1  # partial sums a row

    @device_function(numba_inline=True)
    def fragment(mi, ni, e, row0):
        """(weight row, token of the tile) of this lane's C element e of tile (mi, ni)."""
        lane, warp = cuda.threadIdx.x & 31, cuda.threadIdx.x >> 5
        row = row0 + (warp // warps_n) * rows_warp + 16 * mi + (lane >> 2) + 8 * (e >> 1)
        return row, (warp % warps_n) * 8 * nt + 8 * ni + 2 * (lane & 3) + (e & 1)

    @device_function(numba_inline=True)
    def store_chunk(acc, m0, eh, where):
        """Elements eh, eh + 1 of the n8 tiles of m16 tiles m0, m0 + 1."""
        row0, n_rows, lo, n_valid, order, bias, has_bias, y0, y1, y2, y3, ends = where
        for mi in range(m0, min(m0 + 2, mt_out)):
            for ni in range(nt):
                for e in range(eh, eh + 2):
                    row, j = fragment(mi, ni, e, row0)
                    if row < n_rows and j < n_valid:
                        at = 4 * nt * mi + 4 * ni + e
                        up = acc[at + up_at] if swiglu else float32(0.0)
                        v = gemm_epilogue(acc[at], up, swiglu, bias, has_bias, row)
                        store_part(y0, y1, y2, y3, ends, order[lo + j] if grouped else lo + j,
                                   row, v)

    @device_function(numba_inline=True)
    def sums_chunk(acc, m0, eh, where):
        """store_chunk's elements' raw sums → part (splits, n_slots, rows · (2 with SwiGLU: gate
        sums, then up)) for block z."""
        row0, n_rows, lo, n_valid, order, part, n_slots = where
        for mi in range(m0, min(m0 + 2, mt_out)):
            for ni in range(nt):
                for e in range(eh, eh + 2):
                    row, j = fragment(mi, ni, e, row0)
                    if row < n_rows and j < n_valid:
                        slot = order[lo + j] if grouped else lo + j
                        at = (int64(cuda.blockIdx.z) * n_slots + slot) * (n_rows * staged) + row
                        part[at] = acc[4 * nt * mi + 4 * ni + e]
                        if swiglu:
                            part[at + n_rows] = acc[4 * nt * mi + 4 * ni + e + up_at]

    return store_chunk, sums_chunk


@functools.cache
def store_fns(bn: int, swiglu: bool, grouped: bool):
    """(store, store_sums): all C fragments through _chunk_fns' chunks, each its own loop nest of
    ≤ 16 iterations, which LLVM unrolls, so that acc's indices are constants and it stays in
    registers (one nest over a 64-token tile's 32-64 elements stayed rolled and put acc in local
    memory)."""
    t = tiling(bn, swiglu)
    mt_out, n_e = t.mt_out, 2 if t.half_tile else 4
    store_chunk, sums_chunk = _chunk_fns(bn, swiglu, grouped)

    @device_function(numba_inline=True)
    def store(acc, row0, n_rows, lo, n_valid, order, bias, has_bias, y0, y1, y2, y3, ends):
        where = (row0, n_rows, lo, n_valid, order, bias, has_bias, y0, y1, y2, y3, ends)
        store_chunk(acc, 0, 0, where)
        if n_e > 2:
            store_chunk(acc, 0, 2, where)
        if mt_out > 2:
            store_chunk(acc, 2, 0, where)
            if n_e > 2:
                store_chunk(acc, 2, 2, where)

    @device_function(numba_inline=True)
    def store_sums(acc, row0, n_rows, lo, n_valid, order, part, n_slots):
        where = (row0, n_rows, lo, n_valid, order, part, n_slots)
        sums_chunk(acc, 0, 0, where)
        if n_e > 2:
            sums_chunk(acc, 0, 2, where)
        if mt_out > 2:
            sums_chunk(acc, 2, 0, where)
            if n_e > 2:
                sums_chunk(acc, 2, 2, where)

    return store, store_sums


@functools.cache
def _walk_fn(ggml_type: GGMLType, bn: int, n_stages: int):
    """walk: a block's k steps s0..s1 into its accumulators, one step a barrier through two
    buffers (n_stages 1) or n_stages steps between two barriers."""
    (fetch, put), multiply = _stage_fns(ggml_type, bn), multiply_fn(bn)
    x_words = tiling(bn, False).tok_elems // 2
    qw_size, xw_size = 8 * n_stages, x_words * n_stages

    @device_function(numba_inline=True)
    def walk(s0, s1, w_src, w_off, x, x_off, a_at, b_at, stages_x, sa, sb, a_frag_at, b_frag_at,
             lane, acc):
        qw = cuda.local.array(qw_size, uint32)  # fetched weight pieces, f16x2
        xw = cuda.local.array(xw_size, uint32)  # fetched activations, f16x2
        if n_stages == 1:
            fetch(s0 * BK, w_src, w_off, x, x_off, qw, xw, 0, stages_x)
            put(sa, sb, 0, qw, xw, 0, a_at, b_at, stages_x)
            cuda.syncthreads()
            for s in range(s1 - s0):
                # step s + 1's loads go out before step s's mma and land in the other buffer
                # after them; branch-free (the last step fetches itself again, into the idle
                # buffer), so ptxas may schedule the mma inside the loads' latency
                fetch((s0 + min(s + 1, s1 - s0 - 1)) * BK, w_src, w_off, x, x_off, qw, xw, 0,
                      stages_x)
                multiply(sa, sb, s & 1, a_frag_at, b_frag_at, lane, acc)
                put(sa, sb, (s + 1) & 1, qw, xw, 0, a_at, b_at, stages_x)
                cuda.syncthreads()
        else:
            # groups of n_stages steps (s1 - s0 is a multiple): the next group's loads go out
            # together before this group's mma; the last group fetches clamped steps it never
            # multiplies
            for u in range(n_stages):
                fetch((s0 + u) * BK, w_src, w_off, x, x_off, qw, xw, u, stages_x)
                put(sa, sb, u, qw, xw, u, a_at, b_at, stages_x)
            cuda.syncthreads()
            for g in range((s1 - s0) // n_stages):
                for u in range(n_stages):
                    step = min(s0 + (g + 1) * n_stages + u, s1 - 1)
                    fetch(step * BK, w_src, w_off, x, x_off, qw, xw, u, stages_x)
                for u in range(n_stages):
                    multiply(sa, sb, u, a_frag_at, b_frag_at, lane, acc)
                cuda.syncthreads()
                for u in range(n_stages):
                    put(sa, sb, u, qw, xw, u, a_at, b_at, stages_x)
                cuda.syncthreads()
    return walk


@functools.cache
def _gemm_kernel(ggml_type: GGMLType, bn: int, swiglu: bool, grouped: bool, n_stages: int = 1):
    t = tiling(bn, swiglu)
    warps_n, warp_rows, rows_block = t.warps_n, t.warp_rows, t.rows_block
    walk = _walk_fn(ggml_type, bn, n_stages)
    operands, (store, store_sums) = _operands_fn(bn, swiglu, grouped), \
        store_fns(bn, swiglu, grouped)
    n_buf = max(2, n_stages)
    sa_size, sb_size, n_acc = n_buf * BM * ROW_WORDS, n_buf * bn * ROW_WORDS, 4 * t.nt * t.mt

    @kernel(fastmath=True)
    def gemm(w, w2, row_bytes, n_rows, mat_bytes, k, n_tok, x, tile_expert, tile_lo, tile_hi,
             order, slot_x, bias, has_bias, y0, y1, y2, y3, ends, part):
        chain_start()
        lo, n_valid, mat = block_tile(grouped, bn, n_tok, tile_expert, tile_lo, tile_hi)
        if n_valid <= 0:
            return
        row0 = cuda.blockIdx.x * rows_block
        is_up, w_off, a_at, x_off, b_at, stages_x = operands(
            row0, mat, lo, n_valid, n_rows, row_bytes, mat_bytes, k, order, slot_x)
        w_src = w2 if is_up else w
        sa = cuda.shared.array(sa_size, uint32)  # (n_buf buffers, BM rows, ROW_WORDS)
        sb = cuda.shared.array(sb_size, uint32)  # (n_buf buffers, bn tokens, ROW_WORDS)
        acc = cuda.local.array(n_acc, float32)  # (mt, nt n8 tiles, 4) C fragments
        for i in range(n_acc):
            acc[i] = 0.0
        warp, lane = cuda.threadIdx.x >> 5, cuda.threadIdx.x & 31
        a_frag_at = 4 * (warp // warps_n) * warp_rows * ROW_WORDS
        b_frag_at = 4 * (warp % warps_n) * 32 * ROW_WORDS
        s0, s1 = k_range(k // BK)
        walk(s0, s1, w_src, w_off, x, x_off, a_at, b_at, stages_x, sa, sb, a_frag_at, b_frag_at,
             lane, acc)
        if cuda.gridDim.z > 1:
            store_sums(acc, row0, n_rows, lo, n_valid, order, part, n_tok)
        else:
            store(acc, row0, n_rows, lo, n_valid, order, bias, has_bias, y0, y1, y2, y3, ends)
    return gemm


# ---------------------------------------------------------------- launch wrappers
_DUMMY = {}


def dummy_i32():
    # NOTE: cached device array [0] for the unused route arguments of the dense kernel.
    if "i32" not in _DUMMY:
        _DUMMY["i32"] = cuda.to_device(np.zeros(1, np.int32))
    return _DUMMY["i32"]


def _check_weights(w: DeviceQuantMatrix, up: DeviceQuantMatrix | None, x) -> None:
    if w.ggml_type not in _PIECES:
        raise ValueError(f"no tensor-core GEMM for ggml type {w.ggml_type.name}")
    if w.k % BK:
        raise ValueError(f"tensor-core GEMM needs k % {BK} == 0, got k={w.k}")
    if up is not None and (up.ggml_type, up.k, up.n_rows, up.n_mats) != (
            w.ggml_type, w.k, w.n_rows, w.n_mats):
        raise ValueError("gate and up matrices must share type and shape for the fused SwiGLU")
    check_array("x", x, np.float32)
    if len(x.shape) != 2 or x.shape[1] != w.k:
        raise ValueError(f"x: shape {tuple(x.shape)}, expected (·, {w.k})")


def output_parts(y, n_slots: int, n_rows: int) -> tuple[list, tuple[int, ...]]:
    """y (n_slots, rows) or a list of row-range parts → flat arrays + end rows (quant_gemv's)."""
    ys = list(y) if isinstance(y, (list, tuple)) else [y]
    for i, part in enumerate(ys):
        if len(part.shape) != 2 or part.shape[0] != n_slots:
            raise ValueError(f"y[{i}]: shape {tuple(part.shape)}, expected ({n_slots}, ·)")
    return qg.output_parts([p.reshape(n_slots, 1, p.shape[1]) for p in ys], n_slots, 1, n_rows)


def _launch(w, up, x, y, n_slots, grid_y, bn, grouped, route_args, bias, stream,
            partials=None, n_splits: int = 1, n_stages: int = 1) -> None:
    parts, ends = output_parts(y, n_slots, w.n_rows)
    if bias is not None:
        check_array("bias", bias, np.float32, (w.n_rows,))
    if n_slots == 0:
        return  # nothing to compute (and a grid of 0 blocks is a launch error)
    swiglu = up is not None
    grid = (cdiv(w.n_rows, BM // 2 if swiglu else BM), grid_y, n_splits)
    if (fragment_gemm.supports(w.ggml_type, w.k) and bn in fragment_gemm.TILES
            and x.size < fragment_gemm.MAX_X_FLOATS):
        kernel = fragment_gemm.gemm_kernel(w.ggml_type, bn, swiglu, grouped)
    else:
        kernel = _gemm_kernel(w.ggml_type, bn, swiglu, grouped, n_stages)
    bias_arg = parts[0] if bias is None else bias
    kernel[grid, THREADS, stream](
        w.data, w.data if up is None else up.data, w.row_bytes, w.n_rows, w.n_rows * w.row_bytes,
        w.k, n_slots, x.reshape(x.size), *route_args, bias_arg, bias is not None, *parts, ends,
        parts[0] if partials is None else partials)
    if n_splits > 1:
        add_partials(partials, n_splits, n_slots, w.n_rows, swiglu, bias, parts, ends, stream)


EPILOGUE_THREADS = 256


def add_partials(partials, n_splits: int, n_slots: int, n_rows: int, swiglu: bool, bias,
                 parts: list, ends: tuple[int, ...], stream) -> None:
    """y parts ← the sums of the k ranges' raw partials (n_splits, n_slots, n_rows · (2 with
    SwiGLU: gate sums, then up sums)), through the GEMM's epilogue (SwiGLU, bias)."""
    n_out = n_slots * n_rows
    _splitk_epilogue[cdiv(n_out, EPILOGUE_THREADS), EPILOGUE_THREADS, stream](
        partials, n_splits, n_slots, n_rows, swiglu, parts[0] if bias is None else bias,
        bias is not None, *parts, ends)


@kernel(fastmath=True)
def _splitk_epilogue(part, n_splits, n_slots, n_rows, swiglu, bias, has_bias, y0, y1, y2, y3,
                     ends):
    chain_start()
    # thread (slot, row): the sums of its n_splits k ranges (part (splits, n_slots, rows ·
    # (2 with SwiGLU)): gate sums, then up sums), then the GEMM's own epilogue
    i = cuda.grid(1)
    if i >= n_slots * n_rows:
        return
    slot, row = i // n_rows, i % n_rows
    staged = n_rows * 2 if swiglu else n_rows
    v, up = float32(0.0), float32(0.0)
    for s in range(n_splits):
        at = (s * n_slots + slot) * staged + row
        v += part[at]
        if swiglu:
            up += part[at + n_rows]
    store_part(y0, y1, y2, y3, ends, slot, row, gemm_epilogue(v, up, swiglu, bias, has_bias, row))


def k_splits(w: DeviceQuantMatrix, n_tok: int, swiglu: bool = False) -> int:
    """The k ranges matmul splits W × (n_tok, k) into given a partials buffer: 1 for a grid (row
    blocks × token tiles) of at least SPLIT_BELOW_BLOCKS blocks, else enough ranges to reach
    SPLIT_TARGET_BLOCKS (≤ MAX_K_SPLITS, each ≥ MIN_SPLIT_STEPS steps)."""
    n_blocks = cdiv(w.n_rows, BM // 2 if swiglu else BM) * cdiv(n_tok, _token_tile(w, n_tok))
    if n_blocks >= SPLIT_BELOW_BLOCKS:
        return 1
    return max(1, min(cdiv(SPLIT_TARGET_BLOCKS, n_blocks), MAX_K_SPLITS,
                      w.k // BK // MIN_SPLIT_STEPS))


def partials_size(w: DeviceQuantMatrix, n_tok: int, swiglu: bool = False) -> int:
    """Floats of the partials buffer matmul needs to split this product (0: it is not split)."""
    n_splits = k_splits(w, n_tok, swiglu)
    return 0 if n_splits == 1 else n_splits * n_tok * w.n_rows * (2 if swiglu else 1)


def _token_tile(w: DeviceQuantMatrix, n_tok: int) -> int:
    """Tokens a block of the dense GEMM: 64, or 128 for long inputs where the f16-staging kernel
    runs (the fragment kernel keeps 64: a 128-token tile spills its accumulators)."""
    if n_tok <= DENSE_TILES[0] or fragment_gemm.supports(w.ggml_type, w.k):
        return DENSE_TILES[0]
    return DENSE_TILES[1]


def expert_tile(n_slots: int, n_expert: int, w: DeviceQuantMatrix | None = None) -> int:
    """The route tile for grouped_matmul over n_slots slots spread on n_expert experts: the
    smallest token tile that holds twice an expert's mean share (staged tiles) or its mean
    share, so that most experts fit one tile (each further tile dequantizes the expert's
    weights again) while a tile computes little padding (a few tokens an expert are what mixed
    serving steps meet). The rule follows which tile ran fastest per mean share on the H200
    (bench/probes/cuda_mma_bench.py, bench/results/2026-12-03-qwen3.6-35b-a3b-cuda-expert-tiles.md).
    Given the gate matrix w of a type the fragment GEMM takes, at most its largest tile (64).
    """
    tiles = TOKEN_TILES
    if w is not None and fragment_gemm.supports(w.ggml_type, w.k):
        tiles = fragment_gemm.TILES
    return next((t for t in tiles
                 if t * n_expert >= (2 if t <= MAX_STAGED_TILE else 1) * n_slots), tiles[-1])


def matmul(w: DeviceQuantMatrix, x, y, *, bias=None, up: DeviceQuantMatrix | None = None,
           partials=None, stream=0) -> None:
    """y (n_tok, n_rows) f32 ← x (n_tok, k) f32 @ dequant(W[0])ᵀ (+ bias (n_rows,) f32).

    up: a second matrix of W's type and shape; then y = silu(x·Wᵀ) ⊙ (x·upᵀ) (bias added after).
    y may be a sequence of up to MAX_PARTS arrays (n_tok, rows_p) with Σ rows_p = n_rows.
    partials: float32 device scratch of ≥ partials_size(w, n_tok, up is not None) floats: then a
    grid too small for the GPU splits k (k_splits); None never splits.
    Raises ValueError for weight types outside SUPPORTED_TYPES (use quant_gemv.gemv then).
    """
    _check_weights(w, up, x)
    n_tok = x.shape[0]
    bn = _token_tile(w, n_tok)
    n_splits = 1
    if partials is not None:
        n_splits = k_splits(w, n_tok, up is not None)
        check_array("partials", partials, np.float32)
        needed = partials_size(w, n_tok, up is not None)
        if partials.size < needed:
            raise ValueError(f"partials: {partials.size} floats, split-K needs {needed}")
    dummy = dummy_i32()
    _launch(w, up, x, y, n_tok, cdiv(n_tok, bn), bn, False, (dummy,) * 5, bias, stream,
            partials, n_splits)


def grouped_matmul(w: DeviceQuantMatrix, x, y, route, slot_x, *,
                   up: DeviceQuantMatrix | None = None, stream=0) -> None:
    """MoE prefill: y[slot] (n_slots, n_rows) f32 ← x[slot_x[slot]] @ dequant(W[expert(slot)])ᵀ.

    route: an expert_route.ExpertRoute filled by route_experts for these n_slots, tile ≤ 128:
    tile t covers slots order[tile_lo[t]:tile_hi[t]], all routed to expert tile_expert[t]; empty
    tiles (tile_lo == tile_hi) do nothing; the grid covers route.tiles_bound(n_slots) tiles.
    slot_x: int32 device array (n_slots,), the x row of each slot. up: fused SwiGLU as in matmul.
    y may be split by row range like matmul's.
    """
    _check_weights(w, up, x)
    if route.tile > TOKEN_TILES[-1]:
        raise ValueError(f"route tile {route.tile} exceeds the GEMM's {TOKEN_TILES[-1]} tokens")
    check_array("slot_x", slot_x, np.int32)
    n_slots = slot_x.shape[0]
    bn = next(t for t in TOKEN_TILES if t >= route.tile)
    route_args = (route.tile_expert, route.tile_lo, route.tile_hi, route.order, slot_x)
    _launch(w, up, x, y, n_slots, route.tiles_bound(n_slots), bn, True, route_args, None, stream,
            n_stages=_stages(bn, w.k // BK))
