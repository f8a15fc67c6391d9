"""The typed packages (pyproject's [tool.mypy] files: engine, server, model) check clean."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parent.parent


def test_mypy_finds_no_errors_in_the_typed_packages() -> None:
    run = subprocess.run([sys.executable, "-m", "mypy", "--no-error-summary"], cwd=ROOT,
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout + run.stderr
