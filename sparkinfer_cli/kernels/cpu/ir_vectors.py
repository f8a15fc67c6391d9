"""LLVM IR text for code on vectors of 8 floats (the CPU kernels written in IR: llvm_jit).

Loads and stores read or write float32 or float16 elements (widened to float32 in registers),
the last vector of a row masked where the row is not a multiple of 8 long; `exp` is a
vectorized e^x for x ≤ 0.
"""

from __future__ import annotations

import struct

import numpy as np

W = 8  # lanes of a vector


def f32(value: float) -> str:
    """value rounded to float32, as an LLVM IR float constant (the hex of its double)."""
    exact = float(np.float32(value))
    return "0x%016X" % struct.unpack("<Q", struct.pack("<d", exact))[0]


def splat(value: float) -> str:
    return "<" + ", ".join(f"float {f32(value)}" for _ in range(W)) + ">"


def ints(values: list[int], ty: str = "i32") -> str:
    return "<" + ", ".join(f"{ty} {v}" for v in values) + ">"


def mask(width: int) -> str:
    return "<8 x i1> <" + ", ".join(f"i1 {str(i < width).lower()}" for i in range(W)) + ">"


# LLVM's name of a vector element type: (IR type, intrinsic suffix, bytes)
ELEMENTS = {"float": ("float", "f32", 4), "half": ("half", "f16", 2)}


def broadcast(name: str, scalar: str, ty: str = "float") -> str:
    """IR: <8 x ty> %name, every lane the scalar."""
    return (f"  %{name}_s = insertelement <8 x {ty}> poison, {ty} {scalar}, i32 0\n"
            f"  %{name} = shufflevector <8 x {ty}> %{name}_s, <8 x {ty}> poison, "
            "<8 x i32> zeroinitializer\n")


def load(name: str, ptr: str, width: int, ty: str = "float") -> str:
    """IR: <8 x float> %name from ptr (elements of ty, widened), its lanes ≥ width zero (masked:
    no read past the row)."""
    ir_ty, suffix, size = ELEMENTS[ty]
    raw = f"%{name}" if ty == "float" else f"%{name}_raw"
    if width == W:
        ir = f"  {raw} = load <8 x {ir_ty}>, ptr {ptr}, align {size}\n"
    else:
        ir = (f"  {raw} = call <8 x {ir_ty}> @llvm.masked.load.v8{suffix}.p0(ptr {ptr}, "
              f"i32 {size}, {mask(width)}, <8 x {ir_ty}> zeroinitializer)\n")
    if ty != "float":
        ir += f"  %{name} = fpext <8 x {ir_ty}> {raw} to <8 x float>\n"
    return ir


def store(value: str, ptr: str, width: int, ty: str = "float") -> str:
    """IR: store <8 x float> value to ptr (as elements of ty), lanes ≥ width left alone."""
    ir_ty, suffix, size = ELEMENTS[ty]
    ir = ""
    if ty != "float":
        ir = f"  {value}_{ty} = fptrunc <8 x float> {value} to <8 x {ir_ty}>\n"
        value = f"{value}_{ty}"
    if width == W:
        return ir + f"  store <8 x {ir_ty}> {value}, ptr {ptr}, align {size}\n"
    return ir + (f"  call void @llvm.masked.store.v8{suffix}.p0(<8 x {ir_ty}> {value}, ptr {ptr}, "
                 f"i32 {size}, {mask(width)})\n")


def exp(x: str, out: str) -> str:
    """IR: %out = e^x for x ≤ 0 (-inf included: 0), Cephes' expf: x = n·ln2 + r, e^r by a
    degree-5 polynomial, 2^n from the exponent bits."""
    c = [1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1,
         5.0000001201e-1]
    ir = (f"  %{out}u = fcmp olt <8 x float> {x}, {splat(-87.0)}\n"
          f"  %{out}x = select <8 x i1> %{out}u, <8 x float> {splat(-87.0)}, <8 x float> {x}\n"
          f"  %{out}m = fmul <8 x float> %{out}x, {splat(1.44269504088896341)}\n"
          f"  %{out}n = call <8 x float> @llvm.roundeven.v8f32(<8 x float> %{out}m)\n"
          f"  %{out}r0 = call <8 x float> @llvm.fma.v8f32(<8 x float> %{out}n, <8 x float> "
          f"{splat(-0.693359375)}, <8 x float> %{out}x)\n"
          f"  %{out}r = call <8 x float> @llvm.fma.v8f32(<8 x float> %{out}n, <8 x float> "
          f"{splat(2.12194440e-4)}, <8 x float> %{out}r0)\n")
    prev = splat(c[0])
    for i, ci in enumerate(c[1:]):
        ir += (f"  %{out}c{i} = call <8 x float> @llvm.fma.v8f32(<8 x float> {prev}, "
               f"<8 x float> %{out}r, <8 x float> {splat(ci)})\n")
        prev = f"%{out}c{i}"
    return ir + (f"  %{out}r2 = fmul <8 x float> %{out}r, %{out}r\n"
                 f"  %{out}y0 = call <8 x float> @llvm.fma.v8f32(<8 x float> {prev}, "
                 f"<8 x float> %{out}r2, <8 x float> %{out}r)\n"
                 f"  %{out}y = fadd <8 x float> %{out}y0, {splat(1.0)}\n"
                 f"  %{out}ni = fptosi <8 x float> %{out}n to <8 x i32>\n"
                 f"  %{out}nb = add <8 x i32> %{out}ni, {ints([127] * W)}\n"
                 f"  %{out}ns = shl <8 x i32> %{out}nb, {ints([23] * W)}\n"
                 f"  %{out}two = bitcast <8 x i32> %{out}ns to <8 x float>\n"
                 f"  %{out}e = fmul <8 x float> %{out}y, %{out}two\n"
                 f"  %{out} = select <8 x i1> %{out}u, <8 x float> zeroinitializer, "
                 f"<8 x float> %{out}e\n")


DECLARATIONS = """declare <8 x float> @llvm.fma.v8f32(<8 x float>, <8 x float>, <8 x float>)
declare <8 x float> @llvm.maxnum.v8f32(<8 x float>, <8 x float>)
declare <8 x float> @llvm.roundeven.v8f32(<8 x float>)
declare float @llvm.vector.reduce.fmax.v8f32(<8 x float>)
declare float @llvm.vector.reduce.fadd.v8f32(float, <8 x float>)
declare i64 @llvm.umin.i64(i64, i64)
declare void @llvm.prefetch.p0(ptr, i32, i32, i32)
declare <8 x float> @llvm.masked.load.v8f32.p0(ptr, i32, <8 x i1>, <8 x float>)
declare void @llvm.masked.store.v8f32.p0(<8 x float>, ptr, i32, <8 x i1>)
declare <8 x half> @llvm.masked.load.v8f16.p0(ptr, i32, <8 x i1>, <8 x half>)
declare void @llvm.masked.store.v8f16.p0(<8 x half>, ptr, i32, <8 x i1>)
"""
