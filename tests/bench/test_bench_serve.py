"""`sparkinfer bench --serve`: the SSE client's timing (TTFT and ITL from the chunks that carry
token text, output tokens from usage), the percentile folding, the loads and the written files
against the real app over a FakeEngine, and one end-to-end run on the tiny qwen3 GGUF."""

from __future__ import annotations

import io
import json
import sys
import threading
import time
from datetime import datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from rich.console import Console
from typer.testing import CliRunner

from sparkinfer_cli.bench.serve import (
    ENGINE_MAX_SEQS,
    JSON_RESPONSE_FORMAT,
    ServeBenchRequest,
    engine_concurrency,
    run_serve_bench,
)
from sparkinfer_cli.bench.serve_client import (
    Endpoint,
    PromptSource,
    RequestTiming,
    add_chunk,
    completion_body,
    connect,
    parse_speculation,
    poisson_arrivals,
    run_arrivals,
    run_together,
    stream_completion,
)
from sparkinfer_cli.bench.serve_report import RunFigures, percentile, summarize
from sparkinfer_cli.cli import app

sys.path.insert(0, str(Path(__file__).parents[1] / "server"))
from server_fakes import LONG_REPLY, CharTokenizer, FakeEngine, QwenLikeTemplate  # noqa: E402
from server_harness import ThreadServer  # noqa: E402

from sparkinfer_cli.server.app import create_app  # noqa: E402

TINY_MODEL = Path(__file__).parents[1] / "fixtures" / "tiny" / "qwen3" / "qwen3-Q8_0.gguf"


def text_chunk(text: str, finish_reason: str | None = None) -> dict:
    return {"choices": [{"index": 0, "text": text, "finish_reason": finish_reason}], "usage": None}


def usage_chunk(completion_tokens: int) -> dict:
    return {"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": completion_tokens,
                                     "ttft_ms": 12.5}}


# ---- timing of one stream ------------------------------------------------------------------------
def test_ttft_and_itl_come_from_chunks_that_carry_token_text():
    timing = RequestTiming(sent_at=10.0)
    for now, chunk in [(10.1, text_chunk("")), (10.3, text_chunk("Hel")), (10.35, text_chunk("")),
                       (10.5, text_chunk("lo")), (10.9, text_chunk("!", "length")),
                       (11.0, usage_chunk(9))]:
        add_chunk(timing, chunk, now)
    assert timing.token_times == [10.3, 10.5, 10.9]
    assert timing.ttft_s == pytest.approx(0.3)
    assert timing.itl_s == pytest.approx([0.2, 0.4])
    assert timing.output_tokens == 9  # the usage block's count, not the 3 chunks
    assert timing.finish_reason == "length" and timing.server_ttft_ms == 12.5
    assert timing.stream_tok_s == pytest.approx(8 / 0.6)


def test_an_error_event_in_the_stream_is_recorded():
    timing = RequestTiming(sent_at=0.0)
    add_chunk(timing, text_chunk("a"), 0.1)
    add_chunk(timing, {"error": {"message": "engine stopped", "type": "server_error"}}, 0.2)
    assert timing.error == "in-stream error: engine stopped"


# The gap before "b" is long so that a client stamping on arrival sees most of it even when the
# machine delays its read of "a"; only the causal bounds (no stamp before its chunk was written)
# are exact.
STREAM = [(0.0, text_chunk("")), (0.15, text_chunk("a")), (0.4, text_chunk("b", "length")),
          (0.0, usage_chunk(5))]


class ScriptedSSE(BaseHTTPRequestHandler):
    """Fixed streams, chosen by path: an empty chunk at once, then token text after delays (and,
    under /nousage, no usage block); other paths get a 503."""

    scripts = {"/v1/completions": STREAM, "/nousage/v1/completions": STREAM[:-1]}

    def do_POST(self):  # noqa: N802 (http.server's name)
        self.rfile.read(int(self.headers["Content-Length"]))
        if self.path not in self.scripts:
            self.send_error(503)
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for delay, chunk in self.scripts[self.path]:
            time.sleep(delay)
            self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
            self.wfile.flush()
        self.wfile.write(b"data: [DONE]\n\n")

    def log_message(self, *args):
        pass


