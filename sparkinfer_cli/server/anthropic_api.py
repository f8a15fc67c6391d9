"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API (what Claude Code
speaks), on the chat path.

The request becomes a chat-completions body (system → a system message, tool_use / tool_result
blocks → tool calls and tool messages, thinking → enable_thinking) that the chat parser
validates; the chat builder's deltas become content blocks through OutputBlocks. Errors under
these paths take Anthropic's shape ({"type": "error", "error": {type, message}}; app.py asks
is_messages_path).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from sanic import Request
from sanic.response import HTTPResponse
from sanic.response import json as json_response

from sparkinfer_cli.server.output_blocks import (
    DELTA,
    REASONING,
    START,
    TEXT,
    Block,
    BlockEvent,
    OutputBlocks,
    arguments_object,
)
from sparkinfer_cli.server.protocol import ApiError, invalid, parse_json_body
from sparkinfer_cli.server.responses import ChatResponse
from sparkinfer_cli.server.routes import (
    count_chat_prompt_tokens,
    counted,
    parse_chat,
    read_body,
    respond_to_chat,
)
from sparkinfer_cli.server.sse_framing import NAMED_EVENT_SSE

MESSAGES_PATH = "/v1/messages"
_SAME_FIELDS = ("model", "stream", "temperature", "top_p", "top_k", "max_tokens")
# Claude Code's system prompt starts with a block that changes on every request, for billing
# only: rendered, it would change the prompt's first tokens and defeat the prefix cache
_BILLING_BLOCK_PREFIX = "x-anthropic-billing-header"
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                403: "permission_error", 404: "not_found_error", 408: "timeout_error",
                413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error",
                504: "timeout_error"}
_STOP_WINDOW_TOKENS = 32  # how far back a stop string that ended the answer is looked for
_STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


@counted
async def messages(request: Request) -> HTTPResponse | None:
    state = request.app.ctx.state
    body = parse_json_body(await read_body(request))
    chat = parse_chat(state, chat_body_of_messages_request(body))
    return await respond_to_chat(
        request, chat, lambda c: MessagesBuilder(c, chat.sampling.stop, state.tokenizer),
        NAMED_EVENT_SSE)


async def count_tokens(request: Request) -> HTTPResponse:
    state = request.app.ctx.state
    body = parse_json_body(await read_body(request))
    chat = parse_chat(state, chat_body_of_messages_request({**body, "max_tokens": 1}))
    return json_response({"input_tokens": await count_chat_prompt_tokens(state, chat)})


def is_messages_path(path: str) -> bool:
    return path.rstrip("/") == MESSAGES_PATH or path.startswith(MESSAGES_PATH + "/")


def error_body(error: ApiError) -> dict[str, Any]:
    kind = _ERROR_TYPES.get(error.status, "api_error")
    return {"type": "error", "error": {"type": kind, "message": error.message}}


# ---------------------------------------------------------------- request → chat body


def chat_body_of_messages_request(body: dict[str, Any]) -> dict[str, Any]:
    if body.get("max_tokens") is None:
        raise invalid("'max_tokens' is required", "max_tokens", "missing_required_parameter")
    chat = {k: body[k] for k in _SAME_FIELDS if body.get(k) is not None}
    chat["messages"] = _system(body.get("system")) + _messages(body.get("messages"))
    chat["stop"] = body.get("stop_sequences")
    tools = body.get("tools")
    chat["tools"] = [_chat_tool(i, t) for i, t in enumerate(tools)] \
        if isinstance(tools, list) else tools
    chat["tool_choice"], chat["parallel_tool_calls"] = _chat_tool_choice(body.get("tool_choice"))
    thinking = body.get("thinking")
    kind = thinking.get("type") if isinstance(thinking, dict) else None
    if kind in ("enabled", "disabled"):  # "adaptive" or none: the template's default
        chat["enable_thinking"] = kind == "enabled"
    chat["response_format"] = _response_format(body.get("output_config"))
    return chat


def _response_format(output_config: Any) -> dict[str, Any] | None:
    """output_config.format {"type": "json_schema", "schema"} → chat's response_format."""
    output_format = output_config.get("format") if isinstance(output_config, dict) else None
    if output_format is None:
        return None
    if not isinstance(output_format, dict) or output_format.get("type") != "json_schema":
        raise invalid("'output_config.format' must be {\"type\": \"json_schema\", \"schema\": "
                      "{...}}", "output_config.format")
    return {"type": "json_schema",
            "json_schema": {"name": "output", "schema": output_format.get("schema")}}


