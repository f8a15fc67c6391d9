"""Elementwise activations: SwiGLU (silu(gate)·up) and the sigmoid gate of gated attention."""

from __future__ import annotations

import math

import numpy as np
from numba import cuda, float32

from sparkinfer_cli.kernels.cuda.launch import cdiv, check_array

THREADS = 256


@cuda.jit(fastmath=True)
def _swiglu_kernel(gate, up, out, n):
    i = cuda.grid(1)
    if i < n:
        g = gate[i]
        out[i] = g / (float32(1.0) + math.exp(-g)) * up[i]


@cuda.jit(fastmath=True)
def _sigmoid_mul_kernel(x, gate, out, n):
    i = cuda.grid(1)
    if i < n:
        out[i] = x[i] / (float32(1.0) + math.exp(-gate[i]))


def _flat_same(*named):
    shape = named[0][1].shape
    for name, arr in named:
        check_array(name, arr, np.float32, shape)
    return [arr.reshape(arr.size) for _, arr in named]


def swiglu(gate, up, out, stream=0) -> None:
    """out = silu(gate) · up, elementwise over same-shaped float32 arrays."""
    g, u, o = _flat_same(("gate", gate), ("up", up), ("out", out))
    _swiglu_kernel[cdiv(g.size, THREADS), THREADS, stream](g, u, o, g.size)


def sigmoid_mul(x, gate, out, stream=0) -> None:
    """out = x · sigmoid(gate) (Qwen3-Next/3.5 gated attention output)."""
    a, g, o = _flat_same(("x", x), ("gate", gate), ("out", out))
    _sigmoid_mul_kernel[cdiv(a.size, THREADS), THREADS, stream](a, g, o, a.size)


def swiglu_reference(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    g = gate.astype(np.float64)
    return g / (1.0 + np.exp(-g)) * up
