"""Where a client written against api.openai.com expects exact OpenAI behaviour (issue 31: the
cases llama.cpp's and vLLM's HTTP suites found), over a real socket against the FakeEngine, whose
replies are known in advance (server_fakes.scripted_reply): the openai SDK and raw SSE."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from server_harness import sse_json
from test_admission import assert_openai_error
from test_chat import WEATHER_TOOL, user


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)


def stream_chunks(server, path: str, body: dict) -> list[dict]:
    response = httpx.post(f"{server.base_url}/{path}", json={**body, "stream": True})
    response.raise_for_status()
    chunks, done = sse_json(response.text)
    assert done
    return chunks


def test_explicit_null_tool_choice_means_omitted(client) -> None:
    completion = client.chat.completions.create(model="m", messages=user("[tool]"),
                                                tools=[WEATHER_TOOL], tool_choice=None)
    assert completion.choices[0].message.tool_calls[0].function.name == "get_weather"


def test_a_stream_cut_by_max_tokens_sends_its_finish_reason_alone(server) -> None:
    chunks = stream_chunks(server, "chat/completions",
                           {"messages": user("abcdef"), "max_tokens": 5})
    deltas = [c["choices"][0] for c in chunks]
    assert "".join(d["delta"].get("content", "") for d in deltas) == "You s"
    assert deltas[-1] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "length"}
    assert all(d["finish_reason"] is None for d in deltas[:-1])


def test_the_first_chunk_carries_only_the_role(server) -> None:
    chunks = stream_chunks(server, "chat/completions", {"messages": user("hi")})
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all("role" not in c["choices"][0]["delta"] for c in chunks[1:])


def test_stream_options_need_stream(server) -> None:
    for path, body in (("chat/completions", {"messages": user("x")}),
                       ("completions", {"prompt": "x"})):
        response = httpx.post(f"{server.base_url}/{path}",
                              json={**body, "stream_options": {"include_usage": True}})
        assert assert_openai_error(response, 400)["param"] == "stream_options"


def test_legacy_logprobs_always_hold_the_sampled_token(client) -> None:
    completion = client.completions.create(model="m", prompt="zz", logprobs=0, max_tokens=3)
    logprobs = completion.choices[0].logprobs
    assert logprobs.tokens == ["Y", "o", "u"]
    assert logprobs.top_logprobs == [{t: lp} for t, lp in zip(logprobs.tokens,
                                                              logprobs.token_logprobs)]


def test_system_fingerprint_and_cached_tokens(server, client) -> None:
    completion = client.chat.completions.create(model="m", messages=user("x"))
    assert completion.system_fingerprint
    assert completion.usage.prompt_tokens_details.cached_tokens == 0
    legacy = client.completions.create(model="m", prompt="x")
    assert legacy.system_fingerprint == completion.system_fingerprint
    assert legacy.usage.prompt_tokens_details.cached_tokens == 0
    chunks = stream_chunks(server, "chat/completions",
                           {"messages": user("x"), "stream_options": {"include_usage": True}})
    assert {c["system_fingerprint"] for c in chunks} == {completion.system_fingerprint}
    assert chunks[-1]["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}


def test_deprecated_functions_map_onto_tools(server) -> None:
    function = WEATHER_TOOL["function"]
    body = httpx.post(f"{server.base_url}/chat/completions",
                      json={"messages": user("[tool]"), "functions": [function]}).json()
    assert body["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "get_weather"
    forced = httpx.post(f"{server.base_url}/chat/completions",
                        json={"messages": user("x"), "functions": [function],
                              "function_call": {"name": "get_weather"}}).json()
    call = forced["choices"][0]["message"]["tool_calls"][0]["function"]
    assert call["name"] == "get_weather" and "Oslo" in call["arguments"]


@pytest.mark.parametrize("body", [
    {"messages": user("x"), "logit_bias": {"²": 5}},  # int() takes superscript digits
    {"messages": user("x"), "logit_bias": {"9" * 5000: 5}},  # beyond int()'s digit limit
    {"messages": [{"role": "user", "content": "a\ud800b"}]},  # a lone surrogate
])
def test_bad_bodies_found_by_fuzzing_are_400(server, body) -> None:
    raw = json.dumps(body).encode()  # ASCII: the surrogate travels as its escape
    response = httpx.post(f"{server.base_url}/chat/completions", content=raw,
                          headers={"content-type": "application/json"})
    assert_openai_error(response, 400)


@pytest.mark.parametrize("path, raw", [
    ("chat/completions", b'{"messages": [{"role": "user", "content": "a\xed\xa0\x80b"}]}'),
    ("completions", b'{"prompt": "a\xed\xa0\x80b"}'),
], ids=["content", "prompt"])
def test_a_surrogate_sent_as_utf8_bytes_is_400(server, path, raw) -> None:
    # a lone surrogate encoded as if it were a code point (CESU-8): not UTF-8
    response = httpx.post(f"{server.base_url}/{path}", content=raw,
                          headers={"content-type": "application/json"})
    assert assert_openai_error(response, 400)["code"] == "invalid_json"


def with_field_nested(body: dict, field: str, depth: int) -> bytes:
    """body with one more field: an object nested depth levels deep."""
    nested = '{"a": ' * depth + "1" + "}" * depth
    return (json.dumps(body)[:-1] + f', "{field}": {nested}}}').encode()


@pytest.mark.parametrize("path, body", [
    ("chat/completions", {"messages": user("x")}),
    ("completions", {"prompt": "x"}),
    ("responses", {"input": "x"}),
    ("messages", {"messages": user("x"), "max_tokens": 5}),
])
def test_an_unknown_field_nested_980_deep_is_ignored(server, path, body) -> None:
    response = httpx.post(f"{server.base_url}/{path}", content=with_field_nested(body, "x", 980),
                          headers={"content-type": "application/json"})
    assert response.status_code == 200, response.text


@pytest.mark.parametrize("raw", [
    with_field_nested({"messages": user("x")}, "x", 2000),
    # nested deeper than json.dumps / json.loads can go from a handler, but within the body limit
    json.dumps({"messages": user("x"), "response_format": {
        "type": "json_schema", "json_schema": {"name": "n", "schema": "SCHEMA"}}}).replace(
        '"SCHEMA"', '{"a": ' * 1015 + "1" + "}" * 1015).encode(),
    json.dumps({"messages": [*user("x"), {"role": "assistant", "content": "", "tool_calls": [
        {"id": "1", "type": "function",
         "function": {"name": "f", "arguments": '{"a": ' * 1020 + "1" + "}" * 1020}}]}]}).encode(),
], ids=["unknown field", "response_format schema", "tool call arguments"])
def test_bodies_nested_too_deep_to_use_are_400(server, raw) -> None:
    response = httpx.post(f"{server.base_url}/chat/completions", content=raw,
                          headers={"content-type": "application/json"})
    assert_openai_error(response, 400)


def test_a_prompt_nested_hundreds_of_lists_deep_is_400(server) -> None:
    prompt: list = [1]
    for _ in range(900):
        prompt = [prompt]
    response = httpx.post(f"{server.base_url}/completions", json={"prompt": prompt})
    assert assert_openai_error(response, 400)["param"] == "prompt"
