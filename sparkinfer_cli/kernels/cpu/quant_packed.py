"""Decode matvec (T = 1, int8 activations) on weights kept in compact 32-element blocks.

Decode is bound by memory bandwidth, so the weights stay about as compact as ggml's own:

    Q4_0 Q4_1 Q5_0 Q5_1 Q8_0   the GGUF rows themselves, zero-copy
    Q4_K Q5_K                  repacked at load into Q4_1/Q5_1-like blocks whose d (= d·sc) and
                               m (= -dmin·mn) are float32       (0.75 / 0.875 bytes per weight)
    Q6_K                       repacked into blocks of two float32 scales d·sc, one per 16
                               elements, 4 low and 2 high bits per quant           (1 byte)

so that q·d + m is ggml's dequantized value bit for bit. A block is

    [d]{1,2} [m]? [high bits: 4 bytes (1 per quant) | 8 bytes (2 per quant)]? [qs]

byte i of the 16 qs bytes holds element i (low nibble) and i + 16 (high nibble); bit i of the
4 high bytes (little-endian) is bit 4 of element i; bits 2g, 2g+1 of high byte j are bits 4, 5 of
element j + 8g. Q8_0's qs is 32 int8.

The row kernel is LLVM IR for AVX2 (llvm_jit): a block is unpacked to 32 int8 quants in
registers and multiplied with x's int8 quants (quant_q8.quantize_q8, blocks of 32) by vpmaddubsw +
vpmaddwd into 8 int32 lanes, which are scaled and accumulated in 8 float lanes. Unsigned nibble
quants go straight into vpmaddubsw and their bias joins the offset term, (m - bias·d)·xs with
xs = xd·Σxq; signed ones (Q8_0, Q6_K) use llama.cpp's sign trick.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Callable

import numpy as np

from sparkinfer_cli.ggml_types import BLOCK_GEOMETRY, row_bytes
from sparkinfer_cli.kernels.cpu import llvm_jit
from sparkinfer_cli.kernels.cpu.quant import _readonly
from sparkinfer_cli.kernels.cpu.quant_blocks import Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, Q8_0
from sparkinfer_cli.kernels.cpu.quant_repack import _k_quant, _q6_k

F16, F32 = "half", "float"
NO_HIGH, HIGH_1BIT, HIGH_2BIT = 0, 4, 8  # bytes of high bits per block


@dataclass(frozen=True)
class BlockLayout:
    """One 32-element block: q = (nibble | high bits << 4) - bias, or 32 int8 when is_q8."""
    size: int  # bytes per block
    scale: str  # F16 or F32: the type of d and m
    n_scales: int  # 1, or 2 (elements 0..15 and 16..31)
    has_m: bool  # an offset m after the scales: value = q·d + m
    high: int  # NO_HIGH, HIGH_1BIT or HIGH_2BIT
    bias: int
    is_q8: bool = False

    @property
    def scale_bytes(self) -> int:
        return 2 if self.scale == F16 else 4

    @property
    def m_offset(self) -> int:
        return self.n_scales * self.scale_bytes

    @property
    def high_offset(self) -> int:
        return self.m_offset + (self.scale_bytes if self.has_m else 0)

    @property
    def qs_offset(self) -> int:
        return self.high_offset + self.high

    @property
    def is_signed(self) -> bool:
        """Quants with a sign bit (or 6 bits: |q - bias|·x pairs would overflow vpmaddubsw)."""
        return self.is_q8 or self.high == HIGH_2BIT


LAYOUTS: dict[int, BlockLayout] = {
    Q4_0: BlockLayout(18, F16, 1, False, NO_HIGH, 8),
    Q4_1: BlockLayout(20, F16, 1, True, NO_HIGH, 0),
    Q5_0: BlockLayout(22, F16, 1, False, HIGH_1BIT, 16),
    Q5_1: BlockLayout(24, F16, 1, True, HIGH_1BIT, 0),
    Q8_0: BlockLayout(34, F16, 1, False, NO_HIGH, 0, is_q8=True),
    Q4_K: BlockLayout(24, F32, 1, True, NO_HIGH, 0),
    Q5_K: BlockLayout(28, F32, 1, True, HIGH_1BIT, 0),
    Q6_K: BlockLayout(32, F32, 2, False, HIGH_2BIT, 32),
}
PACKED_TYPES: frozenset[int] = frozenset(LAYOUTS)


@dataclass(frozen=True)
class PackedWeight:
    blocks: np.ndarray  # uint8 (rows, ne0 / 32 · layout.size)
    ne0: int
    layout: BlockLayout

    @property
    def rows(self) -> int:
        return self.blocks.shape[0]

    @property
    def nbytes(self) -> int:
        return self.blocks.nbytes


def pack(raw: np.ndarray, ggml_type: int, ne0: int) -> PackedWeight:
    """raw uint8 (rows, row_bytes) as GGUFFile.raw gives it → PackedWeight (a view of raw for
    the legacy types, a lossless repack for the K-quants)."""
    if ggml_type not in LAYOUTS:
        raise ValueError(f"pack supports ggml types {sorted(LAYOUTS)}, got {ggml_type}")
    if raw.ndim != 2 or raw.shape[1] != row_bytes(ggml_type, ne0):
        raise ValueError(f"raw must be (rows, {row_bytes(ggml_type, ne0)}) uint8, got {raw.shape}")
    layout = LAYOUTS[ggml_type]
    if ggml_type in (Q4_K, Q5_K, Q6_K):
        raw = _repack_k(raw, ggml_type, layout)
    return PackedWeight(_readonly(np.ascontiguousarray(raw)), ne0, layout)


def _repack_k(raw: np.ndarray, ggml_type: int, layout: BlockLayout) -> np.ndarray:
    """K-quant superblocks → this module's 32-blocks: uint8 (rows, n_blocks · layout.size)."""
    superblocks = np.ascontiguousarray(raw).reshape(-1, BLOCK_GEOMETRY[ggml_type][1])
    if ggml_type == Q6_K:
        q, d, m = _q6_k(superblocks)  # q (n_super, 256) in -32..31; d (n_super, 16)
        q = q + 32
    else:
        q, d, m = _k_quant(superblocks, layout.high == HIGH_1BIT)  # d, m (n_super, 8)
    q = q.reshape(-1, 32).astype(np.uint8)  # (n_blocks, 32) unsigned quants
    parts = [_bytes(d, np.float32, layout.n_scales)]
    if layout.has_m:
        parts.append(_bytes(m, np.float32, 1))
    if layout.high == HIGH_1BIT:
        bits = (q >> 4).astype(np.uint32) << np.arange(32, dtype=np.uint32)  # (n_blocks, 32)
        parts.append(_bytes(bits.sum(axis=1, dtype=np.uint32), "<u4", 1))
    elif layout.high == HIGH_2BIT:
        fields = (q >> 4).reshape(-1, 4, 8) << np.array([0, 2, 4, 6], np.uint8)[:, None]
        parts.append(np.bitwise_or.reduce(fields, axis=1))  # (n_blocks, 8)
    parts.append((q[:, :16] & 15) | ((q[:, 16:] & 15) << 4))  # (n_blocks, 16)
    return np.concatenate(parts, axis=1).reshape(raw.shape[0], -1)  # (rows, n_blocks · size)


