"""Qwen tool calls ⇄ OpenAI tool_calls.

Two formats appear between <tool_call> and </tool_call>:
  Qwen3 (hermes):         {"name": "get_weather", "arguments": {"city": "Paris"}}
  Qwen3.5/3.6 and Coder:  <function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>
The XML form carries every value as text, so values are typed by the tool's JSON Schema.
Qwen models sometimes drop the tags; an answer that is nothing but one JSON call, bare or in a
```json fence, naming one of the request's tools is read as that call (llama.cpp and vLLM do too).
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"

_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)(?:</function>|\Z)", re.S)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|\Z)", re.S)
# a JSON call's name, then (once written) its arguments key: what can be read of a cut call
_JSON_CALL_HEAD = re.compile(
    r'\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")(\s*,\s*"(?:arguments|parameters)"\s*:)?', re.S)
_JSON_NAME_STRING_OPENED = re.compile(r'\{\s*"name"\s*:\s*"')
_JSON_CALL_START = '{"name":"'
_FENCE = "```"
_FENCE_OPENER = re.compile(r"```(?:json)?[ \t]*\n")
_FENCE_OPENER_START = re.compile(r"`{1,2}|```(?:j(?:s(?:o(?:n)?)?)?)?[ \t]*")
_FENCED = re.compile(r"```(?:json)?[ \t]*\n(.*?)(?:```)?", re.S)
_JSON_DECODER = json.JSONDecoder()


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text of an object, as OpenAI sends it (cut short if max_tokens cut it)

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


def new_tool_call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


def parse_tool_calls(body: str, tools: Sequence[Mapping[str, Any]] | None) -> list[ToolCall] | None:
    """The calls in the text between <tool_call> and </tool_call> (which may be cut short by
    max_tokens), or None when it names no function."""
    text = body.strip()
    if text.startswith("<function="):
        return _parse_xml(text, _parameter_schemas(tools or ()))
    return _parse_json(text) or _parse_json_head(text)


def may_be_untagged_tool_call(answer: str, tools: Sequence[Mapping[str, Any]]) -> bool:
    """Whether the answer so far can still turn out to be one untagged call to one of the tools
    (then it must be held back). Once False it stays False however the answer goes on, so the
    answer routes the same way whatever pieces it streams in."""
    text = answer.lstrip()
    fenced = text.startswith("`")
    if fenced:
        opener = _FENCE_OPENER.match(text)
        if opener is None:
            return "\n" not in text and _FENCE_OPENER_START.fullmatch(text) is not None
        text = text[opener.end():].lstrip()
    if not text:
        return True
    head = _JSON_CALL_HEAD.match(text)
    if head is None:  # the name is not written yet: is this still the start of '{"name": "'?
        return _JSON_NAME_STRING_OPENED.match(text) is not None or \
            _JSON_CALL_START.startswith("".join(text.split()))
    if not _names_a_tool(head, tools):
        return False
    try:
        _, end = _JSON_DECODER.raw_decode(text)
    except ValueError:
        return True  # unfinished, or malformed: that is known only at the end
    rest = text[end:].strip()  # after the call: nothing, or the closing fence
    return not rest or fenced and _FENCE.startswith(rest)


def parse_untagged_tool_call(answer: str,
                             tools: Sequence[Mapping[str, Any]]) -> list[ToolCall] | None:
    """The call an answer consists of, bare JSON or in a ```json fence, if it names one of the
    tools; None when the answer is anything else (it is then content)."""
    text = answer.strip()
    fenced = _FENCED.fullmatch(text)
    body = fenced.group(1).strip() if fenced else text
    head = _JSON_CALL_HEAD.match(body)  # a call opens with its name, as Qwen writes it
    return _parse_json(body) if head and _names_a_tool(head, tools) else None


def uses_xml_format(template_source: str) -> bool:
    """Qwen3.5/3.6 and Qwen3-Coder templates teach the <function=...> form; Qwen3 the JSON one."""
    return "<function=" in template_source


def call_opening(xml_format: bool, name: str) -> str:
    """How the template writes a call of `name` after '<tool_call>\n', up to its arguments."""
    return f"<function={name}>\n" if xml_format else f'{{"name": {json.dumps(name)}, "arguments": '


def call_closing(xml_format: bool) -> str:
    """How the template ends a call after its arguments."""
    return f"</function>\n{TOOL_CALL_CLOSE}" if xml_format else f"}}\n{TOOL_CALL_CLOSE}"


def forced_call_prefix(xml_format: bool, name: str | None) -> str:
    """Text appended to the prompt so generation starts inside a tool call (tool_choice
    'required'), or inside a call of one named function."""
    return f"{TOOL_CALL_OPEN}\n" + (call_opening(xml_format, name) if name is not None else "")


def is_text_parameter(schema: Mapping[str, Any] | None) -> bool:
    """Whether the XML form carries this parameter's value as raw text (its type allows a
    string); any other value is JSON there."""
    return "string" in _types(schema)


def arguments_for_template(arguments: str | dict[str, Any]) -> dict[str, Any] | str:
    """OpenAI history sends arguments as a JSON string; Qwen templates iterate them as a mapping."""
    if isinstance(arguments, dict):
        return arguments
    try:
        parsed = json.loads(arguments)
    except (ValueError, RecursionError):  # not JSON, or nested deeper than json.loads can go
        return arguments
    return parsed if isinstance(parsed, dict) else arguments


def _parse_json(text: str) -> list[ToolCall] | None:
    try:
        call = json.loads(text)
    except ValueError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    arguments = call.get("arguments", call.get("parameters", {}))
    if isinstance(arguments, str):
        arguments = arguments_for_template(arguments)
    if not isinstance(arguments, dict):
        return None
    return [ToolCall(new_tool_call_id(), call["name"], _dumps(arguments))]


def _parse_json_head(text: str) -> list[ToolCall] | None:
    """A JSON call that does not parse (cut by max_tokens, or malformed) but whose name can be
    read: its arguments are the text written for them, up to the brace that closes the call.
    OpenAI passes a model's arguments on unvalidated, and reports a call cut by max_tokens this
    way (finish_reason 'length')."""
    head = _JSON_CALL_HEAD.match(text)
    name = _json_string(head.group(1)) if head else None
    if head is None or name is None:
        return None
    arguments = _before_unmatched_close(text[head.end():]).strip() if head.group(2) else ""
    return [ToolCall(new_tool_call_id(), name, _uniform_arguments(arguments))]


def _uniform_arguments(text: str) -> str:
    """Arguments that are a whole object (a call cut just before its last brace) written as every
    parsed call's are; anything else as the model wrote it."""
    try:
        parsed = json.loads(text)
    except ValueError:
        return text
    return _dumps(parsed) if isinstance(parsed, dict) else text


def _before_unmatched_close(text: str) -> str:
    """text up to its first closing bracket that no bracket in it opened (strings skipped)."""
    depth, in_string, escaped = 0, False, False
    for i, char in enumerate(text):
        if escaped:
            escaped = False
        elif in_string:
            escaped, in_string = char == "\\", char != '"'
        elif char == '"':
            in_string = True
        elif char in "{[":
            depth += 1
        elif char in "}]":
            if depth == 0:
                return text[:i]
            depth -= 1
    return text


def _json_string(literal: str) -> str | None:
    try:
        return json.loads(literal)
    except ValueError:  # an invalid escape
        return None


def _names_a_tool(head: re.Match[str], tools: Sequence[Mapping[str, Any]]) -> bool:
    name = _json_string(head.group(1))
    return any(tool.get("function", {}).get("name") == name for tool in tools)


def _parse_xml(text: str, schemas: Mapping[str, Mapping[str, Any]]) -> list[ToolCall] | None:
    calls = []
    for match in _FUNCTION.finditer(text):
        name = match.group(1).strip()
        properties = schemas.get(name, {})
        arguments = {key.strip(): _typed_value(_strip_line_breaks(value),
                                               properties.get(key.strip()))
                     for key, value in _PARAMETER.findall(match.group(2))}
        calls.append(ToolCall(new_tool_call_id(), name, _dumps(arguments)))
    return calls or None


def _strip_line_breaks(value: str) -> str:
    """The value sits on its own lines: drop exactly one leading and one trailing newline."""
    value = value[1:] if value.startswith("\n") else value
    return value[:-1] if value.endswith("\n") else value


def _typed_value(value: str, schema: Mapping[str, Any] | None) -> Any:
    """A string parameter stays text; anything else is read as JSON when it parses."""
    if is_text_parameter(schema):
        return value
    try:
        return json.loads(value, parse_constant=_reject_constant)
    except ValueError:
        lowered = value.strip().lower()
        if "boolean" in _types(schema) and lowered in ("true", "false"):
            return lowered == "true"
        return value


def _types(schema: Mapping[str, Any] | None) -> set[Any]:
    kinds = (schema or {}).get("type")
    return set(kinds) if isinstance(kinds, list) else {kinds}


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")  # NaN/Infinity would break the arguments JSON


def _parameter_schemas(tools: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    schemas = {}
    for tool in tools:
        function = tool.get("function", {})
        properties = (function.get("parameters") or {}).get("properties")
        schemas[function.get("name")] = properties if isinstance(properties, dict) else {}
    return schemas


def _dumps(arguments: Mapping[str, Any]) -> str:
    return json.dumps(arguments, ensure_ascii=False)
