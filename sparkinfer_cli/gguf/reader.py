"""GGUFFile: metadata, tensor table and zero-copy tensor bytes of a GGUF file.

The header is parsed here rather than with `gguf.GGUFReader`, which builds one numpy object per
vocabulary string and takes ~15 s on a 150k-token vocabulary; this parser takes well under a second.
Tensor data is a read-only `np.memmap`, so tensors are views, never copies.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from sparkinfer_cli.gguf.ggml_types import BLOCK_GEOMETRY, GGMLType, tensor_bytes, type_name

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
GGML_MAX_DIMS = 4
# GGUF nests arrays for no key we read; a bound keeps a hostile file from recursing unboundedly
MAX_ARRAY_DEPTH = 8

# GGUF metadata value types → struct format (scalars)
_SCALAR_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q",
                   11: "q", 12: "d"}
_NUMPY_DTYPES = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32,
                 6: np.float32, 7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
_STRING, _ARRAY = 8, 9
# the fewest bytes one value of a type takes: a string is its u64 length, an array its type + count
_MIN_VALUE_BYTES = {**{t: struct.calcsize("<" + f) for t, f in _SCALAR_FORMATS.items()},
                    _STRING: 8, _ARRAY: 12}
_MIN_KV_BYTES = 8 + 4 + 1  # key length, value type, a one-byte value
_MIN_TENSOR_INFO_BYTES = 8 + 4 + 8 + 4 + 8  # name length, n_dims, one dim, type, offset


class GGUFError(ValueError):
    """A GGUF file that cannot be used; the message names the file and what is wrong."""


class UnusableModelError(GGUFError):
    """A well-formed GGUF this engine cannot run (unsupported architecture, metadata it lacks):
    `inspect` still reports such a file, with the reason as a warning."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    ggml_type: int
    shape: tuple[int, ...]  # ggml order: ne0 (contiguous) first
    offset: int  # absolute byte offset in the file
    n_bytes: int

    @property
    def type_name(self) -> str:
        return type_name(self.ggml_type)

    @property
    def n_elements(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))


