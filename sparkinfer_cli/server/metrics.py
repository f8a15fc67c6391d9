"""Prometheus metrics: request outcomes, token totals, live engine gauges and latency histograms.

Each app owns its own CollectorRegistry, so several servers in one process (tests) do not collide.
Names follow sparkinfer-server's counters and vLLM's histogram suffixes so existing dashboards fit.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from sparkinfer_cli.server.vllm_metrics import VllmMetrics

OUTCOMES = ("ok", "client_error", "overloaded", "timeout", "cancelled", "server_error")
PREFIX = "sparkinfer"
CONTENT_TYPE = CONTENT_TYPE_LATEST

# seconds; 1 ms .. ~40 min, dense where interactive latencies live
_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                    5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1,
                0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)


def outcome_of_status(status: int) -> str:
    if status < 400:
        return "ok"
    if status in (429, 503):
        return "overloaded"
    if status == 504:
        return "timeout"
    return "client_error" if status < 500 else "server_error"


def _read_stat(stats: Callable[[], Any], read: Callable[[Any], float]) -> float:
    return float(read(stats()))


class StepTimingsCollector(Collector):
    """The engine thread's cumulative step and model.forward time per step kind, read at scrape
    time: the engine's own overhead over a window is 1 − Δforward / Δstep."""

    def __init__(self, stats: Callable[[], Any]):
        self._stats = stats

    def collect(self) -> Any:
        timings = self._stats().step_timings
        steps = CounterMetricFamily(f"{PREFIX}_engine_steps", "engine steps run", labels=["kind"])
        step_s = CounterMetricFamily(f"{PREFIX}_engine_step_seconds",
                                     "engine-thread time in steps", labels=["kind"])
        forward_s = CounterMetricFamily(f"{PREFIX}_engine_forward_seconds",
                                        "model.forward time in steps", labels=["kind"])
        overhead = GaugeMetricFamily(f"{PREFIX}_engine_overhead_ratio",
                                     "share of step time outside model.forward", labels=["kind"])
        for kind in timings.steps:
            steps.add_metric([kind], timings.steps[kind])
            step_s.add_metric([kind], timings.step_s[kind])
            forward_s.add_metric([kind], timings.forward_s[kind])
            overhead.add_metric([kind], timings.overhead_fraction(kind))
        return [steps, step_s, forward_s, overhead]


class PrefixCacheCollector(Collector):
    """Prefix-cache lookups and hits in prompt tokens (vLLM's names: vllm_metrics.py), plus what
    the cache holds."""

    def __init__(self, stats: Callable[[], Any]):
        self._stats = stats

    def collect(self) -> Any:
        cache = self._stats().prefix_cache
        queried, hit = (cache.queried_tokens, cache.hit_tokens) if cache else (0, 0)
        families: list[CounterMetricFamily | GaugeMetricFamily] = [
            CounterMetricFamily(f"{PREFIX}_prefix_cache_queries",
                                "prompt tokens looked up in the prefix cache", value=queried),
            CounterMetricFamily(f"{PREFIX}_prefix_cache_hits",
                                "prompt tokens found in the prefix cache", value=hit)]
        families.append(GaugeMetricFamily(
            f"{PREFIX}_prefix_cache_blocks", "unreferenced KV blocks kept for their content",
            value=cache.cached_blocks if cache else 0))
        families.append(GaugeMetricFamily(
            f"{PREFIX}_prefix_cache_snapshots", "recurrent-state snapshots held (hybrid models)",
            value=cache.snapshots if cache else 0))
        return families


class SpeculationCollector(Collector):
    """Speculative decoding's drafts: checks that carried drafts, tokens drafted and kept (vLLM's
    spec_decode counters: vllm_metrics.py), and their ratios; nothing when the engine drafts
    none."""

    def __init__(self, stats: Callable[[], Any]):
        self._stats = stats

    def collect(self) -> Any:
        spec = self._stats().speculation
        if spec is None:
            return []
        return [
            CounterMetricFamily(f"{PREFIX}_spec_decode_drafts", "decode checks that carried drafts",
                                value=spec.num_drafts),
            CounterMetricFamily(f"{PREFIX}_spec_decode_draft_tokens", "tokens drafted",
                                value=spec.num_draft_tokens),
            CounterMetricFamily(f"{PREFIX}_spec_decode_accepted_tokens",
                                "drafted tokens the checks kept", value=spec.num_accepted_tokens),
            GaugeMetricFamily(f"{PREFIX}_spec_decode_acceptance_rate",
                              "share of drafted tokens kept, over the engine's life",
                              value=spec.acceptance_rate),
            GaugeMetricFamily(f"{PREFIX}_spec_decode_mean_accepted_length",
                              "tokens a check gives on average (kept drafts + 1)",
                              value=spec.mean_accepted_length)]


