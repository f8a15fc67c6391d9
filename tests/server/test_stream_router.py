"""StreamRouter and tool-call parsing: hand-written expected splits, checked at every split."""

from __future__ import annotations

import itertools
import json

import pytest

from sparkinfer_cli.server.stream_router import StreamRouter, prompt_opens_thinking
from sparkinfer_cli.server.tool_calls import (
    arguments_for_template,
    forced_call_prefix,
    parse_tool_calls,
    uses_xml_format,
)

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}, "zip": {"type": "string"},
        "metric": {"type": "boolean"}, "hours": {"type": ["array", "null"]}}}}}
TOOLS = [WEATHER_TOOL]

XML_CALL = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n"
            "<parameter=days>\n3\n</parameter>\n<parameter=zip>\n01234\n</parameter>\n"
            "<parameter=metric>\nTrue\n</parameter>\n<parameter=hours>\n[1, 2]\n</parameter>\n"
            "</function>\n</tool_call>")
XML_ARGS = {"city": "New York", "days": 3, "zip": "01234", "metric": True, "hours": [1, 2]}
BARE_CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
JSON_CALL = f"<tool_call>\n{BARE_CALL}\n</tool_call>"

# (router options, generated text, expected content, expected reasoning, expected calls)
CASES = {
    "qwen3_thinking": ({"reasoning": True}, "<think>\nThe user wants X.\n</think>\n\nHello!",
                       "Hello!", "The user wants X.", []),
    "qwen35_prompt_opened_think": ({"reasoning": True, "thinking_open": True},
                                   "Step 1.\nStep 2.\n</think>\n\nAnswer: 42",
                                   "Answer: 42", "Step 1.\nStep 2.", []),
    "no_reasoning_parser": ({"reasoning": False}, "<think>\nx\n</think>\n\nHi",
                            "<think>\nx\n</think>\n\nHi", "", []),
    "think_after_text_is_content": ({"reasoning": True}, "Hi <think>not a thought</think>",
                                    "Hi <think>not a thought</think>", "", []),
    "second_think_is_content": ({"reasoning": True}, "<think>a</think>b<think>c</think>",
                                "b<think>c</think>", "a", []),
    "empty_thought": ({"reasoning": True}, "<think>\n\n</think>\n\nOnly content.",
                      "Only content.", "", []),
    "thought_cut_by_length": ({"reasoning": True, "thinking_open": True}, "I am still thinking \n",
                              "", "I am still thinking", []),
    "partial_marker_at_end": ({"reasoning": True, "tools": TOOLS}, "a <thi and <tool_ca",
                              "a <thi and <tool_ca", "", []),
    "json_tool_call": ({"reasoning": True, "tools": TOOLS}, "Let me check.\n" + JSON_CALL,
                       "Let me check.\n", "", [("get_weather", {"city": "Paris"})]),
    "xml_tool_call_typed_by_schema": ({"reasoning": True, "tools": TOOLS}, XML_CALL, "", "",
                                      [("get_weather", XML_ARGS)]),
    "think_then_xml_call": ({"reasoning": True, "thinking_open": True, "tools": TOOLS},
                            "Need weather.\n</think>\n\n" + XML_CALL, "", "Need weather.",
                            [("get_weather", XML_ARGS)]),
    "parallel_calls": ({"reasoning": True, "tools": TOOLS}, JSON_CALL + "\n" + JSON_CALL, "", "",
                       [("get_weather", {"city": "Paris"})] * 2),
    "no_tools_means_literal": ({"reasoning": True}, JSON_CALL, JSON_CALL, "", []),
    # the tags are markup, the server's own when tool_choice forced the call: never content
    "call_naming_no_function_is_content_without_tags": ({"reasoning": True, "tools": TOOLS},
                                                        "<tool_call>\n{not json}\n</tool_call>",
                                                        "{not json}", "", []),
    "empty_call_is_dropped": ({"reasoning": True, "tools": TOOLS}, "<tool_call>\n", "", "", []),
    "call_cut_before_its_name_is_content": ({"reasoning": True, "tools": TOOLS},
                                            '<tool_call>\n{"na', '{"na', "", []),
    "unterminated_xml_call_at_eos": ({"reasoning": True, "tools": TOOLS},
                                     "<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n"
                                     "</parameter>\n</function>\n",
                                     "", "", [("get_weather", {"city": "Rome"})]),
    # a call cut by max_tokens is still a call: its arguments are the text generated for them
    "json_call_cut_after_its_name": ({"reasoning": True, "tools": TOOLS},
                                     '<tool_call>\n{"name": "get_weather", "argu', "", "",
                                     [("get_weather", "")]),
    "json_call_cut_in_its_arguments": ({"reasoning": True, "tools": TOOLS},
                                       '<tool_call>\n{"name": "get_weather", "arguments": '
                                       '{"city": "Par', "", "", [("get_weather", '{"city": "Par')]),
    "json_call_cut_before_its_closing_brace": ({"reasoning": True, "tools": TOOLS},
                                               '<tool_call>\n{"name": "get_weather", '
                                               '"arguments": {"city": "Paris"}', "", "",
                                               [("get_weather", {"city": "Paris"})]),
    "xml_call_cut_in_a_value": ({"reasoning": True, "tools": TOOLS},
                                "<tool_call>\n<function=get_weather>\n<parameter=city>\nPar",
                                "", "", [("get_weather", {"city": "Par"})]),
    "malformed_json_call_keeps_its_arguments_text": ({"reasoning": True, "tools": TOOLS},
                                                     '<tool_call>\n{"name": "get_weather", '
                                                     '"arguments": {"city": Paris}}\n</tool_call>',
                                                     "", "", [("get_weather", '{"city": Paris}')]),
    # Qwen models sometimes drop the tags: a whole answer that is one call to a given tool, bare
    # or in a ```json fence, is that call (llama.cpp and vLLM parse these too)
    "untagged_json_call": ({"reasoning": True, "tools": TOOLS}, "\n" + BARE_CALL + "\n", "", "",
                           [("get_weather", {"city": "Paris"})]),
    "fenced_json_call": ({"reasoning": True, "tools": TOOLS}, f"```json\n{BARE_CALL}\n```", "",
                         "", [("get_weather", {"city": "Paris"})]),
    "fenced_call_without_language": ({"reasoning": True, "tools": TOOLS},
                                     f"```\n{BARE_CALL}\n```\n", "", "",
                                     [("get_weather", {"city": "Paris"})]),
    "think_then_untagged_call": ({"reasoning": True, "thinking_open": True, "tools": TOOLS},
                                 "Need weather.\n</think>\n\n" + BARE_CALL, "", "Need weather.",
                                 [("get_weather", {"city": "Paris"})]),
    "untagged_call_with_a_marker_in_a_value": ({"reasoning": True, "tools": TOOLS},
                                               '{"name": "get_weather", "arguments": '
                                               '{"city": "<tool_call>"}}', "", "",
                                               [("get_weather", {"city": "<tool_call>"})]),
    "untagged_json_naming_no_given_tool_is_content": ({"reasoning": True, "tools": TOOLS},
                                                      '{"name": "launch", "arguments": {}}',
                                                      '{"name": "launch", "arguments": {}}', "",
                                                      []),
    "untagged_json_without_tools_is_content": ({"reasoning": True}, BARE_CALL, BARE_CALL, "", []),
    "json_answer_is_content": ({"reasoning": True, "tools": TOOLS}, '{"answer": 42}',
                               '{"answer": 42}', "", []),
    "untagged_call_then_text_is_content": ({"reasoning": True, "tools": TOOLS},
                                           BARE_CALL + " Done.", BARE_CALL + " Done.", "", []),
    "text_then_untagged_call_is_content": ({"reasoning": True, "tools": TOOLS},
                                           "Call: " + BARE_CALL, "Call: " + BARE_CALL, "", []),
    "fenced_call_then_text_is_content": ({"reasoning": True, "tools": TOOLS},
                                         f"```json\n{BARE_CALL}\n```\nok",
                                         f"```json\n{BARE_CALL}\n```\nok", "", []),
    "cut_untagged_call_is_content": ({"reasoning": True, "tools": TOOLS}, BARE_CALL[:20],
                                     BARE_CALL[:20], "", []),
    "malformed_json_then_tagged_call": ({"reasoning": True, "tools": TOOLS},
                                        '{"name": "get_weather" oops ' + JSON_CALL,
                                        '{"name": "get_weather" oops ', "",
                                        [("get_weather", {"city": "Paris"})]),
    "backticks_are_content": ({"reasoning": True, "tools": TOOLS}, "`x` and ```py\nx\n```",
                              "`x` and ```py\nx\n```", "", []),
    "unicode_content": ({"reasoning": True}, "<think>🤔 ü</think>日本語 ✓", "日本語 ✓", "🤔 ü", []),
}


