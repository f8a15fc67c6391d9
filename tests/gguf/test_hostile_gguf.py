"""Corrupted GGUF files through `inspect`, `generate` and `serve`: each is refused with a one-line
error that names the file, exit code 1 and no traceback, before anything large is allocated.

Generation and the server's engine are replaced by a sentinel, so a file that slips through fails
fast (the sentinel reaches the test) instead of generating or listening.
"""

from __future__ import annotations

import random
import struct
import subprocess
import sys

import gguf
import pytest
from gguf_corpus import CORRUPTIONS, Reached, V, reach, write_tiny
from typer.testing import CliRunner

from sparkinfer_cli import kv_budget
from sparkinfer_cli.app.inspect_report import build_report
from sparkinfer_cli.app.preflight import check_loadable
from sparkinfer_cli.cli import app
from sparkinfer_cli.gguf.reader import GGUFError, GGUFFile

runner = CliRunner()
MiB = 1024 ** 2


@pytest.fixture(autouse=True)
def no_generation_or_engine(monkeypatch):
    monkeypatch.setattr("sparkinfer_cli.app.generate.GenerationSession", reach)
    monkeypatch.setattr("sparkinfer_cli.engine.engine.ContinuousBatchEngine", reach)
    monkeypatch.delenv("CTX", raising=False)


@pytest.fixture(scope="module")
def valid(tmp_path_factory):
    return write_tiny(tmp_path_factory.mktemp("valid") / "tiny.gguf")


COMMANDS = {
    "inspect": lambda path: ["inspect", str(path)],
    "generate": lambda path: ["generate", "hi", "-m", str(path), "--raw", "--max-tokens", "4",
                              "--device", "cpu"],
    "serve": lambda path: ["serve", "-m", str(path), "--port", "0", "--device", "cpu"],
}


def assert_refused(result, path) -> None:
    assert result.exception is None or isinstance(result.exception, SystemExit), \
        f"{type(result.exception).__name__}: {result.exception}\n{result.output}"
    assert result.exit_code != 0, result.output
    assert "Traceback" not in result.output
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and path.name in errors[0], result.output


def test_the_valid_file_passes_every_command(valid):
    assert runner.invoke(app, COMMANDS["inspect"](valid)).exit_code == 0
    for command in ("generate", "serve"):
        result = runner.invoke(app, COMMANDS[command](valid))
        assert isinstance(result.exception, Reached), (command, result.output)


# a tensor no layer reads is found by the loader's exhaustive check; inspect reads no weights
FOUND_BY_LOADING = {"tensor-unexpected"}
CASES = [(corruption, command) for corruption in CORRUPTIONS for command in COMMANDS
         if not (command == "inspect" and corruption in FOUND_BY_LOADING)]


@pytest.mark.parametrize(("corruption", "command"), CASES)
def test_a_corrupted_file_is_refused(valid, tmp_path, corruption, command):
    path = tmp_path / f"{corruption}.gguf"
    CORRUPTIONS[corruption](valid, path)
    assert_refused(runner.invoke(app, COMMANDS[command](path)), path)


@pytest.mark.parametrize("exponent", [20, 40])
def test_a_huge_trained_context_caps_the_servers_kv_pool(tmp_path, monkeypatch, exponent):
    monkeypatch.setattr(kv_budget, "available_memory_bytes", lambda device: 256 * MiB)
    path = write_tiny(tmp_path / "long.gguf", {"llama.context_length": (2 ** exponent, V.UINT64)})
    assert runner.invoke(app, COMMANDS["inspect"](path)).exit_code == 0
    result = runner.invoke(app, COMMANDS["serve"](path))
    assert isinstance(result.exception, Reached), result.output
    engine_config = result.exception.args[0][2]
    assert engine_config.ctx * 512 <= 256 * MiB  # 512 bytes of float32 K and V a token
    assert "--ctx" in result.output and f"{2 ** exponent:,}" in result.output


def test_a_kv_pool_beyond_memory_is_refused_when_asked_for(tmp_path, monkeypatch):
    monkeypatch.setattr(kv_budget, "available_memory_bytes", lambda device: 256 * MiB)
    path = write_tiny(tmp_path / "long.gguf")
    result = runner.invoke(app, COMMANDS["serve"](path) + ["--ctx", str(2 ** 30)])
    assert result.exit_code == 1 and "--ctx" in result.output and "memory" in result.output
    assert not isinstance(result.exception, Reached)


@pytest.mark.parametrize("corruption", ["truncated-in-vocab", "nested-arrays-100k-deep",
                                        "merges-integers"])
def test_the_real_command_prints_one_line(valid, tmp_path, corruption):
    """The installed entry point, not CliRunner: stderr is exactly one error line."""
    path = tmp_path / f"{corruption}.gguf"
    CORRUPTIONS[corruption](valid, path)
    done = subprocess.run([sys.executable, "-m", "sparkinfer_cli", "inspect", str(path)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.count("\n") == 1 and str(path.name) in done.stderr, done.stderr


def test_random_header_mutations_raise_only_gguf_errors(valid, tmp_path):
    """Seeded byte and field mutations of the header: the reader, inspect's report and the
    loadability check raise GGUFError or nothing (OverflowError and struct.error were found so)."""
    data, header_end = valid.read_bytes(), gguf.GGUFReader(valid).data_offset
    rng, path = random.Random(31), tmp_path / "mutated.gguf"
    for _ in range(300):
        mutated = bytearray(data)
        at = rng.randrange(header_end - 8)
        struct.pack_into("<Q", mutated, at, rng.choice([0, 3, 2 ** 31, 2 ** 40, 2 ** 64 - 1]))
        mutated[rng.randrange(header_end)] = rng.randrange(256)
        path.write_bytes(bytes(mutated))
        try:
            gguf_file = GGUFFile(path)
            build_report(gguf_file)
            check_loadable(gguf_file)
        except GGUFError:
            pass
