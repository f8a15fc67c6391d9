"""Request parsing (protocol.py) for the fields vLLM adds to OpenAI's, and those fields end to end
over HTTP through the real engine on a fake model whose every step's argmax is EOS."""

from __future__ import annotations

import sys
from pathlib import Path

import httpx
import pytest
from server_harness import ThreadServer, sse_json

from sparkinfer_cli.engine.config import EngineConfig
from sparkinfer_cli.engine.engine import ContinuousBatchEngine
from sparkinfer_cli.server.app import create_app
from sparkinfer_cli.server.protocol import (
    ApiError,
    parse_chat_request,
    parse_completion_request,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
from fake_model import (  # noqa: E402
    FakeDeviceModel,
    eos_first,
    expected_greedy,
    make_tokenizer,
)

CHAT = {"messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {"prompt": "hi"}
LIMITS = {"default_temperature": 1.0, "vocab_size": 100, "max_n": 4}
TOKENIZER = make_tokenizer()


def parse(body: dict) -> list:
    """The SamplingParams that a chat body and a completion body with the same fields give."""
    chat = parse_chat_request({**CHAT, **body}, **LIMITS)
    completion = parse_completion_request({**COMPLETION, **body}, **LIMITS)
    return [r.sampling.to_params(r.max_tokens or 64, 0, None) for r in (chat, completion)]


def test_ignore_eos_and_min_tokens_reach_the_sampling_params() -> None:
    assert all(not p.ignore_eos and p.min_tokens == 0 for p in parse({}))
    for params in parse({"ignore_eos": True, "min_tokens": 7, "max_tokens": 7}):
        assert params.ignore_eos and params.min_tokens == 7 and params.max_tokens == 7
    assert all(p.min_tokens == 0 for p in parse({"ignore_eos": None, "min_tokens": None}))


def test_chat_min_tokens_is_bounded_by_whichever_max_tokens_is_given() -> None:
    unbounded = parse_chat_request({**CHAT, "min_tokens": 10_000}, **LIMITS)
    assert unbounded.sampling.min_tokens == 10_000  # the server caps max_tokens later
    newer = {**CHAT, "min_tokens": 6, "max_tokens": 9, "max_completion_tokens": 5}
    assert_rejected(parse_chat_request, newer, "min_tokens", "invalid_value")


@pytest.mark.parametrize("body, code", [
    ({"ignore_eos": 1}, "invalid_type"),
    ({"ignore_eos": "true"}, "invalid_type"),
    ({"min_tokens": -1}, "invalid_value"),
    ({"min_tokens": 2.0}, "invalid_type"),
    ({"min_tokens": True}, "invalid_type"),
    ({"min_tokens": "3"}, "invalid_type"),
    ({"min_tokens": 9, "max_tokens": 8}, "invalid_value"),
])
def test_bad_values_are_400s_naming_the_field(body, code) -> None:
    for parser, base in ((parse_chat_request, CHAT), (parse_completion_request, COMPLETION)):
        assert_rejected(parser, {**base, **body}, next(iter(body)), code)


def test_completion_min_tokens_is_bounded_by_the_default_max_tokens() -> None:
    assert_rejected(parse_completion_request, {**COMPLETION, "min_tokens": 17}, "min_tokens",
                    "invalid_value")


def assert_rejected(parser, body: dict, param: str, code: str) -> None:
    with pytest.raises(ApiError) as caught:
        parser(body, **LIMITS)
    error = caught.value
    assert (error.status, error.param, error.code) == (400, param, code)
    assert param in error.message


# ---- over HTTP, through the real engine --------------------------------------------------------
class LastUserMessage:
    """A chat template that renders only the last message's text (the fake vocabulary has no
    ChatML markers)."""

    source = ""

    def render(self, messages: list[dict], **kwargs) -> str:
        return messages[-1]["content"]


@pytest.fixture(scope="module")
def eos_server():
    engine = ContinuousBatchEngine(eos_first(FakeDeviceModel), TOKENIZER,
                                   EngineConfig(ctx=1024, block_size=8))
    engine.start()
    try:
        with ThreadServer(create_app(engine, TOKENIZER, LastUserMessage())) as server:
            yield server
    finally:
        engine.shutdown()


PROMPTS = {"completions": {"prompt": [1, 2]},  # token ids: the fake vocabulary's "b", "c"
           "chat/completions": {"messages": [{"role": "user", "content": "bc"}]}}


def generate(server: ThreadServer, endpoint: str, stream: bool, **fields) -> tuple[list, list]:
    """(the choice's texts or deltas, finish reasons) of one request."""
    body = {**PROMPTS[endpoint], "stream": stream, "temperature": 0, **fields}
    response = httpx.post(f"{server.url}/v1/{endpoint}", json=body, timeout=30)
    assert response.status_code == 200, response.text
    choices = [c["choices"][0] for c in sse_json(response.text)[0] if c["choices"]] if stream \
        else response.json()["choices"]
    pieces = [c.get("text", c.get("delta", c.get("message", {})).get("content")) for c in choices]
    return [p for p in pieces if p], [c["finish_reason"] for c in choices if c["finish_reason"]]


@pytest.mark.parametrize("endpoint", ["completions", "chat/completions"])
@pytest.mark.parametrize("stream", [False, True])
def test_min_tokens_and_ignore_eos_over_http(eos_server, endpoint, stream) -> None:
    assert generate(eos_server, endpoint, stream, max_tokens=12) == ([], ["stop"])
    pieces, reasons = generate(eos_server, endpoint, stream, max_tokens=12, min_tokens=5)
    assert reasons == ["stop"]  # the model's own 5 tokens, then EOS
    assert "".join(pieces) == TOKENIZER.decode(expected_greedy([1, 2], 5))
    assert len(pieces) == (5 if stream else 1)  # one delta per token
    assert generate(eos_server, endpoint, stream, max_tokens=12, ignore_eos=True)[1] == ["length"]


def test_usage_counts_max_tokens_with_ignore_eos(eos_server) -> None:
    body = {"prompt": [1, 2], "max_tokens": 12, "ignore_eos": True, "temperature": 0}
    usage = httpx.post(f"{eos_server.url}/v1/completions", json=body, timeout=30).json()["usage"]
    assert usage["completion_tokens"] == 12
    chunks, _ = sse_json(httpx.post(f"{eos_server.url}/v1/completions", timeout=30, json={
        **body, "stream": True, "stream_options": {"include_usage": True}}).text)
    assert chunks[-1]["usage"]["completion_tokens"] == 12


def test_bad_min_tokens_is_a_400_over_http(eos_server) -> None:
    body = {"prompt": [1, 2], "max_tokens": 4, "min_tokens": 5}
    response = httpx.post(f"{eos_server.url}/v1/completions", json=body, timeout=30)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "min_tokens"