@pytest.fixture
def scripted_url():
    server = ThreadingHTTPServer(("127.0.0.1", 0), ScriptedSSE)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_stream_completion_stamps_chunks_as_they_arrive(scripted_url):
    timing = stream_completion(Endpoint(scripted_url), [1, 2, 3, 4], 5)
    assert timing.error is None
    assert len(timing.token_times) == 2 and timing.output_tokens == 5
    assert timing.ttft_s >= 0.15  # the empty chunk sent at once does not count
    assert timing.ttft_s + timing.itl_s[0] >= 0.55
    assert timing.itl_s[0] >= 0.2  # "a" was stamped when it came, not together with "b"
    assert timing.e2e_s >= timing.ttft_s + timing.itl_s[0]


def test_http_errors_are_recorded_not_raised(scripted_url):
    timing = stream_completion(Endpoint(scripted_url + "/busy"), [1], 2)
    assert timing.error.startswith("HTTP 503") and not timing.token_times


def test_a_stream_without_usage_is_an_error_not_a_count_of_chunks(scripted_url):
    timing = stream_completion(Endpoint(scripted_url + "/nousage"), [1, 2], 5)
    assert "usage" in timing.error and len(timing.token_times) == 2


# ---- folding into figures ------------------------------------------------------------------------
def test_speculation_counters_come_from_the_metrics_page():
    """The spec_decode counters of sparkinfer's /metrics (Prometheus text, counters as floats);
    None where a page lacks any of them (speculation off, another server)."""
    page = ("# HELP sparkinfer_spec_decode_drafts_total decode checks that carried drafts\n"
            "sparkinfer_spec_decode_drafts_total 12.0\n"
            "sparkinfer_spec_decode_draft_tokens_total 40.0\n"
            "sparkinfer_spec_decode_accepted_tokens_total 25.0\n"
            "sparkinfer_spec_decode_acceptance_rate 0.625\n")
    stats = parse_speculation(page)
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (12, 40, 25)
    assert parse_speculation(page.replace("accepted_tokens_total", "accepted_tokens_x")) is None
    assert parse_speculation("") is None


def test_percentiles_interpolate_between_ranks():
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5
    assert percentile(list(range(101)), 99) == 99.0
    assert percentile([1.0, 2.0], 99) == pytest.approx(1.99)
    assert percentile([], 50) is None


def timing(sent: float, tokens: list[float], end: float, n: int, error: str | None = None):
    return RequestTiming(sent, tokens, end, n, "length", None, error)


def test_summarize_counts_and_rates():
    timings = [timing(0.0, [0.1, 0.2, 0.3], 0.4, 3),  # ttft 100 ms, gaps 100 100
               timing(0.0, [0.3, 0.7], 1.0, 4),  # ttft 300 ms, gap 400
               timing(0.5, [0.6], 0.6, 1),  # stopped early (1 < 4)
               timing(0.2, [], 0.3, 0, "HTTP 429: busy")]
    figures = summarize(timings, 4, "3 clients × 1", 3, None)
    assert (figures.num_requests, figures.num_failed, figures.num_stopped_early) == (4, 1, 2)
    assert figures.output_tokens == 8 and figures.span_s == 1.0 and figures.output_tok_s == 8.0
    assert figures.ttft_ms["p50"] == pytest.approx(100.0)  # of 100, 300, 100
    assert figures.itl_ms["p50"] == pytest.approx(100.0)  # of 100, 100, 400
    assert figures.itl_ms["p99"] == pytest.approx(100 + 0.98 * 300)
    assert figures.stream_tok_s["min"] == pytest.approx(3 / 0.4)  # the second: 3 tokens in 0.4 s
    assert figures.mean_in_flight == pytest.approx(0.4 + 1.0 + 0.1 + 0.1)
    assert figures.first_error == "HTTP 429: busy"


