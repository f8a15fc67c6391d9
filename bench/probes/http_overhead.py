"""Decode speed through HTTP (streaming chat completions) against the server's own engine timing.

    python bench/probes/http_overhead.py PRESET OUT.json [--device cuda] [--streams 1,32]

Starts `sparkinfer serve` on a synthetic preset (written on first use), sends N concurrent greedy
streaming requests per round, and records per round: client-side tokens/s (first to last SSE chunk),
the engine's own decode_tps from the usage block, and their ratio; and, from the server's /metrics
before and after the round, the engine thread's mean step time against model.forward's per step
kind (decode: graph-replayed passes; mixed: passes with a prefill), whose ratio is the engine's
own overhead (scheduler + sampling + detokenizing + events). Results are written after each round,
so a run cut short still leaves what it measured.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console

from sparkinfer_cli.bench.runner import ensure_synthetic

MAX_TOKENS = 64


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: Path, device: str, port: int) -> subprocess.Popen:
    env = dict(os.environ, SPARKINFER_MAX_OUTPUT_TOKENS=str(MAX_TOKENS), CTX="16384")
    cmd = [sys.executable, "-m", "sparkinfer_cli", "serve", "-m", str(model), "--device", device,
           "--port", str(port)]
    return subprocess.Popen(cmd, env=env)


def wait_healthy(base: str, proc: subprocess.Popen, timeout_s: float) -> float:
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                return time.monotonic() - start
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError("server did not become healthy")


async def one_stream(client: httpx.AsyncClient, base: str, i: int) -> dict:
    body = {"model": "bench", "stream": True, "temperature": 0, "max_tokens": MAX_TOKENS,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": f"Count to {100 + i} slowly."}]}
    first = last = None
    usage = None
    async with client.stream("POST", f"{base}/v1/chat/completions", json=body) as response:
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices"):
                now = time.monotonic()
                first, last = first or now, now
            usage = chunk.get("usage") or usage
    return {"first": first, "last": last, "tokens": usage["completion_tokens"],
            "engine_decode_tps": usage.get("decode_tps")}


def engine_counters(base: str) -> dict[tuple[str, str], float]:
    """(metric, step kind) → value of the engine's cumulative step counters."""
    text = httpx.get(f"{base}/metrics", timeout=30).text
    return {(s.name, s.labels["kind"]): s.value
            for family in text_string_to_metric_families(text) if family.name.startswith(
                "sparkinfer_engine_") for s in family.samples if s.name.endswith("_total")}


def engine_overhead(before: dict, after: dict) -> dict:
    """Per step kind over one round: steps, mean step and forward ms, engine overhead fraction."""
    out: dict = {}
    for kind in ("decode", "mixed"):
        delta = {name: after[(f"sparkinfer_engine_{name}_total", kind)] -
                 before[(f"sparkinfer_engine_{name}_total", kind)]
                 for name in ("steps", "step_seconds", "forward_seconds")}
        steps = delta["steps"]
        out[f"engine_{kind}_steps"] = int(steps)
        if steps:
            out[f"engine_{kind}_step_ms"] = delta["step_seconds"] / steps * 1e3
            out[f"engine_{kind}_forward_ms"] = delta["forward_seconds"] / steps * 1e3
            out[f"engine_{kind}_overhead"] = 1 - delta["forward_seconds"] / delta["step_seconds"]
    return out


async def round_of(base: str, n: int) -> dict:
    async with httpx.AsyncClient(timeout=600) as client:
        streams = await asyncio.gather(*(one_stream(client, base, i) for i in range(n)))
    window = max(s["last"] for s in streams) - min(s["first"] for s in streams)
    tokens = sum(s["tokens"] - 1 for s in streams)
    engine = [s["engine_decode_tps"] for s in streams if s["engine_decode_tps"]]
    per_stream_client = [(s["tokens"] - 1) / (s["last"] - s["first"]) for s in streams
                         if s["last"] > s["first"]]
    return {"streams": n, "client_tok_s_total": tokens / window if window > 0 else None,
            "client_tok_s_per_stream": sum(per_stream_client) / len(per_stream_client),
            "engine_decode_tps_per_stream": sum(engine) / len(engine) if engine else None}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("preset")
    ap.add_argument("out", type=Path)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--streams", default="1,32")
    args = ap.parse_args()
    result: dict = {"preset": args.preset, "device": args.device, "max_tokens": MAX_TOKENS}
    path = ensure_synthetic(args.preset, Console(stderr=True))
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    proc = start_server(path, args.device, port)
    try:
        result["startup_s"] = wait_healthy(base, proc, 600)
        asyncio.run(round_of(base, 1))  # warm-up: first-request costs (JIT, allocations)
        for n in (int(v) for v in args.streams.split(",")):
            before = engine_counters(base)
            measured = asyncio.run(round_of(base, n))
            measured.update(engine_overhead(before, engine_counters(base)))
            result.setdefault("rounds", []).append(measured)
            args.out.write_text(json.dumps(result, indent=2))
            print(json.dumps(result["rounds"][-1]), flush=True)
    finally:
        proc.terminate()
        proc.wait(timeout=60)


if __name__ == "__main__":
    main()
