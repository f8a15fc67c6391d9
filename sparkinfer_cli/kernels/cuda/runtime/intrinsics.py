"""Inline-PTX device intrinsics that numba.cuda lacks, each with a pure-Python simulator twin.

Loads take any C-contiguous device array plus a *byte* offset into it, so one intrinsic serves uint8
weight bytes, int8 activations and float32 vectors alike. `.nc` loads go through the read-only data
cache: only use them on buffers no kernel in the same launch writes. Alignment is the caller's duty
(u16: 2 bytes, u32: 4, v2: 8, v4: 16); a misaligned address faults on the GPU.

Under NUMBA_ENABLE_CUDASIM=1 the same names are plain Python functions giving bit-identical results.

Tensor cores (mma.sync m16n8k16, f16 inputs, f32 accumulators): `ldmatrix_x4` reads a 16×16 f16
tile from shared memory into a warp's fragments and `mma_f16_f32` multiplies fragments. A lane's
simulator twin cannot see the other lanes' registers, so in the simulator a fragment register is a
`Fragment` that carries the whole 8×8 matrix it came from (its int() is the lane's real u32);
the mma twin rebuilds A and B from them and returns exactly this lane's C elements (f32 sums in a
fixed order: equal to the GPU's up to the order of the additions). A register computed in the
kernel (e.g. probabilities packed with `pack_f16x2` into an A fragment) is a plain int: then the
twin gathers all 32 lanes' registers through `warp_exchange` and rebuilds A and B from the
documented fragment layout instead. `ldmatrix_x4_trans` reads a row-major (k, n) tile as B
fragments (ldmatrix .trans).

Int8 tensor cores (mma.sync m16n8k32, s8 inputs, s32 sums): `ldmatrix_x4_b8` is the same ldmatrix
over a 16×32-byte tile (its fragments are the A of m16n8k32 for a row-major (m, k) tile and the B of
two n8 tiles for an (n, k) tile) and `mma_s8_s32` multiplies them, exactly.
`ld_s8_fragments_x4` gives the same A registers for rows that are only 4- or 2-byte aligned.

`lds_v2_u32` / `lds_v4_u32` read 2 / 4 adjacent words of a shared u32 array in one instruction
(one bank-conflict-free wavefront for a quarter warp's 16 bytes instead of one load a word).

Asynchronous copies (sm_80+): `cp_async_16` starts a 16-byte copy from global to shared memory
that no register waits on; `cp_async_commit` closes the thread's group of copies started since the
last one, and `cp_async_wait(n)` (n a compile-time constant) waits until at most n of its groups
are still in flight. A barrier after the wait makes every thread's copies visible to the block.
The simulator copies at once.
"""

from __future__ import annotations

import numpy as np
from numba.cuda.core import config

IS_SIMULATOR: bool = bool(config.ENABLE_CUDASIM)
# ldmatrix reads 16-byte rows: shared tiles it reads are declared with this alignment (the
# simulator takes no alignment argument)
LDMATRIX_ALIGN = None if IS_SIMULATOR else 16

