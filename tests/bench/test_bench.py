"""`sparkinfer bench` on a tiny synthetic model: the files and their fields, the roofline and
throughput arithmetic against hand-computed values, llama.cpp anchors against the fixture, and
clear errors for bad input."""

from __future__ import annotations

import io
import json
import re
import subprocess
import sys
from datetime import datetime
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from rich.console import Console

from sparkinfer_cli.bench.measure import Settings, decode_throughput
from sparkinfer_cli.bench.report import (
    BenchReport,
    ResultRow,
    report_json,
    report_markdown,
    write_report,
)
from sparkinfer_cli.bench.roofline import MachinePeaks, ModelCost, cpu_info, roofline
from sparkinfer_cli.bench.runner import BenchRequest, run_bench
from sparkinfer_cli.gguf.reader import GGUFFile
from sparkinfer_cli.gguf.synthetic import tensor_plan, write_synthetic
from sparkinfer_cli.model.config import ModelConfig

COMMAND = "sparkinfer bench --synthetic tiny-qwen3 --device cpu --ctx 16"
EXPECTED_ROWS = [("prefill", 16, 1), ("decode", 16, 1), ("throughput", 16, 1),
                 ("throughput", 16, 2)]


@pytest.fixture(scope="module")
def cache_env(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPARKINFER_CACHE_DIR", str(tmp_path_factory.mktemp("cache") / "models"))
        yield


@pytest.fixture(scope="module")
def bench_run(cache_env, tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("results")
    console = Console(file=io.StringIO(), width=120)
    files = run_bench(BenchRequest(None, "tiny-qwen3", "cpu", (16,), (1, 2), out_dir, COMMAND),
                      console)
    return files, out_dir, console.file.getvalue()


def _result_json(out_dir: Path) -> dict:
    (path,) = out_dir.glob("*.json")
    return json.loads(path.read_text())


# ---- the real run --------------------------------------------------------------------------------
def test_files_are_written_under_date_model_device(bench_run):
    files, out_dir, _ = bench_run
    stem = f"{datetime.now().date().isoformat()}-tiny-qwen3-cpu"
    names = {p.name for p in out_dir.iterdir()}
    assert {f"{stem}.md", f"{stem}.json"} <= names
    assert set(files) <= {out_dir / n for n in names}
    chart = _result_json(out_dir)["chart"]
    try:
        import matplotlib  # noqa: F401
        assert chart == f"{stem}.png" and (out_dir / chart).stat().st_size > 1000
    except ImportError:
        assert chart is None and f"{stem}.png" not in names


def test_json_fields_and_types(bench_run):
    _, out_dir, _ = bench_run
    data = _result_json(out_dir)
    assert data["model"] == "tiny-qwen3" and data["command"] == COMMAND
    assert data["device"] == cpu_info()["model name"]
    # NOTE: other sessions commit meanwhile, so HEAD now may be newer: the commit must exist
    is_repo = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent,
                             capture_output=True).returncode == 0
    if is_repo:
        head, dirty = re.fullmatch(r"([0-9a-f]{40})(\+dirty)?", data["commit"]).groups()
        assert subprocess.run(["git", "cat-file", "-e", f"{head}^{{commit}}"],
                              cwd=Path(__file__).parent).returncode == 0
        changed = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                                 cwd=Path(__file__).parent, capture_output=True, text=True)
        assert bool(dirty) == bool(changed.stdout.strip())
    else:
        assert data["commit"] == "unknown"
    assert datetime.fromisoformat(data["date"]).date() == datetime.now().date()
    rows = data["results"]
    assert [(r["kind"], r["ctx"], r["concurrency"]) for r in rows] == EXPECTED_ROWS
    for r in rows:
        assert isinstance(r["tok_s"], float) and r["tok_s"] > 0
        assert isinstance(r["roofline_fraction"], float) and 0 < r["roofline_fraction"] <= 1
        assert r["bound"] in ("memory", "compute")
        assert isinstance(r["load_1min"], float) and r["load_1min"] >= 0
        assert r["host_us"] is None  # the CPU model does not split host from device time
    load = data["machine"]["load_average"]
    assert len(load["before"]) == 3 and len(load["after"]) == 3


def test_markdown_and_console_show_every_figure(bench_run):
    _, out_dir, console_text = bench_run
    (md_path,) = out_dir.glob("*.md")
    md = md_path.read_text()
    for r in _result_json(out_dir)["results"]:
        row = f"| {r['kind']} | {r['ctx']} | {r['concurrency']} | {r['tok_s']:,.1f} |"
        assert row in md
        assert f"{r['tok_s']:,.1f}" in console_text
    assert cpu_info()["model name"] in md and "load average" in md


