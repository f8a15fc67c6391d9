"""Server test fixtures: an in-process server over a FakeEngine, built per test or per module."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from server_fakes import CharTokenizer, FakeEngine, QwenLikeTemplate  # noqa: E402
from server_harness import ThreadServer  # noqa: E402

from sparkinfer_cli.server.app import create_app  # noqa: E402
from sparkinfer_cli.server.config import ServerConfig  # noqa: E402


@dataclass
class RunningServer:
    url: str
    engine: FakeEngine
    app: Any
    template: Any

    @property
    def base_url(self) -> str:
        return f"{self.url}/v1"

    @property
    def state(self) -> Any:
        return self.app.ctx.state


def _start(stack: ExitStack, engine_options: dict[str, Any], config_options: dict[str, Any],
           template: Any) -> RunningServer:
    engine = FakeEngine(**engine_options)
    engine.start()
    stack.callback(engine.shutdown, False)
    app = create_app(engine, CharTokenizer(), template, ServerConfig(**config_options))
    server = stack.enter_context(ThreadServer(app))
    return RunningServer(server.url, engine, app, template)


@pytest.fixture
def make_server() -> Iterator[Callable[..., RunningServer]]:
    """make_server(engine_options..., config=dict(...), opens_thinking=False, template=None)."""
    with ExitStack() as stack:
        def make(config: dict[str, Any] | None = None, opens_thinking: bool = False,
                 template: Any = None, **engine_options: Any) -> RunningServer:
            template = template or QwenLikeTemplate(opens_thinking=opens_thinking)
            return _start(stack, engine_options, config or {}, template)

        yield make


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    """A shared default server (FakeEngine replies instantly, no auth)."""
    with ExitStack() as stack:
        yield _start(stack, {}, {}, QwenLikeTemplate())
