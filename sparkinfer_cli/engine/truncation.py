"""Which tokens survive top-k, top-p and min-p, and the draw among them, on a vocabulary-sized row
without sorting it, and without exponentiating all of it where the answer does not depend on that.

The rules are in sampler.py's docstring; this module only finds their result fast:

- top-k: a threshold keeping at least k tokens is read off a strided sample of the row and checked
  by one comparison pass; the exact k-th value is then partitioned out of those candidates only;
- top-p: candidates are the most likely head of the row. The probability mass outside the head is
  at most (tokens outside) × exp(threshold − peak); when the cut lands on the same token at both
  ends of that bound, the softmax normaliser over the whole vocabulary is never computed;
- min-p: one comparison against peak + log(min_p).

Every function returns ascending positions, so of equal logits the lower token id is kept.
"""

from __future__ import annotations

import math
import threading
from typing import Literal

import numpy as np

SAMPLE_SIZE = 4096  # strided sample of the row from which top-k thresholds are guessed
TOP_P_HEADS = (256, 16384)  # candidate heads tried before the whole vocabulary
TAIL_SLACK = 1.0 + 1e-5  # float32 exp() may round a value just under the threshold up to it
SEARCH_BLOCK = 1024  # block size of the two-level cumulative sum in cumulative_search()


class Workspace:
    """Vocabulary-sized buffers, one set per thread, reused for every token.

    Fresh 1 MB numpy temporaries cost about a thousand page faults per token on a 248k
    vocabulary, more than the arithmetic; with these buffers sampling allocates only small arrays.
    """

    def __init__(self, n_vocab: int):
        self.logits = np.empty(n_vocab, dtype=np.float32)  # (n_vocab,) processed logits
        self.weights = np.empty(n_vocab, dtype=np.float32)  # (n_vocab,) exp(logit − max)
        self.mask = np.empty(n_vocab, dtype=np.bool_)  # (n_vocab,) comparisons


_thread_local = threading.local()


def thread_workspace(n_vocab: int) -> Workspace:
    workspaces = _thread_local.__dict__.setdefault("workspaces", {})
    if n_vocab not in workspaces:
        workspaces[n_vocab] = Workspace(n_vocab)
    return workspaces[n_vocab]


def truncate(logits: np.ndarray, top_k: int, top_p: float, min_p: float,
             ws: Workspace) -> np.ndarray | None:
    """Ascending ids of the tokens that survive top-k, top-p and min-p; None when all do."""
    ids = top_positions(logits, top_k, ws) if 0 < top_k < len(logits) else None
    if top_p < 1.0:
        ids = narrow(ids, top_p_positions(subset(logits, ids), top_p, ws))
    if min_p > 0.0:
        ids = narrow(ids, min_p_positions(subset(logits, ids), min_p, ws))
    return ids


def subset(logits: np.ndarray, ids: np.ndarray | None) -> np.ndarray:
    return logits if ids is None else logits[ids]


def narrow(ids: np.ndarray | None, positions: np.ndarray) -> np.ndarray:
    return positions if ids is None else ids[positions]