def test_engine_figures_run_no_more_sequences_than_the_server_runs_at_once():
    """A Poisson load's engine figure runs its mean number in flight, but requests beyond the
    server's max_num_seqs wait in its queue: 65 in flight is a 64-sequence engine figure."""
    def in_flight(requests: int, at_once: float) -> RunFigures:
        # `requests` requests of 1 s each over a span of requests / at_once seconds
        spacing = 1.0 / at_once
        return summarize([timing(i * spacing, [i * spacing + 1.0], i * spacing + 1.0, 1)
                          for i in range(requests)], 1, "Poisson", None, at_once)

    assert engine_concurrency(in_flight(200, 3.2)) == 3
    assert engine_concurrency(in_flight(2000, 70.0)) == ENGINE_MAX_SEQS == 64
    assert engine_concurrency(summarize([timing(0.0, [0.1], 0.1, 1)], 1, "1", 1, None)) == 1


def test_poisson_arrivals_are_seeded_and_inside_the_duration():
    arrivals = poisson_arrivals(50.0, 10.0, seed=3)
    assert arrivals == poisson_arrivals(50.0, 10.0, seed=3) != poisson_arrivals(50.0, 10.0, 4)
    assert arrivals == sorted(arrivals) and 0 < arrivals[0] and arrivals[-1] < 10.0
    assert 400 < len(arrivals) < 600  # 500 expected; a seeded draw, so no flakiness


# ---- against the real app over a FakeEngine ------------------------------------------------------
@pytest.fixture(scope="module")
def fake_server():
    engine = FakeEngine(lambda prompt, params: LONG_REPLY, token_delay_s=0.001)
    engine.start()
    try:
        with ThreadServer(create_app(engine, CharTokenizer(), QwenLikeTemplate())) as server:
            yield server.url, engine
    finally:
        engine.shutdown(wait=False)


def test_prompts_have_exactly_n_tokens_and_all_differ(fake_server):
    prompts = PromptSource(connect(fake_server[0]))
    batch = [prompts.next(32) for _ in range(50)]
    assert all(len(p) == 32 for p in batch)
    assert len({tuple(p[:16]) for p in batch}) == 50  # no two share a first KV block


def test_clients_together_each_send_their_requests_in_a_row(fake_server):
    url, engine = fake_server
    endpoint, prompts = connect(url), PromptSource(connect(url))
    before = len(engine.submitted)
    one = lambda: stream_completion(endpoint, prompts.next(8), 6)  # noqa: E731
    timings = run_together([[one, one]] * 3)
    assert len(timings) == 6 and len(engine.submitted) - before == 6
    assert all(t.error is None and t.output_tokens == 6 and len(t.token_times) == 6
               for t in timings)
    assert all(len(ids) == 8 and params.max_tokens == 6 and params.temperature == 0
               and params.ignore_eos for _, ids, params in engine.submitted[before:])
    for first, second in zip(timings[0::2], timings[1::2]):  # one client's requests in a row
        assert second.sent_at >= first.ended_at


def test_arrivals_start_each_request_at_its_time(fake_server):
    endpoint = connect(fake_server[0])
    sends = [lambda: stream_completion(endpoint, [65, 66, 67], 2)] * 3
    start = time.perf_counter()
    timings = run_arrivals(sends, [0.0, 0.1, 0.2])
    assert [t.output_tokens for t in timings] == [2, 2, 2]
    assert timings[2].sent_at - start >= 0.2


