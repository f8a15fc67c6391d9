"""CUDA NEOX RoPE (partial) and elementwise activations vs float64 numpy."""

from __future__ import annotations

import numpy as np
from numba import cuda

from sparkinfer_cli.kernels.cuda import activation, rope


def test_rope_neox_partial_rotates_first_n_rot_dims_only():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 3, 16)).astype(np.float32)  # (tokens, heads, head_dim)
    positions = np.array([5, 40000], np.int32)
    dev = cuda.to_device(x)
    rope.rope_neox(dev, cuda.to_device(positions), 8, 1e7)
    ref = rope.rope_neox_reference(x, positions, 8, 1e7)
    np.testing.assert_allclose(dev.copy_to_host(), ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(dev.copy_to_host()[..., 8:], x[..., 8:])


def test_swiglu_and_sigmoid_gate():
    rng = np.random.default_rng(2)
    g, u = (rng.standard_normal(200).astype(np.float32) * 4 for _ in range(2))
    out = cuda.device_array(200, np.float32)
    activation.swiglu(cuda.to_device(g), cuda.to_device(u), out)
    np.testing.assert_allclose(out.copy_to_host(), activation.swiglu_reference(g, u), rtol=1e-5,
                               atol=1e-6)
    activation.sigmoid_mul(cuda.to_device(u), cuda.to_device(g), out)
    np.testing.assert_allclose(out.copy_to_host(), u / (1 + np.exp(-g.astype(np.float64))),
                               rtol=1e-5, atol=1e-6)
