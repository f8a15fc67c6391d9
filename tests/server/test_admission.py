"""Auth, error statuses (400/401/404/405/413/429/503/504), disconnect → abort, and a property-based
test that malformed bodies only ever get 4xx OpenAI errors while the server stays up."""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time

import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from server_harness import sse_json

LONG = [{"role": "user", "content": "[long]"}]
HELLO = [{"role": "user", "content": "hello"}]


def chat(url: str, **body) -> httpx.Response:
    return httpx.post(f"{url}/v1/chat/completions", json={"messages": HELLO, **body}, timeout=30)


def assert_openai_error(response: httpx.Response, status: int, code: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if code is not None:
        assert error["code"] == code
    return error


def wait_until(predicate, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)


def metric(url: str, name: str) -> float:
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    raise KeyError(name)


def kv_is_free(url: str) -> bool:
    capacity = httpx.get(f"{url}/v1/capacity").json()
    return capacity["free_kv_blocks"] == capacity["total_kv_blocks"] and \
        capacity["active_requests"] == 0


def test_bearer_auth(make_server) -> None:
    srv = make_server(config={"api_key": "sekret"})
    error = assert_openai_error(chat(srv.url), 401, "invalid_api_key")
    assert error["type"] == "authentication_error"
    response = httpx.get(f"{srv.base_url}/models", headers={"Authorization": "Bearer wrong"})
    assert_openai_error(response, 401)
    assert response.headers["www-authenticate"].startswith("Bearer")
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=srv.base_url, api_key="wrong", max_retries=0).models.list()
    good = openai.OpenAI(base_url=srv.base_url, api_key="sekret", max_retries=0)
    assert good.chat.completions.create(model="m", messages=HELLO).choices[0].message.content
    lowercase = httpx.get(f"{srv.base_url}/info", headers={"Authorization": "bearer sekret"})
    assert lowercase.status_code == 200
    assert httpx.get(f"{srv.url}/health").status_code == 200  # open
    assert httpx.get(f"{srv.url}/metrics").status_code == 200


def test_unknown_route_method_and_oversized_body(make_server) -> None:
    srv = make_server(config={"max_request_bytes": 4096})
    assert_openai_error(httpx.get(f"{srv.base_url}/nope"), 404, "unknown_url")
    assert_openai_error(httpx.get(f"{srv.base_url}/chat/completions"), 405, "method_not_allowed")
    big = [{"role": "user", "content": "x" * 8000}]
    assert_openai_error(httpx.post(f"{srv.base_url}/chat/completions", json={"messages": big}),
                        413)
    assert chat(srv.url).status_code == 200


def test_a_body_far_over_the_limit_gets_its_413_not_a_reset(make_server) -> None:
    # a client writes the whole body before it reads (http.client does): closing the connection
    # with megabytes unread would reset it, and the client would never see the 413
    srv = make_server(config={"max_request_bytes": 4096})
    message = json.dumps({"role": "user", "content": "hello"}).encode()
    body = b'{"messages": [' + b", ".join([message] * 600_000) + b"]}"  # 20 MB
    pieces = [body[i:i + 65536] for i in range(0, len(body), 65536)]
    connection = http.client.HTTPConnection("127.0.0.1", int(srv.url.rsplit(":", 1)[1]), timeout=30)
    for content, chunked in ((body, False), (pieces, True)):  # one connection: it stays usable
        connection.request("POST", "/v1/chat/completions", body=content, encode_chunked=chunked,
                           headers={"content-type": "application/json"})
        response = connection.getresponse()
        assert response.status == 413
        assert json.loads(response.read())["error"]["code"] == "request_too_large"
    connection.close()


def test_read_timeout_drops_a_stalled_request(make_server) -> None:
    srv = make_server(config={"read_timeout_s": 0.5})
    with socket.create_connection(("127.0.0.1", int(srv.url.rsplit(":", 1)[1])), 5) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n"
                     b"\r\n{\"messages\": ")  # then nothing more
        sock.settimeout(5)
        started = time.monotonic()
        reply = sock.recv(4096)
    assert reply.startswith(b"HTTP/1.1 408") and time.monotonic() - started < 3


def test_context_limits(make_server) -> None:
    srv = make_server(ctx=96)
    assert_openai_error(chat(srv.url, messages=[{"role": "user", "content": "x" * 100}]), 400,
                        "context_length_exceeded")
    error = assert_openai_error(chat(srv.url, max_tokens=90), 400, "context_length_exceeded")
    assert "96" in error["message"]  # the message names the limit
    assert chat(srv.url).json()["choices"][0]["message"]["content"] == "You said: hello"


def test_max_output_tokens_caps_max_tokens(make_server) -> None:
    srv = make_server(config={"max_output_tokens": 5})
    body = chat(srv.url, max_tokens=1000).json()
    assert (body["choices"][0]["message"]["content"], body["choices"][0]["finish_reason"]) == \
        ("You s", "length")
    assert httpx.get(f"{srv.base_url}/info").json()["max_output_tokens"] == 5


