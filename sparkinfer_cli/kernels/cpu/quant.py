"""CPU kernels on ggml-quantized weights: dequantize, matmul (x @ W.T) and embedding rows.

Each block type has one `_dequant_<type>(raw, r0, r1, lut, w)` that writes rows r0..r1 as float32,
with ggml's exact formula (d*sc formed first, ...), so it is bit-exact with gguf.quants. The
matmul kernels are generic over it:

    T <= FUSED_MAX_TOKENS  per thread, dequantize 16 rows into an L1/L2-resident tile and dot
                           them with x at once: the weights stream from memory once, and no
                           dequantized copy of the matrix is ever made
    T larger               dequantize a tile of rows (a few MiB, stays in L3), then BLAS

Activations stay float32. Dot products accumulate in float32 over 8 independent lanes (the SIMD
order), so the kernels vectorize without fastmath. Threads: the kernels are serial, nogil numba
functions run on a small thread pool over row ranges (thread-safe, no numba threading layer).
Kernels compile per ggml type on first use (the type is a compile-time literal) and are cached.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import numba
import numpy as np
from numba import njit, types

from sparkinfer_cli.ggml_types import GGMLType, row_bytes, type_name

F32, F16, BF16 = int(GGMLType.F32), int(GGMLType.F16), int(GGMLType.BF16)
Q4_0, Q4_1, Q5_0, Q5_1 = int(GGMLType.Q4_0), int(GGMLType.Q4_1), int(GGMLType.Q5_0), int(GGMLType.Q5_1)
Q8_0, IQ4_NL, IQ4_XS = int(GGMLType.Q8_0), int(GGMLType.IQ4_NL), int(GGMLType.IQ4_XS)
Q4_K, Q5_K, Q6_K = int(GGMLType.Q4_K), int(GGMLType.Q5_K), int(GGMLType.Q6_K)
SUPPORTED_TYPES: frozenset[int] = frozenset(
    {F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL, Q4_K, Q5_K, Q6_K, IQ4_XS})

# Bit patterns → float32, exact by construction (numpy's own fp16 conversion; bf16 = high half).
_F16_LUT = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)
_BF16_LUT = (np.arange(65536, dtype=np.uint32) << 16).view(np.float32)
_IQ4_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113],
                       dtype=np.float32)  # kvalues_iq4nl

FUSED_MAX_TOKENS = 8  # above this, dequantized tile + BLAS is faster (bench/results)
_BLAS_TILE_BYTES = 4 << 20  # float32 tile of the BLAS path: stays in the 32 MiB L3
_MIN_ROWS_PER_THREAD = 64

# NOTE: numba widens integer arithmetic to int64, which has no AVX2 float conversion; casting the
# small results back to int32 lets LLVM narrow the whole chain and vectorize it.
_f32, _i32 = np.float32, np.int32
_C8, _C16, _C32 = np.float32(8), np.float32(16), np.float32(32)


# ---- block types ------------------------------------------------------------------------------
# A block is NSUB sub-blocks of SBE elements. Per type, `_scales_*` reads a block's header into
# sc[j], of[j] (and returns one aux int, e.g. Q5's high bits) and `_q_*` gives the quant value of
# element i of sub-block j (an integer or IQ4 table value, as float32); the weight is
# sc[j] * q (+ of[j]), formed exactly as ggml forms it.

# ggml type → (elements per block, raw units per block, sub-blocks per block, has offset).
# F16/BF16 rows are viewed as uint16, so their "block" of 32 values is 32 units.
_LAYOUT: dict[int, tuple[int, int, int, bool]] = {
    F16: (32, 32, 1, False), BF16: (32, 32, 1, False),
    Q4_0: (32, 18, 2, False), Q4_1: (32, 20, 2, True), Q5_0: (32, 22, 2, False),
    Q5_1: (32, 24, 2, True), Q8_0: (32, 34, 1, False), IQ4_NL: (32, 18, 2, False),
    Q4_K: (256, 144, 8, True), Q5_K: (256, 176, 8, True), Q6_K: (256, 210, 16, False),
    IQ4_XS: (256, 136, 16, False),
}


@njit(cache=True, inline="always")
def _fp16(raw, r, o, lut):
    return lut[np.int64(raw[r, o]) | (np.int64(raw[r, o + 1]) << 8)]


@njit(cache=True, inline="always")
def _u32(raw, r, o):
    return (np.int64(raw[r, o]) | (np.int64(raw[r, o + 1]) << 8) | (np.int64(raw[r, o + 2]) << 16)
            | (np.int64(raw[r, o + 3]) << 24))


# Legacy 32-blocks: byte i of qs holds element i (low nibble, sub-block 0) and i+16 (high, 1).

@njit(cache=True, inline="always")
def _scales_d(raw, r, o, lut, sc, of):  # Q4_0, IQ4_NL: d
    sc[0] = sc[1] = _fp16(raw, r, o, lut)
    return 0


@njit(cache=True, inline="always")
def _scales_dm(raw, r, o, lut, sc, of):  # Q4_1: d, m
    sc[0] = sc[1] = _fp16(raw, r, o, lut)
    of[0] = of[1] = _fp16(raw, r, o + 2, lut)
    return 0


@njit(cache=True, inline="always")
def _scales_q5_0(raw, r, o, lut, sc, of):
    _scales_d(raw, r, o, lut, sc, of)
    return _u32(raw, r, o + 2)


@njit(cache=True, inline="always")
def _scales_q5_1(raw, r, o, lut, sc, of):
    _scales_dm(raw, r, o, lut, sc, of)
    return _u32(raw, r, o + 4)


@njit(cache=True, inline="always")
def _nibble(raw, r, o, j, i):
    return _i32((raw[r, o + i] >> (4 * j)) & 15)


@njit(cache=True, inline="always")
def _q5(raw, r, o, qh, j, i):
    return _f32(_nibble(raw, r, o, j, i) | _i32(((qh >> (16 * j + i)) & 1) << 4))


@njit(cache=True, inline="always")
def _k_scale_min(raw, r, o, j):
    # get_scale_min_k4: 8 six-bit scales and mins packed into the 12 bytes at raw[r, o:o+12]
    if j < 4:
        return raw[r, o + j] & 63, raw[r, o + j + 4] & 63
    return ((raw[r, o + j + 4] & 15) | ((raw[r, o + j - 4] >> 6) << 4),
            (raw[r, o + j + 4] >> 4) | ((raw[r, o + j] >> 6) << 4))


@njit(cache=True, inline="always")
def _scales_k(raw, r, o, lut, sc, of):  # Q4_K, Q5_K
    d, dmin = _fp16(raw, r, o, lut), _fp16(raw, r, o + 2, lut)
    for j in range(8):
        s, m = _k_scale_min(raw, r, o + 4, j)
        sc[j] = d * _f32(s)
        of[j] = -(dmin * _f32(m))  # NOTE: a*q + (-b) == a*q - b bit for bit
    return 0


@njit(cache=True, inline="always")
def _scales_q6_k(raw, r, o, lut, sc, of):
    d = _fp16(raw, r, o + 208, lut)
    for j in range(16):
        sc[j] = d * _f32(np.int8(raw[r, o + 192 + j]))
    return 0


@njit(cache=True, inline="always")
def _q_q6_k(raw, r, o, j, i):
    # element 16j+i: half n, then quarter k of the half picks the ql nibble and the qh bit pair
    n, k, l = j // 8, (j % 8) // 2, 16 * (j % 2) + i
    lo = _i32((raw[r, o + 64 * n + 32 * (k % 2) + l] >> (4 * (k // 2))) & 15)
    hi = _i32((raw[r, o + 128 + 32 * n + l] >> (2 * k)) & 3)
    return _f32(lo | (hi << 4)) - _C32


@njit(cache=True, inline="always")
def _scales_iq4_xs(raw, r, o, lut, sc, of):
    # sub-blocks of 16: j = 2*ib + (high nibble); 6-bit scale of 32-block ib, offset by 32
    d, scales_h = _fp16(raw, r, o, lut), np.int64(raw[r, o + 2]) | (np.int64(raw[r, o + 3]) << 8)
    for ib in range(8):
        ls = (((raw[r, o + 4 + ib // 2] >> (4 * (ib % 2))) & 15)
              | (((scales_h >> (2 * ib)) & 3) << 4))
        sc[2 * ib] = sc[2 * ib + 1] = d * _f32(ls - 32)
    return 0


@njit(cache=True, inline="always")
def _scales_one(raw, r, o, lut, sc, of):  # F16 / BF16: the value itself, times 1 (exact)
    sc[0] = _f32(1)
    return 0


@njit(cache=True, inline="always")
def _scales(qtype, raw, r, o, lut, sc, of):
    # qtype is a compile-time literal: numba prunes every branch but one (here and in _q)
    if qtype == Q4_0 or qtype == IQ4_NL:
        return _scales_d(raw, r, o, lut, sc, of)
    if qtype == Q8_0:
        sc[0] = _fp16(raw, r, o, lut)
        return 0
    if qtype == Q4_1:
        return _scales_dm(raw, r, o, lut, sc, of)
    if qtype == Q5_0:
        return _scales_q5_0(raw, r, o, lut, sc, of)
    if qtype == Q5_1:
        return _scales_q5_1(raw, r, o, lut, sc, of)
    if qtype == Q4_K or qtype == Q5_K:
        return _scales_k(raw, r, o, lut, sc, of)
    if qtype == Q6_K:
        return _scales_q6_k(raw, r, o, lut, sc, of)
    if qtype == IQ4_XS:
        return _scales_iq4_xs(raw, r, o, lut, sc, of)
    return _scales_one(raw, r, o, lut, sc, of)


@njit(cache=True, inline="always")
def _q(qtype, raw, r, o, aux, lut, j, i):
    if qtype == Q4_0:
        return _f32(_nibble(raw, r, o + 2, j, i)) - _C8
    if qtype == Q4_1:
        return _f32(_nibble(raw, r, o + 4, j, i))
    if qtype == Q5_0:
        return _q5(raw, r, o + 6, aux, j, i) - _C16
    if qtype == Q5_1:
        return _q5(raw, r, o + 8, aux, j, i)
    if qtype == Q8_0:
        return _f32(np.int8(raw[r, o + 2 + i]))
    if qtype == IQ4_NL:
        return _IQ4_VALUES[_nibble(raw, r, o + 2, j, i)]
    if qtype == Q4_K:
        return _f32(_nibble(raw, r, o + 16 + 32 * (j // 2), j % 2, i))
    if qtype == Q5_K:
        return _f32(_nibble(raw, r, o + 48 + 32 * (j // 2), j % 2, i)
                    | _i32(((raw[r, o + 16 + i] >> j) & 1) << 4))
    if qtype == Q6_K:
        return _q_q6_k(raw, r, o, j, i)
    if qtype == IQ4_XS:
        return _IQ4_VALUES[_nibble(raw, r, o + 8 + 16 * (j // 2), j % 2, i)]
    return lut[raw[r, o + i]]


@njit(cache=True, inline="always")
def _layout(qtype):
    if qtype == Q4_0 or qtype == IQ4_NL:
        return 32, 18, 2, False
    if qtype == Q4_1:
        return 32, 20, 2, True
    if qtype == Q5_0:
        return 32, 22, 2, False
    if qtype == Q5_1:
        return 32, 24, 2, True
    if qtype == Q8_0:
        return 32, 34, 1, False
    if qtype == Q4_K:
        return 256, 144, 8, True
    if qtype == Q5_K:
        return 256, 176, 8, True
    if qtype == Q6_K:
        return 256, 210, 16, False
    if qtype == IQ4_XS:
        return 256, 136, 16, False
    return 32, 32, 1, False


# ---- kernels ----------------------------------------------------------------------------------
# NOTE: `sbe` (elements per sub-block) arrives as a runtime argument on purpose. With a constant
# trip count LLVM fully unrolls the inner loop, and then only the SLP vectorizer could vectorize
# it, which cannot prove that numba arrays don't alias; the loop vectorizer adds runtime checks.

@njit(cache=True, nogil=True)
def _dequant_rows(raw, qtype, lut, r0, r1, sbe, out):
    """out[r - r0] = dequantized row r, for r in r0..r1."""
    BS, BU, NSUB, HAS_OFF = _layout(qtype)
    sc, of = np.zeros(NSUB, np.float32), np.zeros(NSUB, np.float32)  # (n_sub,)
    for r in range(r0, r1):
        for b in range(raw.shape[1] // BU):
            aux = _scales(qtype, raw, r, b * BU, lut, sc, of)
            for j in range(NSUB):
                s, m, e = sc[j], of[j], b * BS + j * sbe
                for i in range(sbe):
                    if HAS_OFF:
                        out[r - r0, e + i] = s * _q(qtype, raw, r, b * BU, aux, lut, j, i) + m
                    else:
                        out[r - r0, e + i] = s * _q(qtype, raw, r, b * BU, aux, lut, j, i)


@njit(cache=True, nogil=True)
def _matmul_rows(raw, qtype, lut, x, r0, r1, sbe, out):
    """out[t, r] = dequantized row r · x[t], fused: 32 float32 lanes per t, nothing stored."""
    BS, BU, NSUB, HAS_OFF = _layout(qtype)
    T = x.shape[0]
    sc, of = np.zeros(NSUB, np.float32), np.zeros(NSUB, np.float32)  # (n_sub,)
    acc = np.empty((T, 32), np.float32)  # (T, lanes)
    for r in range(r0, r1):
        acc[:] = 0
        for b in range(raw.shape[1] // BU):
            aux = _scales(qtype, raw, r, b * BU, lut, sc, of)
            for j in range(NSUB):
                s, m, e = sc[j], of[j], b * BS + j * sbe
                for t in range(T):
                    for i in range(sbe):
                        w = s * _q(qtype, raw, r, b * BU, aux, lut, j, i)
                        if HAS_OFF:
                            w += m
                        acc[t, i] += w * x[t, e + i]
        for t in range(T):
            out[t, r] = _sum32(acc[t])


@njit(cache=True, inline="always")
def _sum32(a):
    s = _f32(0)
    for k in range(4):
        s += ((a[8 * k] + a[8 * k + 1]) + (a[8 * k + 2] + a[8 * k + 3])) + (
            (a[8 * k + 4] + a[8 * k + 5]) + (a[8 * k + 6] + a[8 * k + 7]))
    return s


# ---- dispatch --------------------------------------------------------------------------------

_SPECIALIZED: dict = {}
_POOL: ThreadPoolExecutor | None = None


def _specialized(kernel, ggml_type: int, args: tuple) -> Callable:
    """`kernel` compiled with the ggml type (its 2nd argument) as a literal; once per process."""
    key = (kernel, ggml_type)
    if key not in _SPECIALIZED:
        sig = [numba.typeof(a) for a in args]
        sig[1] = types.literal(ggml_type)
        kernel.compile(tuple(sig))
        _SPECIALIZED[key] = kernel.overloads[tuple(sig)].entry_point
    return _SPECIALIZED[key]


def _num_threads() -> int:
    return numba.config.NUMBA_NUM_THREADS


def _parallel_rows(fn: Callable, n_rows: int, *args) -> None:
    """fn(*args, r0, r1) over row ranges, one per thread; the caller's thread takes the first."""
    global _POOL
    n = max(1, min(_num_threads(), n_rows // _MIN_ROWS_PER_THREAD))
    bounds = [n_rows * k // n for k in range(n + 1)]
    if n == 1:
        fn(*args, 0, n_rows)
        return
    if _POOL is None:
        _POOL = ThreadPoolExecutor(_num_threads() - 1, thread_name_prefix="sparkinfer-quant")
    futures = [_POOL.submit(fn, *args, bounds[k], bounds[k + 1]) for k in range(1, n)]
    fn(*args, bounds[0], bounds[1])
    for f in futures:
        f.result()


# ---- public API ------------------------------------------------------------------------------

def _rows_view(raw: np.ndarray, ggml_type: int, ne0: int) -> np.ndarray:
    """raw → read-only 2-D (rows, units) array in the dtype the kernels read."""
    if ggml_type not in SUPPORTED_TYPES:
        raise ValueError(f"ggml type {type_name(ggml_type)} is not supported by the CPU quant "
                         f"kernels (supported: {', '.join(sorted(map(type_name, SUPPORTED_TYPES)))})")
    raw = np.ascontiguousarray(raw)
    if ggml_type == F32:
        expected, dtype = ne0, np.dtype(np.float32)
    elif ggml_type == F16:
        expected, dtype = ne0, np.dtype(np.float16)
    else:
        expected, dtype = row_bytes(ggml_type, ne0), np.dtype(np.uint8)
    if raw.dtype != dtype or raw.ndim == 0 or raw.shape[-1] != expected:
        raise ValueError(f"{type_name(ggml_type)} tensor with ne0={ne0} needs {dtype} rows of "
                         f"{expected}, got {raw.dtype} {raw.shape}")
    rows = raw.reshape(-1, expected)  # (n_rows, units)
    if ggml_type in (F16, BF16):
        rows = rows.view(np.uint16)  # (n_rows, ne0)
    return _readonly(rows)


def _readonly(a: np.ndarray) -> np.ndarray:
    # NOTE: numba compiles read-only and writable arrays separately; always pass read-only ones
    a = a.view()
    a.flags.writeable = False
    return a


def _lut(ggml_type: int) -> np.ndarray:
    return _BF16_LUT if ggml_type == BF16 else _F16_LUT


def _dequant_range(rows: np.ndarray, ggml_type: int, r0: int, r1: int, out: np.ndarray) -> None:
    """out[:r1-r0] = dequantized rows r0..r1, on all threads."""
    if ggml_type == F32:
        out[:r1 - r0] = rows[r0:r1]
        return
    block, _, n_sub, _ = _LAYOUT[ggml_type]
    args = (rows, ggml_type, _lut(ggml_type))
    kernel = _specialized(_dequant_rows, ggml_type, (*args, 0, 0, 0, out))

    def part(a: int, b: int) -> None:
        kernel(*args, r0 + a, r0 + b, block // n_sub, out[a:])

    _parallel_rows(part, r1 - r0)


def dequantize(raw: np.ndarray, ggml_type: int, ne0: int) -> np.ndarray:
    """raw: as returned by GGUFFile.raw(name): natural dtype for F32/F16 (shape (..., ne0)), uint8
    (..., row_bytes) for quantized types and BF16. Returns float32 (..., ne0), equal to
    gguf.quants.dequantize bit for bit."""
    rows = _rows_view(raw, ggml_type, ne0)
    out = np.empty((rows.shape[0], ne0), np.float32)  # (n_rows, ne0)
    _dequant_range(rows, ggml_type, 0, rows.shape[0], out)
    return out.reshape(*raw.shape[:-1], ne0)


def embedding_rows(raw: np.ndarray, ggml_type: int, ne0: int, ids: np.ndarray) -> np.ndarray:
    """Dequantized rows `ids` of a (n_rows, row_bytes) tensor → float32 (len(ids), ne0)."""
    rows = _rows_view(raw, ggml_type, ne0)
    ids = np.asarray(ids).reshape(-1)
    if len(ids) and (ids.min() < 0 or ids.max() >= rows.shape[0]):
        raise ValueError(f"embedding ids must lie in [0, {rows.shape[0]}), got "
                         f"[{ids.min()}, {ids.max()}]")
    out = np.empty((len(ids), ne0), np.float32)  # (len(ids), ne0)
    for k, r in enumerate(ids.tolist()):
        _dequant_range(rows, ggml_type, r, r + 1, out[k:])
    return out


def _matmul_tiled(rows: np.ndarray, ggml_type: int, x: np.ndarray) -> np.ndarray:
    n_rows, ne0 = rows.shape[0], x.shape[1]
    tile = max(16, _BLAS_TILE_BYTES // (4 * ne0))
    w = np.empty((tile, ne0), np.float32)  # (tile, ne0)
    out_t = np.empty((n_rows, x.shape[0]), np.float32)  # (rows, T)
    for r0 in range(0, n_rows, tile):
        r1 = min(n_rows, r0 + tile)
        _dequant_range(rows, ggml_type, r0, r1, w)
        np.matmul(w[:r1 - r0], x.T, out=out_t[r0:r1])
    return np.ascontiguousarray(out_t.T)  # (T, rows)


def _matmul_fused(rows: np.ndarray, ggml_type: int, x: np.ndarray) -> np.ndarray:
    out = np.empty((x.shape[0], rows.shape[0]), np.float32)  # (T, rows)
    block, _, n_sub, _ = _LAYOUT[ggml_type]
    args = (rows, ggml_type, _lut(ggml_type), _readonly(x))
    kernel = _specialized(_matmul_rows, ggml_type, (*args, 0, 0, 0, out))
    _parallel_rows(lambda r0, r1: kernel(*args, r0, r1, block // n_sub, out), rows.shape[0])
    return out


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
    return _matmul_fused(rows, ggml_type, x)
