"""Response builders: engine events → OpenAI chat or completion chunks, and the fold of them."""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from sparkinfer_cli import __version__
from sparkinfer_cli.server.protocol import ChatCompletionRequest
from sparkinfer_cli.server.stream_router import RoutedText, StreamRouter

if TYPE_CHECKING:
    from sparkinfer_cli.server.routes import ServerState

MIN_LOGPROB = -9999.0  # OpenAI's floor; -inf is not valid JSON
# OpenAI's backend configuration id, constant for a server build (clients log it with seeds)
SYSTEM_FINGERPRINT = f"fp_sparkinfer_{__version__}"


@dataclass(frozen=True)
class Timings:
    ttft_ms: float
    generation_ms: float
    decode_tps: float


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    reasoning_tokens: int = 0
    timings: Timings | None = None
    cached_tokens: int = 0  # prompt tokens whose KV was reused rather than computed

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
            "completion_tokens_details": {"reasoning_tokens": self.reasoning_tokens},
        }
        if self.timings is not None:
            out.update(ttft_ms=round(self.timings.ttft_ms, 3),
                       generation_ms=round(self.timings.generation_ms, 3),
                       decode_tps=round(self.timings.decode_tps, 3))
        return out


@dataclass(frozen=True)
class ResponseHeader:
    """The fields shared by every chunk of one response (OpenAI keeps id and created constant)."""

    id: str
    model: str
    created: int = field(default_factory=lambda: int(time.time()))

    def chat(self, choices: list[dict[str, Any]], usage: Usage | None) -> dict[str, Any]:
        return self._object("chat.completion", choices, usage)

    def chat_chunk(self, choices: list[dict[str, Any]],
                   usage: Usage | None = None) -> dict[str, Any]:
        return self._object("chat.completion.chunk", choices, usage)

    def completion(self, choices: list[dict[str, Any]], usage: Usage | None) -> dict[str, Any]:
        return self._object("text_completion", choices, usage)

    def _object(self, kind: str, choices: list[dict[str, Any]],
                usage: Usage | None) -> dict[str, Any]:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model,
                "system_fingerprint": SYSTEM_FINGERPRINT, "choices": choices,
                "usage": usage.to_dict() if usage else None}


_ENCODER = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))  # built once: hot path


def dumps(obj: Any) -> str:
    return _ENCODER.encode(obj)


class TokenTexts:
    """Token id → text and bytes for logprobs (cached; vocabularies repeat tokens a lot)."""

    def __init__(self, tokenizer: Any):
        self._tokenizer = tokenizer
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def entry(self, token_id: int) -> tuple[str, list[int]]:
        if token_id not in self._cache:
            data = self._tokenizer.token_bytes(token_id)
            self._cache[token_id] = (data.decode("utf-8", errors="replace"), list(data))
        return self._cache[token_id]

    def chat_logprob(self, lp: Any, top_k: int) -> dict[str, Any]:
        text, data = self.entry(lp.token_id)
        top = [{"token": t, "logprob": max(v, MIN_LOGPROB), "bytes": b}
               for (t, b), v in ((self.entry(i), v) for i, v in lp.top[:top_k])]
        return {"token": text, "logprob": max(lp.logprob, MIN_LOGPROB), "bytes": data,
                "top_logprobs": top}


def _timings(events: list[Any]) -> Timings | None:
    firsts = [e.first_token_at for e in events if e.first_token_at is not None]
    if not firsts:
        return None
    submitted, first = min(e.submitted_at for e in events), min(firsts)
    finished = max(e.finished_at or time.monotonic() for e in events)
    decode_tokens = sum(max(e.num_output_tokens - 1, 0) for e in events)
    generation_s = max(finished - first, 0.0)
    return Timings(ttft_ms=(first - submitted) * 1000, generation_ms=generation_s * 1000,
                   decode_tps=decode_tokens / generation_s if generation_s > 0 else 0.0)


