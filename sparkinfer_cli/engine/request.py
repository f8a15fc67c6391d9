"""Request: one generation's progress (two integers) and its output stream; RequestEvent: what
the engine reports to the caller."""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Container
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import numpy as np

from sparkinfer_cli.engine.sampler import token_logprob
from sparkinfer_cli.engine.sampling_params import SamplingParams
from sparkinfer_cli.engine.speculative import DraftLength
from sparkinfer_cli.engine.truncation import thread_workspace

if TYPE_CHECKING:
    from sparkinfer_cli.engine.kv_cache import KVBlocks
    from sparkinfer_cli.engine.sampler import Sampler, SampleResult, TokenLogprob


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class RequestEvent:
    request_id: str
    token_ids: list[int]  # tokens produced since the previous event
    text: str  # text produced since the previous event (UTF-8 complete, stop strings removed)
    # None while running; stop | length | abort | timeout | error | rejected (the request's own
    # settings leave no token to sample)
    finish_reason: str | None
    logprobs: list[TokenLogprob]  # one per token in token_ids when requested, else []
    num_prompt_tokens: int
    num_output_tokens: int
    submitted_at: float  # time.monotonic()
    scheduled_at: float | None
    first_token_at: float | None
    finished_at: float | None
    error: str | None = None
    num_cached_tokens: int = 0  # prompt tokens the prefix cache supplied
    # SamplingParams.prompt_logprobs: one per prompt token (None for the first), in the first
    # event only
    prompt_logprobs: list[TokenLogprob | None] | None = None


class TextPiece(Protocol):
    def push(self, token_id: int) -> str: ...
    def flush(self) -> str: ...


class StopMatcher(Protocol):
    def push(self, text: str) -> tuple[str, bool]: ...
    def flush(self) -> str: ...


class OutputStream:
    """Sampled tokens → event deltas: detokenizes, removes stop strings, stops on stop tokens."""

    def __init__(self, detokenizer: TextPiece, stop_matcher: StopMatcher,
                 stop_token_ids: Container[int]):
        self.detokenizer, self.stop_matcher = detokenizer, stop_matcher
        self.stop_token_ids = stop_token_ids
        self.token_ids: list[int] = []
        self.text = ""
        self.logprobs: list[TokenLogprob] = []

    def push(self, result: SampleResult, is_last: bool, may_stop: bool = True) -> str | None:
        """Adds one token; returns the finish reason if it ends the generation. Unless may_stop
        (within min_tokens), stop tokens and stop strings do not end it."""
        self.token_ids.append(result.token_id)
        if result.logprob is not None:
            self.logprobs.append(result.logprob)
        if may_stop and result.token_id in self.stop_token_ids:
            self._flush(may_stop)
            return "stop"
        text, stopped = self._match(self.detokenizer.push(result.token_id), may_stop)
        self.text += text
        if stopped:
            return "stop"
        return ("stop" if self._flush(may_stop) else "length") if is_last else None

    def _match(self, text: str, may_stop: bool) -> tuple[str, bool]:
        """(text to emit, stopped?); stop strings are looked for only in text that may stop."""
        return self.stop_matcher.push(text) if may_stop else (text, False)

    def _flush(self, may_stop: bool) -> bool:
        """Emits held-back text at the end; True if that text completed a stop string."""
        text, stopped = self._match(self.detokenizer.flush(), may_stop)
        self.text += text if stopped else text + self.stop_matcher.flush()
        return stopped

    def take(self) -> tuple[list[int], str, list[TokenLogprob]]:
        delta = self.token_ids, self.text, self.logprobs
        self.token_ids, self.text, self.logprobs = [], "", []
        return delta


@dataclass(eq=False)
class Request:
    """Progress is `num_computed_tokens` (tokens whose KV is in the cache) chasing `num_tokens`."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams  # max_tokens already capped by the engine
    on_event: Callable[[RequestEvent], None] = lambda event: None
    priority: int = 0
    arrival_seq: int = 0
    output: OutputStream | None = None
    sampler: Sampler | None = None
    deadline: float | None = None  # time.monotonic() after which the request times out
    submitted_at: float = field(default_factory=time.monotonic)
    token_ids: list[int] = field(init=False)  # prompt + output
    output_ids: list[int] = field(default_factory=list)  # NOTE: kept apart for the sampler
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at admission
    # SamplingParams.prompt_logprobs, filled as its prompt is computed; None once sent
    prompt_logprobs: list[TokenLogprob | None] | None = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    kv: KVBlocks | None = None
    # its decode steps' n-gram drafts (EngineConfig.spec_tokens); None: it drafts none
    drafting: DraftLength | None = None
    block_keys: list[bytes] = field(default_factory=list)  # prefix-cache keys of its full blocks
    last_scheduled: int = -1  # stamp of its latest scheduling: decodes rotate by it
    scheduled_at: float | None = None
    first_token_at: float | None = None
    finished_at: float | None = None
    finish_reason: str | None = None
    error: str | None = None

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_ids)

    @property
    def num_kv_tokens(self) -> int:
        """Positions reserved in the KV cache: prompt + max_tokens (the last sampled token is never
        fed back, which leaves one position of headroom)."""
        return len(self.prompt_ids) + self.params.max_tokens

    @property
    def is_prefilling(self) -> bool:
        return self.num_computed_tokens < len(self.prompt_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def append_sample(self, result: SampleResult) -> str | None:
        """Appends a sampled token; returns the finish reason if the generation is over."""
        self.token_ids.append(result.token_id)
        self.output_ids.append(result.token_id)
        if self.first_token_at is None:
            self.first_token_at = time.monotonic()
        is_last = self.num_output_tokens >= self.params.max_tokens
        if self.output is None:
            return "length" if is_last else None
        return self.output.push(result, is_last, self.num_output_tokens > self.params.min_tokens)

    def take_event(self) -> RequestEvent:
        token_ids, text, logprobs = self.output.take() if self.output else ([], "", [])
        return RequestEvent(self.request_id, token_ids, text, self.finish_reason, logprobs,
                            self.num_prompt_tokens, self.num_output_tokens, self.submitted_at,
                            self.scheduled_at, self.first_token_at, self.finished_at, self.error,
                            self.num_cached_tokens, self._take_prompt_logprobs())

    def add_prompt_logprobs(self, logits: np.ndarray, start: int) -> None:
        """logits (piece, n_vocab) of prompt positions start…: each row scores the next prompt
        token (the first token has no logprob)."""
        assert self.prompt_logprobs is not None
        if start == 0:
            self.prompt_logprobs.append(None)
        num_top = self.params.prompt_logprobs or 0
        ws = thread_workspace(logits.shape[1])
        for i, row in enumerate(logits):
            if start + i + 1 < self.num_prompt_tokens:
                self.prompt_logprobs.append(
                    token_logprob(row, self.prompt_ids[start + i + 1], num_top, ws))

    @property
    def wants_prompt_logits(self) -> bool:
        """Its prefill needs the logits of every prompt token (SamplingParams.prompt_logprobs)."""
        return self.params.prompt_logprobs is not None

    def _take_prompt_logprobs(self) -> list[TokenLogprob | None] | None:
        if not self.wants_prompt_logits or self.is_prefilling or self.prompt_logprobs is None:
            return None
        taken, self.prompt_logprobs = self.prompt_logprobs, None
        return taken
