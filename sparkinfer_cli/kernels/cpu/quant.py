"""CPU kernels on ggml-quantized weights: dequantize, matmul (x @ W.T) and embedding rows.

Every block type is described once, by a `_decode_*` function that writes a block's quant values
q (small integers or IQ4 table values, as float32), and per sub-block a scale and an offset, so
that the weight is exactly ggml's `scale * q (+ offset)`. The kernels are generic over that:

    dequantize      y = sc[j] * q (+ of[j])                       (bit-exact with gguf.quants)
    matmul, T small out[t] = sum_j sc[j] * (q_j . x_j) (+ of[j] * sum(x_j))   fused, no W copy
    matmul, T large dequantize a tile of rows into a float32 scratch, then BLAS

Activations stay float32; dot products accumulate in float32 over 8 independent lanes (the
vectorizable order), so no fastmath is needed. Kernels take the ggml type as a compile-time
literal: each (kernel, type) pair compiles on first use and is cached on disk.
"""

from __future__ import annotations

import numpy as np
import numba
from numba import literally, njit, prange

from sparkinfer_cli.ggml_types import GGMLType, row_bytes, type_name

F32, F16, BF16 = int(GGMLType.F32), int(GGMLType.F16), int(GGMLType.BF16)
Q4_0, Q4_1, Q5_0, Q5_1 = int(GGMLType.Q4_0), int(GGMLType.Q4_1), int(GGMLType.Q5_0), int(GGMLType.Q5_1)
Q8_0, IQ4_NL, IQ4_XS = int(GGMLType.Q8_0), int(GGMLType.IQ4_NL), int(GGMLType.IQ4_XS)
Q4_K, Q5_K, Q6_K = int(GGMLType.Q4_K), int(GGMLType.Q5_K), int(GGMLType.Q6_K)

# ggml type → (elements per block, raw units per block, sub-blocks per block, has offset).
# F16/BF16 rows are viewed as uint16, so a "block" of 32 of them is 32 units.
_LAYOUT: dict[int, tuple[int, int, int, bool]] = {
    F16: (32, 32, 1, False), BF16: (32, 32, 1, False),
    Q4_0: (32, 18, 1, False), Q4_1: (32, 20, 1, True), Q5_0: (32, 22, 1, False),
    Q5_1: (32, 24, 1, True), Q8_0: (32, 34, 1, False), IQ4_NL: (32, 18, 1, False),
    Q4_K: (256, 144, 8, True), Q5_K: (256, 176, 8, True), Q6_K: (256, 210, 16, False),
    IQ4_XS: (256, 136, 8, False),
}
SUPPORTED_TYPES: frozenset[int] = frozenset(_LAYOUT) | {F32}

# Bit patterns → float32, exact by construction (numpy's own fp16 conversion; bf16 = high half).
_F16_LUT = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)
_BF16_LUT = (np.arange(65536, dtype=np.uint32) << 16).view(np.float32)
_IQ4_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113],
                       dtype=np.float32)

# Above this many tokens, a dequantized tile + BLAS beats the fused kernel (bench/results).
FUSED_MAX_TOKENS = 8
_TILE_BYTES = 4 << 20  # float32 scratch per tile: stays in the 32 MiB L3 between dequant and GEMM

_f32 = np.float32
_C8, _C16, _C32 = np.float32(8), np.float32(16), np.float32(32)


# ---- block decoders: q values, per-sub-block scale and offset, exactly as ggml forms them ------

@njit(cache=True)
def _fp16(rr, o, lut):
    return lut[np.int64(rr[o]) | (np.int64(rr[o + 1]) << 8)]


@njit(cache=True)
def _nibbles(rr, o, q, bias):
    # legacy 32-blocks: byte i holds element i (low nibble) and element i+16 (high nibble)
    for i in range(16):
        b = rr[o + i]
        q[i] = _f32(b & 15) - bias
        q[i + 16] = _f32(b >> 4) - bias


