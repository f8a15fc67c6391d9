"""Sampler: turns one sequence's logits into the next token, the way llama.cpp's default chain does.

Order of operations (each step sees the result of the one before):

1. repetition penalty — llama.cpp/CTRL style over the last 64 tokens of prompt + output: every
   distinct token there has a positive logit divided by the penalty, a negative one multiplied;
2. presence and frequency penalties — OpenAI semantics over the generated tokens only:
   ``logit -= frequency_penalty * count + presence_penalty * (count > 0)``;
3. logit bias — ``logit += bias``; a bias of -100 or less bans the token outright (-inf); until
   min_tokens tokens are out, the request's stop tokens (end-of-generation included) carry that ban;
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

Cost on a 248k vocabulary: steps 1–3 are computed on the few ids they touch, and greedy without
logprobs is one argmax of the raw row (the row is copied only when the winner itself is touched);
truncation.py finds steps 4–6 without sorting the row.

Each Sampler owns a numpy Generator seeded with ``params.seed`` (fresh OS entropy when None), so
the same seed over the same logits gives the same token sequence.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from sparkinfer_cli.engine.sampling_params import SamplingParams
from sparkinfer_cli.engine.truncation import (
    Workspace,
    check_draft,
    choose,
    thread_workspace,
    top_positions,
)
from sparkinfer_cli.model.batch import DeviceDraw

REPETITION_WINDOW = 64  # llama.cpp's penalty_last_n default
BAN_BIAS = -100.0  # OpenAI: "-100 should result in a ban"
NO_IDS = np.empty(0, dtype=np.int64)


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token id, logprob), most likely first


@dataclass
class SampleResult:
    token_id: int
    logprob: TokenLogprob | None  # filled iff params.logprobs


@dataclass(frozen=True)
class TouchedLogits:
    """Steps 1–3 change a few logits only: their ascending ids and processed float32 values."""

    ids: np.ndarray  # (num_touched,) int64, ascending
    values: np.ndarray  # (num_touched,) float32

    def contains(self, token_id: int) -> bool:
        i = int(np.searchsorted(self.ids, token_id))
        return i < len(self.ids) and int(self.ids[i]) == token_id

    def apply(self, logits: np.ndarray, out: np.ndarray) -> np.ndarray:
        """The processed logits: a float32 copy with the touched values written in."""
        np.copyto(out, logits, casting="same_kind")
        out[self.ids] = self.values
        return out


NOTHING_TOUCHED = TouchedLogits(NO_IDS, np.empty(0, dtype=np.float32))


class TokenConstraint(Protocol):
    """What the sampler asks of a structured-output matcher (engine/constraint.py)."""

    def allowed(self) -> np.ndarray | None: ...
    def allowed_words(self) -> np.ndarray | None: ...
    def consume(self, token_id: int) -> None: ...


class Sampler:
    def __init__(self, params: SamplingParams, n_vocab: int, stop_token_ids: Iterable[int] = (),
                 constraint: TokenConstraint | None = None):
        """constraint: the tokens a structured answer allows (masked before choosing; told the
        chosen token)."""
        self.params = params
        self.n_vocab = n_vocab
        self.constraint = constraint
        self._rng = np.random.default_rng(params.seed)
        self._bias = logit_bias_arrays(params.logit_bias, n_vocab)
        stop_bans = {t: BAN_BIAS for t in stop_token_ids if 0 <= t < n_vocab} \
            if params.min_tokens else {}  # an id outside the vocabulary is never sampled anyway
        self._early_bias = logit_bias_arrays({**params.logit_bias, **stop_bans}, n_vocab)
        self._penalises = bool(params.repetition_penalty != 1.0 or params.presence_penalty
                               or params.frequency_penalty)
        # NOTE: exact while the min_tokens ban lasts: every token goes through sample() then
        self._num_output_tokens = 0

    @property
    def may_touch_logits(self) -> bool:
        """Whether steps 1–3 may change the next token's logits."""
        return self._penalises or self._bias_for(self._num_output_tokens)[0].size > 0

    @property
    def is_plain_greedy(self) -> bool:
        """The token is the argmax of the raw logits (GreedyBatch may sample it)."""
        return self.params.is_greedy and not self.params.logprobs and \
            not self.may_touch_logits and self.constraint is None

    def can_sample_on_device(self, max_top_k: int) -> bool:
        """Whether a device sampler that keeps the max_top_k best logits (CudaModel.
        forward_sampled) picks what sample() would from device_draw() and device_mask(): greedy
        or a top-k of at most max_top_k, with no logprobs, penalties or bias."""
        p = self.params
        return self.is_plain_greedy or (not p.logprobs and not self.may_touch_logits
                                        and (p.is_greedy or 1 <= p.top_k <= max_top_k))

    @property
    def checks_drafts_by_sampling(self) -> bool:
        """Whether check_draft keeps this request's output distribution: it samples from the raw
        logits (no penalties, bias, min_tokens ban or grammar; no logprobs to report)."""
        p = self.params
        return not p.is_greedy and not p.logprobs and self.constraint is None and \
            not self._penalises and not self._bias[0].size and not self._early_bias[0].size

    def check_draft(self, logits: np.ndarray, draft: int) -> tuple[int, bool]:
        """This token, given a drafted guess for it (checks_drafts_by_sampling): (draft, True)
        when speculative sampling keeps the draft, else (the token drawn instead, False)."""
        p = self.params
        check_finite(0, logits.max())
        return check_draft(logits, p.temperature, p.top_k, p.top_p, p.min_p, draft,
                           self._rng.random(), self._rng.random(), thread_workspace(self.n_vocab))

    def device_mask(self) -> np.ndarray | None:
        """The uint32 mask words of the tokens this token may be (constraint.allowed_words);
        None: any token."""
        return self.constraint.allowed_words() if self.constraint is not None else None

    def take(self, token_id: int) -> SampleResult:
        """A token picked elsewhere (on the device, or by GreedyBatch) as this token's sample."""
        if self.constraint is not None:
            self.constraint.consume(token_id)
        return SampleResult(token_id, None)

    def device_draw(self) -> DeviceDraw:
        """This token's draw for the device sampler; u is drawn from this request's generator as
        sample() draws it (none for greedy)."""
        p = self.params
        u = 0.0 if p.is_greedy else self._rng.random()
        return DeviceDraw(p.temperature, p.top_k, p.top_p, p.min_p, u)

    def sample(self, logits: np.ndarray, prompt_ids: Sequence[int],
               output_ids: Sequence[int]) -> SampleResult:
        if logits.shape != (self.n_vocab,):
            raise ValueError(f"logits have shape {logits.shape}, expected ({self.n_vocab},)")
        self._num_output_tokens = len(output_ids) + 1  # with the one picked now
        ws = thread_workspace(self.n_vocab)
        touched = self.touched_logits(logits, prompt_ids, output_ids)
        allowed = self.constraint.allowed() if self.constraint is not None else None
        if allowed is not None and not allowed.any():
            raise UnsatisfiableSampling(GRAMMAR_DEAD_END)
        if allowed is not None:  # NOTE: refused tokens out, then as without a constraint
            logits = touched.apply(logits, ws.logits)
            logits[~allowed] = -np.inf
            touched = NOTHING_TOUCHED
        result = self._sample(logits, touched, ws)
        if self.constraint is not None:
            self.constraint.consume(result.token_id)
        return result

    def _sample(self, logits: np.ndarray, touched: TouchedLogits, ws: Workspace) -> SampleResult:
        if logits.dtype != np.float32:  # NOTE: ties and argmax are decided in float32
            logits, touched = touched.apply(logits, ws.logits), NOTHING_TOUCHED
        if self.params.is_greedy and not self.params.logprobs:
            return SampleResult(greedy_token(logits, touched, ws), None)
        processed = touched.apply(logits, ws.logits) if touched.ids.size else logits
        token_id = self._choose(processed, ws)
        logprob = None
        if self.params.logprobs:
            logprob = token_logprob(processed, token_id, self.params.top_logprobs, ws)
        return SampleResult(token_id, logprob)

    def process_logits(self, logits: np.ndarray, prompt_ids: Sequence[int],
                       output_ids: Sequence[int], out: np.ndarray | None = None) -> np.ndarray:
        """Steps 1–3 on a float32 copy of the logits (written to `out` when given)."""
        out = np.empty(self.n_vocab, dtype=np.float32) if out is None else out  # (n_vocab,)
        return self.touched_logits(logits, prompt_ids, output_ids).apply(logits, out)

    def touched_logits(self, logits: np.ndarray, prompt_ids: Sequence[int],
                       output_ids: Sequence[int]) -> TouchedLogits:
        """Steps 1–3, computed on the few ids they touch."""
        p = self.params
        bias_ids, bias_values = self._bias_for(len(output_ids))
        if not (self._penalises or bias_ids.size):
            return NOTHING_TOUCHED
        penalised = np.unique(recent_tokens(prompt_ids, output_ids)) \
            if p.repetition_penalty != 1.0 else NO_IDS  # each distinct token penalised once
        counted, counts = np.unique(np.asarray(output_ids, dtype=np.int64), return_counts=True) \
            if (p.presence_penalty or p.frequency_penalty) and len(output_ids) else (NO_IDS, NO_IDS)
        ids = np.union1d(np.union1d(penalised, counted), bias_ids)  # (num_touched,)
        if not ids.size:
            return NOTHING_TOUCHED
        values = logits[ids].astype(np.float32)  # (num_touched,)
        if penalised.size:
            apply_repetition_penalty(values, np.searchsorted(ids, penalised), p.repetition_penalty)
        if counted.size:
            values[np.searchsorted(ids, counted)] -= \
                (p.frequency_penalty * counts + p.presence_penalty).astype(np.float32)
        values[np.searchsorted(ids, bias_ids)] += bias_values
        return TouchedLogits(ids, values)

    def _bias_for(self, num_output_tokens: int) -> tuple[np.ndarray, np.ndarray]:
        """(ids, values) of the logit bias for the token after num_output_tokens."""
        return self._early_bias if num_output_tokens < self.params.min_tokens else self._bias

    def _choose(self, logits: np.ndarray, ws: Workspace) -> int:
        p = self.params
        if p.is_greedy:
            return greedy_token(logits, NOTHING_TOUCHED, ws)
        check_finite(0, logits.max())
        return choose(logits, p.temperature, p.top_k, p.top_p, p.min_p, self._rng.random(), ws)


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