def _bytes(a: np.ndarray, dtype: type | str, per_block: int) -> np.ndarray:
    """per_block values of each 32-block as uint8 (n_blocks, itemsize · per_block)."""
    return np.ascontiguousarray(a, dtype=dtype).reshape(-1, per_block).view(np.uint8)


# ---- kernel -----------------------------------------------------------------------------------

def _vec(ty: str, values: list[int]) -> str:
    return "<" + ", ".join(f"{ty} {v}" for v in values) + ">"


def _i8s(v: int, n: int = 32) -> str:
    return _vec("i8", [v] * n)


def _load_scale(name: str, offset: int, scale: str) -> str:
    """IR: float %{name} read from the block at byte offset."""
    ir = (f"  %{name}p = getelementptr i8, ptr %bp, i64 {offset}\n"
          f"  %{name}r = load {scale}, ptr %{name}p, align 1\n")
    if scale == F16:
        return ir + f"  %{name} = fpext half %{name}r to float\n"
    return ir + f"  %{name} = fadd float %{name}r, -0.0\n"


def _high_bits(layout: BlockLayout) -> str:
    """IR: <32 x i8> %hb, each quant's high bits already shifted to bit 4 (and 5)."""
    ir = f"  %hp = getelementptr i8, ptr %bp, i64 {layout.high_offset}\n"
    if layout.high == HIGH_1BIT:  # byte i // 8 to lane i, tested against bit i % 8
        masks = [(1 << (i % 8)) - (256 if i % 8 == 7 else 0) for i in range(32)]
        return ir + ("  %h = load <4 x i8>, ptr %hp, align 1\n"
                     "  %hx = shufflevector <4 x i8> %h, <4 x i8> poison, <32 x i32> "
                     + _vec("i32", [i // 8 for i in range(32)]) + "\n"
                     f"  %hm = and <32 x i8> %hx, {_vec('i8', masks)}\n"
                     "  %hs = icmp ne <32 x i8> %hm, zeroinitializer\n"
                     f"  %hb = select <32 x i1> %hs, <32 x i8> {_i8s(16)}, <32 x i8> {_i8s(0)}\n")
    # 8 bytes to each quarter of the lanes; quarter g shifts its fields 2g down (dword shifts:
    # the bits a byte takes from its neighbour are masked off)
    return ir + ("  %h = load <8 x i8>, ptr %hp, align 1\n"
                 "  %hx = shufflevector <8 x i8> %h, <8 x i8> poison, <32 x i32> "
                 + _vec("i32", [i % 8 for i in range(32)]) + "\n"
                 "  %hd = bitcast <32 x i8> %hx to <8 x i32>\n"
                 "  %hsh = lshr <8 x i32> %hd, " + _vec("i32", [0, 0, 2, 2, 4, 4, 6, 6]) + "\n"
                 "  %h8 = bitcast <8 x i32> %hsh to <32 x i8>\n"
                 f"  %h3 = and <32 x i8> %h8, {_i8s(3)}\n  %hb = shl <32 x i8> %h3, {_i8s(4)}\n")


def _unpack_quants(layout: BlockLayout) -> str:
    """IR: <32 x i8> %qv, the block's quants (unsigned for nibble types, before the bias)."""
    ir = f"  %qsp = getelementptr i8, ptr %bp, i64 {layout.qs_offset}\n"
    if layout.is_q8:
        return ir + "  %qv = load <32 x i8>, ptr %qsp, align 1\n"
    ir += ("  %qs = load <16 x i8>, ptr %qsp, align 1\n"
           f"  %lo = and <16 x i8> %qs, {_i8s(15, 16)}\n  %hi = lshr <16 x i8> %qs, {_i8s(4, 16)}\n"
           "  %nib = shufflevector <16 x i8> %lo, <16 x i8> %hi, <32 x i32> "
           + _vec("i32", list(range(32))) + "\n")
    if layout.high == NO_HIGH:
        return ir.replace("%nib =", "%qv =")
    return ir + _high_bits(layout) + "  %qv = or <32 x i8> %nib, %hb\n"


def _int_dot(layout: BlockLayout) -> str:
    """IR: <8 x i32> %s; lane k = Σ q·xq over elements 4k..4k+3 (signed q: bias removed)."""
    ir, qa, xa = "", "%qv", "%xv"  # unsigned quants go into vpmaddubsw as they are
    if layout.is_signed:  # llama.cpp's sign trick: |q| (≤ 128, unsigned) · (x with q's sign)
        q, qa, xa = "%qv", "%qa", "%xa"
        if not layout.is_q8:
            ir, q = f"  %qb = sub <32 x i8> %qv, {_i8s(layout.bias)}\n", "%qb"
        ir += (f"  %qa = call <32 x i8> @llvm.abs.v32i8(<32 x i8> {q}, i1 false)\n"
               f"  %xa = call <32 x i8> @llvm.x86.avx2.psign.b(<32 x i8> %xv, <32 x i8> {q})\n")
    # i16 pair sums stay below 2·128·127; vpmaddwd with ones widens them to int32
    return ir + (f"  %p16 = call <16 x i16> @llvm.x86.avx2.pmadd.ub.sw(<32 x i8> {qa}, "
                 f"<32 x i8> {xa})\n"
                 "  %s = call <8 x i32> @llvm.x86.avx2.pmadd.wd(<16 x i16> %p16, <16 x i16> "
                 + _vec("i16", [1] * 16) + ")\n")


def _scale_lanes(layout: BlockLayout) -> str:
    """IR: <8 x float> %scv, d·xd per lane (lanes 0-3 are elements 0..15, 4-7 are 16..31)."""
    ir = _load_scale("ds", 0, layout.scale) + "  %sc = fmul float %ds, %xds\n"
    ir += "  %sci = insertelement <8 x float> poison, float %sc, i32 0\n"
    if layout.n_scales == 1:
        return ir + ("  %scv = shufflevector <8 x float> %sci, <8 x float> poison, <8 x i32> "
                     "zeroinitializer\n")
    return ir + (_load_scale("ds1", layout.scale_bytes, layout.scale)
                 + "  %sc1 = fmul float %ds1, %xds\n"
                 "  %scj = insertelement <8 x float> %sci, float %sc1, i32 1\n"
                 "  %scv = shufflevector <8 x float> %scj, <8 x float> poison, <8 x i32> "
                 + _vec("i32", [0, 0, 0, 0, 1, 1, 1, 1]) + "\n")


def _offset_term(layout: BlockLayout) -> str:
    """IR: %accm2 = %accm + (m - bias·d)·xs for unsigned quants (xs = xd·Σ xq of the block)."""
    if layout.is_signed:
        return "  %accm2 = fadd float %accm, -0.0\n"
    ir = f"  %mt0 = fmul float %ds, -{layout.bias}.0\n"
    if layout.has_m:
        ir += _load_scale("ms", layout.m_offset, layout.scale) + "  %mt = fadd float %ms, %mt0\n"
    else:
        ir += "  %mt = fadd float %mt0, -0.0\n"
    return ir + ("  %xsp = getelementptr float, ptr %xs, i64 %b\n  %xsv = load float, ptr %xsp\n"
                 "  %accm2 = call float @llvm.fma.f32(float %mt, float %xsv, float %accm)\n")


# Software prefetch this far ahead in the row: measured 17-25 % faster on the 144 MB output
# matrix, where the hardware prefetcher alone falls behind on 22-34-byte blocks.
_PREFETCH_BYTES = 1024


def _row_kernel_ir(layout: BlockLayout) -> str:
    """void dots(w, row_bytes, xq, xd, xs, n_blocks, r0, r1, out): out[r] for r0 <= r < r1."""
    return f"""
declare <8 x i32> @llvm.x86.avx2.pmadd.wd(<16 x i16>, <16 x i16>)
declare <16 x i16> @llvm.x86.avx2.pmadd.ub.sw(<32 x i8>, <32 x i8>)
declare <32 x i8> @llvm.x86.avx2.psign.b(<32 x i8>, <32 x i8>)
declare <32 x i8> @llvm.abs.v32i8(<32 x i8>, i1)
declare <8 x float> @llvm.fma.v8f32(<8 x float>, <8 x float>, <8 x float>)
declare float @llvm.fma.f32(float, float, float)
declare void @llvm.prefetch.p0(ptr, i32, i32, i32)
declare float @llvm.vector.reduce.fadd.v8f32(float, <8 x float>)
define void @dots(ptr %w, i64 %rb, ptr %xq, ptr %xd, ptr %xs, i64 %nb, i64 %r0, i64 %r1,
                  ptr %out) {{
entry:
  br label %row
row:
  %r = phi i64 [%r0, %entry], [%rn, %rowend]
  %ro = mul i64 %r, %rb
  %rowp = getelementptr i8, ptr %w, i64 %ro
  br label %blk
blk:
  %b = phi i64 [0, %row], [%bn, %blk]
  %acc = phi <8 x float> [zeroinitializer, %row], [%acc2, %blk]
  %accm = phi float [0.0, %row], [%accm2, %blk]
  %bo = mul i64 %b, {layout.size}
  %bp = getelementptr i8, ptr %rowp, i64 %bo
  %pfp = getelementptr i8, ptr %bp, i64 {_PREFETCH_BYTES}
  call void @llvm.prefetch.p0(ptr %pfp, i32 0, i32 3, i32 1)
  %e = shl i64 %b, 5
  %xp = getelementptr i8, ptr %xq, i64 %e
  %xv = load <32 x i8>, ptr %xp, align 1
  %xdp = getelementptr float, ptr %xd, i64 %b
  %xds = load float, ptr %xdp
{_unpack_quants(layout)}{_int_dot(layout)}{_scale_lanes(layout)}
  %f = sitofp <8 x i32> %s to <8 x float>
  %acc2 = call <8 x float> @llvm.fma.v8f32(<8 x float> %f, <8 x float> %scv, <8 x float> %acc)
{_offset_term(layout)}
  %bn = add i64 %b, 1
  %bc = icmp ult i64 %bn, %nb
  br i1 %bc, label %blk, label %rowend
rowend:
  %sum = call float @llvm.vector.reduce.fadd.v8f32(float -0.0, <8 x float> %acc2)
  %tot = fadd float %sum, %accm2
  %op = getelementptr float, ptr %out, i64 %r
  store float %tot, ptr %op
  %rn = add i64 %r, 1
  %rc = icmp slt i64 %rn, %r1
  br i1 %rc, label %row, label %done
done:
  ret void
}}
"""


_ARGS = [ctypes.c_void_p, ctypes.c_int64] + [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 3 \
    + [ctypes.c_void_p]


def row_kernel(layout: BlockLayout) -> Callable:
    """ctypes fn(w, row_bytes, xq, xd, xs, n_blocks, r0, r1, out) for this CPU (needs AVX2)."""
    return llvm_jit.compile_function(_row_kernel_ir(layout), "dots", _ARGS)