def top_candidates(values: np.ndarray, count: int, ws: Workspace) -> tuple[np.ndarray, float]:
    """(ascending positions of every value ≥ t, t) for a threshold t that keeps at least `count`
    values, and typically a few times that many; t = -inf keeps them all."""
    n = len(values)
    stride = max(1, n // SAMPLE_SIZE)
    sample = values[::stride]  # (≤ SAMPLE_SIZE,) view
    mask = ws.mask[:n]
    rank = 2 * (count // stride) + 8  # NOTE: about 2·count values of the row lie above
    while count < n and rank < len(sample):
        threshold = np.partition(sample, len(sample) - rank)[len(sample) - rank]
        if np.count_nonzero(np.greater_equal(values, threshold, out=mask)) >= count:
            return np.flatnonzero(mask), float(threshold)
        rank *= 4
    return np.arange(n), -math.inf


def top_positions(values: np.ndarray, count: int, ws: Workspace) -> np.ndarray:
    """Ascending positions of the `count` largest values; of equal values the lower position."""
    if count >= len(values):
        return np.arange(len(values))
    candidates, _ = top_candidates(values, count, ws)
    kept = values[candidates]  # (num_candidates,)
    cutoff = np.partition(kept, len(kept) - count)[len(kept) - count]  # smallest value kept
    above = candidates[kept > cutoff]
    tied = candidates[kept == cutoff][:count - len(above)]
    return np.sort(np.concatenate([above, tied]))


def top_p_positions(values: np.ndarray, top_p: float, ws: Workspace) -> np.ndarray:
    """Ascending positions of the smallest head of most likely values whose softmax mass reaches
    top_p (the value that crosses top_p is kept)."""
    n, peak = len(values), values.max()
    total: float | None = None  # the exact softmax normaliser, only if the tail bound is too loose
    for head in (*TOP_P_HEADS, n):
        candidates, threshold = top_candidates(values, head, ws)
        ranked = candidates[np.argsort(-values[candidates], kind="stable")]  # likeliest first
        cdf = np.cumsum(np.exp(values[ranked] - peak), dtype=np.float64)  # (num_candidates,)
        tail = (n - len(ranked)) * math.exp(threshold - float(peak)) * TAIL_SLACK
        low, high = (total, total) if total is not None and tail else (cdf[-1], cdf[-1] + tail)
        keep = top_p_cut(cdf, top_p, low, high)
        if keep is None and total is None:
            total = exp_sum(values, peak, ws)
            keep = top_p_cut(cdf, top_p, total, total)
        if keep is not None:
            return np.sort(ranked[:keep])
    raise AssertionError("the whole vocabulary always settles the top-p cut")


def top_p_cut(cdf: np.ndarray, top_p: float, low_total: float, high_total: float) -> int | None:
    """How many ranked tokens top-p keeps, if that is the same for every softmax normaliser in
    [low_total, high_total]; None if it is not (or the head holds too little mass)."""
    first = int(np.searchsorted(cdf, top_p * low_total, side="left"))
    last = int(np.searchsorted(cdf, top_p * high_total, side="left"))
    return first + 1 if first == last < len(cdf) else None


def exp_sum(values: np.ndarray, peak: float, ws: Workspace) -> float:
    weights = ws.weights[:len(values)]
    np.exp(np.subtract(values, peak, out=weights), out=weights)
    return float(weights.sum())


def min_p_positions(values: np.ndarray, min_p: float, ws: Workspace) -> np.ndarray:
    threshold = values.max() + np.float32(np.log(min_p))
    return np.flatnonzero(np.greater_equal(values, threshold, out=ws.mask[:len(values)]))


def choose(logits: np.ndarray, temperature: float, top_k: int, top_p: float, min_p: float,
           u: float, ws: Workspace) -> int:
    """The token the rules keep and draw for a uniform u in [0, 1): truncate, then draw."""
    ids = truncate(logits, top_k, top_p, min_p, ws)
    position = draw(subset(logits, ids), temperature, u, ws)
    return position if ids is None else int(ids[position])


def check_draft(logits: np.ndarray, temperature: float, top_k: int, top_p: float, min_p: float,
                draft: int, u_keep: float, u_instead: float, ws: Workspace) -> tuple[int, bool]:
    """Speculative sampling of a draft proposed with certainty (prompt lookup: its proposal puts
    all mass on `draft`): (draft, True) with probability p(draft) under choose()'s distribution,
    else (a token drawn by u_instead from p with the draft's mass taken out, False). Over the
    two draws the token is distributed exactly as choose() draws it (Leviathan et al.: accept
    with min(1, p/q), else sample the residual max(0, p − q), here p without the draft)."""
    ids = truncate(logits, top_k, top_p, min_p, ws)
    values = subset(logits, ids)
    position = draft if ids is None else int(np.searchsorted(ids, draft))
    present = position < len(values) and (ids is None or ids[position] == draft)
    weights = softmax_weights(values, temperature, ws)
    if present:
        total = float(np.sum(weights, dtype=np.float64))
        if u_keep * total < weights[position]:
            return draft, True
        weights[position] = 0.0
    drawn = cumulative_search(weights, u_instead, side="right")
    return (drawn if ids is None else int(ids[drawn])), False


def draw(values: np.ndarray, temperature: float, u: float, ws: Workspace) -> int:
    """Position drawn from softmax(values / temperature) by u: the first whose cumulative weight
    (positions ascending) exceeds u of the total."""
    return cumulative_search(softmax_weights(values, temperature, ws), u, side="right")


def softmax_weights(values: np.ndarray, temperature: float, ws: Workspace) -> np.ndarray:
    """exp((values − max) / temperature) in ws.weights: softmax's unnormalised weights."""
    weights = ws.weights[:len(values)]
    np.subtract(values, values.max(), out=weights)
    if temperature != 1.0:  # NOTE: dividing by 1 changes no bit; skip the pass
        np.divide(weights, np.float32(temperature), out=weights)
    np.exp(weights, out=weights)
    return weights


def cumulative_search(weights: np.ndarray, fraction: float,
                      side: Literal["left", "right"]) -> int:
    """First position whose cumulative weight exceeds (side="right") or reaches ("left")
    `fraction` of the total weight.

    Sums blocks first, then runs a cumulative sum only inside the block where the mass falls: no
    vocabulary-sized temporaries, and a zero weight is never chosen for a fraction below 1.
    """
    starts = np.arange(0, len(weights), SEARCH_BLOCK)  # (num_blocks,)
    block_sums = np.add.reduceat(weights, starts)  # (num_blocks,) float32
    block_cdf = np.cumsum(block_sums, dtype=np.float64)  # (num_blocks,)
    mass = fraction * block_cdf[-1]
    block = min(int(np.searchsorted(block_cdf, mass, side=side)), len(starts) - 1)
    within = (mass - (block_cdf[block - 1] if block else 0.0)) / block_sums[block]  # in (0, 1]
    inner_cdf = np.cumsum(weights[starts[block]:starts[block] + SEARCH_BLOCK], dtype=np.float64)
    inner = int(np.searchsorted(inner_cdf, within * inner_cdf[-1], side=side))
    return int(starts[block]) + min(inner, len(inner_cdf) - 1)
