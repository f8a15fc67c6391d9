"""CUDA elementwise activations vs float64 numpy."""

from __future__ import annotations

import numpy as np
from numba import cuda

from sparkinfer_cli.kernels.cuda import activation


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


def test_sigmoid_gate_with_fused_q8_quantization():
    from sparkinfer_cli.kernels.cuda import quant_gemv as qg

    rng = np.random.default_rng(3)
    u, g = (rng.standard_normal((1, 2, 64)).astype(np.float32) for _ in range(2))
    out, act = cuda.device_array_like(u), qg.QuantizedActivations(1, 2, 64)
    activation.sigmoid_mul(cuda.to_device(u), cuda.to_device(g), out, act=act)
    y = out.copy_to_host()
    np.testing.assert_allclose(y, u / (1 + np.exp(-g.astype(np.float64))), rtol=1e-5, atol=1e-6)
    q, d, _ = qg.quantize_q8_reference(y)
    np.testing.assert_array_equal(act.xq.copy_to_host().reshape(y.shape), q)
    np.testing.assert_allclose(act.xd.copy_to_host(), d.reshape(-1), rtol=1e-6)
