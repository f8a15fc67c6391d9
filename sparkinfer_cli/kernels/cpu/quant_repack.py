"""Decode matmul on ggml weights repacked at load time into plain int8 quants + float32 scales.

The quant_q8 kernels unpack 4/5/6-bit fields per weight and are compute-bound at T = 1. Here a
2-D quantized weight is unpacked once, losslessly, into

    q  int8    (rows, ne0)         the type's integer quant, offsets applied (Q5_0: nibble|bit - 16)
    d  float32 (rows, ne0 / g)     per sub-block scale (K-quants: d * sc, as ggml computes it)
    m  float32 (rows, ne0 / g)     per sub-block offset (Q4_1/Q5_1: m; K-quants: -dmin * mn), or
                                   (rows, 0) for types without one

so that q * d + m is ggml's dequantized value bit for bit; g = 32 (16 for Q6_K). A matvec is then
one int8 x int8 -> int32 dot over contiguous memory per sub-block, with x quantized once per call
by quant_q8.quantize_q8 (blocks of 32), plus d * xd * dot + m * xs.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
from typing import Callable

import llvmlite.binding as llvm
import numpy as np
from gguf.quants import Q4_K as _GGUF_Q4_K
from numba import njit

from sparkinfer_cli.ggml_types import BLOCK_GEOMETRY, row_bytes
from sparkinfer_cli.kernels.cpu.quant import _parallel_rows, _readonly
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
from sparkinfer_cli.kernels.cpu.quant_q8 import quantize_q8

_i32, _f32 = np.int32, np.float32


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


# ---- kernels ----------------------------------------------------------------------------------
# numba alone gives 78-85 ms per decode token against 55-62 ms for the IR kernel: LLVM reduces
# each 32-element dot to a scalar before the float multiply-add. So the row kernel is LLVM IR,
# as llama.cpp's AVX2 ggml_vec_dot_q8_0_q8_0: per 32-block two vpmaddwd give 8 int32 lanes,
# which are converted and scaled into 8 float lanes; one horizontal sum per row. llvmlite (numba's
# own LLVM) compiles it for the host CPU; hosts without AVX2 use the numba kernel below.

@njit(cache=True, nogil=True)
def _dot_rows(q, d, m, xq, xd, xs, group, r0, r1, out):
    """out[r] = Σ_b d[r,b]·xd·Σ_i q·xq (+ m[r,b]·xs) for rows r0..r1; group at run time."""
    has_m = m.shape[1] > 0
    for r in range(r0, r1):
        acc = _f32(0)
        for b in range(d.shape[1]):
            e = b * group
            s = _i32(0)
            for i in range(group):
                s = _i32(s + _i32(_i32(q[r, e + i]) * _i32(xq[e + i])))
            acc += d[r, b] * xd[e >> 5] * _f32(s)
            if has_m:
                acc += m[r, b] * xs[e >> 5]
        out[r] = acc


def _splat(name: str, scalar: str) -> str:
    return (f"  %{name}i = insertelement <8 x float> poison, float {scalar}, i32 0\n"
            f"  %{name} = shufflevector <8 x float> %{name}i, <8 x float> poison, "
            "<8 x i32> zeroinitializer\n")


def _half(v: str, h: int) -> str:
    """%{v}{h}: elements 16h..16h+16 of <32 x i8> %{v}v, sign-extended to <16 x i16>."""
    idx = ", ".join(f"i32 {16 * h + i}" for i in range(16))
    return (f"  %{v}{h}b = shufflevector <32 x i8> %{v}v, <32 x i8> poison, <16 x i32> <{idx}>\n"
            f"  %{v}{h} = sext <16 x i8> %{v}{h}b to <16 x i16>\n")


def _scaled_block(group: int) -> str:
    """IR: %t = this 32-block's 8 float lanes, Σ over lanes = d·xd·Σ q·xq."""
    ir = "".join(_half(v, h) for v in "qx" for h in (0, 1))
    ir += "".join(f"  %p{h} = call <8 x i32> @llvm.x86.avx2.pmadd.wd(<16 x i16> %q{h}, "
                  f"<16 x i16> %x{h})\n" for h in (0, 1))
    if group == 32:  # one scale: add the int lanes first
        return ir + ("  %s = add <8 x i32> %p0, %p1\n  %f = sitofp <8 x i32> %s to <8 x float>\n"
                     "  %dp = getelementptr float, ptr %rowd, i64 %b\n  %ds = load float, ptr %dp\n"
                     "  %sc = fmul float %ds, %xds\n" + _splat("scv", "%sc")
                     + "  %t = fmul <8 x float> %f, %scv\n")
    for h in (0, 1):  # a scale per 16-element half
        ir += (f"  %f{h} = sitofp <8 x i32> %p{h} to <8 x float>\n"
               f"  %dp{h} = getelementptr float, ptr %rowd, i64 %b2{h}\n"
               f"  %ds{h} = load float, ptr %dp{h}\n  %sc{h} = fmul float %ds{h}, %xds\n"
               + _splat(f"s{h}v", f"%sc{h}") + f"  %t{h} = fmul <8 x float> %f{h}, %s{h}v\n")
    return ("  %b20 = shl i64 %b, 1\n  %b21 = or i64 %b20, 1\n" + ir
            + "  %t = fadd <8 x float> %t0, %t1\n")


