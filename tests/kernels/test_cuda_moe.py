"""CUDA MoE router top-k vs float64 numpy (the combine is tested with the norm it is fused into)."""

from __future__ import annotations

import numpy as np
import pytest
from numba import cuda

from sparkinfer_cli.kernels.cuda import moe


@pytest.mark.parametrize("n_tokens, n_experts, k", [
    (3, 40, 4), (2, 70, 10),  # simulator: 4 and 2 threads an expert
    pytest.param(64, 256, 8, marks=pytest.mark.gpu),  # GPU: 4 and 8 threads an expert
    pytest.param(64, 128, 8, marks=pytest.mark.gpu)])
def test_router_topk_softmax_renormalised_with_ties_to_lower_index(n_tokens, n_experts, k):
    rng = np.random.default_rng(4)
    logits = rng.standard_normal((n_tokens, n_experts)).astype(np.float32)
    logits[1, 7] = logits[1, 30] = 5.0  # a tie: expert 7 must come first
    ids = cuda.device_array((n_tokens, k), np.int32)
    weights = cuda.device_array((n_tokens, k), np.float32)
    moe.router_topk(cuda.to_device(logits), k, ids, weights)
    ref_ids, ref_w = moe.router_topk_reference(logits, k)
    np.testing.assert_array_equal(ids.copy_to_host(), ref_ids)
    assert list(ref_ids[1, :2]) == [7, 30]
    np.testing.assert_allclose(weights.copy_to_host(), ref_w, rtol=1e-5)



def test_rank_parts_cover_the_experts_in_whole_warps_and_rounds():
    for n_experts in range(1, moe.MAX_THREADS + 1):  # on the GPU: MAX_EXPERTS
        parts, slots = moe._rank_parts(n_experts)
        assert parts in (1, 2, 4, 8, 16, 32) and slots >= n_experts
        assert slots * parts <= moe.MAX_THREADS and slots * parts % 32 == 0
        assert slots % parts == 0 and slots // parts % 8 == 0  # counting rounds of 8
        if parts < 32:  # the most threads that fit: twice as many would not
            unit = max(16 * parts, 16 // parts)
            assert -(-n_experts // unit) * unit * 2 * parts > moe.MAX_THREADS, n_experts
