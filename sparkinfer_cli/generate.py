"""One prompt through the engine, as a stream of text: what `sparkinfer generate` runs."""

from __future__ import annotations

import queue
from collections.abc import Iterator
from dataclasses import dataclass

from sparkinfer_cli.engine.config import EngineConfig
from sparkinfer_cli.engine.engine import ContinuousBatchEngine, warm_up
from sparkinfer_cli.engine.request import RequestEvent
from sparkinfer_cli.engine.sampling_params import SamplingParams
from sparkinfer_cli.tokenizer.chat_template import ChatTemplate
from sparkinfer_cli.tokenizer.tokenizer import Tokenizer


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    output_tokens: int = 0
    prompt_tok_s: float = 0.0
    decode_tok_s: float = 0.0
    finish_reason: str | None = None

    @classmethod
    def from_event(cls, e: RequestEvent) -> GenerationStats:
        prefill_s = (e.first_token_at or 0) - (e.scheduled_at or e.submitted_at)
        decode_s = (e.finished_at or 0) - (e.first_token_at or 0)
        return cls(e.num_prompt_tokens, e.num_output_tokens,
                   e.num_prompt_tokens / prefill_s if prefill_s > 0 else 0.0,
                   (e.num_output_tokens - 1) / decode_s if decode_s > 0 else 0.0,
                   e.finish_reason)


def build_prompt(tokenizer: Tokenizer, text: str, *, raw: bool, system: str | None,
                 enable_thinking: bool = True) -> list[int]:
    """Prompt ids: the text itself (raw) or a one-turn chat through the model's template."""
    if raw:
        return tokenizer.encode(text)
    messages = ([{"role": "system", "content": system}] if system else []) + \
        [{"role": "user", "content": text}]
    kwargs = {} if enable_thinking else {"enable_thinking": False}
    rendered = ChatTemplate.from_tokenizer(tokenizer).render(messages, **kwargs)
    return tokenizer.encode(rendered, parse_special=True)


def stream_generation(model, tokenizer: Tokenizer, prompt_ids: list[int],
                      params: SamplingParams, stats: GenerationStats) -> Iterator[str]:
    """Yields text as it is produced; fills `stats` at the end. Closing the iterator (Ctrl-C)
    aborts the request."""
    # room for this request and for the warm-up one (16 + 2 tokens)
    ctx = min(max(len(prompt_ids) + params.max_tokens, 32) + 32, model.config.context_length)
    engine = ContinuousBatchEngine(model, tokenizer, EngineConfig(
        ctx=ctx, max_batch_tokens=max(64, len(prompt_ids)), max_num_seqs=1,
        max_output_tokens=params.max_tokens))
    events: queue.Queue[RequestEvent] = queue.Queue()
    engine.start()
    warm_up(engine)  # compile before timing, so the reported speeds are the model's
    request_id = engine.submit(prompt_ids, params, events.put)
    try:
        while True:
            event = events.get()
            if event.error:
                raise RuntimeError(event.error)
            if event.text:
                yield event.text
            if event.finish_reason is not None:
                vars(stats).update(vars(GenerationStats.from_event(event)))
                return
    finally:
        engine.abort(request_id)
        engine.shutdown(wait=True)
