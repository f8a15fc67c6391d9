"""The small ops of a decode step (one new token per sequence) as numba kernels; ops.py is their
reference.

At T = 1 the numpy versions cost 15-45 µs each in call overhead and temporaries (a decode token
of Qwen2.5-0.5B runs about 150 of them), and attention gathered each sequence's whole K/V out of
the paged cache first. These read the cache in place and allocate only their outputs.
"""

from __future__ import annotations

import numpy as np
from numba import carray, cfunc, njit, types

from sparkinfer_cli.kernels.cpu import parallel_calls, quant
from sparkinfer_cli.kernels.cpu.ops import ROPE_NEOX, _inv_freq

_f32 = np.float32


@njit(cache=True, nogil=True)
def _rms_norm_row(x, w, eps, out):
    ss = 0.0  # float64 sum of squares, as ggml
    for i in range(x.shape[0]):
        ss += np.float64(x[i]) * np.float64(x[i])
    scale = _f32(1.0 / np.sqrt(ss / x.shape[0] + eps))
    for i in range(x.shape[0]):
        out[i] = (x[i] * scale) * w[i]


@njit(cache=True, nogil=True)
def _rms_norm_rows(x, w, eps, out):
    for r in range(x.shape[0]):
        _rms_norm_row(x[r], w, eps, out[r])


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """ops.rms_norm of x (..., n) float32, row by row: a row's result does not depend on the
    others."""
    rows = x.reshape(-1, x.shape[-1])  # (rows, n)
    out = np.empty(rows.shape, np.float32)  # (rows, n)
    _rms_norm_rows(rows, weight, eps, out)
    return out.reshape(x.shape)


@njit(cache=True, nogil=True)
def _rope_heads(x, position, inv_freq, neox, out):
    """out = x (H, D) rotated in its first 2·len(inv_freq) dims; neox pairs i with i + half."""
    half = inv_freq.shape[0]
    for i in range(half):
        angle = position * inv_freq[i]  # float64, as ops.rope
        c, s = np.float32(np.cos(angle)), np.float32(np.sin(angle))
        ia, ib = (i, i + half) if neox else (2 * i, 2 * i + 1)
        for h in range(x.shape[0]):
            a, b = x[h, ia], x[h, ib]
            out[h, ia] = a * c - b * s
            out[h, ib] = a * s + b * c
    for h in range(x.shape[0]):
        for d in range(2 * half, x.shape[1]):
            out[h, d] = x[h, d]


@njit(cache=True, nogil=True)
def _rope_rows(x, positions, inv_freq, neox, out):
    for t in range(x.shape[0]):
        _rope_heads(x[t], np.float64(positions[t]), inv_freq, neox, out[t])


def rope(x: np.ndarray, positions: np.ndarray, n_rot: int, base: float,
         style: str) -> np.ndarray:
    """ops.rope of x (T, H, D), token t at positions[t]."""
    out = np.empty(x.shape, np.float32)  # (T, H, D)
    _rope_rows(x, positions, _inv_freq(n_rot, base), style == ROPE_NEOX, out)
    return out


