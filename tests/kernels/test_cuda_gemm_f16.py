"""f16 prefill GEMM (cp.async stages) and its conversions vs numpy.

The weights' f16 copy is gguf.quants.dequantize's values rounded once to f16; the GEMM's sums of
f16 products in float32 are checked against float64 over the same f16 inputs (~1e-5 of Σ|x||w|).
Simulator: ≤ 2 blocks of 256 threads.
"""

from __future__ import annotations

import numpy as np
import pytest
from gguf.quants import dequantize
from numba import cuda
from test_cuda_quant_gemv import random_weights

from sparkinfer_cli.gguf.ggml_types import GGMLType
from sparkinfer_cli.kernels.cuda import gemm_f16
from sparkinfer_cli.kernels.cuda import quant_gemv as qg
from sparkinfer_cli.kernels.cuda.runtime.launch import to_device_bytes


def _weights(ggml_type: GGMLType, n_rows: int, k: int, rng):
    raw = random_weights(ggml_type, n_rows, k, rng)
    dev = qg.DeviceQuantMatrix(to_device_bytes(raw), ggml_type, k, n_rows)
    return dev, dequantize(raw, ggml_type).reshape(n_rows, k)


def _halves(words: np.ndarray, shape: tuple[int, int]) -> np.ndarray:
    return words.view(np.float16).reshape(shape)


@pytest.mark.parametrize("ggml_type", [GGMLType.Q8_0, GGMLType.Q4_K, GGMLType.Q6_K])
def test_dequantize_rounds_gguf_values_once_to_f16(ggml_type, rng):
    w, ref = _weights(ggml_type, 3, 256, rng)
    half = gemm_f16.dequantize(w)
    assert (half.n_rows, half.k) == (3, 256)
    got = _halves(half.words.copy_to_host(), (3, 256)).astype(np.float32)
    # the kernel computes scale·q + shift in float32 before rounding; gguf's order may differ
    # by one float32 rounding, which can move the f16 result by one unit in the last place
    ulp = np.spacing(np.abs(ref).astype(np.float16)).astype(np.float32)
    np.testing.assert_array_less(np.abs(got - ref.astype(np.float16).astype(np.float32)),
                                 1.01 * ulp + 1e-30)


def test_to_f16_packs_pairs_rounding_to_nearest(rng):
    x = (rng.standard_normal((3, 10)) * 100).astype(np.float32)
    out = cuda.device_array(15, np.uint32)
    gemm_f16.to_f16(cuda.to_device(x), out)
    np.testing.assert_array_equal(_halves(out.copy_to_host(), (3, 10)), x.astype(np.float16))
    with pytest.raises(ValueError, match="f16 pairs"):
        gemm_f16.to_f16(cuda.to_device(x), cuda.device_array(14, np.uint32))


def _run(n_rows, k, n_tok, rng, parts=None, bias=False):
    w, _ = _weights(GGMLType.Q8_0, n_rows, k, rng)
    half = gemm_f16.dequantize(w)
    w16 = _halves(half.words.copy_to_host(), (n_rows, k)).astype(np.float64)
    x = rng.standard_normal((n_tok, k)).astype(np.float32)
    xh = cuda.device_array(n_tok * k // 2, np.uint32)
    gemm_f16.to_f16(cuda.to_device(x), xh)
    x16 = x.astype(np.float16).astype(np.float64)
    b = rng.standard_normal(n_rows).astype(np.float32) if bias else None
    ys = [cuda.device_array((n_tok, n), np.float32) for n in (parts or (n_rows,))]
    gemm_f16.matmul(half, xh, ys, bias=None if b is None else cuda.to_device(b))
    got = np.concatenate([y.copy_to_host() for y in ys], axis=1)
    y = x16 @ w16.T + (0 if b is None else b)
    np.testing.assert_array_less(np.abs(got - y), 1e-5 * (np.abs(x16) @ np.abs(w16).T) + 1e-6)


def test_matmul_walks_more_steps_than_stages_over_two_token_tiles(rng):
    # 5 k steps through 4 stages (each buffer reused), 130 tokens: a second tile of 2 tokens;
    # 72 rows: one row block cut at 72 of 128; two output parts and a bias
    _run(72, 160, 130, rng, parts=(30, 42), bias=True)


def test_matmul_with_fewer_steps_than_stages(rng):
    # 2 k steps: the prologue leaves a stage empty; 140 rows: a second row block of 12
    _run(140, 64, 5, rng)


def test_matmul_rejects_what_it_does_not_take(rng):
    w, _ = _weights(GGMLType.Q8_0, 20, 64, rng)
    half = gemm_f16.dequantize(w)
    y = cuda.device_array((3, 20), np.float32)
    with pytest.raises(ValueError, match="whole rows"):
        gemm_f16.matmul(half, cuda.device_array(3 * 64 // 2 + 1, np.uint32), y)
    stacked = qg.DeviceQuantMatrix(w.data, GGMLType.Q8_0, 64, 10, 2)  # experts: not dense
    with pytest.raises(ValueError, match="no f16 copy"):
        gemm_f16.dequantize(stacked)


# ---------------------------------------------------------------- real shapes (H200)
@pytest.mark.gpu
@pytest.mark.parametrize("n_tok", [256, 2048])
@pytest.mark.parametrize("k, n_rows", [(2048, 12352), (4096, 2048)])  # Qwen3.6 GDN in / out
def test_matmul_real_shapes(k, n_rows, n_tok, rng):
    _run(n_rows, k, n_tok, rng, bias=True)
