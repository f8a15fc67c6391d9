"""The Responses and Messages APIs against the real server (engine, tokenizer, chat template and the
tiny qwen3 GGUF in a process of their own, an API key set), through the official openai and
anthropic SDKs: each answers what chat completions answers for the same conversation (greedy),
streamed or not, with its usage; tool calls round-trip; errors and auth come in each API's shape."""

from __future__ import annotations

import json

import anthropic
import httpx
import openai
import pytest
from test_admission import assert_openai_error
from test_e2e_real import REQUEST_S, start_real_server

pytestmark = pytest.mark.slow  # a server process; the first may compile the CPU kernels
KEY = "sk-agents"
QUESTION = "Name three rivers of Europe."
OPENAI_TOOL = {"type": "function", "name": "get_weather", "description": "Weather of a city",
               "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                              "required": ["city"]}}
# anthropic's SDK (2.x) dropped temperature from its signature; Claude Code still sends it
GREEDY = {"temperature": 0}
ANTHROPIC_TOOL = {"name": "get_weather", "description": "Weather of a city",
                  "input_schema": OPENAI_TOOL["parameters"]}


@pytest.fixture(scope="module")
def real():
    with start_real_server(SPARKINFER_API_KEY=KEY) as server:
        yield server


def openai_sdk(server, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0,
                         timeout=REQUEST_S)


def anthropic_sdk(server, key: str = KEY) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=key, max_retries=0,
                               timeout=REQUEST_S)


def chat_answer(server, max_tokens: int, **extra) -> openai.types.chat.ChatCompletion:
    return openai_sdk(server).chat.completions.create(
        model="m", messages=[{"role": "user", "content": QUESTION}], max_tokens=max_tokens,
        temperature=0, **extra)


def test_a_response_is_the_chat_answer_streamed_or_not_and_reports_cached_tokens(real) -> None:
    chat = chat_answer(real, 16)
    sdk = openai_sdk(real)
    response = sdk.responses.create(model="m", input=QUESTION, max_output_tokens=16,
                                    temperature=0)
    assert response.output_text == (chat.choices[0].message.content or "")
    reasoning = [o.content[0].text for o in response.output if o.type == "reasoning"]
    chat_reasoning = getattr(chat.choices[0].message, "reasoning_content", None)
    assert reasoning == ([chat_reasoning] if chat_reasoning else [])
    assert (response.usage.input_tokens, response.usage.output_tokens) == \
        (chat.usage.prompt_tokens, chat.usage.completion_tokens)
    assert response.usage.input_tokens_details.cached_tokens >= 16  # the chat request's blocks
    events = list(sdk.responses.create(model="m", input=QUESTION, max_output_tokens=16,
                                       temperature=0, stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].type == "response.created" and events[-1].type == "response.incomplete"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == \
        response.output_text
    assert events[-1].response.usage.output_tokens == 16


def test_a_forced_function_call_round_trips_through_function_call_output(real) -> None:
    sdk = openai_sdk(real)
    first = sdk.responses.create(model="m", input="Weather in Paris?", tools=[OPENAI_TOOL],
                                 tool_choice={"type": "function", "name": "get_weather"},
                                 max_output_tokens=12, temperature=0)
    call = first.output[-1]
    assert (call.type, call.name) == ("function_call", "get_weather")
    history = [{"role": "user", "content": "Weather in Paris?"}, call.model_dump(),
               {"type": "function_call_output", "call_id": call.call_id,
                "output": "sunny, 24 C"}]
    with sdk.responses.stream(model="m", input=history, tools=[OPENAI_TOOL],
                              max_output_tokens=8, temperature=0) as stream:
        kinds = [e.type for e in stream]
    second = sdk.responses.create(model="m", input=history, tools=[OPENAI_TOOL],
                                  max_output_tokens=8, temperature=0)
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert second.output and second.usage.input_tokens > first.usage.input_tokens


def plain_message_request(max_tokens: int) -> dict:
    """The question, greedy, thinking off (the tiny model's answer is then all text)."""
    return {"model": "m", "max_tokens": max_tokens, "extra_body": GREEDY,
            "thinking": {"type": "disabled"}, "messages": [{"role": "user", "content": QUESTION}]}


def test_a_message_is_the_chat_answer_streamed_or_not(real) -> None:
    chat = chat_answer(real, 16, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    sdk = anthropic_sdk(real)
    request = plain_message_request(16)
    message = sdk.messages.create(**request)
    text = "".join(b.text for b in message.content if b.type == "text")
    assert text == chat.choices[0].message.content and message.stop_reason == "max_tokens"
    usage = message.usage
    assert usage.input_tokens + usage.cache_read_input_tokens == chat.usage.prompt_tokens
    assert usage.cache_read_input_tokens >= 16 and usage.output_tokens == 16
    with sdk.messages.stream(**request) as stream:
        streamed = stream.get_final_message()
    assert [(b.type, b.text) for b in streamed.content] == [("text", text)]
    assert streamed.usage.output_tokens == 16
    assert sdk.messages.count_tokens(model="m", messages=request["messages"],
                                     thinking={"type": "disabled"}).input_tokens == \
        chat.usage.prompt_tokens


def test_a_stop_sequence_ends_the_message_and_is_named(real) -> None:
    """The tiny random model answers this greedily with blank lines: a blank line stops it."""
    sdk = anthropic_sdk(real)
    request = plain_message_request(24)
    assert sdk.messages.create(**request).content[0].text.startswith("\n\n")
    stopped = sdk.messages.create(**request, stop_sequences=["never-seen-stop", "\n\n"])
    assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", "\n\n")
    assert stopped.usage.output_tokens < 24
    unstopped = sdk.messages.create(**request, stop_sequences=["never-seen-stop"])
    assert (unstopped.stop_reason, unstopped.stop_sequence) == ("max_tokens", None)


def test_a_forced_tool_use_round_trips_through_a_tool_result(real) -> None:
    sdk = anthropic_sdk(real)
    question = [{"role": "user", "content": "Weather in Paris?"}]
    with sdk.messages.stream(model="m", max_tokens=12, extra_body=GREEDY, messages=question,
                             tools=[ANTHROPIC_TOOL],
                             tool_choice={"type": "tool", "name": "get_weather"}) as stream:
        first = stream.get_final_message()
    call = first.content[-1]
    assert (call.type, call.name) == ("tool_use", "get_weather")
    assert isinstance(call.input, dict) and first.stop_reason in ("tool_use", "max_tokens")
    history = [*question, {"role": "assistant", "content": [call.model_dump()]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                             "content": "sunny, 24 C"}]}]
    second = sdk.messages.create(model="m", max_tokens=8, extra_body=GREEDY, messages=history,
                                 tools=[ANTHROPIC_TOOL])
    assert second.content and second.usage.output_tokens > 0
    assert second.usage.input_tokens + second.usage.cache_read_input_tokens > \
        first.usage.input_tokens + first.usage.cache_read_input_tokens


