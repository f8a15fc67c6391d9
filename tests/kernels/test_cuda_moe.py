"""CUDA MoE router top-k vs float64 numpy (the combine is tested with the norm it is fused into)."""

from __future__ import annotations

import numpy as np
import pytest
from numba import cuda

from sparkinfer_cli.kernels.cuda import moe


@pytest.mark.parametrize("n_tokens, n_experts, k", [
    (3, 40, 4), (2, 70, 10), pytest.param(64, 256, 8, marks=pytest.mark.gpu)])
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

