"""The server with the real ChatTemplate renderer and the real Qwen templates: OpenAI-shaped
history (arguments as JSON strings, tool_call ids, null content) must render exactly like the
transformers goldens, and the template decides thinking-open and the tool-call format."""

from __future__ import annotations

import copy
import json

import httpx
import pytest

from sparkinfer_cli.tokenizer.chat_template import ChatTemplate


@pytest.fixture(scope="module")
def goldens(fixtures_dir) -> dict:
    return json.loads((fixtures_dir / "chat" / "chat_template_goldens.json").read_text())


def golden_case(goldens: dict, template: str, conversation: str, kwargs: dict) -> str:
    for case in goldens["cases"]:
        if (case["template"], case["conversation"], case["kwargs"]) == \
                (template, conversation, kwargs):
            return case["rendered"]
    raise KeyError((template, conversation, kwargs))


def as_openai_request(conversation: dict) -> dict:
    """The goldens' conversation as an OpenAI client sends it."""
    messages = copy.deepcopy(conversation["messages"])
    for i, message in enumerate(messages):
        for j, call in enumerate(message.get("tool_calls", [])):
            call["id"] = f"call_{i}_{j}"
            call["function"]["arguments"] = json.dumps(call["function"]["arguments"])
        if message.get("tool_calls") and not message["content"]:
            message["content"] = None
        if message["role"] == "tool":
            message["tool_call_id"] = "call_1_0"
    return {"messages": messages, "tools": conversation.get("tools"), "max_tokens": 4}


@pytest.mark.parametrize("template", ["qwen3", "qwen3.5", "qwen3-coder"])
@pytest.mark.parametrize("kwargs", [{}, {"enable_thinking": False}])
def test_tool_history_renders_like_transformers(make_server, goldens, template, kwargs) -> None:
    srv = make_server(template=ChatTemplate(goldens["templates"][template]["text"]))
    body = as_openai_request(goldens["conversations"]["tools_call_and_response"])
    response = httpx.post(f"{srv.base_url}/chat/completions", json={**body, **kwargs})
    assert response.status_code == 200, response.text
    prompt = "".join(map(chr, srv.engine.submitted[-1][1]))
    expected = golden_case(goldens, template, "tools_call_and_response",
                           {"add_generation_prompt": True, **kwargs})
    assert prompt == expected


@pytest.mark.parametrize("template, reply, content, reasoning", [
    ("qwen3.5", "Thinking it over.\n</think>\n\nDone.", "Done.", "Thinking it over."),
    ("qwen3", "<think>\nThinking it over.\n</think>\n\nDone.", "Done.", "Thinking it over."),
])
def test_reasoning_with_real_templates(make_server, goldens, template, reply, content,
                                       reasoning) -> None:
    srv = make_server(template=ChatTemplate(goldens["templates"][template]["text"]),
                      reply=lambda prompt, params: reply)
    body = httpx.post(f"{srv.base_url}/chat/completions",
                      json={"messages": [{"role": "user", "content": "Hi"}]}).json()
    message = body["choices"][0]["message"]
    assert (message["content"], message["reasoning_content"]) == (content, reasoning)


def test_required_tool_choice_uses_the_templates_xml_format(make_server, goldens) -> None:
    srv = make_server(template=ChatTemplate(goldens["templates"]["qwen3.5"]["text"]),
                      reply=lambda prompt, params: "<parameter=city>\nParis\n</parameter>\n"
                                                   "</function>\n</tool_call>")
    tools = goldens["conversations"]["tools_call_and_response"]["tools"]
    body = httpx.post(f"{srv.base_url}/chat/completions", json={
        "messages": [{"role": "user", "content": "Weather?"}], "tools": tools,
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}).json()
    prompt = "".join(map(chr, srv.engine.submitted[-1][1]))
    assert prompt.endswith("<|im_start|>assistant\n<think>\n</think>\n\n<tool_call>\n"
                           "<function=get_weather>\n")
    call = body["choices"][0]["message"]["tool_calls"][0]["function"]
    assert (call["name"], json.loads(call["arguments"])) == ("get_weather", {"city": "Paris"})
    assert body["choices"][0]["finish_reason"] == "tool_calls"
