"""RMSNorm on the GPU: plain, fused with the residual add (or the MoE combine), gated by silu(z).

Rows are independent: one block per row of `d` elements, held in registers between the sum of
squares and the scaling. The same kernel serves per-head norms (rows = tokens × heads, d =
head_dim) since the weight index is the position within the row; rows of at most WARP_ROW_MAX
elements take one warp each, WARP_ROWS_A_BLOCK to a block: a prefill's per-head rows number
tokens × heads, and a block per 128-element row spent its time on block scheduling and the two
barriers of a block-wide sum instead of moving the row's bytes.
"""

from __future__ import annotations

import functools
import math

import numpy as np
from numba import cuda, float32

from sparkinfer_cli.kernels.cuda.quant_gemv import store_q8
from sparkinfer_cli.kernels.cuda.runtime.intrinsics import IS_SIMULATOR, chain_start
from sparkinfer_cli.kernels.cuda.runtime.jit import device_function, kernel
from sparkinfer_cli.kernels.cuda.runtime.launch import cdiv, check_array
from sparkinfer_cli.kernels.cuda.runtime.warp import block_sum, warp_sum

MAX_THREADS = 32 if IS_SIMULATOR else 512  # threads per row (the simulator is slow)
WARP_ROW_MAX = 256  # rows of up to this many elements take one warp (≤ 8 elements a lane)
WARP_ROWS_A_BLOCK = 2 if IS_SIMULATOR else 8


# modes: what the first pass adds into the row before normalising
PLAIN, ADD, SILU_GATE, MOE, MOE_SHARED = 0, 1, 2, 3, 4


@device_function
def _moe_sum(x, moe_w, k, shared, gate, row, i, d, with_shared):
    """Σ_r moe_w[row, r]·x[row·k + r, i] (+ sigmoid(gate[row])·shared[row, i])."""
    acc = float32(0.0)
    for r in range(k):
        acc += moe_w[row * k + r] * x[(row * k + r) * d + i]
    if with_shared:
        acc += shared[row * d + i] / (float32(1.0) + math.exp(-gate[row]))
    return acc


@device_function(numba_inline=True)
def _row_and_thread(warp_rows):
    """(this thread's row, its index in the row, threads a row): a warp or a block a row."""
    if warp_rows:
        return (cuda.blockIdx.x * (cuda.blockDim.x >> 5) + (cuda.threadIdx.x >> 5),
                cuda.threadIdx.x & 31, 32)
    return cuda.blockIdx.x, cuda.threadIdx.x, cuda.blockDim.x


@functools.cache
def _norm_kernel(per_thread: int, k: int, mode: int, warp_rows: bool):
    """per_thread: elements each thread keeps in registers; k: experts of the MOE modes; mode;
    warp_rows: a warp per row (else a block). All compile-time, so a thread's loads form one
    straight run of code."""
    accumulates = mode == ADD or mode >= MOE

    @kernel(fastmath=True)
    def rms_norm(x, residual, w, out, d, n_rows, eps, quantize, xq, xd, xs, moe_w, shared, gate):
        chain_start()
        # PLAIN: out = norm(x)·w;  ADD: h = x + residual, residual ← h, out = norm(h)·w;
        # SILU_GATE: out = norm(x)·w·silu(residual)  (residual holds the gate z);
        # MOE(_SHARED): as ADD with x = the MoE output: x holds each row's k expert outputs,
        # combined with weights moe_w (+ the shared expert, gated by sigmoid(gate)).
        # Thread t of a row owns elements t + j·n_threads (the block's threads, or a warp's
        # lanes for warp rows). quantize: also write out as int8 per 32 elements
        # (quant_gemv's q8 activations): with d % 32 == 0 each warp holds whole 32-blocks.
        # All loads of a thread come first, in one basic block (elements past the row re-read
        # its last one, zeroed after), stores after: a store to `residual` or a branch between
        # them makes the next loads wait for the last ones, a memory latency per element.
        scratch = cuda.shared.array(33, float32)
        vals = cuda.local.array(per_thread, float32)
        weights = cuda.local.array(per_thread, float32)
        gates = cuda.local.array(per_thread, float32)  # SILU_GATE: z
        row, tid, n_threads = _row_and_thread(warp_rows)
        if row >= n_rows:  # the last block's spare warps (no barrier below: a warp's sum)
            return
        base = row * d
        for j in range(per_thread):
            i = tid + j * n_threads
            ic = min(i, d - 1)
            if mode >= MOE:
                v = _moe_sum(x, moe_w, k, shared, gate, row, ic, d, mode == MOE_SHARED)
            else:
                v = x[base + ic]
            if accumulates:
                v += residual[base + ic]
            if mode == SILU_GATE:
                gates[j] = residual[base + ic]
            weights[j] = w[ic]
            vals[j] = v if i < d else float32(0.0)
        partial = float32(0.0)
        for j in range(per_thread):
            i = tid + j * n_threads
            if accumulates and i < d:
                residual[base + i] = vals[j]
            partial += vals[j] * vals[j]
        total = warp_sum(partial) if warp_rows else block_sum(partial, scratch)
        inv = float32(1.0) / math.sqrt(total / float32(d) + eps)
        for j in range(per_thread):
            i = tid + j * n_threads
            y = float32(0.0)
            if i < d:
                y = vals[j] * inv * weights[j]
                if mode == SILU_GATE:
                    z = gates[j]
                    y *= z / (float32(1.0) + math.exp(-z))
                out[base + i] = y
            if quantize and j * n_threads + tid // 32 * 32 < d:
                store_q8(y, base + i, xq, xd, xs)
    return rms_norm


