"""Share of prompt tokens served from the replicas' prefix caches behind a router, per policy.

    python bench/probes/router_cache_share.py [--router smg] [--policy cache_aware round_robin]
        [--conversations 6] [--turns 4] [--repeats 1] [--out OUT.json]

Starts two `sparkinfer serve` replicas of the tiny qwen3 GGUF (CPU, 127.0.0.1), then per policy
and repeat: the router over both, `POST /flush_cache` through it (both caches empty), and a
multi-turn workload: the conversations run concurrently, one client thread each, every turn
sending the whole history (a distinct ~150-token opening, then each answer and a new user
message) as chat messages. Reported per run: sum of usage.prompt_tokens_details.cached_tokens
over sum of usage.prompt_tokens, and how many requests each replica served. Needs the router's
binary on PATH (`pip install -e ".[routers]"`).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

REPO_ROOT = Path(__file__).resolve().parents[2]
MODEL = REPO_ROOT / "tests" / "fixtures" / "tiny" / "qwen3" / "qwen3-Q8_0.gguf"
ALIAS = "tiny"
ROUTER_SUBCOMMAND = {"vllm-router": [], "smg": ["launch"]}
TOPICS = ["lighthouses", "sourdough", "glaciers", "chess openings", "bicycle gears", "tide pools",
          "volcanoes", "origami", "beekeeping", "radio antennas", "canal locks", "moss"]
ANSWER_TOKENS = 24


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_for(url: str, process: subprocess.Popen, timeout_s: float, needle: str = "") -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{process.args[:3]} exited with {process.returncode}")
        try:
            response = httpx.get(url, timeout=2)
            if response.status_code == 200 and needle in response.text:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} not ready in {timeout_s} s")


def start(args: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
    log = tempfile.TemporaryFile(mode="w+")
    return subprocess.Popen(args, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)


def stop(process: subprocess.Popen, sig: int = signal.SIGTERM) -> None:
    if process.poll() is None:
        process.send_signal(sig)
        try:
            process.wait(15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(5)


def start_replica() -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "HOST": "127.0.0.1", "PORT": str(port),
           "CTX": "16384"}
    process = start([sys.executable, "-m", "sparkinfer_cli", "serve", "-m", str(MODEL),
                     "--device", "cpu", "--alias", ALIAS], env)
    url = f"http://127.0.0.1:{port}"
    wait_for(f"{url}/health", process, 300)
    return process, url


def start_router(binary: str, policy: str, workers: list[str]) -> tuple[subprocess.Popen, str]:
    port = free_port()
    path = shutil.which(binary) or shutil.which(binary, path=str(Path(sys.executable).parent))
    process = start([path, *ROUTER_SUBCOMMAND[binary], "--host", "127.0.0.1", "--port", str(port),
                     "--prometheus-port", str(free_port()), "--policy", policy,
                     "--worker-urls", *workers])
    url = f"http://127.0.0.1:{port}"
    wait_for(f"{url}/v1/models", process, 60, ALIAS)
    return process, url


def opening(conversation: int) -> str:
    topic = TOPICS[conversation % len(TOPICS)]
    facts = " ".join(f"Fact {i} about {topic}: item {conversation}-{i} matters for reason {i * 7}."
                     for i in range(10))
    return f"Conversation {conversation}. Let us talk about {topic}. {facts} What stands out?"


def converse(router: str, conversation: int, turns: int) -> list[dict]:
    """One conversation's turns in order; the usage block of each response."""
    messages, usages = [{"role": "user", "content": opening(conversation)}], []
    for turn in range(turns):
        response = httpx.post(f"{router}/v1/chat/completions", timeout=300, json={
            "model": ALIAS, "messages": messages, "max_tokens": ANSWER_TOKENS,
            "temperature": 0})
        response.raise_for_status()
        body = response.json()
        usages.append(body["usage"])
        messages += [{"role": "assistant", "content": body["choices"][0]["message"]["content"]},
                     {"role": "user", "content": f"Turn {turn + 1}: tell me more about point "
                                                 f"{turn + 2} of conversation {conversation}."}]
    return usages


def requests_served(url: str) -> float:
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith("sparkinfer_requests_total "):
            return float(line.split()[-1])
    raise KeyError("sparkinfer_requests_total")


def run(binary: str, policy: str, workers: list[str], conversations: int, turns: int) -> dict:
    router, url = start_router(binary, policy, workers)
    try:
        httpx.post(f"{url}/flush_cache", timeout=60).raise_for_status()
        before = [requests_served(w) for w in workers]
        with ThreadPoolExecutor(conversations) as pool:
            usages = [u for conv in pool.map(lambda c: converse(url, c, turns),
                                             range(conversations)) for u in conv]
        prompt = sum(u["prompt_tokens"] for u in usages)
        cached = sum((u.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
                     for u in usages)
        return {"router": binary, "policy": policy, "requests": len(usages),
                "prompt_tokens": prompt, "cached_tokens": cached,
                "cached_share": round(cached / prompt, 4),
                "per_replica": [requests_served(w) - b for w, b in zip(workers, before)]}
    finally:
        stop(router, signal.SIGINT)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--router", default="smg", choices=sorted(ROUTER_SUBCOMMAND))
    parser.add_argument("--policy", nargs="+", default=["cache_aware", "round_robin"])
    parser.add_argument("--conversations", type=int, default=6)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    replicas = [start_replica() for _ in range(2)]
    results = []
    try:
        workers = [url for _, url in replicas]
        for repeat in range(args.repeats):
            for policy in args.policy:
                result = run(args.router, policy, workers, args.conversations, args.turns)
                results.append({"repeat": repeat, **result})
                print(json.dumps(results[-1]), flush=True)
                if args.out:
                    args.out.write_text(json.dumps(results, indent=1) + "\n")
    finally:
        for process, _ in replicas:
            stop(process)


if __name__ == "__main__":
    main()
