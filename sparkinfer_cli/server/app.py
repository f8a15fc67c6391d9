"""The Sanic app: factory, route table, error mapping, auth and CORS hooks, graceful shutdown,
run_server."""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from sanic import Request, Sanic
from sanic.exceptions import SanicException
from sanic.response import HTTPResponse, json

from sparkinfer_cli.engine.config import EngineConfig
from sparkinfer_cli.server import anthropic_api, responses_api, router_api, routes
from sparkinfer_cli.server.async_engine import AsyncEngine, EngineClient
from sparkinfer_cli.server.auth import check_request
from sparkinfer_cli.server.config import ServerConfig, Speculation, build_engine_config
from sparkinfer_cli.server.metrics import ServerMetrics
from sparkinfer_cli.server.protocol import ApiError
from sparkinfer_cli.server.responses import TokenTexts

log = logging.getLogger(__name__)

FORCE_EXIT_SLACK_S = 5.0  # after the grace period, app.stop() gets this long before os._exit
CUT_REPORT_S = 1.0  # after the grace period, how long the requests cut get to send their 503
REFUSED_BODY_DRAIN_BYTES = 64 * 1024 * 1024  # read past max_request_bytes to deliver the 413
_app_numbers = itertools.count()

ROUTES: tuple[tuple[Any, str, str], ...] = (
    (routes.health, "/health", "GET"),
    (routes.metrics, "/metrics", "GET"),
    (routes.models, "/v1/models", "GET"),
    (routes.model, "/v1/models/<model_id:path>", "GET"),
    (routes.info, "/v1/info", "GET"),
    (routes.capacity, "/v1/capacity", "GET"),
    (routes.tokenize, "/v1/tokenize", "POST"),
    (routes.detokenize, "/v1/detokenize", "POST"),
    (routes.chat_completions, "/v1/chat/completions", "POST"),
    (routes.completions, "/v1/completions", "POST"),
    (responses_api.responses, "/v1/responses", "POST"),
    (anthropic_api.messages, "/v1/messages", "POST"),
    (anthropic_api.count_tokens, "/v1/messages/count_tokens", "POST"),
    # for request routers (vllm-router, smg): SGLang's names, and their /get_* spellings
    (router_api.get_load, "/get_load", "GET"),
    (router_api.loads, "/v1/loads", "GET"),
    (router_api.model_info, "/model_info", "GET"),
    (router_api.model_info, "/get_model_info", "GET"),
    (router_api.server_info, "/server_info", "GET"),
    (router_api.server_info, "/get_server_info", "GET"),
    (router_api.flush_cache, "/flush_cache", "POST"),
    (router_api.health_generate, "/health_generate", "GET"),
)
V1 = "/v1"
# also served without /v1, for clients given a base URL without it (llama-server has these too)
UNPREFIXED_ALIASES = frozenset({"/v1/models", "/v1/chat/completions", "/v1/completions"})
CORS_METHODS = "GET, POST, OPTIONS"
CORS_DEFAULT_HEADERS = "Authorization, Content-Type"
CORS_PREFLIGHT_MAX_AGE_S = 600  # how long a browser may reuse a preflight's answer
_ERROR_CODES = {404: "unknown_url", 405: "method_not_allowed", 408: "request_timeout",
                413: "request_too_large", 503: "service_unavailable"}


def create_app(engine: EngineClient, tokenizer: Any, chat_template: Any,
               server_config: ServerConfig | None = None) -> Sanic:
    """An OpenAI-compatible app over a started engine (ContinuousBatchEngine, an EngineClient)."""
    config = server_config or ServerConfig()
    app = Sanic(f"sparkinfer_{next(_app_numbers)}", configure_logging=False)
    _configure_transport(app, config)
    async_engine = AsyncEngine(engine, request_timeout_s=config.request_timeout_s,
                               retry_after_s=config.retry_after_s)
    async_engine.metrics = ServerMetrics(engine.stats, lambda: async_engine.is_accepting,
                                         config.model_name)
    app.ctx.state = routes.ServerState(async_engine, tokenizer, chat_template, config,
                                       async_engine.metrics, int(time.time()),
                                       TokenTexts(tokenizer))
    for handler, uri, method in ROUTES:
        # every route streams: Sanic buffers no body; POST handlers read theirs themselves (the
        # read timeout and max_request_bytes: routes.read_body); routes are named by path, since
        # one handler may serve several
        app.add_route(handler, uri, methods=[method], stream=True, name=uri)
        if uri in UNPREFIXED_ALIASES:
            app.add_route(handler, uri.removeprefix(V1), methods=[method], stream=True,
                          name=uri.removeprefix(V1))
    app.error_handler.add(Exception, _error_response)
    if config.cors_origins:
        app.on_request(_answer_cors_preflight)  # first: a preflight carries no API key
        app.on_response(_add_cors_headers)
    app.on_request(_authenticate)
    return app


