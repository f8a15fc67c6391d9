"""Command-line mistakes are named as the user typed them and caught before the model loads."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
from gguf_corpus import CONTEXT, Reached, reach, write_tiny
from typer.testing import CliRunner

from sparkinfer_cli import __version__
from sparkinfer_cli.cli import app

TINY = Path(__file__).parents[1] / "fixtures" / "tiny"

runner = CliRunner()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny(tmp_path_factory.mktemp("cli") / "tiny.gguf")


@pytest.fixture(autouse=True)
def nothing_loads(monkeypatch):
    """A test that reaches the weights or the server fails with Reached."""
    monkeypatch.setattr("sparkinfer_cli.model.loader.load_runtime_model", reach)
    monkeypatch.setattr("sparkinfer_cli.server.app.run_server", reach)
    monkeypatch.delenv("PORT", raising=False)


def assert_error(result, *needles: str, exit_code: int = 1) -> None:
    assert result.exception is None or isinstance(result.exception, SystemExit), \
        repr(result.exception)
    assert result.exit_code == exit_code, result.output
    assert all(needle in result.output for needle in needles), result.output


def test_version_and_short_help():
    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0 and result.stdout.strip() == f"sparkinfer {__version__}"
    for args in (["-h"], ["generate", "-h"], ["serve", "-h"]):
        result = runner.invoke(app, args)
        assert result.exit_code == 0 and "Usage" in result.stdout, args


def test_inspect_ctx_zero_names_the_flag(tiny):
    assert_error(runner.invoke(app, ["inspect", str(tiny), "--ctx", "0"]), "--ctx", exit_code=2)


@pytest.mark.parametrize(("flag", "value"), [("--max-tokens", "0"), ("--top-p", "1.5"),
                                             ("--temperature", "-1"), ("--min-p", "2")])
def test_generate_sampling_errors_name_the_flag(tiny, flag, value):
    result = runner.invoke(app, ["generate", "hi", "-m", str(tiny), flag, value])
    assert_error(result, f"error: {flag} must")


def test_generate_max_tokens_beyond_the_context_before_loading(tiny):
    result = runner.invoke(app, ["generate", "hi", "-m", str(tiny), "--raw", "--device", "cpu",
                                 "--max-tokens", str(CONTEXT)])
    assert_error(result, "--max-tokens 256", f"context of {CONTEXT} tokens")


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_a_missing_model_file_is_named(tmp_path, command):
    absent = tmp_path / "absent.gguf"
    args = ["generate", "hi"] if command == "generate" else ["serve"]
    assert_error(runner.invoke(app, args + ["-m", str(absent), "--device", "cpu"]), str(absent))


def test_serve_port_in_use_names_the_address_before_loading(tiny):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = runner.invoke(app, ["serve", "-m", str(tiny), "--device", "cpu",
                                     "--port", str(port)])
    assert_error(result, f"127.0.0.1:{port}", "already in use")


def test_serve_port_out_of_range(tiny):
    result = runner.invoke(app, ["serve", "-m", str(tiny), "--port", "70000"])
    assert_error(result, "--port", exit_code=2)


def test_serve_port_from_the_environment_is_checked(tiny, monkeypatch):
    monkeypatch.setenv("PORT", "http")
    result = runner.invoke(app, ["serve", "-m", str(tiny), "--device", "cpu"])
    assert_error(result, "PORT='http'")


def test_serve_with_good_settings_reaches_the_server(tiny):
    result = runner.invoke(app, ["serve", "-m", str(tiny), "--device", "cpu", "--port", "0"])
    assert isinstance(result.exception, Reached), result.output


@pytest.mark.parametrize(("flags", "needle"), [
    (["--spec-type", "eagle"], "'eagle' is not supported"),
    (["--spec-type", "mtp"], "has no MTP head"),
    (["--spec-type", "draft-mtp"], "has no MTP head"),
    (["--spec-type", "ngram", "--spec-draft-n-max", "9"], "1 to 7"),
    (["--spec-draft-n-max", "3"], "--spec-draft-n-max needs --spec-type"),
    (["--speculative-config", "{nope"], "--speculative-config is no JSON"),
    (["--speculative-config", '{"method": "ngram"}', "--spec-type", "ngram"], "not both"),
    (["--spec-type", "draft"], "--spec-type draft needs --model-draft FILE"),
    (["--spec-type", "ngram", "--model-draft", "{tiny}"], "--model-draft FILE goes with"),
    (["--spec-type", "mtp", "--model-draft", "{qwen35}"], "is no MTP head of"),
    (["--model-draft", "{qwen35}"], "attention layers only"),
    (["--model-draft", "{qwen3}"], "tokens differ"),
    (["--speculative-config", '{"model": 5}'], "model must be a file name"),
    (["--speculative-config", '{"method": "qwen3_next_mtp"}'], "has no MTP head"),
    (["--speculative-config", '{"method": "draft_model"}'], "--spec-type draft needs")])
def test_serve_speculation_flags_are_checked_before_loading(tiny, flags, needle):
    files = {"tiny": tiny, "qwen35": TINY / "qwen35" / "qwen35-Q8_0.gguf",
             "qwen3": TINY / "qwen3" / "qwen3-Q8_0.gguf"}
    for name, path in files.items():
        flags = [flag.replace(f"{{{name}}}", str(path)) for flag in flags]
    result = runner.invoke(app, ["serve", "-m", str(tiny), "--device", "cpu", "--port", "0",
                                 *flags])
    assert_error(result, needle)


@pytest.mark.parametrize(("flags", "draft"), [
    (["--spec-type", "ngram", "--spec-draft-n-max", "3"], False),
    (["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}'], False),
    (["--model-draft", "{tiny}", "--spec-draft-n-max", "3"], True),
    (["--speculative-config", '{"model": "{tiny}", "num_speculative_tokens": 3}'], True)])
def test_serve_speculation_flags_in_either_spelling_reach_the_engine(tiny, monkeypatch, flags,
                                                                     draft):
    flags = [flag.replace("{tiny}", str(tiny)) for flag in flags]
    passed = {}

    def run_server(*args, **kwargs):
        passed.update(kwargs)
        raise Reached

    monkeypatch.setattr("sparkinfer_cli.server.app.run_server", run_server)
    result = runner.invoke(app, ["serve", "-m", str(tiny), "--device", "cpu", "--port", "0",
                                 *flags])
    assert isinstance(result.exception, Reached), result.output
    assert passed["speculation"].tokens == 3
    assert passed["speculation"].draft_model == (str(tiny) if draft else None)


def test_serve_ctx_and_engine_settings_are_checked_before_loading(tiny, monkeypatch):
    result = runner.invoke(app, ["serve", "-m", str(tiny), "--device", "cpu", "--port", "0",
                                 "--ctx", "5"])
    assert_error(result, "--ctx must hold at least one KV block")
    monkeypatch.setenv("SPARKINFER_SCHED_POLICY", "fastest")
    result = runner.invoke(app, ["serve", "-m", str(tiny), "--device", "cpu", "--port", "0"])
    assert_error(result, "SPARKINFER_SCHED_POLICY")


def test_a_head_only_file_is_named_as_such(tmp_path):
    """A file of llama.cpp's --mtp kind holds no model to run: every command says what it is."""
    import dataclasses

    from sparkinfer_cli.gguf.synthetic import PRESETS, write_synthetic
    head = write_synthetic(tmp_path / "head.gguf",
                           dataclasses.replace(PRESETS["tiny-qwen35moe-mtp"], head_only=True))
    for command in (["inspect", str(head)], ["generate", "hi", "-m", str(head), "--device", "cpu"]):
        assert_error(runner.invoke(app, command), "an MTP head without its model")
