"""Decode matvec (T = 1, int8 activations) on weights repacked at load into compact records.

Decode streams every weight once per token, so the packed weights stay about as small as
ggml's, but are laid out so that the AVX2 kernel unpacks them in few instructions (on one core
the kernel is compute-bound at ggml's own layouts). Q8_0 keeps its GGUF rows (zero-copy, read two
blocks at a time). Every other type is unpacked losslessly (quant_repack's unpackers) to unsigned
quants q in 0..2^bits-1, a scale d per 32 (Q6_K: per 16) and an offset m (Q4_1, Q5_1, K-quants),
with value = (q - bias)·d + m, bit for bit ggml's (d, m float16 as in ggml for the legacy types,
float32 products d·sc for the K-quants), and stored as records of two 32-blocks A and B:

    [d_A d_B (Q6_K: 2 each)] [m_A m_B]? [low bits of A, of B]? [32 nibble bytes]

Byte i of the nibble bytes holds q_A[i] >> lb (low nibble) and q_B[i] >> lb (high nibble), lb =
0 (Q4_*), 1 (Q5_*) or 2 (Q6_K) low bits kept apart: with element e = 4k + b (k = 0..7, b = 0..3),
a 1-bit plane (uint32) holds q & 1 at bit 8b + k, a 2-bit plane (uint64) holds q & 3 at bit
32·(k & 1) + 8b + 2·(k >> 1), so that one variable shift per 32-bit lane k lines them up
(legacy types: ggml's own bytes; K-quants 0.75-1.0 bytes per weight against ggml's 0.56-0.82).

The row kernel (LLVM IR, llvm_jit) multiplies the unsigned quants with x's int8 quants
(quant_q8's rounding, blocks of 32) by vpmaddubsw + vpmaddwd into 8 int32 lanes, lane k summing
elements 4k..4k+3, subtracts bias·Σxq per lane (exact integers), and scales and accumulates in
float32 lanes; offsets add m·xd·Σxq. Q8_0 uses llama.cpp's sign trick instead.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Callable

import numpy as np
from numba import njit

from sparkinfer_cli.ggml_types import BLOCK_GEOMETRY, row_bytes
from sparkinfer_cli.kernels.cpu import llvm_jit
from sparkinfer_cli.kernels.cpu.quant import _readonly
from sparkinfer_cli.kernels.cpu.quant_blocks import Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, Q8_0
from sparkinfer_cli.kernels.cpu.quant_q8 import quantize_rows
from sparkinfer_cli.kernels.cpu.quant_repack import _UNPACK

RECORD_ELEMENTS = 64


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
    """ggml blocks → records: uint8 (rows, n_records · layout.size)."""
    q, d, m = _UNPACK[ggml_type][1](np.ascontiguousarray(raw).reshape(
        -1, BLOCK_GEOMETRY[ggml_type][1]))
    q = (q.astype(np.int16) + layout.bias).astype(np.uint8).reshape(-1, 2, 32)  # (n_rec, AB, e)
    scale = "<f2" if layout.scale == "half" else "<f4"  # float16: ggml's own d, m, exactly
    parts = [_bytes(d, scale, 2 * layout.n_scales)]
    if layout.has_m:
        parts.append(_bytes(m, scale, 2))
    lb = layout.low_bits
    if lb:
        e = np.arange(32)
        k, b = e // 4, e % 4
        pos = 8 * b + k if lb == 1 else 32 * (k & 1) + 8 * b + 2 * (k >> 1)  # (32,)
        low = (q & (2 ** lb - 1)).astype(np.uint64) << pos.astype(np.uint64)  # (n_rec, AB, e)
        plane = low.sum(axis=2, dtype=np.uint64)  # (n_rec, AB)
        parts.append(_bytes(plane, "<u4" if lb == 1 else "<u8", 2))
    parts.append((q[:, 0] >> lb) | ((q[:, 1] >> lb) << 4))  # (n_rec, 32)
    return np.concatenate(parts, axis=1).reshape(raw.shape[0], -1)


def _bytes(a: np.ndarray, dtype: str, per_record: int) -> np.ndarray:
    """per_record values of each record as uint8 (n_records, itemsize · per_record)."""
    return np.ascontiguousarray(a, dtype=dtype).reshape(-1, per_record).view(np.uint8)


# ---- activations -------------------------------------------------------------------------------

@njit(cache=True, nogil=True)
def quantize_with_lane_sums(x, xq, xd, xs, xl):
    """quant_q8's quantization of x (1, ne0) into xq, xd, xs (1, n_blocks), plus the lane sums
    the row kernel subtracts the bias with: xl (n_blocks, 8) int32, Σ of xq over each 4."""
    quantize_rows(x, xq, xd, xs)
    for b in range(xl.shape[0]):
        for k in range(8):
            e = 32 * b + 4 * k
            xl[b, k] = (np.int32(xq[0, e]) + np.int32(xq[0, e + 1]) + np.int32(xq[0, e + 2])
                        + np.int32(xq[0, e + 3]))


# ---- kernel -----------------------------------------------------------------------------------

def _vec(ty: str, values: list[int]) -> str:
    return "<" + ", ".join(f"{ty} {v}" for v in values) + ">"


def _i8s(v: int) -> str:
    return _vec("i8", [v] * 32)


def _at(name: str, offset: int | str) -> str:
    """IR: %{name} = pointer offset bytes into the record."""
    return f"  %{name} = getelementptr i8, ptr %rp, i64 {offset}\n"


def _quants(lay: RecordLayout, j: int) -> str:
    """IR: <32 x i8> %q{j}: block j's unsigned quants (Q8_0: signed)."""
    if lay.is_q8:
        return _at(f"qp{j}", 34 * j + 2) + f"  %q{j} = load <32 x i8>, ptr %qp{j}, align 1\n"
    lb, mask = lay.low_bits, _i8s(15 << lay.low_bits)
    shift = f"shl <32 x i8> %nib, {_i8s(lb)}" if j == 0 else f"lshr <32 x i8> %nib, {_i8s(4 - lb)}"
    ir = f"  %n{j}s = {shift}\n  %n{j} = and <32 x i8> %n{j}s, {mask}\n"
    if not lb:
        return ir.replace(f"%n{j} =", f"%q{j} =")
    lanes = [0, 1, 2, 3, 4, 5, 6, 7] if lb == 1 else [0, 0, 2, 2, 4, 4, 6, 6]
    ty = "i32" if lb == 1 else "i64"
    n = 8 if lb == 1 else 4
    ir += (_at(f"lp{j}", lay.low_offset + 4 * lb * j)
           + f"  %l{j} = load {ty}, ptr %lp{j}, align 1\n"
           f"  %l{j}i = insertelement <{n} x {ty}> poison, {ty} %l{j}, i32 0\n"
           f"  %l{j}v = shufflevector <{n} x {ty}> %l{j}i, <{n} x {ty}> poison, <{n} x i32> "
           "zeroinitializer\n"
           f"  %l{j}d = bitcast <{n} x {ty}> %l{j}v to <8 x i32>\n"
           f"  %l{j}s = lshr <8 x i32> %l{j}d, {_vec('i32', lanes)}\n"
           f"  %l{j}b = bitcast <8 x i32> %l{j}s to <32 x i8>\n"
           f"  %l{j}m = and <32 x i8> %l{j}b, {_i8s(2 ** lb - 1)}\n")
    return ir + f"  %q{j} = or <32 x i8> %n{j}, %l{j}m\n"


