"""Decode matmul (a few tokens, int8 activations) on weights repacked at load into compact records.

Decode streams every weight once per step, so the packed weights stay about as small as
ggml's, but are laid out so that the AVX2 kernel unpacks them in few instructions (on one core
the kernel is compute-bound at ggml's own layouts). Q8_0 keeps its GGUF rows (zero-copy, read two
blocks at a time). Every other type is unpacked losslessly (quant_repack's unpackers) to unsigned
quants q in 0..2^bits-1, a scale d per 32 (Q6_K: per 16) and an offset m (Q4_1, Q5_1, K-quants),
with value = (q - bias)·d + m, bit for bit ggml's (d, m float16 as in ggml for the legacy types,
float32 products d·sc for the K-quants). A row is stored as pairs of records (64 elements each:
blocks A, B; A', B'), then its last record alone when it has an odd number (ne0 % 128 = 64).

A lone record: [d_A d_B (Q6_K: 2 each, block-major)] [m_A m_B]? [low bits of A, of B]? [32
nibble bytes], byte i of the nibble bytes holding q_A[i] >> lb (low nibble) and q_B[i] >> lb
(high nibble), lb = 0 (Q4_*), 1 (Q5_*) or 2 (Q6_K) low bits kept apart: with element e = 4k + b
(k = 0..7, b = 0..3), a 1-bit plane (uint32) holds q & 1 at bit 8b + k, a 2-bit plane (uint64)
holds q & 3 at bit 32·(k & 1) + 8b + 2·(k >> 1), so that one variable shift per 32-bit lane k
lines them up (legacy types: ggml's own bytes; K-quants 0.75-1.0 bytes per weight against ggml's
0.56-0.82).
A pair record has the same fields, each twice as long, over the four 32-quant vectors the kernel
multiplies (x_order: vector c byte k is element x_order(128)[0][32c + k] of the pair): d in lane
order (A, B, A', B'; Q6_K: their first halves' scales, then their second halves'), m per block,
a plane per vector, vectors 0 and 1 in the low and high nibbles of 32 bytes, 2 and 3 of the next
32. So the kernel loads them with no shuffle.

The row kernel (LLVM IR, llvm_jit) multiplies a row's records, two at a time, with up to
MAX_ROWS rows of x's int8 quants (quant_q8's rounding, blocks of 32; x stored in the kernel's
order, see x_order): per x row, vpmaddubsw + vpmaddwd (or VNNI's vpdpbusd) sum a pair of records
into 8 int32 lanes of 16 elements of one block each, so that one bias subtraction (bias·Σxq,
exact integers), one conversion and one multiply-add by the lanes' scales d·xd serve four
blocks. Offsets add m·xs for all rows at once. Q8_0 uses llama.cpp's sign trick for its signed
quants.
"""

from __future__ import annotations

import ctypes
import functools
import re
from dataclasses import dataclass
from typing import Callable

import numpy as np

from sparkinfer_cli.gguf.ggml_types import BLOCK_GEOMETRY, row_bytes
from sparkinfer_cli.kernels.cpu import llvm_jit, parallel_calls
from sparkinfer_cli.kernels.cpu.quant import _readonly
from sparkinfer_cli.kernels.cpu.quant_blocks import Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, Q8_0
from sparkinfer_cli.kernels.cpu.quant_q8 import Q8_BLOCK
from sparkinfer_cli.kernels.cpu.quant_repack import _UNPACK

RECORD_ELEMENTS = 64


# Which arrangement of the records pack() writes (with LAYOUTS, the key of the packed disk cache):
# 2 = a row's records in pairs, in the row kernel's vector order.
PACKING_VERSION = 2


@dataclass(frozen=True)
class RecordLayout:
    """A record of two 32-element blocks."""
    n_scales: int  # per block: 1, or 2 (elements 0..15 and 16..31)
    has_m: bool
    low_bits: int  # bits of q below the nibble: 0, 1 or 2
    bias: int  # a power of two, or 0
    scale: str = "float"  # type of d and m: "float", or "half" where ggml's are float16
    is_q8: bool = False  # Q8_0: two GGUF blocks [d float16][32 int8] as they are

    @property
    def scale_bytes(self) -> int:
        return 2 if self.scale == "half" else 4

    @property
    def m_offset(self) -> int:
        return 2 * self.scale_bytes * self.n_scales

    @property
    def low_offset(self) -> int:
        return self.m_offset + (2 * self.scale_bytes if self.has_m else 0)

    @property
    def nibble_offset(self) -> int:
        return self.low_offset + 8 * self.low_bits

    @property
    def size(self) -> int:
        return 68 if self.is_q8 else self.nibble_offset + 32


LAYOUTS: dict[int, RecordLayout] = {
    Q4_0: RecordLayout(1, False, 0, 8, "half"),
    Q4_1: RecordLayout(1, True, 0, 0, "half"),
    Q5_0: RecordLayout(1, False, 1, 16, "half"),
    Q5_1: RecordLayout(1, True, 1, 0, "half"),
    Q8_0: RecordLayout(1, False, 0, 0, "half", is_q8=True),
    Q4_K: RecordLayout(1, True, 0, 0),
    Q5_K: RecordLayout(1, True, 1, 0),
    Q6_K: RecordLayout(2, False, 2, 32),
}
PACKED_TYPES: frozenset[int] = frozenset(LAYOUTS)


@dataclass(frozen=True)
class PackedWeight:
    records: np.ndarray  # uint8 (rows, ne0 / RECORD_ELEMENTS · layout.size)
    ne0: int
    layout: RecordLayout

    @property
    def rows(self) -> int:
        return self.records.shape[0]

    @property
    def nbytes(self) -> int:
        return self.records.nbytes


def can_pack(ggml_type: int, ne0: int) -> bool:
    """Whether pack takes this type and row length (records of 64 need ne0 % 64 == 0)."""
    return ggml_type in LAYOUTS and ne0 % RECORD_ELEMENTS == 0


def pack(raw: np.ndarray, ggml_type: int, ne0: int) -> PackedWeight:
    """raw uint8 (rows, row_bytes) as GGUFFile.raw gives it → PackedWeight, lossless."""
    if not can_pack(ggml_type, ne0):
        raise ValueError(f"pack supports ggml types {sorted(LAYOUTS)} with ne0 a multiple of "
                         f"64, got type {ggml_type}, ne0 {ne0}")
    if raw.ndim != 2 or raw.shape[1] != row_bytes(ggml_type, ne0):
        raise ValueError(f"raw must be (rows, {row_bytes(ggml_type, ne0)}) uint8, got {raw.shape}")
    layout = LAYOUTS[ggml_type]
    if not layout.is_q8:
        raw = _records(raw, ggml_type, layout)
    return PackedWeight(_readonly(np.ascontiguousarray(raw)), ne0, layout)