class ServerMetrics:
    def __init__(self, stats: Callable[[], Any], is_accepting: Callable[[], bool],
                 model_name: str = "sparkinfer"):
        """stats() returns the engine's EngineStats; both are read at scrape time. model_name:
        the label of the vLLM-named series."""
        disable_created_metrics()  # the *_created samples only double the exposition's size
        self.registry = CollectorRegistry()
        self._started = time.monotonic()
        self._create_counters()
        self._create_histograms()
        self._create_gauges(stats, is_accepting)
        self.vllm = VllmMetrics(self.registry, stats, model_name, _LATENCY_BUCKETS, _ITL_BUCKETS)

    def _create_counters(self) -> None:
        r = self.registry
        self.requests = Counter(f"{PREFIX}_requests", "generation requests received", registry=r)
        self.streaming = Counter(f"{PREFIX}_requests_streaming", "streaming generation requests",
                                 registry=r)
        self.by_outcome = Counter(f"{PREFIX}_requests_by_outcome", "generation requests by outcome",
                                  ["outcome"], registry=r)
        self.tokens = Counter(f"{PREFIX}_tokens", "tokens processed", ["kind"], registry=r)
        for outcome in OUTCOMES:
            self.by_outcome.labels(outcome)
        for kind in ("prompt", "completion"):
            self.tokens.labels(kind)

    def _create_histograms(self) -> None:
        r = self.registry
        self.ttft = Histogram(f"{PREFIX}_time_to_first_token_seconds",
                              "submission to first generated token", buckets=_LATENCY_BUCKETS,
                              registry=r)
        self.itl = Histogram(f"{PREFIX}_inter_token_latency_seconds",
                             "time between consecutive generated tokens", buckets=_ITL_BUCKETS,
                             registry=r)
        self.e2e = Histogram(f"{PREFIX}_e2e_request_latency_seconds",
                             "submission to finish of one engine request", buckets=_LATENCY_BUCKETS,
                             registry=r)
        self.queue_time = Histogram(f"{PREFIX}_request_queue_time_seconds",
                                    "submission to first scheduling", buckets=_LATENCY_BUCKETS,
                                    registry=r)

    def _create_gauges(self, stats: Callable[[], Any], is_accepting: Callable[[], bool]) -> None:
        live: dict[str, tuple[str, Callable[[Any], float]]] = {
            "active_requests": ("requests running in the engine", lambda s: s.active_requests),
            "queued_requests": ("requests waiting for admission", lambda s: s.queued_requests),
            "free_kv_blocks": ("free KV cache blocks", lambda s: s.free_kv_blocks),
            "total_kv_blocks": ("KV cache blocks in the pool", lambda s: s.total_kv_blocks),
            "kv_cache_usage_perc": ("fraction of KV blocks in use", lambda s: s.kv_cache_usage),
        }
        for name, (doc, read) in live.items():
            gauge = Gauge(f"{PREFIX}_{name}", doc, registry=self.registry)
            gauge.set_function(functools.partial(_read_stat, stats, read))
        Gauge(f"{PREFIX}_uptime_seconds", "seconds since the server started",
              registry=self.registry).set_function(lambda: time.monotonic() - self._started)
        Gauge(f"{PREFIX}_accepting_requests", "1 unless draining or stopped",
              registry=self.registry).set_function(lambda: float(is_accepting()))
        self.registry.register(StepTimingsCollector(stats))
        self.registry.register(PrefixCacheCollector(stats))
        self.registry.register(SpeculationCollector(stats))

    def count_request(self, outcome: str, *, streaming: bool) -> None:
        self.requests.inc()
        if streaming:
            self.streaming.inc()
        self.by_outcome.labels(outcome).inc()

    def count_tokens(self, prompt: int, completion: int) -> None:
        self.tokens.labels("prompt").inc(prompt)
        self.tokens.labels("completion").inc(completion)
        self.vllm.prompt_tokens.inc(prompt)
        self.vllm.generation_tokens.inc(completion)

    def observe_finished(self, event: Any) -> None:
        """Latency histograms from one finished engine request's timestamps (time.monotonic)."""
        for at, ours, vllms in ((event.scheduled_at, self.queue_time, self.vllm.queue_time),
                                (event.first_token_at, self.ttft, self.vllm.ttft),
                                (event.finished_at, self.e2e, self.vllm.e2e)):
            if at is not None:
                ours.observe(max(at - event.submitted_at, 0.0))
                vllms.observe(max(at - event.submitted_at, 0.0))
        self.vllm.count_finished(event.finish_reason)

    def observe_inter_token(self, gap_s: float, num_tokens: int) -> None:
        for _ in range(num_tokens):
            self.itl.observe(gap_s / num_tokens)
            self.vllm.itl.observe(gap_s / num_tokens)

    def render(self) -> bytes:
        return generate_latest(self.registry)
