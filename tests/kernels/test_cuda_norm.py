"""CUDA RMSNorm variants vs float64 numpy."""

from __future__ import annotations

import numpy as np
import pytest
from numba import cuda

from sparkinfer_cli.kernels.cuda import norm


@pytest.mark.parametrize("width", [96, 100])  # 100: lanes past the row's end
def test_rms_norm_add_and_gate(width):
    rng = np.random.default_rng(0)
    x, r, z = (rng.standard_normal((3, width)).astype(np.float32) for _ in range(3))
    w = rng.uniform(0.5, 1.5, width).astype(np.float32)
    out = cuda.device_array_like(x)
    norm.rms_norm(cuda.to_device(x), cuda.to_device(w), out, 1e-6)
    np.testing.assert_allclose(out.copy_to_host(), norm.rms_norm_reference(x, w, 1e-6), rtol=1e-5)

    res = cuda.to_device(r)
    norm.add_rms_norm(cuda.to_device(x), res, cuda.to_device(w), out, 1e-6)
    np.testing.assert_allclose(res.copy_to_host(), x + r, rtol=1e-6)
    np.testing.assert_allclose(out.copy_to_host(), norm.rms_norm_reference(x + r, w, 1e-6),
                               rtol=1e-5)

    w_head = w[:width // 4].copy()  # per-head norm: 4 rows inside each token
    norm.rms_norm_silu_gate(cuda.to_device(x), cuda.to_device(z), cuda.to_device(w_head), out, 1e-6)
    ref = norm.rms_norm_reference(x, w_head, 1e-6) * z / (1 + np.exp(-z.astype(np.float64)))
    np.testing.assert_allclose(out.copy_to_host(), ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("rows, width", [(2, 64), (3, 64), (3, norm.WARP_ROW_MAX + 64)],
                         ids=["a warp a row", "spare warps", "a block a row"])
def test_add_rms_norm_with_fused_q8_quantization(rows, width):
    from sparkinfer_cli.kernels.cuda import quant_gemv as qg

    rng = np.random.default_rng(1)
    x, r = (rng.standard_normal((rows, width)).astype(np.float32) for _ in range(2))
    w = rng.uniform(0.5, 1.5, width).astype(np.float32)
    out, act = cuda.device_array_like(x), qg.QuantizedActivations(1, rows, width)
    norm.add_rms_norm(cuda.to_device(x), cuda.to_device(r), cuda.to_device(w), out, 1e-6, act=act)
    y = out.copy_to_host()
    np.testing.assert_allclose(y, norm.rms_norm_reference(x + r, w, 1e-6), rtol=1e-5)
    q, d, s = qg.quantize_q8_reference(y)  # the kernel's own float output, quantized in numpy
    np.testing.assert_array_equal(act.xq.copy_to_host().reshape(rows, -1), q)
    np.testing.assert_allclose(act.xd.copy_to_host(), d.reshape(-1), rtol=1e-6)
    np.testing.assert_allclose(act.xs.copy_to_host(), s.reshape(-1), rtol=1e-5, atol=1e-6)


def test_moe_combine_fused_into_the_next_pre_norm():
    from sparkinfer_cli.kernels.cuda import quant_gemv as qg

    rng = np.random.default_rng(2)
    rows, k, d = 2, 3, 64
    experts = rng.standard_normal((rows * k, d)).astype(np.float32)
    weights = rng.uniform(0, 1, (rows, k)).astype(np.float32)
    shared = rng.standard_normal((rows, d)).astype(np.float32)
    gate = np.array([0.3, -2.0], np.float32)
    h = rng.standard_normal((rows, d)).astype(np.float32)
    w = rng.uniform(0.5, 1.5, d).astype(np.float32)
    combined = h + np.einsum("tk,tkd->td", weights, experts.reshape(rows, k, d))
    for with_shared in (False, True):
        res, out = cuda.to_device(h), cuda.device_array_like(h)
        act = qg.QuantizedActivations(1, rows, d)
        extra = {"shared": cuda.to_device(shared), "shared_gate": cuda.to_device(gate)} \
            if with_shared else {}
        norm.moe_add_rms_norm(cuda.to_device(experts), cuda.to_device(weights), res,
                              cuda.to_device(w), out, 1e-6, act=act, **extra)
        ref_h = combined + (shared / (1 + np.exp(-gate[:, None].astype(np.float64)))
                            if with_shared else 0)
        np.testing.assert_allclose(res.copy_to_host(), ref_h, rtol=1e-5, atol=1e-6)
        y = out.copy_to_host()
        np.testing.assert_allclose(y, norm.rms_norm_reference(ref_h, w, 1e-6), rtol=1e-5)
        np.testing.assert_array_equal(act.xq.copy_to_host().reshape(rows, d),
                                      qg.quantize_q8_reference(y)[0])
