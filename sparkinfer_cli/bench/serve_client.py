"""The client side of `sparkinfer bench --serve`: streaming /v1/completions requests, one thread
each, timed as the client sees them, in the loads the benchmark drives (all clients at once, or
Poisson arrivals).

Standard library only (http.client, threads), so the figures carry no client library's overhead
and the loads run against any OpenAI-compatible server.
"""

from __future__ import annotations

import http.client
import itertools
import json
import random
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from sparkinfer_cli.engine.speculative import SpeculationStats

REQUEST_TIMEOUT_S = 600.0  # one request, connect to [DONE]
# prompts are windows of seeded random words, so no two requests share a prefix (or a cache hit)
PROMPT_WORDS = ("time", "river", "stone", "light", "market", "garden", "number", "window",
                "paper", "engine", "winter", "voice", "circle", "island", "letter", "forest",
                "copper", "signal", "bridge", "summer", "thread", "planet", "mirror", "harbor",
                "silver", "orange", "pocket", "valley", "ladder", "candle", "rocket", "meadow")
PROMPT_POOL_WORDS = 6000
PROMPT_STRIDE = 7919  # a prime: the windows of consecutive requests start far apart


@dataclass
class RequestTiming:
    """One streamed request as the client saw it (perf_counter seconds)."""

    sent_at: float
    token_times: list[float] = field(default_factory=list)  # chunks that carried token text
    ended_at: float = 0.0
    output_tokens: int = 0  # the final usage block's completion_tokens
    finish_reason: str | None = None
    server_ttft_ms: float | None = None  # the usage block's ttft_ms, where the server sends one
    error: str | None = None
    prompt_tokens: int = 0  # the usage block's
    cached_tokens: int = 0  # the usage block's prompt_tokens_details.cached_tokens
    text: str = ""  # the streamed text

    @property
    def ttft_s(self) -> float:
        return self.token_times[0] - self.sent_at

    @property
    def itl_s(self) -> list[float]:
        return [b - a for a, b in itertools.pairwise(self.token_times)]

    @property
    def e2e_s(self) -> float:
        return self.ended_at - self.sent_at

    @property
    def stream_tok_s(self) -> float | None:
        """Tokens after the first over the time from the first token chunk to the last."""
        span = self.token_times[-1] - self.token_times[0] if self.token_times else 0.0
        return (self.output_tokens - 1) / span if span > 0 else None


@dataclass(frozen=True)
class Endpoint:
    """A server's base URL and the model id its requests name."""

    url: str
    model: str = "sparkinfer"

    def target(self, path: str) -> str:
        """path under the URL's own path (a server mounted at /api gets /api/v1/...)."""
        return urlsplit(self.url).path.rstrip("/") + path

    def connection(self, timeout_s: float) -> http.client.HTTPConnection:
        parts = urlsplit(self.url)
        https = parts.scheme == "https"
        kind = http.client.HTTPSConnection if https else http.client.HTTPConnection
        return kind(parts.hostname or "127.0.0.1", parts.port, timeout=timeout_s)

    def get_json(self, path: str, timeout_s: float = 10.0) -> dict:
        return json.loads(self._call("GET", path, None, timeout_s))

    def get_text(self, path: str, timeout_s: float = 10.0) -> str:
        return self._call("GET", path, None, timeout_s).decode()

    def post_json(self, path: str, body: dict, timeout_s: float = 60.0) -> dict:
        return json.loads(self._call("POST", path, body, timeout_s))

    def _call(self, method: str, path: str, body: dict | None, timeout_s: float) -> bytes:
        conn = self.connection(timeout_s)
        try:
            conn.request(method, self.target(path), None if body is None else json.dumps(body),
                         {"Content-Type": "application/json"})
            response = conn.getresponse()
            data = response.read()
        finally:
            conn.close()
        if response.status != 200:
            raise RuntimeError(f"{method} {self.url}{path}: {http_error(response.status, data)}")
        return data