def _launch(x, residual, w, out, eps: float, mode: int, stream, act=None, moe=None) -> None:
    """moe: (weights (rows, k), shared or None, shared gate logits or None) for the MOE modes."""
    d = w.shape[0]
    check_array("w", w, np.float32)
    check_array("x", x, np.float32, None if moe else out.shape)
    for name, arr in (("out", out), ("residual", residual)):
        check_array(name, arr, np.float32, out.shape)
    if out.size % d:
        raise ValueError(f"rows of {out.size} elements are not a whole number of rows of {d}")
    if act is not None and (d % 32 or int(np.prod(act.shape)) != out.size):
        raise ValueError(f"fused quantization needs rows of 32·n and {out.size} activations")
    q = (act.xq, act.xd, act.xs) if act is not None else (out.reshape(out.size),) * 3
    moe_w, shared, gate = moe if moe is not None else (w, None, None)
    k = moe_w.size // (out.size // d) if moe is not None else 0
    n_rows = out.size // d
    if d <= WARP_ROW_MAX:
        kern, grid, threads = _norm_kernel(cdiv(d, 32), k, mode, True), \
            cdiv(n_rows, WARP_ROWS_A_BLOCK), 32 * WARP_ROWS_A_BLOCK
    else:
        threads = min(MAX_THREADS, cdiv(d, 32) * 32)
        kern, grid = _norm_kernel(cdiv(d, threads), k, mode, False), n_rows
    kern[grid, threads, stream](
        x.reshape(x.size), residual.reshape(residual.size), w, out.reshape(out.size), d, n_rows,
        float32(eps), act is not None, *q, moe_w.reshape(moe_w.size),
        w if shared is None else shared.reshape(shared.size),
        w if gate is None else gate.reshape(gate.size))


def rms_norm(x, w, out, eps: float, stream=0, act=None) -> None:
    """out = x / sqrt(mean(x²) + eps) · w over rows of len(w) (act: as in add_rms_norm)."""
    _launch(x, x, w, out, eps, PLAIN, stream, act)


def add_rms_norm(x, residual, w, out, eps: float, stream=0, act=None) -> None:
    """residual += x, then out = rms_norm(residual) (the pre-norm of the next sub-layer).

    act: a quant_gemv.QuantizedActivations of out's size, filled in the same pass (saves a launch).
    """
    _launch(x, residual, w, out, eps, ADD, stream, act)


def moe_add_rms_norm(expert_out, weights, residual, w, out, eps: float, stream=0, act=None,
                     shared=None, shared_gate=None) -> None:
    """residual (rows, d) += Σ_r weights[t, r]·expert_out[t·k + r] (+ sigmoid(shared_gate[t]) ·
    shared[t]), then out = rms_norm(residual)·w: the MoE combine fused into the next pre-norm."""
    check_array("weights", weights, np.float32)
    if expert_out.size != weights.size * w.shape[0]:
        raise ValueError(f"expert_out has {expert_out.size} values, expected weights.size · d")
    if (shared is None) != (shared_gate is None):
        raise ValueError("the shared expert needs both its output and its gate logits")
    mode = MOE if shared is None else MOE_SHARED
    _launch(expert_out, residual, w, out, eps, mode, stream, act, (weights, shared, shared_gate))


def rms_norm_silu_gate(x, z, w, out, eps: float, stream=0, act=None) -> None:
    """out = rms_norm(x)·w·silu(z), per row of len(w) (Gated DeltaNet output norm)."""
    _launch(x, z, w, out, eps, SILU_GATE, stream, act)


def rms_norm_reference(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    rows = x.astype(np.float64).reshape(-1, w.shape[0])  # (rows, d)
    y = rows / np.sqrt((rows * rows).mean(axis=1, keepdims=True) + eps) * w
    return y.reshape(x.shape)