def route(options: dict, pieces: list[str]) -> tuple[str, str, list[tuple[str, dict]]]:
    router = StreamRouter(**options)
    content, reasoning, calls = "", "", []
    for routed in [router.push(p) for p in pieces] + [router.finish()]:
        content += routed.content
        reasoning += routed.reasoning
        calls += [(c.name, decoded(c.arguments)) for c in routed.tool_calls]
    return content, reasoning, calls


def decoded(arguments: str) -> dict | str:
    """A call's arguments as the object they encode, or as text where they are not JSON (a call
    cut by max_tokens, or malformed)."""
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


@pytest.mark.parametrize("name", CASES)
def test_every_two_piece_split_routes_like_the_expected_text(name: str) -> None:
    options, text, *expected = CASES[name]
    for cut in range(len(text) + 1):
        assert route(options, [text[:cut], text[cut:]]) == tuple(expected), f"split at {cut}"


@pytest.mark.parametrize("name", CASES)
def test_one_character_per_push(name: str) -> None:
    options, text, *expected = CASES[name]
    assert route(options, list(text)) == tuple(expected)


def test_every_three_piece_split_of_a_short_text() -> None:
    text = "<think>ab</think>c<tool_call>\n<function=f>\n</function>\n</tool_call>"
    expected = ("c", "ab", [("f", {})])
    for i, j in itertools.combinations(range(len(text) + 1), 2):
        assert route({"reasoning": True, "tools": TOOLS}, [text[:i], text[i:j], text[j:]]) == \
            expected, (i, j)


