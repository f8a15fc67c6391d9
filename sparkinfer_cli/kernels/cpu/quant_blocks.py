"""ggml block layouts as numba helpers: where a block's scales are, what its quants are.

A block is n_sub sub-blocks of `block // n_sub` elements. `scales(raw, r, o, lut, sc, of)` reads
the header of the block at unit offset o of row r into sc[j] (scale) and of[j] (offset) and
returns one aux int (Q5's 32 high bits); `q(raw, r, o, aux, lut, j, i)` is the quant value of
element i of sub-block j, as float32. The weight is sc[j] * q (+ of[j]), formed exactly as ggml
forms it (d*sc first, ...), hence bit-exact with gguf.quants. Layouts: ggml's ggml-common.h
(block_q4_K, ...), dequantized as gguf-py's gguf/quants.py does.

Writing rules that keep the callers' inner loops vectorized (AVX2, no fastmath):
- numba widens integer arithmetic to int64, which has no AVX2 float conversion: small integer
  results are cast back to int32 before they become floats;
- no shifts by variable amounts (they stay 64-bit): select between constant shifts, or test bits
  with a mask loaded from a table;
- & and >> instead of % and // on indices (the sign fix-ups block vectorization).
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import numpy as np
from numba import njit

from sparkinfer_cli.gguf.ggml_types import GGMLType

F32, F16, BF16 = int(GGMLType.F32), int(GGMLType.F16), int(GGMLType.BF16)
Q4_0, Q4_1 = int(GGMLType.Q4_0), int(GGMLType.Q4_1)
Q5_0, Q5_1 = int(GGMLType.Q5_0), int(GGMLType.Q5_1)
Q8_0, IQ4_NL, IQ4_XS = int(GGMLType.Q8_0), int(GGMLType.IQ4_NL), int(GGMLType.IQ4_XS)
Q4_K, Q5_K, Q6_K = int(GGMLType.Q4_K), int(GGMLType.Q5_K), int(GGMLType.Q6_K)

# Bit patterns → float32, exact by construction (numpy's own fp16 conversion; bf16 = high half).
F16_LUT = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)
BF16_LUT = (np.arange(65536, dtype=np.uint32) << 16).view(np.float32)

_IQ4_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113],
                       dtype=np.float32)  # kvalues_iq4nl
_BIT = np.array([1 << i for i in range(16)], dtype=np.int32)
_f32, _i32 = np.float32, np.int32
_C8, _C16, _C32 = np.float32(8), np.float32(16), np.float32(32)


class BlockType(NamedTuple):
    block: int  # elements per block
    units: int  # raw units (bytes; uint16 for F16/BF16) per block
    n_sub: int  # sub-blocks per block, each with its own scale (and offset)
    has_offset: bool
    scales: Callable
    q: Callable

    @property
    def sub_block(self) -> int:
        return self.block // self.n_sub


@njit(cache=True, inline="always")
def _fp16(raw, r, o, lut):
    return lut[np.int64(raw[r, o]) | (np.int64(raw[r, o + 1]) << 8)]


@njit(cache=True, inline="always")
def _u32(raw, r, o):
    return (np.int64(raw[r, o]) | (np.int64(raw[r, o + 1]) << 8) | (np.int64(raw[r, o + 2]) << 16)
            | (np.int64(raw[r, o + 3]) << 24))


@njit(cache=True, inline="always")
def _nibble(raw, r, o, high, i):
    v = raw[r, o + i]
    return _i32(v >> 4) if high else _i32(v & 15)


# ---- legacy 32-blocks: byte i of qs holds element i (low nibble, sub-block 0) and i+16 (high, 1)

@njit(cache=True, inline="always")
def _scales_d(raw, r, o, lut, sc, of):
    sc[0] = sc[1] = _fp16(raw, r, o, lut)
    return 0


@njit(cache=True, inline="always")
def _scales_dm(raw, r, o, lut, sc, of):
    sc[0] = sc[1] = _fp16(raw, r, o, lut)
    of[0] = of[1] = _fp16(raw, r, o + 2, lut)
    return 0


@njit(cache=True, inline="always")
def _scales_d_qh(raw, r, o, lut, sc, of):
    _scales_d(raw, r, o, lut, sc, of)
    return _u32(raw, r, o + 2)


@njit(cache=True, inline="always")
def _scales_dm_qh(raw, r, o, lut, sc, of):
    _scales_dm(raw, r, o, lut, sc, of)
    return _u32(raw, r, o + 4)


@njit(cache=True, inline="always")
def _q5(raw, r, o, qh, j, i):
    qh_half = _i32((qh >> 16) if j else (qh & 0xFFFF))
    high_bit = _i32((qh_half & _BIT[i]) != 0) << 4
    return _f32(_i32(_nibble(raw, r, o, j, i) | high_bit))


@njit(cache=True, inline="always")
def _q_q4_0(raw, r, o, aux, lut, j, i):
    return _f32(_nibble(raw, r, o + 2, j, i)) - _C8


@njit(cache=True, inline="always")
def _q_q4_1(raw, r, o, aux, lut, j, i):
    return _f32(_nibble(raw, r, o + 4, j, i))


@njit(cache=True, inline="always")
def _q_q5_0(raw, r, o, aux, lut, j, i):
    return _q5(raw, r, o + 6, aux, j, i) - _C16


@njit(cache=True, inline="always")
def _q_q5_1(raw, r, o, aux, lut, j, i):
    return _q5(raw, r, o + 8, aux, j, i)


@njit(cache=True, inline="always")
def _q_iq4_nl(raw, r, o, aux, lut, j, i):
    return _IQ4_VALUES[_nibble(raw, r, o + 2, j, i)]


@njit(cache=True, inline="always")
def _scales_q8_0(raw, r, o, lut, sc, of):
    sc[0] = _fp16(raw, r, o, lut)
    return 0


@njit(cache=True, inline="always")
def _q_q8_0(raw, r, o, aux, lut, j, i):
    return _f32(np.int8(raw[r, o + 2 + i]))


# ---- K-quants: 256-element super-blocks -------------------------------------------------------

@njit(cache=True, inline="always")
def _k_scale_min(raw, r, o, j):
    # get_scale_min_k4: 8 six-bit scales and mins packed into the 12 bytes at raw[r, o:o+12]
    if j < 4:
        return raw[r, o + j] & 63, raw[r, o + j + 4] & 63
    return ((raw[r, o + j + 4] & 15) | ((raw[r, o + j - 4] >> 6) << 4),
            (raw[r, o + j + 4] >> 4) | ((raw[r, o + j] >> 6) << 4))


@njit(cache=True, inline="always")
def _scales_k(raw, r, o, lut, sc, of):  # Q4_K, Q5_K
    d, dmin = _fp16(raw, r, o, lut), _fp16(raw, r, o + 2, lut)
    for j in range(8):
        s, m = _k_scale_min(raw, r, o + 4, j)
        sc[j] = d * _f32(s)
        of[j] = -(dmin * _f32(m))  # NOTE: a*q + (-b) == a*q - b bit for bit
    return 0


@njit(cache=True, inline="always")
def _q_q4_k(raw, r, o, aux, lut, j, i):
    # sub-block j: low (even j) or high (odd j) nibbles of qs[32 * (j // 2):]
    return _f32(_nibble(raw, r, o + 16 + 32 * (j >> 1), j & 1, i))


@njit(cache=True, inline="always")
def _q_q5_k(raw, r, o, aux, lut, j, i):
    high_bit = _i32((raw[r, o + 16 + i] & _BIT[j]) != 0) << 4  # bit j of qh[i]
    return _f32(_i32(_nibble(raw, r, o + 48 + 32 * (j >> 1), j & 1, i) | high_bit))


@njit(cache=True, inline="always")
def _scales_q6_k(raw, r, o, lut, sc, of):
    d = _fp16(raw, r, o + 208, lut)
    for j in range(16):
        sc[j] = d * _f32(np.int8(raw[r, o + 192 + j]))
    return 0


@njit(cache=True, inline="always")
def _q_q6_k(raw, r, o, aux, lut, j, i):
    # element 16j+i: half n; quarter k of the half picks the ql nibble and the qh bit pair
    n, k, p = j >> 3, (j >> 1) & 3, ((j & 1) << 4) + i
    lo = _nibble(raw, r, o + 64 * n + 32 * (k & 1), k >> 1, p)
    h = _nibble(raw, r, o + 128 + 32 * n, k >> 1, p)
    h = _i32(h >> 2) if k & 1 else _i32(h & 3)
    return _f32(_i32(lo | (h << 4))) - _C32


@njit(cache=True, inline="always")
def _scales_iq4_xs(raw, r, o, lut, sc, of):
    # sub-blocks of 16: j = 2*ib + (high nibble); 6-bit scale of 32-block ib, offset by 32
    d, scales_h = _fp16(raw, r, o, lut), np.int64(raw[r, o + 2]) | (np.int64(raw[r, o + 3]) << 8)
    for ib in range(8):
        ls = (((raw[r, o + 4 + (ib >> 1)] >> (4 * (ib & 1))) & 15)
              | (((scales_h >> (2 * ib)) & 3) << 4))
        sc[2 * ib] = sc[2 * ib + 1] = d * _f32(ls - 32)
    return 0


@njit(cache=True, inline="always")
def _q_iq4_xs(raw, r, o, aux, lut, j, i):
    return _IQ4_VALUES[_nibble(raw, r, o + 8 + 16 * (j >> 1), j & 1, i)]


# ---- F16 / BF16 rows viewed as uint16: the quant is the value itself, scale 1 (exact) ----------

@njit(cache=True, inline="always")
def _scales_one(raw, r, o, lut, sc, of):
    sc[0] = _f32(1)
    return 0


@njit(cache=True, inline="always")
def _q_table(raw, r, o, aux, lut, j, i):
    return lut[raw[r, o + i]]


BLOCK_TYPES: dict[int, BlockType] = {
    F16: BlockType(32, 32, 1, False, _scales_one, _q_table),
    BF16: BlockType(32, 32, 1, False, _scales_one, _q_table),
    Q4_0: BlockType(32, 18, 2, False, _scales_d, _q_q4_0),
    Q4_1: BlockType(32, 20, 2, True, _scales_dm, _q_q4_1),
    Q5_0: BlockType(32, 22, 2, False, _scales_d_qh, _q_q5_0),
    Q5_1: BlockType(32, 24, 2, True, _scales_dm_qh, _q_q5_1),
    Q8_0: BlockType(32, 34, 1, False, _scales_q8_0, _q_q8_0),
    IQ4_NL: BlockType(32, 18, 2, False, _scales_d, _q_iq4_nl),
    Q4_K: BlockType(256, 144, 8, True, _scales_k, _q_q4_k),
    Q5_K: BlockType(256, 176, 8, True, _scales_k, _q_q5_k),
    Q6_K: BlockType(256, 210, 16, False, _scales_q6_k, _q_q6_k),
    IQ4_XS: BlockType(256, 136, 16, False, _scales_iq4_xs, _q_iq4_xs),
}
