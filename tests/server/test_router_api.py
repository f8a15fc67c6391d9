"""The endpoints request routers read (server/router_api.py), over a real socket against the
FakeEngine: load figures in vllm-router's and smg's shapes, model and server facts under both
spellings, /flush_cache, /health_generate, and which of them need the API key."""

from __future__ import annotations

import httpx
import pytest
from test_admission import assert_openai_error, metric, wait_until

from sparkinfer_cli.engine.sampling_params import SamplingParams
from sparkinfer_cli.server import router_api

KEY = {"Authorization": "Bearer sekret"}
OPEN_PATHS = ("/get_load", "/model_info", "/get_model_info", "/server_info", "/get_server_info",
              "/health_generate")
VLLM_LABELS = '{engine="0",model_name="sparkinfer"}'


def endless_reply(prompt: str, params: object) -> str:
    return "x" * 10_000  # the request runs until max_tokens, or its abort


@pytest.fixture
def busy(make_server):
    """A server whose engine runs one request at a time and holds three: one running, two
    waiting, each reserving (10 + 214) / 16 = 14 KV blocks."""
    srv = make_server(reply=endless_reply, token_delay_s=0.05, max_num_seqs=1)
    ids = [srv.engine.submit([ord("a")] * 10, SamplingParams(max_tokens=214), lambda event: None)
           for _ in range(3)]
    wait_until(lambda: len(srv.engine.running) == 1)
    yield srv
    for request_id in ids:
        srv.engine.abort(request_id)


def test_get_load_gives_vllm_router_the_requests_the_engine_holds(busy) -> None:
    load = httpx.get(f"{busy.url}/get_load").json()
    assert load["load"] == 3
    assert (load["num_running_reqs"], load["num_waiting_reqs"]) == (1, 2)


def test_v1_loads_is_one_sglang_scheduler_snapshot(busy) -> None:
    body = httpx.get(f"{busy.url}/v1/loads?include=core,disagg,queues,memory").json()
    assert body["dp_rank_count"] == 1 and body["timestamp"]
    (snapshot,) = body["loads"]
    total_tokens = busy.engine.total_blocks * busy.engine.block_size
    assert snapshot == {"dp_rank": 0, "num_running_reqs": 1, "num_waiting_reqs": 2,
                        "num_total_reqs": 3, "num_used_tokens": 14 * 16,
                        "max_total_num_tokens": total_tokens, "token_usage": 14 * 16 / total_tokens,
                        "cache_hit_rate": 0.0, "max_running_requests": 1}


def test_load_figures_match_the_vllm_metrics(busy) -> None:
    """The load endpoints and /metrics read the same engine: routers and dashboards agree."""
    snapshot = httpx.get(f"{busy.url}/v1/loads").json()["loads"][0]
    for vllm_name, ours in (("num_requests_running", "num_running_reqs"),
                            ("num_requests_waiting", "num_waiting_reqs"),
                            ("kv_cache_usage_perc", "token_usage")):
        assert metric(busy.url, f"vllm:{vllm_name}{VLLM_LABELS}") == snapshot[ours]


def test_an_idle_server_reports_no_load(server) -> None:
    assert httpx.get(f"{server.url}/get_load").json()["load"] == 0
    snapshot = httpx.get(f"{server.url}/v1/loads").json()["loads"][0]
    assert snapshot["num_used_tokens"] == 0 and snapshot["token_usage"] == 0.0


def test_model_and_server_info_answer_under_both_spellings(make_server) -> None:
    srv = make_server(config={"model_name": "org/tiny"}, ctx=2048, max_num_seqs=8)
    model_info = httpx.get(f"{srv.url}/model_info").json()
    assert httpx.get(f"{srv.url}/get_model_info").json() == model_info
    assert model_info["served_model_name"] == model_info["model_path"] == "org/tiny"
    assert model_info["is_generation"] is True and model_info["context_length"] == 2048
    server_info = httpx.get(f"{srv.url}/server_info").json()
    assert httpx.get(f"{srv.url}/get_server_info").json() == server_info
    assert server_info["served_model_name"] == "org/tiny"
    assert (server_info["context_length"], server_info["max_total_num_tokens"]) == (2048, 2048)
    assert (server_info["dp_size"], server_info["max_running_requests"]) == (1, 8)


