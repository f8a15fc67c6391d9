"""The `sparkinfer` command line as a user runs it (CliRunner over the real Typer app)."""

from __future__ import annotations

import json

import numpy as np
from typer.testing import CliRunner

from sparkinfer_cli.cli import app
from sparkinfer_cli.gguf.reader import GGUFFile
from sparkinfer_cli.tokenizer.tokenizer import Tokenizer

runner = CliRunner()


def test_inspect_json_reports_the_file(fixtures_dir):
    path = fixtures_dir / "tiny/qwen35moe/qwen35moe-Q4_K_M.gguf"
    result = runner.invoke(app, ["inspect", str(path), "--json", "--ctx", "1024"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    info = json.loads((fixtures_dir / "tiny/qwen35moe/gguf_info.json").read_text())
    types = [t for t, _ in info["variants"]["Q4_K_M"]["tensor_types"].values()]
    counts = {row["type"]: row["tensors"] for row in report["quantization"]}
    assert counts == {t: types.count(t) for t in set(types)}
    assert report["memory"]["ctx"] == 1024


def test_inspect_rich_and_errors(fixtures_dir, tmp_path):
    ok = runner.invoke(app, ["inspect", str(fixtures_dir / "tiny/qwen3/qwen3-Q8_0.gguf")])
    assert ok.exit_code == 0 and "qwen3" in ok.stdout
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a model")
    result = runner.invoke(app, ["inspect", str(bad)])
    assert result.exit_code == 1 and "not a GGUF file" in result.output


def test_generate_raw_greedy_streams_llama_cpp_continuation(fixtures_dir):
    """`generate --raw` with the tiny qwen3: the text is the decoded llama.cpp greedy ids."""
    path = fixtures_dir / "tiny/qwen3/qwen3-F32.gguf"
    goldens = np.load(fixtures_dir / "tiny/qwen3/qwen3.goldens.npz")
    tok = Tokenizer.from_gguf(GGUFFile(path))
    prompt = tok.decode(goldens["prompt_short"].tolist())
    assert tok.encode(prompt) == goldens["prompt_short"].tolist()
    greedy = goldens["lc_F32_greedy_short"][:8].tolist()
    expected = tok.decode(greedy[:next((i for i, t in enumerate(greedy) if t in tok.eog_ids),
                                       len(greedy))])
    result = runner.invoke(app, ["generate", prompt, "-m", str(path), "--raw",
                                 "--max-tokens", "8", "--device", "cpu"])
    assert result.exit_code == 0, result.output
    assert result.stdout.rstrip("\n") == expected
    assert "tok/s" in result.stderr


def test_generate_bad_input_is_a_clear_error(fixtures_dir):
    path = str(fixtures_dir / "tiny/qwen3/qwen3-F32.gguf")
    result = runner.invoke(app, ["generate", "hi", "-m", path, "--top-p", "1.5"])
    assert result.exit_code == 1 and "--top-p must be" in result.stderr  # the flag as typed
    result = runner.invoke(app, ["generate", "hi", "-m", "/nonexistent/model.gguf"])
    assert result.exit_code == 1 and "error" in result.stderr
    result = runner.invoke(app, ["generate", "hi", "-m", path, "--device", "tpu"])
    assert result.exit_code == 1 and "--device" in result.stderr


def test_inspect_takes_a_demo_model_name_and_shows_its_path(monkeypatch, fixtures_dir):
    from sparkinfer_cli.hub import download as hub

    tiny = fixtures_dir / "tiny/qwen3/qwen3-Q8_0.gguf"
    monkeypatch.setattr(hub, "fetch_demo_model", lambda name: tiny)
    result = runner.invoke(app, ["inspect", "smollm2-135m", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["file"]["path"] == str(tiny.resolve())
    rich = runner.invoke(app, ["inspect", "smollm2-135m"], terminal_width=400)
    assert str(tiny.resolve()) in rich.stdout