# ---- arithmetic against hand-computed values -----------------------------------------------------
def _cost(preset: str, tmp_path: Path) -> ModelCost:
    gguf = GGUFFile(write_synthetic(tmp_path / f"{preset}.gguf", preset))
    return ModelCost.from_gguf(gguf, ModelConfig.from_gguf(gguf))


def test_model_cost_counts_tied_embeddings_and_active_experts(tmp_path):
    plan = tensor_plan("tiny-qwen3")  # tied: the output matmul reads token_embd
    dense = _cost("tiny-qwen3", tmp_path)
    assert dense.bytes_per_pass(1) == sum(t.n_bytes for t in plan)
    assert dense.flops_per_pass(3) == 2 * 3 * sum(t.n_elements for t in plan)

    plan = [t for t in tensor_plan("tiny-qwen3moe") if t.name != "token_embd.weight"]  # untied
    experts = sum(t.n_bytes for t in plan if t.name.endswith("_exps.weight"))
    moe = _cost("tiny-qwen3moe", tmp_path)
    assert experts > 0 and moe.n_expert == 8 and moe.n_expert_used == 2
    assert moe.bytes_per_pass(1) == pytest.approx(sum(t.n_bytes for t in plan) - experts * 6 / 8)
    two_tokens = 1 - (6 / 8) ** 2  # share of experts that 2 tokens touch
    assert moe.bytes_per_pass(2) == pytest.approx(sum(t.n_bytes for t in plan)
                                                  - experts * (1 - two_tokens))


def test_roofline_takes_the_binding_roof():
    cost = ModelCost(dense_bytes=10**9, expert_bytes=0, dense_params=10**9, expert_params=0)
    peaks = MachinePeaks("test", memory_bandwidth=1e10, peak_flops=1e12, note="")
    # decode: 1 GB at 10 GB/s = 0.1 s floor; 5 tok/s = 0.2 s
    assert roofline(cost, peaks, 1, 5.0) == (pytest.approx(0.5), "memory")
    # prefill 1000 tokens: 2e12 FLOPs at 1e12 = 2 s floor; 250 tok/s = 4 s
    assert roofline(cost, peaks, 1000, 250.0) == (pytest.approx(0.5), "compute")


def test_decode_throughput_counts_only_the_span_where_all_decode():
    # a: first token at t=0, one per second, finishes at t=5 (6 tokens); b: first at t=1, ends t=7
    events = [(float(t), "a", t + 1, t == 5) for t in range(6)]
    events += [(t + 0.5, "b", t, t == 7) for t in range(1, 8)]
    # span (1.5, 5]: a goes 2 → 6, b goes 1 → 4 (its count at t=4.5): 7 tokens in 3.5 s
    assert decode_throughput(events) == pytest.approx(7 / 3.5)
    # skipping 2 steps: span (3.5, 5]: a goes 4 → 6, b goes 3 → 4: 3 tokens in 1.5 s
    assert decode_throughput(events, skip_steps=2) == pytest.approx(3 / 1.5)
    with pytest.raises(RuntimeError, match="decode steps"):
        decode_throughput([(0.0, "a", 1, True), (1.0, "b", 1, True)])


def test_gpu_peaks_come_from_the_design_table(monkeypatch):
    from sparkinfer_cli.bench import roofline as bench_roofline

    monkeypatch.setattr(bench_roofline, "gpu_name", lambda: "NVIDIA H200")
    peaks = bench_roofline.gpu_peaks()
    assert (peaks.name, peaks.memory_bandwidth, peaks.peak_flops) == ("NVIDIA H200", 4.0e12, 7.9e14)
    monkeypatch.setattr(bench_roofline, "gpu_name", lambda: "NVIDIA A10")
    assert "H200 figures assumed" in bench_roofline.gpu_peaks().note


def test_results_of_a_demo_model_file_are_filed_under_its_demo_name(tmp_path):
    from sparkinfer_cli.bench.runner import resolve_bench_model
    from sparkinfer_cli.hub.demo_models import DEMO_MODELS

    path = tmp_path / DEMO_MODELS["qwen2.5-coder-0.5b"].filename
    path.write_bytes(b"GGUF")
    request = BenchRequest(str(path), None, "cpu")
    assert resolve_bench_model(request, Console(file=io.StringIO())) == (path,
                                                                        "qwen2.5-coder-0.5b")
    other = tmp_path / "my-model.Q8_0.gguf"
    other.write_bytes(b"GGUF")
    request = BenchRequest(str(other), None, "cpu")
    assert resolve_bench_model(request, Console(file=io.StringIO()))[1] == "my-model.Q8_0"


