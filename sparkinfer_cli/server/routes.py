"""Route handlers: parse and validate, delegate to AsyncEngine, shape the stream.

Streaming and non-streaming share one path: each engine event goes through a response builder
that returns the SSE chunk for it; a non-streaming response is the builder's fold of the same
events. Streaming responses wait for the first event before sending headers, so errors that
happen before any token (429, 504 in the queue, 400) still get a real HTTP status.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Any, TypeVar, cast
from urllib.parse import unquote

from sanic import Request
from sanic.http import Http
from sanic.response import HTTPResponse, json, raw

from sparkinfer_cli.engine.constraint import json_schema_grammar, lark_grammar
from sparkinfer_cli.engine.engine import EngineStats
from sparkinfer_cli.server.async_engine import AsyncEngine, Generation
from sparkinfer_cli.server.config import ServerConfig
from sparkinfer_cli.server.metrics import CONTENT_TYPE, ServerMetrics, outcome_of_status
from sparkinfer_cli.server.protocol import (
    ApiError,
    ChatCompletionRequest,
    invalid,
    parse_chat_request,
    parse_completion_request,
    parse_json_body,
    parse_tokenize_request,
)
from sparkinfer_cli.server.responses import (
    ChatResponse,
    CompletionResponse,
    ResponseHeader,
    TokenTexts,
)
from sparkinfer_cli.server.sse_framing import OPENAI_CHAT_SSE, SseFraming
from sparkinfer_cli.server.stream_router import THINK_CLOSE, THINK_OPEN, prompt_opens_thinking
from sparkinfer_cli.server.tool_call_grammar import tool_call_grammar
from sparkinfer_cli.server.tool_calls import forced_call_prefix, uses_xml_format

log = logging.getLogger(__name__)

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}

T = TypeVar("T")


@dataclass
class ServerState:
    """What every handler needs; lives on app.ctx.state."""

    engine: AsyncEngine
    tokenizer: Any
    template: Any
    config: ServerConfig
    metrics: ServerMetrics
    started_at: int
    token_texts: TokenTexts

    @property
    def max_context(self) -> int:
        return int(self.engine.engine.max_context)

    @property
    def vocab_size(self) -> int:
        return int(self.tokenizer.vocab_size)

    @property
    def parses_reasoning(self) -> bool:
        """Thinking models name <think> in their template or vocabulary."""
        if not self.config.parse_reasoning:
            return False
        return THINK_OPEN in self.template_source or self.tokenizer.id_of(THINK_OPEN) is not None

    @property
    def template_source(self) -> str:
        return getattr(self.template, "source", "") or ""


def _state(request: Request) -> ServerState:
    return request.app.ctx.state


# ---------------------------------------------------------------- request bodies

async def read_body(request: Request) -> bytes:
    """The request body, read chunk by chunk: each chunk must arrive within read_timeout_s
    (reset on every byte, so slow uploads pass and stalled ones do not hold a connection), and
    more than max_request_bytes is a 413."""
    config = _state(request).config
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > config.max_request_bytes:
        raise _too_large(config.max_request_bytes)
    if request.stream is None:
        return request.body or b""
    stream = cast(Http, request.stream)  # the HTTP/1.1 protocol reads the body (Http.read)
    chunks, size = list[bytes](), 0
    while True:
        try:
            chunk = await asyncio.wait_for(stream.read(), config.read_timeout_s)
        except asyncio.TimeoutError:
            raise ApiError(408, "the request body stalled for longer than the read timeout",
                           type="timeout_error", code="request_timeout") from None
        if chunk is None:
            return b"".join(chunks)
        size += len(chunk)
        if size > config.max_request_bytes:
            raise _too_large(config.max_request_bytes)
        chunks.append(chunk)


def _too_large(limit: int) -> ApiError:
    return ApiError(413, f"the request body is larger than {limit} bytes",
                    code="request_too_large")


# ---------------------------------------------------------------- info routes


async def health(request: Request) -> HTTPResponse:
    if _state(request).engine.is_draining:
        return json({"status": "draining"}, status=503)
    return json({"status": "ok"})


def _model_card(state: ServerState) -> dict[str, Any]:
    return {"id": state.config.model_name, "object": "model", "created": state.started_at,
            "owned_by": "sparkinfer", "context_length": state.max_context,
            "max_model_len": state.max_context}


async def models(request: Request) -> HTTPResponse:
    return json({"object": "list", "data": [_model_card(_state(request))]})


async def model(request: Request, model_id: str) -> HTTPResponse:
    state = _state(request)
    model_id = unquote(model_id)  # clients quote an id's "/" (org/name), Sanic leaves it quoted
    if model_id != state.config.model_name:
        raise ApiError(404, f"the model {model_id!r} does not exist", param="model",
                       code="model_not_found")
    return json(_model_card(state))


async def info(request: Request) -> HTTPResponse:
    state = _state(request)
    return json({"model": state.config.model_name, "max_context": state.max_context,
                 "max_output_tokens": state.config.max_output_tokens})


async def capacity(request: Request) -> HTTPResponse:
    state = _state(request)
    stats = state.engine.engine.stats()
    return json({"active_requests": stats.active_requests,
                 "queued_requests": stats.queued_requests,
                 "in_flight_http_requests": state.engine.num_in_flight,
                 "free_kv_blocks": stats.free_kv_blocks, "total_kv_blocks": stats.total_kv_blocks,
                 "max_queue_depth": stats.max_queue_depth,
                 "accepting_requests": state.engine.is_accepting,
                 "prefix_cache": _prefix_cache_card(stats)})


def _prefix_cache_card(stats: EngineStats) -> dict[str, Any] | None:
    cache = stats.prefix_cache
    if cache is None:
        return None
    return {"queried_tokens": cache.queried_tokens, "hit_tokens": cache.hit_tokens,
            "cached_blocks": cache.cached_blocks, "state_snapshots": cache.snapshots,
            "state_snapshot_slots": cache.snapshot_slots,
            "state_snapshot_bytes": cache.snapshot_slots * stats.state_snapshot_bytes}


async def metrics(request: Request) -> HTTPResponse:
    return raw(_state(request).metrics.render(), content_type=CONTENT_TYPE)


async def tokenize(request: Request) -> HTTPResponse:
    state = _state(request)
    body = parse_json_body(await read_body(request))
    text = parse_tokenize_request(body)
    if text is None:
        chat = parse_chat(state, body)
        text, _, _ = await off_event_loop(_chat_prompt, state, chat)
    ids = await off_event_loop(state.tokenizer.encode, text)
    return json({"count": len(ids), "tokens": ids, "max_context": state.max_context})


async def detokenize(request: Request) -> HTTPResponse:
    """llama-server's /detokenize: {"tokens": [ids]} → {"content": text}, special tokens kept."""
    state = _state(request)
    ids = _token_ids_to_detokenize(parse_json_body(await read_body(request)), state.vocab_size)
    return json({"content": state.tokenizer.decode(ids)})


