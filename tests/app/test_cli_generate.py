"""`generate` and `chat` as a user runs them on the tiny qwen3: the prompt from stdin, a chat's
history and its prefix cache, the sampling and context flags, Ctrl-C's exit code."""

from __future__ import annotations

import re

import pytest
from typer.testing import CliRunner

from sparkinfer_cli.app import generate as generate_module
from sparkinfer_cli.cli import app
from sparkinfer_cli.engine.sampling_params import SamplingParams

runner = CliRunner()


@pytest.fixture
def tiny(fixtures_dir) -> str:
    return str(fixtures_dir / "tiny/qwen3/qwen3-F32.gguf")


def run(*args: str, input: str | None = None):
    return runner.invoke(app, [*args, "--device", "cpu", "--max-tokens", "4"], input=input)


def test_a_dash_reads_the_prompt_from_stdin(tiny):
    from_stdin = run("generate", "-", "-m", tiny, "--raw", input="The sea is")
    typed = run("generate", "The sea is", "-m", tiny, "--raw")
    assert from_stdin.exit_code == typed.exit_code == 0, from_stdin.output
    assert from_stdin.stdout == typed.stdout and typed.stdout.strip()


def test_no_prompt_without_chat_is_an_error(tiny):
    result = run("generate", "-m", tiny)
    assert result.exit_code == 1 and "-i to chat" in result.stderr


@pytest.mark.parametrize("command", [["chat"], ["generate", "-i"]])
def test_chat_keeps_the_history_and_reuses_its_kv(tiny, command):
    result = run(*command, "-m", tiny, input="hello there\nand then?\n/bye\n")
    assert result.exit_code == 0, result.output
    speeds = [line for line in result.stderr.splitlines() if "tok/s" in line]
    assert len(speeds) == 2
    first, second = (int(re.search(r"prompt (\d+) tokens", s)[1]) for s in speeds)
    cached = re.search(r"\((\d+) cached\)", speeds[1])
    assert second > first and cached and int(cached[1]) >= 16  # the first turn's whole blocks


def test_chat_ends_at_end_of_input(tiny):
    assert run("chat", "-m", tiny, input="hello\n").exit_code == 0


def test_the_penalty_flags_reach_the_sampler(tiny, monkeypatch):
    seen: list[SamplingParams] = []
    stream = generate_module.GenerationSession.stream

    def recording(self, ids, params, stats):
        seen.append(params)
        return stream(self, ids, params, stats)

    monkeypatch.setattr(generate_module.GenerationSession, "stream", recording)
    result = run("generate", "hi", "-m", tiny, "--repeat-penalty", "1.3",
                 "--presence-penalty", "0.5", "--frequency-penalty", "-0.25")
    assert result.exit_code == 0, result.output
    assert (seen[0].repetition_penalty, seen[0].presence_penalty,
            seen[0].frequency_penalty) == (1.3, 0.5, -0.25)
    result = run("generate", "hi", "-m", tiny, "--presence-penalty", "3")
    assert result.exit_code == 1 and "--presence-penalty must be" in result.stderr


def test_ctx_bounds_prompt_and_answer(tiny):
    result = run("generate", "hello", "-m", tiny, "--ctx", "8")
    assert result.exit_code == 1 and "beyond --ctx 8" in result.stderr
    assert run("generate", "hello", "-m", tiny, "--ctx", "64").exit_code == 0


def test_ctrl_c_while_streaming_exits_130(tiny, monkeypatch):
    def interrupted(self, ids, params, stats):
        yield "partial"
        raise KeyboardInterrupt

    monkeypatch.setattr(generate_module.GenerationSession, "stream", interrupted)
    result = run("generate", "hi", "-m", tiny)
    assert result.exit_code == 130 and result.stdout.startswith("partial")


def test_a_draft_model_leaves_the_answer_as_it_was(tiny, fixtures_dir):
    """--model-draft (the same tiny model's Q4_K_M file drafting) prints the greedy answer
    generated without it, and reports the drafts it checked."""
    draft = str(fixtures_dir / "tiny/qwen3/qwen3-Q4_K_M.gguf")
    args = ("generate", "The sea is", "-m", tiny, "--raw", "--max-tokens", "12")
    plain, drafted = runner.invoke(app, [*args, "--device", "cpu"]), \
        runner.invoke(app, [*args, "--device", "cpu", "--model-draft", draft])
    assert plain.exit_code == drafted.exit_code == 0, drafted.output
    assert drafted.stdout == plain.stdout and plain.stdout.strip()
    assert re.search(r"drafts: \d+ of [1-9]\d* kept", drafted.stderr)


@pytest.mark.parametrize("head_only", [False, True])
def test_mtp_drafts_leave_the_answer_as_it_was(tmp_path, head_only):
    """--spec-type mtp on a synthetic Qwen3.5-MoE with an MTP head, in the file or in a head-only
    file given as --model-draft: the greedy answer of the run without drafts, and a stats line
    that counts the head's drafts."""
    import dataclasses

    from sparkinfer_cli.gguf.synthetic import PRESETS, write_synthetic
    spec = PRESETS["tiny-qwen35moe-mtp"]
    path = str(write_synthetic(tmp_path / "mtp.gguf", "tiny-qwen35moe" if head_only else spec))
    head = ["--model-draft", str(write_synthetic(
        tmp_path / "head.gguf", dataclasses.replace(spec, head_only=True)))] if head_only else []
    args = ("generate", "The sea is", "-m", path, "--raw", "--max-tokens", "12", "--device", "cpu")
    plain = runner.invoke(app, list(args))
    drafted = runner.invoke(app, [*args, "--spec-type", "mtp", "--spec-draft-n-max", "2", *head])
    assert plain.exit_code == drafted.exit_code == 0, drafted.output
    assert drafted.stdout == plain.stdout
    assert re.search(r"drafts: \d+ of [1-9]\d* kept", drafted.stderr)
