"""SIGTERM/SIGINT against a real server process: in-flight streams finish, new requests and those
not started yet get 503 with Retry-After (a router retries them elsewhere), the process exits;
what still runs when SPARKINFER_SHUTDOWN_GRACE_S ends gets an error in its API's shape, never a
bare close."""

from __future__ import annotations

import signal
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import httpx
import pytest
from server_harness import ProcessServer, fake_server, sse_json
from test_admission import assert_openai_error, wait_until

LONG = [{"role": "user", "content": "[long]"}]
LONG_STREAM = {"messages": LONG, "stream": True}


def post_until_refused(url: str, timeout_s: float = 3.0) -> httpx.Response:
    deadline = time.monotonic() + timeout_s
    while True:
        response = httpx.post(f"{url}/v1/chat/completions",
                              json={"messages": [{"role": "user", "content": "hi"}]}, timeout=10)
        if response.status_code != 200 or time.monotonic() > deadline:
            return response
        time.sleep(0.05)


def test_sigterm_lets_in_flight_streams_finish_and_refuses_new_ones() -> None:
    env = {"FAKE_TOKEN_DELAY_S": "0.01", "SPARKINFER_SHUTDOWN_GRACE_S": "20"}
    with fake_server(env) as server:
        with httpx.stream("POST", f"{server.url}/v1/chat/completions", timeout=30,
                          json={**LONG_STREAM, "max_tokens": 150}) as stream:
            lines = stream.iter_lines()
            first = next(lines)
            server.signal(signal.SIGTERM)
            refused = post_until_refused(server.url)
            assert refused.status_code == 503
            assert refused.json()["error"]["code"] == "server_shutting_down"
            assert httpx.get(f"{server.url}/health").status_code == 503
            body = "\n".join([first, *lines]) + "\n\n"
        chunks, done = sse_json(body)
        assert done and chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert len("".join(c["choices"][0]["delta"].get("content", "") for c in chunks)) == 150
        assert server.wait(15) == 0
        assert "server exited cleanly" in server.output()


def capacity(server: ProcessServer) -> dict[str, Any]:
    return httpx.get(f"{server.url}/v1/capacity").json()


@pytest.mark.slow
def test_sigterm_refuses_queued_requests_at_once_and_finishes_the_running_one() -> None:
    # 25 KV blocks of 16 tokens: the stream holds 19 of them, the two others wait for KV
    env = {"FAKE_TOKEN_DELAY_S": "0.02", "SPARKINFER_SHUTDOWN_GRACE_S": "20", "CTX": "400"}
    queued_body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 150}
    with fake_server(env) as server, ThreadPoolExecutor(2) as pool:
        with httpx.stream("POST", f"{server.url}/v1/chat/completions", timeout=30,
                          json={**LONG_STREAM, "max_tokens": 250}) as stream:
            lines = stream.iter_lines()
            first = next(lines)
            queued = [pool.submit(httpx.post, f"{server.url}/v1/chat/completions", timeout=30,
                                  json={**queued_body, "stream": is_stream})
                      for is_stream in (False, True)]
            wait_until(lambda: capacity(server)["queued_requests"] == 2)
            server.signal(signal.SIGTERM)
            for future in queued:  # the stream has 4 s to go
                refused = future.result(timeout=2)
                assert_openai_error(refused, 503, "server_shutting_down")
                assert refused.headers["retry-after"] == "1"
            body = "\n".join([first, *lines]) + "\n\n"
        chunks, done = sse_json(body)
        assert done and chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert len("".join(c["choices"][0]["delta"].get("content", "") for c in chunks)) == 250
        assert server.wait(15) == 0


def stream_in_background(pool: ThreadPoolExecutor, url: str, body: dict[str, Any]
                         ) -> tuple[Future[tuple[int, dict[str, str], str]], threading.Event]:
    """POSTs body; the future gets (status, headers, body text), the event is set once the
    response headers are in."""
    headers_in = threading.Event()

    def post() -> tuple[int, dict[str, str], str]:
        with httpx.stream("POST", url, json=body, timeout=30) as response:
            headers_in.set()
            return response.status_code, dict(response.headers), response.read().decode()

    return pool.submit(post), headers_in


def named_events(text: str) -> list[tuple[str, str]]:
    """(event name, data) of a Responses or Messages stream."""
    return [(block.split("\n")[0].removeprefix("event: "), block.split("data: ", 1)[1])
            for block in text.strip().split("\n\n")]


def test_requests_running_when_the_grace_period_ends_get_an_error_not_a_cut() -> None:
    env = {"FAKE_TOKEN_DELAY_S": "0.01", "SPARKINFER_SHUTDOWN_GRACE_S": "1", "CTX": "16384"}
    streams = {"chat/completions": {**LONG_STREAM, "max_tokens": 3000},
               "responses": {"input": "[long]", "max_output_tokens": 3000, "stream": True},
               "messages": {"messages": LONG, "max_tokens": 3000, "stream": True}}
    with fake_server(env) as server, ThreadPoolExecutor(4) as pool:
        started = {path: stream_in_background(pool, f"{server.url}/v1/{path}", body)
                   for path, body in streams.items()}
        plain, _ = stream_in_background(pool, f"{server.url}/v1/chat/completions",
                                        {"messages": LONG, "max_tokens": 3000})
        assert all(headers_in.wait(10) for _, headers_in in started.values())
        wait_until(lambda: capacity(server)["active_requests"] == 4)
        signalled = time.monotonic()
        server.signal(signal.SIGINT)
        answers = {path: future.result(15) for path, (future, _) in started.items()}
        status, headers, text = plain.result(15)
        assert server.wait(15) == 0 and "server exited cleanly" in server.output()
    assert time.monotonic() - signalled < 1 + 5  # grace + reporting the cut + Sanic's close
    assert status == 503 and headers["retry-after"] == "1"
    assert assert_openai_error(httpx.Response(status, text=text), 503)["code"] == \
        "server_shutting_down"
    chunks, done = sse_json(answers["chat/completions"][2])
    assert not done and chunks[-1]["error"]["code"] == "server_shutting_down"
    assert 0 < len("".join(c["choices"][0]["delta"].get("content", "") for c in chunks[:-1]))
    responses = named_events(answers["responses"][2])
    assert responses[-1][0] == "response.failed" and "server_shutting_down" in responses[-1][1]
    messages = named_events(answers["messages"][2])
    assert messages[-1][0] == "error" and "overloaded_error" in messages[-1][1]
    assert "message_stop" not in dict(messages)
