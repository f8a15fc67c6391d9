"""Qwen tool calls ⇄ OpenAI tool_calls.

Two formats appear between <tool_call> and </tool_call>:
  Qwen3 (hermes):         {"name": "get_weather", "arguments": {"city": "Paris"}}
  Qwen3.5/3.6 and Coder:  <function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>
The XML form carries every value as text, so values are typed by the tool's JSON Schema.
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


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text of an object, as OpenAI sends it

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


def new_tool_call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


def parse_tool_calls(body: str, tools: Sequence[Mapping[str, Any]] | None) -> list[ToolCall] | None:
    """The calls in the text between <tool_call> and </tool_call>, or None if it does not parse."""
    text = body.strip()
    if text.startswith("<function="):
        return _parse_xml(text, _parameter_schemas(tools or ()))
    return _parse_json(text)


def uses_xml_format(template_source: str) -> bool:
    """Qwen3.5/3.6 and Qwen3-Coder templates teach the <function=...> form; Qwen3 the JSON one."""
    return "<function=" in template_source


def forced_call_prefix(xml_format: bool, name: str | None) -> str:
    """Text appended to the prompt so generation starts inside a tool call (tool_choice
    'required'), or inside a call of one named function."""
    if name is None:
        return f"{TOOL_CALL_OPEN}\n"
    if xml_format:
        return f"{TOOL_CALL_OPEN}\n<function={name}>\n"
    return f'{TOOL_CALL_OPEN}\n{{"name": {json.dumps(name)}, "arguments": '


def arguments_for_template(arguments: str | dict[str, Any]) -> dict[str, Any] | str:
    """OpenAI history sends arguments as a JSON string; Qwen templates iterate them as a mapping."""
    if isinstance(arguments, dict):
        return arguments
    try:
        parsed = json.loads(arguments)
    except ValueError:
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
    kinds = (schema or {}).get("type")
    kinds = set(kinds) if isinstance(kinds, list) else {kinds}
    if "string" in kinds:
        return value
    try:
        return json.loads(value, parse_constant=_reject_constant)
    except ValueError:
        lowered = value.strip().lower()
        if "boolean" in kinds and lowered in ("true", "false"):
            return lowered == "true"
        return value


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