def _token_ids_to_detokenize(body: dict[str, Any], vocab_size: int) -> list[int]:
    """The body's 'tokens'; absent or null is no tokens, as llama-server has it."""
    ids = body.get("tokens")
    if ids is None:
        return []
    # bool is an int subclass, but true is no token id
    if not isinstance(ids, list) or not all(
            isinstance(i, int) and not isinstance(i, bool) and 0 <= i < vocab_size for i in ids):
        raise invalid(f"'tokens' must be a list of token ids in [0, {vocab_size})", "tokens")
    return ids


# ---------------------------------------------------------------- generation routes


Handler = Callable[[Request], Awaitable["HTTPResponse | None"]]


def counted(handler: Handler) -> Handler:
    """Count every generation request once, by outcome (ok, client_error, overloaded, ...)."""

    @functools.wraps(handler)
    async def wrapped(request: Request) -> HTTPResponse | None:
        request.ctx.outcome, request.ctx.streaming = None, False
        outcome = "server_error"
        try:
            response = await handler(request)  # None: it streamed its own response
            outcome = request.ctx.outcome or outcome_of_status(response.status if response else 200)
            return response
        except ApiError as exc:
            outcome = outcome_of_status(exc.status)
            raise
        except asyncio.CancelledError:
            outcome = "cancelled"
            raise
        finally:
            _state(request).metrics.count_request(outcome, streaming=request.ctx.streaming)

    return wrapped