def _configure_transport(app: Sanic, config: ServerConfig) -> None:
    # NOTE: routes.read_body refuses a body over max_request_bytes (413); Sanic's limit is how
    # much more it then reads and drops, as closing with unread bytes resets the connection and a
    # client still sending the body never sees the 413
    app.config.REQUEST_MAX_SIZE = config.max_request_bytes + REFUSED_BODY_DRAIN_BYTES
    app.config.REQUEST_TIMEOUT = config.read_timeout_s  # Sanic resets it on every byte received
    # NOTE: Sanic's response timeout also runs while a non-streaming generation computes, so it is
    # off; stalled writes are bounded per send by write_timeout_s in routes._stream.
    app.config.RESPONSE_TIMEOUT = 10 * 365 * 24 * 3600
    app.config.GRACEFUL_SHUTDOWN_TIMEOUT = 1.0  # connections are drained before app.stop()
    app.config.NOISY_EXCEPTIONS = False
    app.config.MOTD = False
    app.config.ACCESS_LOG = False
    app.config.TOUCHUP = False  # TouchUp rewrites Sanic's class once: a second app would break


async def _authenticate(request: Request) -> None:
    check_request(_guarded_path(request.path), request.headers.get("authorization"),
                  request.app.ctx.state.config.api_key, request.headers.get("x-api-key"))


def _guarded_path(path: str) -> str:
    """An un-prefixed alias (with or without a trailing slash) is guarded as the /v1 route it
    stands for; any other path as itself."""
    v1_path = V1 + path
    return v1_path if v1_path.rstrip("/") in UNPREFIXED_ALIASES else path


def _cors_allowed_origin(request: Request) -> str | None:
    """Access-Control-Allow-Origin for this request: '*', its own Origin, or None when it has no
    Origin or one that --cors-origins does not list."""
    origin = request.headers.get("origin")
    allowed = request.app.ctx.state.config.cors_origins
    if origin is None:
        return None
    if "*" in allowed:
        return "*"
    return origin if origin.lower() in allowed else None


async def _answer_cors_preflight(request: Request) -> HTTPResponse | None:
    """A browser's OPTIONS preflight from an allowed origin gets 204 (its CORS headers come from
    _add_cors_headers); other OPTIONS requests go on to routing, which has no OPTIONS route."""
    is_preflight = request.method == "OPTIONS" and \
        "access-control-request-method" in request.headers
    if is_preflight and _cors_allowed_origin(request) is not None:
        return HTTPResponse(status=204,
                            headers={"Access-Control-Max-Age": str(CORS_PREFLIGHT_MAX_AGE_S)})
    return None


async def _add_cors_headers(request: Request, response: HTTPResponse) -> None:
    """CORS headers on every response to an allowed origin, errors and streams included, so that
    the page can read a 401 or a 400 too."""
    allowed = _cors_allowed_origin(request)
    if allowed is None:
        return
    response.headers["Access-Control-Allow-Origin"] = allowed
    response.headers["Access-Control-Allow-Methods"] = CORS_METHODS
    # echoed: a '*' here would not cover Authorization, and SDKs add headers of their own
    response.headers["Access-Control-Allow-Headers"] = request.headers.get(
        "access-control-request-headers", CORS_DEFAULT_HEADERS)
    if allowed != "*":
        response.headers["Vary"] = "Origin"  # caches must not serve it to another origin


def _error_response(request: Request, exc: Exception) -> HTTPResponse:
    error = _as_api_error(exc)
    body = anthropic_api.error_body(error) if anthropic_api.is_messages_path(request.path) \
        else error.body()
    return json(body, status=error.status, headers=error.headers)


def _as_api_error(exc: Exception) -> ApiError:
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, SanicException):
        status = int(exc.status_code)
        kind = "server_error" if status >= 500 else "invalid_request_error"
        return ApiError(status, str(exc) or "request failed", type=kind,
                        code=_ERROR_CODES.get(status), headers=getattr(exc, "headers", None))
    log.error("unhandled error", exc_info=exc)
    return ApiError(500, f"internal server error: {type(exc).__name__}", type="server_error",
                    code="internal_error")


# ---------------------------------------------------------------- running and stopping


