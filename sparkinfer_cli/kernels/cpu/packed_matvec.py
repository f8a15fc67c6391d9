"""A decode step (n tokens, one per sequence) through several packed weights that read the same
input, as one call.

q/k/v and gate/up share their input: x is quantized once, and one parallel_calls hand-off splits
the rows of all of them between the threads. Each weight row is multiplied with up to MAX_ROWS x
rows in one pass (quant_packed's kernel), so a step of n sequences reads the weights once per
MAX_ROWS, not n times, and all of a call's x rows (up to GROUP_ROWS) go to the threads in one
hand-off. Everything a call needs but x and y (the kernels, pointers to the weights, the
concatenated bias) is prepared at load, so a call costs a few microseconds of Python besides the
kernels.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from sparkinfer_cli.kernels.cpu import parallel_calls, quant
from sparkinfer_cli.kernels.cpu.quant_packed import (
    MAX_ROWS,
    RECORD_ELEMENTS,
    PackedWeight,
    quantize_kernel,
    row_kernel,
)
from sparkinfer_cli.kernels.cpu.quant_q8 import Q8_BLOCK

# A call costs about weights·(n + 2) units of ~17 ps on one core (Qwen2.5-0.5B's Q6_K ffn_down:
# 0.24 ms for 1 row, 0.76 ms for 8). Its rows are split between the threads when each gets more
# than the few µs of parallel_calls' hand-off.
_MIN_WORK_PER_PART = 1 << 16
# x rows of one hand-off to the threads: a prompt piece's rows go out in a few large calls, not one
# per kernel pass, and the quantized x of a call stays a few MiB.
GROUP_ROWS = 32 * MAX_ROWS


class _Chunk(NamedTuple):
    """Rows lo..lo+m of a call's quantized x: the pointers (xq, xd, xs, xl) of their part of
    each buffer, for the row kernel."""

    lo: int
    m: int
    pointers: tuple[int, ...]


class _Plan(NamedTuple):
    """A call's chunks, and the buffers' addresses (xq, xd, xl, xs) for quantize_kernel."""

    chunks: list[_Chunk]
    buffers: tuple[int, ...]


class _Scratch:
    """The quantized x of a call: one set of buffers for the process, grown to the largest call
    (calls run one at a time under its lock), so that the ~120 fused weights of a model do not
    each keep their own; the chunk plan of each (rows, ne0) is kept, so that a decode call costs
    little Python besides its kernels."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self._bufs: dict[str, np.ndarray] = {}
        self._plans: dict[tuple[int, int], list[_Chunk]] = {}
        self.generation = 0  # counts the times the buffers moved (plans made before are stale)

    def plan(self, n: int, ne0: int) -> _Plan:
        """x (n, ne0) in chunks of up to MAX_ROWS rows (the rows of one kernel pass)."""
        plan = self._plans.get((n, ne0))
        if plan is None:
            plan = self._plans[n, ne0] = self._plan(n, ne0)
        return plan

    def _plan(self, n: int, ne0: int) -> _Plan:
        nb, nr = ne0 // Q8_BLOCK, ne0 // RECORD_ELEMENTS
        sizes = {"xq": (n * ne0, np.int8), "xd": (n * nr * 8, np.float32),
                 "xl": (n * nr * 8, np.int32), "xs": (n * nb, np.float32)}
        for name, (size, dtype) in sizes.items():
            if name not in self._bufs or self._bufs[name].size < size:
                self._bufs[name] = np.empty(size, dtype)
                self._plans.clear()  # their views are of the buffer this one replaces
                self.generation += 1
        buf = {name: self._bufs[name][:size] for name, (size, _) in sizes.items()}
        xq, xd, xl = (buf["xq"].reshape(n, ne0), buf["xd"].reshape(n, nr, 8),
                      buf["xl"].reshape(n, nr, 8))
        chunks = []
        for lo in range(0, n, MAX_ROWS):
            m = min(MAX_ROWS, n - lo)
            xs = buf["xs"][lo * nb:(lo + m) * nb]  # (n_blocks, the chunk's rows)
            views = (xq[lo:lo + m], xd[lo:lo + m], xs, xl[lo:lo + m])
            chunks.append(_Chunk(lo, m, tuple(v.ctypes.data for v in views)))
        return _Plan(chunks, tuple(buf[name].ctypes.data for name in ("xq", "xd", "xl", "xs")))


_SCRATCH = _Scratch()
_OUT_FIELD = 10  # a record's out pointer: the row kernel's 10th argument


class _Job:
    """A call's parallel_calls records (out pointers filled in per call from rel_out, their
    offsets in y) and where each thread's part ends, with both arrays' addresses."""

    def __init__(self, calls: np.ndarray, part_ends: np.ndarray):
        self.calls, self.part_ends = calls, part_ends
        self.rel_out = calls[:, _OUT_FIELD].copy()
        self.calls_at, self.ends_at = calls.ctypes.data, part_ends.ctypes.data


