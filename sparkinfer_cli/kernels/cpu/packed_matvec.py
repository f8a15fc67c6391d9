"""A decode step (n tokens, one per sequence) through several packed weights that read the same
input, as one call.

q/k/v and gate/up share their input: x is quantized once, and one thread-pool dispatch splits
the rows of all of them between the threads. Each weight row is multiplied with up to MAX_ROWS x
rows in one pass (quant_packed's kernel), so a step of n sequences reads the weights once per
MAX_ROWS, not n times. Everything a call needs but x and y (pointers to the weights and to a
scratch for the quantized x, the concatenated bias) is prepared at load, so a call costs a few
microseconds of Python besides the kernels.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import numpy as np

from sparkinfer_cli.kernels.cpu.quant import parallel_ranges
from sparkinfer_cli.kernels.cpu.quant_packed import (
    MAX_ROWS,
    RECORD_ELEMENTS,
    PackedWeight,
    quantize_x,
    row_kernel,
)
from sparkinfer_cli.kernels.cpu.quant_q8 import Q8_BLOCK

# A call costs about weights·(n + 2) units of ~17 ps on one core (Qwen2.5-0.5B's Q6_K ffn_down:
# 0.24 ms for 1 row, 0.76 ms for 8), and handing rows to a second thread ~0.1 ms on the 2-vCPU VM we
# measured on (its idle vCPU halts): split when each thread gets about that much more.
_MIN_WORK_PER_THREAD = 6 << 20


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
        nb = self.ne0 // Q8_BLOCK
        # scratch for up to MAX_ROWS quantized x rows, shaped per row count (_plan)
        self._xq, self._xq_rows = np.empty((2, MAX_ROWS * self.ne0), np.int8)  # (n, ne0)
        self._xd = np.empty(MAX_ROWS * self.ne0 // 8, np.float32)  # (n, n_records, lanes)
        self._xl = np.empty(MAX_ROWS * self.ne0 // 8, np.int32)  # (n, n_records, lanes)
        self._xs, self._xd_rows = np.empty((2, MAX_ROWS * nb), np.float32)  # (n_blocks, n)
        self._x_ptrs = tuple(a.ctypes.data for a in (self._xq, self._xd, self._xs, self._xl))
        self._plans: dict[int, tuple[tuple[np.ndarray, ...], list[tuple]]] = {}
        self._lock = threading.Lock()  # one call at a time uses the scratch
        for n in range(1, MAX_ROWS + 1):  # compile every row count's kernel now, not in a request
            self._plan(n)

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
        out = y.ctypes.data
        with self._lock:
            for lo in range(0, len(x), MAX_ROWS):
                chunk = x[lo:lo + MAX_ROWS]  # (n ≤ MAX_ROWS, ne0)
                scratch, members = self._plan(len(chunk))
                quantize_x(chunk, *scratch)
                self._run(members, len(chunk), out + 4 * lo * self.rows)
        if self.bias is not None:
            y += self.bias
        return y

    def _plan(self, n: int) -> tuple[tuple[np.ndarray, ...], list[tuple]]:
        """For n x rows: the scratch as quantize_x's arguments, and per weight its kernel,
        pointer and row bytes."""
        if n not in self._plans:
            nb, nr = self.ne0 // Q8_BLOCK, self.ne0 // RECORD_ELEMENTS
            scratch = (self._xq[:n * self.ne0].reshape(n, self.ne0),
                       self._xd[:n * nr * 8].reshape(n, nr, 8), self._xs[:nb * n].reshape(nb, n),
                       self._xl[:n * nr * 8].reshape(n, nr, 8),
                       self._xq_rows[:n * self.ne0].reshape(n, self.ne0),
                       self._xd_rows[:n * nb].reshape(n, nb))
            self._plans[n] = scratch, [(row_kernel(layout, n), w, row_bytes)
                                       for layout, w, row_bytes in self._members]
        return self._plans[n]

    def _run(self, members: list[tuple], n: int, out: int) -> None:
        """out (n, Σ rows) = the quantized x rows · each weight, threads splitting the rows."""
        starts, n_records, stride = self.row_starts, self.ne0 // RECORD_ELEMENTS, self.rows
        x_ptrs = self._x_ptrs

        def rows(r0: int, r1: int) -> None:  # rows r0..r1 of the concatenation
            for i, (kernel, w, row_bytes) in enumerate(members):
                a, b = max(r0, starts[i]), min(r1, starts[i + 1])
                if a < b:
                    o = starts[i]
                    kernel(w, row_bytes, *x_ptrs, n_records, a - o, b - o, out + 4 * o, stride)

        parallel_ranges(rows, self.rows, self.rows * self.ne0 * (n + 2) // _MIN_WORK_PER_THREAD)

    def split(self, y: np.ndarray) -> list[np.ndarray]:
        """y (n, Σ rows) → each weight's (n, rows_i) view."""
        s = self.row_starts
        return [y[:, s[i]:s[i + 1]] for i in range(len(self.weights))]