def apply_repetition_penalty(values: np.ndarray, positions: np.ndarray, penalty: float) -> None:
    seen = values[positions]
    values[positions] = np.where(seen > 0, seen / penalty, seen * penalty)


def greedy_token(logits: np.ndarray, touched: TouchedLogits, ws: Workspace) -> int:
    """argmax of the processed logits (ties → lowest id). The row is copied only when the raw
    winner is itself touched, or a touched value is NaN or +inf."""
    best = int(np.argmax(logits))
    if not touched.ids.size:
        return check_finite(best, logits[best])
    if touched.contains(best) or not (touched.values < np.inf).all():
        processed = touched.apply(logits, ws.logits)
        best = int(np.argmax(processed))
        return check_finite(best, processed[best])
    i = int(np.argmax(touched.values))  # ties → lowest touched id (ids ascend)
    rival, value = int(touched.ids[i]), touched.values[i]
    if value > logits[best] or (value == logits[best] and rival < best):
        return check_finite(rival, value)
    return check_finite(best, logits[best])


class UnsatisfiableSampling(ValueError):
    """No token can be sampled under the request's own settings (a client error, not a fault)."""


GRAMMAR_DEAD_END = "the answer's grammar (response_format or tools) allows no next token"


def check_finite(token_id: int, logit: float) -> int:
    if not math.isfinite(logit):
        raise UnsatisfiableSampling("every token is banned (logit_bias, min_tokens) or the "
                                    "sampling settings make the logits non-finite")
    return token_id


def token_logprob(logits: np.ndarray, token_id: int, num_top: int, ws: Workspace) -> TokenLogprob:
    peak = logits.max()
    weights = np.exp(np.subtract(logits, peak, out=ws.weights), out=ws.weights)
    log_total = float(peak) + float(np.log(weights.sum()))  # float32 pairwise sum: no temporary
    top = top_positions(logits, num_top, ws) if num_top else np.empty(0, dtype=np.int64)
    top = top[np.lexsort((top, -logits[top]))]  # most likely first, ties → lower id
    pairs = [(int(i), float(logits[i]) - log_total) for i in top if np.isfinite(logits[i])]
    return TokenLogprob(int(token_id), float(logits[token_id]) - log_total, pairs)
