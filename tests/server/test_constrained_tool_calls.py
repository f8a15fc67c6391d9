"""Constrained tool calls (issue 26): the grammar of tool_call_grammar.py against the templates'
own renderings, then the real server on the tiny qwen3 (JSON calls) and qwen3.5 (XML calls)
GGUFs. Their weights are random, so unconstrained they write no call at all: with the grammar
every forced call parses, names one of the request's functions (the named one, if named) and its
arguments validate against that function's parameters schema, in chat completions and in the
Responses and Messages APIs."""

from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import numpy as np
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from server_harness import ProcessServer
from test_admission import assert_openai_error
from test_e2e_real import FIXTURES, REQUEST_S, RUN_SERVER, STARTUP_S, sdk, start_real_server
from test_e2e_real import tokenizer as tokenizer  # noqa: F401 (a fixture)
from test_structured_output import NO_THINKING, follow, may_end, schemas

from sparkinfer_cli.engine.constraint import GrammarConstraint, lark_grammar
from sparkinfer_cli.gguf.reader import GGUFFile
from sparkinfer_cli.server.stream_router import THINK_CLOSE, THINK_OPEN, prompt_opens_thinking
from sparkinfer_cli.server.tool_call_grammar import tool_call_grammar
from sparkinfer_cli.server.tool_calls import forced_call_prefix, uses_xml_format
from sparkinfer_cli.tokenizer.chat_template import ChatTemplate
from sparkinfer_cli.tokenizer.tokenizer import Tokenizer

pytestmark = pytest.mark.slow  # server processes and grammars over generated tool sets

