"""AsyncEngine: the bridge between the engine thread and the asyncio server.

It owns everything about a request's life that is not HTTP: admission (503 while draining, engine
errors → 429/400/503), one asyncio queue per HTTP request fed from the engine thread through a
LoopRelay, the request deadline (504), cancel-on-disconnect (abort on close) and the drain that
graceful shutdown waits for (queued requests 503 at once, running ones until the grace ends, then
503 too). Route handlers only iterate a `Generation`.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import Future
from typing import Any, Protocol

from sparkinfer_cli.engine.config import EngineStoppedError, QueueFullError, RequestTooLargeError
from sparkinfer_cli.engine.engine import EngineStats
from sparkinfer_cli.engine.request import RequestEvent
from sparkinfer_cli.engine.sampling_params import SamplingParams
from sparkinfer_cli.server.metrics import ServerMetrics
from sparkinfer_cli.server.protocol import ApiError

log = logging.getLogger(__name__)


class LoopRelay:
    """Runs engine-thread callbacks on the event loop, in order, with one wake-up per burst: the
    events of one engine step cost one call_soon_threadsafe (a self-pipe write), not one each."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self._lock = threading.Lock()
        self._pending: list[tuple[Callable[..., Any], tuple[Any, ...]]] = []

    def call(self, fn: Callable[..., Any], *args: Any) -> None:
        """Queues fn(*args) for the loop (any thread); RuntimeError if the loop is closed."""
        with self._lock:
            self._pending.append((fn, args))
            if len(self._pending) > 1:
                return  # NOTE: pending is non-empty exactly while a drain is scheduled
        self.loop.call_soon_threadsafe(self._drain)

    def _drain(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
        for fn, args in pending:
            fn(*args)


class EngineClient(Protocol):
    """What the server asks of an engine (ContinuousBatchEngine; the tests' FakeEngine)."""

    @property
    def keeps_state_snapshots(self) -> bool: ...
    @property
    def max_context(self) -> int: ...
    def submit(self, prompt_ids: list[int], params: SamplingParams,
               on_event: Callable[[RequestEvent], None], *,
               request_id: str | None = None) -> str: ...
    def check_grammar(self, grammar: str) -> str: ...
    def abort(self, request_id: str) -> None: ...
    def abort_waiting(self) -> None: ...
    def stats(self) -> EngineStats: ...
    def flush_prefix_cache(self) -> Future[int]: ...


class AsyncEngine:
    def __init__(self, engine: EngineClient, *, metrics: ServerMetrics | None = None,
                 request_timeout_s: float = 0.0, retry_after_s: int = 1):
        self.engine = engine
        self.metrics = metrics
        self.request_timeout_s = request_timeout_s
        self.retry_after_s = retry_after_s
        self.is_draining = False
        self._in_flight: set[Generation] = set()
        self._idle = asyncio.Event()
        self._idle.set()
        self._relay: LoopRelay | None = None

    def relay(self) -> LoopRelay:
        """The LoopRelay of the running event loop."""
        loop = asyncio.get_running_loop()
        if self._relay is None or self._relay.loop is not loop:
            self._relay = LoopRelay(loop)
        return self._relay

    @property
    def num_in_flight(self) -> int:
        return len(self._in_flight)

    @property
    def is_accepting(self) -> bool:
        return not self.is_draining and self.engine.stats().accepting_requests

    def unavailable(self, message: str, code: str) -> ApiError:
        return ApiError(503, message, type="service_unavailable_error", code=code,
                        headers={"Retry-After": str(self.retry_after_s)})

    def shutting_down(self, message: str) -> ApiError:
        """The 503 of a draining server: a router that sees it retries on another replica."""
        return self.unavailable(message, "server_shutting_down")

    def generate(self, choices: Sequence[tuple[list[int], SamplingParams]],
                 request_id: str) -> Generation:
        """Submit one engine request per (prompt ids, params) choice; raises ApiError if the
        engine refuses any (the ones already submitted are aborted)."""
        if self.is_draining:
            raise self.shutting_down("the server is shutting down and accepts no new requests")
        deadline = time.monotonic() + self.request_timeout_s if self.request_timeout_s else None
        generation = Generation(self, len(choices), deadline)
        for index, (prompt_ids, params) in enumerate(choices):
            choice_id = request_id if len(choices) == 1 else f"{request_id}-{index}"
            generation.submit(index, prompt_ids, params, choice_id)
        self._in_flight.add(generation)
        self._idle.clear()
        return generation

    def release(self, generation: Generation) -> None:
        self._in_flight.discard(generation)
        if not self._in_flight:
            self._idle.set()

    def begin_drain(self) -> None:
        """From now on new generation requests get 503, and so do those the engine has not
        started yet (their Generation sees "abort"); the running ones go on."""
        self.is_draining = True
        self.engine.abort_waiting()

    async def cut_in_flight(self, timeout_s: float) -> bool:
        """Ends every generation still in flight with a 503 (an SSE error event where a stream
        is under way); True once their handlers have all reported it, False after timeout_s."""
        for generation in list(self._in_flight):
            generation.interrupt(self.shutting_down("the server shut down before the request "
                                                    "finished"))
        return await self.wait_idle(timeout_s)

    async def wait_idle(self, timeout_s: float) -> bool:
        """True once no generation is in flight; False if timeout_s passed first."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except asyncio.TimeoutError:
            return False
        return True

    def submit_error(self, exc: Exception) -> ApiError:
        if isinstance(exc, QueueFullError):
            return ApiError(429, f"the server is overloaded: {exc}", type="rate_limit_error",
                            code="queue_full", headers={"Retry-After": str(self.retry_after_s)})
        if isinstance(exc, RequestTooLargeError):
            return ApiError(400, str(exc), param="messages", code="context_length_exceeded")
        if isinstance(exc, EngineStoppedError):
            return self.unavailable(str(exc), "engine_stopped")
        return ApiError(400, str(exc))  # the engine's ValueError for a request it cannot take


class Generation:
    """The engine requests of one HTTP request (one per choice), merged into one event stream.

    Iterate it for (choice_index, RequestEvent); `close()` (or leaving `async with`) aborts any
    choice still running, which is how a client disconnect frees KV.
    """

    def __init__(self, owner: AsyncEngine, num_choices: int, deadline: float | None):
        self._owner, self._engine = owner, owner.engine
        self._relay = owner.relay()
        self._queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
        self._deadline = deadline
        self._running: dict[int, str] = {}  # choice index → engine request id
        self._last_token_at: dict[int, float] = {}
        self.num_choices = num_choices
        self.is_closed = False

    def submit(self, index: int, prompt_ids: list[int], params: SamplingParams,
               request_id: str) -> None:
        def on_event(event: Any) -> None:  # engine thread
            try:
                self._relay.call(self._queue.put_nowait, (index, event))
            except RuntimeError:  # the loop is closed: nobody is listening any more
                pass

        try:
            self._running[index] = self._engine.submit(prompt_ids, params, on_event,
                                                       request_id=request_id)
        except Exception as exc:
            self.close()  # abort the choices already submitted
            if isinstance(exc, (QueueFullError, EngineStoppedError, ValueError)):
                raise self._owner.submit_error(exc) from None
            raise

    async def __aenter__(self) -> Generation:
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        self.close()

    async def __aiter__(self) -> AsyncIterator[tuple[int, Any]]:
        while self._running:
            index, event = await self._next()
            if isinstance(event, ApiError):  # interrupt(): `async with` closes it once reported
                raise event
            self._observe(index, event)
            if event.finish_reason is not None:
                del self._running[index]
                self._raise_if_failed(event)
            yield index, event
        self.close()

    async def _next(self) -> tuple[int, Any]:
        if self._deadline is None:
            return await self._queue.get()
        try:
            return await asyncio.wait_for(self._queue.get(), self._deadline - time.monotonic())
        except asyncio.TimeoutError:
            self.close()
            raise _timeout_error() from None

    def _raise_if_failed(self, event: Any) -> None:
        reason = event.finish_reason
        if reason in ("stop", "length"):
            return
        self.close()
        if reason == "timeout":
            raise _timeout_error()
        if reason == "abort" and self._owner.is_draining:  # AsyncEngine.begin_drain
            raise self._owner.shutting_down("the server is shutting down and did not start "
                                            "this request")
        if reason == "abort":
            raise self._owner.unavailable("the request was aborted by the server",
                                          "request_aborted")
        if reason == "rejected":
            raise ApiError(400, f"nothing can be sampled: {event.error}",
                           code="unsatisfiable_sampling")
        raise ApiError(500, f"generation failed: {event.error or reason}", type="server_error",
                       code="generation_failed")

    def interrupt(self, error: ApiError) -> None:
        """Iterating raises `error` after the events already received. The generation stays in
        flight until closed, so that AsyncEngine.wait_idle covers its handler reporting it."""
        self._queue.put_nowait((-1, error))

    def _observe(self, index: int, event: Any) -> None:
        metrics = self._owner.metrics
        if metrics is None:
            return
        now = time.monotonic()
        if event.token_ids and index in self._last_token_at:
            metrics.observe_inter_token(now - self._last_token_at[index], len(event.token_ids))
        if event.token_ids:
            self._last_token_at[index] = now
        if event.finish_reason in ("stop", "length"):
            metrics.observe_finished(event)

    def close(self) -> None:
        """Abort every choice still running (idempotent); frees their KV within one step."""
        running, self._running = self._running, {}
        for request_id in running.values():
            self._engine.abort(request_id)
        if not self.is_closed:
            self.is_closed = True
            self._owner.release(self)


def _timeout_error() -> ApiError:
    return ApiError(504, "the request exceeded SPARKINFER_REQUEST_TIMEOUT_S and was cancelled",
                    type="timeout_error", code="request_timeout")
