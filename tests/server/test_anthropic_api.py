"""POST /v1/messages and /v1/messages/count_tokens over the FakeEngine (scripted replies), driven by
the anthropic SDK: thinking / text / tool_use blocks, the event sequence, a tool call round trip,
the request's translation onto the chat prompt, errors in Anthropic's shape, x-api-key auth."""

from __future__ import annotations

import anthropic
import httpx
import pytest

KEY = "sk-test"
WEATHER_TOOL = {"name": "get_weather", "description": "Weather of a city",
                "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}


@pytest.fixture
def server(make_server):
    return make_server(config={"api_key": KEY})


def client(server, key: str = KEY) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=key, max_retries=0)


def last_prompt(server) -> str:
    return "".join(chr(i) for i in server.engine.submitted[-1][1])


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def assert_anthropic_error(response: httpx.Response, status: int, kind: str) -> str:
    assert response.status_code == status, response.text
    body = response.json()
    assert body["type"] == "error" and body["error"]["type"] == kind
    assert body["error"]["message"]
    return body["error"]["message"]


def test_a_thinking_answer_is_a_thinking_block_then_a_text_block(server) -> None:
    message = client(server).messages.create(model="m", max_tokens=200, messages=user("[think]"),
                                             system=[{"type": "text", "text": "Be brief."}])
    thinking, text = message.content
    assert (thinking.type, thinking.thinking) == ("thinking", "The user wants a greeting.")
    assert (text.type, text.text) == ("text", "Hello there!")
    assert message.stop_reason == "end_turn" and message.role == "assistant"
    assert message.usage.input_tokens == len(last_prompt(server))
    assert message.usage.cache_read_input_tokens == 0 and message.usage.output_tokens > 0
    assert last_prompt(server).startswith("<|im_start|>system\nBe brief.<|im_end|>")


def test_the_stream_sends_anthropics_events_in_order(server) -> None:
    with client(server).messages.stream(model="m", max_tokens=200,
                                        messages=user("[think]")) as stream:
        events = list(stream)
        final = stream.get_final_message()
    kinds = [e.type for e in events if e.type in ("message_start", "content_block_start",
                                                  "content_block_stop", "message_delta",
                                                  "message_stop")]
    assert kinds == ["message_start", "content_block_start", "content_block_stop",
                     "content_block_start", "content_block_stop", "message_delta",
                     "message_stop"]
    deltas = {e.delta.type for e in events if e.type == "content_block_delta"}
    assert deltas == {"thinking_delta", "text_delta"}
    assert [b.type for b in final.content] == ["thinking", "text"]
    assert final.content[1].text == "Hello there!" and final.stop_reason == "end_turn"
    assert final.usage.output_tokens > 0


def test_a_tool_use_round_trips_through_a_tool_result(server) -> None:
    sdk = client(server)
    with sdk.messages.stream(model="m", max_tokens=200, messages=user("[tool] Paris?"),
                             tools=[WEATHER_TOOL]) as stream:
        first = stream.get_final_message()
    call, = first.content
    assert (call.type, call.name, call.input) == ("tool_use", "get_weather", {"city": "Paris"})
    assert first.stop_reason == "tool_use"
    history = [*user("Paris?"), {"role": "assistant", "content": [call.model_dump()]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                             "content": [{"type": "text", "text": "sunny"}]}]}]
    second = sdk.messages.create(model="m", max_tokens=200, messages=history,
                                 tools=[WEATHER_TOOL])
    assert second.content[0].text == "It is sunny in Paris."
    assert "<tool_response>\nsunny\n</tool_response>" in last_prompt(server)


def test_tool_choice_tool_forces_that_call(server) -> None:
    message = client(server).messages.create(
        model="m", max_tokens=200, messages=user("anything"), tools=[WEATHER_TOOL],
        tool_choice={"type": "tool", "name": "get_weather"})
    assert [(b.type, b.input) for b in message.content] == [("tool_use", {"city": "Oslo"})]


