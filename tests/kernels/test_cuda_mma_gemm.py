"""Tensor-core prefill GEMM vs float64 numpy on gguf.quants.dequantize'd weights.

Simulator: tiny shapes (a launch is ≤ 5 blocks of 256 threads). The kernel multiplies f16 values,
so the tight check rounds W and x to f16 first; the loose check compares with the exact product.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import numpy as np
import pytest
from fragments import check_fragments
from gguf.quants import dequantize
from numba import cuda
from test_cuda_quant_gemv import random_weights

from sparkinfer_cli.gguf.ggml_types import GGMLType, row_bytes
from sparkinfer_cli.kernels.cuda import fragment_gemm
from sparkinfer_cli.kernels.cuda import mma_gemm as mg
from sparkinfer_cli.kernels.cuda.expert_route import ExpertRoute, route_experts
from sparkinfer_cli.kernels.cuda.quant_gemv import DeviceQuantMatrix
from sparkinfer_cli.kernels.cuda.runtime.intrinsics import (
    ldmatrix_x4,
    ldmatrix_x4_pairs,
    mma_f16_f32,
    pack_f16x2,
)
from sparkinfer_cli.kernels.cuda.runtime.launch import to_device_bytes


# ---------------------------------------------------------------- intrinsics
@cuda.jit
def _pack_kernel(lo, hi, out):
    i = cuda.grid(1)
    if i < out.size:
        out[i] = pack_f16x2(lo[i], hi[i])


# the simulator's twins here, the hardware's instructions on the GPU (pytest -m gpu)
@pytest.mark.parametrize("where", ["simulator", pytest.param("gpu", marks=pytest.mark.gpu)])
def test_ldmatrix_and_mma_follow_the_ptx_fragment_layouts(where, rng):
    a = rng.standard_normal((16, 16)).astype(np.float16)
    b = rng.standard_normal((16, 16)).astype(np.float16)  # (n, k)
    c = check_fragments(ldmatrix_x4, ldmatrix_x4_pairs, mma_f16_f32, a, b)  # m16n8k16 .f16
    np.testing.assert_allclose(c, a.astype(np.float64) @ b.astype(np.float64).T, rtol=1e-5,
                               atol=1e-5)


def test_pack_f16x2_rounds_like_numpy(rng):
    edges = [65504.0, 65520.0, -1e6, 6e-8, 0.0, -0.0, 1.0 + 2 ** -11, 1.0 + 3 * 2 ** -11]  # ties
    vals = np.concatenate([rng.standard_normal(60) * 10.0 ** rng.integers(-6, 5, 60), edges])
    vals = vals.astype(np.float32)
    lo, hi = vals, vals[::-1].copy()
    out = np.zeros(vals.size, np.uint32)
    _pack_kernel[1, 128](lo, hi, out)
    with np.errstate(over="ignore"):
        expect = np.stack([lo, hi], axis=1).astype(np.float16).view(np.uint32).reshape(-1)
    np.testing.assert_array_equal(out, expect)


# ---------------------------------------------------------------- dequantized pieces
@functools.cache
def _pieces_kernel(ggml_type: GGMLType):
    piece = mg._PIECES[ggml_type]

    @cuda.jit
    def pieces(w, row_bytes_, k, out):
        # out (n_rows, k / 2) u32: thread i dequantizes the i-th 16-element piece
        i = cuda.grid(1)
        per_row = k // 16
        if i < out.shape[0] * per_row:
            row, kk = i // per_row, (i % per_row) * 16
            q = piece(w, row * row_bytes_, kk)
            for j in range(8):
                out[row, kk // 2 + j] = q[j]
    return pieces


@pytest.mark.parametrize("ggml_type", sorted(mg.SUPPORTED_TYPES), ids=lambda t: GGMLType(t).name)
def test_pieces_match_gguf_dequantize(ggml_type, rng):
    k, n_rows = 256, 2
    raw = random_weights(ggml_type, n_rows, k, rng)
    out = np.zeros((n_rows, k // 2), np.uint32)
    _pieces_kernel(ggml_type)[1, 32](to_device_bytes(raw), row_bytes(ggml_type, k), k, out)
    ref = dequantize(raw, ggml_type).reshape(n_rows, k)
    got = out.view(np.float16).astype(np.float32)
    # f16 of the f32 value: half an f16 ulp, plus one more where f32 rounding decides the f16 tie
    np.testing.assert_allclose(got, ref, rtol=2 ** -10, atol=2 ** -24)


# ---------------------------------------------------------------- GEMM
def _weights(ggml_type, n_mats, n_rows, k, rng):
    raw = random_weights(ggml_type, n_mats * n_rows, k, rng)
    dev = DeviceQuantMatrix(to_device_bytes(raw), ggml_type, k, n_rows, n_mats)
    return dev, dequantize(raw, ggml_type).reshape(n_mats, n_rows, k).astype(np.float64)


def _f16(a: np.ndarray) -> np.ndarray:
    return a.astype(np.float16).astype(np.float64)


def _check(got, x, w, up=None, bias=None):
    """got (n, rows) vs x (n, k) @ w (rows, k)ᵀ [SwiGLU with up] [+ bias], tight on f16 inputs."""
    def product(xx, ww, uu):
        y = xx @ ww.T
        if uu is not None:
            y = y / (1 + np.exp(-y)) * (xx @ uu.T)
        return y if bias is None else y + bias

    scale = np.abs(x) @ np.abs(w).T  # (n, rows): Σ|x||w|, the error yardstick
    if up is not None:
        scale = scale * (1 + np.abs(x) @ np.abs(up).T)
    tight = product(_f16(x), _f16(w), None if up is None else _f16(up))
    np.testing.assert_array_less(np.abs(got - tight), 5e-4 * scale + 1e-6)
    np.testing.assert_array_less(np.abs(got - product(x, w, up)), 5e-3 * scale + 1e-5)


@pytest.mark.parametrize("ggml_type, n_tok, n_rows", [
    (GGMLType.Q4_K, 70, 150),  # 128-token tile cut at 70, second row block cut at 22
    (GGMLType.Q6_K, 9, 40),  # 64-token tile
    (GGMLType.F32, 64, 128),  # exact tiles
])
@pytest.mark.slow
def test_matmul_matches_dequantized_reference(ggml_type, n_tok, n_rows, rng):
    k = 256
    w, w_ref = _weights(ggml_type, 1, n_rows, k, rng)
    x = rng.standard_normal((n_tok, k)).astype(np.float32)
    y = cuda.device_array((n_tok, n_rows), np.float32)
    mg.matmul(w, cuda.to_device(x), y)
    _check(y.copy_to_host(), x.astype(np.float64), w_ref[0])


def test_matmul_splits_rows_over_outputs_and_adds_bias(rng):
    k, parts, n_tok = 64, (50, 30, 20), 20
    w, w_ref = _weights(GGMLType.Q8_0, 1, sum(parts), k, rng)
    bias = rng.standard_normal(sum(parts)).astype(np.float32)
    x = rng.standard_normal((n_tok, k)).astype(np.float32)
    ys = [cuda.device_array((n_tok, n), np.float32) for n in parts]
    mg.matmul(w, cuda.to_device(x), ys, bias=cuda.to_device(bias))
    got = np.concatenate([y.copy_to_host() for y in ys], axis=1)  # (n_tok, Σ parts)
    _check(got, x.astype(np.float64), w_ref[0], bias=bias)
    with pytest.raises(ValueError, match="hold 80 rows"):
        mg.matmul(w, cuda.to_device(x), ys[:2])


@pytest.mark.slow
def test_matmul_fused_swiglu_over_two_row_blocks(rng):
    k, n_rows, n_tok = 64, 70, 70  # 64 output rows per block → 2 blocks; a 128-token tile
    gate, gate_ref = _weights(GGMLType.Q5_0, 1, n_rows, k, rng)
    up, up_ref = _weights(GGMLType.Q5_0, 1, n_rows, k, rng)
    x = rng.standard_normal((n_tok, k)).astype(np.float32)
    y = cuda.device_array((n_tok, n_rows), np.float32)
    mg.matmul(gate, cuda.to_device(x), y, up=up)
    _check(y.copy_to_host(), x.astype(np.float64), gate_ref[0], up=up_ref[0])


@pytest.mark.parametrize("swiglu", [False, True])
@pytest.mark.slow
def test_matmul_splits_k_when_the_grid_is_small(swiglu, rng):
    # 13 k steps in 3 ranges of 4, 4 and 5 (MIN_SPLIT_STEPS 4); rows in 2 output parts + bias
    k, parts, n_tok = 13 * mg.BK, (40, 30), 9
    n_rows = sum(parts)
    w, w_ref = _weights(GGMLType.Q8_0, 1, n_rows, k, rng)
    up, up_ref = _weights(GGMLType.Q8_0, 1, n_rows, k, rng) if swiglu else (None, None)
    assert mg.k_splits(w, n_tok, swiglu) == 3
    bias = rng.standard_normal(n_rows).astype(np.float32)
    x = rng.standard_normal((n_tok, k)).astype(np.float32)
    ys = [cuda.device_array((n_tok, n), np.float32) for n in parts]
    partials = cuda.device_array(mg.partials_size(w, n_tok, swiglu), np.float32)
    mg.matmul(w, cuda.to_device(x), ys, bias=cuda.to_device(bias), up=up, partials=partials)
    got = np.concatenate([y.copy_to_host() for y in ys], axis=1)  # (n_tok, n_rows)
    _check(got, x.astype(np.float64), w_ref[0], up=None if up is None else up_ref[0], bias=bias)
    with pytest.raises(ValueError, match="split-K needs"):
        mg.matmul(w, cuda.to_device(x), ys, up=up, partials=partials[:partials.size - 1])


def test_k_splits_fill_the_gpu_only_for_small_grids():
    def matrix(n_rows, k, ggml_type=GGMLType.Q8_0):  # k_splits reads shape and type only
        return SimpleNamespace(n_rows=n_rows, k=k, ggml_type=ggml_type)

    # a 4096-token prefill of a 4096-row matrix: 32 × 32 blocks already fill the GPU
    assert mg.k_splits(matrix(4096, 2048), 4096) == 1
    assert mg.partials_size(matrix(4096, 2048), 4096) == 0
    # 64 tokens × 12,352 rows (a GDN input projection): 97 blocks, faster whole on the H200
    assert mg.k_splits(matrix(12352, 2048), 64) == 1
    # 64 tokens × 2,048 rows, k 4096 (an output projection): 16 blocks → 16 ranges
    assert mg.k_splits(matrix(2048, 4096), 64) == 16
    assert mg.partials_size(matrix(2048, 4096), 64) == 16 * 64 * 2048
    # 4,096 rows: 32 blocks → 8 ranges; SwiGLU stages 64 output rows a block: 64 blocks, whole
    assert mg.k_splits(matrix(4096, 2048), 64) == 8
    assert mg.k_splits(matrix(4096, 2048), 64, swiglu=True) == 1
    # k of 8 steps: at most 2 ranges of MIN_SPLIT_STEPS
    assert mg.k_splits(matrix(64, 256), 64, swiglu=True) == 2
    # the fragment kernel's 64-token tiles: 200 tokens of a 1,024-row Q4_K matrix are 8 × 4
    # blocks → 8 ranges; Q8_0's 128-token tiles 8 × 2 → 16
    assert mg.k_splits(matrix(1024, 2048, GGMLType.Q4_K), 200) == 8
    assert mg.k_splits(matrix(1024, 2048), 200) == 16


def test_matmul_rejects_types_without_a_dequantizer_and_partial_k_steps():
    w = DeviceQuantMatrix(to_device_bytes(np.zeros(136, np.uint8)), GGMLType.IQ4_XS, 256, 1)
    with pytest.raises(ValueError, match="IQ4_XS"):
        mg.matmul(w, cuda.to_device(np.zeros((1, 256), np.float32)),
                  cuda.device_array((1, 1), np.float32))
    q4k = DeviceQuantMatrix(to_device_bytes(np.zeros(144, np.uint8)), GGMLType.Q4_K, 256, 1)
    f32_k40 = DeviceQuantMatrix(to_device_bytes(np.zeros(160, np.uint8)), GGMLType.F32, 40, 1)
    assert not mg.supports(w) and mg.supports(q4k) and not mg.supports(f32_k40)
    with pytest.raises(ValueError, match="k % 32"):
        mg.matmul(f32_k40, cuda.to_device(np.zeros((1, 40), np.float32)),
                  cuda.device_array((1, 1), np.float32))


# ---------------------------------------------------------------- grouped (MoE) GEMM
def _run_grouped(ggml_type, n_expert, n_rows, k, slot_expert, slot_x, n_x, tile, swiglu, rng):
    gate, gate_ref = _weights(ggml_type, n_expert, n_rows, k, rng)
    up, up_ref = _weights(ggml_type, n_expert, n_rows, k, rng) if swiglu else (None, None)
    x = rng.standard_normal((n_x, k)).astype(np.float32)
    n_slots = slot_expert.size
    route = ExpertRoute(n_expert, n_slots, tile)
    route_experts(cuda.to_device(slot_expert.astype(np.int32)), n_slots, route)
    y = cuda.device_array((n_slots, n_rows), np.float32)
    mg.grouped_matmul(gate, cuda.to_device(x), y, route, cuda.to_device(slot_x.astype(np.int32)),
                      up=up)
    return y.copy_to_host(), x.astype(np.float64), gate_ref, up_ref


@pytest.mark.parametrize("tile, k", [(64, 64), (16, 128), (32, 64)])
@pytest.mark.slow
def test_grouped_matmul_routes_slots_to_their_expert(tile, k, rng):
    # expert 0: no slots, expert 1: 100 slots (several tiles), expert 2: 30 slots; k of 4 / 2
    # steps: staged 4 / 2 at a time
    slot_expert = rng.permutation(np.repeat([1, 2], [100, 30]))
    slot_x = rng.integers(0, 50, slot_expert.size)
    got, x, w_ref, _ = _run_grouped(GGMLType.Q8_0, 3, 20, k, slot_expert, slot_x, 50, tile,
                                    False, rng)
    for e in (1, 2):
        slots = np.flatnonzero(slot_expert == e)
        _check(got[slots], x[slot_x[slots]], w_ref[e])


@pytest.mark.parametrize("tile", [16, 32, 64])
def test_grouped_matmul_fused_swiglu(tile, rng):
    # tiles of ≤ 32 tokens pair gate and up rows within one m16 tile
    slot_expert = rng.integers(0, 2, 40)
    slot_x = rng.integers(0, 20, slot_expert.size)
    got, x, gate_ref, up_ref = _run_grouped(GGMLType.Q4_0, 2, 24, 64, slot_expert, slot_x, 20,
                                            tile, True, rng)
    for e in (0, 1):
        slots = np.flatnonzero(slot_expert == e)
        _check(got[slots], x[slot_x[slots]], gate_ref[e], up=up_ref[e])


# ---------------------------------------------------------------- real shapes (H200)
@pytest.mark.gpu
@pytest.mark.parametrize("ggml_type, n_tok, k, n_rows", [
    (GGMLType.Q4_K, 4096, 2048, 4096),
    (GGMLType.Q5_K, 4096, 2048, 512),
    (GGMLType.Q6_K, 4096, 2048, 512),
    (GGMLType.Q8_0, 4096, 2048, 512),
    (GGMLType.F16, 1000, 2048, 512),
])
def test_matmul_real_shapes(ggml_type, n_tok, k, n_rows, rng):
    w, w_ref = _weights(ggml_type, 1, n_rows, k, rng)
    x = rng.standard_normal((n_tok, k)).astype(np.float32)
    y = cuda.device_array((n_tok, n_rows), np.float32)
    mg.matmul(w, cuda.to_device(x), y)
    toks = np.sort(rng.choice(n_tok, 256, replace=False))
    rows = np.sort(rng.choice(n_rows, 256, replace=False))
    got = y.copy_to_host()[np.ix_(toks, rows)]
    _check(got, x[toks].astype(np.float64), w_ref[0][rows])


@pytest.mark.gpu
@pytest.mark.parametrize("ggml_type, k, n_rows, swiglu", [
    (GGMLType.Q8_0, 2048, 4096, False),  # a 4096-row projection, 64 decode rows: 8 ranges
    (GGMLType.Q6_K, 4096, 2048, False),  # a GDN output projection: 16 ranges
    (GGMLType.Q4_K, 2048, 512, True),  # the shared expert's gate/up
])
def test_matmul_split_k_real_shapes(ggml_type, k, n_rows, swiglu, rng):
    n_tok = 64
    w, w_ref = _weights(ggml_type, 1, n_rows, k, rng)
    up, up_ref = _weights(ggml_type, 1, n_rows, k, rng) if swiglu else (None, None)
    assert mg.k_splits(w, n_tok, swiglu) > 1
    x = rng.standard_normal((n_tok, k)).astype(np.float32)
    y = cuda.device_array((n_tok, n_rows), np.float32)
    partials = cuda.device_array(mg.partials_size(w, n_tok, swiglu), np.float32)
    mg.matmul(w, cuda.to_device(x), y, up=up, partials=partials)
    rows = np.sort(rng.choice(n_rows, 256, replace=False))
    _check(y.copy_to_host()[:, rows], x.astype(np.float64), w_ref[0][rows],
           up=None if up is None else up_ref[0][rows])


def test_expert_tile_holds_the_mean_share_of_an_expert():
    # Qwen3.6-35B-A3B: 256 experts, top-8; staged tiles (≤ 32) hold twice the mean share
    assert mg.expert_tile(64 * 8, 256) == 16  # 2 slots an expert
    assert mg.expert_tile(256 * 8, 256) == 16  # 8
    assert mg.expert_tile(257 * 8, 256) == 32
    assert mg.expert_tile(1024 * 8, 256) == 64  # 32
    assert mg.expert_tile(2048 * 8, 256) == 64  # 64
    assert mg.expert_tile(2049 * 8, 256) == 128
    assert mg.expert_tile(8192 * 8, 256) == 128  # the largest tile
    assert mg.expert_tile(4096 * 8, 128) == 128
    # gate weights the fragment GEMM takes: its largest tile (a 128-token one spills)
    q4k = SimpleNamespace(ggml_type=GGMLType.Q4_K, k=2048)
    assert mg.expert_tile(8192 * 8, 256, q4k) == 64
    assert mg.expert_tile(64 * 8, 256, q4k) == 16


@pytest.mark.gpu
@pytest.mark.parametrize("swiglu, n_tok, tile", [(False, 4096, 128), (True, 4096, 128),
                                                 (True, 256, 16), (False, 512, 32)])
def test_grouped_matmul_real_shapes(swiglu, n_tok, tile, rng):
    # Qwen3.6-35B-A3B expert gate/up: n_tok tokens × top-8 over 256 experts, k 2048 → ff 512
    n_expert, k, n_rows = 256, 2048, 512
    slot_expert = np.stack([rng.choice(n_expert, 8, replace=False) for _ in range(n_tok)]).ravel()
    slot_x = np.repeat(np.arange(n_tok), 8)
    got, x, gate_ref, up_ref = _run_grouped(GGMLType.Q4_K, n_expert, n_rows, k, slot_expert,
                                            slot_x, n_tok, tile, swiglu, rng)
    for e in rng.choice(n_expert, 4, replace=False):
        slots = np.flatnonzero(slot_expert == e)
        _check(got[slots], x[slot_x[slots]], gate_ref[e], None if up_ref is None else up_ref[e])


# ---------------------------------------------------------------- fragment GEMM (Q4_K)
def test_q4_k_takes_the_fragment_kernel_for_tiles_up_to_64():
    assert fragment_gemm.supports(GGMLType.Q4_K, 256)
    assert not fragment_gemm.supports(GGMLType.Q5_K, 256)
    assert not fragment_gemm.supports(GGMLType.Q8_0, 256)
    assert not fragment_gemm.supports(GGMLType.Q4_K, 96)  # not whole 64-element steps
    assert 128 not in fragment_gemm.TILES


@pytest.mark.parametrize("tile, ggml_type", [(16, GGMLType.Q4_K), (64, GGMLType.Q4_K)])
@pytest.mark.slow
def test_fragment_gemm_grouped_swiglu(tile, ggml_type, rng):
    # 4 k steps through both buffers, two row blocks, an expert with several 16-token tiles
    slot_expert = rng.permutation(np.repeat([0, 2], [34, 9]))
    slot_x = rng.integers(0, 30, slot_expert.size)
    got, x, gate_ref, up_ref = _run_grouped(ggml_type, 3, 70, 256, slot_expert, slot_x, 30,
                                            tile, True, rng)
    for e in (0, 2):
        slots = np.flatnonzero(slot_expert == e)
        _check(got[slots], x[slot_x[slots]], gate_ref[e], up=up_ref[e])


@pytest.mark.slow
def test_fragment_gemm_split_k_q4_k(rng):
    n_tok, k, n_rows = 20, 256, 140
    w, w_ref = _weights(GGMLType.Q4_K, 1, n_rows, k, rng)
    assert mg.k_splits(w, n_tok) > 1
    x = rng.standard_normal((n_tok, k)).astype(np.float32)
    y = cuda.device_array((n_tok, n_rows), np.float32)
    partials = cuda.device_array(mg.partials_size(w, n_tok), np.float32)
    mg.matmul(w, cuda.to_device(x), y, partials=partials)
    _check(y.copy_to_host(), x.astype(np.float64), w_ref[0])