class PackedMatvec:
    """y = concat_i(x · W_iᵀ + b_i) for PackedWeights W_i of one ne0; x (n, ne0) → y (n, Σ rows)."""

    def __init__(self, weights: Sequence[PackedWeight], biases: Sequence[np.ndarray | None]):
        ne0 = {w.ne0 for w in weights}
        if len(ne0) != 1 or len(biases) != len(weights):
            raise ValueError(f"fused weights need one ne0 and a bias slot each, got ne0 {ne0}")
        self.ne0 = ne0.pop()
        self.weights = list(weights)  # keeps the blocks alive: the kernels get raw pointers
        self.row_starts = np.cumsum([0] + [w.rows for w in weights]).tolist()
        # per weight: layout, weight pointer, row bytes
        self._members = [(w.layout, w.records.ctypes.data, w.records.shape[1]) for w in weights]
        has_bias = any(b is not None for b in biases)
        self.bias = np.concatenate([np.zeros(w.rows, np.float32) if b is None else
                                    np.asarray(b, np.float32).reshape(w.rows)
                                    for w, b in zip(weights, biases)]) if has_bias else None
        # per weight, the address of the kernel of each x row count (compiled now, not in a
        # request; quant_packed's cache keeps them alive)
        self._kernels = [[parallel_calls.address(row_kernel(layout, n))
                          for n in range(1, MAX_ROWS + 1)] for layout, _, _ in self._members]
        # decode calls' records by (x rows, scratch generation, parts)
        self._decode_calls: dict[tuple[int, int, int], _Job] = {}
        self._quantize = quantize_kernel(self.ne0)

    @property
    def rows(self) -> int:
        return self.row_starts[-1]

    def __call__(self, x: np.ndarray) -> np.ndarray:
        if x.ndim != 2 or x.shape[1] != self.ne0 or x.dtype != np.float32 or \
                not x.flags.c_contiguous:
            x = np.ascontiguousarray(x, dtype=np.float32)
            if x.ndim != 2 or x.shape[1] != self.ne0:
                raise ValueError(f"x must be (n, {self.ne0}), got {x.shape}")
        y = np.empty((len(x), self.rows), np.float32)  # (n, Σ rows)
        x_at, y_at = x.ctypes.data, y.ctypes.data
        with _SCRATCH.lock:
            for lo in range(0, len(x), GROUP_ROWS):
                n = min(GROUP_ROWS, len(x) - lo)  # rows of this group
                plan = _SCRATCH.plan(n, self.ne0)
                self._quantize(x_at + 4 * lo * self.ne0, self.ne0, n, *plan.buffers, 0, 0, 0, 0)
                self._run(plan.chunks, n, y_at + 4 * lo * self.rows)
        if self.bias is not None:
            y += self.bias
        return y

    def _run(self, chunks: list[_Chunk], n: int, out: int) -> None:
        """out (n, Σ rows) = the quantized x rows · each weight, in one hand-off: the rows of
        the concatenation split between the threads, each running every chunk over its rows
        (its share of each weight stays in its core's cache from one chunk to the next)."""
        work = self.rows * self.ne0 * (n + 2 * len(chunks))
        n_parts = max(1, min(quant._num_threads(), work // _MIN_WORK_PER_PART))
        key = (n, _SCRATCH.generation, n_parts)
        job = self._decode_calls.get(key) if n <= MAX_ROWS else None
        if job is None:
            job = _Job(*self._call_records(chunks, n_parts))
            if n <= MAX_ROWS:
                self._decode_calls[key] = job
        np.add(job.rel_out, out, out=job.calls[:, _OUT_FIELD])
        parallel_calls.run_parts_at(job.calls_at, job.ends_at, len(job.part_ends))

    def _call_records(self, chunks: list[_Chunk], n_parts: int) -> tuple[np.ndarray, np.ndarray]:
        """parallel_calls' records of a call over n_parts row ranges of the concatenation (out
        pointers relative to y's start), and where each part's records end."""
        bounds = [self.rows * k // n_parts for k in range(n_parts + 1)]
        n_records, stride = self.ne0 // RECORD_ELEMENTS, self.rows
        starts, records, part_ends = self.row_starts, [], []
        for r0, r1 in zip(bounds, bounds[1:]):
            for i, (kernels, (_, w, row_bytes)) in enumerate(zip(self._kernels, self._members)):
                o = starts[i]
                a, b = max(r0, o), min(r1, starts[i + 1])
                chunk_out = 4 * o
                for c in chunks:
                    if a < b:
                        records.append((kernels[c.m - 1], w, row_bytes, *c.pointers, n_records,
                                        a - o, b - o, chunk_out, stride))
                    chunk_out += 4 * c.m * stride
            part_ends.append(len(records))
        calls = np.array(records, np.int64).reshape(-1, parallel_calls.CALL_FIELDS)
        return calls, np.array(part_ends, np.int64)

    def split(self, y: np.ndarray) -> list[np.ndarray]:
        """y (n, Σ rows) → each weight's (n, rows_i) view."""
        s = self.row_starts
        return [y[:, s[i]:s[i + 1]] for i in range(len(self.weights))]