@counted
async def chat_completions(request: Request) -> HTTPResponse | None:
    chat = parse_chat(_state(request), parse_json_body(await read_body(request)))
    return await respond_to_chat(request, chat)


async def respond_to_chat(request: Request, chat: ChatCompletionRequest,
                          adapt: Callable[[ChatResponse], Any] = lambda builder: builder,
                          framing: SseFraming = OPENAI_CHAT_SSE) -> HTTPResponse | None:
    """Generate a chat request's answer. The Responses and Messages APIs come here too: `adapt`
    wraps the chat builder in one that speaks their shapes, `framing` puts those on the wire."""
    state = _state(request)
    request.ctx.streaming = chat.stream
    prompt = await off_event_loop(_tokenized_chat_prompt, state, chat)
    max_tokens = _max_tokens(state, chat.max_tokens, len(prompt.ids))
    header = ResponseHeader(f"chatcmpl-{uuid.uuid4().hex}", chat.model or state.config.model_name)
    builder = adapt(ChatResponse(header, chat, state, len(prompt.ids), prompt.thinking_open,
                                 prompt.forced))
    # a forced call starts in the prompt, after any thought it opened
    may_reason = not prompt.forced and (prompt.thinking_open or
                                        chat.template_kwargs.get("enable_thinking") is not False)
    extra = {"snapshot_positions": prompt.snapshot_positions,
             **_constrained_output(state, _chat_grammar(state, chat),
                                   prompt.thinking_open if may_reason else None)}
    choices = [(prompt.ids, replace(chat.sampling.to_params(max_tokens, i, chat.top_logprobs),
                                    **extra)) for i in range(chat.n)]
    return await _respond(request, state.engine.generate(choices, header.id), builder, chat.stream,
                          framing)


@counted
async def completions(request: Request) -> HTTPResponse | None:
    state = _state(request)
    req = parse_completion_request(parse_json_body(await read_body(request)),
                                   default_temperature=state.config.default_temperature,
                                   vocab_size=state.vocab_size, max_n=state.config.max_n)
    request.ctx.streaming = req.stream
    prompts = await off_event_loop(
        lambda: [_completion_prompt(state, p, req.suffix) for p in req.prompts])
    header = ResponseHeader(f"cmpl-{uuid.uuid4().hex}", req.model or state.config.model_name)
    structured = _constrained_output(state, _response_format_grammar(state, req.response_schema),
                                     None)
    choices = []
    for ids in prompts:
        max_tokens = _max_tokens(state, req.max_tokens, len(ids))
        choices += [(ids, replace(req.sampling.to_params(max_tokens, j, req.top_logprobs,
                                                         req.prompt_logprobs), **structured))
                    for j in range(req.n)]
    texts = [state.tokenizer.decode(ids) if req.echo else "" for ids in prompts]
    builder = CompletionResponse(header, state, prompts, req.n, texts, req.top_logprobs,
                                 req.include_usage)
    return await _respond(request, state.engine.generate(choices, header.id), builder, req.stream)


def _completion_prompt(state: ServerState, prompt: str | list[int],
                       suffix: str | None) -> list[int]:
    """The prompt's ids; with a suffix, a fill-in-the-middle prompt of the two."""
    if isinstance(prompt, list):
        return prompt
    refuse_certain_overflow(state, prompt + (suffix or ""), "prompt")
    if suffix is None:
        return state.tokenizer.encode(prompt)
    ids = state.tokenizer.fill_in_the_middle(prompt, suffix)
    if ids is None:
        raise invalid("'suffix' needs a model with fill-in-the-middle tokens (<|fim_prefix|>, "
                      "<|fim_suffix|>, <|fim_middle|>); this one has none", "suffix",
                      "unsupported_value")
    return ids


def parse_chat(state: ServerState, body: dict[str, Any]) -> ChatCompletionRequest:
    return parse_chat_request(body, default_temperature=state.config.default_temperature,
                              vocab_size=state.vocab_size, max_n=state.config.max_n)


