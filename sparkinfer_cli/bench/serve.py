"""`sparkinfer bench --serve`: the real server (started as `sparkinfer serve`, or one already
running at `--url`) driven over HTTP by concurrent streaming clients; its figures set against the
engine-only throughput of the same model, device and loads.

A session: the first request right after /health says ready (cold TTFT), short prompts one at a
time (warm idle TTFT), then for each client count a warm-up round and `requests_per_client`
requests per client in a row, then Poisson arrivals if a rate is given. Split by concern:
serve_client.py sends and times, serve_report.py folds and writes,
serve_engine.py measures the engine alone.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import datetime
from functools import partial
from pathlib import Path

from rich.console import Console
from rich.table import Table

from sparkinfer_cli.bench.runner import DEVICES, BenchRequest, git_commit, resolve_bench_model
from sparkinfer_cli.bench.serve_client import (
    Endpoint,
    PromptSource,
    RequestTiming,
    connect,
    poisson_arrivals,
    run_arrivals,
    run_together,
    speculation_counts,
    stream_completion,
)
from sparkinfer_cli.bench.serve_engine import describe_device
from sparkinfer_cli.bench.serve_report import (
    TABLE_HEADER,
    RunFigures,
    ServeReport,
    idle_lines,
    percentile,
    single_request,
    summarize,
    table_cells,
    write_serve_report,
)
from sparkinfer_cli.bench.serve_server import server_ctx, started_server
from sparkinfer_cli.bench.serve_turns import (
    TURNS_HEADER,
    TurnFigures,
    TurnsReport,
    run_turns,
    turn_cells,
    write_turns_report,
)
from sparkinfer_cli.engine.config import EngineConfig
from sparkinfer_cli.paths import bench_results_dir

DEFAULT_CLIENTS = {"cuda": (1, 8, 32, 64), "cpu": (1, 4, 8)}
WARM_IDLE_PROMPT_TOKENS = 16
WARM_IDLE_REQUESTS = 3
WARM_IDLE_MAX_TOKENS = 4
ENGINE_MAX_SEQS = EngineConfig.max_num_seqs  # what the started server runs at once
# --json: what every request asks for. A list of at least 64 short records never closes within
# a bench's answer, so the grammar constrains every token (keys, strings, integers, punctuation)
# and an answer cannot end before max_tokens
JSON_RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "bench_records", "schema": {
    "type": "object", "required": ["records"], "properties": {"records": {
        "type": "array", "minItems": 64, "items": {
            "type": "object", "required": ["name", "score"], "properties": {
                "name": {"type": "string", "maxLength": 12},
                "score": {"type": "integer", "minimum": 0, "maximum": 999}}}}}}}}
JSON_LOAD_SUFFIX = ", JSON schema"  # the label of a load's constrained run
ENGINE_TIMEOUT_S = 3600.0


@dataclass(frozen=True)
class ServeBenchRequest:
    model: str | None  # path, demo name or hub ref (None with no synthetic: the default model)
    synthetic: str | None
    device: str  # cpu | cuda: the started server's and the engine figure's
    clients: tuple[int, ...] = ()  # clients sent together (empty: the device's defaults)
    prompt_tokens: int = 128
    max_tokens: int = 128
    requests_per_client: int = 2
    rate: float | None = None  # Poisson arrivals a second (None: no Poisson load)
    duration_s: float = 60.0
    url: str | None = None  # a running server: nothing is started, no engine figure
    out_dir: Path = field(default_factory=bench_results_dir)
    command: str = "sparkinfer bench --serve"
    seed: int = 0
    turns: int = 0  # > 0: one conversation of this many turns instead of the loads
    turn_tokens: int = 200  # new text tokens each turn appends
    json: bool = False  # every request asks for JSON_RESPONSE_FORMAT (the grammar's cost)
    serve_flags: tuple[str, ...] = ()  # more flags for the started server (speculation)

    def __post_init__(self) -> None:
        if self.url is None:
            BenchRequest(self.model, self.synthetic, self.device)  # its checks of these three
        elif self.device not in DEVICES:
            raise ValueError(f"bench runs on one of {', '.join(DEVICES)}, not {self.device!r}")
        checks = [
            (all(c >= 1 for c in self.clients), "--concurrency values must be at least 1"),
            (self.prompt_tokens >= 1 and self.max_tokens >= 1,
             "--prompt-tokens and --max-tokens must be at least 1"),
            (self.requests_per_client >= 1, "--requests-per-client must be at least 1"),
            (self.rate is None or self.rate > 0, "--rate must be above 0 requests a second"),
            (self.duration_s > 0, "--duration must be above 0 seconds"),
            (self.turns >= 0 and self.turn_tokens >= 1,
             "--turns must be >= 0 and --turn-tokens at least 1"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @property
    def client_counts(self) -> tuple[int, ...]:
        """The loads of clients sent together: the given ones, the device's defaults when neither
        they nor a Poisson rate are given."""
        return self.clients or (() if self.rate else DEFAULT_CLIENTS[self.device])

    @property
    def response_format(self) -> dict | None:
        return JSON_RESPONSE_FORMAT if self.json else None

    @property
    def request_tokens(self) -> int:
        """The longest request: with --turns, the last turn's prompt and answer."""
        return self.prompt_tokens + self.max_tokens + \
            self.turns * (self.turn_tokens + self.max_tokens)


