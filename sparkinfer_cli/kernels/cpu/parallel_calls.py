"""Native kernel calls split over the CPU's threads with a hand-off of a few microseconds.

A decode token makes ~120 matvec calls of 20-200 µs each. Handing half of one to a pool thread
that sleeps between calls costs ~0.1 ms (the wake-up of a halted vCPU), as much as the half
itself, so such calls stayed on one core. Here the helper threads wait for work in native code
(no GIL): spinning for about a millisecond after each job, so that the calls of a step hand off
in microseconds, then polling with sleeps, so that an idle process leaves its cores idle.
(numba's OpenMP loops spin too, but each calling thread gets its own team, and a server's
engine thread beside a main thread that ran the warm-up halved the speed of both.)

A call is a record of CALL_FIELDS int64s: the address of a kernel taking 11 integer or pointer
arguments (quant_packed's row kernel), then those arguments; a part, one thread's share, is a
run of consecutive records, executed in order. One job runs at a time (a lock): its caller runs
part 0, helper w part w + 1.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import threading

import numpy as np

from sparkinfer_cli.kernels.cpu import llvm_jit

CALL_FIELDS = 12
_N_ARGS = CALL_FIELDS - 1
# A helper waiting for work spins (cycle-counter ticks, ~1 ms at 3 GHz), then polls every
# _DOZE_US until ~10 ms have passed, then every _SLEEP_US: an idle process costs its cores ~1 %,
# and the first call after a pause waits at most that long for its helpers.
_SPIN_TICKS, _DOZE_TICKS = 3_000_000, 30_000_000
_DOZE_US, _SLEEP_US = 100, 1000

# The control block, int64 words: the job number the caller posts, a stop flag, the address of
# the job's records, how many helpers finished it, then (first, end) record of each helper.
_JOB, _STOP, _CALLS, _DONE, _RANGES = range(5)

_ARGS = ", ".join(f"i64 %a{j}" for j in range(_N_ARGS))
_LOADS = "".join(f"  %p{j} = getelementptr i64, ptr %rec, i64 {j + 1}\n"
                 f"  %a{j} = load i64, ptr %p{j}\n" for j in range(_N_ARGS))
_PAUSE = "  call void @llvm.x86.sse2.pause()\n" if llvm_jit.host_is_x86() else ""
# run_calls(calls, first, end): records first..end-1 of the int64 array at address `calls`. The
# kernels' pointer arguments are passed as i64, which the x86-64 and AArch64 calling conventions
# pass in the same registers and stack slots.
_IR = f"""
{"declare void @llvm.x86.sse2.pause()" if _PAUSE else ""}
declare i64 @llvm.readcyclecounter()

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

define void @helper(i64 %ctl_at, i64 %w, i64 %usleep_at, i64 %job0) {{
entry:
  %ctl = inttoptr i64 %ctl_at to ptr
  %sleep = inttoptr i64 %usleep_at to ptr
  %stop_p = getelementptr i64, ptr %ctl, i64 {_STOP}
  %calls_p = getelementptr i64, ptr %ctl, i64 {_CALLS}
  %done_p = getelementptr i64, ptr %ctl, i64 {_DONE}
  %r = mul i64 %w, 2
  %first_at = add i64 %r, {_RANGES}
  %first_p = getelementptr i64, ptr %ctl, i64 %first_at
  %end_p = getelementptr i64, ptr %first_p, i64 1
  %t0 = call i64 @llvm.readcyclecounter()
  br label %poll
poll:
  %last = phi i64 [%job0, %entry], [%job, %ran], [%last, %wait]
  %since = phi i64 [%t0, %entry], [%t1, %ran], [%since, %wait]
  %job = load atomic i64, ptr %ctl acquire, align 8
  %new = icmp ne i64 %job, %last
  br i1 %new, label %run, label %check
run:
  %calls = load i64, ptr %calls_p
  %first = load i64, ptr %first_p
  %end = load i64, ptr %end_p
  call void @run_calls(i64 %calls, i64 %first, i64 %end)
  %prev = atomicrmw add ptr %done_p, i64 1 release
  br label %ran
ran:
  %t1 = call i64 @llvm.readcyclecounter()
  br label %poll
check:
  %stop = load atomic i64, ptr %stop_p acquire, align 8
  %stopped = icmp ne i64 %stop, 0
  br i1 %stopped, label %exit, label %idle_check
idle_check:
  %now = call i64 @llvm.readcyclecounter()
  %idle = sub i64 %now, %since
  %spinning = icmp ult i64 %idle, {_SPIN_TICKS}
  br i1 %spinning, label %spin, label %nap
spin:
{_PAUSE}  br label %wait
nap:
  %dozing = icmp ult i64 %idle, {_DOZE_TICKS}
  %us = select i1 %dozing, i32 {_DOZE_US}, i32 {_SLEEP_US}
  %ignored = call i32 %sleep(i32 %us)
  br label %wait
wait:
  br label %poll
exit:
  ret void
}}

