"""Tool calls over HTTP (issue 31, items 2 and 9): a forced call never leaks the server's prefix
into content and is reported as a call even when max_tokens cuts it; an answer that is one call
without <tool_call> tags (bare JSON or a ```json fence) naming a given tool is a tool call."""

from __future__ import annotations

import json

import httpx
import pytest
from server_harness import sse_json
from test_chat import ADD_TOOL, WEATHER_TOOL, user

NAMED = {"type": "function", "function": {"name": "get_weather"}}
UNTAGGED_CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'


def chat(server, body: dict) -> dict:
    response = httpx.post(f"{server.base_url}/chat/completions", json=body)
    response.raise_for_status()
    return response.json()["choices"][0]


def chat_stream(server, body: dict) -> tuple[str, list[dict], str]:
    """(content, tool_call deltas, finish reason) of a streamed chat completion."""
    response = httpx.post(f"{server.base_url}/chat/completions", json={**body, "stream": True})
    response.raise_for_status()
    chunks, done = sse_json(response.text)
    assert done
    deltas = [c["choices"][0] for c in chunks]
    return ("".join(d["delta"].get("content") or "" for d in deltas),
            [tc for d in deltas for tc in d["delta"].get("tool_calls", [])],
            deltas[-1]["finish_reason"])


def calls_of(message: dict) -> list[tuple[str, str]]:
    return [(c["function"]["name"], c["function"]["arguments"])
            for c in message.get("tool_calls", [])]


def test_a_required_call_the_model_leaves_empty_leaks_no_markup(make_server) -> None:
    srv = make_server(reply=lambda prompt, params: "")  # EOS right after the forced <tool_call>
    body = {"messages": user("hi"), "tools": [WEATHER_TOOL], "tool_choice": "required"}
    choice = chat(srv, body)
    assert choice["message"]["content"] == "" and "tool_calls" not in choice["message"]
    assert choice["finish_reason"] == "stop"
    assert chat_stream(srv, body) == ("", [], "stop")


@pytest.mark.parametrize("tool_choice, generated", [
    (NAMED, '{"city":'),
    ("required", '{"name": "get_weather", "arguments": {"city": "Ro'),
])
def test_a_forced_call_cut_by_max_tokens_is_a_tool_call(server, tool_choice, generated) -> None:
    body = {"messages": user("hi"), "tools": [WEATHER_TOOL, ADD_TOOL], "tool_choice": tool_choice,
            "max_tokens": len(generated)}  # the fake model writes one character per token
    arguments = generated.split('"arguments": ')[-1]
    choice = chat(server, body)
    assert choice["message"]["content"] is None
    assert calls_of(choice["message"]) == [("get_weather", arguments)]
    assert choice["finish_reason"] == "length"
    content, calls, finish_reason = chat_stream(server, body)
    assert (content, finish_reason) == ("", "length")
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == \
        [("get_weather", arguments)]


@pytest.mark.parametrize("reply", [UNTAGGED_CALL, f"```json\n{UNTAGGED_CALL}\n```"])
def test_an_untagged_call_to_a_given_tool_is_a_tool_call(make_server, reply: str) -> None:
    srv = make_server(reply=lambda prompt, params: reply)
    body = {"messages": user("weather?"), "tools": [WEATHER_TOOL]}
    choice = chat(srv, body)
    assert choice["message"]["content"] is None
    assert [(name, json.loads(arguments)) for name, arguments in calls_of(choice["message"])] == \
        [("get_weather", {"city": "Paris"})]
    assert choice["finish_reason"] == "tool_calls"
    content, calls, finish_reason = chat_stream(srv, body)
    assert (content, finish_reason) == ("", "tool_calls")
    assert [c["function"]["name"] for c in calls] == ["get_weather"]


def test_untagged_json_stays_content_unless_it_calls_a_given_tool(make_server) -> None:
    srv = make_server(reply=lambda prompt, params: UNTAGGED_CALL)
    for tools in ([ADD_TOOL], None):
        body = {"messages": user("weather?"), **({"tools": tools} if tools else {})}
        choice = chat(srv, body)
        assert (choice["message"]["content"], choice["finish_reason"]) == (UNTAGGED_CALL, "stop")
        assert "tool_calls" not in choice["message"]