def _system(system: Any) -> list[dict[str, Any]]:
    if system is None:
        return []
    blocks = [{"type": "text", "text": system}] if isinstance(system, str) else system
    texts = [t for t in _texts(blocks, "system") if not t.startswith(_BILLING_BLOCK_PREFIX)]
    return [{"role": "system", "content": "\n".join(texts)}] if texts else []


def _messages(messages: Any) -> list[dict[str, Any]]:
    if not isinstance(messages, list) or not messages:
        raise invalid("'messages' must be a non-empty list of messages", "messages",
                      "missing_required_parameter" if messages is None else "invalid_type")
    out: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        role = message.get("role") if isinstance(message, dict) else None
        if role not in ("user", "assistant", "system"):
            raise invalid(f"{where}.role must be 'user', 'assistant' or 'system'",
                          f"{where}.role")
        content = message.get("content")
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
        if not isinstance(blocks, list):
            raise invalid(f"{where}.content must be a string or a list of content blocks",
                          f"{where}.content", "invalid_type")
        if role == "system":  # Claude Code sends these between turns: a system message there
            out.append({"role": "system",
                        "content": "\n".join(_texts(blocks, f"{where}.content"))})
            continue
        convert = _assistant_turn if role == "assistant" else _user_turn
        out += convert(blocks, f"{where}.content")
    return out


def _assistant_turn(blocks: list[Any], where: str) -> list[dict[str, Any]]:
    texts, thoughts, calls = [], [], []
    for i, block in enumerate(blocks):
        kind = _block_type(block, f"{where}[{i}]")
        if kind == "text":
            texts.append(block.get("text", ""))
        elif kind == "thinking":
            thoughts.append(block.get("thinking", ""))
        elif kind == "tool_use":
            calls.append({"id": block.get("id"), "type": "function",
                          "function": {"name": block.get("name"),
                                       "arguments": block.get("input") or {}}})
        elif kind != "redacted_thinking":  # encrypted by Anthropic: nothing to render
            raise _unsupported_block(kind, f"{where}[{i}]")
    message: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
    if thoughts:
        message["reasoning_content"] = "\n".join(thoughts)
    if calls:
        message["tool_calls"] = calls
    return [message]


def _user_turn(blocks: list[Any], where: str) -> list[dict[str, Any]]:
    """Tool results become tool messages, ahead of the turn's text (the chat templates answer
    the calls first)."""
    results, texts = [], []
    for i, block in enumerate(blocks):
        kind = _block_type(block, f"{where}[{i}]")
        if kind == "tool_result":
            content = block.get("content")
            text = "\n".join(_texts(content, f"{where}[{i}].content")) \
                if isinstance(content, list) else content or ""
            results.append({"role": "tool", "tool_call_id": block.get("tool_use_id"),
                            "content": f"Error: {text}" if block.get("is_error") else text})
        elif kind == "text":
            texts.append(block.get("text", ""))
        else:
            raise _unsupported_block(kind, f"{where}[{i}]")
    return results + ([{"role": "user", "content": "\n".join(texts)}] if texts else [])


def _block_type(block: Any, where: str) -> str:
    kind = block.get("type") if isinstance(block, dict) else None
    if not isinstance(kind, str):
        raise invalid(f"{where} must be a content block with a 'type'", where, "invalid_type")
    return kind


def _unsupported_block(kind: str, where: str) -> ApiError:
    return invalid(f"{where} is a {kind!r} block; this server takes text, thinking, tool_use "
                   "and tool_result blocks (the model reads text only)", where)


def _texts(blocks: Any, where: str) -> list[str]:
    if not isinstance(blocks, list) or not all(
            isinstance(b, dict) and b.get("type") == "text" and isinstance(b.get("text"), str)
            for b in blocks):
        raise invalid(f"{where} must be a string or a list of text blocks", where, "invalid_type")
    return [b["text"] for b in blocks]


def _chat_tool(index: int, tool: Any) -> dict[str, Any]:
    """{"name", "description", "input_schema"} → a chat function tool; Anthropic's server tools
    (web search, bash, ...) carry a versioned type and run on Anthropic's side."""
    if not isinstance(tool, dict) or tool.get("type", "custom") != "custom":
        raise invalid(f"tools[{index}] must be a custom tool (name, description, input_schema)",
                      f"tools[{index}]", "unsupported_value")
    function = {"name": tool.get("name"), "parameters": tool.get("input_schema") or {}}
    if "description" in tool:
        function["description"] = tool["description"]
    return {"type": "function", "function": function}


