"""Routes and serve settings that clients of llama-server, vLLM and browsers rely on (issue 31,
item 10): un-prefixed aliases, /v1/detokenize, --alias / --served-model-name and CORS, over a
real socket against the FakeEngine (one character per token, server_fakes.CharTokenizer)."""

from __future__ import annotations

from pathlib import Path

import httpx
import openai
import pytest
from test_admission import assert_openai_error
from test_chat import user
from typer.testing import CliRunner

from sparkinfer_cli import cli, env
from sparkinfer_cli.hub import download as hub
from sparkinfer_cli.server import app as server_app
from sparkinfer_cli.server.config import ServerConfig

ORIGIN = "http://app.example:3000"
PREFLIGHT = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "authorization, content-type, x-stainless-os"}


# ---------------------------------------------------------------- un-prefixed aliases


def test_unprefixed_aliases_answer_like_the_v1_routes(server) -> None:
    bare = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0)
    v1 = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
    assert bare.models.list().data == v1.models.list().data
    chat = bare.chat.completions.create(model="m", messages=user("abc"))
    assert chat.choices[0].message.content == "You said: abc"
    legacy = bare.completions.create(model="m", prompt="x", max_tokens=3)
    assert legacy.choices[0].text == "You"


def test_unprefixed_aliases_need_the_api_key(make_server) -> None:
    srv = make_server(config={"api_key": "sekret"})
    key = {"Authorization": "Bearer sekret"}
    for path in ("/models", "/models/"):
        assert_openai_error(httpx.get(f"{srv.url}{path}"), 401, "invalid_api_key")
        assert httpx.get(f"{srv.url}{path}", headers=key).status_code == 200
    for path, body in (("/chat/completions", {"messages": user("x")}),
                       ("/completions", {"prompt": "x"})):
        assert_openai_error(httpx.post(f"{srv.url}{path}", json=body), 401, "invalid_api_key")
        assert httpx.post(f"{srv.url}{path}", json=body, headers=key).status_code == 200
    assert httpx.get(f"{srv.url}/health").status_code == 200  # still open


# ---------------------------------------------------------------- /v1/detokenize


def test_detokenize_inverts_tokenize(server) -> None:
    text = "héllo, wörld ✓"
    ids = httpx.post(f"{server.base_url}/tokenize", json={"content": text}).json()["tokens"]
    response = httpx.post(f"{server.base_url}/detokenize", json={"tokens": ids})
    assert response.status_code == 200 and response.json() == {"content": text}
    for no_tokens in ({}, {"tokens": None}):  # llama-server: no tokens, no text
        assert httpx.post(f"{server.base_url}/detokenize", json=no_tokens).json() == \
            {"content": ""}


@pytest.mark.parametrize("tokens", [[104, -1], [0x110000], ["a"], [True], [1.5], "abc", 104])
def test_detokenize_rejects_what_is_not_a_token_id(server, tokens) -> None:
    response = httpx.post(f"{server.base_url}/detokenize", json={"tokens": tokens})
    assert assert_openai_error(response, 400)["param"] == "tokens"


def test_detokenize_needs_the_api_key(make_server) -> None:
    srv = make_server(config={"api_key": "sekret"})
    url, body = f"{srv.base_url}/detokenize", {"tokens": [104, 105]}
    assert_openai_error(httpx.post(url, json=body), 401, "invalid_api_key")
    granted = httpx.post(url, json=body, headers={"Authorization": "Bearer sekret"})
    assert granted.json() == {"content": "hi"}


# ---------------------------------------------------------------- --alias / --served-model-name


def test_the_alias_is_the_model_id_clients_see(make_server) -> None:
    srv = make_server(config={"model_name": "team/chat-model"})
    client = openai.OpenAI(base_url=srv.base_url, api_key="unused", max_retries=0)
    assert [m.id for m in client.models.list().data] == ["team/chat-model"]
    assert client.models.retrieve("team/chat-model").id == "team/chat-model"
    unnamed = httpx.post(f"{srv.base_url}/chat/completions", json={"messages": user("x")})
    assert unnamed.json()["model"] == "team/chat-model"
    # a request naming another model is served and echoed, as before the alias existed
    assert client.completions.create(model="other", prompt="x").model == "other"


def test_the_alias_comes_from_the_flag_else_the_environment_else_the_file() -> None:
    environ = {"SPARKINFER_SERVED_MODEL_NAME": "from-env"}
    assert ServerConfig.from_env(environ, model_name="from-flag",
                                 fallback_model_name="from-file").model_name == "from-flag"
    assert ServerConfig.from_env(environ, fallback_model_name="from-file").model_name == \
        "from-env"
    assert ServerConfig.from_env({}, fallback_model_name="from-file").model_name == "from-file"
    with pytest.raises(ValueError, match="model_name"):
        ServerConfig.from_env({}, model_name="")


# ---------------------------------------------------------------- CORS


def test_cors_is_off_by_default(server) -> None:
    preflight = httpx.options(f"{server.base_url}/chat/completions", headers=PREFLIGHT)
    assert preflight.status_code == 405
    assert "access-control-allow-origin" not in preflight.headers
    models = httpx.get(f"{server.base_url}/models", headers={"Origin": ORIGIN})
    assert "access-control-allow-origin" not in models.headers