class ChatChoice:
    """One choice of a chat completion: routes its events into deltas and keeps the fold."""

    def __init__(self, index: int, router: StreamRouter, texts: TokenTexts,
                 top_logprobs: int | None, parallel_tool_calls: bool):
        self.index, self.router, self.texts = index, router, texts
        self.top_logprobs, self.parallel_tool_calls = top_logprobs, parallel_tool_calls
        # NOTE: lists of parts, joined once at the end: += on a growing string is quadratic
        self.content: list[str] = []
        self.reasoning: list[str] = []
        self.tool_calls: list[Any] = []
        self.logprobs: list[dict[str, Any]] = []
        self.last_event: Any = None
        self.num_reasoning_tokens = 0
        self.finish_reason: str | None = None

    def push(self, event: Any) -> list[dict[str, Any]]:
        """The streaming choice deltas for this event, as OpenAI sends them: the first one a
        role-only delta with empty content, the finish reason alone with an empty delta."""
        is_first = self.last_event is None
        self.last_event = event
        if self.router.in_reasoning:
            self.num_reasoning_tokens += len(event.token_ids)
        routed = self.router.push(event.text)
        if event.finish_reason is not None:
            routed.extend(self.router.finish())
        routed.tool_calls = self._admit_calls(routed.tool_calls)
        self.content.append(routed.content)
        self.reasoning.append(routed.reasoning)
        self.tool_calls += routed.tool_calls
        logprobs = self._logprobs(event)
        if event.finish_reason is not None:
            self.finish_reason = "tool_calls" if self.tool_calls and \
                event.finish_reason == "stop" else event.finish_reason
        delta = self._delta(routed)
        deltas = [self._choice_delta({"role": "assistant", "content": ""})] if is_first else []
        if delta or logprobs:
            deltas.append(self._choice_delta(delta, logprobs))
        if self.finish_reason is not None:
            deltas.append(self._choice_delta({}, finish_reason=self.finish_reason))
        return deltas

    def _choice_delta(self, delta: dict[str, Any], logprobs: list[dict[str, Any]] | None = None,
                      finish_reason: str | None = None) -> dict[str, Any]:
        return {"index": self.index, "delta": delta,
                "logprobs": {"content": logprobs} if logprobs else None,
                "finish_reason": finish_reason}

    def _admit_calls(self, calls: list[Any]) -> list[Any]:
        if self.parallel_tool_calls:
            return calls
        return calls[:max(1 - len(self.tool_calls), 0)]

    def _logprobs(self, event: Any) -> list[dict[str, Any]]:
        if self.top_logprobs is None:
            return []
        entries = [self.texts.chat_logprob(lp, self.top_logprobs) for lp in event.logprobs]
        self.logprobs += entries
        return entries

    def _delta(self, routed: RoutedText) -> dict[str, Any]:
        delta: dict[str, Any] = {}
        if routed.reasoning:
            delta["reasoning_content"] = delta["reasoning"] = routed.reasoning
        if routed.content:
            delta["content"] = routed.content
        if routed.tool_calls:
            first = len(self.tool_calls) - len(routed.tool_calls)
            delta["tool_calls"] = [{"index": first + k, **call.to_dict()}
                                   for k, call in enumerate(routed.tool_calls)]
        return delta

    def message(self) -> dict[str, Any]:
        content, reasoning = "".join(self.content), "".join(self.reasoning)
        message: dict[str, Any] = {"role": "assistant",
                                   "content": content or (None if self.tool_calls else "")}
        if reasoning:
            message["reasoning_content"] = message["reasoning"] = reasoning
        if self.tool_calls:
            message["tool_calls"] = [call.to_dict() for call in self.tool_calls]
        return {"index": self.index, "message": message,
                "logprobs": {"content": self.logprobs} if self.top_logprobs is not None else None,
                "finish_reason": self.finish_reason}


class ChatResponse:
    def __init__(self, header: ResponseHeader, chat: ChatCompletionRequest, state: ServerState,
                 num_prompt_tokens: int, thinking_open: bool, forced_prefix: str):
        texts = state.token_texts
        self.header, self.include_usage = header, chat.include_usage
        self.num_prompt_tokens = num_prompt_tokens
        self.choices = [ChatChoice(i, StreamRouter(reasoning=state.parses_reasoning,
                                                   thinking_open=thinking_open, tools=chat.tools),
                                   texts, chat.top_logprobs, chat.parallel_tool_calls)
                        for i in range(chat.n)]
        for choice in self.choices:  # the prompt already opened the forced tool call
            choice.router.push(forced_prefix)

    def push(self, index: int, event: Any) -> list[dict[str, Any]]:
        """The stream chunks of this event (none when it adds nothing to send)."""
        chunks = [self.header.chat_chunk([delta]) for delta in self.choices[index].push(event)]
        if not self.include_usage:
            for chunk in chunks:
                del chunk["usage"]
        return chunks

    def usage(self) -> Usage:
        events = [c.last_event for c in self.choices if c.last_event is not None]
        return Usage(self.num_prompt_tokens, sum(e.num_output_tokens for e in events),
                     sum(c.num_reasoning_tokens for c in self.choices), _timings(events),
                     max((e.num_cached_tokens for e in events), default=0))  # one prompt

    def usage_chunk(self) -> dict[str, Any] | None:
        return self.header.chat_chunk([], self.usage()) if self.include_usage else None

    def response(self) -> dict[str, Any]:
        return self.header.chat([c.message() for c in self.choices], self.usage())

    def token_counts(self) -> tuple[int, int]:
        return self.num_prompt_tokens, self.usage().completion_tokens