def run_serve_bench(request: ServeBenchRequest, console: Console) -> list[Path]:
    """Measures, prints a table, writes the result files and returns their paths."""
    if request.turns:
        return run_turns_bench(request, console)
    load_before = list(os.getloadavg())
    if request.url is not None:
        report = measure_running_server(request, console)
    else:
        report = measure_started_server(request, console)
    report.load_average = {"before": load_before, "after": list(os.getloadavg())}
    files = write_serve_report(report, request.out_dir)
    console.print(results_table(report))
    for line in idle_lines(report) + [f"[yellow]{note}[/]" for note in report.notes]:
        console.print(line)
    console.print("wrote " + ", ".join(str(f) for f in files))
    return files


def measure_running_server(request: ServeBenchRequest, console: Console) -> ServeReport:
    endpoint = connect(request.url)
    report = new_report(request, endpoint.model, None, describe_device("cpu") + " (the client's)",
                        {"url": endpoint.url, "started": False})
    run_session(request, endpoint, report, console)
    report.notes.append("no engine-only figure: the server was already running (--url)")
    return report


def measure_started_server(request: ServeBenchRequest, console: Console) -> ServeReport:
    """Starts the server, measures, stops it; then the engine figures, in a process of their own
    (the server's copy of the model is gone by then)."""
    path, label = resolve_bench_model(
        BenchRequest(request.model, request.synthetic, request.device), console)
    ctx = server_ctx(path, request.request_tokens, max(request.client_counts, default=1))
    machine = describe_device("cpu") if request.device == "cpu" else ""  # cuda: from the engine's
    with started_server(path, request.device, ctx, console,
                        request.serve_flags) as (endpoint, startup_s):
        report = new_report(request, label, path.name, machine,
                            {"url": endpoint.url, "started": True, "ctx": ctx,
                             "startup_s": startup_s})
        run_session(request, endpoint, report, console)
    add_engine_figures(report, path, request, console)
    return report


def run_turns_bench(request: ServeBenchRequest, console: Console) -> list[Path]:
    """One conversation (serve_turns.py) through a started or running server."""
    if request.url is not None:
        endpoint = connect(request.url)
        turns, cold = conversation(request, endpoint, console)
        label, machine = endpoint.model, describe_device("cpu") + " (the client's)"
    else:
        path, label = resolve_bench_model(
            BenchRequest(request.model, request.synthetic, request.device), console)
        ctx = server_ctx(path, request.request_tokens, 2)  # NOTE: room to keep the last turn
        with started_server(path, request.device, ctx, console,
                            request.serve_flags) as (endpoint, _):
            turns, cold = conversation(request, endpoint, console)
        machine = describe_device(request.device)
    parameters = {"turns": request.turns, "first_prompt_tokens": request.prompt_tokens,
                  "turn_tokens": request.turn_tokens, "max_tokens": request.max_tokens,
                  "seed": request.seed}
    report = TurnsReport(label, request.device, machine, git_commit(),
                         datetime.now().astimezone().isoformat(timespec="seconds"),
                         request.command, parameters, turns, cold)
    files = write_turns_report(report, request.out_dir)
    table = Table(title=f"{label}: {request.turns} turns on {machine}")
    for name in TURNS_HEADER:
        table.add_column(name, justify="right")
    for turn in [*turns, cold]:
        table.add_row(*turn_cells(turn, cold.ttft_ms))
    console.print(table)
    for turn in [*turns, cold]:
        if turn.error:
            console.print(f"[yellow]turn {turn.turn or 'cold'}: {turn.error}[/]")
    console.print("wrote " + ", ".join(str(f) for f in files))
    return files