def _records(raw: np.ndarray, ggml_type: int, layout: RecordLayout) -> np.ndarray:
    """ggml blocks → each row's pairs of records, then its last record alone when it has an
    odd number: uint8 (rows, n_records · layout.size)."""
    q, d, m = _UNPACK[ggml_type][1](np.ascontiguousarray(raw).reshape(
        -1, BLOCK_GEOMETRY[ggml_type][1]))
    rows = raw.shape[0]
    n_blocks = q.size // 32 // rows  # 32-element blocks a row
    q = (q.astype(np.int16) + layout.bias).astype(np.uint8).reshape(rows, n_blocks, 32)
    d = np.asarray(d, np.float32).reshape(rows, n_blocks, layout.n_scales)
    m = None if m is None else np.asarray(m, np.float32).reshape(rows, n_blocks)
    paired = n_blocks // 4 * 4  # blocks in pairs of records
    parts = []
    if paired:
        pq = q[:, :paired].reshape(-1, 4 * 32)[:, x_order(2 * RECORD_ELEMENTS)[0]]
        pd = d[:, :paired].reshape(-1, 4, layout.n_scales).transpose(0, 2, 1)  # lane order
        pm = None if m is None else m[:, :paired].reshape(-1, 4)
        parts.append(_fields(pq.reshape(-1, 4, 32), pd, pm, layout).reshape(rows, -1))
    if paired < n_blocks:  # the lone record: blocks A, B in element order, d block-major
        lm = None if m is None else m[:, paired:].reshape(-1, 2)
        parts.append(_fields(q[:, paired:], d[:, paired:], lm, layout).reshape(rows, -1))
    return np.concatenate(parts, axis=1)


def _fields(vectors: np.ndarray, d: np.ndarray, m: np.ndarray | None,
            layout: RecordLayout) -> np.ndarray:
    """Records of 2 blocks (a lone record) or 4 (a pair) from their quants as the kernel's
    32-byte vectors (n, 2 | 4, 32), their weight scales d and offsets m in record order:
    uint8 (n, size)."""
    n, n_vec, _ = vectors.shape
    scale = "<f2" if layout.scale == "half" else "<f4"  # float16: ggml's own d, m, exactly
    parts = [_bytes(d, scale, n_vec * layout.n_scales)]
    if layout.has_m:
        parts.append(_bytes(m, scale, n_vec))
    lb = layout.low_bits
    if lb:
        e = np.arange(32)
        k, b = e // 4, e % 4
        pos = 8 * b + k if lb == 1 else 32 * (k & 1) + 8 * b + 2 * (k >> 1)  # (32,)
        low = (vectors & (2 ** lb - 1)).astype(np.uint64) << pos.astype(np.uint64)
        plane = low.sum(axis=2, dtype=np.uint64)  # (n, vectors)
        parts.append(_bytes(plane, "<u4" if lb == 1 else "<u8", n_vec))
    for v in range(0, n_vec, 2):  # vector v in the low nibbles, v + 1 in the high
        parts.append((vectors[:, v] >> lb) | ((vectors[:, v + 1] >> lb) << 4))  # (n, 32)
    return np.concatenate(parts, axis=1)


def _bytes(a: np.ndarray, dtype: str, per_record: int) -> np.ndarray:
    """per_record values of each record as uint8 (n_records, itemsize · per_record)."""
    return np.ascontiguousarray(a, dtype=dtype).reshape(-1, per_record).view(np.uint8)


def _renamed(ir: str, suffix: str, free: dict[str, str]) -> str:
    """IR with each value it defines renamed %v → %v{suffix} and the values in `free` (not
    defined in it) replaced: one body of IR placed twice in a function."""
    names = {n: n + suffix for n in re.findall(r"%([\w.]+) =", ir)} | free
    return re.sub(r"%([\w.]+)", lambda m: "%" + names.get(m.group(1), m.group(1)), ir)


# ---- activations -------------------------------------------------------------------------------
# The kernel multiplies a record in two 32-byte halves h = 0, 1 whose 4-byte groups alternate
# between its blocks A and B (vpunpckldq / vpunpckhdq of the two): group g of half h holds block
# g % 2, elements 16·(g // 4) + 8·h + 4·(g % 4 // 2) + 0..3. Int32 lane g of one record sums group
# g of both halves, 8 elements of one block.
# Records go through the kernel in pairs (a, b), as four 32-byte vectors c = 2h + k: lanes 0, 1, 4,
# 5 hold record a's groups, lanes 2, 3, 6, 7 record b's, k = 1 with each record's lanes swapped in
# pairs (PAIR_LANES). A lane then sums 16 elements of one block over the four vectors, so one
# conversion and one multiply-add by the lanes' scales d·xd serve four blocks: the float work a
# weight is half of a lone record's. A row of an odd number of records ends with one record in the
# lone order. x is stored in this order.

# PAIR_LANES[k][g]: the lane of the two records' lanes (a: 0-7, b: 8-15) that lane g of vector
# 2h + k takes from half h
PAIR_LANES = ([0, 1, 10, 11, 4, 5, 14, 15], [2, 3, 8, 9, 6, 7, 12, 13])