@njit(cache=True)
def _nibbles_5bit(rr, o, qh, q, bias):
    for i in range(16):
        b = rr[o + i]
        q[i] = _f32((b & 15) | (((qh >> i) & 1) << 4)) - bias
        q[i + 16] = _f32((b >> 4) | (((qh >> (i + 16)) & 1) << 4)) - bias


@njit(cache=True)
def _u32(rr, o):
    return (np.int64(rr[o]) | (np.int64(rr[o + 1]) << 8) | (np.int64(rr[o + 2]) << 16)
            | (np.int64(rr[o + 3]) << 24))


@njit(cache=True)
def _decode_q4_0(rr, o, lut, q, sc, of):
    sc[0] = _fp16(rr, o, lut)
    _nibbles(rr, o + 2, q, _C8)


@njit(cache=True)
def _decode_q4_1(rr, o, lut, q, sc, of):
    sc[0], of[0] = _fp16(rr, o, lut), _fp16(rr, o + 2, lut)
    _nibbles(rr, o + 4, q, _f32(0))


@njit(cache=True)
def _decode_q5_0(rr, o, lut, q, sc, of):
    sc[0] = _fp16(rr, o, lut)
    _nibbles_5bit(rr, o + 6, _u32(rr, o + 2), q, _C16)


@njit(cache=True)
def _decode_q5_1(rr, o, lut, q, sc, of):
    sc[0], of[0] = _fp16(rr, o, lut), _fp16(rr, o + 2, lut)
    _nibbles_5bit(rr, o + 8, _u32(rr, o + 4), q, _f32(0))


@njit(cache=True)
def _decode_q8_0(rr, o, lut, q, sc, of):
    sc[0] = _fp16(rr, o, lut)
    for i in range(32):
        q[i] = _f32(np.int8(rr[o + 2 + i]))


@njit(cache=True)
def _decode_iq4_nl(rr, o, lut, q, sc, of, kv):
    sc[0] = _fp16(rr, o, lut)
    for i in range(16):
        b = rr[o + 2 + i]
        q[i], q[i + 16] = kv[b & 15], kv[b >> 4]


@njit(cache=True)
def _k_scale_min(s, o, j):
    # get_scale_min_k4: 8 six-bit scales and mins packed into the 12 bytes at s[o:o+12]
    if j < 4:
        return s[o + j] & 63, s[o + j + 4] & 63
    return ((s[o + j + 4] & 15) | ((s[o + j - 4] >> 6) << 4),
            (s[o + j + 4] >> 4) | ((s[o + j] >> 6) << 4))


@njit(cache=True)
def _k_scales(rr, o, lut, sc, of):
    d, dmin = _fp16(rr, o, lut), _fp16(rr, o + 2, lut)
    for j in range(8):
        s, m = _k_scale_min(rr, o + 4, j)
        sc[j] = d * _f32(s)
        of[j] = -(dmin * _f32(m))  # NOTE: a*q + (-b) == a*q - b bit for bit


@njit(cache=True)
def _decode_q4_k(rr, o, lut, q, sc, of):
    _k_scales(rr, o, lut, sc, of)
    for c in range(4):
        for i in range(32):
            b = rr[o + 16 + 32 * c + i]
            q[64 * c + i] = _f32(b & 15)
            q[64 * c + 32 + i] = _f32(b >> 4)


@njit(cache=True)
def _decode_q5_k(rr, o, lut, q, sc, of):
    _k_scales(rr, o, lut, sc, of)
    for c in range(4):
        for i in range(32):
            b, h = rr[o + 48 + 32 * c + i], rr[o + 16 + i]
            q[64 * c + i] = _f32((b & 15) | (((h >> (2 * c)) & 1) << 4))
            q[64 * c + 32 + i] = _f32((b >> 4) | (((h >> (2 * c + 1)) & 1) << 4))


