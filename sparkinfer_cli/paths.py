"""Where sparkinfer keeps files of its own: the user's cache (demo models, repacked weights) and
data (benchmark results) directories, so that no command writes into the working directory
unasked."""

from __future__ import annotations

import os
from pathlib import Path


def user_cache_dir() -> Path:
    """$SPARKINFER_CACHE_DIR, else ~/.cache/sparkinfer."""
    return Path(os.environ.get("SPARKINFER_CACHE_DIR") or Path.home() / ".cache" / "sparkinfer")


def user_data_dir() -> Path:
    """$XDG_DATA_HOME/sparkinfer, else ~/.local/share/sparkinfer."""
    return Path(os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share") / "sparkinfer"


def bench_results_dir() -> Path:
    """Where `sparkinfer bench` writes unless --out says otherwise."""
    return user_data_dir() / "bench-results"
