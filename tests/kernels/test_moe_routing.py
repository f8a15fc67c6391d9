"""MoE routing vs an independent float64 computation of ARCHITECTURES.md §3.3."""

from __future__ import annotations

import numpy as np
import pytest

from sparkinfer_cli.kernels.cpu.moe_routing import (
    MIN_WEIGHT_SUM,
    group_tokens_by_expert,
    route,
)


def reference_route(logits, k):
    """float64 softmax, per-token sort by (−p, index), renormalise with the clamp."""
    x = logits.astype(np.float64)
    p = np.exp(x - x.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    ids = np.array([sorted(range(len(row)), key=lambda e: (-row[e], e))[:k] for row in p])
    w = np.take_along_axis(p, ids, axis=1)
    return ids, w / np.maximum(w.sum(axis=1, keepdims=True), 6.103515625e-5)


@pytest.mark.parametrize("n_tokens,n_expert,k", [(1, 8, 2), (17, 128, 8), (40, 256, 8), (5, 4, 4)])
def test_route_matches_float64_reference(n_tokens, n_expert, k):
    rng = np.random.default_rng(n_expert)
    logits = (2.0 * rng.standard_normal((n_tokens, n_expert))).astype(np.float32)
    ids, weights = route(logits, k)
    want_ids, want_w = reference_route(logits, k)
    assert ids.dtype == np.int32 and weights.dtype == np.float32 and ids.shape == (n_tokens, k)
    np.testing.assert_array_equal(ids, want_ids)
    err = np.abs(weights - want_w).max()
    assert err < 1e-6, f"max abs weight diff vs float64: {err:.2e}"


def test_ties_pick_the_lower_index_first():
    logits = np.array([[0.0, 1.0, 1.0, 1.0, 0.5]], dtype=np.float32)
    ids, weights = route(logits, 2)
    assert ids.tolist() == [[1, 2]]
    np.testing.assert_allclose(weights, [[0.5, 0.5]], rtol=1e-6)


def test_renormalisation_sum_is_clamped():
    """With softmax gating the top-k mass is ≥ 1/E, so the clamp only bites beyond 16384 experts:
    20000 equal logits give p = 5e-5 each, and top-1 weight = 5e-5 / 6.103515625e-5."""
    ids, weights = route(np.zeros((1, 20000), dtype=np.float32), 1)
    assert ids.tolist() == [[0]]
    assert MIN_WEIGHT_SUM == 6.103515625e-5
    assert weights[0, 0] == pytest.approx(5e-5 / 6.103515625e-5, rel=1e-5)


def test_route_rejects_bad_k():
    with pytest.raises(ValueError, match="k must be"):
        route(np.zeros((2, 4), np.float32), 5)


def test_group_tokens_by_expert_is_a_stable_csr_partition():
    rng = np.random.default_rng(0)
    ids = np.stack([rng.choice(16, 4, replace=False) for _ in range(30)]).astype(np.int32)
    order, token_index, offsets = group_tokens_by_expert(ids, n_expert=16)
    assert offsets.shape == (17,) and offsets[0] == 0 and offsets[-1] == ids.size
    flat = ids.ravel()
    for e in range(16):
        entries = order[offsets[e]:offsets[e + 1]]
        want_tokens = [t for t in range(30) if e in ids[t]]
        assert (flat[entries] == e).all()
        assert token_index[offsets[e]:offsets[e + 1]].tolist() == want_tokens
    assert sorted(order.tolist()) == list(range(ids.size))


def test_group_tokens_defaults_to_max_id_plus_one():
    order, token_index, offsets = group_tokens_by_expert(np.array([[2, 0]], np.int32))
    assert offsets.tolist() == [0, 1, 1, 2]
    assert order.tolist() == [1, 0] and token_index.tolist() == [0, 0]
