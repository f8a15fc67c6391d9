"""SamplingParams: how one request turns logits into tokens and when it stops."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 1.0  # 0 → greedy
    top_k: int = 0  # 0 → off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # llama.cpp style: positive logits / p, negative · p
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False  # end-of-generation tokens do not stop the request
    # vLLM: stop tokens are banned from, and stop strings ignored in, the first min_tokens tokens;
    # NOTE: not checked against max_tokens, which the engine may lower (the API checks it)
    min_tokens: int = 0
    logprobs: bool = False
    top_logprobs: int = 0
    # vLLM's prompt_logprobs: each prompt token's logprob (the first has none) with this many
    # alternatives, as OpenAI's echo + logprobs returns them (None = off); such a request computes
    # its whole prompt (no prefix-cache hit) and may ask for max_tokens 0 (scoring only)
    prompt_logprobs: int | None = None
    # constrained output: the answer follows this llguidance grammar (engine/constraint.py: a
    # JSON schema's or a Lark grammar's); reasoning_tokens (<think>, </think>): reasoning before
    # it stays free, whether the prompt opened the thought (reasoning_open) or the answer opens it
    grammar: str | None = None
    reasoning_tokens: tuple[int, int] | None = None
    reasoning_open: bool = False
    # hybrid models: prompt positions where the prefix cache keeps a recurrent-state snapshot
    # (where the conversation's next turn will likely part from this prompt: the end of the
    # messages, before the generation prompt); not a sampling setting, it rides along with them
    snapshot_positions: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        checks = [
            (self.max_tokens >= 1 or (self.max_tokens == 0 and self.prompt_logprobs is not None),
             "max_tokens must be at least 1 (0 only to score a prompt: prompt_logprobs)"),
            (self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= 20,
             "prompt_logprobs must be in [0, 20]"),
            (self.min_tokens >= 0, "min_tokens must be >= 0"),
            (self.temperature >= 0, "temperature must be >= 0"),
            (self.top_k >= 0, "top_k must be >= 0"),
            (0 < self.top_p <= 1, "top_p must be in (0, 1]"),
            (0 <= self.min_p <= 1, "min_p must be in [0, 1]"),
            (self.repetition_penalty > 0, "repetition_penalty must be > 0"),
            (-2 <= self.presence_penalty <= 2, "presence_penalty must be in [-2, 2]"),
            (-2 <= self.frequency_penalty <= 2, "frequency_penalty must be in [-2, 2]"),
            (0 <= self.top_logprobs <= 20, "top_logprobs must be in [0, 20]"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0