# ---- llama.cpp anchors and the chart fallback ----------------------------------------------------
def _fake_report(model: str, rows: list[ResultRow]) -> BenchReport:
    return BenchReport(model=model, model_file=f"{model}.gguf", device="AMD EPYC",
                       device_kind="cpu", commit="abc", date="2026-11-30T10:00:00+00:00",
                       command="sparkinfer bench", peaks=MachinePeaks("AMD EPYC", 1e10, 1e11, "x"),
                       cost=ModelCost(10**8, 0, 10**8, 0), settings=Settings(16, 512, 16),
                       load_average={"before": [1.0, 2.0, 3.0], "after": [1.5, 2.0, 3.0]},
                       results=rows)


def test_cpu_anchor_matches_the_llama_bench_fixture(fixtures_dir):
    summary = json.loads((fixtures_dir / "real" / "llama_bench_qwen25coder.json").read_text())
    pp64, tg32 = (summary["summary"][k]["avg_tokens_per_s"] for k in ("pp64", "tg32"))
    rows = [ResultRow("prefill", 64, 1, 62.0, 0.1, "compute", 2.0),
            ResultRow("decode", 64, 1, 16.0, 0.2, "memory", 2.0),
            ResultRow("decode", 512, 1, 15.0, 0.2, "memory", 2.0, 812.4)]
    report = _fake_report("qwen2.5-coder-0.5b", rows)
    anchors = {a["test"]: a for a in report_json(report, None)["llama_cpp"]}
    assert set(anchors) == {"pp64", "tg32"}
    assert anchors["pp64"]["tok_s"] == pytest.approx(pp64, abs=0.05)
    assert anchors["tg32"]["tok_s"] == pytest.approx(tg32, abs=0.05)
    assert anchors["pp64"]["ratio"] == pytest.approx(62.0 / anchors["pp64"]["tok_s"])
    md = report_markdown(report, None)
    assert re.search(r"\| prefill \| 64 \| 1 \| 62\.0 \|.*124\.3 \(pp64\) \| 0\.50× \|", md)
    assert "| decode | 512 | 1 | 15.0 | 20% | memory | 2.0 | 812 | — | — |" in md
    assert "llama.cpp:" not in report_markdown(_fake_report("tiny-qwen3", rows), None)


def test_missing_matplotlib_skips_the_chart_with_a_note(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import → ImportError
    row = ResultRow("decode", 16, 1, 10.0, 0.5, "memory", 2.0)
    report = _fake_report("qwen2.5-coder-0.5b", [row])
    files = write_report(report, tmp_path)
    stem = "2026-11-30-qwen2.5-coder-0.5b-cpu"  # the dots in the name are no suffix
    assert sorted(p.name for p in files) == [f"{stem}.json", f"{stem}.md"]
    assert not list(tmp_path.glob("*.png"))
    assert "PNG skipped" in _result_json(tmp_path)["notes"][0]
    assert "PNG skipped" in (tmp_path / f"{report.stem}.md").read_text()


# ---- bad input -----------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, message", [
    ({"synthetic": "no-such-preset"}, "unknown synthetic preset 'no-such-preset'"),
    ({"concurrency": (1, 0)}, "--concurrency values must be at least 1"),
    ({"ctx": (0,)}, "--ctx values must be at least 1"),
    ({"model": "x.gguf"}, "not both"),
    ({"device": "tpu"}, "cpu, cuda"),
])
def test_bad_requests_are_refused(kwargs, message):
    fields = {"model": None, "synthetic": "tiny-qwen3", "device": "cpu"} | kwargs
    with pytest.raises(ValueError, match=re.escape(message)):
        BenchRequest(**fields)


def test_ctx_beyond_the_model_context_is_refused_before_any_work(tmp_path, monkeypatch):
    monkeypatch.setenv("SPARKINFER_CACHE_DIR", str(tmp_path / "cache" / "models"))
    out_dir = tmp_path / "results"
    request = BenchRequest(None, "tiny-qwen3", "cpu", (16, 5000), (1,), out_dir, "x")
    with pytest.raises(ValueError, match="--ctx 5000 plus 16 decode steps exceeds the model's "
                                         "context of 4096 tokens"):
        run_bench(request, Console(file=io.StringIO()))
    assert not out_dir.exists() and not (tmp_path / "cache").exists()  # nothing written


