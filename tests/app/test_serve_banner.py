"""The one line `sparkinfer serve` prints once it listens."""

from __future__ import annotations

import shlex
from pathlib import Path

from typer.testing import CliRunner

from sparkinfer_cli.app.serve_banner import banner_line, base_url
from sparkinfer_cli.cli import app
from sparkinfer_cli.engine.config import EngineConfig
from sparkinfer_cli.hub import download as hub
from sparkinfer_cli.server import app as server_app
from sparkinfer_cli.server.config import ServerConfig

TINY = Path(__file__).parents[1] / "fixtures" / "tiny" / "qwen3" / "qwen3-Q8_0.gguf"


def test_the_banner_says_where_what_how_big_and_how_to_try_it():
    line = banner_line(ServerConfig(host="0.0.0.0", port=8081, api_key="k", model_name="tiny"),
                       EngineConfig(ctx=4096), "cpu")
    assert "\n" not in line
    for part in ("http://127.0.0.1:8081/v1", "tiny", "cpu", "KV pool 4,096 tokens",
                 "API key on", "Authorization: Bearer $SPARKINFER_API_KEY"):
        assert part in line
    curl = shlex.split(line.split("try: ", 1)[1])
    assert curl[:3] == ["curl", "-s", "http://127.0.0.1:8081/v1/chat/completions"]
    assert '"Authorization: Bearer $SPARKINFER_API_KEY"' in line  # the shell expands it
    no_key = banner_line(ServerConfig(model_name="tiny"), EngineConfig(), "cuda")
    assert "API key off" in no_key and "Authorization" not in no_key


def test_ipv6_hosts_are_bracketed():
    assert base_url("::", 80) == "http://[::1]:80"
    assert base_url("localhost", 80) == "http://localhost:80"


def test_serve_prints_the_banner_once_listening(monkeypatch):
    monkeypatch.setattr(hub, "resolve_model", lambda model, prefer_gpu, **_: (TINY, ""))
    monkeypatch.setenv("PORT", "0")

    def listening_server(*args, on_listening, **kwargs):
        on_listening(ServerConfig(port=8080, model_name="qwen3-tiny"), EngineConfig(ctx=512))

    monkeypatch.setattr(server_app, "run_server", listening_server)
    result = CliRunner().invoke(app, ["serve", "--device", "cpu"])
    assert result.exit_code == 0, result.output
    banner = [line for line in result.stderr.splitlines() if line.startswith("serving")]
    assert len(banner) == 1 and "qwen3-tiny at http://127.0.0.1:8080/v1" in banner[0]
