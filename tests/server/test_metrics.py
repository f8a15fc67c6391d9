"""The engine's step timings as Prometheus counters: what the overhead benchmark scrapes."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from sparkinfer_cli.engine.engine import EngineStats
from sparkinfer_cli.engine.step_timings import StepTimings
from sparkinfer_cli.server.metrics import ServerMetrics


def samples(metrics: ServerMetrics) -> dict[tuple[str, str], float]:
    text = metrics.render().decode()
    return {(s.name, s.labels.get("kind", "")): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_step_timings_are_exported_per_kind() -> None:
    timings = StepTimings()
    stats = EngineStats(0, 0, 10, 10, 0, True, timings)
    metrics = ServerMetrics(lambda: stats, lambda: True)
    assert samples(metrics)[("sparkinfer_engine_steps_total", "decode")] == 0
    timings.add("decode", 0.010, 0.009)
    timings.add("decode", 0.030, 0.027)
    timings.add("mixed", 0.5, 0.25)
    got = samples(metrics)
    assert got[("sparkinfer_engine_steps_total", "decode")] == 2
    assert got[("sparkinfer_engine_step_seconds_total", "decode")] == 0.040
    assert got[("sparkinfer_engine_forward_seconds_total", "decode")] == 0.036
    assert abs(got[("sparkinfer_engine_overhead_ratio", "decode")] - 0.1) < 1e-12
    assert got[("sparkinfer_engine_steps_total", "mixed")] == 1
    assert got[("sparkinfer_engine_overhead_ratio", "mixed")] == 0.5


def test_vllm_names_carry_the_engine_state_and_the_request_figures() -> None:
    """vLLM's series (what its dashboard and the Kubernetes endpoint picker read), labelled with
    the model id: live gauges from the engine's stats, counters and histograms from the hooks."""
    from types import SimpleNamespace

    from sparkinfer_cli.engine.kv_cache import PrefixCacheStats

    stats = EngineStats(3, 5, 25, 100, 0, True, StepTimings(),
                        PrefixCacheStats(400, 96, 7, 0, 0))
    metrics = ServerMetrics(lambda: stats, lambda: True, "qwen3-tiny")
    metrics.count_tokens(120, 30)
    metrics.observe_inter_token(0.04, 2)
    for reason, t in (("stop", 1.0), ("length", 2.0), ("error", 3.0)):
        metrics.observe_finished(SimpleNamespace(submitted_at=0.0, scheduled_at=0.1,
                                                 first_token_at=0.5, finished_at=t,
                                                 finish_reason=reason))
    text = metrics.render().decode()
    got = {(s.name, s.labels.get("finished_reason", "")): (s.value, s.labels)
           for family in text_string_to_metric_families(text) for s in family.samples
           if s.name.startswith("vllm:")}
    assert {labels["model_name"] for _, labels in got.values()} == {"qwen3-tiny"}
    value = {key: v for key, (v, _) in got.items()}
    assert value[("vllm:num_requests_running", "")] == 3
    assert value[("vllm:num_requests_waiting", "")] == 5
    assert value[("vllm:kv_cache_usage_perc", "")] == 0.75
    assert value[("vllm:prefix_cache_queries_total", "")] == 400
    assert value[("vllm:prefix_cache_hits_total", "")] == 96
    assert value[("vllm:prompt_tokens_total", "")] == 120
    assert value[("vllm:generation_tokens_total", "")] == 30
    assert value[("vllm:request_success_total", "stop")] == 1
    assert value[("vllm:request_success_total", "length")] == 1
    assert ("vllm:request_success_total", "error") not in value  # a failure is no success
    assert value[("vllm:time_to_first_token_seconds_count", "")] == 3
    assert value[("vllm:inter_token_latency_seconds_count", "")] == 2
    assert value[("vllm:e2e_request_latency_seconds_sum", "")] == 6.0


def test_speculation_counters_in_both_names_only_where_the_engine_drafts() -> None:
    from sparkinfer_cli.engine.speculative import SpeculationStats

    spec = SpeculationStats()
    for drafted, kept in ((4, 4), (4, 1), (2, 0)):
        spec.record(drafted, kept)
    drafting = EngineStats(1, 0, 10, 10, 0, True, StepTimings(), speculation=spec)
    got = samples(ServerMetrics(lambda: drafting, lambda: True))
    assert got[("sparkinfer_spec_decode_drafts_total", "")] == 3
    assert got[("sparkinfer_spec_decode_draft_tokens_total", "")] == 10
    assert got[("sparkinfer_spec_decode_accepted_tokens_total", "")] == 5
    assert got[("sparkinfer_spec_decode_acceptance_rate", "")] == 0.5
    assert got[("sparkinfer_spec_decode_mean_accepted_length", "")] == 1 + 5 / 3
    assert got[("vllm:spec_decode_num_drafts_total", "")] == 3
    assert got[("vllm:spec_decode_num_draft_tokens_total", "")] == 10
    assert got[("vllm:spec_decode_num_accepted_tokens_total", "")] == 5
    plain = EngineStats(1, 0, 10, 10, 0, True, StepTimings())
    assert not [name for name, _ in samples(ServerMetrics(lambda: plain, lambda: True))
                if "spec_decode" in name]
