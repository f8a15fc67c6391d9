"""bench --llama-bench: llama.cpp measured in the same run, through a stand-in llama-bench that
answers as the real one does (-o json records with n_prompt, n_gen, n_depth, avg_ts)."""

from __future__ import annotations

import io
import json
import sys
import textwrap
from pathlib import Path

import pytest
from rich.console import Console

from sparkinfer_cli.bench.llama_bench import measure_llama_cpp
from sparkinfer_cli.bench.runner import BenchRequest, run_bench


@pytest.fixture
def fake_llama_bench(tmp_path) -> Path:
    """pp{n}: 1000 + n tok/s; tg at depth d: 100 − d / 100 tok/s; a model path containing
    'broken' fails as llama-bench does; every call's arguments are appended to calls.txt."""
    script = tmp_path / "llama-bench"
    script.write_text(textwrap.dedent(f"""\
        #!{sys.executable}
        import json, sys
        args = sys.argv[1:]
        with open({str(tmp_path / "calls.txt")!r}, "a") as f:
            f.write(" ".join(args) + "\\n")
        value = lambda flag, default: args[args.index(flag) + 1] if flag in args else default
        if "broken" in value("-m", ""):
            sys.stderr.write("llama_model_load: error loading model\\nmain: error: failed\\n")
            sys.exit(1)
        prompts = [int(p) for p in value("-p", "512").split(",")]
        n_gen = int(value("-n", "128"))
        depths = [int(d) for d in value("-d", "0").split(",")]
        records = [{{"n_prompt": p, "n_gen": 0, "n_depth": 0, "avg_ts": 1000.0 + p}}
                   for p in prompts if p] if n_gen == 0 else \\
            [{{"n_prompt": 0, "n_gen": n_gen, "n_depth": d, "avg_ts": 100.0 - d / 100}}
             for d in depths]
        print(json.dumps(records))
        """))
    script.chmod(0o755)
    return script


def test_prefill_and_decode_at_each_depth(fake_llama_bench, tmp_path):
    source, anchors = measure_llama_cpp(fake_llama_bench, tmp_path / "m.gguf", [64, 512], 16,
                                        "cpu")
    assert [(a.kind, a.ctx, a.tok_s, a.test) for a in anchors] == [
        ("prefill", 64, 1064.0, "pp64"), ("prefill", 512, 1512.0, "pp512"),
        ("decode", 64, 99.36, "tg16 @ d64"), ("decode", 512, 94.88, "tg16 @ d512")]
    assert source.startswith("measured in this run: ") and "-d 64,512" in source
    calls = (tmp_path / "calls.txt").read_text().splitlines()
    assert all("-ngl 0" in c and "-o json" in c for c in calls)
    measure_llama_cpp(fake_llama_bench, tmp_path / "m.gguf", [64], 16, "cuda")
    assert "-ngl 99 -fa on" in (tmp_path / "calls.txt").read_text().splitlines()[-1]


def test_a_failing_llama_bench_names_its_last_line(fake_llama_bench, tmp_path):
    with pytest.raises(RuntimeError, match="llama-bench failed \\(1\\): main: error: failed"):
        measure_llama_cpp(fake_llama_bench, tmp_path / "broken.gguf", [64], 16, "cpu")


def test_a_bench_run_sets_our_figures_against_the_same_runs_llama_cpp(fake_llama_bench,
                                                                      tmp_path, monkeypatch):
    monkeypatch.setenv("SPARKINFER_CACHE_DIR", str(tmp_path / "cache"))
    out_dir = tmp_path / "results"
    run_bench(BenchRequest(None, "tiny-qwen3", "cpu", (16,), (1,), out_dir,
                           llama_bench=fake_llama_bench), Console(file=io.StringIO()))
    (path,) = out_dir.glob("*.json")
    report = json.loads(path.read_text())
    ours = {(r["kind"], r["ctx"]): r["tok_s"] for r in report["results"]}
    anchors = {a["test"]: a for a in report["llama_cpp"]}
    assert set(anchors) == {"pp16", "tg16 @ d16"}
    assert anchors["pp16"]["ratio"] == pytest.approx(ours[("prefill", 16)] / 1016.0)
    assert anchors["tg16 @ d16"]["ratio"] == pytest.approx(ours[("decode", 16)] / 99.84)
    assert "measured in this run" in path.with_suffix(".md").read_text()


def test_a_missing_llama_bench_is_refused_before_any_work(tmp_path):
    with pytest.raises(ValueError, match="--llama-bench .*: no such file"):
        BenchRequest(None, "tiny-qwen3", "cpu", llama_bench=tmp_path / "absent")
