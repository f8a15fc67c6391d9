"""CPU kernels on ggml-quantized weights: dequantize, matmul (x @ W.T) and embedding rows.

Per ggml type, quant_blocks.py says where a block's scales are and what its quants are; the
kernels here are generic over that and are built per type by `_make_kernels`:

    dequant_rows  rows r0..r1 → float32, bit-exact with gguf.quants
    dot_rows      out[t, r] = row r · x[t], fused: each block is decoded in registers and
                  multiplied into 32 float32 lanes per token; no dequantized copy of W exists

matmul uses dot_rows for T <= FUSED_MAX_TOKENS (decode), and for larger T dequantizes a tile of
rows (a few MiB, stays in L3) and multiplies it with BLAS. Activations stay float32 and sums
accumulate in float32 in a fixed lane order, so the kernels need no fastmath. The kernels are
serial nogil numba functions run on a small thread pool over row ranges (thread-safe: no numba
threading layer). They are compiled into two drivers, `_dequant_rows` and `_matmul_rows`, on
their first use (all types at once: ~25 s CPU on a cold cache) and cached on disk.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import numba
import numpy as np
from numba import njit

from sparkinfer_cli.gguf.ggml_types import row_bytes, type_name
from sparkinfer_cli.kernels.cpu.quant_blas import single_threaded_blas
from sparkinfer_cli.kernels.cpu.quant_blocks import (
    BF16,
    BF16_LUT,
    BLOCK_TYPES,
    F16,
    F16_LUT,
    F32,
    IQ4_NL,
    IQ4_XS,
    Q4_0,
    Q4_1,
    Q4_K,
    Q5_0,
    Q5_1,
    Q5_K,
    Q6_K,
    Q8_0,
    BlockType,
)

SUPPORTED_TYPES: frozenset[int] = frozenset(BLOCK_TYPES) | {F32}
FUSED_MAX_TOKENS = 8  # above this, dequantized tile + BLAS is faster (bench/results)
_BLAS_TILE_BYTES = 4 << 20  # float32 tile of the BLAS path: stays in the 32 MiB L3
# Below this many weights per thread, handing work to a second thread costs more than it saves.
_MIN_WEIGHTS_PER_THREAD = 1 << 20


# ---- kernels ----------------------------------------------------------------------------------
# Vectorization (AVX2, no fastmath) hinges on LLVM's loop vectorizer, which adds runtime alias
# checks for numba arrays; the SLP vectorizer cannot prove them apart. So no inner loop may be
# fully unrolled first: dequant_rows gets its trip count `sbe` at run time; dot_rows has a
# constant 16 but a body (two lanes per step) too large to unroll. Measured, not guessed.

def _make_kernels(bt: BlockType) -> tuple[Callable, Callable]:
    BS, BU, NSUB, HAS_OFF, scales, q = bt

    @njit(nogil=True)
    def dequant_rows(raw, lut, r0, r1, sbe, out):
        sc, of = np.zeros(NSUB, np.float32), np.zeros(NSUB, np.float32)  # (n_sub,)
        for r in range(r0, r1):
            for b in range(raw.shape[1] // BU):
                aux = scales(raw, r, b * BU, lut, sc, of)
                for j in range(NSUB):
                    s, m, e = sc[j], of[j], b * BS + j * sbe
                    for i in range(sbe):
                        w = s * q(raw, r, b * BU, aux, lut, j, i)
                        out[r - r0, e + i] = w + m if HAS_OFF else w

    # dot_rows walks 32-element runs: lane i is element i of sub-block ja, lane 16+i is element
    # RUN_I+i of sub-block jb (the next 16-element sub-block, or the same 32-element one)
    RUN_J = 2 if NSUB * 16 == BS else 1  # 16-element sub-blocks: a run spans two of them
    RUN_I = 0 if NSUB * 16 == BS else 16

    @njit(nogil=True)
    def dot_rows(raw, lut, x, r0, r1, out):
        sc, of = np.zeros(NSUB, np.float32), np.zeros(NSUB, np.float32)  # (n_sub,)
        acc = np.empty((x.shape[0], 32), np.float32)  # (T, lanes)
        for r in range(r0, r1):
            acc[:] = 0
            for b in range(raw.shape[1] // BU):
                o = b * BU
                aux = scales(raw, r, o, lut, sc, of)
                for k in range(BS // 32):
                    ja, e = RUN_J * k, b * BS + 32 * k
                    jb = ja + RUN_J - 1
                    sa, sb, ma, mb = sc[ja], sc[jb], of[ja], of[jb]
                    for t in range(x.shape[0]):
                        for i in range(16):
                            wa = sa * q(raw, r, o, aux, lut, ja, i)
                            wb = sb * q(raw, r, o, aux, lut, jb, RUN_I + i)
                            acc[t, i] += (wa + ma if HAS_OFF else wa) * x[t, e + i]
                            acc[t, 16 + i] += (wb + mb if HAS_OFF else wb) * x[t, e + 16 + i]
            for t in range(x.shape[0]):
                out[t, r] = _sum32(acc[t])

    return dequant_rows, dot_rows


@njit(cache=True, inline="always")
def _sum32(a):
    s = np.float32(0)
    for k in range(4):
        s += ((a[8 * k] + a[8 * k + 1]) + (a[8 * k + 2] + a[8 * k + 3])) + (
            (a[8 * k + 4] + a[8 * k + 5]) + (a[8 * k + 6] + a[8 * k + 7]))
    return s


_DQ_F16, _DOT_F16 = _make_kernels(BLOCK_TYPES[F16])  # BF16 too: only the lut differs
_DQ_Q4_0, _DOT_Q4_0 = _make_kernels(BLOCK_TYPES[Q4_0])
_DQ_Q4_1, _DOT_Q4_1 = _make_kernels(BLOCK_TYPES[Q4_1])
_DQ_Q5_0, _DOT_Q5_0 = _make_kernels(BLOCK_TYPES[Q5_0])
_DQ_Q5_1, _DOT_Q5_1 = _make_kernels(BLOCK_TYPES[Q5_1])
_DQ_Q8_0, _DOT_Q8_0 = _make_kernels(BLOCK_TYPES[Q8_0])
_DQ_IQ4_NL, _DOT_IQ4_NL = _make_kernels(BLOCK_TYPES[IQ4_NL])
_DQ_Q4_K, _DOT_Q4_K = _make_kernels(BLOCK_TYPES[Q4_K])
_DQ_Q5_K, _DOT_Q5_K = _make_kernels(BLOCK_TYPES[Q5_K])
_DQ_Q6_K, _DOT_Q6_K = _make_kernels(BLOCK_TYPES[Q6_K])
_DQ_IQ4_XS, _DOT_IQ4_XS = _make_kernels(BLOCK_TYPES[IQ4_XS])


# The drivers are what numba caches on disk (the per-type closures above are compiled into them).
# One compile covers every type (~10 s cold on 2 cores; numba does not prune the branches of a
# literal qtype here, so per-type specialization would only multiply that).

@njit(cache=True, nogil=True)
def _dequant_rows(raw, qtype, lut, r0, r1, sbe, out):
    if qtype == Q4_0:
        _DQ_Q4_0(raw, lut, r0, r1, sbe, out)
    elif qtype == Q4_1:
        _DQ_Q4_1(raw, lut, r0, r1, sbe, out)
    elif qtype == Q5_0:
        _DQ_Q5_0(raw, lut, r0, r1, sbe, out)
    elif qtype == Q5_1:
        _DQ_Q5_1(raw, lut, r0, r1, sbe, out)
    elif qtype == Q8_0:
        _DQ_Q8_0(raw, lut, r0, r1, sbe, out)
    elif qtype == IQ4_NL:
        _DQ_IQ4_NL(raw, lut, r0, r1, sbe, out)
    elif qtype == Q4_K:
        _DQ_Q4_K(raw, lut, r0, r1, sbe, out)
    elif qtype == Q5_K:
        _DQ_Q5_K(raw, lut, r0, r1, sbe, out)
    elif qtype == Q6_K:
        _DQ_Q6_K(raw, lut, r0, r1, sbe, out)
    elif qtype == IQ4_XS:
        _DQ_IQ4_XS(raw, lut, r0, r1, sbe, out)


@njit(cache=True, nogil=True)
def _matmul_rows(raw, qtype, lut, x, r0, r1, out):
    if qtype == Q4_0:
        _DOT_Q4_0(raw, lut, x, r0, r1, out)
    elif qtype == Q4_1:
        _DOT_Q4_1(raw, lut, x, r0, r1, out)
    elif qtype == Q5_0:
        _DOT_Q5_0(raw, lut, x, r0, r1, out)
    elif qtype == Q5_1:
        _DOT_Q5_1(raw, lut, x, r0, r1, out)
    elif qtype == Q8_0:
        _DOT_Q8_0(raw, lut, x, r0, r1, out)
    elif qtype == IQ4_NL:
        _DOT_IQ4_NL(raw, lut, x, r0, r1, out)
    elif qtype == Q4_K:
        _DOT_Q4_K(raw, lut, x, r0, r1, out)
    elif qtype == Q5_K:
        _DOT_Q5_K(raw, lut, x, r0, r1, out)
    elif qtype == Q6_K:
        _DOT_Q6_K(raw, lut, x, r0, r1, out)
    elif qtype == IQ4_XS:
        _DOT_IQ4_XS(raw, lut, x, r0, r1, out)


@njit(cache=True, nogil=True)
def _dequant_rows_16(raw, qtype, lut, r0, r1, sbe, out):  # F16 / BF16 rows as uint16
    _DQ_F16(raw, lut, r0, r1, sbe, out)


@njit(cache=True, nogil=True)
def _matmul_rows_16(raw, qtype, lut, x, r0, r1, out):
    _DOT_F16(raw, lut, x, r0, r1, out)


# ---- dispatch --------------------------------------------------------------------------------

_POOL: ThreadPoolExecutor | None = None


def _num_threads() -> int:
    return numba.config.NUMBA_NUM_THREADS


def _parallel_rows(fn: Callable, n_rows: int, row_size: int) -> None:
    """fn(r0, r1) over row ranges, one per thread, enough weights (row_size each) for each."""
    parallel_ranges(fn, n_rows, n_rows * row_size // _MIN_WEIGHTS_PER_THREAD)


def parallel_ranges(fn: Callable, n: int, n_parts: int) -> None:
    """fn(a, b) over ranges that cover 0..n, n_parts of them but at least 1 and at most one per
    thread, in parallel on a shared pool; the caller's thread takes the first."""
    global _POOL
    n_parts = max(1, min(_num_threads(), n_parts))
    bounds = [n * k // n_parts for k in range(n_parts + 1)]
    if n_parts == 1:
        fn(0, n)
        return
    if _POOL is None:
        _POOL = ThreadPoolExecutor(_num_threads() - 1, thread_name_prefix="sparkinfer-quant")
    futures = [_POOL.submit(fn, bounds[k], bounds[k + 1]) for k in range(1, n_parts)]
    fn(bounds[0], bounds[1])
    for f in futures:
        f.result()


# ---- public API ------------------------------------------------------------------------------

def _rows_view(raw: np.ndarray, ggml_type: int, ne0: int) -> np.ndarray:
    """raw → read-only 2-D (rows, units) array in the dtype the kernels read."""
    if ggml_type not in SUPPORTED_TYPES:
        supported = ", ".join(sorted(map(type_name, SUPPORTED_TYPES)))
        raise ValueError(f"ggml type {type_name(ggml_type)} is not supported by the CPU quant "
                         f"kernels (supported: {supported})")
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
    return BF16_LUT if ggml_type == BF16 else F16_LUT


def _dequant_range(rows: np.ndarray, ggml_type: int, r0: int, r1: int, out: np.ndarray,
                   threaded: bool = True) -> None:
    """out[:r1-r0] = dequantized rows r0..r1, on all threads (or on the caller's only)."""
    if ggml_type == F32:
        out[:r1 - r0] = rows[r0:r1]
        return
    sbe = BLOCK_TYPES[ggml_type].sub_block
    args = (rows, int(ggml_type), _lut(ggml_type))  # an IntEnum would be re-typed every call
    kernel = _dequant_rows_16 if ggml_type in (F16, BF16) else _dequant_rows

    def part(a: int, b: int) -> None:
        kernel(*args, r0 + a, r0 + b, sbe, out[a:])

    if threaded:
        _parallel_rows(part, r1 - r0, out.shape[1])
    else:
        part(0, r1 - r0)


def dequantize(raw: np.ndarray, ggml_type: int, ne0: int) -> np.ndarray:
    """raw: as returned by GGUFFile.raw(name): natural dtype for F32/F16 (shape (..., ne0)), uint8
    (..., row_bytes) for quantized types and BF16. Returns float32 (..., ne0), equal to
    gguf.quants.dequantize bit for bit."""
    rows = _rows_view(raw, ggml_type, ne0)
    out = np.empty((rows.shape[0], ne0), np.float32)  # (n_rows, ne0)
    _dequant_range(rows, ggml_type, 0, rows.shape[0], out)
    return out.reshape(*raw.shape[:-1], ne0)


_GATHER_MIN_ROWS = 64


def embedding_rows(raw: np.ndarray, ggml_type: int, ne0: int, ids: np.ndarray) -> np.ndarray:
    """Dequantized rows `ids` of a (n_rows, row_bytes) tensor → float32 (len(ids), ne0)."""
    rows = _rows_view(raw, ggml_type, ne0)
    ids = np.asarray(ids).reshape(-1)
    if len(ids) and (ids.min() < 0 or ids.max() >= rows.shape[0]):
        raise ValueError(f"embedding ids must lie in [0, {rows.shape[0]}), got "
                         f"[{ids.min()}, {ids.max()}]")
    out = np.empty((len(ids), ne0), np.float32)  # (len(ids), ne0)
    if len(ids) > _GATHER_MIN_ROWS:  # a prefill: gather the rows, dequantize them on all threads
        # NOTE: read-only like the file's rows, so numba compiles one kernel for both paths
        _dequant_range(_readonly(rows[ids]), ggml_type, 0, len(ids), out)
        return out
    for k, r in enumerate(ids.tolist()):  # one row is less work than a thread handoff
        _dequant_range(rows, ggml_type, r, r + 1, out[k:], threaded=False)
    return out


def _matmul_tiled(rows: np.ndarray, ggml_type: int, x: np.ndarray) -> np.ndarray:
    n_rows, ne0 = rows.shape[0], x.shape[1]
    tile = max(16, _BLAS_TILE_BYTES // (4 * ne0))
    out_t = np.empty((n_rows, x.shape[0]), np.float32)  # (rows, T)

    def part(a: int, b: int) -> None:  # each thread: its own tiles, dequantize then GEMM
        w = np.empty((tile, ne0), np.float32)  # (tile, ne0)
        for r0 in range(a, b, tile):
            r1 = min(b, r0 + tile)
            _dequant_range(rows, ggml_type, r0, r1, w, threaded=False)
            np.matmul(w[:r1 - r0], x.T, out=out_t[r0:r1])

    with single_threaded_blas():
        _parallel_rows(part, n_rows, ne0 * x.shape[0])
    return np.ascontiguousarray(out_t.T)  # (T, rows)


def _matmul_fused(rows: np.ndarray, ggml_type: int, x: np.ndarray) -> np.ndarray:
    out = np.empty((x.shape[0], rows.shape[0]), np.float32)  # (T, rows)
    args = (rows, int(ggml_type), _lut(ggml_type), _readonly(x))
    kernel = _matmul_rows_16 if ggml_type in (F16, BF16) else _matmul_rows
    _parallel_rows(lambda r0, r1: kernel(*args, r0, r1, out), rows.shape[0],
                   x.shape[1] * x.shape[0])
    return out


def matmul(raw: np.ndarray, ggml_type: int, ne0: int, x: np.ndarray) -> np.ndarray:
    """raw: one 2-D weight (rows, row_bytes or ne0); x: float32 (T, ne0). Returns float32
    (T, rows) = x @ W.T where W = dequantize(raw). T=1 (decode) through large T (prefill)."""
    rows, x = _operands(raw, ggml_type, ne0, x)
    if ggml_type == F32:
        return x @ rows.T  # (T, rows)
    if x.shape[0] > FUSED_MAX_TOKENS:
        return _matmul_tiled(rows, ggml_type, x)
    return _matmul_fused(rows, ggml_type, x)


def matmul_row_invariant(raw: np.ndarray, ggml_type: int, ne0: int, x: np.ndarray) -> np.ndarray:
    """matmul whose output row t is computed from x[t] alone, the same way whatever T: for
    products whose row count depends on what else shares the pass (the MoE experts' tokens), so
    that a sequence's numbers do not."""
    rows, x = _operands(raw, ggml_type, ne0, x)
    if ggml_type == F32:  # one matrix-vector product a row: BLAS may sum a GEMM by its shape
        out = np.empty((x.shape[0], rows.shape[0]), np.float32)  # (T, rows)
        for t in range(x.shape[0]):
            np.matmul(rows, x[t], out=out[t])
        return out
    return _matmul_fused(rows, ggml_type, x)


def _operands(raw: np.ndarray, ggml_type: int, ne0: int,
              x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(W's rows view, x as contiguous float32 (T, ne0)), or ValueError."""
    if raw.ndim != 2:
        raise ValueError(f"matmul needs a 2-D weight, got shape {raw.shape}")
    rows = _rows_view(raw, ggml_type, ne0)
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim != 2 or x.shape[1] != ne0:
        raise ValueError(f"x must be (T, {ne0}), got {x.shape}")
    return rows, x
