"""The server `sparkinfer bench --serve` measures: `sparkinfer serve` in a subprocess on a free
loopback port, ready once GET /health says so, always stopped at the end."""

from __future__ import annotations

import math
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

from rich.console import Console

from sparkinfer_cli.bench.serve_client import Endpoint, connect
from sparkinfer_cli.engine.config import EngineConfig

STARTUP_TIMEOUT_S = 1200.0  # loading a 20 GB GGUF, then the server's own warm-up request
STOP_TIMEOUT_S = 30.0
LOG_TAIL_LINES = 20


def server_ctx(path: Path, request_tokens: int, max_concurrent: int) -> int:
    """The server's KV pool: its default (the model's context), or more where max_concurrent
    requests of request_tokens would not all fit at once."""
    from sparkinfer_cli.gguf.reader import GGUFFile
    from sparkinfer_cli.model.config import ModelConfig

    trained = ModelConfig.from_gguf(GGUFFile(path)).context_length
    if request_tokens > trained:
        raise ValueError(f"--prompt-tokens plus --max-tokens ({request_tokens}) exceed the "
                         f"model's context of {trained} tokens")
    block = EngineConfig.block_size
    return max(trained, max_concurrent * math.ceil(request_tokens / block) * block)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def started_server(path: Path, device: str, ctx: int, console: Console,
                   serve_flags: tuple[str, ...] = ()) -> Iterator[tuple[Endpoint, float]]:
    """(its endpoint, seconds until it was ready); serve_flags: more of `serve`'s flags."""
    port = free_port()
    command = [sys.executable, "-m", "sparkinfer_cli", "serve", "-m", str(path), "--device",
               device, "--host", "127.0.0.1", "--port", str(port), "--ctx", str(ctx),
               *serve_flags]
    env = {k: v for k, v in os.environ.items() if k != "SPARKINFER_API_KEY"}  # the bench sends none
    with tempfile.TemporaryFile(mode="w+") as log:  # NOTE: a pipe nobody drains could block it
        proc = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
        try:
            start = time.perf_counter()
            with console.status(f"starting the server on port {port}"):
                wait_ready(f"http://127.0.0.1:{port}", proc, log)
            startup_s = time.perf_counter() - start
            console.print(f"server ready in {startup_s:.0f} s")
            yield connect(f"http://127.0.0.1:{port}"), startup_s
        finally:
            stop(proc)


def wait_ready(url: str, proc: subprocess.Popen, log: IO[str],
               timeout_s: float = STARTUP_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            log.seek(0)
            tail = "".join(log.readlines()[-LOG_TAIL_LINES:])
            raise RuntimeError(f"the server exited with code {proc.returncode} before it was "
                               f"ready; its last lines:\n{tail}")
        if is_ready(url):
            return
        time.sleep(0.25)
    raise RuntimeError(f"the server was not ready within {timeout_s:.0f} s")


def is_ready(url: str) -> bool:
    try:
        return Endpoint(url).get_json("/health", timeout_s=2).get("status") == "ok"
    except (OSError, RuntimeError, ValueError):
        return False


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM (the server drains, then exits); SIGKILL if it is still there after a while."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