def test_max_tokens_ends_with_stop_reason_max_tokens(server) -> None:
    message = client(server).messages.create(model="m", max_tokens=5, messages=user("[long]"))
    assert message.stop_reason == "max_tokens" and message.usage.output_tokens == 5


def test_thinking_disabled_closes_the_thought_in_the_prompt(server) -> None:
    client(server).messages.create(model="m", max_tokens=20, messages=user("hi"),
                                   thinking={"type": "disabled"})
    assert last_prompt(server).endswith("<think>\n\n</think>\n\n")


def test_the_billing_system_block_stays_out_of_the_prompt(server) -> None:
    system = [{"type": "text", "text": "x-anthropic-billing-header: cc_version=1; cch=abc;"},
              {"type": "text", "text": "You are a coding agent."}]
    client(server).messages.create(model="m", max_tokens=20, messages=user("hi"), system=system)
    assert last_prompt(server).startswith("<|im_start|>system\nYou are a coding agent.")


def test_a_system_message_between_turns_is_rendered_in_place(server) -> None:
    # Claude Code (2.1) sends one after the first user turn (its agent list)
    messages = [{"role": "user", "content": "hi"},
                {"role": "system", "content": [{"type": "text", "text": "Agents: none."}]},
                {"role": "user", "content": "again"}]
    client(server).messages.create(model="m", max_tokens=20, messages=messages)
    assert "<|im_start|>user\nhi<|im_end|>\n<|im_start|>system\nAgents: none.<|im_end|>\n" \
        "<|im_start|>user\nagain<|im_end|>" in last_prompt(server)


def test_count_tokens_counts_the_rendered_prompt(server) -> None:
    count = client(server).messages.count_tokens(model="m", messages=user("hello"))
    client(server).messages.create(model="m", max_tokens=5, messages=user("hello"))
    assert count.input_tokens == len(last_prompt(server))


@pytest.mark.parametrize("body, fragment", [
    ({"messages": user("hi")}, "max_tokens"),
    ({"max_tokens": 5, "messages": []}, "messages"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image"}]}]},
     "'image' block"),
    ({"max_tokens": 5, "messages": user("hi"), "tools": [{"type": "web_search_20250305"}]},
     "tools[0]"),
])
def test_bad_bodies_are_400s_in_anthropics_shape(server, body, fragment) -> None:
    response = httpx.post(f"{server.url}/v1/messages", json={"model": "m", **body},
                          headers={"x-api-key": KEY})
    assert fragment in assert_anthropic_error(response, 400, "invalid_request_error")


def test_the_key_may_come_as_x_api_key_or_bearer_and_a_wrong_one_is_401(server) -> None:
    body = {"model": "m", "max_tokens": 5, "messages": user("hi")}
    url = f"{server.url}/v1/messages"
    assert httpx.post(url, json=body, headers={"x-api-key": KEY}).status_code == 200
    assert httpx.post(url, json=body,
                      headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    assert_anthropic_error(httpx.post(url, json=body, headers={"x-api-key": "nope"}), 401,
                           "authentication_error")
    with pytest.raises(anthropic.AuthenticationError):
        client(server, "nope").messages.create(model="m", max_tokens=5, messages=user("hi"))


def test_an_error_after_the_first_token_ends_the_stream_with_an_error_event(make_server) -> None:
    server = make_server(config={"api_key": KEY}, request_timeout_s=0.3, token_delay_s=0.01)
    response = httpx.post(f"{server.url}/v1/messages", headers={"x-api-key": KEY}, json={
        "model": "m", "max_tokens": 4000, "stream": True, "messages": user("[long]")})
    events = [line.removeprefix("event: ") for line in response.text.splitlines()
              if line.startswith("event: ")]
    assert events[0] == "message_start" and "content_block_delta" in events
    assert events[-1] == "error" and "message_stop" not in events
    with pytest.raises(anthropic.APIStatusError, match="timeout_error|timed out"):
        with client(server).messages.stream(model="m", max_tokens=4000,
                                            messages=user("[long]")) as stream:
            stream.get_final_message()