def test_bench_of_a_running_server_writes_the_serve_json(fake_server, tmp_path):
    request = ServeBenchRequest(None, None, "cpu", (1, 3), prompt_tokens=12, max_tokens=5,
                                requests_per_client=2, rate=20.0, duration_s=0.3,
                                url=fake_server[0], out_dir=tmp_path, command="sparkinfer bench")
    console = Console(file=io.StringIO(), width=200)
    files = run_serve_bench(request, console)
    stem = f"{datetime.now().date().isoformat()}-sparkinfer-cpu-serve"
    assert sorted(f.name for f in files) == [f"{stem}.json", f"{stem}.md"]
    result = json.loads((tmp_path / f"{stem}.json").read_text())
    assert result["kind"] == "serve" and result["server"]["started"] is False
    assert {"date", "commit", "machine", "command", "parameters", "cold", "warm_idle",
            "load_average", "notes"} <= result.keys()
    together, poisson = result["runs"][:2], result["runs"][2]
    assert [r["num_requests"] for r in together] == [2, 6]
    assert [r["output_tokens"] for r in together] == [10, 30]
    assert poisson["clients"] is None and poisson["rate"] == 20.0
    assert all(r["num_failed"] == 0 and r["ttft_ms"]["p99"] >= r["ttft_ms"]["p50"] > 0
               and r["engine_tok_s"] is None and r["drafts"] is None for r in result["runs"])
    assert result["cold"]["output_tokens"] == 5 and len(result["warm_idle"]["ttft_ms"]) == 3
    assert "no engine-only figure" in " ".join(result["notes"])
    assert "1 client × 2" in console.file.getvalue()


@pytest.mark.parametrize("kwargs, message", [
    ({"rate": 0.0}, "--rate"), ({"max_tokens": 0}, "--max-tokens"),
    ({"clients": (0,)}, "--concurrency"), ({"device": "tpu"}, "tpu")])
def test_bad_requests_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ServeBenchRequest(**{"model": None, "synthetic": None, "device": "cpu", **kwargs})


def test_cli_refuses_ctx_with_serve():
    result = CliRunner().invoke(app, ["bench", "--serve", "--ctx", "64", "--device", "cpu"])
    assert result.exit_code == 1 and "--ctx" in result.output


@pytest.mark.parametrize("mode", [[], ["--url", "http://127.0.0.1:9"]])
def test_cli_refuses_speculation_flags_without_a_server_to_start(mode):
    result = CliRunner().invoke(app, ["bench", "--spec-type", "ngram", "--device", "cpu", *mode])
    assert result.exit_code == 1 and "the server --serve starts" in result.output


