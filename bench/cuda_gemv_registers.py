"""Registers per thread of the GEMV kernel per weight type (occupancy: 65,536 registers an SM).

    python bench/cuda_gemv_registers.py        (on a GPU: compiles one kernel per type)
"""
from __future__ import annotations

import sys

import numpy as np
from numba import cuda

from sparkinfer_cli.ggml_types import GGMLType
from sparkinfer_cli.kernels.cuda import quant_gemv as qg
from sparkinfer_cli.kernels.cuda.launch import to_device_bytes


def main() -> None:
    sys.path.insert(0, "tests/kernels")  # the tests' valid random GGUF blocks
    from test_cuda_quant_gemv import random_weights, upload_activations

    rng = np.random.default_rng(0)
    k, n_rows = 2048, 256
    for t in (GGMLType.Q4_K, GGMLType.Q5_K, GGMLType.Q6_K, GGMLType.Q8_0, GGMLType.F32):
        w = qg.DeviceQuantMatrix(to_device_bytes(random_weights(t, n_rows, k, rng)), t, k, n_rows)
        for n_cols, swiglu in ((1, False), (1, True), (8, False)):
            x = upload_activations(rng.standard_normal((1, n_cols, k)).astype(np.float32), w)
            y = cuda.device_array((1, n_cols, n_rows), np.float32)
            qg.gemv(w, x, y, up=w if swiglu else None)
            kernel = qg._gemv_kernel(t, n_cols, swiglu, 1)  # 256 rows: one row a lane
            regs = max(compiled.regs_per_thread for compiled in kernel.overloads.values())
            blocks = min(16, 65536 // (regs * 128 + 1))
            print(f"{t.name:6s} cols {n_cols} swiglu {swiglu!s:5s}: {regs:3d} registers, "
                  f"≤ {blocks} blocks of 128 threads an SM")


if __name__ == "__main__":
    main()
