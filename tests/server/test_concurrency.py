"""32 concurrent streams through one server: outputs match solo runs, KV returns, metrics add up."""

from __future__ import annotations

import asyncio

import httpx
import openai
from test_admission import kv_is_free, metric, wait_until

NUM_STREAMS = 32


async def run_streams(base_url: str, prompts: list[str]) -> list[tuple[str, int, int]]:
    async with openai.AsyncOpenAI(base_url=base_url, api_key="x", max_retries=0) as client:
        async def one(prompt: str) -> tuple[str, int, int]:
            stream = await client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": prompt}], stream=True,
                temperature=0, stream_options={"include_usage": True})
            text, usage = "", None
            async for chunk in stream:
                text += "".join(c.delta.content or "" for c in chunk.choices)
                usage = chunk.usage or usage
            return text, usage.prompt_tokens, usage.completion_tokens

        return await asyncio.gather(*[one(p) for p in prompts])


def test_concurrent_streams_match_solo_and_metrics_add_up(make_server) -> None:
    srv = make_server(token_delay_s=0.002, ctx=32 * 1024)
    prompts = [f"question {i} " + "x" * (i * 7 % 23) for i in range(NUM_STREAMS)]
    solo = [asyncio.run(run_streams(srv.base_url, [p]))[0] for p in prompts[:4]]
    together = asyncio.run(run_streams(srv.base_url, prompts))
    assert together[:4] == solo
    assert [text for text, _, _ in together] == [f"You said: {p}" for p in prompts]
    wait_until(lambda: kv_is_free(srv.url))
    results = solo + together
    assert metric(srv.url, "sparkinfer_requests_total") == len(results)
    assert metric(srv.url, 'sparkinfer_requests_by_outcome_total{outcome="ok"}') == len(results)
    assert metric(srv.url, "sparkinfer_requests_streaming_total") == len(results)
    assert metric(srv.url, 'sparkinfer_tokens_total{kind="prompt"}') == sum(r[1] for r in results)
    assert metric(srv.url, 'sparkinfer_tokens_total{kind="completion"}') == \
        sum(r[2] for r in results)
    assert metric(srv.url, "sparkinfer_time_to_first_token_seconds_count") == len(results)
    assert metric(srv.url, "sparkinfer_e2e_request_latency_seconds_count") == len(results)
    assert metric(srv.url, "sparkinfer_inter_token_latency_seconds_count") == \
        sum(r[2] - 1 for r in results)
    assert metric(srv.url, "sparkinfer_free_kv_blocks") == metric(srv.url,
                                                                  "sparkinfer_total_kv_blocks")
    assert httpx.get(f"{srv.base_url}/capacity").json()["active_requests"] == 0
