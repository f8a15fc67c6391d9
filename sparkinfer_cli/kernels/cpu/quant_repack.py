"""Lossless unpacking of ggml weight blocks into plain integer quants and float32 scales:

    q  int8    (rows, ne0)         the type's integer quant, offsets applied (Q5_0: nibble|bit - 16)
    d  float32 (rows, ne0 / g)     per sub-block scale (K-quants: d * sc, as ggml computes it)
    m  float32 (rows, ne0 / g)     per sub-block offset (Q4_1/Q5_1: m; K-quants: -dmin * mn), or
                                   (rows, 0) for types without one

so that q * d + m is ggml's dequantized value bit for bit; g = 32 (16 for Q6_K). quant_packed
builds its decode records from these unpackers (_UNPACK); repack() is their tested front door.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from gguf.quants import Q4_K as _GGUF_Q4_K

from sparkinfer_cli.gguf.ggml_types import BLOCK_GEOMETRY, row_bytes
from sparkinfer_cli.kernels.cpu.quant import _readonly
from sparkinfer_cli.kernels.cpu.quant_blocks import (
    Q4_0,
    Q4_1,
    Q4_K,
    Q5_0,
    Q5_1,
    Q5_K,
    Q6_K,
    Q8_0,
)


@dataclass(frozen=True)
class RepackedWeight:
    q: np.ndarray  # int8 (rows, ne0)
    d: np.ndarray  # float32 (rows, ne0 // group)
    m: np.ndarray  # float32 (rows, ne0 // group) or (rows, 0)
    group: int  # elements per scale: 32, or 16 for Q6_K

    @property
    def nbytes(self) -> int:
        return self.q.nbytes + self.d.nbytes + self.m.nbytes

    def dequantize(self) -> np.ndarray:
        """float32 (rows, ne0) = q * d (+ m), ggml's dequantized weight."""
        rows, ne0 = self.q.shape
        w = self.q.reshape(rows, -1, self.group).astype(np.float32) * self.d[:, :, None]
        if self.m.shape[1]:
            w = w + self.m[:, :, None]
        return w.reshape(rows, ne0)


# ---- unpacking: blocks (n, block_bytes) uint8 → q int8 (n, block), d and m (n, n_sub) ---------

def _f16(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)  # (n, 1)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """(n, 16) bytes → (n, 32): low nibbles are elements 0..15, high nibbles 16..31."""
    return np.concatenate([qs & 15, qs >> 4], axis=1)


def _bits32(qh: np.ndarray) -> np.ndarray:
    """(n, 4) bytes → (n, 32) bit i of the little-endian uint32, shifted to 16."""
    bits = np.ascontiguousarray(qh).view("<u4") >> np.arange(32, dtype=np.uint32)  # (n, 32)
    return ((bits & 1) << 4).astype(np.uint8)


def _legacy(b: np.ndarray, has_m: bool, has_qh: bool, bias: int):
    o = 4 if has_m else 2
    m = _f16(b[:, 2:4]) if has_m else None
    qh = _bits32(b[:, o:o + 4]) if has_qh else 0
    qs = b[:, o + 4:] if has_qh else b[:, o:]
    q = (_nibbles(qs) | qh).astype(np.int16) - bias
    return q, _f16(b[:, :2]), m


def _q8_0(b: np.ndarray):
    return b[:, 2:].view(np.int8), _f16(b[:, :2]), None


def _k_quant(b: np.ndarray, has_qh: bool):
    d, dmin = _f16(b[:, :2]), _f16(b[:, 2:4])
    sc, mn = _GGUF_Q4_K.get_scale_min(b[:, 4:16])  # (n, 8) each
    qs = b[:, 48:] if has_qh else b[:, 16:]  # (n, 128): byte 32jj+i → sub-blocks 2jj, 2jj+1
    q = np.stack([qs & 15, qs >> 4], axis=2).reshape(-1, 4, 32, 2)  # (n, jj, i, lo/hi)
    q = q.transpose(0, 1, 3, 2).reshape(-1, 256)  # (n, 256)
    if has_qh:
        bits = b[:, 16:48, None] >> np.arange(8, dtype=np.uint8)  # (n, i, j)
        q = q | ((bits & 1) << 4).transpose(0, 2, 1).reshape(-1, 256)
    return q, d * sc.astype(np.float32), -(dmin * mn.astype(np.float32))


def _q6_k(b: np.ndarray):
    ql, qh = b[:, :128].reshape(-1, 2, 64), b[:, 128:192].reshape(-1, 2, 32)
    low = np.stack([ql[:, :, :32] & 15, ql[:, :, 32:] & 15, ql[:, :, :32] >> 4,
                    ql[:, :, 32:] >> 4], axis=2)  # (n, half, quarter, 32)
    high = (qh[:, :, None, :] >> np.array([0, 2, 4, 6], np.uint8)[:, None]) & 3  # same
    q = (low | (high << 4)).astype(np.int16).reshape(-1, 256) - 32
    d = _f16(b[:, 208:210]) * b[:, 192:208].view(np.int8).astype(np.float32)  # (n, 16)
    return q, d, None


_UNPACK = {
    Q4_0: (32, lambda b: _legacy(b, False, False, 8)),
    Q4_1: (32, lambda b: _legacy(b, True, False, 0)),
    Q5_0: (32, lambda b: _legacy(b, False, True, 16)),
    Q5_1: (32, lambda b: _legacy(b, True, True, 0)),
    Q8_0: (32, _q8_0),
    Q4_K: (32, lambda b: _k_quant(b, False)),
    Q5_K: (32, lambda b: _k_quant(b, True)),
    Q6_K: (16, _q6_k),
}
REPACK_TYPES: frozenset[int] = frozenset(_UNPACK)


def repack(raw: np.ndarray, ggml_type: int, ne0: int) -> RepackedWeight:
    """raw uint8 (rows, row_bytes) as GGUFFile.raw gives it → RepackedWeight, lossless."""
    if ggml_type not in _UNPACK:
        raise ValueError(f"repack supports ggml types {sorted(_UNPACK)}, got {ggml_type}")
    if raw.ndim != 2 or raw.shape[1] != row_bytes(ggml_type, ne0):
        raise ValueError(f"raw must be (rows, {row_bytes(ggml_type, ne0)}) uint8, got {raw.shape}")
    group, unpack = _UNPACK[ggml_type]
    rows = raw.shape[0]
    n_blocks = rows * raw.shape[1] // BLOCK_GEOMETRY[ggml_type][1]
    q, d, m = unpack(np.ascontiguousarray(raw).reshape(n_blocks, -1))
    q = np.ascontiguousarray(q, dtype=np.int8).reshape(rows, ne0)  # (rows, ne0)
    d = np.ascontiguousarray(d, dtype=np.float32).reshape(rows, ne0 // group)  # (rows, n_sub)
    m = (np.zeros((rows, 0), np.float32) if m is None  # (rows, 0)
         else np.ascontiguousarray(m, dtype=np.float32).reshape(rows, ne0 // group))
    return RepackedWeight(_readonly(q), _readonly(d), _readonly(m), group)
