"""The CPU decode records of a GGUF's weights (quant_packed.pack), kept on disk between runs.

Packing every linear of a model takes seconds (3.7 s for Qwen2.5-Coder-0.5B on 2 cores) and
gives the same bytes each time, so the first load writes them to one file in the user's cache,
and later loads map that file read-only instead of packing. The file is named after what decides
its content: the GGUF's identity (resolved path, size, mtime), the record layouts and their
arrangement (quant_packed.PACKING_VERSION: a change there yields a new name). A file that is
missing, stale, truncated or corrupt (its header, sizes or crc32 disagree) is ignored and
rewritten, so the cache can only cost time.

    [8 bytes: header length] [JSON header] [zero padding to 64] [records of each weight, 64-aligned]
"""

from __future__ import annotations

import glob
import hashlib
import json
import logging
import os
import struct
import tempfile
import zlib
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from sparkinfer_cli.kernels.cpu.quant_packed import (
    LAYOUTS,
    PACKING_VERSION,
    RECORD_ELEMENTS,
    PackedWeight,
)
from sparkinfer_cli.paths import user_cache_dir

if TYPE_CHECKING:
    from sparkinfer_cli.model.base import CausalLM

log = logging.getLogger(__name__)
FORMAT_VERSION = 1  # of this file's layout; the record layouts are keyed separately
_ALIGN = 64
_LENGTH = struct.Struct("<Q")


def packed_cache_dir() -> Path:
    return user_cache_dir() / "packed"


def cache_file(gguf_path: Path, root: Path | None = None) -> Path:
    """Where the records of this version of `gguf_path` live."""
    path = gguf_path.resolve()
    st = path.stat()
    identity = json.dumps([FORMAT_VERSION, PACKING_VERSION, str(path), st.st_size,
                           st.st_mtime_ns, sorted((t, repr(lay)) for t, lay in LAYOUTS.items())])
    digest = hashlib.sha256(identity.encode()).hexdigest()[:16]
    return (root or packed_cache_dir()) / f"{path.stem}-{digest}.packed"


def load_packed(file: Path, expected: Mapping[str, tuple[int, int, int]]
                ) -> dict[str, PackedWeight]:
    """The stored records, read-only and memory-mapped, when `file` holds exactly the weights
    `expected` names (name → (ggml type, ne0, rows)) intact; {} otherwise."""
    try:
        header, data_start = _read_header(file)
        mapped = np.memmap(file, np.uint8, mode="r")
        weights = dict(_entries(header, mapped, data_start, expected))
    except (OSError, ValueError, KeyError, TypeError, struct.error) as exc:
        if file.exists():
            log.warning("ignoring the repacked-weight cache %s (%s): repacking", file, exc)
        return {}
    return weights


def save_packed(file: Path, weights: Mapping[str, PackedWeight], source: Path) -> None:
    """Writes the records of the GGUF `source` atomically (a temp file renamed into place) and
    removes the records of its earlier versions; a failure to write only logs: the next load
    repacks."""
    try:
        file.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=file.parent, suffix=".partial")
        try:
            with os.fdopen(fd, "wb") as out:
                _write(out, weights, str(source.resolve()))
            os.replace(tmp, file)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        _remove_earlier_versions(file, str(source.resolve()))
    except OSError as exc:
        log.warning("could not write the repacked-weight cache %s: %s", file, exc)


def _remove_earlier_versions(file: Path, source: str) -> None:
    """Other files of the same name stem that hold records of `source` (it changed since)."""
    stem = file.name.rsplit("-", 1)[0]
    for other in file.parent.glob(f"{glob.escape(stem)}-*.packed"):
        try:
            if other != file and _read_header(other)[0].get("source") == source:
                other.unlink()
        except (OSError, ValueError, KeyError, struct.error):
            continue  # someone else's, or damaged: a later save or a person removes it


def _write(out, weights: Mapping[str, PackedWeight], source: str) -> None:
    entries, offset, crc = {}, 0, 0
    for name, w in weights.items():
        offset = _aligned(offset)
        entries[name] = {"offset": offset, "shape": list(w.records.shape), "ne0": w.ne0,
                         "type": _ggml_type(w)}
        offset += w.records.nbytes
        crc = zlib.crc32(np.ascontiguousarray(w.records).data, crc)
    header = json.dumps({"version": FORMAT_VERSION, "source": source, "size": offset,
                         "crc32": crc, "entries": entries}).encode()
    out.write(_LENGTH.pack(len(header)) + header)
    out.write(bytes(_aligned(out.tell()) - out.tell()))
    data_start = out.tell()
    for name, w in weights.items():
        out.write(bytes(data_start + entries[name]["offset"] - out.tell()))
        out.write(np.ascontiguousarray(w.records).data)


def _read_header(file: Path) -> tuple[dict, int]:
    with open(file, "rb") as f:
        (length,) = _LENGTH.unpack(f.read(_LENGTH.size))
        if length > 1 << 26:
            raise ValueError(f"header length {length}")
        header = json.loads(f.read(length))
    if header["version"] != FORMAT_VERSION:
        raise ValueError(f"format version {header['version']}")
    data_start = _aligned(_LENGTH.size + length)
    if file.stat().st_size != data_start + header["size"]:
        raise ValueError("truncated")
    return header, data_start


def _entries(header: dict, mapped: np.ndarray, data_start: int,
             expected: Mapping[str, tuple[int, int, int]]) -> Iterator[tuple[str, PackedWeight]]:
    entries = header["entries"]
    if set(entries) != set(expected):
        raise ValueError("it holds other weights")
    crc = 0
    for name, e in entries.items():
        rows, row_bytes = e["shape"]
        ggml_type, ne0 = expected[name][:2]
        if [ggml_type, ne0, rows, row_bytes] != [e["type"], e["ne0"], expected[name][2],
                                                  ne0 // RECORD_ELEMENTS * LAYOUTS[ggml_type].size]:
            raise ValueError(f"{name} changed")
        start = data_start + e["offset"]
        records = mapped[start:start + rows * row_bytes].reshape(rows, row_bytes)
        crc = zlib.crc32(records.data, crc)
        yield name, PackedWeight(records, e["ne0"], LAYOUTS[e["type"]])
    if crc != header["crc32"]:
        raise ValueError("checksum mismatch")


def _ggml_type(w: PackedWeight) -> int:
    return next(t for t, lay in LAYOUTS.items() if lay == w.layout)


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def use_cached_int8_decode(model: CausalLM, gguf_path: Path, root: Path | None = None,
                           report: Callable[[str], None] = lambda _: None) -> bool:
    """model.use_int8_decode() with its records from the cache when it has them (True), else
    packed and stored for the next load (False). Q8_0 weights are used in place, never stored.
    `report` hears which of the two is under way."""
    expected = {lin.weight.name: (lin.weight.ggml_type, lin.weight.ne0, lin.weight.shape[1])
                for lin in model.packable_linears() if not LAYOUTS[lin.weight.ggml_type].is_q8}
    file = cache_file(gguf_path, root)
    stored = load_packed(file, expected) if expected else {}
    if expected:
        report(f"mapping the repacked weights from {file}" if stored else
               "repacking the weights for the CPU kernels (once: kept in the cache for later "
               "runs)")
    packed = model.use_int8_decode(stored)
    if expected and not stored:
        save_packed(file, {name: packed[name] for name in expected}, gguf_path)
    return bool(stored)