SPEC_COUNTERS = ("drafts", "draft_tokens", "accepted_tokens")  # sparkinfer_spec_decode_*_total


def speculation_counts(endpoint: Endpoint) -> SpeculationStats | None:
    """The server's speculative-decoding counters so far (its /metrics); None where it reports
    none (speculation off, or another server)."""
    try:
        return parse_speculation(endpoint.get_text("/metrics"))
    except RuntimeError:  # no /metrics here
        return None


def parse_speculation(metrics: str) -> SpeculationStats | None:
    """sparkinfer's spec_decode counters from a Prometheus text page; None unless all are there."""
    values = {}
    for line in metrics.splitlines():
        name, _, value = line.partition(" ")
        for counter in SPEC_COUNTERS:
            if name == f"sparkinfer_spec_decode_{counter}_total":
                values[counter] = int(float(value))
    if len(values) < len(SPEC_COUNTERS):
        return None
    return SpeculationStats(*(values[c] for c in SPEC_COUNTERS))


def http_error(status: int, body: bytes) -> str:
    return f"HTTP {status}: {body[:300].decode(errors='replace')}"


def connect(url: str) -> Endpoint:
    """The endpoint with the model id the server lists first (servers that check it need it)."""
    base = url.rstrip("/")
    models = Endpoint(base).get_json("/v1/models").get("data") or [{}]
    return Endpoint(base, models[0].get("id", "sparkinfer"))


# ---- one streamed request ------------------------------------------------------------------------
def completion_body(endpoint: Endpoint, prompt: list[int] | str, max_tokens: int,
                    ignore_eos: bool = True, response_format: dict | None = None) -> dict:
    # NOTE: ignore_eos (vLLM's field) keeps every request max_tokens long; a server without it
    # stops at EOS, which the report counts as "stopped early"
    body = {"model": endpoint.model, "prompt": prompt, "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True},
            "ignore_eos": ignore_eos}
    if response_format is not None:
        body["response_format"] = response_format
    return body


def stream_completion(endpoint: Endpoint, prompt: list[int] | str, max_tokens: int,
                      timeout_s: float = REQUEST_TIMEOUT_S, ignore_eos: bool = True,
                      response_format: dict | None = None) -> RequestTiming:
    """Sends one streaming completion and times its chunks; failures are recorded, not raised."""
    return stream_post(endpoint, "/v1/completions", completion_body(
        endpoint, prompt, max_tokens, ignore_eos, response_format), timeout_s)


def stream_chat(endpoint: Endpoint, messages: list[dict], max_tokens: int,
                timeout_s: float = REQUEST_TIMEOUT_S) -> RequestTiming:
    """One streaming chat completion (greedy, max_tokens long: ignore_eos), timed."""
    body = {"model": endpoint.model, "messages": messages, "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True},
            "ignore_eos": True}
    return stream_post(endpoint, "/v1/chat/completions", body, timeout_s)


def stream_post(endpoint: Endpoint, path: str, body: dict, timeout_s: float) -> RequestTiming:
    conn = endpoint.connection(timeout_s)
    timing = RequestTiming(time.perf_counter())
    try:
        conn.request("POST", endpoint.target(path), json.dumps(body),
                     {"Content-Type": "application/json", "Accept": "text/event-stream"})
        response = conn.getresponse()
        if response.status != 200:
            timing.error = http_error(response.status, response.read())
        else:
            read_stream(response, timing)
    except (OSError, http.client.HTTPException, ValueError) as exc:
        timing.error = f"{type(exc).__name__}: {exc}"
    finally:
        conn.close()
    timing.ended_at = time.perf_counter()
    return timing


def read_stream(lines: Iterator[bytes], timing: RequestTiming) -> None:
    """Folds an SSE body into timing, each data line stamped when it arrives."""
    for data in sse_data(lines):
        if data == "[DONE]":
            if timing.output_tokens == 0:  # NOTE: tokens are counted from usage, never chunks
                timing.error = "the stream carried no usage block (stream_options.include_usage)"
            return
        add_chunk(timing, json.loads(data), time.perf_counter())
    if timing.error is None:
        timing.error = "the stream ended without [DONE]"


