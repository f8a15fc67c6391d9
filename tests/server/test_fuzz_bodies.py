"""Property-based fuzzing of the issue 31 classes that gave 500s or dropped connections, on the
fake-engine app: bodies written as raw JSON text (so they can hold lone or broken UTF-16
surrogates, keys of any digits, nesting of any depth, repeated messages), posted to
/v1/chat/completions, /v1/completions and /v1/tokenize. Every answer must be a 2xx, or a 4xx
carrying an OpenAI error object; never a 5xx. test_admission fuzzes the fields' shapes."""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

ROUTES = ["/v1/chat/completions", "/v1/completions", "/v1/tokenize"]
# JSON string escapes a validator may trip on: lone and reversed surrogates, a valid pair, NUL
ESCAPES = ["\\ud800", "\\udfff", "\\udc00\\ud800", "\\ud83d\\ude00", "\\u0000", "\\u00e9", "x"]
# digits Python's int() or str.isdigit() take that JSON or a token id would not
DIGIT_KEYS = st.sampled_from(["²", "①", "٣", "१२", "𝟗", "1_0", " 7", "+3", "-0", "0x1f", "1e3",
                              "9" * 5000, "00042", "-1"])


def text_with_escapes() -> st.SearchStrategy[str]:
    """The inside of a JSON string literal mixing plain text and escapes."""
    plain = st.text(st.characters(blacklist_categories=("Cs", "Cc"),
                                  blacklist_characters='"\\'), max_size=6)
    return st.lists(plain | st.sampled_from(ESCAPES), max_size=6).map("".join)


def nested(depth: int, leaf: str, opener: str = "[") -> str:
    closer = {"[": "]", "{": "}"}[opener]
    if opener == "{":
        return '{"a": ' * depth + leaf + closer * depth
    return opener * depth + leaf + closer * depth


@st.composite
def raw_bodies(draw: st.DrawFn) -> tuple[str, str]:
    route = draw(st.sampled_from(ROUTES))
    text = draw(text_with_escapes())
    depth = draw(st.integers(1, 1500))
    kind = draw(st.sampled_from(["surrogates", "logit_bias", "deep_prompt", "deep_unknown",
                                 "repeated", "deep_content"]))
    messages = f'[{{"role": "user", "content": "{text}"}}]'
    if kind == "surrogates":
        field = '"prompt"' if route == "/v1/completions" else '"messages"'
        value = f'"{text}"' if route == "/v1/completions" else messages
        return route, f'{{{field}: {value}, "max_tokens": 4}}'
    if kind == "logit_bias":
        bias = json.dumps({draw(DIGIT_KEYS): draw(st.integers(-200, 200) | st.floats(-1e3, 1e3))})
        return route, f'{{"messages": {messages}, "prompt": "hi", "logit_bias": {bias}}}'
    if kind == "deep_prompt":
        return route, f'{{"prompt": {nested(depth, "1")}, "max_tokens": 2}}'
    if kind == "deep_unknown":  # an unknown field the server should ignore, however deep
        opener = draw(st.sampled_from(["[", "{"]))
        return route, (f'{{"messages": {messages}, "prompt": "hi", "max_tokens": 2, '
                       f'"x_extra": {nested(depth, "null", opener)}}}')
    if kind == "deep_content":
        return route, f'{{"messages": [{{"role": "user", "content": {nested(depth, "1")}}}]}}'
    repeats = draw(st.integers(1, 3000))
    return route, f'{{"messages": [{", ".join([messages[1:-1]] * repeats)}], "max_tokens": 2}}'


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, timeout=60) as http:
        yield http


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(request=raw_bodies())
def test_hostile_json_bodies_get_2xx_or_4xx_openai_errors(client, request) -> None:
    route, body = request
    response = client.post(route, content=body.encode("utf-8"),
                           headers={"content-type": "application/json"})
    assert response.status_code < 500, response.text
    if response.status_code >= 400:
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}
