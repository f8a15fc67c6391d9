"""MoE router: softmax over all experts, top-k, renormalise (llama.cpp's build_moe_ffn), and the
token grouping a grouped expert GEMM needs in prefill.

Ties: llama.cpp's CPU `ggml_top_k` is `std::partial_sort` with `a > b` (no tie rule; upstream's
test_top_k accepts any index among equal values) and it swaps output slots 0 and 1 on purpose. We
return experts by descending probability with the lower index first among equals, which is
deterministic and selects the same set whenever the k-th value is not tied across the cut.
"""

from __future__ import annotations

import numpy as np

# llama.cpp clamps the renormalisation sum to the smallest normal f16
MIN_WEIGHT_SUM = 6.103515625e-5


def expert_probs(router_logits: np.ndarray) -> np.ndarray:
    """Softmax over the expert axis in f32; the sum is accumulated in f64 as ggml does."""
    shifted = router_logits - router_logits.max(axis=-1, keepdims=True)  # (T, E)
    e = np.exp(shifted, dtype=np.float32)  # (T, E)
    inv_sum = (1.0 / e.sum(axis=-1, keepdims=True, dtype=np.float64)).astype(np.float32)
    return e * inv_sum


def route(router_logits: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """router_logits (T, E) f32 → ids (T, k) int32, weights (T, k) f32 (sum 1 per token)."""
    if router_logits.ndim != 2:
        raise ValueError(f"router_logits must be (tokens, experts), got {router_logits.shape}")
    n_expert = router_logits.shape[1]
    if not 1 <= k <= n_expert:
        raise ValueError(f"k must be in 1..{n_expert}, got {k}")
    probs = expert_probs(router_logits.astype(np.float32, copy=False))  # (T, E)
    ids = np.argsort(-probs, axis=1, kind="stable")[:, :k].astype(np.int32)  # (T, k)
    weights = np.take_along_axis(probs, ids, axis=1)  # (T, k)
    total = weights.sum(axis=1, keepdims=True, dtype=np.float64).astype(np.float32)  # (T, 1)
    return ids, weights / np.maximum(total, np.float32(MIN_WEIGHT_SUM))


def group_tokens_by_expert(ids: np.ndarray, n_expert: int | None = None
                           ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """CSR grouping of the (token, slot) assignments in `ids` (T, k) by expert.

    Returns (expert_order, token_index, offsets):
      expert_order (T·k,) int32: flat indices into ids.ravel() / weights.ravel(), grouped by expert
                                 (stable: token order within an expert);
      token_index  (T·k,) int32: the token row of each entry of expert_order;
      offsets (n_expert + 1,) int64: expert e owns entries offsets[e]:offsets[e+1].
    """
    flat = ids.reshape(-1)  # (T·k,)
    n_expert = int(flat.max()) + 1 if n_expert is None and flat.size else (n_expert or 0)
    if flat.size and (flat.min() < 0 or flat.max() >= n_expert):
        raise ValueError(f"expert ids must be in 0..{n_expert - 1}")
    expert_order = np.argsort(flat, kind="stable").astype(np.int32)  # (T·k,)
    token_index = (expert_order // max(ids.shape[-1], 1)).astype(np.int32)  # (T·k,)
    offsets = np.zeros(n_expert + 1, dtype=np.int64)  # (E + 1,)
    np.cumsum(np.bincount(flat, minlength=n_expert), out=offsets[1:])
    return expert_order, token_index, offsets