@njit(cache=True)
def _decode_q6_k(rr, o, lut, q, sc, of):
    d = _fp16(rr, o + 208, lut)
    for j in range(16):
        sc[j] = d * _f32(np.int8(rr[o + 192 + j]))
    for n in range(2):
        for i in range(32):
            lo, hi, h = rr[o + 64 * n + i], rr[o + 64 * n + 32 + i], rr[o + 128 + 32 * n + i]
            q[128 * n + i] = _f32((lo & 15) | ((h & 3) << 4)) - _C32
            q[128 * n + 32 + i] = _f32((hi & 15) | (((h >> 2) & 3) << 4)) - _C32
            q[128 * n + 64 + i] = _f32((lo >> 4) | (((h >> 4) & 3) << 4)) - _C32
            q[128 * n + 96 + i] = _f32((hi >> 4) | (((h >> 6) & 3) << 4)) - _C32


@njit(cache=True)
def _decode_iq4_xs(rr, o, lut, q, sc, of, kv):
    d = _fp16(rr, o, lut)
    scales_h = np.int64(rr[o + 2]) | (np.int64(rr[o + 3]) << 8)
    for ib in range(8):
        ls = ((rr[o + 4 + ib // 2] >> (4 * (ib % 2))) & 15) | (((scales_h >> (2 * ib)) & 3) << 4)
        sc[ib] = d * _f32(ls - 32)
        for i in range(16):
            b = rr[o + 8 + 16 * ib + i]
            q[32 * ib + i], q[32 * ib + 16 + i] = kv[b & 15], kv[b >> 4]


@njit(cache=True)
def _decode_table(rr, o, lut, q, sc, of):
    # F16/BF16 rows viewed as uint16: the "quant" is the value itself, scale 1 (exact)
    sc[0] = _f32(1)
    for i in range(32):
        q[i] = lut[rr[o + i]]


@njit(cache=True)
def _decode_block(qtype, rr, o, lut, kv, q, sc, of):
    if qtype == Q4_0:
        _decode_q4_0(rr, o, lut, q, sc, of)
    elif qtype == Q4_1:
        _decode_q4_1(rr, o, lut, q, sc, of)
    elif qtype == Q5_0:
        _decode_q5_0(rr, o, lut, q, sc, of)
    elif qtype == Q5_1:
        _decode_q5_1(rr, o, lut, q, sc, of)
    elif qtype == Q8_0:
        _decode_q8_0(rr, o, lut, q, sc, of)
    elif qtype == IQ4_NL:
        _decode_iq4_nl(rr, o, lut, q, sc, of, kv)
    elif qtype == Q4_K:
        _decode_q4_k(rr, o, lut, q, sc, of)
    elif qtype == Q5_K:
        _decode_q5_k(rr, o, lut, q, sc, of)
    elif qtype == Q6_K:
        _decode_q6_k(rr, o, lut, q, sc, of)
    elif qtype == IQ4_XS:
        _decode_iq4_xs(rr, o, lut, q, sc, of, kv)
    else:
        _decode_table(rr, o, lut, q, sc, of)


@njit(cache=True)
def _layout(qtype):
    if qtype == Q4_0 or qtype == IQ4_NL:
        return 32, 18, 1, False
    if qtype == Q4_1:
        return 32, 20, 1, True
    if qtype == Q5_0:
        return 32, 22, 1, False
    if qtype == Q5_1:
        return 32, 24, 1, True
    if qtype == Q8_0:
        return 32, 34, 1, False
    if qtype == Q4_K:
        return 256, 144, 8, True
    if qtype == Q5_K:
        return 256, 176, 8, True
    if qtype == Q6_K:
        return 256, 210, 16, False
    if qtype == IQ4_XS:
        return 256, 136, 8, False
    return 32, 32, 1, False  # F16 / BF16 as uint16


# ---- kernels ----------------------------------------------------------------------------------

@njit(cache=True, parallel=True)
def _dequant_rows(raw, qtype, lut, kv, ids, out):
    literally(qtype)
    BS, BU, NSUB, HAS_OFF = _layout(qtype)
    SB = BS // NSUB
    n_blocks = out.shape[1] // BS
    for k in prange(ids.shape[0]):
        q = np.empty(BS, np.float32)  # (block,)
        sc, of = np.empty(NSUB, np.float32), np.empty(NSUB, np.float32)  # (n_sub,)
        rr, y = raw[ids[k]], out[k]
        for b in range(n_blocks):
            _decode_block(qtype, rr, b * BU, lut, kv, q, sc, of)
            for j in range(NSUB):
                for i in range(SB):
                    y[b * BS + j * SB + i] = sc[j] * q[j * SB + i]
                if HAS_OFF:
                    for i in range(SB):
                        y[b * BS + j * SB + i] += of[j]


@njit(cache=True)
def _lane_dot(q, qo, x, xo, n, scale, acc):
    # acc[l] += scale * sum_k q[qo+8k+l] * x[xo+8k+l]: 8 independent float32 lanes (SIMD order)
    for l in range(8):
        v = q[qo + l] * x[xo + l]
        for k in range(8, n, 8):
            v += q[qo + k + l] * x[xo + k + l]
        acc[l] += scale * v


@njit(cache=True)
def _row_dot(qtype, rr, lut, kv, x, xsum, q, sc, of, acc, off):
    """acc (T, 8) and off (T,) accumulate row · x[t] for every t."""
    BS, BU, NSUB, HAS_OFF = _layout(qtype)
    SB = BS // NSUB
    T = x.shape[0]
    for b in range(x.shape[1] // BS):
        _decode_block(qtype, rr, b * BU, lut, kv, q, sc, of)
        for t in range(T):
            for j in range(NSUB):
                _lane_dot(q, j * SB, x[t], b * BS + j * SB, SB, sc[j], acc[t])
            if HAS_OFF:
                for j in range(NSUB):
                    off[t] += of[j] * xsum[t, b * NSUB + j]


@njit(cache=True, parallel=True)
def _matmul_fused(raw, qtype, lut, kv, x, xsum, n_chunks, out):
    literally(qtype)
    BS, BU, NSUB, HAS_OFF = _layout(qtype)
    T, rows = out.shape
    for c in prange(n_chunks):
        q = np.empty(BS, np.float32)  # (block,)
        sc, of = np.empty(NSUB, np.float32), np.empty(NSUB, np.float32)  # (n_sub,)
        acc, off = np.empty((T, 8), np.float32), np.empty(T, np.float32)  # (T, lanes), (T,)
        for r in range(c * rows // n_chunks, (c + 1) * rows // n_chunks):
            acc[:] = 0
            off[:] = 0
            _row_dot(qtype, raw[r], lut, kv, x, xsum, q, sc, of, acc, off)
            for t in range(T):
                out[t, r] = acc[t].sum() + off[t]


# ---- public API -------------------------------------------------------------------------------

def _check_type(ggml_type: int) -> None:
    if ggml_type not in SUPPORTED_TYPES:
        raise ValueError(f"ggml type {type_name(ggml_type)} is not supported by the CPU quant "
                         f"kernels (supported: {sorted(type_name(t) for t in SUPPORTED_TYPES)})")


def _rows_view(raw: np.ndarray, ggml_type: int, ne0: int) -> np.ndarray:
    """raw → read-only 2-D (rows, units) array in the dtype the kernels read."""
    _check_type(ggml_type)
    raw = np.ascontiguousarray(raw)
    if ggml_type == F32:
        expected, dtype = ne0, np.float32
    elif ggml_type == F16:
        expected, dtype = ne0, np.float16
    else:
        expected, dtype = row_bytes(ggml_type, ne0), np.uint8
    if raw.dtype != dtype or raw.shape[-1] != expected:
        raise ValueError(f"{type_name(ggml_type)} tensor with ne0={ne0} needs {dtype.__name__} rows "
                         f"of {expected}, got {raw.dtype} {raw.shape}")
    rows = raw.reshape(-1, expected)  # (n_rows, units)
    if ggml_type in (F16, BF16):
        rows = rows.view(np.uint16)  # (n_rows, ne0)
    rows = rows.view()
    rows.flags.writeable = False  # NOTE: one numba specialization for mmaps and test arrays alike
    return rows


def _lut(ggml_type: int) -> np.ndarray:
    return _BF16_LUT if ggml_type == BF16 else _F16_LUT


def _dequant_ids(rows: np.ndarray, ggml_type: int, ne0: int, ids: np.ndarray) -> np.ndarray:
    out = np.empty((len(ids), ne0), np.float32)  # (len(ids), ne0)
    if ggml_type == F32:
        np.take(rows, ids, axis=0, out=out)
    elif len(ids):
        _dequant_rows(rows, ggml_type, _lut(ggml_type), _IQ4_VALUES, ids.astype(np.int64), out)
    return out


def dequantize(raw: np.ndarray, ggml_type: int, ne0: int) -> np.ndarray:
    """raw: as returned by GGUFFile.raw(name): natural dtype for F32/F16 (shape (..., ne0)), uint8
    (..., row_bytes) for quantized types and BF16. Returns float32 (..., ne0), equal to
    gguf.quants.dequantize bit for bit."""
    rows = _rows_view(raw, ggml_type, ne0)
    out = _dequant_ids(rows, ggml_type, ne0, np.arange(rows.shape[0]))
    return out.reshape(*raw.shape[:-1], ne0)


def embedding_rows(raw: np.ndarray, ggml_type: int, ne0: int, ids: np.ndarray) -> np.ndarray:
    """Dequantized rows `ids` of a (n_rows, row_bytes) tensor → float32 (len(ids), ne0)."""
    rows = _rows_view(raw, ggml_type, ne0)
    ids = np.asarray(ids, dtype=np.int64).reshape(-1)
    if len(ids) and (ids.min() < 0 or ids.max() >= rows.shape[0]):
        raise ValueError(f"embedding ids must lie in [0, {rows.shape[0]}), got "
                         f"[{ids.min()}, {ids.max()}]")
    return _dequant_ids(rows, ggml_type, ne0, ids)


def _x_sums(x: np.ndarray, ggml_type: int) -> np.ndarray:
    """Per-sub-block sums of x for types with an offset (the offset multiplies sum(x_j))."""
    BS, _, NSUB, has_offset = _LAYOUT[ggml_type]
    if not has_offset:
        return np.zeros((x.shape[0], 1), np.float32)  # (T, 1) unused
    return x.reshape(x.shape[0], -1, BS // NSUB).sum(axis=2, dtype=np.float32)  # (T, n_sub_total)


def _matmul_tiled(rows: np.ndarray, ggml_type: int, x: np.ndarray) -> np.ndarray:
    n_rows, ne0 = rows.shape[0], x.shape[1]
    tile = max(16, _TILE_BYTES // (4 * ne0))
    out_t = np.empty((n_rows, x.shape[0]), np.float32)  # (rows, T)
    for r0 in range(0, n_rows, tile):
        ids = np.arange(r0, min(n_rows, r0 + tile))
        w = _dequant_ids(rows, ggml_type, ne0, ids)  # (tile, ne0)
        np.matmul(w, x.T, out=out_t[r0:r0 + len(ids)])
    return np.ascontiguousarray(out_t.T)  # (T, rows)


def matmul(raw: np.ndarray, ggml_type: int, ne0: int, x: np.ndarray) -> np.ndarray:
    """raw: one 2-D weight (rows, row_bytes or ne0); x: float32 (T, ne0). Returns float32
    (T, rows) = x @ W.T where W = dequantize(raw). T=1 (decode) through large T (prefill)."""
    if raw.ndim != 2:
        raise ValueError(f"matmul needs a 2-D weight, got shape {raw.shape}")
    rows = _rows_view(raw, ggml_type, ne0)
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim != 2 or x.shape[1] != ne0:
        raise ValueError(f"x must be (T, {ne0}), got {x.shape}")
    if ggml_type == F32:
        return x @ rows.T  # (T, rows)
    if x.shape[0] > FUSED_MAX_TOKENS:
        return _matmul_tiled(rows, ggml_type, x)
    out = np.empty((x.shape[0], rows.shape[0]), np.float32)  # (T, rows)
    n_chunks = min(rows.shape[0], 4 * numba.get_num_threads())
    _matmul_fused(rows, ggml_type, _lut(ggml_type), _IQ4_VALUES, x, _x_sums(x, ggml_type), n_chunks,
                  out)
    return out
