"""Prompts through the engine, as streams of text: what `sparkinfer generate` and `chat` run."""

from __future__ import annotations

import dataclasses
import queue
import threading
from collections.abc import Iterator
from dataclasses import dataclass

from sparkinfer_cli.engine.config import EngineConfig
from sparkinfer_cli.engine.engine import ContinuousBatchEngine
from sparkinfer_cli.engine.request import RequestEvent
from sparkinfer_cli.engine.sampling_params import SamplingParams
from sparkinfer_cli.engine.speculative import SpeculationStats
from sparkinfer_cli.tokenizer.chat_template import ChatTemplate
from sparkinfer_cli.tokenizer.tokenizer import Tokenizer

# room the warm-up requests need in the KV pool (their blocks stay cached, evictable)
WARM_UP_TOKENS = 32


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    prompt_tok_s: float = 0.0
    decode_tok_s: float = 0.0
    finish_reason: str | None = None
    drafts: SpeculationStats | None = None  # the answer's drafts (None: speculation off)

    @classmethod
    def from_event(cls, e: RequestEvent) -> GenerationStats:
        prefill_s = (e.first_token_at or 0) - (e.scheduled_at or e.submitted_at)
        decode_s = (e.finished_at or 0) - (e.first_token_at or 0)
        computed = e.num_prompt_tokens - e.num_cached_tokens
        return cls(e.num_prompt_tokens, e.num_cached_tokens, e.num_output_tokens,
                   computed / prefill_s if prefill_s > 0 else 0.0,
                   (e.num_output_tokens - 1) / decode_s if decode_s > 0 else 0.0,
                   e.finish_reason)


def build_prompt(tokenizer: Tokenizer, text: str, *, raw: bool, system: str | None,
                 enable_thinking: bool = True) -> list[int]:
    """Prompt ids: the text itself (raw) or a one-turn chat through the model's template."""
    if raw:
        return tokenizer.encode(text)
    messages = ([{"role": "system", "content": system}] if system else []) + \
        [{"role": "user", "content": text}]
    return chat_prompt(tokenizer, messages, enable_thinking)


def chat_prompt(tokenizer: Tokenizer, messages: list[dict], enable_thinking: bool = True
                ) -> list[int]:
    """The ids of `messages` rendered by the model's chat template, ready for the answer."""
    kwargs = {} if enable_thinking else {"enable_thinking": False}
    rendered = ChatTemplate.from_tokenizer(tokenizer).render(messages, **kwargs)
    return tokenizer.encode(rendered, parse_special=True)


class GenerationSession:
    """One engine for a run of prompts, one at a time: a chat's turns share its prefix cache,
    so each turn prefills only what it adds to the last."""

    def __init__(self, model, tokenizer: Tokenizer, ctx: int, spec_tokens: int = 0,
                 draft_model=None, use_mtp: bool = False):
        """ctx: the KV pool in tokens; the longest prompt + answer is ctx - WARM_UP_TOKENS;
        spec_tokens: drafts a decode step checks at most (EngineConfig.spec_tokens), n-gram ones,
        draft_model's or (use_mtp) the model's MTP head's."""
        self.max_tokens = ctx - WARM_UP_TOKENS
        self.engine = ContinuousBatchEngine(model, tokenizer, EngineConfig(
            ctx=ctx, max_batch_tokens=64, max_num_seqs=1, max_output_tokens=ctx,
            spec_tokens=spec_tokens), draft_model, use_mtp)
        self.engine.start()

    def warm_up(self, params: SamplingParams, timeout_s: float = 600.0) -> None:
        """A throwaway request down the paths a first request takes (a prompt through the
        prefill kernels, then decoding with `params`' sampling), so that compiling them, or
        loading them from numba's cache, is paid here and not in the speeds reported."""
        n_vocab = self.engine.n_vocab
        settings = dataclasses.replace(params, max_tokens=2, min_tokens=0, ignore_eos=True,
                                       stop=(), stop_token_ids=())
        done = threading.Event()
        self.engine.submit([(7 + i) % n_vocab for i in range(16)], settings,
                           lambda e: done.set() if e.finish_reason is not None else None)
        if not done.wait(timeout_s):
            raise RuntimeError(f"the warm-up did not finish in {timeout_s:.0f} s")

    def stream(self, prompt_ids: list[int], params: SamplingParams,
               stats: GenerationStats) -> Iterator[str]:
        """Yields text as it is produced; fills `stats` at the end. Closing the iterator (Ctrl-C)
        aborts the request."""
        events: queue.Queue[RequestEvent] = queue.Queue()
        drafts_before = self.engine.stats().speculation
        request_id = self.engine.submit(prompt_ids, params, events.put)
        try:
            while True:
                event = events.get()
                if event.error:
                    raise RuntimeError(event.error)
                if event.text:
                    yield event.text
                if event.finish_reason is not None:
                    vars(stats).update(vars(GenerationStats.from_event(event)))
                    drafts_after = self.engine.stats().speculation
                    if drafts_before is not None and drafts_after is not None:
                        stats.drafts = drafts_after.since(drafts_before)
                    return
        finally:
            self.engine.abort(request_id)

    def close(self) -> None:
        self.engine.shutdown(wait=True)