def _chat_prompt(state: ServerState, chat: ChatCompletionRequest) -> tuple[str, bool, str]:
    """(prompt text, whether it opens a thought, the forced tool-call text it ends with).

    tool_choice 'required' or a named function starts the generation inside a tool call; an
    opened thought is closed first (a forced call skips thinking)."""
    prompt = _render_prompt(state, chat)
    thinking_open = prompt_opens_thinking(prompt)
    if chat.tool_choice != "required":
        return prompt, thinking_open, ""
    forced = forced_call_prefix(uses_xml_format(state.template_source), chat.forced_tool)
    forced = f"{THINK_CLOSE}\n\n{forced}" if thinking_open else forced
    return prompt + forced, thinking_open, forced


async def count_chat_prompt_tokens(state: ServerState, chat: ChatCompletionRequest) -> int:
    """The tokens of the prompt a chat request generates from (the Messages API's
    count_tokens)."""
    prompt, _, _ = await off_event_loop(_chat_prompt, state, chat)
    return len(await off_event_loop(state.tokenizer.encode, prompt))


@dataclass(frozen=True)
class TokenizedChatPrompt:
    ids: list[int]
    thinking_open: bool  # the prompt opens a thought
    forced: str  # the forced tool-call text the prompt ends with, if any
    snapshot_positions: tuple[int, ...]  # see _messages_end


def _tokenized_chat_prompt(state: ServerState,
                           chat: ChatCompletionRequest) -> TokenizedChatPrompt:
    """Render and tokenize a chat request's prompt (seconds for a prompt of megabytes: call it
    off the event loop)."""
    prompt, thinking_open, forced = _chat_prompt(state, chat)
    refuse_certain_overflow(state, prompt, "messages")
    ids = state.tokenizer.encode(prompt)
    return TokenizedChatPrompt(ids, thinking_open, forced,
                               _messages_end(state, chat, prompt, ids))


