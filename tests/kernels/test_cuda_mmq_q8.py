"""Int8 tensor-core GEMM (Q8_0 × q8 activations) vs float64 numpy on gguf.quants.dequantize'd
weights and the numpy q8 reference of the activations.

The kernel's sums of int8 products are exact; only the float32 scaling and adding of the Q8_0
blocks rounds, so the tight check is ~1e-5 of Σ|x||w|. Simulator: ≤ 4 blocks of 128 threads.
"""

from __future__ import annotations

import numpy as np
import pytest
from fragments import check_fragments
from gguf.quants import dequantize
from numba import cuda
from test_cuda_quant_gemv import random_weights

from sparkinfer_cli.gguf.ggml_types import GGMLType
from sparkinfer_cli.kernels.cuda import mmq_q8
from sparkinfer_cli.kernels.cuda import quant_gemv as qg
from sparkinfer_cli.kernels.cuda.runtime.intrinsics import (
    ldmatrix_x4_b8,
    ldmatrix_x4_b8_pairs,
    mma_s8_s32,
)
from sparkinfer_cli.kernels.cuda.runtime.launch import to_device_bytes


# ---------------------------------------------------------------- intrinsics
# the simulator's twins here, the hardware's instructions on the GPU (pytest -m gpu)
@pytest.mark.parametrize("where", ["simulator", pytest.param("gpu", marks=pytest.mark.gpu)])
def test_ldmatrix_b8_and_mma_s8_follow_the_ptx_fragment_layouts(where, rng):
    a = rng.integers(-128, 128, (16, 32)).astype(np.int8)
    b = rng.integers(-128, 128, (16, 32)).astype(np.int8)  # (n, k)
    c = check_fragments(ldmatrix_x4_b8, ldmatrix_x4_b8_pairs, mma_s8_s32, a, b)  # m16n8k32 .s8
    np.testing.assert_array_equal(c, a.astype(np.int64) @ b.astype(np.int64).T)


# ---------------------------------------------------------------- the GEMM
def _weights(n_rows: int, k: int, rng):
    raw = random_weights(GGMLType.Q8_0, n_rows, k, rng)
    dev = qg.DeviceQuantMatrix(to_device_bytes(raw), GGMLType.Q8_0, k, n_rows)
    return dev, dequantize(raw, GGMLType.Q8_0).reshape(n_rows, k).astype(np.float64)


def _activations(n_tok: int, k: int, rng):
    """(device q8 activations of n_tok tokens as (1, n_tok, k), their float64 values)."""
    x = rng.standard_normal((1, n_tok, k)).astype(np.float32)
    q, d, s = qg.quantize_q8_reference(x)
    act = qg.QuantizedActivations(1, n_tok, k)
    act.xq, act.xd, act.xs = (cuda.to_device(a.reshape(-1)) for a in (q, d, s))
    x_q8 = (q.reshape(n_tok, -1, 32).astype(np.float64) * d.reshape(n_tok, -1, 1))
    return act, x_q8.reshape(n_tok, k)


def _check(got, x, w, up=None, bias=None):
    """got (n, rows) vs x (n, k) @ w (rows, k)ᵀ [SwiGLU with up] [+ bias]."""
    y = x @ w.T
    scale = np.abs(x) @ np.abs(w).T  # (n, rows): Σ|x||w|, the error yardstick
    if up is not None:
        y = y / (1 + np.exp(-y)) * (x @ up.T)
        scale = scale * (1 + np.abs(x) @ np.abs(up).T)
    if bias is not None:
        y = y + bias
    np.testing.assert_array_less(np.abs(got - y), 2e-5 * scale + 1e-7)


def _run(n_rows, k, n_tok, rng, parts=None, bias=False, swiglu=False):
    w, w_ref = _weights(n_rows, k, rng)
    up, up_ref = _weights(n_rows, k, rng) if swiglu else (None, None)
    act, x = _activations(n_tok, k, rng)
    b = rng.standard_normal(n_rows).astype(np.float32) if bias else None
    ys = [cuda.device_array((n_tok, n), np.float32) for n in (parts or (n_rows,))]
    size = mmq_q8.partials_size(w, n_tok, swiglu)
    partials = cuda.device_array(size, np.float32) if size else None
    mmq_q8.matmul(w, act, ys, bias=None if b is None else cuda.to_device(b), up=up,
                  partials=partials)
    got = np.concatenate([y.copy_to_host() for y in ys], axis=1)  # (n_tok, n_rows)
    _check(got, x, w_ref, up=up_ref, bias=b)


