"""The fused attention input (q/k norm + RoPE + K/V store) vs the CPU ops in float64 numpy."""

from __future__ import annotations

import numpy as np
import pytest
from numba import cuda

from sparkinfer_cli.kernels.cpu import ops
from sparkinfer_cli.kernels.cuda import quant_gemv as qg
from sparkinfer_cli.kernels.cuda.attention_input import prepare_attention_input
from sparkinfer_cli.kernels.cuda.norm import rms_norm_reference


@pytest.mark.parametrize("style, with_norm, kv_dtype", [
    ("neox", True, np.float16), ("normal", False, np.float32), ("neox", False, np.float32)])
@pytest.mark.slow
def test_norm_rope_and_store_match_the_unfused_ops(style, with_norm, kv_dtype):
    rng = np.random.default_rng(8)
    n_tok, n_heads, n_kv, d, n_rot, eps = 3, 4, 2, 32, 16, 1e-6
    q = rng.standard_normal((n_tok, n_heads, d)).astype(np.float32)
    k, v = (rng.standard_normal((n_tok, n_kv, d)).astype(np.float32) for _ in range(2))
    wq, wk = (rng.uniform(0.5, 1.5, d).astype(np.float32) for _ in range(2))
    pos = np.array([0, 7, 300], np.int32)
    slots = np.array([5, 0, 2], np.int32)  # cache rows (block · block_size + offset)
    cache_shape = (3, 2, n_kv, d)  # (blocks, block_size, n_kv, d)
    k_cache, v_cache = (cuda.to_device(np.zeros(cache_shape, kv_dtype)) for _ in range(2))
    dq, dk = cuda.to_device(q), cuda.to_device(k)
    norms = (cuda.to_device(wq), cuda.to_device(wk)) if with_norm else (None, None)
    prepare_attention_input(dq, dk, cuda.to_device(v), *norms, eps, cuda.to_device(pos), n_rot,
                            1e6, k_cache, v_cache, cuda.to_device(slots), neox=style == "neox")
    qn = rms_norm_reference(q, wq, eps) if with_norm else q
    kn = rms_norm_reference(k, wk, eps) if with_norm else k
    ref_q, ref_k = (ops.rope(x.astype(np.float32), pos, n_rot, 1e6, style) for x in (qn, kn))
    np.testing.assert_allclose(dq.copy_to_host(), ref_q, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dk.copy_to_host(), ref_k, rtol=1e-5, atol=1e-5)
    tol = 1e-3 if kv_dtype == np.float16 else 1e-5
    flat_k = k_cache.copy_to_host().reshape(-1, n_kv, d)
    flat_v = v_cache.copy_to_host().reshape(-1, n_kv, d)
    np.testing.assert_allclose(flat_k[slots], ref_k, rtol=tol, atol=tol)
    np.testing.assert_allclose(flat_v[slots], v, rtol=tol, atol=tol)
    untouched = np.setdiff1d(np.arange(len(flat_k)), slots)
    assert not flat_k[untouched].any() and not flat_v[untouched].any()


def test_int8_cache_stores_q8_blocks_of_the_rotated_keys_and_values():
    rng = np.random.default_rng(9)
    n_tok, n_heads, n_kv, d, n_rot = 2, 2, 2, 64, 32
    q = rng.standard_normal((n_tok, n_heads, d)).astype(np.float32)
    k, v = (rng.standard_normal((n_tok, n_kv, d)).astype(np.float32) for _ in range(2))
    slots = np.array([3, 1], np.int32)
    caches = [cuda.to_device(np.zeros((2, 2, n_kv, d), np.int8)) for _ in range(2)]
    scales = [cuda.to_device(np.zeros((2, 2, n_kv, d // 32), np.float32)) for _ in range(2)]
    dk = cuda.to_device(k)
    prepare_attention_input(cuda.to_device(q), dk, cuda.to_device(v), None, None, 1e-6,
                            cuda.to_device(np.array([4, 9], np.int32)), n_rot, 1e4, *caches,
                            cuda.to_device(slots), scales=scales)
    for stored, scale, x in zip(caches, scales, (dk.copy_to_host(), v)):
        want_q, want_d, _ = qg.quantize_q8_reference(x)  # x: the float rows the kernel stored
        got_q = stored.copy_to_host().reshape(-1, n_kv, d)[slots]
        got_d = scale.copy_to_host().reshape(-1, n_kv, d // 32)[slots]
        np.testing.assert_array_equal(got_q, want_q)
        np.testing.assert_allclose(got_d, want_d, rtol=1e-6)