def test_queue_full_gives_429_with_retry_after(make_server) -> None:
    srv = make_server(max_queue_depth=1, token_delay_s=0.01, config={"retry_after_s": 2})
    with httpx.stream("POST", f"{srv.base_url}/chat/completions",
                      json={"messages": LONG, "stream": True}) as first:
        lines = first.iter_lines()  # NOTE: keep it: a collected iterator closes the connection
        next(lines)  # the first request is running
        response = chat(srv.url)
        assert_openai_error(response, 429, "queue_full")
        assert response.headers["retry-after"] == "2"
        with pytest.raises(openai.RateLimitError):
            openai.OpenAI(base_url=srv.base_url, api_key="x", max_retries=0) \
                .chat.completions.create(model="m", messages=HELLO)
    wait_until(lambda: kv_is_free(srv.url))
    assert chat(srv.url).status_code == 200
    assert metric(srv.url, 'sparkinfer_requests_by_outcome_total{outcome="overloaded"}') == 2


def test_n_choices_are_admitted_together_or_not_at_all(make_server) -> None:
    srv = make_server(max_queue_depth=2, token_delay_s=0.01)
    assert_openai_error(chat(srv.url, messages=LONG, n=3), 429, "queue_full")
    wait_until(lambda: len(srv.engine.aborted) == 2)  # the two admitted choices are withdrawn
    wait_until(lambda: kv_is_free(srv.url))
    assert srv.state.engine.num_in_flight == 0


def test_engine_timeout_gives_504_or_an_sse_error(make_server) -> None:
    srv = make_server(request_timeout_s=0.3, token_delay_s=0.01)
    assert_openai_error(chat(srv.url, messages=LONG), 504, "request_timeout")
    response = chat(srv.url, messages=LONG, stream=True)  # headers went out with the first token
    chunks, done = sse_json(response.text)
    assert chunks[-1]["error"]["code"] == "request_timeout" and not done
    with pytest.raises(openai.APIError):
        list(openai.OpenAI(base_url=srv.base_url, api_key="x", max_retries=0)
             .chat.completions.create(model="m", messages=LONG, stream=True))
    wait_until(lambda: kv_is_free(srv.url))
    assert metric(srv.url, 'sparkinfer_requests_by_outcome_total{outcome="timeout"}') == 3


def test_server_deadline_backstop_aborts_a_stuck_request(make_server) -> None:
    srv = make_server(prefill_delay_s=1.0, config={"request_timeout_s": 0.2})
    started = time.monotonic()
    assert_openai_error(chat(srv.url, stream=True), 504, "request_timeout")  # before any token
    assert time.monotonic() - started < 0.9
    wait_until(lambda: len(srv.engine.aborted) == 1)
    wait_until(lambda: kv_is_free(srv.url))


def test_draining_refuses_new_generation_with_503(make_server) -> None:
    srv = make_server()
    srv.state.engine.begin_drain()
    response = chat(srv.url)
    assert_openai_error(response, 503, "server_shutting_down")
    assert "retry-after" in response.headers
    assert httpx.get(f"{srv.url}/health").status_code == 503
    assert httpx.get(f"{srv.base_url}/capacity").json()["accepting_requests"] is False
    assert httpx.get(f"{srv.base_url}/models").status_code == 200


def test_stream_disconnect_aborts_and_frees_kv(make_server) -> None:
    srv = make_server(token_delay_s=0.01)
    with httpx.stream("POST", f"{srv.base_url}/chat/completions",
                      json={"messages": LONG, "stream": True}) as response:
        lines = response.iter_lines()
        request_id = json.loads(next(lines)[len("data: "):])["id"]
        assert not kv_is_free(srv.url)
    # leaving the block closes the connection mid-stream
    wait_until(lambda: request_id in srv.engine.aborted)
    wait_until(lambda: kv_is_free(srv.url))
    assert metric(srv.url, 'sparkinfer_requests_by_outcome_total{outcome="cancelled"}') == 1
    assert srv.state.engine.num_in_flight == 0


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_hangs_up_before_the_first_token_aborts_its_request(make_server,
                                                                          stream) -> None:
    """A client that leaves while its prompt is still being read (nothing written to it yet)
    gets its request aborted then, not once the first token is ready: the prefill here waits
    until the test opens its gate, after the abort must have arrived."""
    gate = threading.Event()
    srv = make_server(prefill_gate=gate)
    host, port = srv.url.removeprefix("http://").split(":")
    body = json.dumps({"messages": LONG, "stream": stream}).encode()
    try:
        with socket.create_connection((host, int(port))) as sock:
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                         b"Content-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n" % len(body) + body)
            wait_until(lambda: srv.engine.running)  # submitted, its prefill held
        wait_until(lambda: srv.engine.aborts)
    finally:
        gate.set()
    wait_until(lambda: len(srv.engine.aborted) == 1)


