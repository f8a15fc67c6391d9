"""vLLM's metric names beside ours, so that tools built for vLLM read a sparkinfer server unchanged:
its Grafana dashboard, the Kubernetes inference gateway's endpoint picker (which reads
num_requests_waiting and kv_cache_usage_perc) and routers that scrape vLLM replicas.

Every series carries vLLM's labels, model_name (the id /v1/models reports) and engine ("0": one
engine a process); the latency histograms use our buckets.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

VLLM = "vllm:"
LABELS = ("model_name", "engine")
SUCCESS_REASONS = ("stop", "length", "abort")  # vLLM's finished_reason values we produce


class _VllmEngineCollector(Collector):
    """The engine's live state, read at scrape time."""

    def __init__(self, stats: Callable[[], Any], labels: tuple[str, str]):
        self._stats, self._labels = stats, labels

    def collect(self) -> Any:
        s = self._stats()
        cache = s.prefix_cache
        families = [
            self._gauge("num_requests_running", "requests running in the engine",
                        s.active_requests),
            self._gauge("num_requests_waiting", "requests waiting for admission",
                        s.queued_requests),
            self._gauge("kv_cache_usage_perc", "fraction of KV blocks in use (1 = full)",
                        s.kv_cache_usage),
            self._counter("prefix_cache_queries", "prompt tokens looked up in the prefix cache",
                          cache.queried_tokens if cache else 0),
            self._counter("prefix_cache_hits", "prompt tokens found in the prefix cache",
                          cache.hit_tokens if cache else 0),
        ]
        spec = s.speculation
        if spec is not None:
            families += [
                self._counter("spec_decode_num_drafts", "decode checks that carried drafts",
                              spec.num_drafts),
                self._counter("spec_decode_num_draft_tokens", "tokens drafted",
                              spec.num_draft_tokens),
                self._counter("spec_decode_num_accepted_tokens", "drafted tokens kept",
                              spec.num_accepted_tokens)]
        info = GaugeMetricFamily(f"{VLLM}cache_config_info", "the KV cache's configuration",
                                 labels=[*LABELS, "num_gpu_blocks", "enable_prefix_caching"])
        info.add_metric([*self._labels, str(s.total_kv_blocks), str(cache is not None).lower()],
                        1.0)
        return [*families, info]

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        family = GaugeMetricFamily(VLLM + name, doc, labels=list(LABELS))
        family.add_metric(list(self._labels), value)
        return family

    def _counter(self, name: str, doc: str, value: float) -> CounterMetricFamily:
        family = CounterMetricFamily(VLLM + name, doc, labels=list(LABELS))
        family.add_metric(list(self._labels), value)
        return family


class VllmMetrics:
    """vLLM's request counters and latency histograms, fed by ServerMetrics's hooks."""

    def __init__(self, registry: CollectorRegistry, stats: Callable[[], Any], model_name: str,
                 latency_buckets: tuple[float, ...], itl_buckets: tuple[float, ...]):
        labels = (model_name, "0")
        registry.register(_VllmEngineCollector(stats, labels))

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Any:
            return Histogram(VLLM + name, doc, LABELS, buckets=buckets,
                             registry=registry).labels(*labels)

        self.prompt_tokens = Counter(f"{VLLM}prompt_tokens", "prompt tokens processed", LABELS,
                                     registry=registry).labels(*labels)
        self.generation_tokens = Counter(f"{VLLM}generation_tokens", "tokens generated", LABELS,
                                         registry=registry).labels(*labels)
        success = Counter(f"{VLLM}request_success", "requests that finished, by reason",
                          [*LABELS, "finished_reason"], registry=registry)
        self.success = {reason: success.labels(*labels, reason) for reason in SUCCESS_REASONS}
        self.ttft = histogram("time_to_first_token_seconds", "submission to first token",
                              latency_buckets)
        self.itl = histogram("inter_token_latency_seconds", "time between generated tokens",
                             itl_buckets)
        self.e2e = histogram("e2e_request_latency_seconds", "submission to finish",
                             latency_buckets)
        self.queue_time = histogram("request_queue_time_seconds", "submission to scheduling",
                                    latency_buckets)

    def count_finished(self, finish_reason: str | None) -> None:
        if finish_reason in self.success:
            self.success[finish_reason].inc()
