"""Structured output (issue 26) through the real server on the tiny qwen3 GGUF (random weights:
without the constraint its answers are never JSON): every answer parses and validates against
the request's schema, streaming or not; thinking stays free text until </think>; schemas the
grammar engine cannot take are 400s naming response_format."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from hypothesis_jsonschema import from_schema
from pydantic import BaseModel
from test_admission import assert_openai_error
from test_e2e_real import sdk, start_real_server
from test_e2e_real import tokenizer as tokenizer  # noqa: F401 (a fixture)
from test_reliability_real import start_server

from sparkinfer_cli.engine.constraint import GrammarConstraint, json_schema_grammar
from sparkinfer_cli.tokenizer.tokenizer import Tokenizer

pytestmark = pytest.mark.slow  # a server process; the first may compile the CPU kernels
ASK = [{"role": "user", "content": "Describe the weather as JSON."}]


@pytest.fixture(scope="module")
def real():
    with start_real_server() as server:
        yield server


NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}


def ask(server, schema: dict | None, **extra) -> tuple[str, str]:
    fmt = {"type": "json_object"} if schema is None else \
        {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}
    reply = sdk(server).chat.completions.create(model="m", messages=ASK, max_tokens=1000,
                                                temperature=0.8, seed=7, response_format=fmt,
                                                **({"extra_body": NO_THINKING} | extra))
    return reply.choices[0].message.content, reply.choices[0].finish_reason


def follow(constraint: GrammarConstraint, ids: list[int]) -> bool:
    """Whether the constraint allows every token in turn."""
    for token_id in ids:
        allowed = constraint.allowed()
        if allowed is not None and not allowed[token_id]:
            return False
        constraint.consume(token_id)
    return True


def may_end(constraint: GrammarConstraint, tokenizer: Tokenizer) -> bool:
    allowed = constraint.allowed()
    return allowed is None or bool(allowed[tokenizer.id_of("<|im_end|>")])


# schemas whose every instance is short: bounded strings, enums, small arrays, nesting
leaf = st.one_of(
    st.just({"type": "boolean"}),
    st.just({"type": "integer", "minimum": 0, "maximum": 99}),
    st.just({"type": "string", "maxLength": 8}),
    st.builds(lambda vs: {"enum": vs}, st.lists(st.sampled_from(["a", "b", 3, True, None]),
                                                min_size=1, max_size=3, unique=True)))
schemas = st.recursive(leaf, lambda inner: st.one_of(
    st.builds(lambda props, req: {"type": "object", "properties": props,
                                  "required": sorted(set(req) & set(props)),
                                  "additionalProperties": False},
              st.dictionaries(st.sampled_from(["a", "bc", "def", "x_y"]), inner, min_size=1,
                              max_size=3),
              st.lists(st.sampled_from(["a", "bc", "def", "x_y"]))),
    st.builds(lambda item: {"type": "array", "items": item, "maxItems": 3}, inner)),
    max_leaves=6)


answer_schemas = st.builds(lambda props: {"type": "object", "properties": props,
                                           "required": sorted(props),
                                           "additionalProperties": False},
                           st.dictionaries(st.sampled_from(["p", "q", "r"]), schemas, min_size=1,
                                           max_size=2))
generated = settings(max_examples=200, deadline=None,
                     suppress_health_check=[HealthCheck.function_scoped_fixture])


@generated
@given(schema=answer_schemas)
def test_every_answer_validates_against_its_schema(real, schema) -> None:
    assert_answer_follows(real, schema)


def assert_answer_follows(server, schema: dict) -> None:
    content, finish = ask(server, schema)
    assert finish == "stop", content
    jsonschema.validate(json.loads(content), schema)


def in_schema_order(value, schema: dict):
    """value with every object's keys in the order of its schema's `properties`."""
    if isinstance(value, dict):
        props = schema.get("properties", {})
        return {k: in_schema_order(value[k], props[k]) for k in props if k in value}
    if isinstance(value, list):
        return [in_schema_order(v, schema.get("items", {})) for v in value]
    return value


@generated
@given(schema=answer_schemas, data=st.data())
def test_the_grammar_takes_every_instance_of_its_schema(tokenizer, schema, data) -> None:
    """The other direction: the mask never refuses a valid answer. Instances hypothesis-jsonschema
    draws from the schema, written as the grammar writes JSON (llguidance's one spelling of each:
    compact, ", " and ": ", raw UTF-8 but for control characters and DEL, which are escaped, an
    object's keys in the order of its schema's properties), pass token by token, and the answer
    may end after them."""
    answer = json.dumps(in_schema_order(data.draw(from_schema(schema)), schema),
                        ensure_ascii=False).replace("\x7f", "\\u007f")
    constraint = GrammarConstraint(json_schema_grammar(json.dumps(schema)), tokenizer,
                                   tokenizer.vocab_size)
    assert follow(constraint, tokenizer.encode(answer, parse_special=False)), answer
    assert may_end(constraint, tokenizer)


@pytest.fixture(scope="module")
def demo(demo_model_path):
    with start_server("llama", model=demo_model_path("smollm2-135m")) as server:
        yield server


@generated
@given(schema=answer_schemas)
def test_the_demo_models_every_answer_validates_against_its_schema(demo, schema) -> None:
    """The same on the CPU demo model a newcomer serves first (real weights, sampled)."""
    assert_answer_follows(demo, schema)


@generated
@given(schema=answer_schemas, seed=st.integers(0, 2**31 - 1))
def test_every_answer_after_a_thought_validates_against_its_schema(real, tokenizer, schema,
                                                                   seed) -> None:
    """Thinking on, over the same generated schemas: biases make the random model open a thought
    and, penalised for repeating it, write some free tokens before </think>; what follows
    </think> validates."""
    think, think_end = (tokenizer.token_to_id[t] for t in ("<think>", "</think>"))
    reply = sdk(real).chat.completions.create(
        model="m", messages=ASK, max_tokens=1000, temperature=0.8, seed=seed, logprobs=True,
        logit_bias={str(think): 10, str(think_end): 4}, frequency_penalty=2.0,
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}},
        extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    choice = reply.choices[0]
    tokens = [t.token for t in choice.logprobs.content]
    assert tokens[0] == "<think>", tokens[:20]
    assume("</think>" in tokens)  # a random model's thought may run to max_tokens
    assert choice.finish_reason == "stop", choice.message.content
    jsonschema.validate(json.loads(choice.message.content), schema)


def test_json_object_streamed(real) -> None:
    stream = sdk(real).chat.completions.create(
        model="m", messages=ASK, max_tokens=200, temperature=0.8, seed=3, stream=True,
        response_format={"type": "json_object"}, extra_body=NO_THINKING)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert isinstance(json.loads(text), dict)


def test_the_sdks_parse_helper_gets_its_model(real) -> None:
    class Weather(BaseModel):
        city: str
        sunny: bool

    reply = sdk(real).chat.completions.parse(model="m", messages=ASK, max_tokens=200,
                                             temperature=0.8, seed=5, response_format=Weather,
                                             extra_body=NO_THINKING)
    assert isinstance(reply.choices[0].message.parsed, Weather)


def test_thinking_stays_free_and_the_answer_follows_the_schema(real, tokenizer) -> None:
    """Thinking on (Qwen3's template: the answer opens the thought itself): the first token may
    be <think> although it is no JSON, the reasoning is free text, and the schema applies from
    the token after </think> (biases make the random model open and soon close a thought)."""
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    think, think_end = (tokenizer.token_to_id[t] for t in ("<think>", "</think>"))
    reply = sdk(real).chat.completions.create(
        model="m", messages=ASK, max_tokens=1000, temperature=0.8, seed=11,
        logit_bias={str(think): 10, str(think_end): 20}, logprobs=True,
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}},
        extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    choice = reply.choices[0]
    assert [t.token for t in choice.logprobs.content[:2]] == ["<think>", "</think>"]
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.message.content), schema)


@pytest.mark.parametrize("response_format", [
    {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "nonsense"}}},
    {"type": "json_schema", "json_schema": {"name": "a", "schema": "not an object"}},
    {"type": "yaml"},
])
def test_bad_schemas_are_400(real, response_format) -> None:
    response = httpx.post(f"{real.url}/v1/chat/completions", json={
        "model": "m", "messages": ASK, "max_tokens": 4, "response_format": response_format})
    error = assert_openai_error(response, 400)
    assert error["param"] == "response_format"


def test_legacy_completions_follow_a_schema_too(real) -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0,
                                                     "maximum": 9}},
              "required": ["n"], "additionalProperties": False}
    reply = sdk(real).completions.create(
        model="m", prompt="Answer as JSON:", max_tokens=200, temperature=0.8, seed=2,
        extra_body={"response_format": {"type": "json_schema",
                                        "json_schema": {"name": "a", "schema": schema}}})
    assert reply.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(reply.choices[0].text), schema)