def refuse_certain_overflow(state: ServerState, text: str, param: str) -> None:
    """400 context_length_exceeded, before tokenizing, for a text that must have more tokens than
    the context holds: no token stands for more than max_token_bytes bytes of text, so the byte
    length gives a lower bound on the token count at once (a 10 MB body of repeated messages
    would otherwise take seconds of tokenization just to be refused)."""
    text_bytes = len(text.encode("utf-8", errors="replace"))  # "?" for a surrogate: still a bound
    fewest_tokens = -(-text_bytes // state.tokenizer.max_token_bytes)
    if fewest_tokens >= state.max_context:
        raise ApiError(400, f"the prompt has at least {fewest_tokens} tokens, but the context "
                            f"limit is {state.max_context} tokens", param=param,
                       code="context_length_exceeded")


async def off_event_loop(compute: Callable[..., T], *args: Any) -> T:
    """compute(*args) on a worker thread. Rendering and tokenizing a long prompt takes seconds; on
    the event loop that would stall every other connection (the tokenizer releases the GIL)."""
    return await asyncio.get_running_loop().run_in_executor(None, functools.partial(compute,
                                                                                    *args))


def _chat_grammar(state: ServerState, chat: ChatCompletionRequest) -> str | None:
    """The grammar a chat answer follows: with tools, its tool calls' (tool_call_grammar: the
    content, where there may be some, as response_format asks); else response_format's."""
    answer = _response_format_grammar(state, chat.response_schema)
    if not chat.tools:
        return answer
    lark = tool_call_grammar(chat.tools, tool_choice=chat.tool_choice,
                             forced_tool=chat.forced_tool, parallel=chat.parallel_tool_calls,
                             xml_format=uses_xml_format(state.template_source),
                             answer_schema=chat.response_schema)
    try:
        return state.engine.engine.check_grammar(lark_grammar(lark))
    except ValueError as exc:
        raise invalid(f"the tools' parameters cannot be enforced: {exc}", "tools",
                      "invalid_function_parameters") from None


def _response_format_grammar(state: ServerState, schema: str | None) -> str | None:
    """response_format's JSON schema as a grammar, checked here so that a schema the grammar
    engine refuses is a 400 naming response_format."""
    if schema is None:
        return None
    try:
        return state.engine.engine.check_grammar(json_schema_grammar(schema))
    except ValueError as exc:
        raise invalid(f"the JSON schema is not supported: {exc}", "response_format",
                      "invalid_json_schema") from None


def _constrained_output(state: ServerState, grammar: str | None,
                        thinking_open: bool | None) -> dict[str, Any]:
    """SamplingParams fields that hold the answer to a grammar. thinking_open: None where the
    answer may not reason; else whether the prompt opened a thought (if not, the answer may open
    one): the reasoning stays free text and the grammar applies after </think>."""
    if grammar is None:
        return {}
    ids = [state.tokenizer.id_of(t) for t in (THINK_OPEN, THINK_CLOSE)]
    reasoning = (ids[0], ids[1]) if None not in ids and thinking_open is not None else None
    return {"grammar": grammar, "reasoning_tokens": reasoning,
            "reasoning_open": bool(thinking_open)}


def _messages_end(state: ServerState, chat: ChatCompletionRequest, prompt: str,
                  prompt_ids: list[int]) -> tuple[int, ...]:
    """Where the rendered messages end and the generation prompt starts, if the engine keeps
    state snapshots (hybrid models): the conversation's next turn resends those messages but
    renders this turn's answer its own way, so it can resume from a snapshot there."""
    if not state.engine.engine.keeps_state_snapshots:
        return ()
    try:
        history = state.template.render(chat.messages, tools=chat.tools,
                                        add_generation_prompt=False, **chat.template_kwargs)
    except Exception:  # NOTE: the prompt itself rendered; no snapshot is no error
        return ()
    ids = state.tokenizer.encode(history) if prompt.startswith(history) else []
    return (len(ids),) if 0 < len(ids) < len(prompt_ids) and prompt_ids[:len(ids)] == ids else ()


def _render_prompt(state: ServerState, chat: ChatCompletionRequest) -> str:
    try:
        return state.template.render(chat.messages, tools=chat.tools, add_generation_prompt=True,
                                     **chat.template_kwargs)
    except Exception as exc:  # the template only sees request data: a failure is bad input
        raise invalid(f"the chat template cannot render these messages: {exc}", "messages") \
            from None


def _max_tokens(state: ServerState, requested: int | None, num_prompt_tokens: int) -> int:
    """The request's max_tokens capped by SPARKINFER_MAX_OUTPUT_TOKENS; when omitted, as many as
    fit in the context. A prompt that leaves no room is a 400 naming both numbers."""
    room = state.max_context - num_prompt_tokens
    if room < 1:
        raise ApiError(400, f"the prompt has {num_prompt_tokens} tokens, but the context limit is "
                            f"{state.max_context} tokens", param="messages",
                       code="context_length_exceeded")
    return min(room if requested is None else requested, state.config.max_output_tokens)


async def _respond(request: Request, generation: Generation, builder: Any, stream: bool,
                   framing: SseFraming = OPENAI_CHAT_SSE) -> HTTPResponse | None:
    state = _state(request)
    try:
        async with generation:
            if stream:
                await _stream(request, generation, builder, framing, state.config.write_timeout_s)
                return None
            async for index, event in generation:
                builder.push(index, event)
            return json(builder.response())
    finally:
        state.metrics.count_tokens(*builder.token_counts())


async def _stream(request: Request, generation: Generation, builder: Any, framing: SseFraming,
                  write_timeout_s: float) -> None:
    events = aiter(generation)
    index, event = await anext(events)  # errors before the first token keep their HTTP status
    response = await request.respond(content_type="text/event-stream", headers=SSE_HEADERS)

    async def send(chunks: list[dict[str, Any] | None]) -> None:
        data = "".join(framing.frame(c) for c in chunks if c is not None)
        if data:
            await asyncio.wait_for(response.send(data), write_timeout_s)

    try:
        await send(builder.push(index, event))
        async for index, event in events:
            await send(builder.push(index, event))
        await response.send(framing.end(builder))
    except ApiError as exc:  # headers are out: report in-band, as an SSE error event
        request.ctx.outcome = outcome_of_status(exc.status)
        await response.send(framing.failure(builder, exc))
    except asyncio.TimeoutError:
        request.ctx.outcome = "cancelled"  # the client stopped reading
        log.warning("a streaming client did not read for %.0f s; cancelled", write_timeout_s)
    await response.eof()
