"""Gated DeltaNet CPU kernels vs float64 numpy references (the delta rule's is shared with the
CUDA kernels' tests: kernels/delta_rule_reference.py)."""

from __future__ import annotations

import numpy as np
import pytest

from sparkinfer_cli.kernels.cpu.gated_delta import (
    causal_conv1d_silu,
    gated_delta_chunked,
    gated_delta_recurrent,
    l2_normalize,
)
from sparkinfer_cli.kernels.delta_rule_reference import delta_rule

H_K, H_V, DK, DV = 2, 4, 16, 8


def random_gdn_inputs(T, seed):
    rng = np.random.default_rng(seed)
    q = l2_normalize(rng.standard_normal((T, H_K, DK), dtype=np.float32), 1e-6)
    k = l2_normalize(rng.standard_normal((T, H_K, DK), dtype=np.float32), 1e-6)
    v = rng.standard_normal((T, H_V, DV), dtype=np.float32)
    g = -rng.uniform(0.0, 1.5, (T, H_V)).astype(np.float32)  # log-decay ≤ 0
    beta = rng.uniform(0.0, 1.0, (T, H_V)).astype(np.float32)
    state = (0.5 * rng.standard_normal((H_V, DK, DV))).astype(np.float32)
    return q, k, v, g, beta, state


@pytest.mark.parametrize("head_map", ["mod", "div"])
@pytest.mark.parametrize("T", [1, 5, 64, 100, 200])
def test_recurrent_and_chunked_match_float64_reference(T, head_map):
    q, k, v, g, beta, state0 = random_gdn_inputs(T, seed=T)
    want_o, want_S = delta_rule(q, k, v, g, beta, state0, head_map == "mod")
    s_rec, s_chk = state0.copy(), state0.copy()
    o_rec = gated_delta_recurrent(q, k, v, g, beta, s_rec, head_map)
    o_chk = gated_delta_chunked(q, k, v, g, beta, s_chk, head_map, chunk=64)
    diffs = {
        "recurrent-vs-f64": np.abs(o_rec - want_o).max(),
        "chunked-vs-f64": np.abs(o_chk - want_o).max(),
        "chunked-vs-recurrent": np.abs(o_chk - o_rec).max(),
        "state recurrent-vs-f64": np.abs(s_rec - want_S).max(),
        "state chunked-vs-recurrent": np.abs(s_chk - s_rec).max(),
    }
    msg = f"T={T} {head_map}: max abs diffs " + ", ".join(f"{n}={d:.2e}" for n, d in diffs.items())
    assert diffs["recurrent-vs-f64"] < 2e-5 and diffs["state recurrent-vs-f64"] < 2e-5, msg
    assert max(diffs.values()) < 1e-4, msg


@pytest.mark.parametrize("chunk", [1, 7, 16])
def test_chunked_handles_any_chunk_size(chunk):
    q, k, v, g, beta, state0 = random_gdn_inputs(37, seed=3)
    want_o, want_S = delta_rule(q, k, v, g, beta, state0, True)
    state = state0.copy()
    o = gated_delta_chunked(q, k, v, g, beta, state, "mod", chunk=chunk)
    err = max(np.abs(o - want_o).max(), np.abs(state - want_S).max())
    assert err < 1e-4, f"chunk={chunk}: max abs diff {err:.2e}"


def test_decode_steps_continue_a_chunked_prefill():
    """Prefill by chunks, then one token at a time: same as one reference pass over everything."""
    q, k, v, g, beta, state0 = random_gdn_inputs(70, seed=11)
    want_o, _ = delta_rule(q, k, v, g, beta, state0, False)
    state = state0.copy()
    outs = [gated_delta_chunked(q[:67], k[:67], v[:67], g[:67], beta[:67], state, "div")]
    for t in range(67, 70):
        sl = slice(t, t + 1)
        outs.append(gated_delta_recurrent(q[sl], k[sl], v[sl], g[sl], beta[sl], state, "div"))
    err = np.abs(np.concatenate(outs) - want_o).max()
    assert err < 1e-4, f"max abs diff {err:.2e}"


def test_head_maps_differ_when_h_k_differs_from_h_v():
    q, k, v, g, beta, state0 = random_gdn_inputs(4, seed=5)
    o_mod = gated_delta_recurrent(q, k, v, g, beta, state0.copy(), "mod")
    o_div = gated_delta_recurrent(q, k, v, g, beta, state0.copy(), "div")
    assert np.abs(o_mod - o_div).max() > 1e-3


def reference_conv_silu(m, conv_state, weight):
    K = weight.shape[1]
    window = np.concatenate([conv_state.T, m]).astype(np.float64)  # (K-1+T, C), oldest first
    T = m.shape[0]
    u = np.stack([(window[t:t + K] * weight.T).sum(0) for t in range(T)])
    return u / (1 + np.exp(-u)), window[-(K - 1):].T


@pytest.mark.parametrize("T", [1, 2, 9])
def test_causal_conv1d_silu_matches_reference_and_rolls_state(T):
    rng = np.random.default_rng(T)
    C, K = 12, 4
    m = rng.standard_normal((T, C), dtype=np.float32)
    conv_state = rng.standard_normal((C, K - 1), dtype=np.float32)
    weight = rng.standard_normal((C, K), dtype=np.float32)
    want, want_state = reference_conv_silu(m, conv_state, weight)
    got = causal_conv1d_silu(m, conv_state, weight)
    err = np.abs(got - want).max()
    assert err < 1e-5, f"max abs diff {err:.2e}"
    np.testing.assert_array_equal(conv_state, want_state.astype(np.float32))


def test_conv_split_into_steps_equals_one_pass():
    rng = np.random.default_rng(0)
    m = rng.standard_normal((6, 5), dtype=np.float32)
    weight = rng.standard_normal((5, 4), dtype=np.float32)
    s_one, s_steps = np.zeros((5, 3), np.float32), np.zeros((5, 3), np.float32)
    one = causal_conv1d_silu(m, s_one, weight)
    steps = np.concatenate([causal_conv1d_silu(m[t:t + 1].copy(), s_steps, weight)
                            for t in range(6)])
    np.testing.assert_allclose(steps, one, rtol=0, atol=1e-6)
    np.testing.assert_array_equal(s_steps, s_one)


def test_l2_normalize_form():
    x = np.array([[3.0, 4.0], [0.0, 0.0]], dtype=np.float32)
    got = l2_normalize(x, eps=1e-6)
    np.testing.assert_allclose(got[0], np.array([3, 4]) / np.sqrt(25 + 1e-6), rtol=1e-6)
    np.testing.assert_array_equal(got[1], [0.0, 0.0])


def test_rejects_bad_arguments():
    q, k, v, g, beta, state = random_gdn_inputs(3, seed=1)
    with pytest.raises(ValueError, match="head_map"):
        gated_delta_recurrent(q, k, v, g, beta, state, "modulo")
    with pytest.raises(ValueError, match="float32"):
        gated_delta_recurrent(q.astype(np.float64), k, v, g, beta, state, "mod")
    with pytest.raises(ValueError, match="shapes"):
        gated_delta_chunked(q, k, v, g[:2], beta, state, "mod")