def test_errors_and_auth_come_in_each_apis_shape(real) -> None:
    with pytest.raises(anthropic.BadRequestError) as bad:
        anthropic_sdk(real).messages.create(model="m", max_tokens=0, messages=[])
    error = bad.value.body["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
    with pytest.raises(anthropic.AuthenticationError):
        anthropic_sdk(real, "wrong").messages.create(
            model="m", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
    assert httpx.post(f"{real.url}/v1/messages", headers={"x-api-key": KEY}, timeout=REQUEST_S,
                      json={"model": "m", "max_tokens": 2,
                            "messages": [{"role": "user", "content": "hi"}]}).status_code == 200
    with pytest.raises(openai.BadRequestError) as unstored:
        openai_sdk(real).responses.create(model="m", input="hi", previous_response_id="resp_x")
    assert unstored.value.code == "unsupported_parameter"
    with pytest.raises(openai.AuthenticationError):
        openai_sdk(real, "wrong").responses.create(model="m", input="hi")
    assert_openai_error(httpx.post(f"{real.url}/v1/responses", json={"model": "m"},
                                   headers={"Authorization": f"Bearer {KEY}"}), 400,
                        "missing_required_parameter")


def test_text_format_and_output_config_constrain_the_answer_to_the_schema(real) -> None:
    """Both APIs hand their JSON schema to structured output: the random model's answer parses
    and has the required key of the right type."""
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    response = openai_sdk(real).responses.create(
        model="m", input=QUESTION, max_output_tokens=40, temperature=0,
        reasoning={"effort": "none"},
        text={"format": {"type": "json_schema", "name": "verdict", "schema": schema}})
    message = anthropic_sdk(real).messages.create(
        **plain_message_request(40), output_config={"format": {"type": "json_schema",
                                                               "schema": schema}})
    for text in (response.output_text, message.content[0].text):
        assert isinstance(json.loads(text)["ok"], bool)