# ---- end to end ----------------------------------------------------------------------------------
@pytest.mark.slow
def test_bench_serve_on_the_tiny_model_starts_measures_and_stops_the_server(tmp_path):
    result = CliRunner().invoke(app, [
        "bench", "--serve", "-m", str(TINY_MODEL), "--device", "cpu", "--concurrency", "1",
        "--concurrency", "2", "--prompt-tokens", "8", "--max-tokens", "4",
        "--requests-per-client", "1", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    (path,) = tmp_path.glob("*-qwen3-Q8_0-cpu-serve.json")
    report = json.loads(path.read_text())
    assert report["server"]["started"] is True
    assert [r["output_tokens"] for r in report["runs"]] == [4, 8]
    assert all(r["num_failed"] == 0 and r["engine_tok_s"] > 0 and r["engine_ratio"] > 0
               for r in report["runs"])
    assert report["cold"]["ttft_ms"] > 0
    assert not is_listening(report["server"]["url"])


@pytest.mark.slow
@pytest.mark.parametrize(("env", "flags"), [
    ({"SPARKINFER_SPEC_TOKENS": "4"}, []),
    ({}, ["--model-draft", str(TINY_MODEL.with_name("qwen3-Q4_K_M.gguf")),
          "--spec-draft-n-max", "3"])])
def test_bench_serve_reports_what_the_server_s_drafts_kept(tmp_path, monkeypatch, env, flags):
    """A server the bench starts with SPARKINFER_SPEC_TOKENS, or with the bench's speculation
    flags passed on (a draft model; the tiny qwen3 repeats itself): each load carries the
    checks, drafted and kept tokens its /metrics counted meanwhile, and a note says what share
    was kept."""
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    result = CliRunner().invoke(app, [
        "bench", "--serve", "-m", str(TINY_MODEL), "--device", "cpu", "--concurrency", "1",
        "--prompt-tokens", "16", "--max-tokens", "48", "--requests-per-client", "2",
        "--out", str(tmp_path), *flags])
    assert result.exit_code == 0, result.output
    (path,) = tmp_path.glob("*-serve.json")
    (run,) = json.loads(path.read_text())["runs"]
    drafts = run["drafts"]
    assert drafts["num_drafts"] > 0 and 0 < drafts["num_accepted_tokens"] <= \
        drafts["num_draft_tokens"]
    assert any("drafted tokens kept" in note for note in json.loads(path.read_text())["notes"])


@pytest.mark.slow
def test_bench_serve_json_answers_constrain_every_request_to_the_end(tmp_path):
    """--json: each load runs plain, then with every request asking for the bench's schema,
    whose list cannot close within the answer, so the grammar constrains each of its tokens and
    no request ends early (ignore_eos with a JSON that had closed would leave the grammar no
    token: a failed or short request)."""
    result = CliRunner().invoke(app, [
        "bench", "--serve", "-m", str(TINY_MODEL), "--device", "cpu", "--concurrency", "2",
        "--prompt-tokens", "8", "--max-tokens", "24", "--requests-per-client", "1", "--json",
        "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    (path,) = tmp_path.glob("*-serve.json")
    report = json.loads(path.read_text())
    assert report["parameters"]["request"]["response_format"] == JSON_RESPONSE_FORMAT
    assert "a JSON answer" in path.with_suffix(".md").read_text()
    plain, constrained = report["runs"]
    assert plain["load"] == "2 clients × 1" and constrained["load"] == "2 clients × 1, JSON schema"
    for run in (plain, constrained):
        assert run["output_tokens"] == 48 and run["num_failed"] == run["num_stopped_early"] == 0


def test_only_json_runs_send_a_response_format():
    endpoint = Endpoint("http://127.0.0.1:1", "m")
    assert "response_format" not in completion_body(endpoint, [1], 2)
    assert completion_body(endpoint, [1], 2, response_format=JSON_RESPONSE_FORMAT)[
        "response_format"] == JSON_RESPONSE_FORMAT
    plain = ServeBenchRequest(None, None, "cpu", url="http://127.0.0.1:1")
    assert plain.response_format is None
    assert ServeBenchRequest(None, None, "cpu", url="http://127.0.0.1:1",
                             json=True).response_format == JSON_RESPONSE_FORMAT


def is_listening(url: str) -> bool:
    from sparkinfer_cli.bench.serve_server import is_ready

    return is_ready(url)


@pytest.mark.parametrize(("flags", "passed"), [
    (["--spec-type", "mtp", "--spec-draft-n-max", "2"], ("--spec-type", "mtp")),
    (["--spec-type", "ngram"], ("--spec-type", "ngram")),
    (["--model-draft", str(TINY_MODEL)], ("--spec-type", "draft", "--model-draft",
                                          str(TINY_MODEL)))])
def test_bench_serve_hands_its_speculation_flags_to_the_server(monkeypatch, flags, passed):
    seen = {}
    monkeypatch.setattr("sparkinfer_cli.bench.serve.run_serve_bench",
                        lambda request, console: seen.update(flags=request.serve_flags))
    result = CliRunner().invoke(app, ["bench", "--serve", "--device", "cpu", *flags])
    assert result.exit_code == 0, result.output
    assert seen["flags"][:len(passed)] == passed and "--spec-draft-n-max" in seen["flags"]