if IS_SIMULATOR:
    import threading

    _warps: dict[tuple[int, int], tuple[list, threading.Barrier]] = {}
    _warps_lock = threading.Lock()

    def _thread_index() -> int:
        t = threading.current_thread()
        bx, by, _ = t._manager._block_dim
        return t.threadIdx.x + bx * (t.threadIdx.y + by * t.threadIdx.z)

    def lane_id() -> int:
        """This simulated thread's lane in its warp."""
        return _thread_index() % 32

    def warp_exchange(v) -> list:
        """The values every lane of this simulated warp passes (all 32 lanes must call it)."""
        t, tid = threading.current_thread(), _thread_index()
        with _warps_lock:
            vals, barrier = _warps.setdefault((id(t._manager), tid // 32),
                                              ([None] * 32, threading.Barrier(32)))
        vals[tid % 32] = v
        barrier.wait()
        out = list(vals)
        barrier.wait()  # nobody overwrites vals before every lane has read
        return out

    def _bytes(arr) -> np.ndarray:
        # NOTE: in a simulated kernel an array is a FakeWithinKernelCUDAArray around a numpy array.
        inner = getattr(arr, "_item", arr)
        ary = getattr(inner, "_ary", inner)
        return np.asarray(ary).reshape(-1).view(np.uint8)

    def _u32_at(b: np.ndarray, off: int) -> int:
        return int(b[off]) | int(b[off + 1]) << 8 | int(b[off + 2]) << 16 | int(b[off + 3]) << 24

    def ld_u16(arr, off):
        b = _bytes(arr)
        return np.uint32(int(b[off]) | int(b[off + 1]) << 8)

    def ld_u32(arr, off):
        return np.uint32(_u32_at(_bytes(arr), int(off)))

    def ld_v2_u32(arr, off):
        b, off = _bytes(arr), int(off)
        return np.uint32(_u32_at(b, off)), np.uint32(_u32_at(b, off + 4))

    def ld_v4_u32(arr, off):
        b, off = _bytes(arr), int(off)
        return tuple(np.uint32(_u32_at(b, off + 4 * i)) for i in range(4))

    def lds_v2_u32(words, i):
        return np.uint32(words[i]), np.uint32(words[i + 1])

    def lds_v4_u32(words, i):
        return tuple(np.uint32(words[i + j]) for j in range(4))

    def dp4a(a, b, c):
        a, b = int(a) & 0xFFFFFFFF, int(b) & 0xFFFFFFFF
        acc = int(c)
        for shift in (0, 8, 16, 24):
            qa, qb = (a >> shift) & 0xFF, (b >> shift) & 0xFF
            acc += (qa - 256 if qa > 127 else qa) * (qb - 256 if qb > 127 else qb)
        return np.int32(acc)

    def byte_perm(a, b, s):
        src = (int(a) & 0xFFFFFFFF) | (int(b) & 0xFFFFFFFF) << 32
        out = 0
        for n in range(4):
            sel = (int(s) >> (4 * n)) & 0xF
            byte = (src >> (8 * (sel & 7))) & 0xFF
            if sel & 8:  # sign-replicate mode of prmt
                byte = 0xFF if byte & 0x80 else 0
            out |= byte << (8 * n)
        return np.uint32(out)

    def funnel_shift_r(lo, hi, shift):
        both = (int(lo) & 0xFFFFFFFF) | (int(hi) & 0xFFFFFFFF) << 32
        return np.uint32((both >> min(int(shift), 32)) & 0xFFFFFFFF)

    def f16_bits_to_f32(h):
        return np.float32(np.array([int(h) & 0xFFFF], np.uint16).view(np.float16)[0])

    def bits_to_f32(u):
        return np.array([int(u) & 0xFFFFFFFF], np.uint32).view(np.float32)[0]

    def fma_f32(a, b, c):
        # the float64 product of two float32 is exact (the simulator's cuda.fma rounds it first)
        return np.float32(np.float64(a) * np.float64(b) + np.float64(c))

    def chain_start():
        pass

    def cp_async_16(dst, dst_off, src, src_off):
        d, dst_off, src_off = _bytes(dst), int(dst_off), int(src_off)
        d[dst_off:dst_off + 16] = _bytes(src)[src_off:src_off + 16]

    def cp_async_commit():
        pass

    def cp_async_wait(n):
        pass

    def pack_f16x2(lo, hi):
        with np.errstate(over="ignore"):  # out of range → ±inf, as cvt.rn does
            halves = np.array([lo, hi], np.float32).astype(np.float16)  # round to nearest even
        return np.uint32(halves.view(np.uint32)[0])

    def _f16x2(u) -> np.ndarray:
        return np.array([int(u) & 0xFFFFFFFF], np.uint32).view(np.float16).astype(np.float64)

    def _from_f16x2(v: np.ndarray):
        with np.errstate(over="ignore"):
            return np.uint32(v.astype(np.float16).view(np.uint32)[0])

    def hsub2(a, b):
        return _from_f16x2(_f16x2(a) - _f16x2(b))

    def hfma2(a, b, c):
        return _from_f16x2(_f16x2(a) * _f16x2(b) + _f16x2(c))

    class Fragment:
        """A lane's register from ldmatrix: its int() is the 4 bytes 4·(lane%4)..+3 of row
        lane//4 of its 8-row × 16-byte matrix (f16: cols 2·(lane%4), +1; int8: 4·(lane%4)..+3)."""

        __slots__ = ("matrix", "lane", "dtype")

        def __init__(self, matrix: np.ndarray, lane: int, dtype):
            # (8, 16 bytes of dtype) values, widened to float32 (f16) or int64 (int8) for the mma
            self.matrix, self.lane, self.dtype = matrix, lane, dtype

        def __int__(self) -> int:
            g, t = divmod(self.lane, 4)
            n = 4 // np.dtype(self.dtype).itemsize  # elements a register
            return int(self.matrix[g, n * t:n * t + n].astype(self.dtype).view(np.uint32)[0])

        __index__ = __int__

    def _ldmatrix_x4_twin(arr, tile_off, row_stride, lane, dtype, wide):
        """The 16-row × 32-byte tile's four 8-row × 16-byte matrices in ldmatrix_x4's order."""
        size = np.dtype(dtype).itemsize
        tile = np.ndarray((16, 32 // size), dtype, buffer=_bytes(arr), offset=int(tile_off),
                          strides=(int(row_stride), size)).astype(wide)  # (16 rows, k)
        h, lane = 16 // size, int(lane)
        return tuple(Fragment(m, lane, dtype)
                     for m in (tile[:8, :h], tile[8:, :h], tile[:8, h:], tile[8:, h:]))

    def _b_pairs(m):
        return m[0], m[2], m[1], m[3]

    def ldmatrix_x4(arr, tile_off, row_stride, lane):
        return _ldmatrix_x4_twin(arr, tile_off, row_stride, lane, np.float16, np.float32)

    def ldmatrix_x4_pairs(arr, tile_off, row_stride, lane):
        return _b_pairs(ldmatrix_x4(arr, tile_off, row_stride, lane))

    def ldmatrix_x4_trans(arr, tile_off, row_stride, lane):
        return tuple(Fragment(m.matrix.T, m.lane, m.dtype)
                     for m in ldmatrix_x4(arr, tile_off, row_stride, lane))

    def ldmatrix_x4_b8(arr, tile_off, row_stride, lane):
        return _ldmatrix_x4_twin(arr, tile_off, row_stride, lane, np.int8, np.int64)

    def ldmatrix_x4_b8_pairs(arr, tile_off, row_stride, lane):
        return _b_pairs(ldmatrix_x4_b8(arr, tile_off, row_stride, lane))

    def ld_s8_fragments_x4(arr, tile_word, row_words, lane, half_word):
        return ldmatrix_x4_b8(arr, 4 * tile_word + (2 if half_word else 0), 4 * row_words, lane)

    def _mma_twin(a0, a1, a2, a3, b0, b1):
        """This lane's sums of A × B: (row g × cols 2t, 2t+1), (row g + 8 × the same cols)."""
        g, t = divmod(a0.lane, 4)
        b_lo, b_hi = b0.matrix[2 * t:2 * t + 2], b1.matrix[2 * t:2 * t + 2]  # (2 n, k / 2) each
        top = a0.matrix[g] @ b_lo.T + a2.matrix[g] @ b_hi.T
        bottom = a1.matrix[g] @ b_lo.T + a3.matrix[g] @ b_hi.T
        return top, bottom

    def _halves(words) -> np.ndarray:
        """(32 lanes, n) u32 registers → (32, n, 2) float32: each register's low, high f16."""
        return np.asarray(words, np.uint32).view(np.float16).reshape(32, -1, 2).astype(np.float32)

    def _mma_twin_from_registers(a0, a1, a2, a3, b0, b1):
        """_mma_twin for registers without their matrices: A (16 × 16) and B (16 k × 8 n) are
        rebuilt from all lanes' registers (lane = 4g + t: a0 row g cols 2t, 2t+1; a1 row g + 8;
        a2, a3 the same rows at cols + 8; b0 k 2t, 2t+1 of col g; b1 k + 8)."""
        regs = _halves(warp_exchange(tuple(int(r) for r in (a0, a1, a2, a3, b0, b1))))
        a, b = np.zeros((16, 16), np.float32), np.zeros((16, 8), np.float32)
        for lane in range(32):
            g, t = divmod(lane, 4)
            r = regs[lane]
            a[g, 2 * t:2 * t + 2], a[g + 8, 2 * t:2 * t + 2] = r[0], r[1]
            a[g, 2 * t + 8:2 * t + 10], a[g + 8, 2 * t + 8:2 * t + 10] = r[2], r[3]
            b[2 * t:2 * t + 2, g], b[2 * t + 8:2 * t + 10, g] = r[4], r[5]
        g, t = divmod(lane_id(), 4)
        d = a @ b
        return d[g, 2 * t:2 * t + 2], d[g + 8, 2 * t:2 * t + 2]

    def mma_f16_f32(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        if all(isinstance(r, Fragment) for r in (a0, a1, a2, a3, b0, b1)):
            top, bottom = _mma_twin(a0, a1, a2, a3, b0, b1)
        else:
            top, bottom = _mma_twin_from_registers(a0, a1, a2, a3, b0, b1)
        return (np.float32(c0 + top[0]), np.float32(c1 + top[1]),
                np.float32(c2 + bottom[0]), np.float32(c3 + bottom[1]))

    def mma_s8_s32(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        top, bottom = _mma_twin(a0, a1, a2, a3, b0, b1)
        return (np.int32(c0 + top[0]), np.int32(c1 + top[1]),
                np.int32(c2 + bottom[0]), np.int32(c3 + bottom[1]))

else:
    from llvmlite import ir
    from numba import cuda, types, uint32
    from numba.cuda import dispatcher as _dispatcher
    from numba.cuda.extending import intrinsic

    _I16, _I32, _I64 = ir.IntType(16), ir.IntType(32), ir.IntType(64)
    # NOTE: loads are only used on buffers no kernel writes while it runs, so marking them readnone
    # lets LLVM share one load between the columns of a small-batch GEMV and hoist it from loops.
    _PURE = ("readnone", "nounwind")

    def _address(context, builder, arrty, arr, offty, off):
        """i64 address of byte `off` in array `arr`."""
        ary = context.make_array(arrty)(context, builder, value=arr)
        base = builder.ptrtoint(ary.data, _I64)
        return builder.add(base, context.cast(builder, off, offty, types.int64))

    def _load(ptx: str, n_out: int, constraint: str):
        """Build codegen for a load whose asm has `n_out` u32 outputs and one i64 address input."""
        def codegen(context, builder, sig, args):
            addr = _address(context, builder, sig.args[0], args[0], sig.args[1], args[1])
            ret_ir = _I32 if n_out == 1 else ir.LiteralStructType([_I32] * n_out)
            asm = ir.InlineAsm(ir.FunctionType(ret_ir, [_I64]), ptx, constraint)
            out = builder.call(asm, [addr], attrs=_PURE)
            if n_out == 1:
                return out
            return context.make_tuple(builder, sig.return_type,
                                      [builder.extract_value(out, i) for i in range(n_out)])
        return codegen

    def _load_intrinsic(ptx: str, n_out: int, constraint: str):
        ret = types.uint32 if n_out == 1 else types.UniTuple(types.uint32, n_out)

        @intrinsic
        def load(typingctx, arr, off):
            if not isinstance(arr, types.Array) or not isinstance(off, types.Integer):
                return None
            return ret(arr, off), _load(ptx, n_out, constraint)
        return load

    ld_u16 = _load_intrinsic("ld.global.nc.u16 $0, [$1];", 1, "=r,l")
    ld_u32 = _load_intrinsic("ld.global.nc.u32 $0, [$1];", 1, "=r,l")
    ld_v2_u32 = _load_intrinsic("ld.global.nc.v2.u32 {$0, $1}, [$2];", 2, "=r,=r,l")
    ld_v4_u32 = _load_intrinsic("ld.global.nc.v4.u32 {$0, $1, $2, $3}, [$4];", 4,
                                "=r,=r,=r,=r,l")

    def _int_codegen(ptx: str, n_args: int, ty, attrs=()):
        """Codegen of one PTX instruction over n_args 32-bit registers (the args cast to ty)."""
        def codegen(context, builder, sig, args):
            vals = [context.cast(builder, v, t, ty) for v, t in zip(args, sig.args)]
            asm = ir.InlineAsm(ir.FunctionType(_I32, [_I32] * n_args), ptx, "=r" + ",r" * n_args)
            return builder.call(asm, vals, attrs=attrs)
        return codegen

    def _op3(ptx: str, ty=types.uint32):
        """An intrinsic (int, int, int) -> ty running one 3-operand PTX instruction on 32-bit
        registers (the integer args cast to ty)."""
        @intrinsic
        def op(typingctx, a, b, c):
            if not all(isinstance(t, types.Integer) for t in (a, b, c)):
                return None
            return ty(a, b, c), _int_codegen(ptx, 3, ty)
        return op

    def _op2(ptx: str):
        """An intrinsic (int, int) -> uint32 running one 2-operand PTX instruction on 32-bit
        registers."""
        @intrinsic
        def op(typingctx, a, b):
            if not all(isinstance(t, types.Integer) for t in (a, b)):
                return None
            return types.uint32(a, b), _int_codegen(ptx, 2, types.uint32, _PURE)
        return op

    # f16x2 arithmetic on u32 registers holding two halves (round to nearest even, one rounding
    # for the fused multiply-add)
    hsub2 = _op2("sub.rn.f16x2 $0, $1, $2;")
    hfma2 = _op3("fma.rn.f16x2 $0, $1, $2, $3;")
    # c + Σ a.byte[i]·b.byte[i], bytes as signed int8 (integer args truncated to 32 bits)
    dp4a = _op3("dp4a.s32.s32 $0, $1, $2, $3;", types.int32)
    # prmt: byte n of the result = byte (s.nibble[n] & 7) of b:a, sign-replicated if nibble bit 3
    byte_perm = _op3("prmt.b32 $0, $1, $2, $3;")
    # (hi:lo) >> min(shift, 32), the low 32 bits
    funnel_shift_r = _op3("shf.r.clamp.b32 $0, $1, $2, $3;")

    @intrinsic
    def f16_bits_to_f32(typingctx, h):
        """The IEEE half in the low 16 bits of `h`, widened to float32."""
        if not isinstance(h, types.Integer):
            return None

        def codegen(context, builder, sig, args):
            bits = builder.trunc(context.cast(builder, args[0], sig.args[0], types.uint32), _I16)
            asm = ir.InlineAsm(ir.FunctionType(ir.FloatType(), [_I16]), "cvt.f32.f16 $0, $1;",
                               "=f,h")
            return builder.call(asm, [bits])
        return types.float32(h), codegen

    @intrinsic
    def bits_to_f32(typingctx, u):
        """Reinterpret the low 32 bits of `u` as a float32."""
        if not isinstance(u, types.Integer):
            return None

        def codegen(context, builder, sig, args):
            bits = context.cast(builder, args[0], sig.args[0], types.uint32)
            return builder.bitcast(bits, ir.FloatType())
        return types.float32(u), codegen

    @intrinsic
    def fma_f32(typingctx, a, b, c):
        """a·b + c in float32, rounded once (fma.rn.f32 whatever the kernel's fastmath flags)."""
        if not all(isinstance(t, types.Float) for t in (a, b, c)):
            return None

        def codegen(context, builder, sig, args):
            v = [context.cast(builder, x, t, types.float32) for x, t in zip(args, sig.args)]
            asm = ir.InlineAsm(ir.FunctionType(ir.FloatType(), [ir.FloatType()] * 3),
                               "fma.rn.f32 $0, $1, $2, $3;", "=f,f,f,f")
            return builder.call(asm, v, attrs=_PURE)
        return types.float32(a, b, c), codegen

    @intrinsic
    def chain_start(typingctx):
        """A chained kernel's first statement (jit.kernel): wait until the kernel before it on the
        stream has finished and its writes are visible, then let the next kernel launch (its
        blocks take free SM slots and wait at their own chain_start while this one runs). The
        trigger after the wait keeps one grid waiting at a time: triggered earlier, grids piled
        up several deep and took SM slots from the running kernel (a slower decode step).
        Programmatic dependent launch needs sm_90: for older targets nothing is emitted."""
        def codegen(context, builder, sig, args):
            # NOTE: the target is the current device's (the compile check patches it to 9.0)
            if _dispatcher.get_current_device().compute_capability >= (9, 0):
                asm = ir.InlineAsm(ir.FunctionType(ir.VoidType(), []),
                                   "griddepcontrol.wait;\n\tgriddepcontrol.launch_dependents;",
                                   "~{memory}", side_effect=True)
                builder.call(asm, [])
            return context.get_dummy_value()
        return types.none(), codegen

    def _shared_address(context, builder, arrty, arr, offty, off):
        """32-bit shared-window address of byte `off` in shared array `arr` (one cvta a kernel
        after CSE; shared addresses fit in 32 bits)."""
        ary = context.make_array(arrty)(context, builder, value=arr)
        to_shared = ir.InlineAsm(ir.FunctionType(_I64, [_I64]), "cvta.to.shared.u64 $0, $1;",
                                 "=l,l")
        base = builder.call(to_shared, [builder.ptrtoint(ary.data, _I64)], attrs=_PURE)
        off = context.cast(builder, off, offty, types.int64)
        return builder.add(builder.trunc(base, _I32), builder.trunc(off, _I32))

    @intrinsic
    def cp_async_16(typingctx, dst, dst_off, src, src_off):
        """Start copying 16 bytes from byte src_off of global array src to byte dst_off of
        shared array dst (both 16-byte aligned), bypassing L1 (.cg)."""
        if not (isinstance(dst, types.Array) and isinstance(src, types.Array)
                and isinstance(dst_off, types.Integer) and isinstance(src_off, types.Integer)):
            return None

        def codegen(context, builder, sig, args):
            s_addr = _shared_address(context, builder, sig.args[0], args[0], sig.args[1],
                                     args[1])
            g_addr = _address(context, builder, sig.args[2], args[2], sig.args[3], args[3])
            asm = ir.InlineAsm(ir.FunctionType(ir.VoidType(), [_I32, _I64]),
                               "cp.async.cg.shared.global [$0], [$1], 16;", "r,l,~{memory}",
                               side_effect=True)
            builder.call(asm, [s_addr, g_addr])
            return context.get_dummy_value()
        return types.none(dst, dst_off, src, src_off), codegen

    def _void_asm(ptx: str):
        def codegen(context, builder, sig, args):
            asm = ir.InlineAsm(ir.FunctionType(ir.VoidType(), []), ptx, "~{memory}",
                               side_effect=True)
            builder.call(asm, [])
            return context.get_dummy_value()
        return codegen

    @intrinsic
    def cp_async_commit(typingctx):
        return types.none(), _void_asm("cp.async.commit_group;")

    @intrinsic
    def cp_async_wait(typingctx, n):
        if not isinstance(n, types.IntegerLiteral):
            return None
        return types.none(n), _void_asm(f"cp.async.wait_group {n.literal_value};")

    @intrinsic
    def pack_f16x2(typingctx, lo, hi):
        """f16(lo) in the low half, f16(hi) in the high half of a u32 (round to nearest even)."""
        if not all(isinstance(t, types.Float) for t in (lo, hi)):
            return None

        def codegen(context, builder, sig, args):
            vals = [context.cast(builder, v, t, types.float32) for v, t in zip(args, sig.args)]
            # NOTE: cvt.rn.f16x2.f32 d, a, b puts a in the upper half
            asm = ir.InlineAsm(ir.FunctionType(_I32, [ir.FloatType()] * 2),
                               "cvt.rn.f16x2.f32 $0, $1, $2;", "=r,f,f")
            return builder.call(asm, [vals[1], vals[0]], attrs=_PURE)
        return types.uint32(lo, hi), codegen

    def _shared_load_intrinsic(ptx: str, n: int):
        """A load of n u32 registers ($0..$n-1) from shared memory at address $n = byte `off` of
        shared array `arr`. A memory clobber: shared memory changes between barriers, so LLVM
        must not merge or hoist it."""
        @intrinsic
        def load_at(typingctx, arr, off):
            if not isinstance(arr, types.Array) or not isinstance(off, types.Integer):
                return None

            def codegen(context, builder, sig, args):
                addr = _shared_address(context, builder, sig.args[0], args[0], sig.args[1],
                                       args[1])
                asm = ir.InlineAsm(ir.FunctionType(ir.LiteralStructType([_I32] * n), [_I32]),
                                   ptx, "=r," * n + "r,~{memory}", side_effect=True)
                out = builder.call(asm, [addr])
                return context.make_tuple(builder, sig.return_type,
                                          [builder.extract_value(out, i) for i in range(n)])
            return types.UniTuple(types.uint32, n)(arr, off), codegen
        return load_at

    def _ldmatrix_x4_intrinsic(shape: str):
        """ldmatrix .x4 (`shape`: its qualifiers) with this lane's row address = byte `off`."""
        return _shared_load_intrinsic(f"ldmatrix.sync.aligned.{shape}.shared.b16 "
                                      "{$0, $1, $2, $3}, [$4];", 4)

    def _lds_intrinsic(n: int):
        """ld.shared.v{n}.u32 at byte `off` of a shared array."""
        outs = ", ".join(f"${i}" for i in range(n))
        return _shared_load_intrinsic(f"ld.shared.v{n}.u32 {{{outs}}}, [${n}];", n)

    _lds_v2_at, _lds_v4_at = _lds_intrinsic(2), _lds_intrinsic(4)

    @cuda.jit(device=True, forceinline=True)
    def lds_v2_u32(words, i):
        """Words i, i + 1 of shared u32 array `words` in one load (i even, the array 8-byte
        aligned)."""
        return _lds_v2_at(words, i * uint32(4))

    @cuda.jit(device=True, forceinline=True)
    def lds_v4_u32(words, i):
        """Words i..i + 3 of shared u32 array `words` in one load (i a multiple of 4, the array
        16-byte aligned)."""
        return _lds_v4_at(words, i * uint32(4))

    _ldmatrix_x4_at = _ldmatrix_x4_intrinsic("m8n8.x4")
    _ldmatrix_x4_trans_at = _ldmatrix_x4_intrinsic("m8n8.x4.trans")

    @cuda.jit(device=True, forceinline=True)  # NVVM inlining (see jit.py)
    def ldmatrix_x4(arr, tile_off, row_stride, lane):
        """The four 8×8 matrices of the 16×16 f16 tile at byte `tile_off` of shared `arr` (rows
        `row_stride` bytes apart, 16-byte aligned): (rows 0-7, cols 0-7), (rows 8-15, cols 0-7),
        (rows 0-7, cols 8-15), (rows 8-15, cols 8-15); register i holds row lane//4, cols
        2·(lane%4) and +1 of matrix i. That is the A fragment of mma m16n8k16 for a row-major
        (m, k) tile, and the B fragments (R0, R2) and (R1, R3) of two n8 tiles for an (n, k) tile.
        """
        return _ldmatrix_x4_at(arr, tile_off + (lane & 15) * row_stride + (lane >> 4) * 16)

    @cuda.jit(device=True, forceinline=True)
    def ldmatrix_x4_trans(arr, tile_off, row_stride, lane):
        """ldmatrix_x4's four 8×8 matrices of a row-major (k, n) f16 tile, each transposed: for
        a 16 k × 16 n tile (e.g. V rows of 16 keys, 16 dims), registers (0, 1) are the B
        fragment of mma m16n8k16 for n 0-7 and (2, 3) that for n 8-15."""
        return _ldmatrix_x4_trans_at(arr, tile_off + (lane & 15) * row_stride + (lane >> 4) * 16)

    def _mma_intrinsic(shape: str, acc, acc_ir, acc_reg: str):
        """An mma.sync intrinsic (a0..a3, b0, b1: u32 fragment registers; c0..c3: accumulators
        of numba type `acc`, PTX register class `acc_reg`) → D = A·B + C as 4 accumulators."""
        acc_kind = types.Float if isinstance(acc, types.Float) else types.Integer

        @intrinsic
        def mma(typingctx, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
            if not all(isinstance(t, types.Integer) for t in (a0, a1, a2, a3, b0, b1)):
                return None
            if not all(isinstance(t, acc_kind) for t in (c0, c1, c2, c3)):
                return None

            def codegen(context, builder, sig, args):
                regs = [context.cast(builder, v, t, types.uint32)
                        for v, t in zip(args[:6], sig.args)]
                accs = [context.cast(builder, v, t, acc) for v, t in zip(args[6:], sig.args[6:])]
                asm = ir.InlineAsm(
                    ir.FunctionType(ir.LiteralStructType([acc_ir] * 4), [_I32] * 6 + [acc_ir] * 4),
                    f"mma.sync.aligned.{shape} {{$0, $1, $2, $3}}, {{$4, $5, $6, $7}}, "
                    "{$8, $9}, {$10, $11, $12, $13};",
                    ",".join([f"={acc_reg}"] * 4) + ",r,r,r,r,r,r,0,1,2,3")
                out = builder.call(asm, regs + accs, attrs=_PURE)
                return context.make_tuple(builder, sig.return_type,
                                          [builder.extract_value(out, i) for i in range(4)])
            return types.UniTuple(acc, 4)(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3), codegen
        return mma

    # D = A·B + C for a warp: A 16×16 f16 (4 u32 a lane), B 16×8 (2 u32), C/D 16×8 f32
    mma_f16_f32 = _mma_intrinsic("m16n8k16.row.col.f32.f16.f16.f32", types.float32,
                                 ir.FloatType(), "f")

    @cuda.jit(device=True, forceinline=True)
    def ldmatrix_x4_pairs(arr, tile_off, row_stride, lane):
        """ldmatrix_x4's matrices in B-operand order: (rows 0-7, cols 0-7), (rows 0-7, cols 8-15),
        (rows 8-15, cols 0-7), (rows 8-15, cols 8-15). For an (n, k) tile, registers (0, 1) are
        the B fragment of the n8 tile of rows 0-7 and (2, 3) that of rows 8-15, each pair in
        adjacent registers as mma.sync reads them (ldmatrix_x4's (0, 2) and (1, 3) cost ptxas
        two register moves a pair)."""
        row = (lane & 7) + ((lane >> 4) << 3)
        return _ldmatrix_x4_at(arr, tile_off + row * row_stride + ((lane >> 3) & 1) * 16)

    ldmatrix_x4_b8 = ldmatrix_x4  # the same 16-byte rows: 8×16 int8 matrices instead of 8×8 f16
    ldmatrix_x4_b8_pairs = ldmatrix_x4_pairs

    @cuda.jit(device=True, forceinline=True)
    def _word_at(words, i, half_word):
        """The 4 bytes at word i of u32 array `words`, or where half_word 2 bytes on (word i's
        upper half, word i + 1's lower half)."""
        if half_word:
            return funnel_shift_r(words[i], words[i + uint32(1)], 16)
        return words[i]

    @cuda.jit(device=True, forceinline=True)
    def ld_s8_fragments_x4(words, tile_word, row_words, lane, half_word):
        """ldmatrix_x4_b8's registers for a 16×32 s8 tile in shared u32 array `words` whose rows
        (row_words words apart) start at word tile_word + row · row_words, or 2 bytes on where
        half_word (GGUF blocks put int8 values after a 2-byte scale): a word load a register, or
        two and a funnel shift, instead of one ldmatrix. half_word should be a compile-time
        constant and tile_word a per-thread base plus a constant, so that the loads take their
        offsets as immediates."""
        at = uint32(tile_word + (lane >> 2) * row_words + (lane & 3))
        below = uint32(8 * row_words)
        return (_word_at(words, at, half_word), _word_at(words, at + below, half_word),
                _word_at(words, at + uint32(4), half_word),
                _word_at(words, at + below + uint32(4), half_word))

    # D = A·B + C for a warp: A 16×32 s8 (4 u32 a lane), B 32×8 s8 (2 u32), C/D 16×8 s32
    mma_s8_s32 = _mma_intrinsic("m16n8k32.row.col.s32.s8.s8.s32", types.int32, _I32, "r")
