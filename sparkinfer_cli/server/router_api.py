"""What request routers read from a replica beyond /health and the OpenAI routes.

vllm-router's power_of_two policy polls GET /get_load and compares its "load" field (added to the
router's own in-flight count, so it counts requests). smg (the successor of sglang-router) finds
out what a worker is from /v1/models, /server_info and /model_info (falling back to the /get_*
spellings), and its load-aware policies (power_of_two, cache_aware's balance check, least_load)
poll GET /v1/loads: one SGLang scheduler snapshot per data-parallel rank, of which token_usage
drives the choice. Both routers fan POST /flush_cache out to every worker, and both proxy
/health_generate, a health check that proves the engine still produces tokens.
"""

from __future__ import annotations

import asyncio
import uuid
from datetime import datetime, timezone
from typing import Any

from sanic import Request
from sanic.response import HTTPResponse, json

from sparkinfer_cli import __version__
from sparkinfer_cli.engine.config import EngineStoppedError, QueueFullError
from sparkinfer_cli.engine.engine import EngineStats, RequestEvent
from sparkinfer_cli.engine.sampling_params import SamplingParams
from sparkinfer_cli.server.async_engine import EngineClient
from sparkinfer_cli.server.routes import ServerState

HEALTH_GENERATE_TIMEOUT_S = 20.0  # SGLang's default for the same check
HEALTH_GENERATE_PARAMS = SamplingParams(max_tokens=1, temperature=0.0)
HEALTH_GENERATE_PROMPT = [0]  # any token id is a valid one-token prompt


def _state(request: Request) -> ServerState:
    return request.app.ctx.state


def scheduler_load(stats: EngineStats) -> dict[str, Any]:
    """The engine's load as one SGLang scheduler snapshot (smg's SchedulerLoadSnapshot). Token
    figures are KV-cache positions; cache_hit_rate is over the server's life, not a window."""
    used_blocks = stats.total_kv_blocks - stats.free_kv_blocks
    cache = stats.prefix_cache
    return {"dp_rank": 0,
            "num_running_reqs": stats.active_requests,
            "num_waiting_reqs": stats.queued_requests,
            "num_total_reqs": stats.active_requests + stats.queued_requests,
            "num_used_tokens": used_blocks * stats.block_size,
            "max_total_num_tokens": stats.total_kv_blocks * stats.block_size,
            "token_usage": stats.kv_cache_usage,
            "cache_hit_rate": cache.hit_tokens / cache.queried_tokens
            if cache is not None and cache.queried_tokens else 0.0,
            "max_running_requests": stats.max_num_seqs}


async def get_load(request: Request) -> HTTPResponse:
    """vllm-router's view: "load" is the requests the engine holds, running or waiting."""
    stats = _state(request).engine.engine.stats()
    return json({"load": stats.active_requests + stats.queued_requests,
                 **scheduler_load(stats)})


async def loads(request: Request) -> HTTPResponse:
    """smg's view (SGLang's /v1/loads): one rank; the include= sections beyond core are absent,
    which smg reads as not reported."""
    snapshot = scheduler_load(_state(request).engine.engine.stats())
    return json({"timestamp": datetime.now(timezone.utc).isoformat(), "dp_rank_count": 1,
                 "loads": [snapshot]})


async def model_info(request: Request) -> HTTPResponse:
    """SGLang's /model_info fields that hold for us. model_path is the served id: where the GGUF
    lies is the operator's business, and smg names the worker's model after it."""
    state = _state(request)
    return json({"model_path": state.config.model_name,
                 "served_model_name": state.config.model_name,
                 "is_generation": True, "has_image_understanding": False,
                 "has_audio_understanding": False, "context_length": state.max_context})


async def server_info(request: Request) -> HTTPResponse:
    """SGLang's /server_info fields smg reads (one replica: no tensor, pipeline or data
    parallelism, no prefill/decode split) and our limits."""
    state = _state(request)
    stats = state.engine.engine.stats()
    return json({"served_model_name": state.config.model_name, "version": __version__,
                 "context_length": state.max_context,
                 "max_output_tokens": state.config.max_output_tokens,
                 "max_total_num_tokens": stats.total_kv_blocks * stats.block_size,
                 "max_running_requests": stats.max_num_seqs,
                 "max_queue_depth": stats.max_queue_depth,
                 "tp_size": 1, "dp_size": 1, "pp_size": 1, "disaggregation_mode": "null",
                 "is_embedding": False})


async def flush_cache(request: Request) -> HTTPResponse:
    """Drops the prefix cache; blocks that requests in flight use stay until they finish."""
    state = _state(request)
    try:
        freed = await asyncio.wrap_future(state.engine.engine.flush_prefix_cache())
    except EngineStoppedError as exc:
        raise state.engine.unavailable(str(exc), "engine_stopped") from None
    return json({"status": "ok", "freed_kv_blocks": freed})


async def health_generate(request: Request) -> HTTPResponse:
    """200 once a one-token generation finishes, 503 if it fails or takes longer than
    HEALTH_GENERATE_TIMEOUT_S. It bypasses the request metrics: a probe is no traffic."""
    state = _state(request)
    if state.engine.is_draining:
        return json({"status": "draining"}, status=503)
    failure = await one_token_failure(state.engine.engine, HEALTH_GENERATE_TIMEOUT_S)
    if failure is not None:
        return json({"status": "unhealthy", "error": failure}, status=503)
    return json({"status": "ok"})


async def one_token_failure(engine: EngineClient, timeout_s: float) -> str | None:
    """Generates one greedy token; None when that worked, else why it did not."""
    loop = asyncio.get_running_loop()
    finished: asyncio.Future[RequestEvent] = loop.create_future()

    def on_event(event: RequestEvent) -> None:  # engine thread
        if event.finish_reason is not None:
            loop.call_soon_threadsafe(_settle, finished, event)

    request_id = f"health-generate-{uuid.uuid4().hex}"
    try:
        engine.submit(HEALTH_GENERATE_PROMPT, HEALTH_GENERATE_PARAMS, on_event,
                      request_id=request_id)
        event = await asyncio.wait_for(finished, timeout_s)
    except (QueueFullError, EngineStoppedError) as exc:
        return str(exc)
    except asyncio.TimeoutError:
        engine.abort(request_id)
        return f"no token within {timeout_s:g} s"
    if event.finish_reason not in ("stop", "length"):
        return f"the generation ended with {event.finish_reason}: {event.error}"
    return None


def _settle(future: asyncio.Future[RequestEvent], event: RequestEvent) -> None:
    if not future.done():  # a timed-out probe's future is cancelled; its abort event comes later
        future.set_result(event)
