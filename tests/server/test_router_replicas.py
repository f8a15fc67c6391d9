"""Scale-out behind the routers people use: two `sparkinfer serve` replicas of the tiny qwen3 GGUF
(CPU, 127.0.0.1) behind vllm-router and behind smg, each a Rust binary from PyPI (the `routers`
extra). Round-robin spreads requests evenly, a killed replica costs no request, nor does one
drained by SIGTERM under a burst (the routers retry its 503s elsewhere), the routers' load views
carry our /get_load and /v1/loads figures, and a flush through the router reaches every replica's
prefix cache. Skipped where a router's binary is not on PATH."""

from __future__ import annotations

import shutil
import signal
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from server_harness import LoggedProcess, ProcessServer, free_port
from test_admission import metric, wait_until

MODEL = Path(__file__).resolve().parents[1] / "fixtures" / "tiny" / "qwen3" / "qwen3-Q8_0.gguf"
SERVED_NAME = "tiny"
REPLICA_CTX = 16384  # room for three requests of the model's whole 4096-token context
# smg's router is its `launch` subcommand, and its load monitor polls every 10 s unless told
ROUTER_SUBCOMMAND = {"vllm-router": [], "smg": ["launch"]}
ROUTER_OPTIONS = {"vllm-router": [], "smg": ["--load-monitor-interval", "1"]}
# the policy that keeps a session on one worker, and the request header that names the session
SESSION_POLICY = {"vllm-router": ("consistent_hash", "X-Session-ID"),
                  "smg": ("consistent_hashing", "X-SMG-Routing-Key")}
# where each router reads a replica's load, and what of it its own GET /get_loads shows
LOAD_SOURCE = {"vllm-router": "/get_load", "smg": "/v1/loads"}
RELAYED_FIELDS = {"vllm-router": ("load",), "smg": ("num_total_reqs", "token_usage")}
STARTUP_S = 300  # a cold numba cache compiles the CPU kernels first
ROUTER_STARTUP_S = 60
REQUEST_S = 120
pytestmark = pytest.mark.slow  # three server processes and two routers


def router_path(binary: str) -> str | None:
    """The router's console script: on PATH, or beside this interpreter (a venv not activated)."""
    return shutil.which(binary) or shutil.which(binary, path=str(Path(sys.executable).parent))


def start_replica(env: dict[str, str] | None = None) -> ProcessServer:
    return ProcessServer(["-m", "sparkinfer_cli", "serve", "-m", str(MODEL), "--device", "cpu",
                          "--alias", SERVED_NAME], {"CTX": str(REPLICA_CTX), **(env or {})},
                         STARTUP_S)


class RouterProcess(LoggedProcess):
    """A router binary on free ports over the given workers; ready once it lists our model."""

    stop_signal = signal.SIGINT  # smg drains first; both routers ignore SIGTERM for a while

    def __init__(self, binary: str, worker_urls: list[str], policy: str,
                 options: tuple[str, ...] = ()):
        self.binary, self.port = binary, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        args = [router_path(binary), *ROUTER_SUBCOMMAND[binary], "--host", "127.0.0.1",
                "--port", str(self.port), "--prometheus-port", str(free_port()),
                "--policy", policy, *ROUTER_OPTIONS[binary], *options,
                "--worker-urls", *worker_urls]
        super().__init__(args)
        try:
            wait_until(self._lists_our_model, ROUTER_STARTUP_S)
        except AssertionError:
            self.stop()
            raise

    def _lists_our_model(self) -> bool:
        assert self.proc.poll() is None, f"{self.binary} exited:\n{self.output()}"
        try:
            return SERVED_NAME in httpx.get(f"{self.url}/v1/models", timeout=2).text
        except httpx.TransportError:
            return False

    def complete(self, prompt: str, headers: dict[str, str] | None = None,
                 **fields) -> httpx.Response:
        return httpx.post(f"{self.url}/v1/completions", timeout=REQUEST_S, headers=headers,
                          json={"model": SERVED_NAME, "prompt": prompt, "max_tokens": 4,
                                "temperature": 0, **fields})



@pytest.fixture(params=["vllm-router", "smg"])
def router_binary(request) -> str:
    if router_path(request.param) is None:
        pytest.skip(f"{request.param} is not installed (pip install -e '.[routers]')")
    return request.param


@pytest.fixture(scope="module")
def replicas() -> Iterator[list[ProcessServer]]:
    with start_replica() as first, start_replica() as second:
        yield [first, second]


@pytest.fixture
def round_robin(router_binary, replicas) -> Iterator[RouterProcess]:
    router = RouterProcess(router_binary, [r.url for r in replicas], "round_robin")
    yield router
    router.stop()


def requests_served(replica: ProcessServer) -> float:
    return metric(replica.url, "sparkinfer_requests_total")


def test_round_robin_spreads_eight_requests_four_and_four(round_robin, replicas) -> None:
    before = [requests_served(r) for r in replicas]
    for i in range(8):
        assert round_robin.complete(f"request {i}").status_code == 200
    assert [requests_served(r) - b for r, b in zip(replicas, before)] == [4, 4]


def test_a_session_stays_on_one_replica(router_binary, replicas) -> None:
    policy, session_header = SESSION_POLICY[router_binary]
    router = RouterProcess(router_binary, [r.url for r in replicas], policy)
    try:
        for session in ("alice", "bob", "carol"):
            before = [requests_served(r) for r in replicas]
            for turn in range(4):
                response = router.complete(f"{session}, turn {turn}", {session_header: session})
                assert response.status_code == 200
            served = [requests_served(r) - b for r, b in zip(replicas, before)]
            assert sorted(served) == [0, 4], f"{session}'s turns went to {served}"
    finally:
        router.stop()


