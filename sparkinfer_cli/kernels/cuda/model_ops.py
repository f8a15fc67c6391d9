"""Small glue kernels of the CUDA model: row gather (logit rows) and per-row bias add."""

from __future__ import annotations

import numpy as np
from numba import cuda

from sparkinfer_cli.kernels.cuda.launch import cdiv, check_array

THREADS = 256


@cuda.jit
def _gather_rows_kernel(x, rows, d, out):
    i = cuda.grid(1)
    if i < rows.size * d:
        r = i // d
        out[i] = x[rows[r] * d + i - r * d]


@cuda.jit
def _add_bias_kernel(y, bias, d):
    i = cuda.grid(1)
    if i < y.size:
        y[i] += bias[i % d]


def gather_rows(x, rows, out, stream=0) -> None:
    """out[i, :] = x[rows[i], :]; x (n, d) f32, rows int32 (m,), out (m, d)."""
    d = tuple(x.shape)[-1]
    check_array("rows", rows, np.int32)
    check_array("out", out, np.float32, (rows.size, d))
    _gather_rows_kernel[cdiv(out.size, THREADS), THREADS, stream](
        x.reshape(x.size), rows, d, out.reshape(out.size))


def add_bias(y, bias, stream=0) -> None:
    """y (..., d) += bias (d,) in place."""
    check_array("bias", bias, np.float32, (tuple(y.shape)[-1],))
    _add_bias_kernel[cdiv(y.size, THREADS), THREADS, stream](y.reshape(y.size), bias, bias.size)
