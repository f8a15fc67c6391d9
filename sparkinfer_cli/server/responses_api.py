"""POST /v1/responses: OpenAI's Responses API (what Codex CLI speaks), on the chat path.

The request becomes a chat-completions body (input items → messages, instructions → a system
message, text.format → response_format, ...) that the chat parser validates; the chat builder's
deltas become output items (reasoning, message, function_call) through OutputBlocks. Nothing is
stored, so previous_response_id and conversation are refused; store, include, prompt_cache_key and
service_tier are accepted and ignored.
"""

from __future__ import annotations

import time
from typing import Any

from sanic import Request
from sanic.response import HTTPResponse

from sparkinfer_cli.server.output_blocks import (
    DELTA,
    REASONING,
    START,
    TEXT,
    Block,
    BlockEvent,
    OutputBlocks,
)
from sparkinfer_cli.server.protocol import ApiError, invalid, parse_json_body
from sparkinfer_cli.server.responses import ChatResponse
from sparkinfer_cli.server.routes import counted, parse_chat, read_body, respond_to_chat
from sparkinfer_cli.server.sse_framing import NAMED_EVENT_SSE

# Responses fields copied into the chat body under the chat name
_SAME_FIELDS = ("model", "stream", "temperature", "top_p", "top_k", "seed",
                "parallel_tool_calls", "min_p", "presence_penalty", "frequency_penalty",
                "repetition_penalty")
_UNSTORED = ("previous_response_id", "conversation")  # need a response store we do not keep
_ITEM_PREFIXES = {REASONING: "rs", TEXT: "msg", "tool_call": "fc"}
# tools the provider runs itself (OpenAI's servers): none runs here, so they are left out of the
# prompt rather than refused (Codex CLI offers web_search by default); forcing one is a 400
_HOSTED_TOOLS = ("web_search", "file_search", "code_interpreter", "image_generation",
                 "computer_use", "mcp", "tool_search")
# a namespace tool's functions are flattened to chat functions named namespace + this + name
NAMESPACE_SEPARATOR = "__"


@counted
async def responses(request: Request) -> HTTPResponse | None:
    body = parse_json_body(await read_body(request))
    chat = parse_chat(request.app.ctx.state, chat_body_of_response_request(body))
    return await respond_to_chat(request, chat, lambda c: ResponsesBuilder(c, body),
                                 NAMED_EVENT_SSE)


# ---------------------------------------------------------------- request → chat body


def chat_body_of_response_request(body: dict[str, Any]) -> dict[str, Any]:
    for name in _UNSTORED:
        if body.get(name) is not None:
            raise invalid(f"'{name}' needs stored responses, and this server stores none: send "
                          "the whole conversation in 'input'", name, "unsupported_parameter")
    if body.get("background"):
        raise invalid("background responses are not supported", "background",
                      "unsupported_parameter")
    chat = {k: body[k] for k in _SAME_FIELDS if body.get(k) is not None}
    chat["messages"] = _instructions(body.get("instructions")) + _messages(body.get("input"))
    chat["max_tokens"] = body.get("max_output_tokens")
    chat["tools"] = [c for i, t in enumerate(body.get("tools") or [])
                     for c in _chat_tools(i, t)] or None
    chat["tool_choice"] = _chat_tool_choice(body.get("tool_choice"))
    chat["response_format"] = _response_format(_object_or_empty(body, "text").get("format"))
    effort = _object_or_empty(body, "reasoning").get("effort")
    if effort is not None:
        chat["reasoning_effort"] = effort
    return chat


def _object_or_empty(body: dict[str, Any], name: str) -> dict[str, Any]:
    value = body.get(name)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise invalid(f"'{name}' must be an object", name, "invalid_type")
    return value


def _instructions(instructions: Any) -> list[dict[str, Any]]:
    if instructions is None:
        return []
    if not isinstance(instructions, str):
        raise invalid("'instructions' must be a string", "instructions", "invalid_type")
    return [{"role": "system", "content": instructions}]