define void @run_job(i64 %ctl_at, i64 %calls, i64 %ends_at, i64 %n_parts, i64 %n_helpers) {{
entry:
  %ctl = inttoptr i64 %ctl_at to ptr
  %ends = inttoptr i64 %ends_at to ptr
  %calls_p = getelementptr i64, ptr %ctl, i64 {_CALLS}
  %done_p = getelementptr i64, ptr %ctl, i64 {_DONE}
  store i64 %calls, ptr %calls_p
  store i64 0, ptr %done_p
  %any = icmp sgt i64 %n_helpers, 0
  br i1 %any, label %range, label %post
range:
  %w = phi i64 [0, %entry], [%w1, %range]
  %w1 = add i64 %w, 1
  %has = icmp slt i64 %w1, %n_parts
  %first_p = getelementptr i64, ptr %ends, i64 %w
  %end_p = getelementptr i64, ptr %ends, i64 %w1
  %first_v = load i64, ptr %first_p
  %end_v = load i64, ptr %end_p
  %first = select i1 %has, i64 %first_v, i64 0
  %end = select i1 %has, i64 %end_v, i64 0
  %r = mul i64 %w, 2
  %at = add i64 %r, {_RANGES}
  %dst = getelementptr i64, ptr %ctl, i64 %at
  store i64 %first, ptr %dst
  %dst1 = getelementptr i64, ptr %dst, i64 1
  store i64 %end, ptr %dst1
  %more = icmp slt i64 %w1, %n_helpers
  br i1 %more, label %range, label %post
post:
  %prev = atomicrmw add ptr %ctl, i64 1 release
  %end0 = load i64, ptr %ends
  call void @run_calls(i64 %calls, i64 0, i64 %end0)
  br label %poll
poll:
  %done = load atomic i64, ptr %done_p acquire, align 8
  %finished = icmp sge i64 %done, %n_helpers
  br i1 %finished, label %exit, label %spin
spin:
{_PAUSE}  br label %poll
exit:
  ret void
}}
"""
_I64 = ctypes.c_int64
_run_calls = llvm_jit.compile_function(_IR, "run_calls", [_I64] * 3)
_helper = llvm_jit.compile_function(_IR, "helper", [_I64] * 4)
_run_job = llvm_jit.compile_function(_IR, "run_job", [_I64] * 5)


def kernel_head(name: str, params: list[str]) -> str:
    """IR: the head of a kernel that call records run: `define void @name(` CALL_FIELDS - 1
    i64 parameters `) {`, its entry block, and `%p = inttoptr` for each parameter written `*p`
    (the pointers); the parameters past `params` are unused."""
    names = [p.lstrip("*") for p in params]
    args = [f"i64 %{n}_i" if p.startswith("*") else f"i64 %{n}" for p, n in zip(params, names)]
    args += [f"i64 %unused{i}" for i in range(len(args), _N_ARGS)]
    pointers = "".join(f"  %{n} = inttoptr i64 %{n}_i to ptr\n"
                       for p, n in zip(params, names) if p.startswith("*"))
    return f"define void @{name}({', '.join(args)}) {{\nentry:\n{pointers}"


def compile_kernel(ir: str, name: str) -> int:
    """The address, for call records, of kernel `name` of module `ir` (its head written by
    kernel_head); llvm_jit keeps the compiled code alive."""
    return address(llvm_jit.compile_function(ir, name, [_I64] * _N_ARGS))


def address(fn: ctypes._CFuncPtr) -> int:
    """A ctypes function's address, for a call record."""
    return ctypes.cast(fn, ctypes.c_void_p).value or 0