def test_cors_answers_preflights_and_marks_responses_of_allowed_origins(make_server) -> None:
    srv = make_server(config={"cors_origins": (ORIGIN,), "api_key": "sekret"})
    url = f"{srv.base_url}/chat/completions"
    preflight = httpx.options(url, headers=PREFLIGHT)  # browsers send no key on a preflight
    assert preflight.status_code == 204
    assert preflight.headers["access-control-allow-origin"] == ORIGIN
    assert "POST" in preflight.headers["access-control-allow-methods"]
    assert preflight.headers["access-control-allow-headers"] == PREFLIGHT[
        "Access-Control-Request-Headers"]
    assert preflight.headers["vary"] == "Origin"
    body = {"messages": user("x")}
    allowed = {"Origin": ORIGIN, "Authorization": "Bearer sekret"}
    for stream in (False, True):
        answer = httpx.post(url, json={**body, "stream": stream}, headers=allowed)
        assert answer.status_code == 200 and \
            answer.headers["access-control-allow-origin"] == ORIGIN
    refused = httpx.post(url, json=body, headers={"Origin": ORIGIN})  # readable by the page
    assert refused.status_code == 401 and refused.headers["access-control-allow-origin"] == ORIGIN
    stranger = {**PREFLIGHT, "Origin": "http://evil.example"}
    assert "access-control-allow-origin" not in httpx.options(url, headers=stranger).headers
    assert "access-control-allow-origin" not in httpx.post(
        url, json=body, headers={**allowed, "Origin": "http://evil.example"}).headers


def test_cors_wildcard_allows_every_origin(make_server) -> None:
    srv = make_server(config={"cors_origins": ("*",)})
    preflight = httpx.options(f"{srv.url}/models", headers=PREFLIGHT)
    assert preflight.status_code == 204 and preflight.headers["access-control-allow-origin"] == "*"
    models = httpx.get(f"{srv.url}/models", headers={"Origin": "http://any.example"})
    assert models.headers["access-control-allow-origin"] == "*"


@pytest.mark.parametrize("raw, expected", [
    ("http://a.example, HTTPS://B.example:8443", ("http://a.example", "https://b.example:8443")),
    ("*", ("*",)),
    ("", ()),
])
def test_cors_origins_parse(raw: str, expected: tuple[str, ...]) -> None:
    assert env.SPARKINFER_CORS_ORIGINS.get({"SPARKINFER_CORS_ORIGINS": raw}) == expected
    assert ServerConfig.from_env({"SPARKINFER_CORS_ORIGINS": raw}).cors_origins == expected


@pytest.mark.parametrize("raw", ["http://a.example/", "a.example", "http://a.example/path"])
def test_an_origin_with_a_path_or_no_scheme_is_refused(raw: str) -> None:
    # a browser's Origin header never has a path: such an entry would silently match nothing
    with pytest.raises(env.EnvError, match="SPARKINFER_CORS_ORIGINS"):
        env.SPARKINFER_CORS_ORIGINS.get({"SPARKINFER_CORS_ORIGINS": raw})


# ---------------------------------------------------------------- the serve command's flags


@pytest.fixture
def served(monkeypatch) -> dict:
    """What `sparkinfer serve` hands run_server, without loading a model."""
    calls: dict = {}
    tiny = Path(__file__).parents[1] / "fixtures" / "tiny" / "qwen3" / "qwen3-Q8_0.gguf"
    monkeypatch.setattr(hub, "resolve_model", lambda model, prefer_gpu, **_: (tiny, None))
    monkeypatch.setenv("PORT", "0")  # serve checks its address before it starts: any free port
    monkeypatch.setattr(server_app, "run_server",
                        lambda *args, **kwargs: calls.update(args=args, kwargs=kwargs))
    return calls


@pytest.mark.parametrize("alias_flag", ["--alias", "--served-model-name"])
def test_serve_passes_the_alias_and_cors_origins(served, alias_flag: str) -> None:
    result = CliRunner().invoke(cli.app, ["serve", "--device", "cpu", alias_flag, "my-model",
                                          "--cors-origins", f"{ORIGIN},http://b.example"])
    assert result.exit_code == 0, result.output
    assert served["kwargs"]["model_name"] == "my-model"
    assert served["kwargs"]["cors_origins"] == (ORIGIN, "http://b.example")


def test_serve_leaves_unset_flags_to_the_environment(served) -> None:
    result = CliRunner().invoke(cli.app, ["serve", "--device", "cpu"])
    assert result.exit_code == 0, result.output
    assert served["kwargs"]["model_name"] is None and served["kwargs"]["cors_origins"] is None


def test_serve_refuses_a_bad_origin_naming_the_flag(served) -> None:
    result = CliRunner().invoke(cli.app, ["serve", "--device", "cpu",
                                          "--cors-origins", "http://a.example/"])
    assert result.exit_code == 1 and "--cors-origins" in result.output and not served