@njit(cache=True, nogil=True, fastmath=True, error_model="numpy")
def _attend_paged(q, k_new, v_new, k, v, block_table, position, out):
    """Store k_new, v_new (H_kv, D) at `position` of a paged cache layer k, v (block, slot,
    H_kv, D), then out (H, D) = softmax(q·Kᵀ/√D)·V over positions 0..position; query head h
    reads KV head h // (H / H_kv)."""
    H, D = q.shape
    H_kv, block_size = k.shape[2], k.shape[1]
    group, length = H // H_kv, position + 1
    k[block_table[position // block_size], position % block_size] = k_new
    v[block_table[position // block_size], position % block_size] = v_new
    scale = _f32(1.0 / np.sqrt(D))
    # NOTE: positions outermost: the cache is read in its own order, each slot's heads at once
    p = np.empty((H, length), np.float32)  # (H, length)
    for t in range(length):
        kt = k[block_table[t // block_size], t % block_size]  # (H_kv, D)
        for h in range(H):
            acc = _f32(0)
            for d in range(D):
                acc += q[h, d] * kt[h // group, d]
            p[h, t] = acc * scale
    for h in range(H):
        p_max, total = p[h].max(), _f32(0)
        for t in range(length):
            p[h, t] = np.exp(p[h, t] - p_max)
            total += p[h, t]
        p[h] /= total
    out[:] = 0
    for t in range(length):
        vt = v[block_table[t // block_size], t % block_size]  # (H_kv, D)
        for h in range(H):
            for d in range(D):
                out[h, d] += p[h, t] * vt[h // group, d]


_ATTEND_SIG = types.void(*[types.CPointer(types.float32)] * 6, types.CPointer(types.int64),
                         types.CPointer(types.int32), types.CPointer(types.int64), types.int64,
                         types.int64)


@cfunc(_ATTEND_SIG, nogil=True, cache=True, fastmath=True, error_model="numpy")
def _attend_rows(q_p, k_new_p, v_new_p, k_p, v_p, out_p, rows_p, tables_p, dims_p, first, end):
    """_attend_paged over rows first..end-1 of attend_paged's arrays, given by address (a
    parallel_calls record): dims = (N, H, H_kv, D, num_blocks, block_size, n_rows, table width),
    rows_p (2, n_rows): each row's token row, then its position; tables_p (n_rows, width)."""
    dims = carray(dims_p, (8,))
    n, h, h_kv, d, n_rows, width = dims[0], dims[1], dims[2], dims[3], dims[6], dims[7]
    q, out = carray(q_p, (n, h, d)), carray(out_p, (n, h, d))
    k_new, v_new = carray(k_new_p, (n, h_kv, d)), carray(v_new_p, (n, h_kv, d))
    k = carray(k_p, (dims[4], dims[5], h_kv, d))
    v = carray(v_p, (dims[4], dims[5], h_kv, d))
    rows, tables = carray(rows_p, (2, n_rows)), carray(tables_p, (n_rows, width))
    for i in range(first, end):
        r = rows[0, i]
        _attend_paged(q[r], k_new[r], v_new[r], k, v, tables[i], rows[1, i], out[r])


# A part of the rows goes to another thread when it holds more attention than parallel_calls'
# hand-off of a few µs costs, in q·K and p·V multiply-adds.
_MIN_MACS_PER_PART = 1 << 17


def attend_paged(q: np.ndarray, k_new: np.ndarray, v_new: np.ndarray, k: np.ndarray,
                 v: np.ndarray, rows: list[int], block_tables: list[np.ndarray],
                 positions: list[int]) -> np.ndarray:
    """Decode tokens of several sequences, one each: token rows[i] of q (N, H, D), k_new, v_new
    (N, H_kv, D) is at positions[i] of the sequence with block_tables[i]. Stores its k_new, v_new
    in the layer's paged cache k, v (num_blocks, block_size, H_kv, D) (ModelCache's region map),
    then ops.causal_attention of its query over positions 0..positions[i]. Returns out (N, H, D),
    written in those rows only. Rows are split between the threads by their keys."""
    N, H, D = q.shape
    out = np.empty((N, H, D), np.float32)
    macs = 2 * H * D * (sum(positions) + len(positions))
    n_parts = max(1, min(quant._num_threads(), len(rows), macs // _MIN_MACS_PER_PART))
    if n_parts == 1:
        for r, table, position in zip(rows, block_tables, positions):
            _attend_paged(q[r], k_new[r], v_new[r], k, v, table, position, out[r])
        return out
    arrays = [np.ascontiguousarray(a, np.float32) for a in (q, k_new, v_new)]
    if not (k.flags.c_contiguous and v.flags.c_contiguous):
        raise ValueError("the KV cache layers must be C-contiguous")
    width = max(len(t) for t in block_tables)
    tables = np.zeros((len(rows), width), np.int32)  # (rows, width)
    for i, table in enumerate(block_tables):
        tables[i, :len(table)] = table
    row_positions = np.array([rows, positions], np.int64)  # (2, rows)
    dims = np.array([N, H, k.shape[2], D, k.shape[0], k.shape[1], len(rows), width], np.int64)
    pointers = [a.ctypes.data for a in (*arrays, k, v, out, row_positions, tables, dims)]
    bounds = _split_by_keys(positions, n_parts)
    calls = np.array([[_attend_rows.address, *pointers, a, b]
                      for a, b in zip(bounds, bounds[1:])], np.int64)
    parallel_calls.run_parts(calls, np.arange(1, n_parts + 1, dtype=np.int64))
    return out


def _split_by_keys(positions: list[int], n_parts: int) -> list[int]:
    """Row bounds of n_parts runs of rows with about equal keys to attend to."""
    ends = np.cumsum(np.asarray(positions, np.int64) + 1)
    cuts = np.searchsorted(ends, ends[-1] * np.arange(1, n_parts) / n_parts, side="right")
    return [0, *(int(c) for c in cuts), len(positions)]
