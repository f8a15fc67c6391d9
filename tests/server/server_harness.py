"""Run a server for tests: in a thread of this process (fast, the engine stays inspectable) or as
a subprocess on a free port (signals, real engine). Plus a raw SSE parser."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
from sanic import Sanic

REPO_ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ThreadServer:
    """Sanic's low-level create_server on an event loop owned by a daemon thread."""

    def __init__(self, app: Sanic):
        self.app, self.port = app, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: Any = None
        self._thread = threading.Thread(target=self._run, daemon=True, name="test-server")

    def __enter__(self) -> ThreadServer:
        self._thread.start()
        if not self._ready.wait(30):
            raise RuntimeError("the test server did not start")
        return self

    def __exit__(self, *exc: Any) -> None:
        future = asyncio.run_coroutine_threadsafe(self._stop(), self._loop)
        future.result(10)
        self._thread.join(10)

    def _run(self) -> None:
        self._loop = asyncio.new_event_loop()
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._serve())
        except asyncio.CancelledError:
            pass

    async def _serve(self) -> None:
        self._server = await self.app.create_server(host="127.0.0.1", port=self.port,
                                                    return_asyncio_server=True)
        await self._server.startup()
        await self._server.before_start()
        await self._server.after_start()
        self._ready.set()
        await self._server.serve_forever()

    async def _stop(self) -> None:
        await self._server.before_stop()
        self._server.close()
        await self._server.wait_closed()
        await self._server.after_stop()


class LoggedProcess:
    """A process run from the repository root, its output in a temporary file (a pipe nobody
    drains could block it); `stop` sends stop_signal, then kills it if it lingers."""

    stop_signal = signal.SIGTERM

    def __init__(self, args: list[str], env: dict[str, str] | None = None):
        self._log = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen(args, env=env, cwd=REPO_ROOT, stdout=self._log,
                                     stderr=subprocess.STDOUT, text=True)

    def output(self) -> str:
        self._log.seek(0)
        return self._log.read()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(self.stop_signal)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self._log.close()


def python_path_with_repo() -> str:
    """The repo first, then whatever PYTHONPATH already holds (where a machine's packages were
    installed with --target, the server process needs them too)."""
    return os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))


class ProcessServer(LoggedProcess):
    """`python <script> ...` with PORT set; ready once GET /health answers."""

    def __init__(self, args: list[str], env: dict[str, str] | None = None,
                 startup_timeout_s: float = 60.0):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        super().__init__([sys.executable, *args],
                         {**os.environ, "PYTHONPATH": python_path_with_repo(), "HOST": "127.0.0.1",
                          "PORT": str(self.port), **(env or {})})
        self._wait_ready(startup_timeout_s)

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited early:\n{self.output()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                time.sleep(0.1)
        self.stop()
        raise RuntimeError("server did not become ready")

    def signal(self, sig: int = signal.SIGTERM) -> None:
        self.proc.send_signal(sig)

    def wait(self, timeout_s: float) -> int:
        return self.proc.wait(timeout_s)

    def __enter__(self) -> ProcessServer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def fake_server(env: dict[str, str] | None = None) -> ProcessServer:
    return ProcessServer([str(HERE / "fake_server_main.py")], env)


def sse_events(text: str) -> list[str]:
    """The data payloads of an SSE body, per the SSE spec (comments ignored, multi-line joined)."""
    events, data = [], []
    for line in text.splitlines():
        if line == "":
            if data:
                events.append("\n".join(data))
            data = []
        elif line.startswith("data:"):
            data.append(line[5:].removeprefix(" "))
    if data:
        events.append("\n".join(data))
    return events


def sse_json(text: str) -> tuple[list[dict[str, Any]], bool]:
    """(parsed JSON chunks, whether the stream ended with [DONE])."""
    events = sse_events(text)
    done = bool(events) and events[-1] == "[DONE]"
    return [json.loads(e) for e in events if e != "[DONE]"], done