def test_concurrency_beyond_the_model_context_is_refused(cache_env, tmp_path):
    request = BenchRequest(None, "tiny-qwen3", "cpu", (16,), (5000,), tmp_path, "x")
    with pytest.raises(ValueError, match="--concurrency 5000 needs requests of 5034 tokens"):
        run_bench(request, Console(file=io.StringIO()))


def test_cli_reports_a_bad_preset_cleanly():
    from typer.testing import CliRunner

    from sparkinfer_cli.cli import app

    result = CliRunner().invoke(app, ["bench", "--synthetic", "nope", "--device", "cpu"])
    assert result.exit_code == 1
    assert "unknown synthetic preset 'nope'" in result.output


def test_decode_host_time_is_the_mean_over_its_graph_replays():
    from sparkinfer_cli.bench.measure import _HostTime
    from sparkinfer_cli.model.backend import StepTimes

    model = SimpleNamespace(times=StepTimes())
    model.times.add("decode", 0.5, 1.0)  # before the figure: not counted
    host = _HostTime(model)
    model.times.add("decode", 300e-6, 4e-3)
    model.times.add("other", 0.2, 0.3)  # a capture or prefill: not a replayed decode step
    model.times.add("decode", 500e-6, 4e-3)
    assert host.mean_us() == pytest.approx(400.0)
    assert _HostTime(SimpleNamespace(times=None)).mean_us() is None  # a model that counts none


def test_decode_on_a_queuing_model_times_runs_of_passes(monkeypatch):
    """A model with decode_greedy (CudaModel's queued passes) is timed as the engine runs it:
    consecutive runs of max_queued_steps passes from the depth on, a step = a run's time / its
    passes."""
    from sparkinfer_cli.bench import measure as bench_measure
    from sparkinfer_cli.bench.measure import DepthBench

    runs = []

    class QueuingModel:
        config = SimpleNamespace(n_vocab=50, is_hybrid=False)
        max_queued_steps = 4
        times = None

        def create_cache(self, num_blocks, block_size, num_state_slots):
            return SimpleNamespace(num_blocks=num_blocks)

        def decode_greedy(self, batch, cache, n_steps):
            assert len(batch.block_tables[0]) * bench_measure.BLOCK_SIZE >= \
                batch.start_positions[0] + n_steps
            runs.append((batch.start_positions[0], n_steps))
            return iter([np.zeros(1, np.int32)] * n_steps)

    clock = iter(range(100))  # each _timed call: 1 s
    monkeypatch.setattr(bench_measure.time, "perf_counter", lambda: next(clock))
    bench = DepthBench(QueuingModel(), 64, Settings(decode_steps=10, prefill_chunk_tokens=64,
                                                    throughput_prompt_tokens=8))
    result = bench.decode(64)
    assert runs == [(64, 4), (68, 4), (72, 2)]
    assert result.tok_s == pytest.approx(4.0)  # the median run: 1 s for 4 passes


# ---- where results go ----------------------------------------------------------------------------
def test_a_second_run_of_the_same_day_gets_a_time_suffix(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    report = _fake_report("qwen2.5-coder-0.5b", [ResultRow("decode", 16, 1, 10.0, 0.5, "memory",
                                                           2.0)])
    first = write_report(report, tmp_path)
    second = write_report(report, tmp_path)
    third = write_report(report, tmp_path)
    stem = "2026-11-30-qwen2.5-coder-0.5b-cpu"
    assert [p.name for p in first] == [f"{stem}.md", f"{stem}.json"]
    assert [p.name for p in second] == [f"{stem}-100000.md", f"{stem}-100000.json"]
    assert [p.name for p in third] == [f"{stem}-100000-2.md", f"{stem}-100000-2.json"]
    assert "bench" in report.notes[0] and 'pip install -e ".[bench]"' in report.notes[0]


def test_bench_writes_under_the_user_data_dir_unless_told(monkeypatch, tmp_path):
    from typer.testing import CliRunner

    from sparkinfer_cli.bench import runner as bench_module
    from sparkinfer_cli.cli import app

    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    seen = []
    monkeypatch.setattr(bench_module, "run_bench", lambda request, console: seen.append(request))
    assert CliRunner().invoke(app, ["bench", "--synthetic", "tiny-qwen3"]).exit_code == 0
    assert CliRunner().invoke(app, ["bench", "--synthetic", "tiny-qwen3", "--out",
                                    "bench/results"]).exit_code == 0
    assert [r.out_dir for r in seen] == [tmp_path / "data" / "sparkinfer" / "bench-results",
                                         Path("bench/results")]
