"""Chat completions over a real HTTP socket with the official openai SDK and raw SSE parsing.

The FakeEngine answers "You said: <last user message>" one character per token, then EOS, so
every expected string and token count below is known in advance.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest
from server_fakes import JSON_TOOL_REPLY, QwenLikeTemplate
from server_harness import sse_json

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "days": {"type": "integer"}}}}}
ADD_TOOL = {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def num_prompt_tokens(messages: list[dict], **kwargs) -> int:
    return len(QwenLikeTemplate().render(messages, **kwargs))  # CharTokenizer: 1 token per char


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)


def test_sdk_sync_non_streaming(client) -> None:
    completion = client.chat.completions.create(model="any", messages=user("hello"))
    choice = completion.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == "You said: hello"
    assert choice.finish_reason == "stop"
    assert completion.object == "chat.completion" and completion.id.startswith("chatcmpl-")
    assert completion.model == "any"
    usage = completion.usage
    assert usage.prompt_tokens == num_prompt_tokens(user("hello"))
    assert usage.completion_tokens == len("You said: hello") + 1  # + EOS
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    extra = usage.model_extra
    assert extra["ttft_ms"] >= 0 and extra["generation_ms"] >= 0 and extra["decode_tps"] >= 0


def test_sdk_streaming_with_usage(client) -> None:
    stream = client.chat.completions.create(model="m", messages=user("stream me"), stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert len({c.id for c in chunks}) == 1 and len({c.created for c in chunks}) == 1
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == "You said: stream me"
    assert [c.choices[0].finish_reason for c in chunks[:-1]][-1] == "stop"
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == len("You said: stream me") + 1


def test_sdk_async_concurrent(server) -> None:
    async def main() -> list[str]:
        async with openai.AsyncOpenAI(base_url=server.base_url, api_key="x") as client:
            async def ask(i: int) -> str:
                completion = await client.chat.completions.create(model="m",
                                                                  messages=user(f"n{i}"))
                return completion.choices[0].message.content

            async def ask_streaming(i: int) -> str:
                stream = await client.chat.completions.create(model="m", messages=user(f"s{i}"),
                                                              stream=True)
                return "".join([c.choices[0].delta.content or "" async for c in stream])

            return await asyncio.gather(*[ask(i) for i in range(4)],
                                        *[ask_streaming(i) for i in range(4)])

    answers = asyncio.run(main())
    assert answers == [f"You said: n{i}" for i in range(4)] + [f"You said: s{i}" for i in range(4)]


def test_raw_sse_framing(server) -> None:
    with httpx.stream("POST", f"{server.base_url}/chat/completions",
                      json={"messages": user("raw"), "stream": True}) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        body = response.read().decode()
    assert body.startswith("data: {") and body.endswith("data: [DONE]\n\n")
    chunks, done = sse_json(body)
    assert done
    assert all(c["object"] == "chat.completion.chunk" and "usage" not in c for c in chunks)
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == "You said: raw"


def test_reasoning_split_non_streaming_and_streaming(client) -> None:
    completion = client.chat.completions.create(model="m", messages=user("[think]"))
    message = completion.choices[0].message
    assert message.content == "Hello there!"
    assert message.model_extra["reasoning_content"] == "The user wants a greeting."
    assert message.model_extra["reasoning"] == "The user wants a greeting."
    assert completion.usage.completion_tokens_details.reasoning_tokens > 0
    chunks = list(client.chat.completions.create(model="m", messages=user("[think]"), stream=True))
    deltas = [c.choices[0].delta for c in chunks]
    assert "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas) == \
        "The user wants a greeting."
    assert "".join(d.content or "" for d in deltas) == "Hello there!"


def test_reasoning_when_the_prompt_opens_think(make_server) -> None:
    srv = make_server(opens_thinking=True,
                      reply=lambda prompt, params: "Plan: greet.\n</think>\n\nHi!")
    body = httpx.post(f"{srv.base_url}/chat/completions", json={"messages": user("x")}).json()
    message = body["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == ("Plan: greet.", "Hi!")


@pytest.mark.parametrize("extra", [{"enable_thinking": False},
                                   {"chat_template_kwargs": {"enable_thinking": False}},
                                   {"reasoning_effort": "none"}])
def test_enable_thinking_false_reaches_the_template(server, extra) -> None:
    response = httpx.post(f"{server.base_url}/chat/completions",
                          json={"messages": user("no think"), **extra})
    assert response.status_code == 200
    prompt = "".join(map(chr, server.engine.submitted[-1][1]))
    assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_tool_call_json_format(client) -> None:
    completion = client.chat.completions.create(model="m", messages=user("[tool]"),
                                                tools=[WEATHER_TOOL])
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.id.startswith("call_")
    assert (call.function.name, json.loads(call.function.arguments)) == \
        ("get_weather", {"city": "Paris"})


def test_tool_call_xml_format_streaming(client) -> None:
    chunks = list(client.chat.completions.create(model="m", messages=user("[xmltool]"),
                                                 tools=[WEATHER_TOOL], stream=True))
    calls = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    assert len(calls) == 1 and calls[0].index == 0 and calls[0].id.startswith("call_")
    assert calls[0].function.name == "get_weather"
    assert json.loads(calls[0].function.arguments) == {"city": "Paris", "days": 3}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ""


def test_tool_results_are_rendered_back(server, client) -> None:
    messages = [*user("Weather in Paris?"),
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": '{"sky": "sunny"}'}]
    completion = client.chat.completions.create(model="m", messages=messages,
                                                tools=[WEATHER_TOOL])
    assert completion.choices[0].message.content == "It is sunny in Paris."
    prompt = "".join(map(chr, server.engine.submitted[-1][1]))
    assert '{"name": "get_weather", "arguments": {"city": "Paris"}}' in prompt
    assert '<tool_response>\n{"sky": "sunny"}\n</tool_response>' in prompt


def test_tool_choice_none_and_named(server) -> None:
    url = f"{server.base_url}/chat/completions"
    body = httpx.post(url, json={"messages": user("[tool]"), "tools": [WEATHER_TOOL],
                                 "tool_choice": "none"}).json()
    assert body["choices"][0]["message"]["content"] == JSON_TOOL_REPLY  # not parsed
    assert "# Tools" not in "".join(map(chr, server.engine.submitted[-1][1]))
    named = {"type": "function", "function": {"name": "add"}}
    httpx.post(url, json={"messages": user("x"), "tools": [WEATHER_TOOL, ADD_TOOL],
                          "tool_choice": named}).raise_for_status()
    prompt = "".join(map(chr, server.engine.submitted[-1][1]))
    assert '"name": "add"' in prompt and "get_weather" not in prompt
    response = httpx.post(url, json={"messages": user("x"), "tools": [WEATHER_TOOL],
                                     "tool_choice": {"type": "function",
                                                     "function": {"name": "nope"}}})
    assert response.status_code == 400 and response.json()["error"]["param"] == "tool_choice"


def test_required_and_named_tool_choice_force_a_call(server, client) -> None:
    required = client.chat.completions.create(model="m", messages=user("hi"),
                                              tools=[WEATHER_TOOL], tool_choice="required")
    call = required.choices[0].message.tool_calls[0]
    assert (call.function.name, json.loads(call.function.arguments)) == \
        ("get_weather", {"city": "Rome"})
    assert "".join(map(chr, server.engine.submitted[-1][1])).endswith(
        "<|im_start|>assistant\n<tool_call>\n")
    named = {"type": "function", "function": {"name": "get_weather"}}
    chunks = list(client.chat.completions.create(model="m", messages=user("hi"), stream=True,
                                                 tools=[WEATHER_TOOL, ADD_TOOL],
                                                 tool_choice=named))
    calls = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    assert [(tc.function.name, json.loads(tc.function.arguments)) for tc in calls] == \
        [("get_weather", {"city": "Oslo"})]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_n_choices_fan_out_with_seeds(server, client) -> None:
    completion = client.chat.completions.create(model="m", messages=user("hi"), n=3,
                                                temperature=0.7, seed=10)
    texts = [c.message.content for c in sorted(completion.choices, key=lambda c: c.index)]
    assert texts == [f"You said: hi #{10 + i}" for i in range(3)]
    assert completion.usage.prompt_tokens == num_prompt_tokens(user("hi"))
    assert completion.usage.completion_tokens == sum(len(t) + 1 for t in texts)
    chunks = list(client.chat.completions.create(model="m", messages=user("yo"), n=2,
                                                 stream=True))
    for index in (0, 1):
        parts = [c.choices[0].delta.content or "" for c in chunks if c.choices[0].index == index]
        assert "".join(parts) == "You said: yo"


def test_logprobs(client) -> None:
    completion = client.chat.completions.create(model="m", messages=user("ab"), logprobs=True,
                                                top_logprobs=2)
    entries = completion.choices[0].logprobs.content
    assert len(entries) == completion.usage.completion_tokens
    assert "".join(e.token for e in entries[:-1]) == "You said: ab"
    first = entries[0]
    assert (first.token, first.logprob, first.bytes) == ("Y", -0.25, [89])
    assert [(t.token, t.logprob) for t in first.top_logprobs] == [("Y", -0.25), ("?", -2.5)]
    chunks = list(client.chat.completions.create(model="m", messages=user("ab"), logprobs=True,
                                                 stream=True))
    streamed = [e for c in chunks if c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in entries]
    assert streamed[0].top_logprobs == []


def test_sampling_parameters_reach_the_engine(server) -> None:
    body = {"messages": user("p"), "temperature": 0.5, "top_p": 0.9, "top_k": 7, "min_p": 0.1,
            "presence_penalty": 0.5, "frequency_penalty": -0.5, "repetition_penalty": 1.1,
            "seed": 3, "logit_bias": {"65": 5, "66": -100}, "stop": ["x", "y"],
            "max_completion_tokens": 50, "max_tokens": 9}
    httpx.post(f"{server.base_url}/chat/completions", json=body).raise_for_status()
    params = server.engine.submitted[-1][2]
    assert (params.temperature, params.top_p, params.top_k, params.min_p) == (0.5, 0.9, 7, 0.1)
    assert (params.presence_penalty, params.frequency_penalty, params.repetition_penalty) == \
        (0.5, -0.5, 1.1)
    assert (params.seed, params.logit_bias, params.stop) == (3, {65: 5.0, 66: -100.0}, ("x", "y"))
    assert params.max_tokens == 50 and not params.logprobs


def test_stop_and_length(client) -> None:
    completion = client.chat.completions.create(model="m", messages=user("one two three"),
                                                stop="two")
    assert completion.choices[0].message.content == "You said: one "
    assert completion.choices[0].finish_reason == "stop"
    completion = client.chat.completions.create(model="m", messages=user("one two"), max_tokens=5)
    assert completion.choices[0].message.content == "You s"
    assert completion.choices[0].finish_reason == "length"
    assert completion.usage.completion_tokens == 5


def test_content_part_arrays_and_developer_role(server) -> None:
    messages = [{"role": "developer", "content": [{"type": "text", "text": "Be brief."}]},
                {"role": "user", "content": [{"type": "text", "text": "a"},
                                             {"type": "text", "text": "b"}]}]
    body = httpx.post(f"{server.base_url}/chat/completions", json={"messages": messages}).json()
    assert body["choices"][0]["message"]["content"] == "You said: a\nb"
    assert "<|im_start|>system\nBe brief.<|im_end|>" in "".join(
        map(chr, server.engine.submitted[-1][1]))


def test_legacy_completions(server) -> None:
    client = openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0)
    text = "<|im_start|>user\nzz<|im_end|>\n<|im_start|>assistant\n"
    completion = client.completions.create(model="m", prompt=text, echo=True, logprobs=1)
    choice = completion.choices[0]
    assert choice.text == text + "You said: zz" and choice.finish_reason == "stop"
    assert choice.logprobs.tokens[:3] == ["Y", "o", "u"]
    assert choice.logprobs.text_offset[:2] == [len(text), len(text) + 1]
    assert choice.logprobs.top_logprobs[0] == {"Y": -0.25}
    many = client.completions.create(model="m", prompt=[text, text.replace("zz", "q")], n=2,
                                     max_tokens=11)
    assert [c.text for c in many.choices] == ["You said: z"] * 2 + ["You said: q"] * 2
    assert many.usage.prompt_tokens == 2 * len(text) - 1
    stream = client.completions.create(model="m", prompt=[ord(c) for c in text], stream=True)
    assert "".join(c.choices[0].text for c in stream) == "You said: zz"


def test_tokenize(server) -> None:
    url = f"{server.base_url}/tokenize"
    body = httpx.post(url, json={"messages": user("count me"), "tools": [WEATHER_TOOL]}).json()
    assert body["count"] == num_prompt_tokens(user("count me"), tools=[WEATHER_TOOL])
    assert httpx.post(url, json={"content": "abc"}).json()["tokens"] == [97, 98, 99]


def test_info_routes(server) -> None:
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
    models = httpx.get(f"{server.base_url}/models").json()
    assert models["object"] == "list" and models["data"][0]["context_length"] == 4096
    assert httpx.get(f"{server.base_url}/models/sparkinfer").json()["id"] == "sparkinfer"
    assert httpx.get(f"{server.base_url}/models/other").status_code == 404
    assert httpx.get(f"{server.base_url}/info").json() == {
        "model": "sparkinfer", "max_context": 4096, "max_output_tokens": 4096}
    capacity = httpx.get(f"{server.base_url}/capacity").json()
    assert capacity["free_kv_blocks"] == capacity["total_kv_blocks"] == 4096 // 16
    assert (capacity["max_queue_depth"], capacity["accepting_requests"]) == (0, True)