MODELS = {"qwen3": FIXTURES / "qwen3-Q8_0.gguf",
          "qwen35": FIXTURES.parent / "qwen35" / "qwen35-Q8_0.gguf"}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 12},
    "days": {"type": "integer", "minimum": 1, "maximum": 7},
    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    "alerts": {"type": "boolean"}}, "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET", 1]}},
        "required": ["zone"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
CALLS = [{"type": "function", "function": {"name": "get_weather", "arguments": {
             "city": "Paris", "days": 3, "unit": "celsius", "alerts": True}}},
         {"type": "function", "function": {"name": "get_time", "arguments": {"zone": "CET"}}}]


# ---------------------------------------------------------------- the grammar, no model

@pytest.fixture(scope="module", params=sorted(MODELS))
def model(request) -> tuple[Tokenizer, ChatTemplate]:
    tokenizer = Tokenizer.from_gguf(GGUFFile(MODELS[request.param]))
    return tokenizer, ChatTemplate.from_tokenizer(tokenizer)


def rendered_answer(template: ChatTemplate, calls: list[dict]) -> tuple[str, str]:
    """(generation prompt, the answer the template renders after it for an assistant turn that
    makes these calls, up to its end-of-turn token)."""
    prompt = template.render(ASK, tools=TOOLS)
    turn = [*ASK, {"role": "assistant", "content": "", "tool_calls": calls}]
    full = template.render(turn, tools=TOOLS, add_generation_prompt=False)
    assert full.startswith(prompt)
    return prompt, full[len(prompt):full.rindex("<|im_end|>")]


def constraint_for(tokenizer: Tokenizer, lark: str, thinking_open: bool | None):
    reasoning = None if thinking_open is None else \
        (tokenizer.id_of(THINK_OPEN), tokenizer.id_of(THINK_CLOSE))
    return GrammarConstraint(lark_grammar(lark), tokenizer, tokenizer.vocab_size, reasoning,
                             bool(thinking_open))


@pytest.mark.parametrize("parallel", [True, False])
def test_the_auto_grammar_takes_the_calls_the_template_renders(model, parallel) -> None:
    """What each template writes for an assistant turn that calls tools (after its thought,
    which stays free) is what the grammar allows, and the answer may end after it; a second
    call only with parallel_tool_calls."""
    tokenizer, template = model
    prompt, answer = rendered_answer(template, CALLS)
    xml = uses_xml_format(template.source)
    lark = tool_call_grammar(TOOLS, tool_choice="auto", forced_tool=None, parallel=parallel,
                             xml_format=xml)
    constraint = constraint_for(tokenizer, lark, prompt_opens_thinking(prompt))
    one_call = answer[:answer.index("</tool_call>") + len("</tool_call>")]
    assert follow(constraint, tokenizer.encode(one_call)) and may_end(constraint, tokenizer)
    assert follow(constraint, tokenizer.encode(answer[len(one_call):])) == parallel


@pytest.mark.parametrize("named", [None, "get_weather"])
def test_a_forced_grammar_takes_the_rest_of_the_call_the_prompt_opened(model, named) -> None:
    tokenizer, template = model
    _, answer = rendered_answer(template, CALLS[:1])
    xml = uses_xml_format(template.source)
    prefix = forced_call_prefix(xml, named)
    lark = tool_call_grammar(TOOLS[:1] if named else TOOLS, tool_choice="required",
                             forced_tool=named, parallel=True, xml_format=xml)
    constraint = constraint_for(tokenizer, lark, None)
    rest = answer[answer.index(prefix) + len(prefix):]
    assert follow(constraint, tokenizer.encode(rest)) and may_end(constraint, tokenizer)


def test_a_thought_is_free_and_a_call_started_after_it_is_held(model) -> None:
    """Thinking on: <tool_call> inside the thought is reasoning; after </think> plain text is
    free, but once a call opens it must be one of the tools'."""
    tokenizer, template = model
    prompt = template.render(ASK, tools=TOOLS, enable_thinking=True)
    thinking_open = prompt_opens_thinking(prompt)
    lark = tool_call_grammar(TOOLS, tool_choice="auto", forced_tool=None, parallel=True,
                             xml_format=uses_xml_format(template.source))
    thought = ("" if thinking_open else "<think>") + "maybe <tool_call> nonsense</think>\n\n"
    constraint = constraint_for(tokenizer, lark, thinking_open)
    assert follow(constraint, tokenizer.encode(thought + "Let me look.\n<tool_call>\n"))
    assert not follow(constraint, tokenizer.encode("nonsense"))


# ---------------------------------------------------------------- the real servers

@pytest.fixture(scope="module")
def qwen3():
    with start_real_server() as server:
        yield server


@pytest.fixture(scope="module")
def qwen35():
    with ProcessServer(["-c", RUN_SERVER, str(MODELS["qwen35"])], {"CTX": "4096"},
                       STARTUP_S) as server:
        yield server


def chat(server, tools: list[dict], max_tokens: int = 600,
         **extra) -> openai.types.chat.ChatCompletion:
    return sdk(server).chat.completions.create(model="m", messages=ASK, tools=tools,
                                               max_tokens=max_tokens, temperature=0.8, **extra)


def assert_valid_calls(message, tools: list[dict], named: str | None = None) -> None:
    schemas = {tool["function"]["name"]: tool["function"]["parameters"] for tool in tools}
    assert message.tool_calls, message.content
    for call in message.tool_calls:
        assert call.function.name in schemas and call.function.name == (named or
                                                                         call.function.name)
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


parameters = st.builds(
    lambda props, required: {"type": "object", "properties": props,
                             "required": sorted(set(required) & set(props)),
                             "additionalProperties": False},
    st.dictionaries(st.sampled_from(["p", "q", "r"]), schemas, min_size=1, max_size=3),
    st.lists(st.sampled_from(["p", "q", "r"])))
tool_sets = st.lists(parameters, min_size=1, max_size=3).map(
    lambda ps: [{"type": "function", "function": {"name": f"f{i}", "parameters": p}}
                for i, p in enumerate(ps)])


@pytest.mark.parametrize("server", ["qwen3", "qwen35"])
@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(tools=tool_sets, parallel=st.booleans(), seed=st.integers(0, 2**16))
def test_every_required_call_is_one_of_the_tools_with_valid_arguments(request, server, tools,
                                                                      parallel, seed) -> None:
    reply = chat(request.getfixturevalue(server), tools, tool_choice="required", seed=seed,
                 parallel_tool_calls=parallel)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert_valid_calls(choice.message, tools)
    assert parallel or len(choice.message.tool_calls) == 1


@pytest.mark.parametrize("server", ["qwen3", "qwen35"])
@pytest.mark.parametrize("seed", range(4))
def test_a_named_function_is_called_once_with_valid_arguments(request, server, seed) -> None:
    reply = chat(request.getfixturevalue(server), TOOLS, seed=seed,
                 tool_choice={"type": "function", "function": {"name": "get_time"}})
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    assert_valid_calls(choice.message, TOOLS, named="get_time")


def test_parallel_calls_follow_one_another(qwen3, tokenizer) -> None:
    """A bias for the newline that leads to the next call keeps the model calling until
    max_tokens cuts a call: each call before that one is valid."""
    reply = chat(qwen3, TOOLS, max_tokens=300, tool_choice="required", seed=2,
                 logit_bias={tokenizer.id_of("\n"): 30})
    *complete, _cut = reply.choices[0].message.tool_calls
    assert reply.choices[0].finish_reason == "length" and len(complete) >= 2
    for call in complete:
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_a_streamed_forced_call_assembles_into_valid_arguments(qwen3) -> None:
    stream = chat(qwen3, TOOLS, tool_choice="required", seed=5, stream=True,
                  parallel_tool_calls=False)
    calls: dict[int, dict] = {}
    for chunk in stream:
        for delta in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            call = calls.setdefault(delta.index, {"name": "", "arguments": ""})
            call["name"] += delta.function.name or ""
            call["arguments"] += delta.function.arguments or ""
    assert len(calls) == 1
    jsonschema.validate(json.loads(calls[0]["arguments"]), SCHEMAS[calls[0]["name"]])


@pytest.mark.parametrize("server", ["qwen3", "qwen35"])
@pytest.mark.parametrize("seed", range(3))
def test_a_call_the_model_starts_under_auto_is_held_to_the_tools(request, server, seed) -> None:
    """'auto', thinking off: a bias makes the random model open a call; the rest of the call
    is the grammar's."""
    tool_call = Tokenizer.from_gguf(GGUFFile(MODELS[server])).id_of("<tool_call>")
    reply = chat(request.getfixturevalue(server), TOOLS, seed=seed, logit_bias={tool_call: 30},
                 parallel_tool_calls=False, extra_body=NO_THINKING)
    assert reply.choices[0].finish_reason == "tool_calls"
    assert_valid_calls(reply.choices[0].message, TOOLS)


def test_with_a_response_format_an_auto_answer_is_that_json_or_a_call(qwen3, tokenizer) -> None:
    """A bias for <tool_call> or for '{' picks which; either follows its schema."""
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}
    for first in ("<tool_call>", "{"):
        message = chat(qwen3, TOOLS, seed=1, response_format=fmt, parallel_tool_calls=False,
                       logit_bias={tokenizer.id_of(first): 30},
                       extra_body=NO_THINKING).choices[0].message
        if first == "{":
            assert not message.tool_calls
            jsonschema.validate(json.loads(message.content), schema)
        else:
            assert_valid_calls(message, TOOLS)


