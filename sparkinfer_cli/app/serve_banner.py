"""The one line `sparkinfer serve` prints once it listens: where, what, how big, whether a key is
needed, and a request to paste."""

from __future__ import annotations

import json
import shlex

from sparkinfer_cli.engine.config import EngineConfig
from sparkinfer_cli.server.config import ServerConfig

_ANY_ADDRESS = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}


def base_url(host: str, port: int) -> str:
    """The address a local client reaches the server at (a wildcard bind is reached on loopback)."""
    host = _ANY_ADDRESS.get(host, host)
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def banner_line(server: ServerConfig, engine: EngineConfig, device: str) -> str:
    url = base_url(server.host, server.port)
    body = json.dumps({"model": server.model_name, "max_tokens": 32,
                       "messages": [{"role": "user", "content": "Say hi in one word."}]})
    auth = ' -H "Authorization: Bearer $SPARKINFER_API_KEY"' if server.api_key else ""
    return (f"serving {server.model_name} at {url}/v1 on {device}, KV pool {engine.ctx:,} "
            f"tokens, API key {'on' if server.api_key else 'off'}; try: curl -s "
            f"{url}/v1/chat/completions{auth} -H 'Content-Type: application/json' "
            f"-d {shlex.quote(body)}")
