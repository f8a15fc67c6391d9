"""Tool calls as a grammar: the Lark grammar (llguidance's dialect, engine/constraint.py) that
holds a chat answer's tool calls to the form its template teaches (tool_calls.py: Qwen3's JSON
body, Qwen3.5/3.6's XML one), each naming one of the request's functions with arguments that
follow that function's `parameters` schema.

  tool_choice 'auto'   free text, or text and then calls: once the answer writes <tool_call>
                       it is held to a call (with a response_format schema, the answer is that
                       JSON or calls)
  'required'           the prompt ends in '<tool_call>\\n' (forced_call_prefix): a call, more
                       when parallel_tool_calls allows, then the answer ends
  a named function     the prompt ends in that call's opening: its arguments, then the end

The templates write one newline between calls. Qwen3's arguments are a JSON object (%json of the
schema); Qwen3.5's are <parameter=...> blocks in the schema's property order, the required ones
present, a string value as raw text (its minLength and maxLength hold, its pattern and format
do not), a boolean as JSON or Python writes it, one of an enum's values as the template writes
it, and any other value as JSON.
Schema keywords llguidance does not implement are ignored (lenient) rather than refused: agents
send large tool schemas, and the rest of each schema still holds.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from sparkinfer_cli.engine.constraint import COMPACT_JSON
from sparkinfer_cli.server.tool_calls import (
    TOOL_CALL_OPEN,
    call_closing,
    call_opening,
    is_text_parameter,
)

TOOL_SCHEMA_OPTIONS = {**COMPACT_JSON, "lenient": True}
OBJECT = {"type": "object"}  # the arguments of a function that declares no parameters
CALL_OPENED = f"{TOOL_CALL_OPEN}\n"
NEXT_CALL = f"\n{TOOL_CALL_OPEN}\n"
PARAMETER_OPENING = "<parameter={}>\n"
PARAMETER_END = "\n</parameter>\n"
# Qwen3.5's template writes a boolean argument as Python does (True); JSON's spelling reads too
BOOLEANS = ("true", "false", "True", "False")
# Free text; an XML string value also never holds what would end it early for the parser. A
# lazy lexeme ends at its first match, so text_then_call ends at the first <tool_call>.
TERMINALS = rf"""
TEXT: /(?s:.*)/
XML_TEXT: /(?s:.*)/ & ~/(?s:.*)(<\/?parameter|<\/function)(?s:.*)/
text_then_call[lazy]: TEXT {json.dumps(TOOL_CALL_OPEN)}
xml_text_value[lazy]: XML_TEXT {json.dumps(PARAMETER_END)}
"""


def tool_call_grammar(tools: Sequence[Mapping[str, Any]], *, tool_choice: str,
                      forced_tool: str | None, parallel: bool, xml_format: bool,
                      answer_schema: str | None = None) -> str:
    """The Lark grammar of the answer to a chat request with tools (those its template
    renders: a named tool_choice renders only that function). answer_schema: response_format's
    JSON schema, which an answer that calls nothing follows ('auto' only)."""
    functions = [tool["function"] for tool in tools]
    rules: list[str] = []
    for i, function in enumerate(functions):
        arguments = _arguments(function.get("parameters") or OBJECT, xml_format, i, rules)
        rules.append(f"args_{i}: {arguments}")
    closing = _literal(call_closing(xml_format))
    if forced_tool is not None:  # the prompt opened the call of the one rendered function
        return _grammar(f"args_0 {closing}", rules)
    rules.append("call: (" + " | ".join(
        f"{_literal(call_opening(xml_format, function['name']))} args_{i}"
        for i, function in enumerate(functions)) + f") {closing}")
    calls = f"call ({_literal(NEXT_CALL)} call)*" if parallel else "call"
    if tool_choice == "required":  # the prompt opened the first call
        return _grammar(calls, rules)
    if answer_schema is not None:
        answer = _json_value(json.loads(answer_schema), COMPACT_JSON)
        return _grammar(f"{answer} | {_literal(CALL_OPENED)} {calls}", rules)
    line_break = _literal("\n")  # the templates write one after <tool_call>
    return _grammar(f"TEXT | text_then_call {line_break} {calls}", rules)


def _grammar(start: str, rules: list[str]) -> str:
    return "\n".join([f"start: {start}", *rules, TERMINALS])


def _arguments(parameters: Mapping[str, Any], xml_format: bool, index: int,
               rules: list[str]) -> str:
    """Function `index`'s arguments (rules: where the rules they need go)."""
    if not xml_format:
        return _json_value(parameters, TOOL_SCHEMA_OPTIONS)
    properties = parameters.get("properties")
    required = parameters.get("required") or ()
    # $ref inside a property points into the root's definitions: each value's schema takes them
    definitions = {k: parameters[k] for k in ("$defs", "definitions") if k in parameters}
    blocks = []
    for j, (name, schema) in enumerate(properties.items()
                                       if isinstance(properties, Mapping) else ()):
        schema = {**schema, **definitions} if isinstance(schema, Mapping) else definitions
        value = _xml_value(schema, f"{index}_{j}", rules)
        block = f"({_literal(PARAMETER_OPENING.format(name))} {value})"
        blocks.append(block if name in required else f"{block}?")
    return " ".join(blocks) or '""'


def _xml_value(schema: Mapping[str, Any], name: str, rules: list[str]) -> str:
    """A parameter's value and the end of its block (rules: where a bounded text's go)."""
    if isinstance(schema.get("enum"), list):  # the template writes a string raw, all else JSON
        return _value_among([v if isinstance(v, str) else json.dumps(v) for v in schema["enum"]])
    if schema.get("type") == "boolean":
        return _value_among(BOOLEANS)
    if not is_text_parameter(schema):
        return f"{_json_value(schema, TOOL_SCHEMA_OPTIONS)} {_literal(PARAMETER_END)}"
    shortest, longest = schema.get("minLength", 0), schema.get("maxLength", "")
    if not shortest and longest == "":
        return "xml_text_value"
    rules.append(f"XML_TEXT_{name}: /(?s:.{{{shortest},{longest}}})/ & XML_TEXT")
    rules.append(f"xml_text_value_{name}[lazy]: XML_TEXT_{name} {_literal(PARAMETER_END)}")
    return f"xml_text_value_{name}"


def _value_among(texts: Sequence[str]) -> str:
    """One of these texts, then the end of the parameter's block."""
    return "(" + " | ".join(_literal(text) for text in texts) + f") {_literal(PARAMETER_END)}"


def _json_value(schema: Mapping[str, Any], options: Mapping[str, Any]) -> str:
    return f"%json {json.dumps({**schema, 'x-guidance': options})}"


def _literal(text: str) -> str:
    return json.dumps(text)  # a Lark string literal escapes as JSON does
