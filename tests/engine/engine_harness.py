"""What engine tests share: an event collector, greedy params and a wait for an idle engine."""

from __future__ import annotations

import threading
import time
from collections import defaultdict

from fake_model import make_tokenizer

from sparkinfer_cli.engine.engine import ContinuousBatchEngine, RequestEvent
from sparkinfer_cli.engine.sampling_params import SamplingParams

WAIT_S = 20.0  # generous bound on the engine thread; the tests finish in milliseconds
TOKENIZER = make_tokenizer()


class Collector:
    """on_event sink: every event by request id, and a wait for final events."""

    def __init__(self):
        self.events: dict[str, list[RequestEvent]] = defaultdict(list)
        self._done = threading.Condition()

    def __call__(self, event: RequestEvent) -> None:
        with self._done:
            self.events[event.request_id].append(event)
            self._done.notify_all()

    def final(self, request_id: str) -> RequestEvent:
        with self._done:
            assert self._done.wait_for(lambda: self._is_done(request_id), WAIT_S), "no final event"
            return self.events[request_id][-1]

    def _is_done(self, request_id: str) -> bool:
        events = self.events.get(request_id)
        return bool(events) and events[-1].finish_reason is not None

    def tokens(self, request_id: str) -> list[int]:
        return [t for e in self.events[request_id] for t in e.token_ids]

    def text(self, request_id: str) -> str:
        return "".join(e.text for e in self.events[request_id])


def greedy(max_tokens: int, **kwargs) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kwargs)


def wait_idle(engine: ContinuousBatchEngine) -> None:
    deadline = time.monotonic() + WAIT_S
    while engine.stats().active_requests or engine.stats().queued_requests:
        assert time.monotonic() < deadline
        time.sleep(0.001)
