"""CUDA Gated DeltaNet conv step and recurrent step vs float64 numpy."""

from __future__ import annotations

import numpy as np
import pytest
from numba import cuda

from sparkinfer_cli.kernels.cuda import gated_delta as gd


def test_conv_silu_step_shifts_state():
    rng = np.random.default_rng(8)
    mixed = rng.standard_normal((2, 6)).astype(np.float32)
    conv_w = rng.standard_normal((6, 4)).astype(np.float32)
    state = rng.standard_normal((3, 6, 3)).astype(np.float32)  # (slots, conv_dim, K-1)
    slots = np.array([2, 0], np.int32)
    dev_state, out = cuda.to_device(state), cuda.device_array((2, 6), np.float32)
    gd.conv_silu_step(cuda.to_device(mixed), cuda.to_device(conv_w), dev_state,
                      cuda.to_device(slots), out)
    window = np.concatenate([state[slots], mixed[:, :, None]], axis=2).astype(np.float64)
    pre = (window * conv_w).sum(axis=2)
    np.testing.assert_allclose(out.copy_to_host(), pre / (1 + np.exp(-pre)), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(dev_state.copy_to_host()[slots], window[:, :, 1:])
    np.testing.assert_array_equal(dev_state.copy_to_host()[1], state[1])


@pytest.mark.parametrize("n_seqs, n_k, n_v, dk, dv", [
    (1, 1, 2, 32, 8),
    pytest.param(3, 16, 32, 128, 128, marks=pytest.mark.gpu),  # Qwen3.6 GDN
])
def test_delta_rule_step_matches_reference_for_both_head_maps(n_seqs, n_k, n_v, dk, dv):
    rng = np.random.default_rng(9)
    u = rng.standard_normal((n_seqs, 2 * n_k * dk + n_v * dv)).astype(np.float32)
    a, b = (rng.standard_normal((n_seqs, n_v)).astype(np.float32) for _ in range(2))
    ssm_a = -rng.uniform(0.5, 2, n_v).astype(np.float32)
    dt_bias = rng.standard_normal(n_v).astype(np.float32)
    state = rng.standard_normal((n_seqs, n_v, dv, dk)).astype(np.float32) * 0.1
    for head_map_mod in (True, False):
        dev_state, out = cuda.to_device(state), cuda.device_array((n_seqs, n_v, dv), np.float32)
        gd.delta_rule_step(cuda.to_device(u), cuda.to_device(a), cuda.to_device(b),
                           cuda.to_device(ssm_a), cuda.to_device(dt_bias), dev_state,
                           cuda.to_device(np.arange(n_seqs, dtype=np.int32)), out, n_k_heads=n_k,
                           head_map_mod=head_map_mod, eps=1e-6)
        ref_out, ref_state = gd.delta_rule_step_reference(u, a, b, ssm_a, dt_bias, state, n_k,
                                                          head_map_mod, 1e-6)
        np.testing.assert_allclose(out.copy_to_host(), ref_out, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(dev_state.copy_to_host(), ref_state, rtol=1e-4, atol=1e-5)