class _Cursor:
    def __init__(self, buf: memoryview, path: Path):
        self.buf, self.pos, self.path = buf, 0, path

    def error(self, what: str) -> GGUFError:
        return GGUFError(f"{self.path}: {what} (at byte {self.pos} of {len(self.buf)})")

    def need(self, n: int, what: str) -> None:
        """Raise unless `n` more bytes remain: counts are checked before anything is built."""
        if self.pos + n > len(self.buf):
            raise self.error(f"truncated or corrupt file: {what} needs {n:,} more bytes")

    def take(self, n: int) -> memoryview:
        self.need(n, "the header")
        out = self.buf[self.pos:self.pos + n]
        self.pos += n
        return out

    def scalar(self, fmt: str) -> Any:
        size = struct.calcsize("<" + fmt)
        return struct.unpack_from("<" + fmt, self.take(size))[0]

    def string(self) -> str:
        n = self.scalar("Q")
        self.need(n, f"a string of {n:,} bytes")
        return bytes(self.take(n)).decode("utf-8", errors="replace")

    def value(self, vtype: int, depth: int = 0) -> Any:
        if vtype in _SCALAR_FORMATS:
            return self.scalar(_SCALAR_FORMATS[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            return self.array(depth + 1)
        raise self.error(f"unknown metadata value type {vtype}")

    def array(self, depth: int) -> Any:
        if depth > MAX_ARRAY_DEPTH:
            raise self.error(f"metadata arrays nested more than {MAX_ARRAY_DEPTH} deep")
        etype, count = self.scalar("I"), self.scalar("Q")
        if etype not in _MIN_VALUE_BYTES:
            raise self.error(f"unknown metadata array element type {etype}")
        self.need(count * _MIN_VALUE_BYTES[etype], f"an array of {count:,} elements")
        if etype in _NUMPY_DTYPES:
            dtype = np.dtype(_NUMPY_DTYPES[etype]).newbyteorder("<")
            raw = self.take(count * dtype.itemsize)
            return np.frombuffer(raw, dtype=dtype).tolist()
        if etype == _STRING:
            return self.string_array(count)
        return [self.value(etype, depth) for _ in range(count)]

    def string_array(self, count: int) -> list[str]:
        out, buf, pos = [], self.buf, self.pos
        unpack = struct.Struct("<Q").unpack_from
        # NOTE: no per-string length check (150k strings): a length past the end fails the
        # next unpack or the slice (past 2^63), or leaves pos past the end
        try:
            for _ in range(count):
                (n,) = unpack(buf, pos)
                out.append(bytes(buf[pos + 8:pos + 8 + n]).decode("utf-8", errors="replace"))
                pos += 8 + n
        except (struct.error, OverflowError):
            pos = len(buf) + 1
        if pos > len(buf):
            raise self.error(f"truncated or corrupt file inside an array of {count:,} strings")
        self.pos = pos
        return out


class GGUFFile:
    """One GGUF file: `metadata` (key → python value), `tensors` (name → TensorInfo)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_file():
            raise GGUFError(f"{self.path}: no such file")
        try:
            self._mmap = np.memmap(self.path, dtype=np.uint8, mode="r")
        except (ValueError, OSError) as exc:  # empty file or unreadable
            raise GGUFError(f"{self.path}: cannot map file ({exc})") from exc
        self.metadata: dict[str, Any] = {}
        self.tensors: dict[str, TensorInfo] = {}
        self._parse()

    # ---- parsing -------------------------------------------------------------------------------
    def _parse(self) -> None:
        cur = _Cursor(memoryview(self._mmap.data), self.path)
        if len(self._mmap) < 4 or bytes(cur.take(4)) != GGUF_MAGIC:
            raise GGUFError(f"{self.path}: not a GGUF file (bad magic)")
        version = cur.scalar("I")
        if version not in (2, 3):
            raise GGUFError(f"{self.path}: unsupported GGUF version {version} (need 2 or 3)")
        n_tensors, n_kv = cur.scalar("Q"), cur.scalar("Q")
        if n_tensors == 0:
            raise GGUFError(f"{self.path}: the file holds no tensors")
        cur.need(n_kv * _MIN_KV_BYTES + n_tensors * _MIN_TENSOR_INFO_BYTES,
                 f"a header of {n_kv:,} metadata keys and {n_tensors:,} tensors")
        self._read_metadata(cur, n_kv)
        raw_infos = [self._read_tensor_info(cur) for _ in range(n_tensors)]
        alignment = self._alignment()
        data_start = -(-cur.pos // alignment) * alignment
        for name, shape, ggml_type, rel in raw_infos:
            if name in self.tensors:
                raise GGUFError(f"{self.path}: tensor {name!r} is listed twice")
            if rel % alignment:
                raise GGUFError(f"{self.path}: tensor {name!r} starts at data offset {rel}, "
                                f"not a multiple of the alignment {alignment}")
            self.tensors[name] = self._tensor_info(name, shape, ggml_type, data_start + rel)
        self._check_no_overlap()

    def _read_metadata(self, cur: _Cursor, n_kv: int) -> None:
        for _ in range(n_kv):
            key = cur.string()
            if key in self.metadata:
                raise cur.error(f"metadata key {key!r} appears twice")
            self.metadata[key] = cur.value(cur.scalar("I"))

    def _read_tensor_info(self, cur: _Cursor) -> tuple[str, tuple[int, ...], int, int]:
        name = cur.string()
        n_dims = cur.scalar("I")
        if not 1 <= n_dims <= GGML_MAX_DIMS:
            raise cur.error(f"tensor {name!r} has {n_dims} dimensions (1 to {GGML_MAX_DIMS})")
        shape = tuple(cur.scalar("Q") for _ in range(n_dims))
        if 0 in shape:
            raise cur.error(f"tensor {name!r} has a zero-sized dimension {list(shape)}")
        return name, shape, cur.scalar("I"), cur.scalar("Q")

    def _alignment(self) -> int:
        alignment = self.metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        is_power_of_two = isinstance(alignment, int) and not isinstance(alignment, bool) \
            and alignment > 0 and alignment & (alignment - 1) == 0
        if not is_power_of_two:
            raise GGUFError(f"{self.path}: general.alignment is {alignment!r}; "
                            "it must be a power of two")
        return alignment

    def _tensor_info(self, name: str, shape: tuple, ggml_type: int, offset: int) -> TensorInfo:
        if ggml_type not in BLOCK_GEOMETRY:
            raise GGUFError(f"{self.path}: tensor {name!r} has {type_name(ggml_type)}, "
                            "which this engine does not know")
        try:
            n_bytes = tensor_bytes(ggml_type, shape)
        except ValueError as exc:
            raise GGUFError(f"{self.path}: tensor {name!r}: {exc}") from exc
        if offset + n_bytes > len(self._mmap):
            raise GGUFError(f"{self.path}: truncated file: tensor {name!r} needs bytes "
                            f"{offset}..{offset + n_bytes}, file has {len(self._mmap)}")
        return TensorInfo(name, int(ggml_type), tuple(int(d) for d in shape), offset, n_bytes)

    def _check_no_overlap(self) -> None:
        by_offset = sorted(self.tensors.values(), key=lambda t: t.offset)
        for before, after in zip(by_offset, by_offset[1:]):
            if after.offset < before.offset + before.n_bytes:
                raise GGUFError(f"{self.path}: tensors {before.name!r} and {after.name!r} "
                                "overlap in the file")

    # ---- access --------------------------------------------------------------------------------
    @property
    def architecture(self) -> str:
        arch = self.metadata.get("general.architecture")
        if not isinstance(arch, str):
            raise GGUFError(f"{self.path}: metadata has no general.architecture")
        return arch

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def typed(self, key: str, kind: type, default: Any = None) -> Any:
        """metadata[key] when it is a `kind` (int: not a bool; float: any real number), `default`
        when absent; any other value is a GGUFError naming the key."""
        value = self.metadata.get(key, default)
        if value is default or _is_kind(value, kind):
            return value
        raise GGUFError(f"{self.path}: metadata key {key} is {_shown(value)}, "
                        f"expected {_KIND_NAMES[kind][0]}")

    def typed_list(self, key: str, kind: type, default: Any = None) -> Any:
        """metadata[key] when it is a list of `kind`, `default` when absent, else GGUFError."""
        value = self.metadata.get(key, default)
        if value is default or isinstance(value, list) and all(_is_kind(v, kind) for v in value):
            return value
        raise GGUFError(f"{self.path}: metadata key {key} is {_shown(value)}, "
                        f"expected a list of {_KIND_NAMES[kind][1]}")

    def arch_key(self, suffix: str, default: Any = None) -> Any:
        """`{arch}.{suffix}`, e.g. arch_key('block_count')."""
        return self.metadata.get(f"{self.architecture}.{suffix}", default)

    def tensor(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise GGUFError(f"{self.path}: missing tensor {name!r}") from None

    def raw(self, name: str) -> np.ndarray:
        """Zero-copy view of a tensor in numpy order (reversed ggml dims).

        F32/F16/F64/I* come back with their natural dtype; quantized types and BF16 as uint8 whose
        last axis is the bytes of one row.
        """
        info = self.tensor(name)
        buf = self._mmap[info.offset:info.offset + info.n_bytes]
        rows = tuple(reversed(info.shape[1:]))
        natural = {GGMLType.F32: np.float32, GGMLType.F16: np.float16, GGMLType.F64: np.float64,
                   GGMLType.I8: np.int8, GGMLType.I16: np.int16, GGMLType.I32: np.int32,
                   GGMLType.I64: np.int64}.get(GGMLType(info.ggml_type))
        if natural is not None:
            return buf.view(natural).reshape(rows + (info.shape[0],))
        return buf.reshape(rows + (info.n_bytes // max(1, int(np.prod(rows, dtype=np.int64))),))

    @property
    def n_bytes(self) -> int:
        return len(self._mmap)


# kind → (one, many) as messages say them
_KIND_NAMES = {int: ("an integer", "integers"), float: ("a number", "numbers"),
               str: ("a string", "strings"), bool: ("a boolean", "booleans")}


def _is_kind(value: Any, kind: type) -> bool:
    if kind in (int, float) and isinstance(value, bool):
        return False
    return isinstance(value, (int, float) if kind is float else kind)


def _shown(value: Any, limit: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "…"
