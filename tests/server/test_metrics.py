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
