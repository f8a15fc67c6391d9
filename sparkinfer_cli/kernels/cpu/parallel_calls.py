"""Native kernel calls split over the CPU's threads with a hand-off of a few microseconds.

A decode token makes ~120 matvec calls of 20-200 µs each. Handing half of one to a pool thread
that sleeps between calls costs ~0.1 ms (the wake-up of a halted vCPU), as much as the half
itself, so such calls stayed on one core. numba's parallel loops on its OpenMP layer keep their
threads spinning for a while after each loop, so calls that follow each other within a step
hand off in ~2 µs. Where numba has no such layer (its workqueue layer wakes its threads as slowly
as the pool), `fast_hand_off()` is False and callers keep splitting only large calls.

A call is a record of CALL_FIELDS int64s: the address of a kernel taking 11 integer or pointer
arguments (quant_packed's row kernel), then those arguments; a part, one thread's share, is a
run of consecutive records, executed in order.
"""

from __future__ import annotations

import ctypes
import functools

import numba
import numpy as np
from numba import njit, prange

from sparkinfer_cli.kernels.cpu import llvm_jit

CALL_FIELDS = 12
_N_ARGS = CALL_FIELDS - 1
_SPINNING_LAYERS = ("omp", "tbb")

# run_calls(calls, first, end): records first..end-1 of the int64 array at address `calls`. The
# kernels' pointer arguments are passed as i64, which the x86-64 and AArch64 calling conventions
# pass in the same registers and stack slots.
_ARGS = ", ".join(f"i64 %a{j}" for j in range(_N_ARGS))
_LOADS = "".join(f"  %p{j} = getelementptr i64, ptr %rec, i64 {j + 1}\n"
                 f"  %a{j} = load i64, ptr %p{j}\n" for j in range(_N_ARGS))
_IR = f"""
define void @run_calls(i64 %calls, i64 %first, i64 %end) {{
entry:
  %base = inttoptr i64 %calls to ptr
  %any = icmp slt i64 %first, %end
  br i1 %any, label %call, label %done
call:
  %i = phi i64 [%first, %entry], [%next, %call]
  %at = mul i64 %i, {CALL_FIELDS}
  %rec = getelementptr i64, ptr %base, i64 %at
  %fn = load i64, ptr %rec
  %fp = inttoptr i64 %fn to ptr
{_LOADS}  call void %fp({_ARGS})
  %next = add i64 %i, 1
  %more = icmp slt i64 %next, %end
  br i1 %more, label %call, label %done
done:
  ret void
}}
"""
_run_calls = llvm_jit.compile_function(_IR, "run_calls", [ctypes.c_int64] * 3)


@njit(parallel=True, nogil=True)
def _run_parts(calls_address, part_ends):
    for p in prange(part_ends.shape[0]):
        _run_calls(calls_address, 0 if p == 0 else part_ends[p - 1], part_ends[p])


def address(fn: ctypes._CFuncPtr) -> int:
    """A ctypes function's address, for a call record."""
    return ctypes.cast(fn, ctypes.c_void_p).value or 0


def run_parts(calls: np.ndarray, part_ends: np.ndarray) -> None:
    """Run the call records calls (n, CALL_FIELDS) int64, part p (records part_ends[p-1] ..
    part_ends[p] - 1) on its own thread; part 0 on the caller's."""
    if calls.dtype != np.int64 or calls.ndim != 2 or calls.shape[1] != CALL_FIELDS or \
            not calls.flags.c_contiguous:
        raise ValueError(f"calls must be C-contiguous int64 (n, {CALL_FIELDS}), got "
                         f"{calls.dtype} {calls.shape}")
    if len(part_ends) and not (0 <= part_ends[-1] <= len(calls)):
        raise ValueError(f"parts end at record {part_ends[-1]} of {len(calls)}")
    _run_parts(calls.ctypes.data, part_ends)


@functools.cache
def fast_hand_off() -> bool:
    """Whether run_parts hands a part to another thread in microseconds (numba's threads spin
    between parallel loops), rather than the ~0.1 ms of waking a sleeping one."""
    _run_parts(0, np.zeros(1, np.int64))  # no records: starts numba's threading layer
    return numba.threading_layer() in _SPINNING_LAYERS
