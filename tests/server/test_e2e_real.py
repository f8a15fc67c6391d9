"""End to end: `run_server` in its own process with the real engine, tokenizer and the tiny qwen3
GGUF on the CPU, driven by the openai SDK and raw HTTP. Greedy output is checked against
llama.cpp's greedy tokens for the same file (tests/fixtures/tiny/qwen3/qwen3.goldens.json)."""

from __future__ import annotations

import asyncio
import json
import signal
from pathlib import Path

import httpx
import openai
import pytest
from server_harness import ProcessServer, sse_json
from test_admission import assert_openai_error, kv_is_free, metric, wait_until

from sparkinfer_cli.bench.serve_client import connect
from sparkinfer_cli.bench.serve_turns import run_turns
from sparkinfer_cli.gguf.reader import GGUFFile
from sparkinfer_cli.tokenizer.tokenizer import Tokenizer

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "tiny" / "qwen3"
MODEL = FIXTURES / "qwen3-Q8_0.gguf"
GOLDENS = json.loads((FIXTURES / "qwen3.goldens.json").read_text())
RUN_SERVER = "import sys; from sparkinfer_cli.server.app import run_server; run_server(sys.argv[1])"
pytestmark = pytest.mark.slow  # two server processes; the first may compile the CPU kernels
STARTUP_S = 300  # a cold numba cache compiles the CPU kernels on the first forward pass
REQUEST_S = 300


def start_real_server(**env: str) -> ProcessServer:
    return ProcessServer(["-c", RUN_SERVER, str(MODEL)], {"CTX": "4096", **env}, STARTUP_S)


@pytest.fixture(scope="module")
def real():
    with start_real_server(SPARKINFER_MAX_QUEUE_DEPTH="64") as server:
        yield server


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_gguf(GGUFFile(MODEL))


def sdk(server: ProcessServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0,
                         timeout=REQUEST_S)


@pytest.mark.parametrize("prompt", ["prompt_short", "prompt_long"])
def test_greedy_completion_matches_llama_cpp(real, tokenizer, prompt) -> None:
    expected = tokenizer.decode(GOLDENS["llama_cpp"]["Q8_0"][f"greedy_{prompt}".replace(
        "greedy_prompt_", "greedy_")])
    completion = sdk(real).completions.create(model="m", prompt=GOLDENS[prompt], max_tokens=24,
                                              temperature=0)
    assert completion.choices[0].text == expected
    assert completion.usage.prompt_tokens == len(GOLDENS[prompt])
    stream = sdk(real).completions.create(model="m", prompt=GOLDENS[prompt], max_tokens=24,
                                          temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in stream) == expected


