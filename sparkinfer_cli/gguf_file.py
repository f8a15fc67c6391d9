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

from sparkinfer_cli.ggml_types import BLOCK_GEOMETRY, GGMLType, tensor_bytes, type_name

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

# GGUF metadata value types → struct format (scalars)
_SCALAR_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q",
                   11: "q", 12: "d"}
_NUMPY_DTYPES = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32,
                 6: np.float32, 7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
_STRING, _ARRAY = 8, 9


class GGUFError(ValueError):
    """A GGUF file that cannot be used; the message names the file and what is wrong."""


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

    def take(self, n: int) -> memoryview:
        if self.pos + n > len(self.buf):
            raise GGUFError(f"{self.path}: truncated file (header needs byte {self.pos + n}, "
                            f"file has {len(self.buf)})")
        out = self.buf[self.pos:self.pos + n]
        self.pos += n
        return out

    def scalar(self, fmt: str) -> Any:
        size = struct.calcsize("<" + fmt)
        return struct.unpack_from("<" + fmt, self.take(size))[0]

    def string(self) -> str:
        n = self.scalar("Q")
        return bytes(self.take(n)).decode("utf-8", errors="replace")

    def value(self, vtype: int) -> Any:
        if vtype in _SCALAR_FORMATS:
            return self.scalar(_SCALAR_FORMATS[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            return self.array()
        raise GGUFError(f"{self.path}: unknown metadata value type {vtype} at byte {self.pos}")

    def array(self) -> Any:
        etype, count = self.scalar("I"), self.scalar("Q")
        if etype in _NUMPY_DTYPES:
            dtype = np.dtype(_NUMPY_DTYPES[etype]).newbyteorder("<")
            raw = self.take(count * dtype.itemsize)
            return np.frombuffer(raw, dtype=dtype).tolist()
        if etype == _STRING:
            return self.string_array(count)
        return [self.value(etype) for _ in range(count)]

    def string_array(self, count: int) -> list[str]:
        out, buf, pos = [], self.buf, self.pos
        unpack = struct.Struct("<Q").unpack_from
        for _ in range(count):
            (n,) = unpack(buf, pos)
            out.append(bytes(buf[pos + 8:pos + 8 + n]).decode("utf-8", errors="replace"))
            pos += 8 + n
        if pos > len(buf):
            raise GGUFError(f"{self.path}: truncated file inside a string array")
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
        cur = _Cursor(memoryview(self._mmap), self.path)
        if len(self._mmap) < 4 or bytes(cur.take(4)) != GGUF_MAGIC:
            raise GGUFError(f"{self.path}: not a GGUF file (bad magic)")
        version = cur.scalar("I")
        if version not in (2, 3):
            raise GGUFError(f"{self.path}: unsupported GGUF version {version} (need 2 or 3)")
        n_tensors, n_kv = cur.scalar("Q"), cur.scalar("Q")
        for _ in range(n_kv):
            key = cur.string()
            self.metadata[key] = cur.value(cur.scalar("I"))
        raw_infos = []
        for _ in range(n_tensors):
            name = cur.string()
            n_dims = cur.scalar("I")
            shape = tuple(cur.scalar("Q") for _ in range(n_dims))
            raw_infos.append((name, shape, cur.scalar("I"), cur.scalar("Q")))
        alignment = int(self.metadata.get("general.alignment", DEFAULT_ALIGNMENT))
        data_start = -(-cur.pos // alignment) * alignment
        for name, shape, ggml_type, rel in raw_infos:
            self.tensors[name] = self._tensor_info(name, shape, ggml_type, data_start + rel)

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

    # ---- access --------------------------------------------------------------------------------
    @property
    def architecture(self) -> str:
        arch = self.metadata.get("general.architecture")
        if not isinstance(arch, str):
            raise GGUFError(f"{self.path}: metadata has no general.architecture")
        return arch

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

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
