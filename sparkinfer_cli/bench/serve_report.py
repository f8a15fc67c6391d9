"""The figures of `sparkinfer bench --serve` and what it writes: the client-side timings of each
load folded into percentiles, then <date>-<model>-<device>-serve.json (kind "serve") and .md."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from sparkinfer_cli.bench.report import free_stem, result_stem
from sparkinfer_cli.bench.serve_client import RequestTiming
from sparkinfer_cli.engine.speculative import SpeculationStats


def percentile(values: list[float], q: float) -> float | None:
    """Linear interpolation between the closest ranks (numpy's default); None for no values."""
    return float(np.percentile(values, q)) if values else None


def _ms(seconds: list[float]) -> list[float]:
    return [1000 * s for s in seconds]


@dataclass(frozen=True)
class RunFigures:
    """One load's figures; times in ms, rates in tokens/s, None where nothing was measured."""

    load: str  # "8 clients × 2" (requests each) or "Poisson 4/s for 60 s"
    clients: int | None  # clients sent together; None for Poisson arrivals
    rate: float | None  # Poisson arrivals a second
    num_requests: int
    num_failed: int
    num_stopped_early: int  # finished before max_tokens (the server did not honour ignore_eos)
    output_tokens: int  # sum of the usage blocks' completion_tokens
    span_s: float  # first request sent → last one done
    output_tok_s: float
    mean_in_flight: float  # Little's law: request-seconds over the span
    ttft_ms: dict[str, float | None]  # p50, p99: request sent → first chunk with token text
    itl_ms: dict[str, float | None]  # p50, p99: gaps between a request's token chunks
    stream_tok_s: dict[str, float | None]  # p50, min over requests (RequestTiming.stream_tok_s)
    e2e_ms: dict[str, float | None]  # p50: request sent → [DONE]
    server_ttft_ms: dict[str, float | None]  # p50 of the usage blocks' ttft_ms, where sent
    first_error: str | None = None
    # the server's speculation counters over the load (its warm-up round included); None: off
    drafts: SpeculationStats | None = None
    engine_tok_s: float | None = None  # bench.measure's decode throughput, same concurrency
    engine_concurrency: int | None = None
    engine_max_tokens: int | None = None

    @property
    def engine_ratio(self) -> float | None:
        return self.output_tok_s / self.engine_tok_s if self.engine_tok_s else None


def summarize(timings: list[RequestTiming], max_tokens: int, load: str, clients: int | None,
              rate: float | None) -> RunFigures:
    done = [t for t in timings if t.error is None and t.token_times]
    failed = [t for t in timings if t not in done]
    span = max(t.ended_at for t in timings) - min(t.sent_at for t in timings)
    output_tokens = sum(t.output_tokens for t in done)
    streams = [r for t in done if (r := t.stream_tok_s) is not None]
    server_ttft = [t.server_ttft_ms for t in done if t.server_ttft_ms is not None]
    ttft = _ms([t.ttft_s for t in done])
    itl = _ms([gap for t in done for gap in t.itl_s])
    return RunFigures(
        load, clients, rate, len(timings), len(failed),
        sum(t.output_tokens < max_tokens for t in done), output_tokens, span,
        output_tokens / span if span > 0 else 0.0, sum(t.e2e_s for t in timings) / span,
        {"p50": percentile(ttft, 50), "p99": percentile(ttft, 99)},
        {"p50": percentile(itl, 50), "p99": percentile(itl, 99)},
        {"p50": percentile(streams, 50), "min": min(streams, default=None)},
        {"p50": percentile(_ms([t.e2e_s for t in done]), 50)},
        {"p50": percentile(server_ttft, 50)},
        failed[0].error if failed else None)


def single_request(timing: RequestTiming) -> dict[str, Any]:
    """One request's figures (the cold first request)."""
    ok = timing.error is None and bool(timing.token_times)
    return {"ttft_ms": 1000 * timing.ttft_s if ok else None, "e2e_ms": 1000 * timing.e2e_s,
            "output_tokens": timing.output_tokens, "server_ttft_ms": timing.server_ttft_ms,
            "error": timing.error}


@dataclass
class ServeReport:
    model: str  # label: demo name, synthetic preset, file stem (or the remote server's model id)
    model_file: str | None
    device_kind: str
    machine: str
    commit: str
    date: str  # ISO 8601, local time
    command: str
    server: dict[str, Any]  # url, started (by the bench), ctx, startup_s
    parameters: dict[str, Any]
    cold: dict[str, Any]  # the first request after /health said ready
    warm_idle: dict[str, Any]  # TTFT of short prompts sent one at a time to an idle server
    runs: list[RunFigures] = field(default_factory=list)
    load_average: dict[str, list[float]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    @property
    def stem(self) -> str:
        return result_stem(self.date, self.model, self.device_kind) + "-serve"


def write_serve_report(report: ServeReport, out_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = free_stem(out_dir, report.stem, report.date)
    md, js = out_dir / f"{stem}.md", out_dir / f"{stem}.json"
    js.write_text(json.dumps(report_json(report), indent=2) + "\n")
    md.write_text(report_markdown(report))
    return [md, js]


def report_json(report: ServeReport) -> dict[str, Any]:
    fields = {f.name: getattr(report, f.name) for f in dataclasses.fields(report)}
    runs = [dataclasses.asdict(r) | {"engine_ratio": r.engine_ratio} for r in report.runs]
    return {"kind": "serve", **fields, "runs": runs}


# ---- tables --------------------------------------------------------------------------------------
TABLE_HEADER = ("load", "requests", "output tok/s", "engine tok/s", "ratio", "TTFT p50/p99 ms",
                "ITL p50/p99 ms", "stream tok/s p50/min", "E2E p50 s", "in flight",
                "failed/short")


def _num(value: float | None, digits: int = 1) -> str:
    return "—" if value is None else f"{value:,.{digits}f}"


def _pair(figure: dict[str, float | None], first: str, second: str) -> str:
    return f"{_num(figure[first])}/{_num(figure[second])}"


def table_cells(report: ServeReport) -> list[tuple[str, ...]]:
    """One row of TABLE_HEADER cells per load (the markdown and the console show the same)."""
    rows = []
    for r in report.runs:
        engine = _num(r.engine_tok_s)
        if r.clients is None and r.engine_tok_s is not None:
            engine += f" (at {r.engine_concurrency})"
        e2e_s = None if r.e2e_ms["p50"] is None else r.e2e_ms["p50"] / 1000
        rows.append((r.load, str(r.num_requests), _num(r.output_tok_s), engine,
                     _num(r.engine_ratio, 2), _pair(r.ttft_ms, "p50", "p99"),
                     _pair(r.itl_ms, "p50", "p99"), _pair(r.stream_tok_s, "p50", "min"),
                     _num(e2e_s, 2), _num(r.mean_in_flight),
                     f"{r.num_failed} / {r.num_stopped_early}"))
    return rows


def idle_lines(report: ServeReport) -> list[str]:
    """The cold first request and the warm idle TTFT, a line each."""
    cold, idle = report.cold, report.warm_idle
    return [f"cold TTFT (the first request after /health said ready, "
            f"{report.parameters['prompt_tokens']}-token prompt): {_num(cold['ttft_ms'])} ms",
            f"warm idle TTFT ({idle['prompt_tokens']}-token prompt, p50 of "
            f"{len(idle['ttft_ms'])} sent one at a time): {_num(idle['ttft_ms_p50'])} ms"]


# ---- markdown ------------------------------------------------------------------------------------
def report_markdown(report: ServeReport) -> str:
    align = ["---" if name == "load" else "---:" for name in TABLE_HEADER]
    table = ["| " + " | ".join(row) + " |" for row in [TABLE_HEADER, align, *table_cells(report)]]
    lines = [f"# sparkinfer bench --serve: {report.model} on {report.device_kind}", "",
             *_header_lines(report), "", *table, "", *(f"- {line}" for line in idle_lines(report)),
             "", METHOD]
    if report.notes:
        lines += ["", "Notes:", *(f"- {note}" for note in report.notes)]
    return "\n".join(lines) + "\n"


def _header_lines(report: ServeReport) -> list[str]:
    p, server = report.parameters, report.server
    started = f"started by the bench (`--ctx {server['ctx']}`, ready after " \
              f"{server['startup_s']:.0f} s)" if server["started"] else "already running"
    return [f"- date: {report.date}; commit `{report.commit}`",
            f"- command: `{report.command}`",
            f"- model: {report.model} (`{report.model_file}`); machine: {report.machine}",
            f"- server: {server['url']}, {started}",
            f"- requests: {p['prompt_tokens']}-token prompts, {p['max_tokens']} tokens out, "
            f"greedy, ignore_eos{_json_note(p)}; clients sent together: a warm-up round, then "
            f"{p['requests_per_client']} requests each in a row" + (
                "; Poisson arrivals: after a warm-up round of as many requests as arrive in a "
                "second" if p["rate"] else ""),
            f"- load average (1/5/15 min) before: {_loads(report, 'before')}, after: "
            f"{_loads(report, 'after')} (the client threads share the machine with the server)"]


def _json_note(parameters: dict) -> str:
    """What --json added (reports written before it have no such field)."""
    return "; loads marked JSON schema: every request asks for a JSON answer (response_format " \
        "json_schema)" if parameters["request"].get("response_format") else ""


def _loads(report: ServeReport, when: str) -> str:
    return " / ".join(f"{v:.2f}" for v in report.load_average.get(when, []))


METHOD = (
    "Method: streaming `/v1/completions` from one thread per request (http.client, standard "
    "library), prompts of exactly the given token ids (windows of one pool of text tokens from "
    "`/v1/tokenize`, different for every request). TTFT: request sent → first SSE chunk with "
    "token text; ITL: gaps between a request's chunks with token text, over all requests; stream "
    "tok/s: a request's tokens after the first over its first → last token chunk; output tokens "
    "from the final usage block. output tok/s: all output tokens over first request sent → last "
    "one done, so it includes prefill and the ramp. engine tok/s: bench.measure's throughput "
    "figure (the same model and device, the same concurrency and lengths, no HTTP) in its own "
    "process: output tokens/s while all sequences decode together; ratio = output / engine. "
    "Poisson loads set the engine figure at their mean number of requests in flight; below "
    "saturation their output tok/s is the offered rate × max_tokens, not a capacity. short: "
    "requests that ended before max_tokens.")