def test_a_repeated_prompt_is_served_from_the_prefix_cache_with_llama_cpps_answer(real,
                                                                                 tokenizer):
    prompt = GOLDENS["prompt_long"]
    expected = tokenizer.decode(GOLDENS["llama_cpp"]["Q8_0"]["greedy_long"])
    full_blocks = (len(prompt) - 1) // 16 * 16  # the last prompt token is always computed
    sdk(real).completions.create(model="m", prompt=prompt, max_tokens=24, temperature=0)
    hits = metric(real.url, "sparkinfer_prefix_cache_hits_total")
    again = sdk(real).completions.create(model="m", prompt=prompt, max_tokens=24, temperature=0)
    assert again.choices[0].text == expected
    assert again.usage.prompt_tokens_details.cached_tokens == full_blocks
    assert metric(real.url, "sparkinfer_prefix_cache_hits_total") == hits + full_blocks
    chunks = list(sdk(real).completions.create(model="m", prompt=prompt, max_tokens=24,
                                               temperature=0, stream=True,
                                               stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == full_blocks
    assert httpx.get(f"{real.url}/v1/capacity").json()["prefix_cache"]["cached_blocks"] > 0


def test_the_turns_benchmark_sees_each_turn_reuse_the_last_one(real) -> None:
    """bench --serve --turns against the real server: every later turn takes at least the
    previous prompt's full blocks from the cache; the cold prompt takes nothing."""
    turns, cold = run_turns(connect(real.url), 3, 120, 20, 8, seed=3)
    assert not [t.error for t in [*turns, cold] if t.error]
    assert turns[0].cached_tokens == 0 and cold.cached_tokens == 0
    for before, turn in zip(turns, turns[1:]):
        assert turn.cached_tokens >= before.prompt_tokens // 16 * 16
        assert 20 <= turn.added_tokens and turn.computed_tokens < turn.prompt_tokens // 2
    assert cold.prompt_tokens >= turns[-1].prompt_tokens


def test_a_hybrid_models_next_chat_turn_resumes_where_the_messages_ended() -> None:
    """Qwen3.5-MoE (Gated-DeltaNet state): the next turn renders this turn's answer its own way
    (thinking dropped), so only a state snapshot where the messages ended lets it resume; it
    does, and computes just the answer and the new message (answers equal the cache-off ones)."""
    hybrid = FIXTURES.parent / "qwen35moe" / "qwen35moe-Q8_0.gguf"
    answers = {}
    for cache in ("1", "0"):
        with ProcessServer(["-c", RUN_SERVER, str(hybrid)],
                           {"CTX": "4096", "SPARKINFER_PREFIX_CACHE": cache}, STARTUP_S) as server:
            client, messages, turns = sdk(server), [], []
            for text in ("Tell me about rivers. " * 40, "And mountains?", "And the sea?"):
                messages.append({"role": "user", "content": text})
                reply = client.chat.completions.create(model="m", messages=messages,
                                                       max_tokens=12, temperature=0)
                turns.append(reply)
                messages.append({"role": "assistant", "content": reply.choices[0].message.content
                                 or ""})
            answers[cache] = [t.choices[0].message for t in turns]
            if cache == "1":
                for before, turn in zip(turns, turns[1:]):
                    cached = turn.usage.prompt_tokens_details.cached_tokens
                    # resumed where the messages ended: before the generation prompt
                    assert before.usage.prompt_tokens - 16 <= cached < turn.usage.prompt_tokens
    assert answers["1"] == answers["0"]


def test_echo_with_logprobs_scores_the_prompt_as_llama_cpp_does(real, tokenizer) -> None:
    """lm-eval's log-likelihood call: echo + logprobs + max_tokens 0 returns every prompt token's
    logprob (the first null), as llama.cpp's own logits of the same file give them (its int8
    activations differ from ours by ≤ 0.09 a logit), and the prompt is not cached for it."""
    import numpy as np

    prompt = [int(t) for t in GOLDENS["prompt_long"]]
    native = np.load(FIXTURES / "qwen3.goldens.npz")["lc_Q8_0_logits_long"].astype(np.float64)
    expected = native - np.logaddexp.reduce(native, axis=1, keepdims=True)
    sdk(real).completions.create(model="m", prompt=prompt, max_tokens=2, temperature=0)
    scored = sdk(real).completions.create(model="m", prompt=prompt, max_tokens=0, echo=True,
                                          logprobs=2, temperature=0)
    choice, lp = scored.choices[0], scored.choices[0].logprobs
    assert choice.text == tokenizer.decode(prompt) and choice.finish_reason == "length"
    assert len(lp.tokens) == len(prompt) and lp.token_logprobs[0] is None
    assert lp.top_logprobs[0] is None and lp.text_offset[0] == 0
    want = expected[np.arange(len(prompt) - 1), prompt[1:]]
    assert np.abs(np.array(lp.token_logprobs[1:]) - want).max() < 0.2
    # top 2 and the token itself, keyed by text (tokens that print alike share a key)
    assert all(1 <= len(top) <= 3 for top in lp.top_logprobs[1:])
    assert scored.usage.completion_tokens == 0
    assert scored.usage.prompt_tokens_details.cached_tokens == 0
    more = sdk(real).completions.create(model="m", prompt=prompt, max_tokens=3, echo=True,
                                        logprobs=0, temperature=0)
    assert len(more.choices[0].logprobs.tokens) == len(prompt) + 3


def test_suffix_fills_in_the_middle(real, tokenizer) -> None:
    """OpenAI's `suffix`: the prompt is the prefix, and the model sees <|fim_prefix|> prefix
    <|fim_suffix|> suffix <|fim_middle|> (Qwen2.5-Coder's and llama.cpp infill's order): the
    same greedy text as that prompt sent as token ids; bad combinations are 400s."""
    def ids(text: str) -> list[int]:
        return tokenizer.encode(text, parse_special=False)

    special = {t: tokenizer.token_to_id[t] for t in ("<|fim_prefix|>", "<|fim_suffix|>",
                                                     "<|fim_middle|>")}
    explicit = [special["<|fim_prefix|>"], *ids("def area(r):\n    "),
                special["<|fim_suffix|>"], *ids("\n    return a"), special["<|fim_middle|>"]]
    filled = sdk(real).completions.create(model="m", prompt="def area(r):\n    ",
                                          suffix="\n    return a", max_tokens=8, temperature=0)
    direct = sdk(real).completions.create(model="m", prompt=explicit, max_tokens=8,
                                          temperature=0)
    assert filled.choices[0].text == direct.choices[0].text
    assert filled.usage.prompt_tokens == len(explicit)
    for body in ({"prompt": "x", "suffix": "y", "echo": True},
                 {"prompt": [1, 2], "suffix": "y"}):
        response = httpx.post(f"{real.url}/v1/completions", json={"max_tokens": 2, **body})
        assert_openai_error(response, 400)


def test_chat_sync_stream_async_and_raw_sse_agree(real) -> None:
    messages = [{"role": "user", "content": "Hello!"}]
    completion = sdk(real).chat.completions.create(model="m", messages=messages, max_tokens=8,
                                                   temperature=0)
    text = completion.choices[0].message.content
    count = httpx.post(f"{real.url}/v1/tokenize", json={"messages": messages}).json()["count"]
    assert completion.usage.prompt_tokens == count
    stream = sdk(real).chat.completions.create(model="m", messages=messages, max_tokens=8,
                                               temperature=0, stream=True,
                                               stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert chunks[-1].usage.completion_tokens == completion.usage.completion_tokens

    async def ask() -> str:
        async with openai.AsyncOpenAI(base_url=f"{real.url}/v1", api_key="x") as client:
            answer = await client.chat.completions.create(model="m", messages=messages,
                                                          max_tokens=8, temperature=0)
            return answer.choices[0].message.content

    assert asyncio.run(ask()) == text
    raw = httpx.post(f"{real.url}/v1/chat/completions", timeout=REQUEST_S,
                     json={"messages": messages, "max_tokens": 8, "temperature": 0,
                           "stream": True})
    events, done = sse_json(raw.text)
    assert done and "".join(e["choices"][0]["delta"].get("content", "") for e in events) == text


def test_32_concurrent_streams_equal_their_solo_output(real) -> None:
    prompts = [GOLDENS["prompt_long"][:12 + 9 * i] for i in range(8)]
    solo = [sdk(real).completions.create(model="m", prompt=p, max_tokens=8, temperature=0)
            .choices[0].text for p in prompts]
    steps = 'sparkinfer_engine_steps_total{kind="decode"}'
    before = {k: metric(real.url, k) for k in ("sparkinfer_requests_total", steps,
                                                'sparkinfer_tokens_total{kind="completion"}')}

    async def stream_all() -> list[tuple[str, int]]:
        async with openai.AsyncOpenAI(base_url=f"{real.url}/v1", api_key="x", max_retries=0,
                                      timeout=REQUEST_S) as client:
            async def one(prompt: list[int]) -> tuple[str, int]:
                stream = await client.completions.create(
                    model="m", prompt=prompt, max_tokens=8, temperature=0, stream=True,
                    stream_options={"include_usage": True})
                text, usage = "", None
                async for chunk in stream:
                    text += "".join(c.text for c in chunk.choices)
                    usage = chunk.usage or usage
                return text, usage.completion_tokens

            return await asyncio.gather(*[one(prompts[i % 8]) for i in range(32)])

    results = asyncio.run(stream_all())
    assert [text for text, _ in results] == [solo[i % 8] for i in range(32)]
    wait_until(lambda: kv_is_free(real.url), 10)
    assert metric(real.url, "sparkinfer_requests_total") - before["sparkinfer_requests_total"] \
        == 32
    assert metric(real.url, 'sparkinfer_tokens_total{kind="completion"}') - \
        before['sparkinfer_tokens_total{kind="completion"}'] == sum(n for _, n in results)
    assert metric(real.url, steps) - before[steps] >= 7  # 8 tokens: ≥ 7 decode steps
    assert 0 < metric(real.url, 'sparkinfer_engine_forward_seconds_total{kind="decode"}') <= \
        metric(real.url, 'sparkinfer_engine_step_seconds_total{kind="decode"}')


def test_disconnect_mid_stream_frees_kv(real) -> None:
    cancelled = 'sparkinfer_requests_by_outcome_total{outcome="cancelled"}'
    before = metric(real.url, cancelled)
    with httpx.stream("POST", f"{real.url}/v1/completions", timeout=REQUEST_S,
                      json={"prompt": GOLDENS["prompt_short"], "max_tokens": 1000,
                            "temperature": 0, "stream": True}) as response:
        lines = response.iter_lines()
        next(lines)
        assert not kv_is_free(real.url)
    wait_until(lambda: kv_is_free(real.url), 10)
    wait_until(lambda: metric(real.url, cancelled) == before + 1)


def test_sampling_settings_that_leave_no_token_are_a_400(real) -> None:
    # 1e-300 sends the prompt tokens' positive logits to +inf: nothing finite to sample
    response = httpx.post(f"{real.url}/v1/completions",
                          json={"prompt": "hello", "max_tokens": 4, "temperature": 0,
                                "repetition_penalty": 1e-300})
    assert "banned" in assert_openai_error(response, 400, "unsatisfiable_sampling")["message"]


def test_queue_full_and_timeout_with_the_real_engine() -> None:
    # greedy repeats one token, so it never reaches EOS; 4,000 tokens (all the tiny model's
    # context allows) took it ~6 s on CI's 2 cores but under 2.5 s on a 2-core AVX-512 host:
    # a 0.5 s deadline stays far below both, and above the first token's arrival
    long_stream = {"prompt": GOLDENS["prompt_short"], "max_tokens": 4000, "temperature": 0,
                   "stream": True}
    with start_real_server(SPARKINFER_MAX_QUEUE_DEPTH="1",
                           SPARKINFER_REQUEST_TIMEOUT_S="0.5") as server:
        with httpx.stream("POST", f"{server.url}/v1/completions", json=long_stream,
                          timeout=REQUEST_S) as response:
            lines = response.iter_lines()
            first = next(lines)
            overflow = httpx.post(f"{server.url}/v1/completions", json={"prompt": "x"})
            assert_openai_error(overflow, 429, "queue_full")
            events, _ = sse_json("\n".join([first, *lines]) + "\n\n")
        assert events[-1]["error"]["code"] == "request_timeout"  # in-band
        wait_until(lambda: kv_is_free(server.url), 10)
        assert_openai_error(httpx.post(f"{server.url}/v1/completions", timeout=REQUEST_S,
                                       json={**long_stream, "stream": False}), 504)
        wait_until(lambda: kv_is_free(server.url), 10)


def test_a_stream_cut_by_the_grace_period_gets_an_error_event_and_the_engine_stops_cleanly(
        ) -> None:
    with start_real_server(SPARKINFER_SHUTDOWN_GRACE_S="0.5") as server:
        with httpx.stream("POST", f"{server.url}/v1/completions", timeout=REQUEST_S,
                          json={"prompt": GOLDENS["prompt_short"], "max_tokens": 4000,
                                "temperature": 0, "stream": True}) as response:
            lines = response.iter_lines()
            first = next(lines)
            server.signal(signal.SIGTERM)
            events, done = sse_json("\n".join([first, *lines]) + "\n\n")
        assert not done and events[-1]["error"]["code"] == "server_shutting_down"
        assert server.wait(15) == 0  # no forced exit
        assert "Traceback" not in server.output()  # nor a forward pass cut by the exit


def test_sigterm_during_a_stream_finishes_it_then_exits(real) -> None:
    """Runs last: it shuts the module's server down."""
    with httpx.stream("POST", f"{real.url}/v1/completions", timeout=REQUEST_S,
                      json={"prompt": GOLDENS["prompt_short"], "max_tokens": 600,
                            "temperature": 0, "stream": True}) as response:
        lines = response.iter_lines()
        first = next(lines)
        real.signal(signal.SIGTERM)  # delivered asynchronously: wait until the server drains
        wait_until(lambda: httpx.get(f"{real.url}/health").status_code == 503, 10)
        refused = httpx.post(f"{real.url}/v1/completions", json={"prompt": "x"})
        assert_openai_error(refused, 503, "server_shutting_down")
        events, done = sse_json("\n".join([first, *lines]) + "\n\n")
    assert done and events[-1]["choices"][0]["finish_reason"] in ("length", "stop")
    assert real.wait(30) == 0