def sse_data(lines: Iterator[bytes]) -> Iterator[str]:
    for line in lines:
        text = line.decode().rstrip("\r\n")
        if text.startswith("data:"):
            yield text[5:].removeprefix(" ")


def add_chunk(timing: RequestTiming, chunk: dict, now: float) -> None:
    if "error" in chunk:
        error = chunk["error"]
        message = error.get("message", error) if isinstance(error, dict) else error
        timing.error = f"in-stream error: {message}"
        return
    for choice in chunk.get("choices") or ():
        delta = choice.get("delta") or {}  # chat chunks; completions carry "text"
        text = choice.get("text") or delta.get("content") or ""
        if text or delta.get("reasoning_content"):
            timing.token_times.append(now)
            timing.text += text  # NOTE: the answer as a client keeps it, reasoning left out
        timing.finish_reason = choice.get("finish_reason") or timing.finish_reason
    usage = chunk.get("usage")
    if usage:
        timing.output_tokens = usage.get("completion_tokens", 0)
        timing.server_ttft_ms = usage.get("ttft_ms")
        timing.prompt_tokens = usage.get("prompt_tokens", 0)
        timing.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)


# ---- prompts -------------------------------------------------------------------------------------
class PromptSource:
    """Prompts of exactly n token ids, a different one each call: windows of one pool of
    ordinary-text tokens from the server's /v1/tokenize (so prompts are text, not random ids)."""

    def __init__(self, endpoint: Endpoint, seed: int = 0):
        rng = random.Random(seed)
        text = " ".join(rng.choice(PROMPT_WORDS) for _ in range(PROMPT_POOL_WORDS))
        self.pool: list[int] = endpoint.post_json("/v1/tokenize", {"prompt": text})["tokens"]
        self.starts = itertools.count()

    def next(self, n: int) -> list[int]:
        start = next(self.starts) * PROMPT_STRIDE
        return [self.pool[(start + i) % len(self.pool)] for i in range(n)]


# ---- loads ---------------------------------------------------------------------------------------
Send = Callable[[], RequestTiming]


def run_together(sends: list[list[Send]]) -> list[RequestTiming]:
    """One thread per client, released at once; each runs its sends one after another."""
    start = threading.Barrier(len(sends))

    def client(mine: list[Send]) -> list[RequestTiming]:
        start.wait()
        return [send() for send in mine]

    return run_threads([lambda s=s: client(s) for s in sends], [0.0] * len(sends))


def run_arrivals(sends: list[Send], arrivals_s: list[float]) -> list[RequestTiming]:
    """sends[i] starts arrivals_s[i] seconds after the call, each on its own thread."""
    return run_threads([lambda s=s: [s()] for s in sends], arrivals_s)


def run_threads(jobs: list[Callable[[], list[RequestTiming]]],
                starts_s: list[float]) -> list[RequestTiming]:
    """jobs[i] on a thread started starts_s[i] seconds after the call; their timings in order."""
    origin = time.perf_counter()
    results: list[list[RequestTiming]] = [[] for _ in jobs]
    threads = []
    for i, (job, at) in enumerate(zip(jobs, starts_s)):
        time.sleep(max(0.0, origin + at - time.perf_counter()))
        threads.append(threading.Thread(target=lambda i=i, job=job: results[i].extend(job())))
        threads[-1].start()
    for thread in threads:
        thread.join()
    return [t for r in results for t in r]


def poisson_arrivals(rate: float, duration_s: float, seed: int = 0) -> list[float]:
    """Arrival times in [0, duration_s) of a Poisson process of `rate` requests/s (seeded)."""
    rng, times, t = random.Random(seed), [], 0.0
    while (t := t + rng.expovariate(rate)) < duration_s:
        times.append(t)
    return times
