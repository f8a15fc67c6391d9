"""Decode matmul on ggml-quantized weights with int8 activations, as llama.cpp does it (T = 1).

x is quantized once per call into blocks of 32 (llama.cpp's Q8_0/Q8_1 form, kept in float32):

    xd[t, b] = max|x[t, 32b:32b+32]| / 127     xq = rint(x / xd) as int8     xs = xd * sum(xq)

Each weight block then contributes an integer dot of its quants with xq (int32) and one float
multiply-add with the scales, the semantics of ggml_vec_dot_<type>_q8_0 / _q8_1. Offsets (Q4_1 and
Q5_1's m, the K-quants' mins) multiply xs, the Q8_1 s-term. K-quants also use these 32-blocks
rather than llama.cpp's Q8_K (one scale per 256): one quantization of x serves every type, the
extra float work is one multiply-add per 32 weights, and the result is closer to the float path.
So out = dequantize(W) @ dequantize(xq).T exactly, up to float32 rounding.

Why the integer loops look as they do (numba 0.68 + LLVM, AVX2; bench/results/cpu-quant-matmul.md
§4 and §6). Every integer step is cast back to int32 (numba widens to int64), and bits are tested
against a table of masks, never shifted by a variable amount. A block's integer dot is one
reduction over loads (no stores), and which vectorizer handles it best was measured per type:
the nibble and K-quant loops have a constant trip count of 16 or 32; LLVM unrolls them and its SLP
vectorizer turns the reduction into vpmaddwd (2x faster than the loop vectorizer on Q5_0). Q8_0's
loop runs `2 * n16` times with n16 = 16 passed at run time: unrolled it stays scalar, while the
loop vectorizer makes vpmaddwd of it.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
from numba import njit

from sparkinfer_cli.kernels.cpu.quant import (
    FUSED_MAX_TOKENS,
    _parallel_rows,
    _readonly,
    _rows_view,
    matmul,
)
from sparkinfer_cli.kernels.cpu.quant_blocks import (
    F16_LUT,
    Q4_0,
    Q4_1,
    Q4_K,
    Q5_0,
    Q5_1,
    Q5_K,
    Q6_K,
    Q8_0,
    _fp16,
    _k_scale_min,
)

Q8_BLOCK = 32  # activation block: one float scale per 32 int8 values
_N16 = 16  # Q8_0's inner trip count / 2, passed at run time (see the module docstring)
_i32, _f32 = np.int32, np.float32
_BIT32 = np.array([1 << k for k in range(32)], dtype=np.int64).astype(np.int32)


# ---- activations -------------------------------------------------------------------------------

@njit(cache=True, nogil=True)
def _quantize_rows(x, xq, xd, xs):
    """x (T, ne0) float32 → xq (T, ne0) int8, xd and xs (T, ne0 / 32) float32."""
    for t in range(x.shape[0]):
        for b in range(x.shape[1] // Q8_BLOCK):
            e = b * Q8_BLOCK
            amax = _f32(0)
            for i in range(Q8_BLOCK):
                amax = max(amax, abs(x[t, e + i]))
            d = amax / _f32(127)
            qsum = 0
            for i in range(Q8_BLOCK):
                q = np.rint(x[t, e + i] / d) if d > 0 else _f32(0)
                xq[t, e + i] = np.int8(q)
                qsum += np.int64(q)
            xd[t, b] = d
            xs[t, b] = d * _f32(qsum)


def quantize_q8(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """x float32 (T, ne0), ne0 a multiple of 32 → (xq int8 (T, ne0), xd, xs float32 (T, ne0/32))."""
    T, ne0 = x.shape
    xq = np.empty((T, ne0), np.int8)  # (T, ne0)
    xd = np.empty((T, ne0 // Q8_BLOCK), np.float32)  # (T, n_blocks)
    xs = np.empty((T, ne0 // Q8_BLOCK), np.float32)  # (T, n_blocks)
    _quantize_rows(x, xq, xd, xs)
    return _readonly(xq), _readonly(xd), _readonly(xs)


# ---- weight blocks: block_dot(raw, r, o, lut, xq, xd, xs, t, e, n16) → float32 -----------------
# o: byte offset of the block in row r; e: its first element (x block e >> 5).

@njit(cache=True, inline="always")
def _qh32(raw, r, o):
    return _i32(np.int64(raw[r, o]) | (np.int64(raw[r, o + 1]) << 8)
                | (np.int64(raw[r, o + 2]) << 16) | (np.int64(raw[r, o + 3]) << 24))


@njit(cache=True, inline="always")
def _dot_nibbles(raw, r, o, qh, bias, xq, t, e, n16):
    """Σ q·xq over a legacy 32-block: q = nibble (+16 where the qh bit is set) - bias; byte i of
    qs at o holds element i (low nibble, qh bit i) and i+16 (high nibble, qh bit i+16)."""
    s = _i32(0)
    for i in range(n16):
        v = raw[r, o + i]
        lo = _i32(_i32(v & 15) - bias + _i32(16 if (qh & _BIT32[i]) != 0 else 0))
        hi = _i32(_i32(v >> 4) - bias + _i32(16 if (qh & _BIT32[16 + i]) != 0 else 0))
        s = _i32(s + _i32(lo * _i32(xq[t, e + i])) + _i32(hi * _i32(xq[t, e + 16 + i])))
    return s


@njit(cache=True, inline="always")
def _bd_q8_0(raw, r, o, lut, xq, xd, xs, t, e, n16):
    s = _i32(0)
    for i in range(2 * n16):
        s = _i32(s + _i32(_i32(np.int8(raw[r, o + 2 + i])) * _i32(xq[t, e + i])))
    return _fp16(raw, r, o, lut) * xd[t, e >> 5] * _f32(s)


@njit(cache=True, inline="always")
def _bd_q4_0(raw, r, o, lut, xq, xd, xs, t, e, n16):
    s = _dot_nibbles(raw, r, o + 2, _i32(0), _i32(8), xq, t, e, 16)
    return _fp16(raw, r, o, lut) * xd[t, e >> 5] * _f32(s)


@njit(cache=True, inline="always")
def _bd_q5_0(raw, r, o, lut, xq, xd, xs, t, e, n16):
    s = _dot_nibbles(raw, r, o + 6, _qh32(raw, r, o + 2), _i32(16), xq, t, e, 16)
    return _fp16(raw, r, o, lut) * xd[t, e >> 5] * _f32(s)


@njit(cache=True, inline="always")
def _bd_q4_1(raw, r, o, lut, xq, xd, xs, t, e, n16):
    s = _dot_nibbles(raw, r, o + 4, _i32(0), _i32(0), xq, t, e, 16)
    b = e >> 5
    return _fp16(raw, r, o, lut) * xd[t, b] * _f32(s) + _fp16(raw, r, o + 2, lut) * xs[t, b]


@njit(cache=True, inline="always")
def _bd_q5_1(raw, r, o, lut, xq, xd, xs, t, e, n16):
    s = _dot_nibbles(raw, r, o + 8, _qh32(raw, r, o + 4), _i32(0), xq, t, e, 16)
    b = e >> 5
    return _fp16(raw, r, o, lut) * xd[t, b] * _f32(s) + _fp16(raw, r, o + 2, lut) * xs[t, b]


@njit(cache=True, inline="always")
def _k_pair(raw, r, o, qs, qh, jj, xq, t, e, n16):
    """Σ q·xq of sub-blocks 2jj (low nibbles of qs[32jj:]) and 2jj+1 (high): Q4_K, or Q5_K when
    qh >= 0 (the qh bytes at qh, bits 2jj and 2jj+1 add 16)."""
    m_lo, m_hi = _BIT32[2 * jj], _BIT32[2 * jj + 1]
    s_lo, s_hi = _i32(0), _i32(0)
    for i in range(2 * n16):
        v = raw[r, o + qs + 32 * jj + i]
        h = _i32(raw[r, o + qh + i]) if qh >= 0 else _i32(0)
        lo = _i32(_i32(v & 15) + _i32(16 if (h & m_lo) != 0 else 0))
        hi = _i32(_i32(v >> 4) + _i32(16 if (h & m_hi) != 0 else 0))
        s_lo = _i32(s_lo + _i32(lo * _i32(xq[t, e + 64 * jj + i])))
        s_hi = _i32(s_hi + _i32(hi * _i32(xq[t, e + 64 * jj + 32 + i])))
    return s_lo, s_hi


@njit(cache=True, inline="always")
def _bd_k(raw, r, o, lut, xq, xd, xs, t, e, n16, qs, qh):
    """Q4_K / Q5_K: d*sc_j*xd*Σq·xq - dmin*m_j*xs per 32-element sub-block j."""
    d, dmin = _fp16(raw, r, o, lut), _fp16(raw, r, o + 2, lut)
    acc = _f32(0)
    for jj in range(4):
        s_lo, s_hi = _k_pair(raw, r, o, qs, qh, jj, xq, t, e, 16)
        for j, s in ((2 * jj, s_lo), (2 * jj + 1, s_hi)):
            sc, m = _k_scale_min(raw, r, o + 4, j)
            b = (e >> 5) + j
            acc += d * _f32(sc) * xd[t, b] * _f32(s) - dmin * _f32(m) * xs[t, b]
    return acc


@njit(cache=True, inline="always")
def _bd_q4_k(raw, r, o, lut, xq, xd, xs, t, e, n16):
    return _bd_k(raw, r, o, lut, xq, xd, xs, t, e, n16, 16, -1)


@njit(cache=True, inline="always")
def _bd_q5_k(raw, r, o, lut, xq, xd, xs, t, e, n16):
    return _bd_k(raw, r, o, lut, xq, xd, xs, t, e, n16, 48, 16)


@njit(cache=True, inline="always")
def _q6_quarter_sums(raw, r, o, n, l0, xq, t, e, n16):
    """Σ q·xq over elements l0..l0+16 of the 4 quarters of half n of a Q6_K block: quarter k is
    elements 128n + 32k + l, 6-bit quant from a ql nibble and a qh bit pair, minus 32."""
    s0, s1, s2, s3 = _i32(0), _i32(0), _i32(0), _i32(0)
    for i in range(n16):
        p = l0 + i
        a, c, h = raw[r, o + 64 * n + p], raw[r, o + 64 * n + 32 + p], raw[r, o + 128 + 32 * n + p]
        q0 = _i32(_i32(_i32(a & 15) | _i32((h & 3) << 4)) - 32)
        q1 = _i32(_i32(_i32(c & 15) | _i32(((h >> 2) & 3) << 4)) - 32)
        q2 = _i32(_i32(_i32(a >> 4) | _i32(((h >> 4) & 3) << 4)) - 32)
        q3 = _i32(_i32(_i32(c >> 4) | _i32((h >> 6) << 4)) - 32)
        x0 = e + 128 * n + p
        s0 = _i32(s0 + _i32(q0 * _i32(xq[t, x0])))
        s1 = _i32(s1 + _i32(q1 * _i32(xq[t, x0 + 32])))
        s2 = _i32(s2 + _i32(q2 * _i32(xq[t, x0 + 64])))
        s3 = _i32(s3 + _i32(q3 * _i32(xq[t, x0 + 96])))
    return s0, s1, s2, s3


@njit(cache=True, inline="always")
def _bd_q6_k(raw, r, o, lut, xq, xd, xs, t, e, n16):
    """Per 32-element quarter: d * xd * (sc_a·Σ_a + sc_b·Σ_b) over its two 16-element halves."""
    acc = _f32(0)
    for n in range(2):
        a0, a1, a2, a3 = _q6_quarter_sums(raw, r, o, n, 0, xq, t, e, 16)
        b0, b1, b2, b3 = _q6_quarter_sums(raw, r, o, n, 16, xq, t, e, 16)
        for k, sa, sb in ((0, a0, b0), (1, a1, b1), (2, a2, b2), (3, a3, b3)):
            sc = o + 192 + 8 * n + 2 * k
            isum = _i32(_i32(np.int8(raw[r, sc])) * sa + _i32(np.int8(raw[r, sc + 1])) * sb)
            acc += xd[t, (e >> 5) + 4 * n + k] * _f32(isum)
    return _fp16(raw, r, o + 208, lut) * acc


# ---- row kernels and the cached driver ----------------------------------------------------------

def _make_dot_rows(block_dot: Callable, units: int, block: int) -> Callable:
    @njit(nogil=True)
    def dot_rows(raw, lut, xq, xd, xs, r0, r1, n16, out):
        for r in range(r0, r1):
            for t in range(xq.shape[0]):
                acc = _f32(0)
                for b in range(raw.shape[1] // units):
                    acc += block_dot(raw, r, b * units, lut, xq, xd, xs, t, b * block, n16)
                out[t, r] = acc

    return dot_rows


_DOT_Q4_0 = _make_dot_rows(_bd_q4_0, 18, 32)
_DOT_Q4_1 = _make_dot_rows(_bd_q4_1, 20, 32)
_DOT_Q5_0 = _make_dot_rows(_bd_q5_0, 22, 32)
_DOT_Q5_1 = _make_dot_rows(_bd_q5_1, 24, 32)
_DOT_Q8_0 = _make_dot_rows(_bd_q8_0, 34, 32)
_DOT_Q4_K = _make_dot_rows(_bd_q4_k, 144, 256)
_DOT_Q5_K = _make_dot_rows(_bd_q5_k, 176, 256)
_DOT_Q6_K = _make_dot_rows(_bd_q6_k, 210, 256)

Q8_TYPES: frozenset[int] = frozenset({Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K})
# The kernels decode each weight block once per token, the float path once per call: at T=2 the
# float path is already as fast (bench/results/cpu-quant-matmul.md §6), so only T=1 comes here.
Q8_MAX_TOKENS = 1


@njit(cache=True, nogil=True)
def _matmul_q8_rows(raw, qtype, lut, xq, xd, xs, r0, r1, n16, out):
    if qtype == Q5_0:
        _DOT_Q5_0(raw, lut, xq, xd, xs, r0, r1, n16, out)
    elif qtype == Q8_0:
        _DOT_Q8_0(raw, lut, xq, xd, xs, r0, r1, n16, out)
    elif qtype == Q6_K:
        _DOT_Q6_K(raw, lut, xq, xd, xs, r0, r1, n16, out)
    elif qtype == Q4_K:
        _DOT_Q4_K(raw, lut, xq, xd, xs, r0, r1, n16, out)
    elif qtype == Q4_0:
        _DOT_Q4_0(raw, lut, xq, xd, xs, r0, r1, n16, out)
    elif qtype == Q4_1:
        _DOT_Q4_1(raw, lut, xq, xd, xs, r0, r1, n16, out)
    elif qtype == Q5_1:
        _DOT_Q5_1(raw, lut, xq, xd, xs, r0, r1, n16, out)
    elif qtype == Q5_K:
        _DOT_Q5_K(raw, lut, xq, xd, xs, r0, r1, n16, out)


# ---- public API -------------------------------------------------------------------------------

def matmul_q8(raw: np.ndarray, ggml_type: int, ne0: int, x: np.ndarray,
              max_tokens: int = Q8_MAX_TOKENS) -> np.ndarray:
    """Same arguments and result as quant.matmul: float32 (T, rows) ≈ x @ dequantize(W).T, with x
    quantized to int8 blocks of 32 (error ~1e-2 relative to the float path). Types outside
    Q8_TYPES, and T > max_tokens, go to quant.matmul."""
    if ggml_type not in Q8_TYPES or x.ndim != 2 or x.shape[0] > min(max_tokens, FUSED_MAX_TOKENS):
        return matmul(raw, ggml_type, ne0, x)
    if raw.ndim != 2:
        raise ValueError(f"matmul_q8 needs a 2-D weight, got shape {raw.shape}")
    rows = _rows_view(raw, ggml_type, ne0)
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.shape[1] != ne0:
        raise ValueError(f"x must be (T, {ne0}), got {x.shape}")
    xq, xd, xs = quantize_q8(x)
    out = np.empty((x.shape[0], rows.shape[0]), np.float32)  # (T, rows)
    args = (rows, ggml_type, F16_LUT, xq, xd, xs)
    _parallel_rows(lambda r0, r1: _matmul_q8_rows(*args, r0, r1, _N16, out), rows.shape[0],
                   ne0 * x.shape[0])
    return out