@pytest.mark.slow  # a minute or more in the simulator on 2 cores
def test_matmul_whole_grid_writes_outputs_with_bias(rng, monkeypatch):
    # no split: 2 row blocks (the second cut at 6 rows), 37 of 64 tokens, 2 steps, 2 output parts
    monkeypatch.setattr(mmq_q8, "SPLIT_BELOW_BLOCKS", 1)
    assert mmq_q8.partials_size(_weights(70, 256, rng)[0], 37) == 0
    _run(70, 256, 37, rng, parts=(30, 40), bias=True)


def test_matmul_splits_k_over_a_small_grid(rng):
    # 1 row block, 3 steps in 3 ranges; a full 64-token tile
    w = _weights(20, 384, rng)[0]
    assert mmq_q8.k_splits(w, 64) == 3
    _run(20, 384, 64, rng, bias=True)


@pytest.mark.slow  # a minute or more in the simulator on 2 cores
def test_matmul_walks_prefill_tokens_in_tiles(rng, monkeypatch):
    # 2 row blocks × 3 token tiles (the last cut at 2 of 64 tokens), no split; then the same
    # product split in 2 k ranges: the partials hold every tile's tokens
    monkeypatch.setattr(mmq_q8, "SPLIT_BELOW_BLOCKS", 1)
    w = _weights(70, 256, rng)[0]
    assert mmq_q8.partials_size(w, 130) == 0
    _run(70, 256, 130, rng, parts=(30, 40), bias=True)
    monkeypatch.setattr(mmq_q8, "SPLIT_BELOW_BLOCKS", 8)
    monkeypatch.setattr(mmq_q8, "SPLIT_TARGET_BLOCKS", 12)
    assert mmq_q8.k_splits(w, 130) == 2
    _run(70, 256, 130, rng, bias=True)


def test_matmul_fused_swiglu(rng):
    # 32 output rows a block: 40 rows → 2 blocks, each in 2 k ranges
    _run(40, 256, 9, rng, swiglu=True)


def test_matmul_rejects_what_it_does_not_take(rng):
    w, _ = _weights(20, 256, rng)
    act, _ = _activations(8, 256, rng)
    y = cuda.device_array((8, 20), np.float32)
    with pytest.raises(ValueError, match="partials buffer"):
        mmq_q8.matmul(w, act, y)
    w_odd_k = qg.DeviceQuantMatrix(to_device_bytes(random_weights(GGMLType.Q8_0, 20, 96, rng)),
                                   GGMLType.Q8_0, 96, 20)  # k not a whole number of steps
    assert not mmq_q8.supports(w_odd_k, 8)
    w6 = qg.DeviceQuantMatrix(to_device_bytes(random_weights(GGMLType.Q6_K, 20, 256, rng)),
                              GGMLType.Q6_K, 256, 20)
    assert not mmq_q8.supports(w6, 8)
    with pytest.raises(ValueError, match="Q6_K"):
        mmq_q8.matmul(w6, act, y)


# ---------------------------------------------------------------- real shapes (H200)
@pytest.mark.gpu
@pytest.mark.parametrize("n_tok", [64, 300, 2048])  # a decode batch; prefill passes
@pytest.mark.parametrize("k, n_rows, swiglu", [
    (2048, 12352, False),  # Qwen3.6 GDN input projection (qkv, z, a, b): whole grid
    (4096, 2048, False),  # GDN output projection: k split at 64 tokens
    (2048, 512, True),  # the shared expert's gate/up
    (512, 2048, False),  # ... its down projection
])
def test_matmul_real_shapes(k, n_rows, swiglu, n_tok, rng):
    w, w_ref = _weights(n_rows, k, rng)
    up, up_ref = _weights(n_rows, k, rng) if swiglu else (None, None)
    act, x = _activations(n_tok, k, rng)
    y = cuda.device_array((n_tok, n_rows), np.float32)
    size = mmq_q8.partials_size(w, n_tok, swiglu)
    partials = cuda.device_array(size, np.float32) if size else None
    mmq_q8.matmul(w, act, y, up=up, partials=partials)
    rows = np.sort(rng.choice(n_rows, 256, replace=False))
    _check(y.copy_to_host()[:, rows], x, w_ref[rows], up=None if up is None else up_ref[rows])
