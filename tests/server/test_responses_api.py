"""POST /v1/responses over the FakeEngine (scripted replies), driven by the openai SDK: the answer
split into reasoning / message / function_call items, the event sequence, a tool call round trip,
the request's translation onto the chat prompt, and errors."""

from __future__ import annotations

import httpx
import openai
import pytest
from test_admission import assert_openai_error

WEATHER_TOOL = {"type": "function", "name": "get_weather", "description": "Weather of a city",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}


@pytest.fixture
def server(make_server):
    return make_server()


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0)


def last_prompt(server) -> str:
    return "".join(chr(i) for i in server.engine.submitted[-1][1])


def test_a_thinking_answer_is_a_reasoning_item_then_a_message(server) -> None:
    response = client(server).responses.create(model="m", input="[think] hi",
                                               instructions="Answer briefly.")
    reasoning, message = response.output
    assert reasoning.type == "reasoning"
    assert reasoning.content[0].text == "The user wants a greeting."
    assert message.type == "message" and response.output_text == "Hello there!"
    assert response.status == "completed" and response.id.startswith("resp_")
    usage = response.usage
    assert usage.input_tokens == len(last_prompt(server))
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert 0 < usage.output_tokens_details.reasoning_tokens < usage.output_tokens
    assert usage.input_tokens_details.cached_tokens == 0
    assert last_prompt(server).startswith("<|im_start|>system\nAnswer briefly.<|im_end|>")


def test_the_stream_numbers_its_events_and_opens_and_closes_every_item(server) -> None:
    events = list(client(server).responses.create(model="m", input="[think] hi", stream=True))
    kinds = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert kinds[:3] == ["response.created", "response.in_progress",
                         "response.output_item.added"]
    message_events = [k for k in kinds[kinds.index("response.output_item.done") + 1:]
                      if not k.endswith(".delta")]
    assert message_events == ["response.output_item.added", "response.content_part.added",
                              "response.output_text.done", "response.content_part.done",
                              "response.output_item.done", "response.completed"]
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    thought = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert (thought, text) == ("The user wants a greeting.", "Hello there!")
    assert events[-1].response.output_text == "Hello there!"
    assert events[-1].response.usage.output_tokens > 0


def test_a_function_call_round_trips_through_function_call_output(server) -> None:
    sdk = client(server)
    with sdk.responses.stream(model="m", input="[tool] weather in Paris?",
                              tools=[WEATHER_TOOL]) as stream:
        events = [e.type for e in stream]
        first = stream.get_final_response()
    call, = first.output
    assert (call.type, call.name, call.arguments) == ("function_call", "get_weather",
                                                      '{"city": "Paris"}')
    assert call.call_id.startswith("call_")
    assert "response.function_call_arguments.delta" in events
    assert "response.function_call_arguments.done" in events
    history = [{"role": "user", "content": "weather in Paris?"}, call.model_dump(),
               {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}]
    second = sdk.responses.create(model="m", input=history, tools=[WEATHER_TOOL])
    assert second.output_text == "It is sunny in Paris."
    prompt = last_prompt(server)
    assert '{"name": "get_weather", "arguments": {"city": "Paris"}}' in prompt
    assert "<tool_response>\nsunny\n</tool_response>" in prompt


# what Codex CLI 0.171 offers by default: a namespace tool (its sub-agent functions) and the hosted
# web_search, beside plain functions
CODEX_TOOLS = [WEATHER_TOOL, {"type": "namespace", "name": "agents", "description": "Sub-agents",
                              "tools": [{**WEATHER_TOOL, "name": "spawn"}]},
               {"type": "web_search", "external_web_access": False}]


def test_hosted_tools_are_left_out_and_namespace_tools_flattened(make_server) -> None:
    reply = '<tool_call>\n{"name": "agents__spawn", "arguments": {"city": "Oslo"}}\n</tool_call>'
    server = make_server(reply=lambda prompt, params: reply)
    sdk = client(server)
    with sdk.responses.stream(model="m", input="go", tools=CODEX_TOOLS) as stream:
        events = list(stream)
        first = stream.get_final_response()
    prompt = last_prompt(server)
    assert '"name": "get_weather"' in prompt and '"name": "agents__spawn"' in prompt
    assert "web_search" not in prompt
    call, = first.output
    assert (call.type, call.name, call.namespace) == ("function_call", "spawn", "agents")
    done, = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert done.name == "spawn"
    history = [{"role": "user", "content": "go"}, call.model_dump(exclude_none=True),
               {"type": "function_call_output", "call_id": call.call_id, "output": "spawned"}]
    sdk.responses.create(model="m", input=history, tools=CODEX_TOOLS)
    assert '{"name": "agents__spawn", "arguments": {"city": "Oslo"}}' in last_prompt(server)


def test_tool_choice_names_the_function_to_call(server) -> None:
    response = client(server).responses.create(
        model="m", input="anything", tools=[WEATHER_TOOL],
        tool_choice={"type": "function", "name": "get_weather"})
    assert [(o.type, o.name, o.arguments) for o in response.output] == \
        [("function_call", "get_weather", '{"city": "Oslo"}')]


def test_a_cut_answer_is_incomplete_with_its_reason(server) -> None:
    response = client(server).responses.create(model="m", input="[long]", max_output_tokens=5)
    assert response.status == "incomplete"
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == 5
    events = list(client(server).responses.create(model="m", input="[long]",
                                                  max_output_tokens=5, stream=True))
    assert events[-1].type == "response.incomplete"


def test_reasoning_effort_none_turns_thinking_off_and_stored_fields_are_ignored(server) -> None:
    client(server).responses.create(model="m", input="hi", reasoning={"effort": "none"},
                                    store=True, include=["reasoning.encrypted_content"],
                                    prompt_cache_key="k", service_tier="auto")
    assert last_prompt(server).endswith("<think>\n\n</think>\n\n")


@pytest.mark.parametrize("body, param", [
    ({"input": "hi", "previous_response_id": "resp_1"}, "previous_response_id"),
    ({"input": []}, "input"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0]"),
    ({"input": "hi", "tools": [{"type": "custom", "name": "apply_patch"}]}, "tools[0]"),
    ({"input": "hi", "tools": [{"type": "web_search"}], "tool_choice": {"type": "web_search"}},
     "tool_choice"),
    ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input[0].content"),
])
def test_requests_it_cannot_honour_are_400s_naming_the_field(server, body, param) -> None:
    response = httpx.post(f"{server.base_url}/responses", json={"model": "m", **body})
    assert assert_openai_error(response, 400)["param"] == param


def test_an_error_after_the_first_token_ends_the_stream_with_response_failed(make_server) -> None:
    server = make_server(request_timeout_s=0.3, token_delay_s=0.01)
    events = list(client(server).responses.create(model="m", input="[long]", stream=True))
    assert events[-1].type == "response.failed"
    assert events[-1].response.error.code == "request_timeout"
    assert any(e.type == "response.output_text.delta" for e in events)