def conversation(request: ServeBenchRequest, endpoint: Endpoint,
                 console: Console) -> tuple[list[TurnFigures], TurnFigures]:
    with console.status(f"a {request.turns}-turn conversation"):
        return run_turns(endpoint, request.turns, request.prompt_tokens, request.turn_tokens,
                         request.max_tokens, request.seed)


def new_report(request: ServeBenchRequest, label: str, model_file: str | None, machine: str,
               server: dict) -> ServeReport:
    parameters = {"clients": list(request.client_counts), "prompt_tokens": request.prompt_tokens,
                  "max_tokens": request.max_tokens,
                  "requests_per_client": request.requests_per_client, "rate": request.rate,
                  "duration_s": request.duration_s if request.rate else None,
                  "seed": request.seed, "warm_idle_prompt_tokens": WARM_IDLE_PROMPT_TOKENS,
                  "request": {"temperature": 0, "ignore_eos": True, "stream": True,
                              "stream_options": {"include_usage": True},
                              "response_format": request.response_format}}
    return ServeReport(label, model_file, request.device, machine, git_commit(),
                       datetime.now().astimezone().isoformat(timespec="seconds"), request.command,
                       server, parameters, {}, {})


# ---- the session ---------------------------------------------------------------------------------
def run_session(request: ServeBenchRequest, endpoint: Endpoint, report: ServeReport,
                console: Console) -> None:
    """Cold request, warm idle requests, then each load (a line per load as it is measured)."""
    prompts = PromptSource(endpoint, request.seed)
    send = partial(send_one, endpoint, prompts, None)
    report.cold = single_request(send(request.prompt_tokens, request.max_tokens))
    idle = [send(WARM_IDLE_PROMPT_TOKENS, WARM_IDLE_MAX_TOKENS) for _ in range(WARM_IDLE_REQUESTS)]
    idle_ttft = [1000 * t.ttft_s for t in idle if t.error is None and t.token_times]
    report.warm_idle = {"prompt_tokens": WARM_IDLE_PROMPT_TOKENS, "ttft_ms": idle_ttft,
                        "ttft_ms_p50": percentile(idle_ttft, 50)}
    # --json: each load plain, then constrained, on the same warm server, so that the grammar's
    # cost is the difference between neighbouring rows rather than between two server starts
    sends = [("", send)]
    if request.response_format is not None:
        sends.append((JSON_LOAD_SUFFIX, partial(send_one, endpoint, prompts,
                                                request.response_format)))
    for clients in request.client_counts:
        for suffix, send_load in sends:
            report.runs.append(with_drafts(endpoint, lambda: measure_together(
                request, send_load, clients, console, suffix)))
    if request.rate is not None:
        for suffix, send_load in sends:
            report.runs.append(with_drafts(endpoint, lambda: measure_poisson(
                request, send_load, request.rate, console, suffix)))
    report.notes += usage_notes(report.runs)


def with_drafts(endpoint: Endpoint, measure: Callable[[], RunFigures]) -> RunFigures:
    """measure()'s figures with the speculation counters the server added meanwhile (where it
    reports them: a server started with SPARKINFER_SPEC_TOKENS, or --url to one with drafts)."""
    before = speculation_counts(endpoint)
    figures = measure()
    after = speculation_counts(endpoint)
    if before is None or after is None:
        return figures
    return replace(figures, drafts=after.since(before))


def send_one(endpoint: Endpoint, prompts: PromptSource, response_format: dict | None,
             prompt_tokens: int, max_tokens: int) -> RequestTiming:
    return stream_completion(endpoint, prompts.next(prompt_tokens), max_tokens,
                             response_format=response_format)


Send = Callable[[int, int], RequestTiming]  # (prompt tokens, max tokens) → its timing


def measure_together(request: ServeBenchRequest, send: Send, clients: int,
                     console: Console, suffix: str = "") -> RunFigures:
    one = partial(send, request.prompt_tokens, request.max_tokens)
    with console.status(f"{clients} clients: warm-up round"):
        run_together([[one]] * clients)
    label = f"{clients} client{'s' * (clients > 1)} × {request.requests_per_client}{suffix}"
    with console.status(label):
        timings = run_together([[one] * request.requests_per_client] * clients)
    return announced(summarize(timings, request.max_tokens, label, clients, None), console)