def _int_dot(lay: RecordLayout, j: int) -> str:
    """IR: <8 x i32> %s{j}; lane k = Σ (q - bias)·xq over elements 4k..4k+3 of block j."""
    ir, qa, xa = "", f"%q{j}", f"%xv{j}"
    if lay.is_q8:  # llama.cpp's sign trick: |q| (≤ 128, unsigned) · (x with q's sign)
        qa, xa = f"%qa{j}", f"%xa{j}"
        ir = (f"  %qa{j} = call <32 x i8> @llvm.abs.v32i8(<32 x i8> %q{j}, i1 false)\n"
              f"  %xa{j} = call <32 x i8> @llvm.x86.avx2.psign.b(<32 x i8> %xv{j}, "
              f"<32 x i8> %q{j})\n")
    # i16 pair sums stay below 2·128·127; vpmaddwd with ones widens them to int32
    ir += (f"  %p{j} = call <16 x i16> @llvm.x86.avx2.pmadd.ub.sw(<32 x i8> {qa}, "
           f"<32 x i8> {xa})\n"
           f"  %u{j} = call <8 x i32> @llvm.x86.avx2.pmadd.wd(<16 x i16> %p{j}, <16 x i16> "
           + _vec("i16", [1] * 16) + ")\n")
    if not lay.bias:
        return ir.replace(f"%u{j} =", f"%s{j} =")
    log2_bias = _vec("i32", [lay.bias.bit_length() - 1] * 8)
    return ir + (f"  %xlp{j} = getelementptr <8 x i32>, ptr %xl, i64 %b{j}\n"
                 f"  %xl{j} = load <8 x i32>, ptr %xlp{j}, align 4\n"
                 f"  %xb{j} = shl <8 x i32> %xl{j}, {log2_bias}\n"
                 f"  %s{j} = sub <8 x i32> %u{j}, %xb{j}\n")