class CompletionResponse:
    """Legacy /v1/completions: choice index = prompt index × n + sample index."""

    def __init__(self, header: ResponseHeader, state: ServerState, prompts: list[list[int]],
                 n: int, echo_texts: list[str], top_logprobs: int | None, include_usage: bool):
        self.header, self.include_usage = header, include_usage
        self.prompts, self.n, self.top_logprobs = prompts, n, top_logprobs
        self.prompt_lengths = [len(ids) for ids in prompts]
        self.texts_of = state.token_texts
        count = len(prompts) * n
        self.texts = [[echo_texts[i // n]] for i in range(count)]  # parts, joined at the end
        self.lengths = [len(echo_texts[i // n]) for i in range(count)]
        self.pending_echo = [bool(echo_texts[i // n]) for i in range(count)]
        self.logprobs: list[dict[str, list[Any]]] = [
            {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
            for _ in range(count)]
        self.last_events: list[Any] = [None] * count

    def push(self, index: int, event: Any) -> list[dict[str, Any]]:
        """The stream chunk of this event, as a list of one (none when it adds nothing)."""
        offset = self.lengths[index]
        text = self.texts[index][0] if self.pending_echo[index] else ""
        self.pending_echo[index] = False
        self.texts[index].append(event.text)
        self.lengths[index] += len(event.text)
        self.last_events[index] = event
        logprobs = self._logprobs(index, event, offset)
        if not (text + event.text or logprobs or event.finish_reason):
            return []
        choice = {"index": index, "text": text + event.text, "logprobs": logprobs,
                  "finish_reason": event.finish_reason}
        chunk = self.header.completion([choice], None)
        if not self.include_usage:
            del chunk["usage"]
        return [chunk]

    def _logprobs(self, index: int, event: Any, offset: int) -> dict[str, list[Any]] | None:
        if self.top_logprobs is None:
            return None
        part: dict[str, list[Any]] = {k: [] for k in self.logprobs[index]}
        if event.prompt_logprobs:  # echo: the prompt's tokens first, the first one unscored
            self._add_entries(part, zip(self.prompts[index // self.n], event.prompt_logprobs), 0)
        self._add_entries(part, ((lp.token_id, lp) for lp in event.logprobs), offset)
        for key, values in part.items():
            self.logprobs[index][key] += values
        return part

    def _add_entries(self, part: dict[str, list[Any]], entries: Iterable[tuple[int, Any]],
                     offset: int) -> None:
        """Appends (token id, its TokenLogprob or None) entries at text offset `offset`."""
        for token_id, lp in entries:
            text, _ = self.texts_of.entry(token_id)
            part["tokens"].append(text)
            part["token_logprobs"].append(None if lp is None else max(lp.logprob, MIN_LOGPROB))
            part["top_logprobs"].append(None if lp is None else self._top_logprobs(lp, text))
            part["text_offset"].append(offset)
            offset += len(text)

    def _top_logprobs(self, lp: Any, text: str) -> dict[str, float]:
        """The top `logprobs` alternatives and, as OpenAI always adds it, the sampled token."""
        top = {self.texts_of.entry(i)[0]: max(v, MIN_LOGPROB)
               for i, v in lp.top[:self.top_logprobs]}
        top.setdefault(text, max(lp.logprob, MIN_LOGPROB))
        return top

    def usage(self) -> Usage:
        events = [e for e in self.last_events if e is not None]
        return Usage(sum(self.prompt_lengths), sum(e.num_output_tokens for e in events),
                     timings=_timings(events),
                     cached_tokens=sum(e.num_cached_tokens for e in events))

    def usage_chunk(self) -> dict[str, Any] | None:
        return self.header.completion([], self.usage()) if self.include_usage else None

    def response(self) -> dict[str, Any]:
        choices = [{"index": i, "text": "".join(parts),
                    "logprobs": self.logprobs[i] if self.top_logprobs is not None else None,
                    "finish_reason": e.finish_reason if e else None}
                   for i, (parts, e) in enumerate(zip(self.texts, self.last_events))]
        return self.header.completion(choices, self.usage())

    def token_counts(self) -> tuple[int, int]:
        return sum(self.prompt_lengths), self.usage().completion_tokens