def _messages(items: Any) -> list[dict[str, Any]]:
    """input (a string, or a list of items) → chat messages; a reasoning item is the thought of
    the assistant turn after it, function calls join the assistant turn before them."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise invalid("'input' must be a string or a non-empty list of items", "input",
                      "missing_required_parameter" if items is None else "invalid_type")
    messages: list[dict[str, Any]] = []
    reasoning: list[str] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "reasoning":
            reasoning.append(_reasoning_text(item))
        elif kind == "function_call":
            _assistant_turn(messages, reasoning)["tool_calls"].append(_history_call(item, where))
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": _string(item, "call_id", where),
                             "content": _text_of(item.get("output"), f"{where}.output")})
        elif kind == "message" and item.get("role") == "assistant":
            _assistant_turn(messages, reasoning, new=True)["content"] = _text_of(
                item.get("content"), f"{where}.content")
        elif kind == "message":
            messages.append({"role": item.get("role"),
                             "content": _text_of(item.get("content"), f"{where}.content")})
        else:
            raise invalid(f"{where} must be a message, function_call, function_call_output or "
                          "reasoning item", where, "invalid_type")
    return messages


def _assistant_turn(messages: list[dict[str, Any]], reasoning: list[str],
                    new: bool = False) -> dict[str, Any]:
    """The assistant message that takes the next item: for a call, the last message if it is an
    assistant's (a turn's text and calls come as separate items); else a new one. It carries the
    reasoning items read since the last turn."""
    last = messages[-1] if messages else None
    if new or last is None or last["role"] != "assistant":
        last = {"role": "assistant", "content": "", "tool_calls": []}
        messages.append(last)
    if reasoning:
        last["reasoning_content"] = "\n".join(reasoning)
        reasoning.clear()
    return last


def _reasoning_text(item: dict[str, Any]) -> str:
    parts = (item.get("content") or []) + (item.get("summary") or [])
    return "\n".join(p.get("text", "") for p in parts if isinstance(p, dict))


def _history_call(item: dict[str, Any], where: str) -> dict[str, Any]:
    name = _string(item, "name", where)
    if isinstance(item.get("namespace"), str):
        name = item["namespace"] + NAMESPACE_SEPARATOR + name
    return {"id": _string(item, "call_id", where), "type": "function",
            "function": {"name": name,
                         "arguments": _string(item, "arguments", where)}}


def _string(item: dict[str, Any], name: str, where: str) -> str:
    value = item.get(name)
    if not isinstance(value, str):
        raise invalid(f"{where}.{name} must be a string", f"{where}.{name}", "invalid_type")
    return value


def _text_of(content: Any, where: str) -> str:
    """A string, or a list of input_text / output_text parts, as one string."""
    if isinstance(content, str):
        return content
    parts = content if isinstance(content, list) else None
    if parts is None or not all(isinstance(p, dict) and isinstance(p.get("text"), str) and
                                p.get("type") in ("input_text", "output_text", "text")
                                for p in parts):
        raise invalid(f"{where} must be a string or a list of input_text / output_text parts; "
                      "this model accepts text only", where, "invalid_type")
    return "\n".join(p["text"] for p in parts)


def _chat_tools(index: int, tool: Any) -> list[dict[str, Any]]:
    """A function tool → one chat function; a namespace tool → its functions, each named
    namespace__name; a hosted tool → none (it cannot run here)."""
    kind = tool.get("type") if isinstance(tool, dict) else None
    if isinstance(kind, str) and kind.startswith(_HOSTED_TOOLS):
        return []
    if kind == "namespace" and isinstance(tool.get("tools"), list):
        prefix = f"{tool.get('name')}{NAMESPACE_SEPARATOR}"
        return [{**c, "function": {**c["function"], "name": prefix + c["function"]["name"]}}
                for t in tool["tools"] for c in _chat_tools(index, t)]
    if kind != "function":
        raise invalid(f"tools[{index}] must be a function or namespace tool; a {kind!r} tool is "
                      "not available here", f"tools[{index}]", "unsupported_value")
    function = {k: tool[k] for k in ("name", "description", "parameters") if k in tool}
    return [{"type": "function", "function": function}]


def namespaced_functions(tools: Any) -> dict[str, tuple[Any, Any]]:
    """The flattened name of each namespace tool's function → (namespace, name)."""
    return {f"{t.get('name')}{NAMESPACE_SEPARATOR}{f.get('name')}": (t.get("name"), f.get("name"))
            for t in tools or [] if isinstance(t, dict) and t.get("type") == "namespace"
            and isinstance(t.get("tools"), list)
            for f in t["tools"] if isinstance(f, dict)}


