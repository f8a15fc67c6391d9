"""CUDA MoE router top-k and expert combine vs float64 numpy."""

from __future__ import annotations

import numpy as np
import pytest
from numba import cuda

from sparkinfer_cli.kernels.cuda import moe


@pytest.mark.parametrize("n_tokens, n_experts, k", [
    (3, 40, 4), pytest.param(64, 256, 8, marks=pytest.mark.gpu)])
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


def test_combine_and_shared_expert_gate():
    rng = np.random.default_rng(5)
    y = rng.standard_normal((2 * 3, 16)).astype(np.float32)  # (tokens·k, d)
    w = rng.uniform(0, 1, (2, 3)).astype(np.float32)
    base = rng.standard_normal((2, 16)).astype(np.float32)
    out = cuda.to_device(base)
    moe.moe_combine(cuda.to_device(y), cuda.to_device(w), out, accumulate=True)
    ref = base + np.einsum("tk,tkd->td", w, y.reshape(2, 3, 16))
    np.testing.assert_allclose(out.copy_to_host(), ref, rtol=1e-5, atol=1e-6)
    shared = rng.standard_normal((2, 16)).astype(np.float32)
    gate = np.array([0.3, -2.0], np.float32)
    moe.add_gated(out, cuda.to_device(shared), cuda.to_device(gate))
    ref += shared / (1 + np.exp(-gate[:, None].astype(np.float64)))
    np.testing.assert_allclose(out.copy_to_host(), ref, rtol=1e-5, atol=1e-6)
