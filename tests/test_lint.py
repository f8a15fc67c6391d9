"""The whole tree lints clean under pyproject's [tool.ruff] rules (so that no change brings back
an over-long line or an unsorted import unnoticed)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parent.parent


def test_ruff_finds_nothing_in_the_tree() -> None:
    run = subprocess.run([sys.executable, "-m", "ruff", "check", "--output-format", "concise",
                          "."], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