def _load_scale(name: str, offset: int, scale: str) -> str:
    """IR: float %{name}, the record's scale at byte offset."""
    ir = _at(f"{name}p", offset) + f"  %{name}r = load {scale}, ptr %{name}p, align 1\n"
    if scale == "half":
        return ir + f"  %{name} = fpext half %{name}r to float\n"
    return ir + f"  %{name} = fadd float %{name}r, -0.0\n"


def _scale_lanes(lay: RecordLayout, j: int) -> str:
    """IR: <8 x float> %sv{j}: d·xd per lane (lanes 0-3 are elements 0..15, 4-7 are 16..31)."""
    if lay.is_q8:
        ir = _load_scale(f"d{j}", 34 * j, "half")
    else:
        ir = "".join(_load_scale(f"d{j}{'' if h == 0 else h}",
                                 lay.scale_bytes * (lay.n_scales * j + h), lay.scale)
                     for h in range(lay.n_scales))
    ir += f"  %sc{j} = fmul float %d{j}, %xd{j}\n"
    ir += f"  %si{j} = insertelement <8 x float> poison, float %sc{j}, i32 0\n"
    if lay.n_scales == 1:
        return ir + (f"  %sv{j} = shufflevector <8 x float> %si{j}, <8 x float> poison, "
                     "<8 x i32> zeroinitializer\n")
    return ir + (f"  %sc{j}1 = fmul float %d{j}1, %xd{j}\n"
                 f"  %sj{j} = insertelement <8 x float> %si{j}, float %sc{j}1, i32 1\n"
                 f"  %sv{j} = shufflevector <8 x float> %sj{j}, <8 x float> poison, <8 x i32> "
                 + _vec("i32", [0, 0, 0, 0, 1, 1, 1, 1]) + "\n")


def _block(lay: RecordLayout, j: int) -> str:
    """IR of block j of the record: %acc{j+1}, %accm{j+1} from %acc{j}, %accm{j}."""
    ir = (f"  %b{j} = add i64 %b, {j}\n  %e{j} = shl i64 %b{j}, 5\n"
          f"  %xp{j} = getelementptr i8, ptr %xq, i64 %e{j}\n"
          f"  %xv{j} = load <32 x i8>, ptr %xp{j}, align 1\n"
          f"  %xdp{j} = getelementptr float, ptr %xd, i64 %b{j}\n"
          f"  %xd{j} = load float, ptr %xdp{j}\n")
    ir += _quants(lay, j) + _int_dot(lay, j) + _scale_lanes(lay, j)
    ir += (f"  %f{j} = sitofp <8 x i32> %s{j} to <8 x float>\n"
           f"  %acc{j + 1} = call <8 x float> @llvm.fma.v8f32(<8 x float> %f{j}, "
           f"<8 x float> %sv{j}, <8 x float> %acc{j})\n")
    if not lay.has_m:
        return ir + f"  %accm{j + 1} = fadd float %accm{j}, -0.0\n"
    return ir + (_load_scale(f"m{j}", lay.m_offset + lay.scale_bytes * j, lay.scale)
                 + f"  %xsp{j} = getelementptr float, ptr %xs, i64 %b{j}\n"
                 f"  %xs{j} = load float, ptr %xsp{j}\n"
                 f"  %accm{j + 1} = call float @llvm.fma.f32(float %m{j}, float %xs{j}, "
                 f"float %accm{j})\n")