def _interleaved(h: int, k: int) -> int:
    """Which of the record's 64 quants (32·block + element) is byte k of half h."""
    g, i = divmod(k, 4)
    return 32 * (g % 2) + 16 * (g // 4) + 8 * h + 4 * (g % 4 // 2) + i


def x_order(ne0: int) -> tuple[np.ndarray, np.ndarray]:
    """int (ne0,): the element of a row of x that byte k of its quantized row holds, and int
    (ne0 / 64 rounded up, 8): the block of x that each lane of each lane group sums (lane group
    p: pair p of records, or the last, lone record)."""
    n_rec = ne0 // RECORD_ELEMENTS
    lone = np.array([_interleaved(h, k) for h in range(2) for k in range(32)])  # (64,)
    order, blocks = [], []
    for p in range(n_rec // 2):
        words = np.concatenate([lone + 128 * p, lone + 128 * p + 64]).reshape(2, 2, 8, 4)
        for c in range(4):  # words (record, half, lane, byte)
            h, k = divmod(c, 2)
            order += [words[lane // 8, h, lane % 8] for lane in PAIR_LANES[k]]
        blocks.append([4 * p + 2 * (lane // 8) + lane % 2 for lane in PAIR_LANES[0]])
    if n_rec % 2:
        order.append(lone + 64 * (n_rec - 1))
        blocks.append([2 * (n_rec - 1) + g % 2 for g in range(8)])
    return np.concatenate(order).ravel(), np.array(blocks)


def _quantize_block(blk: int) -> str:
    """IR: block blk of the record (32 floats at %xr) → float %d{blk} = max|x| / 127,
    <32 x i8> %q{blk} = rint(x / d) (0 where d = 0), float %s{blk} = d · Σ q: quant_q8's rule,
    the same float32 operations, so the same bits."""
    t = f"_{blk}"
    ir = ""
    for j in range(4):
        ir += (f"  %xp{t}{j} = getelementptr float, ptr %xr, i64 {32 * blk + 8 * j}\n"
               f"  %v{t}{j} = load <8 x float>, ptr %xp{t}{j}, align 4\n"
               f"  %a{t}{j} = call <8 x float> @llvm.fabs.v8f32(<8 x float> %v{t}{j})\n")
    for name, a, b in ((f"m{t}a", f"a{t}0", f"a{t}1"), (f"m{t}b", f"a{t}2", f"a{t}3"),
                       (f"m{t}", f"m{t}a", f"m{t}b")):
        ir += (f"  %{name} = call <8 x float> @llvm.maxnum.v8f32(<8 x float> %{a}, "
               f"<8 x float> %{b})\n")
    ir += (f"  %amax{t} = call float @llvm.vector.reduce.fmax.v8f32(<8 x float> %m{t})\n"
           f"  %d{blk} = fdiv float %amax{t}, 127.0\n"
           f"  %pos{t} = fcmp ogt float %d{blk}, 0.0\n"
           f"  %di{t} = insertelement <8 x float> poison, float %d{blk}, i32 0\n"
           f"  %dv{t} = shufflevector <8 x float> %di{t}, <8 x float> poison, <8 x i32> "
           "zeroinitializer\n")
    for j in range(4):
        ir += (f"  %r{t}{j} = fdiv <8 x float> %v{t}{j}, %dv{t}\n"
               f"  %n{t}{j} = call <8 x float> @llvm.roundeven.v8f32(<8 x float> %r{t}{j})\n"
               f"  %z{t}{j} = select i1 %pos{t}, <8 x float> %n{t}{j}, <8 x float> "
               "zeroinitializer\n"
               f"  %i{t}{j} = fptosi <8 x float> %z{t}{j} to <8 x i32>\n"
               f"  %b{t}{j} = trunc <8 x i32> %i{t}{j} to <8 x i8>\n")
    return ir + (f"  %s{t}a = add <8 x i32> %i{t}0, %i{t}1\n"
                 f"  %s{t}b = add <8 x i32> %i{t}2, %i{t}3\n"
                 f"  %s{t}c = add <8 x i32> %s{t}a, %s{t}b\n"
                 f"  %qs{t} = call i32 @llvm.vector.reduce.add.v8i32(<8 x i32> %s{t}c)\n"
                 f"  %qf{t} = sitofp i32 %qs{t} to float\n"
                 f"  %s{blk} = fmul float %d{blk}, %qf{t}\n"
                 f"  %c{t}a = shufflevector <8 x i8> %b{t}0, <8 x i8> %b{t}1, "
                 f"<16 x i32> {_vec('i32', list(range(16)))}\n"
                 f"  %c{t}b = shufflevector <8 x i8> %b{t}2, <8 x i8> %b{t}3, "
                 f"<16 x i32> {_vec('i32', list(range(16)))}\n"
                 f"  %q{blk} = shufflevector <16 x i8> %c{t}a, <16 x i8> %c{t}b, "
                 f"<32 x i32> {_vec('i32', list(range(32)))}\n")


def _pair_vectors(src: str, dst: str) -> str:
    """IR: the pair's four vectors %{dst}0..3 (<32 x i8>) from its records' halves %{src}{h}a and
    %{src}{h}b (see PAIR_LANES)."""
    ir = ""
    for c in range(4):
        h, k = divmod(c, 2)
        ir += "".join(f"  %{dst}{c}{r} = bitcast <32 x i8> %{src}{h}{r} to <8 x i32>\n"
                      for r in "ab")
        ir += (f"  %{dst}{c}i = shufflevector <8 x i32> %{dst}{c}a, <8 x i32> %{dst}{c}b, "
               f"<8 x i32> {_vec('i32', PAIR_LANES[k])}\n"
               f"  %{dst}{c} = bitcast <8 x i32> %{dst}{c}i to <32 x i8>\n")
    return ir


def _x_outputs(n_blocks: int) -> str:
    """IR: the quants %q0 .. %q{n_blocks - 1} of one record (2 blocks) or a pair (4), stored in
    the row kernel's order at %qr; each lane's block scale to xd and quant sum to xl (lane group
    %lg of the row's, from %lane0); the blocks' Σ-weighted scales to xs (blocks from %blk0:
    chunk-major, this row's column %xsr, %m rows a chunk)."""
    ir = ""
    for r, name in enumerate("ab"[:n_blocks // 2]):
        ir += "".join(f"  %h{h}{name} = shufflevector <32 x i8> %q{2 * r}, <32 x i8> "
                      f"%q{2 * r + 1}, <32 x i32> "
                      f"{_vec('i32', [_interleaved(h, k) for k in range(32)])}\n"
                      for h in range(2))
    if n_blocks == 4:
        ir += _pair_vectors("h", "v")
        vectors = [f"%v{c}" for c in range(4)]
        lane_blocks = [PAIR_LANES[0][g] // 8 * 2 + g % 2 for g in range(8)]
    else:
        vectors, lane_blocks = ["%h0a", "%h1a"], [g % 2 for g in range(8)]
    for c, v in enumerate(vectors):
        ir += (f"  %vp{c} = getelementptr i8, ptr %qr, i64 {32 * c}\n"
               f"  store <32 x i8> {v}, ptr %vp{c}, align 1\n"
               f"  %vw{c} = sext <32 x i8> {v} to <32 x i32>\n")
    ir += "  %vs0 = add <32 x i32> %vw0, %vw1\n"
    if n_blocks == 4:
        ir += ("  %vs1 = add <32 x i32> %vw2, %vw3\n"
               "  %vs = add <32 x i32> %vs0, %vs1\n")
    ir += "".join(f"  %l{i} = shufflevector <32 x i32> %vs{'' if n_blocks == 4 else '0'}, "
                  f"<32 x i32> poison, <8 x i32> {_vec('i32', [4 * g + i for g in range(8)])}\n"
                  for i in range(4))
    ir += "".join(f"  %di{j} = insertelement <{n_blocks} x float> "
                  f"{'poison' if j == 0 else f'%di{j - 1}'}, float %d{j}, i32 {j}\n"
                  for j in range(n_blocks))
    ir += f"""  %la = add <8 x i32> %l0, %l1
  %lb = add <8 x i32> %l2, %l3
  %lsum = add <8 x i32> %la, %lb
  %lg8 = mul i64 %lg, 8
  %lo8 = add i64 %lane0, %lg8
  %lp = getelementptr i32, ptr %xl, i64 %lo8
  store <8 x i32> %lsum, ptr %lp, align 4
  %dl = shufflevector <{n_blocks} x float> %di{n_blocks - 1}, <{n_blocks} x float> poison, \
<8 x i32> {_vec('i32', lane_blocks)}
  %dp = getelementptr float, ptr %xd, i64 %lo8
  store <8 x float> %dl, ptr %dp, align 4
"""
    for j in range(n_blocks):
        ir += (f"  %bk{j} = add i64 %blk0, {j}\n"
               f"  %sa{j}0 = mul i64 %bk{j}, %m\n"
               f"  %sa{j} = add i64 %xsr, %sa{j}0\n"
               f"  %sp{j} = getelementptr float, ptr %xs, i64 %sa{j}\n"
               f"  store float %s{j}, ptr %sp{j}, align 4\n")
    return ir


def _quantize_pairs(n_pairs: int) -> str:
    """IR (quantize): the loop over a row's pairs of records, from %row to %paired."""
    if not n_pairs:
        return ""
    return f"""pair:
  %p = phi i64 [0, %row], [%pn, %pair]
  %xe = mul i64 %p, {2 * RECORD_ELEMENTS}
  %xr = getelementptr float, ptr %xrow, i64 %xe
  %qr = getelementptr i8, ptr %qrow, i64 %xe
  %blk0 = mul i64 %p, 4
  %lg = add i64 %p, 0
{"".join(_quantize_block(b) for b in range(4))}{_x_outputs(4)}  %pn = add i64 %p, 1
  %pc = icmp ult i64 %pn, {n_pairs}
  br i1 %pc, label %pair, label %paired
"""


def _quantize_lone(ne0: int, n_pairs: int) -> str:
    """IR (quantize): the loop over the records after the pairs (none, or one), to %rowend."""
    n_rec = ne0 // RECORD_ELEMENTS
    if 2 * n_pairs == n_rec:
        return ""
    return "lone:\n" + _renamed(f"""  %rr = phi i64 [{2 * n_pairs}, %paired], [%rrn, %lone]
  %xe = mul i64 %rr, {RECORD_ELEMENTS}
  %xr = getelementptr float, ptr %xrow, i64 %xe
  %qr = getelementptr i8, ptr %qrow, i64 %xe
  %blk0 = mul i64 %rr, 2
  %lg = sub i64 %rr, {n_pairs}
{_quantize_block(0)}{_quantize_block(1)}{_x_outputs(2)}  %rrn = add i64 %rr, 1
  %rrc = icmp ult i64 %rrn, {n_rec}
  br i1 %rrc, label %lone, label %rowend
""", ".t", {})


def _quantize_ir(ne0: int) -> str:
    """void quantize(x, x_stride, n, xq, xd, xl, xs, 4 unused): rows 0..n-1 of x (floats,
    rows x_stride apart) → xq (n, ne0) int8 in the kernel's order (x_order), per lane of each
    lane group its block's scale xd and Σ xq over the lane's elements xl (n, ne0 / 64, 8: the
    lane groups first, the rest unused); xs, Σ-weighted scales for the offsets, by 8-row chunk
    (chunk c at 8c·n_blocks: (n_blocks, its rows))."""
    n_rec, n_blocks = ne0 // RECORD_ELEMENTS, ne0 // Q8_BLOCK
    n_pairs = n_rec // 2
    head = parallel_calls.kernel_head("quantize", ["*x", "xst", "n", "*xq", "*xd", "*xl", "*xs"])
    pair, lone = _quantize_pairs(n_pairs), _quantize_lone(ne0, n_pairs)
    return f"""declare <8 x float> @llvm.fabs.v8f32(<8 x float>)
declare <8 x float> @llvm.maxnum.v8f32(<8 x float>, <8 x float>)
declare <8 x float> @llvm.roundeven.v8f32(<8 x float>)
declare float @llvm.vector.reduce.fmax.v8f32(<8 x float>)
declare i32 @llvm.vector.reduce.add.v8i32(<8 x i32>)
declare i64 @llvm.umin.i64(i64, i64)

{head}  %any = icmp sgt i64 %n, 0
  br i1 %any, label %row, label %done
row:
  %t = phi i64 [0, %entry], [%tn, %rowend]
  %lo = and i64 %t, -8
  %left = sub i64 %n, %lo
  %m = call i64 @llvm.umin.i64(i64 %left, i64 8)
  %tt = sub i64 %t, %lo
  %xso0 = mul i64 %lo, {n_blocks}
  %xsr = add i64 %xso0, %tt
  %xo = mul i64 %t, %xst
  %xrow = getelementptr float, ptr %x, i64 %xo
  %qo = mul i64 %t, {ne0}
  %qrow = getelementptr i8, ptr %xq, i64 %qo
  %lane0 = mul i64 %t, {8 * n_rec}
  br label {"%pair" if n_pairs else "%paired"}
{pair}paired:
  br label {"%lone" if 2 * n_pairs < n_rec else "%rowend"}
{lone}rowend:
  %tn = add i64 %t, 1
  %tc = icmp slt i64 %tn, %n
  br i1 %tc, label %row, label %done
done:
  ret void
}}
"""


@functools.cache
def quantize_kernel(ne0: int) -> Callable:
    """quant_q8's quantization of a group's x rows for the row kernel (see _quantize_ir)."""
    return llvm_jit.compile_function(_quantize_ir(ne0), "quantize", [ctypes.c_int64] * 11)


# ---- kernel -----------------------------------------------------------------------------------
# One call multiplies each weight row with n x rows (a decode step's sequences): a record is
# unpacked, and its scales loaded, once for all n rows, so the weights are read once per step.
# Per row the float ops are those of n = 1, in the same order: every row's result is the same
# bit for bit whatever n it was computed with.

MAX_ROWS = 8  # x rows of one kernel call: 8 float accumulators, plus quants and temporaries


def _vec(ty: str, values: list[int]) -> str:
    return "<" + ", ".join(f"{ty} {v}" for v in values) + ">"


def _i8s(v: int) -> str:
    return _vec("i8", [v] * 32)


def _at(name: str, offset: int | str) -> str:
    """IR: %{name} = pointer offset bytes into the record."""
    return f"  %{name} = getelementptr i8, ptr %rp, i64 {offset}\n"


def _quants(lay: RecordLayout, j: int, nib: str = "nib", plane_at: int | None = None) -> str:
    """IR: <32 x i8> %q{j}: block j's quants (unsigned; Q8_0: signed): the low (even j) or high
    nibbles of %{nib} with the low bits of the plane at byte plane_at (default: block j's)."""
    if lay.is_q8:
        return _at(f"qp{j}", 34 * j + 2) + f"  %q{j} = load <32 x i8>, ptr %qp{j}, align 1\n"
    lb, mask = lay.low_bits, _i8s(15 << lay.low_bits)
    shift = f"shl <32 x i8> %{nib}, {_i8s(lb)}" if j % 2 == 0 else \
        f"lshr <32 x i8> %{nib}, {_i8s(4 - lb)}"
    ir = f"  %n{j}s = {shift}\n  %n{j} = and <32 x i8> %n{j}s, {mask}\n"
    if not lb:
        return ir.replace(f"%n{j} =", f"%q{j} =")
    lanes = [0, 1, 2, 3, 4, 5, 6, 7] if lb == 1 else [0, 0, 2, 2, 4, 4, 6, 6]
    ty = "i32" if lb == 1 else "i64"
    n = 8 if lb == 1 else 4
    ir += (_at(f"lp{j}", lay.low_offset + 4 * lb * j if plane_at is None else plane_at)
           + f"  %l{j} = load {ty}, ptr %lp{j}, align 1\n"
           f"  %l{j}i = insertelement <{n} x {ty}> poison, {ty} %l{j}, i32 0\n"
           f"  %l{j}v = shufflevector <{n} x {ty}> %l{j}i, <{n} x {ty}> poison, <{n} x i32> "
           "zeroinitializer\n"
           f"  %l{j}d = bitcast <{n} x {ty}> %l{j}v to <8 x i32>\n"
           f"  %l{j}s = lshr <8 x i32> %l{j}d, {_vec('i32', lanes)}\n"
           f"  %l{j}b = bitcast <8 x i32> %l{j}s to <32 x i8>\n"
           f"  %l{j}m = and <32 x i8> %l{j}b, {_i8s(2 ** lb - 1)}\n")
    return ir + f"  %q{j} = or <32 x i8> %n{j}, %l{j}m\n"


def _pair_quants(lay: RecordLayout) -> str:
    """IR: a pair record's four vectors %q0..3 (<32 x i8>) and lane scales %dvp, as stored:
    the same fields as a record's, each twice as long (see _fields), nothing to shuffle."""
    ir = "".join(_at(f"nibp{h}", 2 * lay.nibble_offset + 32 * h)
                 + f"  %nib{h} = load <32 x i8>, ptr %nibp{h}, align 1\n" for h in range(2))
    for c in range(4):
        ir += _quants(lay, c, f"nib{c // 2}", 2 * lay.low_offset + 4 * lay.low_bits * c)
    k = 4 * lay.n_scales
    lanes = list(range(8)) if lay.n_scales == 2 else [0, 1, 2, 3] * 2
    if lay.scale == "half":
        ir += (f"  %dph = load <{k} x half>, ptr %rp, align 1\n"
               f"  %dp = fpext <{k} x half> %dph to <{k} x float>\n")
    else:
        ir += f"  %dp = load <{k} x float>, ptr %rp, align 1\n"
    return ir + (f"  %dvp = shufflevector <{k} x float> %dp, <{k} x float> poison, "
                 f"<8 x i32> {_vec('i32', lanes)}\n")


def _record_scales(lay: RecordLayout) -> str:
    """IR: <8 x float> %dv, each lane's weight scale (lane g: block g % 2; Q6_K: its first
    half-block's scale in lanes 0-3, the second's in 4-7)."""
    if lay.is_q8:
        ir = "".join(_at(f"d{j}p", 34 * j) + f"  %d{j}h = load half, ptr %d{j}p, align 1\n"
                     for j in range(2))
        ir += ("  %dpi = insertelement <2 x half> poison, half %d0h, i32 0\n"
               "  %dph = insertelement <2 x half> %dpi, half %d1h, i32 1\n"
               "  %dp = fpext <2 x half> %dph to <2 x float>\n")
    else:
        k, half = 2 * lay.n_scales, lay.scale == "half"
        ir = f"  %dp{'h' * half} = load <{k} x {lay.scale}>, ptr %rp, align 1\n"
        ir += f"  %dp = fpext <{k} x half> %dph to <{k} x float>\n" if half else ""
    lanes = [0, 1] * 4 if lay.n_scales == 1 else [0, 2, 0, 2, 1, 3, 1, 3]
    return ir + (f"  %dv = shufflevector <{2 * lay.n_scales} x float> %dp, <{2 * lay.n_scales} "
                 f"x float> poison, <8 x i32> {_vec('i32', lanes)}\n")


def _halves(lay: RecordLayout) -> str:
    """IR: <32 x i8> %w0, %w1, the record's unsigned quants in the kernel's order (Q8_0: |q|, and
    the signed %ws0, %ws1)."""
    ir = ""
    for h in range(2):
        mask = _vec("i32", [_interleaved(h, k) for k in range(32)])
        w = f"%ws{h}" if lay.is_q8 else f"%w{h}"
        ir += f"  {w} = shufflevector <32 x i8> %q0, <32 x i8> %q1, <32 x i32> {mask}\n"
        if lay.is_q8:
            ir += f"  %w{h} = call <32 x i8> @llvm.abs.v32i8(<32 x i8> %ws{h}, i1 false)\n"
    return ir


def _x_vectors(lay: RecordLayout, t: int, signs: list[str]) -> tuple[str, list[str]]:
    """IR, and the names of x row t's 32-byte vectors from byte %xe of its row, one a weight
    vector (Q8_0: with the signs of its quants `signs`: llama.cpp's sign trick, |q| ≤ 128
    unsigned · x·sign(q))."""
    ir, x = "", []
    for c, sign in enumerate(signs):
        ir += (f"  %xo{c}_{t} = add i64 %xe, {32 * c}\n"
               f"  %xp{c}_{t} = getelementptr i8, ptr %xqr{t}, i64 %xo{c}_{t}\n"
               f"  %xv{c}_{t} = load <32 x i8>, ptr %xp{c}_{t}, align 1\n")
        x.append(f"%xv{c}_{t}")
        if lay.is_q8:
            ir += (f"  %xa{c}_{t} = call <32 x i8> @llvm.x86.avx2.psign.b(<32 x i8> {x[c]}, "
                   f"<32 x i8> {sign})\n")
            x[c] = f"%xa{c}_{t}"
    return ir, x


def _int_dot(lay: RecordLayout, t: int, vnni: bool, w: list[str], signs: list[str]) -> str:
    """IR: <8 x i32> %u{t}, lane g = Σ q·xq over lane g of each weight vector w[c] and x row t's
    vector c (2 of a lone record, 4 of a pair)."""
    ir, x = _x_vectors(lay, t, signs)
    if vnni:  # vpdpbusd: every vector into one accumulator, no int16 intermediate
        acc = "zeroinitializer"
        for c, (wc, xc) in enumerate(zip(w, x)):
            out = f"%u{t}" if c == len(w) - 1 else f"%v{c}_{t}"
            ir += (f"  %wi{c}_{t} = bitcast <32 x i8> {wc} to <8 x i32>\n"
                   f"  %xi{c}_{t} = bitcast <32 x i8> {xc} to <8 x i32>\n"
                   f"  {out} = call <8 x i32> @llvm.x86.avx512.vpdpbusd.256(<8 x i32> {acc}, "
                   f"<8 x i32> %wi{c}_{t}, <8 x i32> %xi{c}_{t})\n")
            acc = out
        return ir
    for c, (wc, xc) in enumerate(zip(w, x)):
        ir += (f"  %p{c}_{t} = call <16 x i16> @llvm.x86.avx2.pmadd.ub.sw(<32 x i8> {wc}, "
               f"<32 x i8> {xc})\n")
    ones = _vec("i16", [1] * 16)
    # int16 pair sums: quants ≤ 63 let two vectors' products add (2·2·63·127 < 2^15); Q8_0's
    # reach 2·128·127, widened one vector at a time
    step = 1 if lay.is_q8 else 2
    sums = []
    for c in range(0, len(w), step):
        p = f"%p{c}_{t}"
        if step == 2:
            ir += f"  %pp{c}_{t} = add <16 x i16> %p{c}_{t}, %p{c + 1}_{t}\n"
            p = f"%pp{c}_{t}"
        ir += (f"  %m{c}_{t} = call <8 x i32> @llvm.x86.avx2.pmadd.wd(<16 x i16> {p}, "
               f"<16 x i16> {ones})\n")
        sums.append(f"%m{c}_{t}")
    while len(sums) > 1:  # a tree of adds, the last named %u{t}
        a, b, *rest = sums
        out = f"%u{t}" if not rest else f"%ms{len(rest)}_{t}"
        ir += f"  {out} = add <8 x i32> {a}, {b}\n"
        sums = rest + [out]
    return ir.replace(f"%m0_{t} =", f"%u{t} =") if len(w) == step else ir


def _x_lanes(name: str, ty: str, t: int) -> str:
    """IR: <8 x ty> %{name}{t}, lane group %lg of x row t's (lane groups, 8) array."""
    return (f"  %{name}p{t} = getelementptr <8 x {ty}>, ptr %{name}r{t}, i64 %lg\n"
            f"  %{name}{t} = load <8 x {ty}>, ptr %{name}p{t}, align 4\n")


def _row_dot(lay: RecordLayout, t: int, vnni: bool, w: list[str], signs: list[str],
             dv: str) -> str:
    """IR: %acc1_{t} = %acc0_{t} + the dot of weight vectors w with x row t, lanes scaled by
    the weights' lane scales dv."""
    ir = _int_dot(lay, t, vnni, w, signs)
    if lay.bias:  # Σ (q - bias)·xq = Σ q·xq - bias·Σ xq, in exact integers
        log2_bias = _vec("i32", [lay.bias.bit_length() - 1] * 8)
        ir += (_x_lanes("xl", "i32", t) + f"  %xb{t} = shl <8 x i32> %xl{t}, {log2_bias}\n"
               f"  %s{t} = sub <8 x i32> %u{t}, %xb{t}\n")
    else:
        ir = ir.replace(f"%u{t} =", f"%s{t} =")
    return ir + (_x_lanes("xd", "float", t) + f"  %sc{t} = fmul <8 x float> {dv}, %xd{t}\n"
                 f"  %f{t} = sitofp <8 x i32> %s{t} to <8 x float>\n"
                 f"  %acc1_{t} = call <8 x float> @llvm.fma.v8f32(<8 x float> %f{t}, "
                 f"<8 x float> %sc{t}, <8 x float> %acc0_{t})\n")


def _load_scale(name: str, offset: int, scale: str) -> str:
    """IR: float %{name}, the record's scale at byte offset."""
    ir = _at(f"{name}p", offset) + f"  %{name}r = load {scale}, ptr %{name}p, align 1\n"
    if scale == "half":
        return ir + f"  %{name} = fpext half %{name}r to float\n"
    return ir + f"  %{name} = fadd float %{name}r, -0.0\n"


def _offsets(lay: RecordLayout, n: int, m_at: int | None = None) -> str:
    """IR: <n x float> %accm2 = %accm0 + m·xs of blocks 2·%ri and 2·%ri + 1, their m at byte
    m_at of %rp (default: a record's), for all n rows at once."""
    ir = ""
    m_at = lay.m_offset if m_at is None else m_at
    for j in range(2):
        ir += (_load_scale(f"m{j}", m_at + lay.scale_bytes * j, lay.scale)
               + f"  %mi{j} = insertelement <{n} x float> poison, float %m{j}, i32 0\n"
               f"  %mv{j} = shufflevector <{n} x float> %mi{j}, <{n} x float> poison, "
               f"<{n} x i32> zeroinitializer\n"
               f"  %xso{j} = mul i64 %b{j}, {n}\n"
               f"  %xsp{j} = getelementptr float, ptr %xs, i64 %xso{j}\n"
               f"  %xsv{j} = load <{n} x float>, ptr %xsp{j}, align 4\n"
               f"  %accm{j + 1} = call <{n} x float> @llvm.fma.v{n}f32(<{n} x float> %mv{j}, "
               f"<{n} x float> %xsv{j}, <{n} x float> %accm{j})\n")
    return "  %b0 = mul i64 %ri, 2\n  %b1 = add i64 %b0, 1\n" + ir


def _x_rows(n: int) -> str:
    """IR (entry block): per x row t, its pointers into xq, xd, xl and out."""
    ir = "  %ne0 = shl i64 %nrec, 6\n  %xrb = shl i64 %nrec, 5\n"  # row bytes of xq, of xd / xl
    for t in range(n):
        ir += (f"  %xqo{t} = mul i64 %ne0, {t}\n"
               f"  %xqr{t} = getelementptr i8, ptr %xq, i64 %xqo{t}\n"
               f"  %xo{t} = mul i64 %xrb, {t}\n"
               f"  %xdr{t} = getelementptr i8, ptr %xd, i64 %xo{t}\n"
               f"  %xlr{t} = getelementptr i8, ptr %xl, i64 %xo{t}\n"
               f"  %oo{t} = mul i64 %os, {t}\n"
               f"  %outr{t} = getelementptr float, ptr %out, i64 %oo{t}\n")
    return ir


def _store_rows(lay: RecordLayout, n: int) -> str:
    """IR (row end): out[t·out_stride + r] = Σ lanes of row t's accumulator %accf_{t} (+ its
    offsets')."""
    ir = ""
    for t in range(n):
        ir += (f"  %sum{t} = call float @llvm.vector.reduce.fadd.v8f32(float -0.0, "
               f"<8 x float> %accf_{t})\n")
        if lay.has_m:
            ir += (f"  %am{t} = extractelement <{n} x float> %accfm, i64 {t}\n"
                   f"  %tot{t} = fadd float %sum{t}, %am{t}\n")
        total = f"%tot{t}" if lay.has_m else f"%sum{t}"
        ir += (f"  %op{t} = getelementptr float, ptr %outr{t}, i64 %r\n"
               f"  store float {total}, ptr %op{t}\n")
    return ir


# Software prefetch this far ahead in the row (a line a record): measured per core on this
# model's matrices, none / 1 KiB / 4 KiB: gate+up 23.2 / 20.2 / 18.2 ms, output 21.5 / 18.2 / 18.1.
_PREFETCH_BYTES = 4096


def _declarations(n: int) -> str:
    fma_n = "" if n == 8 else \
        f"declare <{n} x float> @llvm.fma.v{n}f32(<{n} x float>, <{n} x float>, <{n} x float>)\n"
    return fma_n + """declare <8 x i32> @llvm.x86.avx2.pmadd.wd(<16 x i16>, <16 x i16>)
declare <16 x i16> @llvm.x86.avx2.pmadd.ub.sw(<32 x i8>, <32 x i8>)
declare <8 x i32> @llvm.x86.avx512.vpdpbusd.256(<8 x i32>, <8 x i32>, <8 x i32>)
declare <32 x i8> @llvm.x86.avx2.psign.b(<32 x i8>, <32 x i8>)
declare <32 x i8> @llvm.abs.v32i8(<32 x i8>, i1)
declare <8 x float> @llvm.fma.v8f32(<8 x float>, <8 x float>, <8 x float>)
declare void @llvm.prefetch.p0(ptr, i32, i32, i32)
declare float @llvm.vector.reduce.fadd.v8f32(float, <8 x float>)
"""


def _record(lay: RecordLayout) -> str:
    """IR: the record at %rp: its quants in the kernel's order %w0, %w1 (Q8_0: |q|, and the
    signed %ws0, %ws1) and its lanes' weight scales %dv."""
    nib = "" if lay.is_q8 else (_at("nibp", lay.nibble_offset)
                                + "  %nib = load <32 x i8>, ptr %nibp, align 1\n")
    return nib + _quants(lay, 0) + _quants(lay, 1) + _halves(lay) + _record_scales(lay)


def _prefetch(name: str, base: str, offset: int) -> str:
    """IR: a software prefetch of the line at byte offset from %{base}."""
    return (f"  %{name} = getelementptr i8, ptr %{base}, i64 {offset}\n"
            f"  call void @llvm.prefetch.p0(ptr %{name}, i32 0, i32 3, i32 1)\n")


def _q8_pair() -> str:
    """IR: Q8_0's two records at %rpa, %rpb (its GGUF blocks as they are) shuffled into the
    pair's signed vectors %S0..3, |q| %W0..3 and lane scales %dvp."""
    lay = LAYOUTS[Q8_0]
    ir = _renamed(_record(lay), "a", {"rp": "rpa"}) + _renamed(_record(lay), "b", {"rp": "rpb"})
    ir += _pair_vectors("ws", "S")
    ir += "".join(f"  %W{c} = call <32 x i8> @llvm.abs.v32i8(<32 x i8> %S{c}, i1 false)\n"
                  for c in range(4))
    return ir + (f"  %dvp = shufflevector <8 x float> %dva, <8 x float> %dvb, <8 x i32> "
                 f"{_vec('i32', PAIR_LANES[0])}\n")


def _pair_body(lay: RecordLayout, n: int, vnni: bool) -> str:
    """IR (pair loop): records 2·%i (a) and 2·%i + 1 (b) of the row into every row's
    accumulators %acc0_{t} → %acc1_{t} (offsets %acc0m → %accm2b)."""
    ir = f"""  %lg = add i64 %i, 0
  %xe = shl i64 %i, 7
  %ria = shl i64 %i, 1
  %rib = add i64 %ria, 1
  %rpo = mul i64 %ria, {lay.size}
  %rpa = getelementptr i8, ptr %rowp, i64 %rpo
  %rpb = getelementptr i8, ptr %rpa, i64 {lay.size}
{_prefetch("pfp", "rpa", _PREFETCH_BYTES)}{_prefetch("pfq", "rpa", _PREFETCH_BYTES + 64)}\
{_q8_pair() if lay.is_q8 else _renamed(_pair_quants(lay), "", {"rp": "rpa"})}"""
    w = [f"%{'W' if lay.is_q8 else 'q'}{c}" for c in range(4)]
    signs = [f"%S{c}" for c in range(4)] if lay.is_q8 else w
    ir += "".join(_row_dot(lay, t, vnni, w, signs, "%dvp") for t in range(n))
    if lay.has_m:  # a pair record's m: blocks 4i, 4i + 1, then 4i + 2, 4i + 3
        m_at = 2 * lay.m_offset
        ir += _renamed(_offsets(lay, n, m_at), "a", {"rp": "rpa", "ri": "ria", "accm0": "acc0m"})
        ir += _renamed(_offsets(lay, n, m_at + 2 * lay.scale_bytes), "b",
                       {"rp": "rpa", "ri": "rib", "accm0": "accm2a"})
    return ir


def _lone_body(lay: RecordLayout, n: int, vnni: bool) -> str:
    """IR (lone loop): record %ri of the row, in the lone order, into the accumulators
    %accl_{t} → %acc1_{t}.t (offsets %acclm → %accm2.t)."""
    w = ["%w0", "%w1"]
    signs = ["%ws0", "%ws1"] if lay.is_q8 else w
    ir = f"""  %lg = sub i64 %ri, %np
  %xe = shl i64 %ri, 6
  %rpo = mul i64 %ri, {lay.size}
  %rp = getelementptr i8, ptr %rowp, i64 %rpo
{_prefetch("pfp", "rp", _PREFETCH_BYTES)}{_record(lay)}"""
    ir += "".join(_row_dot(lay, t, vnni, w, signs, "%dv") for t in range(n))
    ir += _offsets(lay, n) if lay.has_m else ""
    free = {f"acc0_{t}": f"accl_{t}" for t in range(n)} | {"accm0": "acclm"}
    return _renamed(ir, ".t", free)


def _phis(lay: RecordLayout, n: int, name: str, arms: list[tuple[str, str, str]]) -> str:
    """IR: %{name}_{t} for each row t (and %{name}m, the offsets) = phi of arms (block, its
    accumulator name: `{t}` stands for the row, or "0": zeros; its offsets' name)."""
    def value(v: str, t: int | None) -> str:
        return "zeroinitializer" if v == "0" else "%" + v.format(t=t)
    ir = "".join(f"  %{name}_{t} = phi <8 x float> "
                 + ", ".join(f"[{value(acc, t)}, %{blk}]" for blk, acc, _ in arms) + "\n"
                 for t in range(n))
    if lay.has_m:
        ir += (f"  %{name}m = phi <{n} x float> "
               + ", ".join(f"[{value(m, None)}, %{blk}]" for blk, _, m in arms) + "\n")
    return ir


def _row_kernel_ir(lay: RecordLayout, n: int, vnni: bool) -> str:
    """void dots(w, row_bytes, xq, xd, xs, xl, n_records, r0, r1, out, out_stride):
    out[t·out_stride + r] = W row r · x row t for r0 <= r < r1, t < n."""
    loop = [("row", "0", "0"), ("pair", "acc1_{t}", "accm2b")]
    lone = [("paired", "accp_{t}", "accpm"), ("lone", "acc1_{t}.t", "accm2.t")]
    return f"""{_declarations(n)}
define void @dots(ptr %w, i64 %rb, ptr %xq, ptr %xd, ptr %xs, ptr %xl, i64 %nrec, i64 %r0,
                  i64 %r1, ptr %out, i64 %os) {{
entry:
{_x_rows(n)}  %np = lshr i64 %nrec, 1
  %anypair = icmp ne i64 %np, 0
  %first = shl i64 %np, 1
  %anylone = icmp ult i64 %first, %nrec
  br label %row
row:
  %r = phi i64 [%r0, %entry], [%rn, %rowend]
  %ro = mul i64 %r, %rb
  %rowp = getelementptr i8, ptr %w, i64 %ro
  br i1 %anypair, label %pair, label %paired
pair:
  %i = phi i64 [0, %row], [%in, %pair]
{_phis(lay, n, "acc0", loop)}{_pair_body(lay, n, vnni)}  %in = add i64 %i, 1
  %ic = icmp ult i64 %in, %np
  br i1 %ic, label %pair, label %paired
paired:
{_phis(lay, n, "accp", loop)}  br i1 %anylone, label %lone, label %rowend
lone:
  %ri = phi i64 [%first, %paired], [%rin, %lone]
{_phis(lay, n, "accl", lone)}{_lone_body(lay, n, vnni)}  %rin = add i64 %ri, 1
  %ric = icmp ult i64 %rin, %nrec
  br i1 %ric, label %lone, label %rowend
rowend:
{_phis(lay, n, "accf", lone)}{_store_rows(lay, n)}  %rn = add i64 %r, 1
  %rc = icmp slt i64 %rn, %r1
  br i1 %rc, label %row, label %done
done:
  ret void
}}
"""


_ARGS = [ctypes.c_void_p, ctypes.c_int64] + [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3 \
    + [ctypes.c_void_p, ctypes.c_int64]


def row_kernel(layout: RecordLayout, n: int) -> Callable:
    """ctypes fn(w, row_bytes, xq, xd, xs, xl, n_records, r0, r1, out, out_stride) for n x rows
    on this CPU (AVX2; AVX512-VNNI's integer dot where the CPU has it and it is faster)."""
    if not 1 <= n <= MAX_ROWS:
        raise ValueError(f"a kernel takes 1 to {MAX_ROWS} x rows, got {n}")
    # NOTE: Q8_0's few rows stay AVX2: after its sign trick VNNI was slower there on Zen 4 (the
    # 145 MB output of Qwen2.5-0.5B, one core: 1 row 7.1 against 6.1 ms, 8 rows 18.8 against 22.3)
    return _row_kernel(layout, n, llvm_jit.has_vnni() and (n >= 4 or not layout.is_q8))


@functools.cache
def _row_kernel(layout: RecordLayout, n: int, vnni: bool) -> Callable:
    return llvm_jit.compile_function(_row_kernel_ir(layout, n, vnni), "dots", _ARGS)