def test_flush_cache_asks_the_engine_to_drop_its_prefix_cache(make_server) -> None:
    srv = make_server()
    response = httpx.post(f"{srv.url}/flush_cache")
    assert response.status_code == 200
    assert response.json() == {"status": "ok", "freed_kv_blocks": 0}
    assert srv.engine.num_cache_flushes == 1
    assert httpx.get(f"{srv.url}/flush_cache").status_code == 405


def test_flush_cache_on_a_stopped_engine_is_a_503(make_server) -> None:
    srv = make_server()
    srv.engine.shutdown()
    assert_openai_error(httpx.post(f"{srv.url}/flush_cache"), 503, "engine_stopped")


def test_only_flush_cache_and_v1_loads_need_the_api_key(make_server) -> None:
    srv = make_server(config={"api_key": "sekret"})
    for path in ("/flush_cache", "/flush_cache/"):
        assert_openai_error(httpx.post(f"{srv.url}{path}"), 401, "invalid_api_key")
    assert httpx.post(f"{srv.url}/flush_cache", headers=KEY).status_code == 200
    assert httpx.post(f"{srv.url}/flush_cache", headers={"x-api-key": "sekret"}).status_code == 200
    assert_openai_error(httpx.get(f"{srv.url}/v1/loads"), 401, "invalid_api_key")
    assert httpx.get(f"{srv.url}/v1/loads", headers=KEY).status_code == 200
    for path in OPEN_PATHS:  # read-only: routers and probes poll them without a key
        assert httpx.get(f"{srv.url}{path}").status_code == 200, path


def test_health_generate_runs_one_token_that_no_metric_counts(make_server) -> None:
    srv = make_server()
    requests = metric(srv.url, "sparkinfer_requests_total")
    assert httpx.get(f"{srv.url}/health_generate").json() == {"status": "ok"}
    ((request_id, prompt, params),) = srv.engine.submitted
    assert request_id.startswith("health-generate-") and params.max_tokens == 1
    assert metric(srv.url, "sparkinfer_requests_total") == requests
    successes = 'vllm:request_success_total{engine="0",finished_reason="length",' \
        'model_name="sparkinfer"}'
    assert metric(srv.url, successes) == 0


def test_health_generate_is_a_503_when_no_token_comes_in_time(make_server, monkeypatch) -> None:
    """The probe waits behind a long request past its timeout, then is aborted."""
    monkeypatch.setattr(router_api, "HEALTH_GENERATE_TIMEOUT_S", 0.2)
    srv = make_server(reply=endless_reply, token_delay_s=0.05, max_num_seqs=1)
    srv.engine.submit([ord("a")], SamplingParams(max_tokens=100), lambda event: None)
    response = httpx.get(f"{srv.url}/health_generate")
    assert response.status_code == 503
    assert response.json() == {"status": "unhealthy", "error": "no token within 0.2 s"}
    wait_until(lambda: any(r.startswith("health-generate-") for r in srv.engine.aborted))


@pytest.mark.parametrize("break_server", ["drain", "stop_engine", "fill_queue"])
def test_health_generate_is_a_503_when_the_server_cannot_generate(make_server,
                                                                  break_server) -> None:
    srv = make_server(reply=endless_reply, max_queue_depth=1, token_delay_s=0.05)
    if break_server == "drain":
        srv.state.engine.begin_drain()
    elif break_server == "stop_engine":
        srv.engine.shutdown()
    else:
        srv.engine.submit([ord("a")], SamplingParams(max_tokens=50), lambda event: None)
    response = httpx.get(f"{srv.url}/health_generate")
    assert response.status_code == 503
    assert response.json()["status"] == ("draining" if break_server == "drain" else "unhealthy")