def test_non_streaming_disconnect_aborts(make_server) -> None:
    srv = make_server(token_delay_s=0.01)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{srv.base_url}/chat/completions", json={"messages": LONG}, timeout=0.3)
    wait_until(lambda: len(srv.engine.aborted) == 1)
    wait_until(lambda: kv_is_free(srv.url))


# ---------------------------------------------------------------- malformed bodies

KNOWN_KEYS = ["model", "messages", "stream", "stream_options", "n", "max_tokens",
              "max_completion_tokens", "temperature", "top_p", "top_k", "min_p",
              "presence_penalty", "frequency_penalty", "repetition_penalty", "seed", "logit_bias",
              "stop", "logprobs", "top_logprobs", "tools", "tool_choice", "parallel_tool_calls",
              "enable_thinking", "chat_template_kwargs", "reasoning_effort", "response_format",
              "prompt", "echo", "best_of", "suffix", "content", "user", "ignore_eos",
              "min_tokens"]
scalars = (st.none() | st.booleans() | st.integers(-2**70, 2**70) |
           st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=12))
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3) |
                           st.dictionaries(st.text(max_size=8) | st.sampled_from(KNOWN_KEYS),
                                           inner, max_size=3), max_leaves=8)
# values a validator has to look at closely: right type, edge of the range, near-miss shapes
near_valid = st.one_of(
    st.integers(-3, 40), st.floats(-3, 3), st.booleans(),
    st.sampled_from(["auto", "none", "required", "text", "none", "", "65", "-1"]),
    st.lists(st.text(max_size=4), max_size=20),
    st.lists(st.integers(-2, 0x110001), min_size=1, max_size=4),
    st.fixed_dictionaries({"type": st.sampled_from(["function", "text", "json_object"]),
                           "function": st.fixed_dictionaries({}, optional={
                               "name": st.sampled_from(["get_weather", "", 3]),
                               "parameters": json_values, "arguments": json_values})}),
    st.dictionaries(st.sampled_from(["65", "x", "-1", "1114112", "include_usage",
                                     "enable_thinking"]),
                    st.integers(-200, 200) | st.booleans() | st.floats(-200, 200), max_size=3),
)
messages = st.lists(st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant", "tool", "developer", "x"]),
     "content": st.text(max_size=12) | json_values | st.lists(st.fixed_dictionaries(
         {"type": st.sampled_from(["text", "image_url"]), "text": st.text(max_size=5) | scalars}),
         max_size=2)},
    optional={"tool_calls": json_values | st.lists(near_valid, max_size=2),
              "reasoning_content": json_values, "name": json_values}), max_size=3)
BASES = [("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                   "max_tokens": 8}),
         ("/v1/completions", {"prompt": "hi", "max_tokens": 8}),
         ("/v1/tokenize", {"messages": [{"role": "user", "content": "hi"}]})]
mutations = st.dictionaries(st.sampled_from(KNOWN_KEYS), near_valid | json_values, max_size=2)
requests = st.one_of(
    st.tuples(st.sampled_from([b[0] for b in BASES]), json_values),
    st.builds(lambda base, changes: (base[0], {**base[1], **changes}), st.sampled_from(BASES),
              mutations),
    st.builds(lambda endpoint, m, changes: (endpoint, {**changes, "messages": m, "max_tokens": 8}),
              st.sampled_from([b[0] for b in BASES]), messages, mutations),
)


@pytest.fixture(scope="module")
def fuzz_client(server):
    with httpx.Client(base_url=server.url, timeout=30) as client:
        yield client


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(request=requests)
def test_malformed_json_bodies_get_4xx_openai_errors(fuzz_client, request) -> None:
    endpoint, body = request
    response = fuzz_client.post(endpoint, content=json.dumps(body))
    assert response.status_code < 500, response.text
    if response.status_code >= 400:
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}


@settings(max_examples=60, deadline=None)
@given(endpoint=st.sampled_from([b[0] for b in BASES]), raw=st.binary(max_size=64))
def test_non_json_bodies_get_400(fuzz_client, endpoint, raw) -> None:
    response = fuzz_client.post(endpoint, content=raw)
    if response.status_code != 200:  # a few byte strings are valid JSON objects
        assert_openai_error(response, 400)


def test_server_is_healthy_and_leak_free_after_fuzzing(server, fuzz_client) -> None:
    assert fuzz_client.get("/health").json() == {"status": "ok"}
    wait_until(lambda: kv_is_free(server.url))
    assert server.state.engine.num_in_flight == 0
    assert metric(server.url, 'sparkinfer_requests_by_outcome_total{outcome="server_error"}') == 0