def serve(app: Sanic, config: ServerConfig) -> None:
    """Serve until SIGTERM/SIGINT, then drain: new generation requests and those not started yet
    get 503 with Retry-After (a router retries them elsewhere), running ones finish, the process
    exits; those still running after shutdown_grace_s end with a 503 (an SSE error event on a
    stream). A second signal exits now."""
    app.register_listener(_install_signal_handlers, "after_server_start")
    app.run(host=config.host, port=config.port, single_process=True, access_log=False,
            motd=False, register_sys_signals=False)


async def _install_signal_handlers(app: Sanic) -> None:
    loop = asyncio.get_running_loop()
    log.info("serving %s on http://%s:%s", app.ctx.state.config.model_name,
                app.ctx.state.config.host, app.ctx.state.config.port)
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, lambda: asyncio.ensure_future(_drain_and_stop(app)))


async def _drain_and_stop(app: Sanic) -> None:
    state: routes.ServerState = app.ctx.state
    if state.engine.is_draining:
        log.warning("second shutdown signal: exiting now")
        os._exit(1)
    grace = state.config.shutdown_grace_s
    log.info("shutdown signal: draining %d in-flight requests (grace %g s); those not started "
             "get 503", state.engine.num_in_flight, grace)
    state.engine.begin_drain()
    timer = threading.Timer(grace + FORCE_EXIT_SLACK_S, os._exit, args=(1,))
    timer.daemon = True
    timer.start()
    if not await state.engine.wait_idle(grace):
        log.warning("grace period over with %d requests in flight; ending them with 503",
                    state.engine.num_in_flight)
        await state.engine.cut_in_flight(CUT_REPORT_S)
    app.stop()


def run_server(model_path: str | Path, host: str | None = None, port: int | None = None,
               ctx: int | None = None, api_key: str | None = None, *, device: str = "cpu",
               model_name: str | None = None, cors_origins: tuple[str, ...] | None = None,
               environ: Mapping[str, str] | None = None, speculation: Speculation | None = None,
               on_listening: Callable[[ServerConfig, EngineConfig], None] | None = None) -> None:
    """`sparkinfer serve`: load the model, start the engine, serve until SIGTERM/SIGINT.
    Arguments left None come from the environment (HOST, PORT, CTX, SPARKINFER_*); the model id
    is model_name, else SPARKINFER_SERVED_MODEL_NAME, else the GGUF's name; speculation (the
    flags: n-gram drafts or a draft model's file), else SPARKINFER_SPEC_TOKENS' n-gram drafts.
    `on_listening` (the CLI's banner) is called once the port accepts connections."""
    from sparkinfer_cli.engine.engine import ContinuousBatchEngine, warm_up
    from sparkinfer_cli.gguf.reader import GGUFFile
    from sparkinfer_cli.model.loader import load_draft_model, load_runtime_model
    from sparkinfer_cli.tokenizer.chat_template import ChatTemplate
    from sparkinfer_cli.tokenizer.vocab_override import load_tokenizer

    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    gguf = GGUFFile(model_path)
    # before the weights load, so that a bad setting fails at once
    server_config = ServerConfig.from_env(environ, host=host, port=port, api_key=api_key,
                                          model_name=model_name, cors_origins=cors_origins,
                                          fallback_model_name=default_model_name(gguf))
    use_mtp = speculation is not None and speculation.mtp
    other_file = None if speculation is None else speculation.draft_model  # a head's, with mtp
    model = load_runtime_model(gguf, device, environ, with_mtp=use_mtp,
                               mtp_file=other_file if use_mtp else None)
    draft = None if use_mtp or other_file is None else \
        load_draft_model(other_file, gguf, device, environ)
    tokenizer = load_tokenizer(gguf, environ)
    spec_tokens = {} if speculation is None else {"spec_tokens": speculation.tokens}
    engine_config = build_engine_config(ctx, model.config.context_length, environ, device=device,
                                        **spec_tokens)
    engine = ContinuousBatchEngine(model, tokenizer, engine_config, draft, use_mtp)
    engine.start()
    if not warm_up(engine):
        log.warning("the warm-up request did not finish in time")
    app = create_app(engine, tokenizer, ChatTemplate.from_tokenizer(tokenizer), server_config)
    if on_listening is not None:
        async def listening(_: Sanic) -> None:
            on_listening(server_config, engine_config)
        app.register_listener(listening, "after_server_start")
    try:
        serve(app, server_config)
    finally:
        # NOTE: the drain ended every request, so the engine thread stops within a step; exiting
        # under it would interrupt a forward pass
        engine.shutdown(wait=True)


def default_model_name(gguf: Any) -> str:
    """general.name, lowercased and dashed ("Qwen3.6-35B-A3B" → "qwen3.6-35b-a3b"); else the
    file's stem."""
    name = gguf.metadata.get("general.name") or Path(gguf.path).stem
    return "-".join(str(name).lower().split())
