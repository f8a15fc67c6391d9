"""Weights: GGUF tensors handed out by name, with shape/type checks and an exhaustive-use check."""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from sparkinfer_cli.gguf.ggml_types import BLOCK_GEOMETRY, COMPUTE_TYPES, GGMLType
from sparkinfer_cli.gguf.reader import GGUFError, GGUFFile, TensorInfo


@dataclass(frozen=True)
class QTensor:
    """A weight in its GGUF encoding: `raw` is the zero-copy view GGUFFile.raw returns."""
    name: str
    ggml_type: int
    shape: tuple[int, ...]  # ggml order, ne0 (input features) first
    raw: np.ndarray
    offset: int | None = None  # where raw starts in the file, when raw is all of a file tensor

    @property
    def ne0(self) -> int:
        return self.shape[0]

    def select_rows(self, rows: np.ndarray, name: str) -> QTensor:
        """A 2-D tensor made of some output rows (whole encoded rows, so any ggml type)."""
        raw = np.ascontiguousarray(self.raw[rows])  # (len(rows), row units)
        return QTensor(name, self.ggml_type, (self.ne0, len(rows)), raw)

    def select_columns(self, lo: int, hi: int, name: str) -> QTensor:
        """A 2-D tensor made of input features lo .. hi of every row (whole blocks of its type:
        raw's last axis holds a row's elements or bytes, in proportion to the features)."""
        block = BLOCK_GEOMETRY[GGMLType(self.ggml_type)][0]
        if lo % block or hi % block or not 0 <= lo < hi <= self.ne0:
            raise ValueError(f"{self.name}: features {lo}..{hi} do not fall on its blocks")
        units = self.raw.shape[-1] // (self.ne0 // block)  # of raw's last axis a block
        raw = np.ascontiguousarray(self.raw[..., lo // block * units:hi // block * units])
        return QTensor(name, self.ggml_type, (hi - lo, *self.shape[1:]), raw)

    def as_f32(self) -> np.ndarray:
        """Small F32 tensors (norms, biases, ssm params) as a float32 array in numpy order."""
        if self.ggml_type != GGMLType.F32:
            from sparkinfer_cli.kernels.cpu.quant import dequantize
            return dequantize(self.raw, self.ggml_type, self.ne0)
        return np.asarray(self.raw)


class Weights:
    """Hands out the tensors of one file; everything not taken by the model is an error."""

    def __init__(self, gguf: GGUFFile, n_layer: int):
        self.gguf = gguf
        self.taken: set[str] = set()
        # NextN/MTP blocks past the trunk are never executed (multi-token prediction heads)
        self.ignored = {n for n in gguf.tensors if _block_index(n) >= n_layer}

    def has(self, name: str) -> bool:
        return name in self.gguf.tensors

    def get(self, name: str, shape: tuple[int, ...] | None = None) -> QTensor:
        info = expect_shape(self.gguf, name, shape)
        if info.ggml_type not in COMPUTE_TYPES:
            raise GGUFError(f"{self.gguf.path}: tensor {name!r} has type {info.type_name}, "
                            "which this engine cannot compute with yet "
                            f"(supported: {', '.join(sorted(t.name for t in COMPUTE_TYPES))})")
        self.taken.add(name)
        return QTensor(name, info.ggml_type, info.shape, self.gguf.raw(name), info.offset)

    def optional(self, name: str, shape: tuple[int, ...] | None = None) -> QTensor | None:
        return self.get(name, shape) if self.has(name) else None

    def check_all_used(self) -> None:
        unused = sorted(set(self.gguf.tensors) - self.taken - self.ignored)
        if unused:
            more = f" and {len(unused) - 5} more" if len(unused) > 5 else ""
            raise GGUFError(f"{self.gguf.path}: unexpected tensors for architecture "
                            f"{self.gguf.architecture}: {', '.join(unused[:5])}{more}")


def expect_shape(gguf: GGUFFile, name: str, shape: tuple[int, ...] | None) -> TensorInfo:
    """The tensor's info; GGUFError when it is missing or its shape is not `shape`."""
    info = gguf.tensor(name)  # raises "missing tensor"
    if shape is not None and tuple(info.shape) != tuple(shape):
        raise GGUFError(f"{gguf.path}: tensor {name!r} has shape {list(info.shape)}, "
                        f"expected {list(shape)}")
    return info


def _block_index(name: str) -> int:
    """The block a tensor belongs to; -1 for tensors outside the blocks."""
    m = re.match(r"blk\.(\d+)\.", name)
    return int(m.group(1)) if m else -1