def test_text_is_released_as_soon_as_it_cannot_start_a_marker() -> None:
    router = StreamRouter(reasoning=True, tools=TOOLS)
    assert router.push("Hello").content == "Hello"
    assert router.push(" <").content == " "  # "<" may begin <tool_call>
    assert router.push("b>").content == "<b>"


def test_in_reasoning_tracks_the_state() -> None:
    router = StreamRouter(reasoning=True, thinking_open=True)
    assert router.in_reasoning
    router.push("x</think>")
    assert not router.in_reasoning


@pytest.mark.parametrize("prompt, opened", [
    ("<|im_start|>assistant\n<think>\n", True),
    ("<|im_start|>assistant\n<think>\n\n</think>\n\n", False),
    ("<|im_start|>assistant\n", False),
])
def test_prompt_opens_thinking(prompt: str, opened: bool) -> None:
    assert prompt_opens_thinking(prompt) is opened


def test_tool_call_ids_are_unique_and_openai_shaped() -> None:
    calls = parse_tool_calls(JSON_CALL[len("<tool_call>"):-len("</tool_call>")], TOOLS) + \
        parse_tool_calls(JSON_CALL[len("<tool_call>"):-len("</tool_call>")], TOOLS)
    assert calls[0].id != calls[1].id and calls[0].id.startswith("call_")
    assert calls[0].to_dict() == {"id": calls[0].id, "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "Paris"}'}}


@pytest.mark.parametrize("body, expected", [
    ('{"name": "f", "arguments": "{\\"a\\": 1}"}', [("f", {"a": 1})]),  # arguments as a string
    ('{"name": "f", "parameters": {"a": 1}}', [("f", {"a": 1})]),
    ('{"name": "f"}', [("f", {})]),
    ('{"arguments": {}}', None),
    ('[1, 2]', None),
    ("<function=f>\n<parameter=x>\nNaN\n</parameter>\n</function>", [("f", {"x": "NaN"})]),
    ("<function=f>\n<parameter=a>\n1\n</parameter>\n</function>\n<function=g>\n</function>",
     [("f", {"a": 1}), ("g", {})]),
    ("<function=f>\n<parameter=text>\nline 1\nline 2\n</parameter>\n</function>",
     [("f", {"text": "line 1\nline 2"})]),
])
def test_parse_tool_calls(body: str, expected: list | None) -> None:
    calls = parse_tool_calls(body, None)
    got = None if calls is None else [(c.name, json.loads(c.arguments)) for c in calls]
    assert got == expected


@pytest.mark.parametrize("arguments, expected", [
    ('{"city": "Paris"}', {"city": "Paris"}),
    ({"city": "Paris"}, {"city": "Paris"}),
    ("not json", "not json"),
    ("[1]", "[1]"),
])
def test_arguments_for_template(arguments, expected) -> None:
    assert arguments_for_template(arguments) == expected


@pytest.mark.parametrize("xml, name, rest", [
    (True, "get_weather", "<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>"),
    (False, "get_weather", '{"city": "Paris"}}\n</tool_call>'),
    (False, None, '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'),
])
def test_forced_call_prefix_continues_into_one_call(xml: bool, name: str | None, rest: str) -> None:
    forced = "</think>\n\n" + forced_call_prefix(xml, name)  # Qwen3.5 prompt had opened <think>
    router = StreamRouter(reasoning=True, thinking_open=True, tools=TOOLS)
    assert not router.push(forced)
    routed = router.push(rest)
    routed.extend(router.finish())
    assert (routed.content, routed.reasoning) == ("", "")
    assert [(c.name, json.loads(c.arguments)) for c in routed.tool_calls] == \
        [("get_weather", {"city": "Paris"})]


@pytest.mark.parametrize("xml, name, generated, expected_call", [
    (False, None, "", None),  # the model stopped at once: issue 31 saw content "<tool_call>\n"
    (False, None, "\n</tool_call>", None),
    (False, None, '{"name": "get_weather", "arguments": {"ci', ("get_weather", '{"ci')),
    (False, "get_weather", "", ("get_weather", "")),
    (False, "get_weather", '{"city": "Par', ("get_weather", '{"city": "Par')),
    (False, "get_weather", "{city: Paris}}\n</tool_call>", ("get_weather", "{city: Paris}")),
    (True, "get_weather", "<parameter=city>\nPar", ("get_weather", '{"city": "Par"}')),
    (True, None, "", None),
])
def test_forced_call_never_leaks_its_prefix(xml: bool, name: str | None, generated: str,
                                            expected_call: tuple[str, str] | None) -> None:
    """tool_choice 'required' or named: whatever the model makes of the forced call (nothing, a
    call cut by max_tokens, malformed arguments), the server's prefix is not content."""
    router = StreamRouter(reasoning=True, tools=TOOLS)
    routed = router.push(forced_call_prefix(xml, name))
    routed.extend(router.push(generated))
    routed.extend(router.finish())
    assert (routed.content, routed.reasoning) == ("", "")
    assert [(c.name, c.arguments) for c in routed.tool_calls] == \
        ([expected_call] if expected_call else [])


def test_an_answer_is_released_as_soon_as_it_cannot_be_an_untagged_call() -> None:
    router = StreamRouter(reasoning=True, tools=TOOLS)
    assert router.push('{"name": "get_weather", "arguments": {').content == ""  # may be a call
    assert router.push('}} and').content == '{"name": "get_weather", "arguments": {}} and'
    router = StreamRouter(reasoning=True, tools=TOOLS)
    assert router.push('{"na').content == ""
    assert router.push('me": "launch"').content == '{"name": "launch"'  # not a given tool
    router = StreamRouter(reasoning=True, tools=TOOLS)
    assert router.push('{"answer"').content == '{"answer"'  # a call starts with its name
    router = StreamRouter(reasoning=True, tools=TOOLS)
    assert router.push("```").content == ""
    assert router.push("python\nx = 1").content == "```python\nx = 1"


@pytest.mark.parametrize("template, xml", [("qwen3", False), ("qwen3.5", True),
                                           ("qwen3-coder", True), ("qwen2.5", False)])
def test_tool_format_follows_the_real_templates(fixtures_dir, template: str, xml: bool) -> None:
    goldens = json.loads((fixtures_dir / "chat" / "chat_template_goldens.json").read_text())
    assert uses_xml_format(goldens["templates"][template]["text"]) is xml
