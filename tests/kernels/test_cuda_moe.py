"""CUDA MoE router top-k vs float64 numpy (the combine is tested with the norm it is fused into)."""

from __future__ import annotations

import numpy as np
import pytest
from numba import cuda

from sparkinfer_cli.kernels.cuda import moe


@pytest.mark.parametrize("n_tokens, n_experts, k", [
    (3, 40, 4),  # 2 logits a lane, the second only on lanes 0-7
    (6, 70, 10),  # 4 a lane (2 warps of a block idle), picks on lanes 0-9
    (2, 32, 32),  # every expert picked, one a lane
    (2, 1, 1),  # one expert: lanes 1-31 hold none
    pytest.param(64, 256, 8, marks=pytest.mark.gpu),  # Qwen3.6
    pytest.param(64, 128, 8, marks=pytest.mark.gpu),  # Qwen3-30B
    pytest.param(5, 1024, 8, marks=pytest.mark.gpu)])
@pytest.mark.slow
def test_router_topk_softmax_renormalised_with_ties_to_lower_index(n_tokens, n_experts, k):
    rng = np.random.default_rng(4)
    logits = rng.standard_normal((n_tokens, n_experts)).astype(np.float32)
    if n_tokens > 1 and n_experts > 30:
        logits[1, 7] = logits[1, 30] = 5.0  # a tie across lanes: expert 7 must come first
    if n_tokens > 2 and n_experts > 37:
        logits[2, 37] = logits[2, 5] = 6.0  # a tie within lane 5: expert 5 must come first
    ids = cuda.device_array((n_tokens, k), np.int32)
    weights = cuda.device_array((n_tokens, k), np.float32)
    moe.router_topk(cuda.to_device(logits), k, ids, weights)
    ref_ids, ref_w = moe.router_topk_reference(logits, k)
    np.testing.assert_array_equal(ids.copy_to_host(), ref_ids)
    if n_tokens > 1 and n_experts > 30:
        assert list(ref_ids[1, :2]) == [7, 30]
    if n_tokens > 2 and n_experts > 37:
        assert list(ref_ids[2, :2]) == [5, 37]
    np.testing.assert_allclose(weights.copy_to_host(), ref_w, rtol=1e-5)


def test_router_topk_rejects_what_a_warp_cannot_pick():
    logits = cuda.to_device(np.zeros((1, 40), np.float32))
    with pytest.raises(ValueError, match="top-k 33"):
        moe.router_topk(logits, 33, cuda.device_array((1, 33), np.int32),
                        cuda.device_array((1, 33), np.float32))