class _Helpers:
    """The helper threads (started at the first job that has parts for them) and their control
    block."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.ctl = np.zeros(_RANGES, np.int64)
        self.ctl_at = self.ctl.ctypes.data
        self.threads: list[threading.Thread] = []
        self.pid = os.getpid()

    def ensure(self, n: int) -> None:
        """At least n helpers running (in this process: a forked child starts its own)."""
        if self.pid != os.getpid():
            self.ctl, self.threads, self.pid = np.zeros(_RANGES, np.int64), [], os.getpid()
        if len(self.threads) >= n:
            return
        ctl = np.zeros(_RANGES + 2 * n, np.int64)
        ctl[:_RANGES] = self.ctl[:_RANGES]
        self.stop()
        self.ctl = ctl  # NOTE: helpers read the block by address: it lives as long as they do
        self.ctl_at = ctl.ctypes.data
        usleep = address(ctypes.CDLL(None).usleep)
        # each helper starts from the job number now, not the one it reads when it starts (a
        # job posted in between would be skipped)
        job = int(ctl[_JOB])
        self.threads = [threading.Thread(target=_helper, args=(ctl.ctypes.data, w, usleep, job),
                                         name=f"sparkinfer-helper-{w}", daemon=True)
                        for w in range(n)]
        for t in self.threads:
            t.start()

    def stop(self) -> None:
        if self.threads:
            self.ctl[_STOP] = 1
            for t in self.threads:
                t.join()
            self.ctl[_STOP] = 0
        self.threads = []

    def run(self, calls_at: int, ends_at: int, n_parts: int) -> None:
        with self.lock:
            self.ensure(n_parts - 1)
            _run_job(self.ctl_at, calls_at, ends_at, n_parts, len(self.threads))


_HELPERS = _Helpers()
atexit.register(_HELPERS.stop)  # before the interpreter frees the block they read


def run_parts(calls: np.ndarray, part_ends: np.ndarray) -> None:
    """Run the call records calls (n, CALL_FIELDS) int64, part p (records part_ends[p-1] ..
    part_ends[p] - 1) on its own thread; part 0 on the caller's."""
    if calls.dtype != np.int64 or calls.ndim != 2 or calls.shape[1] != CALL_FIELDS or \
            not calls.flags.c_contiguous:
        raise ValueError(f"calls must be C-contiguous int64 (n, {CALL_FIELDS}), got "
                         f"{calls.dtype} {calls.shape}")
    ends = np.ascontiguousarray(part_ends, np.int64)
    if not len(ends) or np.any(np.diff(ends) < 0) or ends[0] < 0 or ends[-1] > len(calls):
        raise ValueError(f"part ends {ends.tolist()} do not split {len(calls)} records")
    run_parts_at(calls.ctypes.data, ends.ctypes.data, len(ends))


def run_parts_at(calls_at: int, ends_at: int, n_parts: int) -> None:
    """run_parts over arrays given by address, unchecked: a hot caller prepares them once."""
    if n_parts == 1:
        _run_calls(calls_at, 0, ctypes.c_int64.from_address(ends_at).value)
    else:
        _HELPERS.run(calls_at, ends_at, n_parts)