def _min_term(has_m: bool) -> str:
    """IR: %accm2 = %accm + m[r, b]·xs[b] (Q4_1/Q5_1/K-quant offsets; group is 32 then)."""
    if not has_m:
        return "  %accm2 = fadd float %accm, -0.0\n"
    return ("  %mp = getelementptr float, ptr %rowm, i64 %b\n  %mv = load float, ptr %mp\n"
            "  %xsp = getelementptr float, ptr %xs, i64 %b\n  %xsv = load float, ptr %xsp\n"
            "  %mx = fmul float %mv, %xsv\n  %accm2 = fadd float %accm, %mx\n")


def _row_kernel_ir(group: int, has_m: bool) -> str:
    """void dots(q, d, m, xq, xd, xs, ne0, r0, r1, out): out[r] for rows r0..r1 (r0 < r1)."""
    return f"""
declare <8 x i32> @llvm.x86.avx2.pmadd.wd(<16 x i16>, <16 x i16>)
declare float @llvm.vector.reduce.fadd.v8f32(float, <8 x float>)
define void @dots(ptr %q, ptr %d, ptr %m, ptr %xq, ptr %xd, ptr %xs, i64 %ne0, i64 %r0, i64 %r1,
                  ptr %out) {{
entry:
  %nb = lshr i64 %ne0, 5
  %nsub = udiv i64 %ne0, {group}
  br label %row
row:
  %r = phi i64 [%r0, %entry], [%rn, %rowend]
  %qo = mul i64 %r, %ne0
  %rowq = getelementptr i8, ptr %q, i64 %qo
  %so = mul i64 %r, %nsub
  %rowd = getelementptr float, ptr %d, i64 %so
  %rowm = getelementptr float, ptr %m, i64 %so
  br label %blk
blk:
  %b = phi i64 [0, %row], [%bn, %blk]
  %acc = phi <8 x float> [zeroinitializer, %row], [%acc2, %blk]
  %accm = phi float [0.0, %row], [%accm2, %blk]
  %e = shl i64 %b, 5
  %qp = getelementptr i8, ptr %rowq, i64 %e
  %xp = getelementptr i8, ptr %xq, i64 %e
  %qv = load <32 x i8>, ptr %qp, align 1
  %xv = load <32 x i8>, ptr %xp, align 1
  %xdp = getelementptr float, ptr %xd, i64 %b
  %xds = load float, ptr %xdp
{_scaled_block(group)}
  %acc2 = fadd <8 x float> %acc, %t
{_min_term(has_m)}
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


_ROW_KERNEL_ARGS = [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 3 + [ctypes.c_void_p]
_COMPILED: dict[tuple[int, bool], tuple[object, Callable]] = {}  # keeps each JIT engine alive


@functools.cache
def has_avx2() -> bool:
    return "+avx2" in llvm.get_host_cpu_features().flatten().split(",")


def _row_kernel(group: int, has_m: bool) -> Callable:
    """The IR row kernel compiled for this CPU (ctypes: releases the GIL while it runs)."""
    key = (group, has_m)
    if key not in _COMPILED:
        llvm.initialize_native_target()
        llvm.initialize_native_asmprinter()
        tm = llvm.Target.from_default_triple().create_target_machine(
            cpu=llvm.get_host_cpu_name(), features=llvm.get_host_cpu_features().flatten(), opt=3)
        module = llvm.parse_assembly(_row_kernel_ir(group, has_m))
        engine = llvm.create_mcjit_compiler(module, tm)
        engine.finalize_object()
        fn = ctypes.CFUNCTYPE(None, *_ROW_KERNEL_ARGS)(engine.get_function_address("dots"))
        _COMPILED[key] = (engine, fn)
    return _COMPILED[key][1]


def _matvec_rows(w: RepackedWeight, xq: np.ndarray, xd: np.ndarray, xs: np.ndarray,
                 out: np.ndarray, use_ir: bool) -> Callable[[int, int], None]:
    """fn(r0, r1) filling out[r0:r1] for one token (xq, xd, xs and out 1-D)."""
    if not use_ir:
        return lambda r0, r1: _dot_rows(w.q, w.d, w.m, xq, xd, xs, w.group, r0, r1, out)
    kernel = _row_kernel(w.group, w.m.shape[1] > 0)
    ptrs = [a.ctypes.data for a in (w.q, w.d, w.m, xq, xd, xs)]
    return lambda r0, r1: kernel(*ptrs, w.q.shape[1], r0, r1, out.ctypes.data)


def matmul_repacked(w: RepackedWeight, x: np.ndarray, use_ir: bool | None = None) -> np.ndarray:
    """x float32 (T, ne0) → float32 (T, rows) = dequantize(W) @ dequantize(x quantized to int8
    blocks of 32) per token, up to float32 rounding. use_ir: the LLVM IR kernel (default: where
    the CPU has AVX2) or the numba one."""
    rows, ne0 = w.q.shape
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim != 2 or x.shape[1] != ne0:
        raise ValueError(f"x must be (T, {ne0}), got {x.shape}")
    use_ir = has_avx2() if use_ir is None else use_ir
    xq, xd, xs = quantize_q8(x)
    out = np.empty((x.shape[0], rows), np.float32)  # (T, rows)
    for t in range(x.shape[0]):
        # the arrays must outlive the threads: _parallel_rows returns only when all are done
        _parallel_rows(_matvec_rows(w, xq[t], xd[t], xs[t], out[t], use_ir), rows, ne0)
    return out