def test_forced_calls_of_the_responses_and_messages_apis_follow_the_schema(qwen3) -> None:
    """Both APIs answer through the chat path: their forced tool choices are constrained too."""
    client = openai.OpenAI(base_url=f"{qwen3.url}/v1", api_key="x", max_retries=0,
                           timeout=REQUEST_S)
    flat = [{"type": "function", **tool["function"]} for tool in TOOLS]
    for choice in ("required", {"type": "function", "name": "get_weather"}):
        response = client.responses.create(model="m", input="Weather?", tools=flat,
                                           tool_choice=choice, max_output_tokens=600,
                                           temperature=0.8)
        call = response.output[-1]
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
    messages = anthropic.Anthropic(base_url=qwen3.url, api_key="x", max_retries=0,
                                   timeout=REQUEST_S)
    for choice in ({"type": "any"}, {"type": "tool", "name": "get_time"}):
        message = messages.messages.create(
            model="m", max_tokens=600, messages=ASK, tool_choice=choice,
            tools=[{"name": t["function"]["name"], "input_schema": t["function"]["parameters"]}
                   for t in TOOLS])
        use = message.content[-1]
        assert message.stop_reason == "tool_use" and use.type == "tool_use"
        jsonschema.validate(use.input, SCHEMAS[use.name])


def test_a_tool_schema_the_grammar_engine_cannot_take_is_a_400(qwen3) -> None:
    bad = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "nonsense"}}}}}]
    response = httpx.post(f"{qwen3.url}/v1/chat/completions", json={
        "model": "m", "messages": ASK, "max_tokens": 4, "tools": bad, "tool_choice": "required"})
    assert assert_openai_error(response, 400)["param"] == "tools"


def test_the_next_mask_is_computed_ahead_and_equals_one_computed_on_demand(model) -> None:
    """After each token the next token's mask is already being computed (on a worker thread,
    while the model would run its pass); masks taken ahead equal those of a constraint that is
    consumed several tokens at a time before it is asked (its pending work joined first)."""
    tokenizer, template = model
    _, answer = rendered_answer(template, CALLS[:1])
    lark = tool_call_grammar(TOOLS, tool_choice="auto", forced_tool=None, parallel=False,
                             xml_format=uses_xml_format(template.source))
    ids = tokenizer.encode(answer)
    ahead, batched = constraint_for(tokenizer, lark, None), constraint_for(tokenizer, lark, None)
    for i, token_id in enumerate(ids):
        mask = ahead.allowed()
        if i % 3 == 2:  # the other constraint is asked only every third token
            np.testing.assert_array_equal(batched.allowed(), mask)
        assert mask[token_id]
        ahead.consume(token_id)
        batched.consume(token_id)
        assert ahead.is_computing_ahead or i == len(ids) - 1  # none once the grammar is done