def measure_poisson(request: ServeBenchRequest, send: Send, rate: float,
                    console: Console, suffix: str = "") -> RunFigures:
    """Poisson arrivals after a warm-up round of as many requests as arrive in a second."""
    one = partial(send, request.prompt_tokens, request.max_tokens)
    arrivals = poisson_arrivals(rate, request.duration_s, request.seed)
    if not arrivals:
        raise ValueError(f"no request arrives in {request.duration_s:g} s at {rate:g}/s")
    label = f"Poisson {rate:g}/s for {request.duration_s:g} s{suffix}"
    with console.status(f"{label}: warm-up round"):
        run_together([[one]] * min(ENGINE_MAX_SEQS, math.ceil(rate)))
    with console.status(f"{label} ({len(arrivals)} requests)"):
        timings = run_arrivals([one] * len(arrivals), arrivals)
    return announced(summarize(timings, request.max_tokens, label, None, rate), console)


def announced(figures: RunFigures, console: Console) -> RunFigures:
    """Prints a line per load as it is measured: logs of runs cut short still show it."""
    ttft = figures.ttft_ms["p50"]
    console.print(f"{figures.load}: {figures.output_tok_s:,.1f} output tok/s, TTFT p50 "
                  f"{'—' if ttft is None else f'{ttft:,.0f}'} ms, {figures.num_failed} failed")
    return figures


def usage_notes(runs: list[RunFigures]) -> list[str]:
    notes = [f"{r.load}: {r.num_failed} of {r.num_requests} requests failed, the first: "
             f"{r.first_error}" for r in runs if r.num_failed]
    notes += [f"{r.load}: {r.drafts.acceptance_rate:.0%} of {r.drafts.num_draft_tokens} drafted "
              f"tokens kept, {r.drafts.mean_accepted_length:.2f} tokens a check "
              f"({r.drafts.num_drafts} checks, the warm-up round's included)"
              for r in runs if r.drafts is not None and r.drafts.num_drafts]
    if any(r.num_stopped_early for r in runs):
        notes.append("some requests ended before max_tokens: the server did not honour "
                     "ignore_eos, so output tok/s counts fewer tokens than asked for")
    return notes


# ---- the engine alone ----------------------------------------------------------------------------
def engine_concurrency(figures: RunFigures) -> int:
    """The engine figure's sequences: the clients sent together, or (Poisson) the mean number in
    flight, no more than the server runs at once (the rest wait in its queue)."""
    return min(ENGINE_MAX_SEQS, figures.clients or max(1, round(figures.mean_in_flight)))


def add_engine_figures(report: ServeReport, path: Path, request: ServeBenchRequest,
                       console: Console) -> None:
    """The engine-only figure at every load's concurrency joins its run; a failure is a note
    (the serving figures stand on their own)."""
    wanted = sorted({engine_concurrency(r) for r in report.runs})
    try:
        result = measure_engine(path, request, wanted, console)
    except (RuntimeError, ValueError, subprocess.TimeoutExpired) as exc:
        report.notes.append(f"no engine-only figure: {exc}")
        return
    report.machine = result["device"]
    report.runs = [with_engine(r, result["figures"][str(engine_concurrency(r))],
                               engine_concurrency(r)) for r in report.runs]


def measure_engine(path: Path, request: ServeBenchRequest, concurrencies: list[int],
                   console: Console) -> dict:
    command = [sys.executable, "-m", "sparkinfer_cli.bench.serve_engine", str(path),
               request.device, str(request.prompt_tokens), str(request.max_tokens),
               *map(str, concurrencies)]
    with console.status("engine-only figures (no HTTP)"):
        proc = subprocess.run(command, stdout=subprocess.PIPE, text=True, timeout=ENGINE_TIMEOUT_S)
    if proc.returncode != 0:
        raise RuntimeError(f"bench.serve_engine exited with code {proc.returncode}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def with_engine(figures: RunFigures, engine: dict, concurrency: int) -> RunFigures:
    return replace(figures, engine_tok_s=engine["tok_s"], engine_concurrency=concurrency,
                   engine_max_tokens=engine["max_tokens"])


def results_table(report: ServeReport) -> Table:
    table = Table(title=f"{report.model} served on {report.machine or report.device_kind}")
    for name in TABLE_HEADER:
        table.add_column(name, justify="left" if name == "load" else "right")
    for cells in table_cells(report):
        table.add_row(*cells)
    return table
