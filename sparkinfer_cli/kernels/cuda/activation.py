"""Elementwise activations: SwiGLU (silu(gate)·up) and the sigmoid gate of gated attention."""

from __future__ import annotations

import math

import numpy as np
from numba import cuda, float32

from sparkinfer_cli.kernels.cuda.quant_gemv import store_q8
from sparkinfer_cli.kernels.cuda.runtime.intrinsics import chain_start
from sparkinfer_cli.kernels.cuda.runtime.jit import kernel
from sparkinfer_cli.kernels.cuda.runtime.launch import cdiv, check_array

THREADS = 256


@kernel(fastmath=True)
def _swiglu_kernel(gate, up, out, n):
    chain_start()
    i = cuda.grid(1)
    if i < n:
        g = gate[i]
        out[i] = g / (float32(1.0) + math.exp(-g)) * up[i]


@kernel(fastmath=True)
def _sigmoid_mul_kernel(x, gate, out, n, quantize, xq, xd, xs):
    chain_start()
    # quantize: n % 32 == 0, so every warp holds one whole q8 block
    i = cuda.grid(1)
    if i < n:
        y = x[i] / (float32(1.0) + math.exp(-gate[i]))
        out[i] = y
        if quantize:
            store_q8(y, i, xq, xd, xs)


def _flat_same(*named):
    shape = named[0][1].shape
    for name, arr in named:
        check_array(name, arr, np.float32, shape)
    return [arr.reshape(arr.size) for _, arr in named]


def swiglu(gate, up, out, stream=0) -> None:
    """out = silu(gate) · up, elementwise over same-shaped float32 arrays."""
    g, u, o = _flat_same(("gate", gate), ("up", up), ("out", out))
    _swiglu_kernel[cdiv(g.size, THREADS), THREADS, stream](g, u, o, g.size)


def sigmoid_mul(x, gate, out, stream=0, act=None) -> None:
    """out = x · sigmoid(gate) (Qwen3-Next/3.5 gated attention output); act: a
    quant_gemv.QuantizedActivations of out's size, filled with out's q8 form in the same pass."""
    a, g, o = _flat_same(("x", x), ("gate", gate), ("out", out))
    if act is not None and (a.size % 32 or int(np.prod(act.shape)) != a.size):
        raise ValueError(f"fused quantization needs 32·n values and {a.size} activations")
    q = (act.xq, act.xd, act.xs) if act is not None else (o,) * 3
    _sigmoid_mul_kernel[cdiv(a.size, THREADS), THREADS, stream](a, g, o, a.size, act is not None,
                                                                *q)


def swiglu_reference(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    g = gate.astype(np.float64)
    return g / (1.0 + np.exp(-g)) * up
