"""Grouped int8 tensor-core GEMM for K-quant experts (Q4_K / Q5_K × q8 activations) vs float64
numpy on gguf.quants.dequantize'd weights and the numpy q8 reference of the activations.

The int8 sums are exact; only the float32 scaling of each sub-block (and its min term) rounds,
so the check is ~1e-5 of Σ|x||w|. Simulator: a few blocks over 2 pipeline steps.
"""

from __future__ import annotations

import numpy as np
import pytest
from numba import cuda
from test_cuda_mma_gemm import _weights
from test_cuda_mmq_q8 import _activations, _check

from sparkinfer_cli.gguf.ggml_types import GGMLType
from sparkinfer_cli.kernels.cuda import mmq_k
from sparkinfer_cli.kernels.cuda.expert_route import ExpertRoute, route_experts


def _run(ggml_type, n_expert, n_rows, k, slot_expert, slot_x, n_x, tile, swiglu, rng):
    """(y (n_slots, n_rows), x (n_x, k) as the kernel sees it, gate and up (experts, rows, k))."""
    gate, gate_ref = _weights(ggml_type, n_expert, n_rows, k, rng)
    up, up_ref = _weights(ggml_type, n_expert, n_rows, k, rng) if swiglu else (None, None)
    act, x = _activations(n_x, k, rng)
    n_slots = slot_expert.size
    route = ExpertRoute(n_expert, n_slots, tile)
    route_experts(cuda.to_device(slot_expert.astype(np.int32)), n_slots, route)
    y = cuda.device_array((n_slots, n_rows), np.float32)
    mmq_k.grouped_matmul(gate, act, y, route, cuda.to_device(slot_x.astype(np.int32)), up=up)
    return y.copy_to_host(), x, gate_ref, up_ref


def _check_experts(got, x, slot_expert, slot_x, gate_ref, up_ref, experts):
    for e in experts:
        slots = np.flatnonzero(slot_expert == e)
        _check(got[slots], x[slot_x[slots]], gate_ref[e], up=None if up_ref is None
               else up_ref[e])


@pytest.mark.slow  # a minute or more in the simulator on 2 cores
@pytest.mark.parametrize("ggml_type", [GGMLType.Q4_K, GGMLType.Q5_K])
def test_grouped_matmul_routes_slots_to_their_expert(ggml_type, rng):
    # expert 0: no slots, expert 1: 100 (a full tile and one of 36: warps of slots 32-63 idle
    # past slot 36), expert 2: 10 (one 16-slot group); 2 row blocks (the second cut at 6 rows);
    # k of one super-block: both halves of it, 2 pipeline steps
    slot_expert = rng.permutation(np.repeat([1, 2], [100, 10]))
    slot_x = rng.integers(0, 50, slot_expert.size)
    got, x, w_ref, _ = _run(ggml_type, 3, 70, 256, slot_expert, slot_x, 50, 64, False, rng)
    _check_experts(got, x, slot_expert, slot_x, w_ref, None, (1, 2))


@pytest.mark.parametrize("ggml_type", [GGMLType.Q4_K, GGMLType.Q5_K])
def test_grouped_matmul_fused_swiglu(ggml_type, rng):
    # 32 output rows a block: 40 rows → 2 blocks; tiles of 16 slots; 2 super-blocks of k
    slot_expert = rng.integers(0, 2, 40)
    slot_x = rng.integers(0, 20, slot_expert.size)
    got, x, gate_ref, up_ref = _run(ggml_type, 2, 40, 512, slot_expert, slot_x, 20, 16, True,
                                    rng)
    _check_experts(got, x, slot_expert, slot_x, gate_ref, up_ref, (0, 1))


def test_grouped_matmul_rejects_what_it_does_not_take(rng):
    slot_x = cuda.to_device(np.zeros(4, np.int32))
    act, _ = _activations(4, 256, rng)
    y = cuda.device_array((4, 8), np.float32)
    route = ExpertRoute(2, 4, 128)
    q6, _ = _weights(GGMLType.Q6_K, 2, 8, 256, rng)
    assert not mmq_k.supports(q6)
    with pytest.raises(ValueError, match="Q6_K"):
        mmq_k.grouped_matmul(q6, act, y, route, slot_x)
    q4, _ = _weights(GGMLType.Q4_K, 2, 8, 256, rng)
    with pytest.raises(ValueError, match="route tile 128"):
        mmq_k.grouped_matmul(q4, act, y, route, slot_x)
    other_k, _ = _activations(4, 512, rng)
    with pytest.raises(ValueError, match="activations of 512"):
        mmq_k.grouped_matmul(q4, other_k, y, ExpertRoute(2, 4, 64), slot_x)


# ---------------------------------------------------------------- real shapes (H200)
@pytest.mark.gpu
@pytest.mark.parametrize("ggml_type, k, n_rows, swiglu", [
    (GGMLType.Q4_K, 2048, 512, True),  # Qwen3.6-35B-A3B expert gate + up
    (GGMLType.Q5_K, 512, 2048, False),  # ... its down projection
])
@pytest.mark.parametrize("n_tok, tile", [(2048, 64), (256, 16)])
def test_grouped_matmul_real_shapes(ggml_type, k, n_rows, swiglu, n_tok, tile, rng):
    n_expert = 256  # n_tok tokens × top-8
    slot_expert = np.stack([rng.choice(n_expert, 8, replace=False) for _ in range(n_tok)]).ravel()
    slot_x = np.repeat(np.arange(n_tok), 8)
    got, x, gate_ref, up_ref = _run(ggml_type, n_expert, n_rows, k, slot_expert, slot_x, n_tok,
                                    tile, swiglu, rng)
    _check_experts(got, x, slot_expert, slot_x, gate_ref, up_ref,
                   rng.choice(n_expert, 4, replace=False))
