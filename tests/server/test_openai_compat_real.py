"""Issue 31's curated OpenAI-compatibility cases against the real server (engine, tokenizer, chat
template and the tiny qwen3 GGUF in a process of their own), through the openai SDK and raw SSE:
what test_openai_compat.py checks against the FakeEngine, here without any fake."""

from __future__ import annotations

import httpx
import openai
import pytest
from server_harness import sse_json
from test_admission import assert_openai_error
from test_e2e_real import sdk, start_real_server

pytestmark = pytest.mark.slow  # a server process; the first may compile the CPU kernels
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
HELLO = [{"role": "user", "content": "Hello!"}]


@pytest.fixture(scope="module")
def real():
    with start_real_server() as server:
        yield server


def stream(server, path: str, body: dict) -> list[dict]:
    response = httpx.post(f"{server.url}/v1/{path}", json={"model": "m", **body, "stream": True},
                          timeout=300)
    response.raise_for_status()
    chunks, done = sse_json(response.text)
    assert done
    return chunks


def test_item_1_null_tool_choice_is_omitted(real) -> None:
    reply = sdk(real).chat.completions.create(model="m", messages=HELLO, tools=[WEATHER],
                                              tool_choice=None, max_tokens=4)
    assert reply.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_items_4_and_8_chunk_shapes_of_a_stream_cut_by_max_tokens(real) -> None:
    chunks = stream(real, "chat/completions", {"messages": HELLO, "max_tokens": 5,
                                               "temperature": 0})
    choices = [c["choices"][0] for c in chunks]
    assert choices[0]["delta"] == {"role": "assistant", "content": ""}
    assert choices[-1]["delta"] == {} and choices[-1]["finish_reason"] == "length"
    assert all(c["finish_reason"] is None for c in choices[:-1])
    assert all(c["system_fingerprint"].startswith("fp_") for c in chunks)


def test_item_5_stream_options_need_stream(real) -> None:
    for path, body in (("chat/completions", {"messages": HELLO}),
                       ("completions", {"prompt": "Hi"})):
        response = httpx.post(f"{real.url}/v1/{path}",
                              json={"model": "m", **body,
                                    "stream_options": {"include_usage": True}})
        assert_openai_error(response, 400)


def test_item_6_legacy_logprobs_hold_the_sampled_token(real) -> None:
    completion = sdk(real).completions.create(model="m", prompt="Once upon a time",
                                              max_tokens=4, temperature=0, logprobs=0)
    lp = completion.choices[0].logprobs
    assert len(lp.tokens) == len(lp.top_logprobs) == 4
    for token, top in zip(lp.tokens, lp.top_logprobs):
        assert token in top and len(top) == 1


def test_item_8_fingerprint_usage_details_and_legacy_functions(real) -> None:
    reply = sdk(real).chat.completions.create(model="m", messages=HELLO, max_tokens=3)
    assert reply.system_fingerprint.startswith("fp_")
    assert reply.usage.prompt_tokens_details.cached_tokens >= 0
    legacy = httpx.post(f"{real.url}/v1/chat/completions", timeout=300, json={
        "model": "m", "messages": HELLO, "max_tokens": 3,
        "functions": [WEATHER["function"]], "function_call": "none"})
    assert legacy.status_code == 200, legacy.text


def test_item_10_unprefixed_routes_and_detokenize(real) -> None:
    assert httpx.get(f"{real.url}/models").json()["data"]
    unprefixed = openai.OpenAI(base_url=real.url, api_key="x", max_retries=0, timeout=300)
    reply = unprefixed.chat.completions.create(model="m", messages=HELLO, max_tokens=2)
    assert reply.choices[0].message.role == "assistant"
    ids = httpx.post(f"{real.url}/v1/tokenize", json={"prompt": "Hello world"}).json()["tokens"]
    text = httpx.post(f"{real.url}/v1/detokenize", json={"tokens": ids}).json()["content"]
    assert text == "Hello world"