def _chat_tool_choice(choice: Any) -> tuple[Any, bool]:
    """(chat tool_choice, parallel_tool_calls) of {"type": auto|any|none|tool, "name",
    "disable_parallel_tool_use"}."""
    if choice is None:
        return None, True
    kind = choice.get("type") if isinstance(choice, dict) else None
    parallel = not choice.get("disable_parallel_tool_use", False) if kind else True
    if kind == "tool":
        return {"type": "function", "function": {"name": choice.get("name")}}, parallel
    if kind in ("auto", "none", "any"):
        return ("required" if kind == "any" else kind), parallel
    raise invalid("'tool_choice.type' must be auto, any, none or tool", "tool_choice")


# ---------------------------------------------------------------- chat stream → message events


class MessagesBuilder:
    """Chat builder's deltas → Anthropic stream events, and the message they fold to."""

    def __init__(self, chat: ChatResponse, stop_sequences: Sequence[str] | None, tokenizer: Any):
        self.chat, self.stop_sequences, self.tokenizer = chat, list(stop_sequences or ()), \
            tokenizer
        self.recent_ids: list[int] = []  # the last tokens, where a stop string would be
        self.id = f"msg_{chat.header.id.removeprefix('chatcmpl-')}"
        self.blocks = OutputBlocks(chat)
        self.started = False

    def push(self, index: int, event: Any) -> list[dict[str, Any]]:
        out = [] if self.started else [{"type": "message_start", "message": self._message([])}]
        self.started = True
        self.recent_ids = (self.recent_ids + event.token_ids)[-_STOP_WINDOW_TOKENS:]
        return out + [self._render(b) for b in self.blocks.push_event(index, event)]

    def closing_events(self) -> list[dict[str, Any]]:
        stop_reason, stop_sequence = self._stop()
        return [{"type": "message_delta",
                 "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                 "usage": self._usage()},
                {"type": "message_stop"}]

    def failure_events(self, exc: ApiError) -> list[dict[str, Any]]:
        return [error_body(exc)]

    def response(self) -> dict[str, Any]:
        return self._message([_content(b) for b in self.blocks.blocks], *self._stop())

    def token_counts(self) -> tuple[int, int]:
        return self.chat.token_counts()

    def _message(self, content: list[dict[str, Any]], stop_reason: str | None = None,
                 stop_sequence: str | None = None) -> dict[str, Any]:
        return {"id": self.id, "type": "message", "role": "assistant",
                "model": self.chat.header.model, "content": content, "stop_reason": stop_reason,
                "stop_sequence": stop_sequence, "usage": self._usage()}

    def _usage(self) -> dict[str, Any]:
        """Anthropic counts cache reads apart from input_tokens (the prompt tokens computed)."""
        usage = self.chat.usage()
        return {"input_tokens": usage.prompt_tokens - usage.cached_tokens,
                "cache_read_input_tokens": usage.cached_tokens,
                "cache_creation_input_tokens": 0, "output_tokens": usage.completion_tokens}

    def _stop(self) -> tuple[str | None, str | None]:
        """(stop_reason, stop_sequence); the engine removes a stop string from the text, so
        which one ended the answer is read from the last tokens' text."""
        finish_reason = self.blocks.finish_reason
        reason = _STOP_REASONS.get(finish_reason or "", finish_reason)
        if reason != "end_turn" or not self.stop_sequences:
            return reason, None
        tail = self.tokenizer.decode(self.recent_ids)
        matched = [s for s in self.stop_sequences if s in tail]
        return ("stop_sequence", matched[0]) if matched else (reason, None)

    def _render(self, event: BlockEvent) -> dict[str, Any]:
        block = event.block
        if event.action == START:
            return {"type": "content_block_start", "index": block.index,
                    "content_block": _content(block, opened=True)}
        if event.action == DELTA:
            return {"type": "content_block_delta", "index": block.index,
                    "delta": _delta(block, event.delta)}
        return {"type": "content_block_stop", "index": block.index}


def _content(block: Block, opened: bool = False) -> dict[str, Any]:
    """A block's content block: as it opens (empty) or as it now is."""
    text = "" if opened else block.text
    if block.kind == REASONING:
        return {"type": "thinking", "thinking": text, "signature": ""}
    if block.kind == TEXT:
        return {"type": "text", "text": text}
    return {"type": "tool_use", "id": block.call_id, "name": block.name,
            "input": {} if opened else arguments_object(block.text)}


def _delta(block: Block, delta: str) -> dict[str, Any]:
    if block.kind == REASONING:
        return {"type": "thinking_delta", "thinking": delta}
    if block.kind == TEXT:
        return {"type": "text_delta", "text": delta}
    return {"type": "input_json_delta", "partial_json": json.dumps(arguments_object(delta))}
