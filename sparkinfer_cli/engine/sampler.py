"""Sampler: turns one sequence's logits into the next token, the way llama.cpp's default chain does.

Order of operations (each step sees the result of the one before):

1. repetition penalty — llama.cpp/CTRL style over the last 64 tokens of prompt + output: every
   distinct token there has a positive logit divided by the penalty, a negative one multiplied;
2. presence and frequency penalties — OpenAI semantics over the generated tokens only:
   ``logit -= frequency_penalty * count + presence_penalty * (count > 0)``;
3. logit bias — ``logit += bias``; a bias of -100 or less bans the token outright (-inf);
4. top-k — keep the k largest logits (0: off);
5. top-p — keep the smallest set of most likely tokens whose probability (softmax at
   temperature 1 over what top-k kept) reaches top_p; the token that crosses top_p is kept;
6. min-p — keep tokens whose probability is at least min_p × that of the most likely one;
7. temperature — divide the kept logits by it and draw from their softmax.

Temperature 0 is greedy: the argmax of the logits after steps 1–3 (ties → lowest token id);
steps 4–7 do not apply.

Logprobs are the log-softmax of the logits after steps 1–3: the penalised, biased distribution
before truncation and temperature (what vLLM calls processed logprobs, without temperature). The
sampled token's logprob is therefore always finite, and top_logprobs does not depend on top-k/p.

Each Sampler owns a numpy Generator seeded with ``params.seed`` (fresh OS entropy when None), so
the same seed over the same logits gives the same token sequence.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from sparkinfer_cli.engine.sampling_params import SamplingParams

REPETITION_WINDOW = 64  # llama.cpp's penalty_last_n default
BAN_BIAS = -100.0  # OpenAI: "-100 should result in a ban"
TOP_P_HEAD = 1024  # largest logits sorted first when looking for the top-p cut
SEARCH_BLOCK = 1024  # block size of the two-level cumulative sum in cumulative_search()


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token id, logprob), most likely first


@dataclass
class SampleResult:
    token_id: int
    logprob: TokenLogprob | None  # filled iff params.logprobs


class Workspace:
    """Vocabulary-sized buffers, one set per thread, reused for every token.

    Fresh 600 KB numpy temporaries cost about a thousand page faults per token on a 152k
    vocabulary, more than the arithmetic; with these buffers sampling allocates only small arrays.
    """

    def __init__(self, n_vocab: int):
        self.logits = np.empty(n_vocab, dtype=np.float32)  # (n_vocab,) processed logits
        self.scratch = np.empty(n_vocab, dtype=np.float32)  # (n_vocab,) partitions and sorts
        self.weights = np.empty(n_vocab, dtype=np.float32)  # (n_vocab,) exp(logit − max)
        self.mask = np.empty(n_vocab, dtype=np.bool_)  # (n_vocab,) comparisons


_thread_local = threading.local()


def thread_workspace(n_vocab: int) -> Workspace:
    workspaces = _thread_local.__dict__.setdefault("workspaces", {})
    if n_vocab not in workspaces:
        workspaces[n_vocab] = Workspace(n_vocab)
    return workspaces[n_vocab]


class Sampler:
    def __init__(self, params: SamplingParams, n_vocab: int):
        self.params = params
        self.n_vocab = n_vocab
        self._rng = np.random.default_rng(params.seed)
        self._bias_ids, self._bias_values = logit_bias_arrays(params.logit_bias, n_vocab)

    def sample(self, logits: np.ndarray, prompt_ids: Sequence[int],
               output_ids: Sequence[int]) -> SampleResult:
        if logits.shape != (self.n_vocab,):
            raise ValueError(f"logits have shape {logits.shape}, expected ({self.n_vocab},)")
        ws = thread_workspace(self.n_vocab)
        processed = self.process_logits(logits, prompt_ids, output_ids, out=ws.logits)
        token_id = self._choose(processed, ws)
        logprob = None
        if self.params.logprobs:
            logprob = token_logprob(processed, token_id, self.params.top_logprobs, ws)
        return SampleResult(token_id, logprob)

    def process_logits(self, logits: np.ndarray, prompt_ids: Sequence[int],
                       output_ids: Sequence[int], out: np.ndarray | None = None) -> np.ndarray:
        """Steps 1–3 on a float32 copy of the logits (written to `out` when given)."""
        p = self.params
        out = np.empty(self.n_vocab, dtype=np.float32) if out is None else out  # (n_vocab,)
        np.copyto(out, logits, casting="same_kind")
        if p.repetition_penalty != 1.0:
            apply_repetition_penalty(out, recent_tokens(prompt_ids, output_ids),
                                     p.repetition_penalty)
        if p.presence_penalty or p.frequency_penalty:
            apply_presence_frequency(out, output_ids, p.presence_penalty, p.frequency_penalty)
        out[self._bias_ids] += self._bias_values
        return out

    def _choose(self, logits: np.ndarray, ws: Workspace) -> int:
        if not np.isfinite(logits.max()):
            raise ValueError("every token is banned (logit_bias) or the logits are not finite")
        p = self.params
        if p.is_greedy:
            return int(np.argmax(logits))
        ids = truncate(logits, p.top_k, p.top_p, p.min_p, ws)
        position = draw(subset(logits, ids), p.temperature, self._rng, ws)
        return position if ids is None else int(ids[position])


def logit_bias_arrays(logit_bias: dict[int, float], n_vocab: int) -> tuple[np.ndarray, np.ndarray]:
    ids = np.fromiter((int(t) for t in logit_bias), dtype=np.int64, count=len(logit_bias))
    if ids.size and (ids.min() < 0 or ids.max() >= n_vocab):
        bad = next(t for t in ids if not 0 <= t < n_vocab)
        raise ValueError(f"logit_bias token id {bad} is outside the vocabulary (0..{n_vocab - 1})")
    values = np.array(list(logit_bias.values()), dtype=np.float32)  # (len(logit_bias),)
    values[values <= BAN_BIAS] = -np.inf
    return ids, values


def recent_tokens(prompt_ids: Sequence[int], output_ids: Sequence[int]) -> np.ndarray:
    """The last REPETITION_WINDOW tokens of prompt + output (without joining long prompts)."""
    from_prompt = max(0, REPETITION_WINDOW - len(output_ids))
    prompt_tail = list(prompt_ids[max(0, len(prompt_ids) - from_prompt):]) if from_prompt else []
    output_tail = list(output_ids[-REPETITION_WINDOW:])
    return np.array(prompt_tail + output_tail, dtype=np.int64)  # (≤ REPETITION_WINDOW,)


def apply_repetition_penalty(logits: np.ndarray, tokens: np.ndarray, penalty: float) -> None:
    ids = np.unique(tokens)  # each distinct token is penalised once, however often it occurs
    seen = logits[ids]
    logits[ids] = np.where(seen > 0, seen / penalty, seen * penalty)


def apply_presence_frequency(logits: np.ndarray, output_ids: Sequence[int], presence: float,
                             frequency: float) -> None:
    if len(output_ids) == 0:
        return
    ids, counts = np.unique(np.asarray(output_ids, dtype=np.int64), return_counts=True)
    logits[ids] -= (frequency * counts + presence).astype(np.float32)


# ---- truncation: every function returns ascending positions, so ties go to the lower token id --
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


def top_positions(values: np.ndarray, count: int, ws: Workspace) -> np.ndarray:
    """Ascending positions of the `count` largest values; of equal values the lower position."""
    n = len(values)
    if count >= n:
        return np.arange(n)
    scratch, mask = ws.scratch[:n], ws.mask[:n]
    np.copyto(scratch, values)
    scratch.partition(n - count)
    cutoff = scratch[n - count]  # the smallest value that is kept
    above = np.flatnonzero(np.greater(values, cutoff, out=mask))
    tied = np.flatnonzero(np.equal(values, cutoff, out=mask))[:count - len(above)]
    return np.sort(np.concatenate([above, tied]))


def top_p_positions(values: np.ndarray, top_p: float, ws: Workspace) -> np.ndarray:
    n, peak = len(values), values.max()
    scratch, weights = ws.scratch[:n], ws.weights[:n]
    np.exp(np.subtract(values, peak, out=weights), out=weights)
    target = top_p * float(weights.sum())
    # Sorting the values of a partitioned head is far cheaper than an argsort of 152k; the full
    # sort only runs when the head holds less than top_p of the probability mass.
    for head in (min(TOP_P_HEAD, n), n):
        np.copyto(scratch, values)
        scratch.partition(n - head)
        ranked = scratch[n - head:]
        ranked.sort()
        descending = weights[:head]  # (head,) probabilities × total, largest first
        np.exp(np.subtract(ranked[::-1], peak, out=descending), out=descending)
        head_mass = float(descending.sum())
        if head == n or head_mass >= target:
            break
    # NOTE: the first token whose cumulative probability reaches top_p is kept.
    keep = cumulative_search(descending, min(1.0, target / head_mass), side="left") + 1
    return top_positions(values, keep, ws)


def min_p_positions(values: np.ndarray, min_p: float, ws: Workspace) -> np.ndarray:
    threshold = values.max() + np.float32(np.log(min_p))
    return np.flatnonzero(np.greater_equal(values, threshold, out=ws.mask[:len(values)]))


def draw(values: np.ndarray, temperature: float, rng: np.random.Generator, ws: Workspace) -> int:
    """Position drawn from softmax(values / temperature)."""
    weights = ws.weights[:len(values)]
    np.subtract(values, values.max(), out=weights)
    np.exp(np.divide(weights, np.float32(temperature), out=weights), out=weights)
    return cumulative_search(weights, rng.random(), side="right")


def cumulative_search(weights: np.ndarray, fraction: float, side: str) -> int:
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


def token_logprob(logits: np.ndarray, token_id: int, num_top: int, ws: Workspace) -> TokenLogprob:
    peak = logits.max()
    weights = np.exp(np.subtract(logits, peak, out=ws.weights), out=ws.weights)
    log_total = float(peak) + float(np.log(weights.sum()))  # float32 pairwise sum: no temporary
    top = top_positions(logits, num_top, ws) if num_top else np.empty(0, dtype=np.int64)
    top = top[np.lexsort((top, -logits[top]))]  # most likely first, ties → lower id
    pairs = [(int(i), float(logits[i]) - log_total) for i in top if np.isfinite(logits[i])]
    return TokenLogprob(int(token_id), float(logits[token_id]) - log_total, pairs)
