"""SwiGLU's silu(gate) · up as one native kernel (LLVM IR through llvm_jit), rows split between
the threads by parallel_calls.

numpy's version makes four temporaries of a prompt's (tokens, n_ff) activations; this one reads
gate and up once, in place (they are column ranges of the fused gate/up projection's output) and
writes the product once. silu(g) = g · σ(g) with σ from e = exp(-|g|) (ir_vectors.exp), so e never
overflows: σ(g) = 1 / (1 + e) for g ≥ 0, e / (1 + e) below. Elementwise: a row's values never
depend on the other rows.
"""

from __future__ import annotations

import functools

import numpy as np
from numba import njit

from sparkinfer_cli.kernels.cpu import parallel_calls, quant
from sparkinfer_cli.kernels.cpu.ir_vectors import DECLARATIONS, W, exp, load, splat, store

# Rows go to the other threads once each gets this many values: parallel_calls hands off in
# microseconds, and a value costs about a nanosecond.
_MIN_VALUES_PER_PART = 1 << 15


def _chunk(width: int, tag: str) -> str:
    """IR: out[c:c+width] = silu(gate) · up over one vector at %c (width < 8: masked)."""
    ptrs = "".join(f"  %{a}p{tag} = getelementptr float, ptr %{a}r, i64 %c{tag}\n"
                   for a in ("g", "u", "o"))
    return (ptrs + load(f"g{tag}", f"%gp{tag}", width) + load(f"u{tag}", f"%up{tag}", width)
            + f"  %a{tag} = call <8 x float> @llvm.fabs.v8f32(<8 x float> %g{tag})\n"
            f"  %n{tag} = fneg <8 x float> %a{tag}\n"
            + exp(f"%n{tag}", f"e{tag}")
            + f"  %d{tag} = fadd <8 x float> %e{tag}, {splat(1.0)}\n"
            f"  %pos{tag} = fcmp oge <8 x float> %g{tag}, zeroinitializer\n"
            f"  %num{tag} = select <8 x i1> %pos{tag}, <8 x float> {splat(1.0)}, "
            f"<8 x float> %e{tag}\n"
            f"  %sig{tag} = fdiv <8 x float> %num{tag}, %d{tag}\n"
            f"  %silu{tag} = fmul <8 x float> %g{tag}, %sig{tag}\n"
            f"  %y{tag} = fmul <8 x float> %silu{tag}, %u{tag}\n"
            + store(f"%y{tag}", f"%op{tag}", width))


def _kernel_ir(cols: int) -> str:
    """void swiglu(gate, up, out, rows, gate_stride, up_stride, out_stride, 4 unused): rows of
    `cols` floats, strides in floats."""
    full, tail = cols // W * W, cols % W
    head = parallel_calls.kernel_head("swiglu", ["*g0", "*u0", "*o0", "rows", "gs", "us", "os"])
    last = (f"  %ct = add i64 0, {full}\n" + _chunk(tail, "t")) if tail else ""
    loop = f"""  br label %col
col:
  %cv = phi i64 [0, %row], [%cn, %col]
{_chunk(W, "v")}  %cn = add i64 %cv, {W}
  %cc = icmp ult i64 %cn, {full}
  br i1 %cc, label %col, label %rowend
rowend:
""" if full else "  br label %rowend\nrowend:\n"
    return f"""{DECLARATIONS}declare <8 x float> @llvm.fabs.v8f32(<8 x float>)

{head}  %any = icmp sgt i64 %rows, 0
  br i1 %any, label %row, label %done
row:
  %r = phi i64 [0, %entry], [%rn, %rowend]
  %go = mul i64 %r, %gs
  %uo = mul i64 %r, %us
  %oo = mul i64 %r, %os
  %gr = getelementptr float, ptr %g0, i64 %go
  %ur = getelementptr float, ptr %u0, i64 %uo
  %or = getelementptr float, ptr %o0, i64 %oo
{loop}{last}  %rn = add i64 %r, 1
  %rc = icmp slt i64 %rn, %rows
  br i1 %rc, label %row, label %done
done:
  ret void
}}
"""


@functools.cache
def _kernel(cols: int) -> int:
    """The address of the kernel for rows of `cols`."""
    return parallel_calls.compile_kernel(_kernel_ir(cols), "swiglu")


@functools.cache
def _part_ends(n_parts: int) -> tuple[np.ndarray, int]:
    """parallel_calls' part ends of n_parts records, one a part, and their address."""
    ends = np.arange(1, n_parts + 1, dtype=np.int64)
    return ends, ends.ctypes.data


_FIELDS = parallel_calls.CALL_FIELDS


@njit(cache=True, nogil=True)
def _records(kernel, gate, up, out, n_parts):
    """One call record per part of the rows (about equal parts), and its address."""
    calls = np.zeros((n_parts, _FIELDS), np.int64)
    n = gate.shape[0]
    for p in range(n_parts):
        r0, r1 = n * p // n_parts, n * (p + 1) // n_parts
        calls[p, 0] = kernel
        calls[p, 1] = gate.ctypes.data + r0 * gate.strides[0]
        calls[p, 2] = up.ctypes.data + r0 * up.strides[0]
        calls[p, 3] = out.ctypes.data + r0 * out.strides[0]
        calls[p, 4] = r1 - r0
        calls[p, 5] = gate.strides[0] // 4
        calls[p, 6] = up.strides[0] // 4
        calls[p, 7] = out.strides[0] // 4
    return calls, calls.ctypes.data


def swiglu(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """silu(gate) · up of (rows, cols) arrays (ops.swiglu is the reference); float32 rows
    that are contiguous are read in place."""
    if gate.shape != up.shape or gate.ndim != 2:
        raise ValueError(f"gate {gate.shape} and up {up.shape} must be one (rows, cols) shape")
    gate, up = (a if a.dtype == np.float32 and a.strides[1] == 4
                else np.ascontiguousarray(a, np.float32) for a in (gate, up))
    rows, cols = gate.shape
    out = np.empty((rows, cols), np.float32)
    if rows and cols:
        n_parts = max(1, min(quant._num_threads(), rows * cols // _MIN_VALUES_PER_PART, rows))
        calls, calls_at = _records(_kernel(cols), gate, up, out, n_parts)
        ends, ends_at = _part_ends(n_parts)
        parallel_calls.run_parts_at(calls_at, ends_at, n_parts)
    return out