def test_the_load_view_of_the_router_carries_our_figures(round_robin, replicas) -> None:
    """Three long requests straight to the first replica: the router, asked for its workers'
    loads, reports what the replicas' /get_load (vllm-router) or /v1/loads (smg) say. A
    request's KV is reserved at admission, so the figures hold still while the three run."""
    busy, idle = replicas
    body = {"model": SERVED_NAME, "prompt": "hello", "max_tokens": 4000, "ignore_eos": True,
            "temperature": 0}
    with ThreadPoolExecutor(3) as pool:
        for _ in range(3):
            pool.submit(httpx.post, f"{busy.url}/v1/completions", json=body, timeout=REQUEST_S)
        wait_until(lambda: running(busy) == 3, REQUEST_S)
        expected = {r.url: replica_load(round_robin.binary, r) for r in (busy, idle)}
        assert expected[busy.url] != expected[idle.url]
        wait_until(lambda: router_loads(round_robin) == expected, REQUEST_S)


def running(replica: ProcessServer) -> int:
    return httpx.get(f"{replica.url}/v1/loads").json()["loads"][0]["num_running_reqs"]


def replica_load(binary: str, replica: ProcessServer) -> dict[str, float]:
    """What the replica reports to that router, less the fields the router does not relay."""
    body = httpx.get(f"{replica.url}{LOAD_SOURCE[binary]}").json()
    report = body["loads"][0] if binary == "smg" else body  # smg: one scheduler snapshot
    return {field: report[field] for field in RELAYED_FIELDS[binary]}


def router_loads(router: RouterProcess) -> dict[str, dict[str, float]]:
    """Each worker's load as the router's GET /get_loads reports it."""
    view = httpx.get(f"{router.url}/get_loads", timeout=10).json()
    return {entry["worker"]: {field: entry[field] for field in RELAYED_FIELDS[router.binary]}
            for entry in view["workers" if router.binary == "vllm-router" else "loads"]}


def test_a_flush_through_the_router_empties_every_prefix_cache(round_robin, replicas) -> None:
    for i in range(4):  # prompts of more than one KV block leave blocks in both caches
        assert round_robin.complete(f"a prompt long enough to fill a block {i} " * 4).is_success
    assert all(metric(r.url, "sparkinfer_prefix_cache_blocks") > 0 for r in replicas)
    assert httpx.post(f"{round_robin.url}/flush_cache", timeout=REQUEST_S).is_success
    assert [metric(r.url, "sparkinfer_prefix_cache_blocks") for r in replicas] == [0, 0]


def test_requests_still_succeed_with_one_replica_killed(router_binary, replicas) -> None:
    """A third replica, killed under the router: every request is answered by the survivor
    (the routers retry a failed worker elsewhere and then mark it unhealthy)."""
    survivor = replicas[0]
    with start_replica() as victim:
        router = RouterProcess(router_binary, [survivor.url, victim.url], "round_robin")
        try:
            victim.proc.kill()
            victim.wait(10)
            before = requests_served(survivor)
            assert all(router.complete(f"after the kill {i}").status_code == 200
                       for i in range(8))
            assert requests_served(survivor) - before == 8
        finally:
            router.stop()


# the drained replica's pool: 64 KV blocks, room for two of the burst's requests (26 blocks each,
# prompt + max_tokens reserved at admission), so the rest of its share waits in its queue
DRAINED_CTX, BURST, BURST_TOKENS = 1024, 16, 400
# retry the drained replica's 503s (both routers retry a 503 on another worker by default, up to
# 5 attempts: made explicit, with room to spare);
# smg's worker overload protection would leave the small replica out once its two requests hold
# 0.8 of its KV, so that nothing ever waits there
RETRIES = ("--retry-max-retries", "10", "--retry-initial-backoff-ms", "50",
           "--retry-max-backoff-ms", "1000")
DRAIN_OPTIONS = {"vllm-router": RETRIES,
                 "smg": (*RETRIES, "--disable-worker-overload-protection")}


def test_sigterm_to_one_replica_loses_no_request(router_binary, replicas) -> None:
    """A burst of 16 through the router, 8 to a replica that can run only two at once; SIGTERM
    to it while some of its requests wait: it answers those with 503 + Retry-After at once and
    finishes the running ones, and the router retries the 503s (and, once it has exited, the
    refused connections) on the survivor. Every client request gets its 200."""
    survivor = replicas[0]
    with start_replica({"CTX": str(DRAINED_CTX)}) as victim:
        router = RouterProcess(router_binary, [survivor.url, victim.url], "round_robin",
                               DRAIN_OPTIONS[router_binary])
        try:
            before = requests_served(survivor)
            with ThreadPoolExecutor(BURST) as pool:
                futures = [pool.submit(router.complete, f"burst {i}", max_tokens=BURST_TOKENS,
                                       ignore_eos=True) for i in range(BURST)]
                wait_until(lambda: waiting(victim) > 0, REQUEST_S)
                victim.signal(signal.SIGTERM)
                responses = [f.result() for f in futures]
            assert [r.status_code for r in responses] == [200] * BURST, \
                [r.text for r in responses if r.status_code != 200]
            assert all(r.json()["usage"]["completion_tokens"] == BURST_TOKENS for r in responses)
            assert victim.wait(REQUEST_S) == 0
            # the survivor took its own eight and the victim's queued ones
            assert requests_served(survivor) - before > BURST // 2
        finally:
            router.stop()


def waiting(replica: ProcessServer) -> int:
    return httpx.get(f"{replica.url}/v1/loads").json()["loads"][0]["num_waiting_reqs"]
