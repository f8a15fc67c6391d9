"""Test entry point: the real server (create_app + serve, signals and all) over a FakeEngine.

Configured like production through the environment (PORT, SPARKINFER_*), plus FAKE_TOKEN_DELAY_S
for the fake model's speed and FAKE_OPENS_THINKING for a Qwen3.5-style template.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from server_fakes import CharTokenizer, FakeEngine, QwenLikeTemplate  # noqa: E402

from sparkinfer_cli import env  # noqa: E402
from sparkinfer_cli.server.app import create_app, serve  # noqa: E402
from sparkinfer_cli.server.config import ServerConfig  # noqa: E402


def main() -> None:
    config = ServerConfig.from_env()
    engine = FakeEngine(ctx=env.CTX.get() or 4096,
                        max_queue_depth=env.SPARKINFER_MAX_QUEUE_DEPTH.get(),
                        max_output_tokens=env.SPARKINFER_MAX_OUTPUT_TOKENS.get(),
                        request_timeout_s=env.SPARKINFER_REQUEST_TIMEOUT_S.get(),
                        token_delay_s=float(os.environ.get("FAKE_TOKEN_DELAY_S", "0")))
    engine.start()
    template = QwenLikeTemplate(opens_thinking=os.environ.get("FAKE_OPENS_THINKING") == "1")
    serve(create_app(engine, CharTokenizer(), template, config), config)
    engine.shutdown(wait=False)
    print("server exited cleanly", flush=True)


if __name__ == "__main__":
    main()