def _chat_tool_choice(choice: Any) -> Any:
    """{"type": "function", "name": f} → chat's {"type": "function", "function": {"name": f}}."""
    if isinstance(choice, dict) and choice.get("type") == "function":
        name = choice.get("name")
        if isinstance(choice.get("namespace"), str):
            name = choice["namespace"] + NAMESPACE_SEPARATOR + str(name)
        return {"type": "function", "function": {"name": name}}
    if isinstance(choice, dict):
        raise invalid(f"tool_choice {{'type': {choice.get('type')!r}}} names a tool that is not "
                      "available here; force a function tool", "tool_choice",
                      "unsupported_value")
    return choice


def _response_format(text_format: Any) -> Any:
    """text.format (its json_schema fields inline) → chat's response_format (them nested)."""
    if isinstance(text_format, dict) and text_format.get("type") == "json_schema":
        schema = {k: text_format[k] for k in ("name", "schema", "strict") if k in text_format}
        return {"type": "json_schema", "json_schema": schema}
    return text_format


# ---------------------------------------------------------------- chat stream → response events


class ResponsesBuilder:
    """Chat builder's deltas → Responses stream events (numbered), and the response they fold to."""

    def __init__(self, chat: ChatResponse, body: dict[str, Any]):
        self.chat, self.body = chat, body
        self.hex = chat.header.id.removeprefix("chatcmpl-")
        self.created_at = int(time.time())
        self.blocks = OutputBlocks(chat)
        self.sequence_number = 0
        self.namespaced = namespaced_functions(body.get("tools"))

    def push(self, index: int, event: Any) -> list[dict[str, Any]]:
        out = [] if self.sequence_number else [self._lifecycle("response.created"),
                                               self._lifecycle("response.in_progress")]
        out += [e for b in self.blocks.push_event(index, event) for e in self._render(b)]
        return [self._numbered(e) for e in out]

    def closing_events(self) -> list[dict[str, Any]]:
        kind = "response.incomplete" if self._incomplete() else "response.completed"
        return [self._numbered({"type": kind, "response": self.response()})]

    def failure_events(self, exc: ApiError) -> list[dict[str, Any]]:
        failed = {**self.response(), "status": "failed",
                  "error": {"code": exc.code or exc.type, "message": exc.message}}
        return [self._numbered({"type": "response.failed", "response": failed})]

    def response(self) -> dict[str, Any]:
        usage = self.chat.usage()
        status = "incomplete" if self._incomplete() else "completed"
        return {**self._snapshot(status), "output": [self._item(b) for b in self.blocks.blocks],
                "incomplete_details": {"reason": "max_output_tokens"} if self._incomplete()
                else None,
                "usage": {"input_tokens": usage.prompt_tokens,
                          "input_tokens_details": {"cached_tokens": usage.cached_tokens},
                          "output_tokens": usage.completion_tokens,
                          "output_tokens_details": {"reasoning_tokens": usage.reasoning_tokens},
                          "total_tokens": usage.prompt_tokens + usage.completion_tokens}}

    def token_counts(self) -> tuple[int, int]:
        return self.chat.token_counts()

    def _incomplete(self) -> bool:
        return self.blocks.finish_reason == "length"

    def _snapshot(self, status: str) -> dict[str, Any]:
        body = self.body
        return {"id": f"resp_{self.hex}", "object": "response", "created_at": self.created_at,
                "status": status, "model": self.chat.header.model, "output": [], "error": None,
                "incomplete_details": None, "instructions": body.get("instructions"),
                "max_output_tokens": body.get("max_output_tokens"),
                "parallel_tool_calls": body.get("parallel_tool_calls", True),
                "tool_choice": body.get("tool_choice", "auto"), "tools": body.get("tools") or [],
                "temperature": body.get("temperature"), "top_p": body.get("top_p"),
                "text": body.get("text") or {"format": {"type": "text"}},
                "reasoning": body.get("reasoning"), "previous_response_id": None,
                "store": False, "metadata": body.get("metadata") or {}, "usage": None}

    def _lifecycle(self, kind: str) -> dict[str, Any]:
        return {"type": kind, "response": self._snapshot("in_progress")}

    def _numbered(self, event: dict[str, Any]) -> dict[str, Any]:
        event["sequence_number"] = self.sequence_number
        self.sequence_number += 1
        return event

    def _render(self, event: BlockEvent) -> list[dict[str, Any]]:
        block = event.block
        where = {"item_id": self._item_id(block), "output_index": block.index}
        if event.action == START:
            added = {"type": "response.output_item.added", "output_index": block.index,
                     "item": self._item(block, opened=True)}
            if block.kind != TEXT:
                return [added]
            return [added, {"type": "response.content_part.added", **where, "content_index": 0,
                            "part": _text_part("")}]
        if event.action == DELTA:
            return [_delta_event(block.kind, where, event.delta)]
        item = self._item(block)
        return [*_done_events(block, where, item.get("name")),
                {"type": "response.output_item.done", "output_index": block.index, "item": item}]

    def _item_id(self, block: Block) -> str:
        return f"{_ITEM_PREFIXES[block.kind]}_{self.hex}_{block.index}"

    def _item(self, block: Block, opened: bool = False) -> dict[str, Any]:
        """The output item of a block: as it opens (empty, in progress) or as it now is."""
        text = "" if opened else block.text
        item = {"id": self._item_id(block), "status": "in_progress" if opened else "completed"}
        if block.kind == REASONING:
            return {**item, "type": "reasoning", "summary": [],
                    "content": [{"type": "reasoning_text", "text": text}]}
        if block.kind == TEXT:
            return {**item, "type": "message", "role": "assistant",
                    "content": [] if opened else [_text_part(text)]}
        call = {**item, "type": "function_call", "call_id": block.call_id, "name": block.name,
                "arguments": text}
        if block.name in self.namespaced:
            call["namespace"], call["name"] = self.namespaced[block.name]
        return call


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _delta_event(kind: str, where: dict[str, Any], delta: str) -> dict[str, Any]:
    if kind == REASONING:
        return {"type": "response.reasoning_text.delta", **where, "content_index": 0,
                "delta": delta}
    if kind == TEXT:
        return {"type": "response.output_text.delta", **where, "content_index": 0,
                "delta": delta, "logprobs": []}
    return {"type": "response.function_call_arguments.delta", **where, "delta": delta}


def _done_events(block: Block, where: dict[str, Any], name: Any) -> list[dict[str, Any]]:
    if block.kind == REASONING:
        return [{"type": "response.reasoning_text.done", **where, "content_index": 0,
                 "text": block.text}]
    if block.kind == TEXT:
        return [{"type": "response.output_text.done", **where, "content_index": 0,
                 "text": block.text, "logprobs": []},
                {"type": "response.content_part.done", **where, "content_index": 0,
                 "part": _text_part(block.text)}]
    return [{"type": "response.function_call_arguments.done", **where, "name": name,
             "arguments": block.text}]