# Software prefetch this far ahead in the row (one per record): measured per core on this
# model's matrices, none / 1 KiB / 4 KiB: gate+up 23.2 / 20.2 / 18.2 ms, output 21.5 / 18.2 / 18.1.
_PREFETCH_BYTES = 4096


def _row_kernel_ir(lay: RecordLayout) -> str:
    """void dots(w, row_bytes, xq, xd, xs, xl, n_records, r0, r1, out): out[r], r0 <= r < r1."""
    R = RECORD_ELEMENTS // 32
    nib = "" if lay.is_q8 else (_at("nibp", lay.nibble_offset)
                                + "  %nib = load <32 x i8>, ptr %nibp, align 1\n")
    return f"""
declare <8 x i32> @llvm.x86.avx2.pmadd.wd(<16 x i16>, <16 x i16>)
declare <16 x i16> @llvm.x86.avx2.pmadd.ub.sw(<32 x i8>, <32 x i8>)
declare <32 x i8> @llvm.x86.avx2.psign.b(<32 x i8>, <32 x i8>)
declare <32 x i8> @llvm.abs.v32i8(<32 x i8>, i1)
declare <8 x float> @llvm.fma.v8f32(<8 x float>, <8 x float>, <8 x float>)
declare float @llvm.fma.f32(float, float, float)
declare void @llvm.prefetch.p0(ptr, i32, i32, i32)
declare float @llvm.vector.reduce.fadd.v8f32(float, <8 x float>)
define void @dots(ptr %w, i64 %rb, ptr %xq, ptr %xd, ptr %xs, ptr %xl, i64 %nrec, i64 %r0,
                  i64 %r1, ptr %out) {{
entry:
  br label %row
row:
  %r = phi i64 [%r0, %entry], [%rn, %rowend]
  %ro = mul i64 %r, %rb
  %rowp = getelementptr i8, ptr %w, i64 %ro
  br label %rec
rec:
  %i = phi i64 [0, %row], [%in, %rec]
  %acc0 = phi <8 x float> [zeroinitializer, %row], [%acc{R}, %rec]
  %accm0 = phi float [0.0, %row], [%accm{R}, %rec]
  %b = mul i64 %i, {R}
  %rpo = mul i64 %i, {lay.size}
  %rp = getelementptr i8, ptr %rowp, i64 %rpo
{_at("pfp", _PREFETCH_BYTES)}  call void @llvm.prefetch.p0(ptr %pfp, i32 0, i32 3, i32 1)
{nib}{"".join(_block(lay, j) for j in range(R))}
  %in = add i64 %i, 1
  %ic = icmp ult i64 %in, %nrec
  br i1 %ic, label %rec, label %rowend
rowend:
  %sum = call float @llvm.vector.reduce.fadd.v8f32(float -0.0, <8 x float> %acc{R})
  %tot = fadd float %sum, %accm{R}
  %op = getelementptr float, ptr %out, i64 %r
  store float %tot, ptr %op
  %rn = add i64 %r, 1
  %rc = icmp slt i64 %rn, %r1
  br i1 %rc, label %row, label %done
done:
  ret void
}}
"""


_ARGS = [ctypes.c_void_p, ctypes.c_int64] + [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3 \
    + [ctypes.c_void_p]


def row_kernel(layout: RecordLayout) -> Callable:
    """ctypes fn(w, row_bytes, xq, xd, xs, xl, n_records, r0, r1, out) for this CPU (AVX2)."""
    return llvm_jit.compile_function(_row_kernel_ir(layout), "dots", _ARGS)
