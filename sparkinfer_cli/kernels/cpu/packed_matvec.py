"""One decode step (T = 1) of several packed weights that read the same input, as one call.

q/k/v and gate/up share their input: x is quantized once, and one thread-pool dispatch splits
the rows of all of them between the threads. Everything a call needs but x and y (kernels,
pointers to the weights and to a scratch for the quantized x, the concatenated bias) is prepared
at load, so a call costs a few microseconds of Python besides the kernels.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import numpy as np

from sparkinfer_cli.kernels.cpu.quant import _parallel_rows
from sparkinfer_cli.kernels.cpu.quant_packed import (
    RECORD_ELEMENTS,
    PackedWeight,
    quantize_with_lane_sums,
    row_kernel,
)
from sparkinfer_cli.kernels.cpu.quant_q8 import Q8_BLOCK


class PackedMatvec:
    """y = concat_i(W_i · x + b_i) for PackedWeights W_i of one ne0; x (1, ne0) → y (1, Σ rows)."""

    def __init__(self, weights: Sequence[PackedWeight], biases: Sequence[np.ndarray | None]):
        ne0 = {w.ne0 for w in weights}
        if len(ne0) != 1 or len(biases) != len(weights):
            raise ValueError(f"fused weights need one ne0 and a bias slot each, got ne0 {ne0}")
        self.ne0 = ne0.pop()
        self.weights = list(weights)  # keeps the blocks alive: the kernels get raw pointers
        self.row_starts = np.cumsum([0] + [w.rows for w in weights]).tolist()
        # per weight: kernel, weight pointer, row bytes, records per row
        self._members = [(row_kernel(w.layout), w.records.ctypes.data, w.records.shape[1],
                          self.ne0 // RECORD_ELEMENTS) for w in weights]
        has_bias = any(b is not None for b in biases)
        self.bias = np.concatenate([np.zeros(w.rows, np.float32) if b is None else
                                    np.asarray(b, np.float32).reshape(w.rows)
                                    for w, b in zip(weights, biases)]) if has_bias else None
        nb = self.ne0 // Q8_BLOCK
        self._xq = np.empty((1, self.ne0), np.int8)  # (1, ne0): scratch for the quantized x
        xds = np.empty((2, 1, nb), np.float32)  # (xd | xs, 1, n_blocks)
        self._xd, self._xs = xds[0], xds[1]
        self._xl = np.empty((nb, 8), np.int32)  # (n_blocks, lanes)
        self._x_ptrs = (self._xq.ctypes.data, xds.ctypes.data, xds.ctypes.data + 4 * nb,
                        self._xl.ctypes.data)
        self._lock = threading.Lock()  # one call at a time uses the scratch

    @property
    def rows(self) -> int:
        return self.row_starts[-1]

    def __call__(self, x: np.ndarray) -> np.ndarray:
        if x.shape != (1, self.ne0) or x.dtype != np.float32 or not x.flags.c_contiguous:
            x = np.ascontiguousarray(x, dtype=np.float32)
            if x.shape != (1, self.ne0):
                raise ValueError(f"x must be (1, {self.ne0}), got {x.shape}")
        y = np.empty((1, self.rows), np.float32)  # (1, Σ rows)
        with self._lock:
            quantize_with_lane_sums(x, self._xq, self._xd, self._xs, self._xl)
            self._run(*self._x_ptrs, y.ctypes.data)
        if self.bias is not None:
            y += self.bias
        return y

    def _run(self, xq: int, xd: int, xs: int, xl: int, out: int) -> None:
        starts, members = self.row_starts, self._members

        def rows(r0: int, r1: int) -> None:  # rows r0..r1 of the concatenation
            for i, (kernel, w, row_bytes, n_records) in enumerate(members):
                a, b = max(r0, starts[i]), min(r1, starts[i + 1])
                if a < b:
                    o = starts[i]
                    kernel(w, row_bytes, xq, xd, xs, xl, n_records, a - o, b - o, out + 4 * o)

        _parallel_rows(rows, self.rows, self.ne0)

    def split(self, y: np.ndarray) -> list[np.ndarray]:
        """y (1, Σ rows) → each weight's (1, rows_i) view."""
        s = self.row_starts
        return [y[:, s[i]:s[i + 1]] for i in range(len(self.weights))]
