"""RMSNorm on the GPU: plain, fused with the residual add, and gated by silu(z) (GDN output norm).

Rows are independent: one block per row of `d` elements. The same kernel serves per-head q/k norms
(rows = tokens × heads, d = head_dim) since the weight index is the position within the row.
"""

from __future__ import annotations

import math

import numpy as np
from numba import cuda, float32

from sparkinfer_cli.kernels.cuda.intrinsics import IS_SIMULATOR
from sparkinfer_cli.kernels.cuda.launch import check_array
from sparkinfer_cli.kernels.cuda.warp import block_sum, warp_max, warp_sum

THREADS = 32 if IS_SIMULATOR else 256  # kernels are blockDim-generic; the simulator is slow


@cuda.jit(fastmath=True)
def _rms_norm_kernel(x, residual, w, out, d, eps, mode, quantize, xq, xd, xs):
    # mode 0: out = norm(x)·w;  1: h = x + residual, residual ← h, out = norm(h)·w;
    # mode 2: out = norm(x)·w·silu(residual)  (residual holds the gate z).
    # quantize: also write out as int8 per 32 elements (quant_gemv's q8 activations); the second
    # loop then runs whole warps over rows of d % 32 == 0 so each warp owns one 32-block per pass.
    scratch = cuda.shared.array(33, float32)
    base = cuda.blockIdx.x * d
    partial = float32(0.0)
    for i in range(cuda.threadIdx.x, d, cuda.blockDim.x):
        v = x[base + i]
        if mode == 1:
            v += residual[base + i]
            residual[base + i] = v
        partial += v * v
    inv = float32(1.0) / math.sqrt(block_sum(partial, scratch) / float32(d) + eps)
    for start in range(0, d, cuda.blockDim.x):
        i = start + cuda.threadIdx.x
        y = float32(0.0)
        if i < d:
            v = residual[base + i] if mode == 1 else x[base + i]
            y = v * inv * w[i]
            if mode == 2:
                z = residual[base + i]
                y *= z / (float32(1.0) + math.exp(-z))
            out[base + i] = y
        if quantize and start + cuda.threadIdx.x // 32 * 32 < d:
            amax = warp_max(abs(y))
            scale = amax / float32(127.0)
            q = math.floor(y / scale + float32(0.5)) if amax > 0 else float32(0.0)
            total = warp_sum(q)
            xq[base + i] = q
            if cuda.threadIdx.x % 32 == 0:
                xd[(base + i) // 32] = scale
                xs[(base + i) // 32] = scale * total


def _launch(x, residual, w, out, eps: float, mode: int, stream, act=None) -> None:
    d = w.shape[0]
    check_array("w", w, np.float32)
    for name, arr in (("x", x), ("out", out), ("residual", residual)):
        check_array(name, arr, np.float32, x.shape)
    if x.size % d:
        raise ValueError(f"x of {x.size} elements is not a whole number of rows of {d}")
    if act is not None and (d % 32 or int(np.prod(act.shape)) != x.size):
        raise ValueError(f"fused quantization needs rows of 32·n and {x.size} activations")
    q = (act.xq, act.xd, act.xs) if act is not None else (x.reshape(x.size),) * 3
    _rms_norm_kernel[x.size // d, THREADS, stream](
        x.reshape(x.size), residual.reshape(x.size), w, out.reshape(x.size), d, float32(eps), mode,
        act is not None, *q)


def rms_norm(x, w, out, eps: float, stream=0, act=None) -> None:
    """out = x / sqrt(mean(x²) + eps) · w over rows of len(w) (act: as in add_rms_norm)."""
    _launch(x, x, w, out, eps, 0, stream, act)


def add_rms_norm(x, residual, w, out, eps: float, stream=0, act=None) -> None:
    """residual += x, then out = rms_norm(residual) (the pre-norm of the next sub-layer).

    act: a quant_gemv.QuantizedActivations of out's size, filled in the same pass (saves a launch).
    """
    _launch(x, residual, w, out, eps, 1, stream, act)


def rms_norm_silu_gate(x, z, w, out, eps: float, stream=0) -> None:
    """out = rms_norm(x)·w·silu(z), per row of len(w) (Gated DeltaNet output norm)."""
    _launch(x, z, w, out, eps, 2, stream)


def rms_norm_reference(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    rows = x.astype(np.float64).reshape(-1, w.shape[0])  # (rows, d)
    y = rows / np.sqrt((rows * rows).mean(axis=1, keepdims=True) + eps) * w
    return y.reshape(x.shape)
