"""Small glue kernel of the CUDA model: the row gather of the rows that produce logits."""

from __future__ import annotations

import numpy as np
from numba import cuda

from sparkinfer_cli.kernels.cuda.runtime.intrinsics import chain_start
from sparkinfer_cli.kernels.cuda.runtime.jit import kernel
from sparkinfer_cli.kernels.cuda.runtime.launch import cdiv, check_array

THREADS = 256


@kernel
def _gather_rows_kernel(x, rows, d, out):
    chain_start()
    i = cuda.grid(1)
    if i < rows.size * d:
        r = i // d
        out[i] = x[rows[r] * d + i - r * d]


def gather_rows(x, rows, out, stream=0) -> None:
    """out[i, :] = x[rows[i], :]; x (n, d) f32, rows int32 (m,), out (m, d)."""
    d = tuple(x.shape)[-1]
    check_array("rows", rows, np.int32)
    check_array("out", out, np.float32, (rows.size, d))
    _gather_rows_kernel[cdiv(out.size, THREADS), THREADS, stream](
        x.reshape(x.size), rows, d, out.reshape(out.size))
