"""packed_cache: a model's CPU decode records stored on first load, mapped on the next, and
repacked whenever the stored file is stale or damaged."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from sparkinfer_cli.gguf.reader import GGUFFile
from sparkinfer_cli.model import packed_cache
from sparkinfer_cli.model.loader import load_model
from sparkinfer_cli.model.packed_cache import cache_file, use_cached_int8_decode

TINY_Q4_K_M = Path(__file__).parent.parent / "fixtures" / "tiny" / "qwen3" / "qwen3-Q4_K_M.gguf"


@pytest.fixture
def gguf(tmp_path) -> Path:
    copy = tmp_path / "model.gguf"
    shutil.copy(TINY_Q4_K_M, copy)
    return copy


def loaded(path: Path, root: Path) -> tuple[bool, dict[str, np.ndarray]]:
    """(whether the records came from the cache, each packed weight's records)."""
    model = load_model(GGUFFile(path), "cpu")
    hit = use_cached_int8_decode(model, path, root)
    return hit, {lin.weight.name: np.asarray(lin.packed.records)
                 for lin in model.packable_linears()}


def assert_same(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> None:
    assert a.keys() == b.keys() and a
    assert all(np.array_equal(a[name], b[name]) for name in a)


def test_the_second_load_maps_the_records_the_first_packed(gguf, tmp_path):
    hit, packed = loaded(gguf, tmp_path / "cache")
    assert not hit and cache_file(gguf, tmp_path / "cache").is_file()
    hit, mapped = loaded(gguf, tmp_path / "cache")
    assert hit
    assert_same(packed, mapped)
    assert not any(r.flags.writeable for r in mapped.values())


@pytest.mark.parametrize("damage", ["flip a record byte", "truncate", "garbage header"])
def test_a_damaged_cache_file_is_repacked_and_rewritten(gguf, tmp_path, damage):
    root = tmp_path / "cache"
    _, packed = loaded(gguf, root)
    file = cache_file(gguf, root)
    data = bytearray(file.read_bytes())
    if damage == "flip a record byte":
        data[-100] ^= 0xFF
    elif damage == "truncate":
        data = data[:len(data) // 2]
    else:
        data[:40] = b"\xff" * 40
    file.write_bytes(bytes(data))
    hit, repacked = loaded(gguf, root)
    assert not hit
    assert_same(packed, repacked)
    assert loaded(gguf, root)[0]  # rewritten whole


def test_a_changed_model_file_gets_its_own_records(gguf, tmp_path):
    root = tmp_path / "cache"
    loaded(gguf, root)
    before = cache_file(gguf, root)
    stat = gguf.stat()
    os.utime(gguf, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    assert cache_file(gguf, root) != before
    assert not loaded(gguf, root)[0]
    assert list(root.iterdir()) == [cache_file(gguf, root)]  # the stale records are gone


def test_records_of_another_packing_get_their_own_file(gguf, tmp_path, monkeypatch):
    """Records written by a build that arranged them differently are never mapped."""
    root = tmp_path / "cache"
    loaded(gguf, root)
    before = cache_file(gguf, root)
    monkeypatch.setattr(packed_cache, "PACKING_VERSION", packed_cache.PACKING_VERSION + 1)
    assert cache_file(gguf, root) != before
    assert not loaded(gguf, root)[0]


def test_an_unwritable_cache_only_costs_the_repack(gguf, tmp_path):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    assert not loaded(gguf, blocker)[0]
    assert not loaded(gguf, blocker)[0]


def test_the_report_says_whether_it_repacks_or_maps(gguf, tmp_path):
    heard: list[str] = []
    for _ in range(2):
        use_cached_int8_decode(load_model(GGUFFile(gguf), "cpu"), gguf, tmp_path / "cache",
                               report=heard.append)
    assert heard[0].startswith("repacking") and heard[1].startswith("mapping")
