"""TFLOP/s of the tensor-core prefill GEMM (mma_gemm) at the Qwen3.6-35B-A3B prefill shapes.

    python bench/probes/cuda_mma_bench.py [--tokens 4096] [--reps 20] [--types Q4_K,Q8_0]

Dense: x (tokens, 2048) @ W (4096 | 512, 2048)ᵀ per weight type (Q8_0: the f16-tile GEMM, then
the int8 one over q8 activations), the f16 GEMM over the weights' f16 copy (gemm_f16, and the
conversion of x it needs), and the fused SwiGLU at 512 rows.
Grouped (MoE): tokens × top-8 slots over 256 experts, gate+up fused (2048 → 512) and down
(512 → 2048), routed by expert_route.route_experts. K-quant types also on the int8 grouped
GEMM (mmq_k) over the same slots' q8 activations. GPU time by CUDA events, mean of --reps
launches behind a sleeping kernel (so host launch overhead is not timed); random weights and
activations (never zeros). Effective TFLOP/s count 2·n·k·rows per matrix (×2 for SwiGLU).
"""
from __future__ import annotations

import argparse
import contextlib

import numpy as np
from numba import cuda

from sparkinfer_cli.gguf.ggml_types import BLOCK_GEOMETRY, GGMLType
from sparkinfer_cli.kernels.cuda import fragment_gemm, gemm_f16, mmq_k, mmq_q8
from sparkinfer_cli.kernels.cuda import mma_gemm as mg
from sparkinfer_cli.kernels.cuda.expert_route import ExpertRoute, route_experts
from sparkinfer_cli.kernels.cuda.quant_gemv import (
    DeviceQuantMatrix,
    QuantizedActivations,
    quantize_activations,
)
from sparkinfer_cli.kernels.cuda.runtime.launch import to_device_bytes

N_EMBD, EXPERT_FF, N_EXPERT, TOP_K = 2048, 512, 256, 8
# byte offsets of each block's fp16 scale fields, set to sane values in the random bytes
_FP16_FIELDS = {GGMLType.Q4_0: (0,), GGMLType.Q4_1: (0, 2), GGMLType.Q5_0: (0,),
                GGMLType.Q5_1: (0, 2), GGMLType.Q8_0: (0,), GGMLType.Q4_K: (0, 2),
                GGMLType.Q5_K: (0, 2), GGMLType.Q6_K: (208,)}


def random_matrix(t: GGMLType, n_mats: int, n_rows: int, k: int, rng) -> DeviceQuantMatrix:
    """Random valid GGUF bytes of type t on the device (float types: N(0, 0.03))."""
    n = n_mats * n_rows * k
    if t in (GGMLType.F32, GGMLType.F16):
        raw = (rng.standard_normal(n, np.float32) * np.float32(0.03)).astype(
            np.float32 if t == GGMLType.F32 else np.float16).view(np.uint8)
    else:
        block, size = BLOCK_GEOMETRY[t]
        raw = rng.integers(0, 256, (n // block, size), dtype=np.uint8)  # (blocks, block bytes)
        for off in _FP16_FIELDS[t]:
            scale = rng.uniform(1e-4, 4e-4, n // block).astype(np.float16)
            raw[:, off:off + 2] = scale.view(np.uint8).reshape(-1, 2)
    return DeviceQuantMatrix(to_device_bytes(raw), t, k, n_rows, n_mats)


@cuda.jit
def _spin(n_ms):
    for _ in range(n_ms):
        cuda.nanosleep(1000000)


def gpu_us(fn, reps: int) -> float:
    """Mean GPU µs of fn() over reps back-to-back launches (a sleeping kernel covers the host)."""
    fn()  # compile + warm up
    cuda.synchronize()
    start, stop = cuda.event(), cuda.event()
    _spin[1, 1](2 + reps // 2)
    start.record()
    for _ in range(reps):
        fn()
    stop.record()
    stop.synchronize()
    return start.elapsed_time(stop) * 1e3 / reps


def _report(name: str, us: float, flops: float, y, weight_bytes: int = 0) -> None:
    """One line: µs, effective TFLOP/s and (given the weight bytes a call must read) GB/s."""
    if not np.isfinite(y.copy_to_host()).all():
        raise SystemExit(f"{name}: non-finite outputs")
    gbs = f"  {weight_bytes / us / 1e3:7.0f} GB/s of weights" if weight_bytes else ""
    print(f"{name:<44} {us:9.1f} µs  {flops / us / 1e6:7.1f} TFLOP/s{gbs}", flush=True)


def bench_dense(types: list[GGMLType], n_tok: int, reps: int, rng) -> None:
    x = cuda.to_device(rng.standard_normal((n_tok, N_EMBD), np.float32))  # (n_tok, k)
    xq = QuantizedActivations(1, n_tok, N_EMBD)  # x as q8, for the int8 GEMM
    quantize_activations(x.reshape(1, n_tok, N_EMBD), xq)
    for t in types:
        for n_rows in (4096, 512):
            w = random_matrix(t, 1, n_rows, N_EMBD, rng)
            y = cuda.device_array((n_tok, n_rows), np.float32)
            us = gpu_us(lambda: mg.matmul(w, x, y), reps)
            _report(f"{t.name} {n_tok}×{N_EMBD} → {n_rows}", us, 2.0 * n_tok * N_EMBD * n_rows, y)
            if mmq_q8.supports(w, n_tok):
                size = mmq_q8.partials_size(w, n_tok)
                part = cuda.device_array(size, np.float32) if size else None
                us = gpu_us(lambda: mmq_q8.matmul(w, xq, y, partials=part), reps)
                _report(f"  int8 (mmq_q8), {mmq_q8.k_splits(w, n_tok)} k ranges", us,
                        2.0 * n_tok * N_EMBD * n_rows, y)
            if gemm_f16.supports(w):
                half, xh = gemm_f16.dequantize(w), cuda.device_array(x.size // 2, np.uint32)
                us = gpu_us(lambda: gemm_f16.to_f16(x, xh), reps)
                _report("  f16 copy (gemm_f16): to_f16 of x", us, 0.0, y)
                us = gpu_us(lambda: gemm_f16.matmul(half, xh, y), reps)
                _report("  f16 copy (gemm_f16)", us, 2.0 * n_tok * N_EMBD * n_rows, y)
    gate, up = (random_matrix(types[0], 1, EXPERT_FF, N_EMBD, rng) for _ in range(2))
    y = cuda.device_array((n_tok, EXPERT_FF), np.float32)
    us = gpu_us(lambda: mg.matmul(gate, x, y, up=up), reps)
    _report(f"{types[0].name} SwiGLU {n_tok}×{N_EMBD} → 2×{EXPERT_FF}", us,
            4.0 * n_tok * N_EMBD * EXPERT_FF, y)


def bench_grouped(t: GGMLType, n_tok: int, tile: int, reps: int, rng) -> None:
    n_slots = n_tok * TOP_K
    ids = np.argsort(rng.random((n_tok, N_EXPERT)), axis=1)[:, :TOP_K].astype(np.int32).ravel()
    route = ExpertRoute(N_EXPERT, n_slots, tile)
    route_experts(cuda.to_device(ids), n_slots, route)
    slot_x = cuda.to_device(np.repeat(np.arange(n_tok, dtype=np.int32), TOP_K))  # (n_slots,)
    x = cuda.to_device(rng.standard_normal((n_tok, N_EMBD), np.float32))
    gate, up = (random_matrix(t, N_EXPERT, EXPERT_FF, N_EMBD, rng) for _ in range(2))
    touched = len(np.unique(ids))  # experts whose weights a call reads
    h = cuda.device_array((n_slots, EXPERT_FF), np.float32)
    us = gpu_us(lambda: mg.grouped_matmul(gate, x, h, route, slot_x, up=up), reps)
    _report(f"{t.name} grouped gate+up {n_slots} slots tile {tile}", us,
            4.0 * n_slots * N_EMBD * EXPERT_FF, h, 2 * touched * gate.n_rows * gate.row_bytes)
    down = random_matrix(t, N_EXPERT, N_EMBD, EXPERT_FF, rng)
    slot_h = cuda.to_device(np.arange(n_slots, dtype=np.int32))  # (n_slots,) row s of h
    y = cuda.device_array((n_slots, N_EMBD), np.float32)
    us = gpu_us(lambda: mg.grouped_matmul(down, h, y, route, slot_h), reps)
    _report(f"{t.name} grouped down {n_slots} slots tile {tile}", us,
            2.0 * n_slots * EXPERT_FF * N_EMBD, y, touched * down.n_rows * down.row_bytes)
    if mmq_k.supports(gate) and tile <= mmq_k.BN:
        _bench_grouped_int8(gate, up, down, x, h, y, route, slot_x, slot_h, reps, touched)
    for swiglu, w in ((True, gate), (False, down)):
        kernel = (fragment_gemm.gemm_kernel(t, tile, swiglu, True)
                  if fragment_gemm.supports(t, w.k)
                  else mg._gemm_kernel(t, tile, swiglu, True, mg._stages(tile, w.k // mg.BK)))
        for compiled in kernel.overloads.values():  # spills show as local memory
            print(f"  swiglu {swiglu}: {compiled.regs_per_thread} registers, "
                  f"{compiled.local_mem_per_thread} local bytes a thread")


def _bench_grouped_int8(gate, up, down, x, h, y, route, slot_x, slot_h, reps, touched) -> None:
    """bench_grouped's two products on mmq_k, each over its input quantized to q8."""
    n_tok, n_slots = x.shape[0], h.shape[0]
    xq, hq = QuantizedActivations(1, n_tok, N_EMBD), QuantizedActivations(1, n_slots, EXPERT_FF)
    quantize_activations(x.reshape(1, n_tok, N_EMBD), xq)
    quantize_activations(h.reshape(1, n_slots, EXPERT_FF), hq)
    us = gpu_us(lambda: mmq_k.grouped_matmul(gate, xq, h, route, slot_x, up=up), reps)
    _report("  int8 (mmq_k) gate+up", us, 4.0 * n_slots * N_EMBD * EXPERT_FF, h,
            2 * touched * gate.n_rows * gate.row_bytes)
    us = gpu_us(lambda: mmq_k.grouped_matmul(down, hq, y, route, slot_h), reps)
    _report("  int8 (mmq_k) down", us, 2.0 * n_slots * EXPERT_FF * N_EMBD, y,
            touched * down.n_rows * down.row_bytes)
    for swiglu in (True, False):
        for compiled in mmq_k._gemm_kernel(gate.ggml_type, swiglu).overloads.values():
            print(f"  mmq_k swiglu {swiglu}: {compiled.regs_per_thread} registers, "
                  f"{compiled.local_mem_per_thread} local bytes a thread")


@contextlib.contextmanager
def staged_only():
    """mma_gemm with its f16-staging kernel for every type (the fragment GEMM off)."""
    supports = fragment_gemm.supports
    fragment_gemm.supports = lambda *args: False
    try:
        yield
    finally:
        fragment_gemm.supports = supports


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="4096", help="comma-separated token counts")
    ap.add_argument("--grouped-only", action="store_true", help="skip the dense GEMMs")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--types", default="Q4_K,Q5_K,Q6_K,Q8_0,Q4_0,Q5_0,F16")
    ap.add_argument("--tiles", default=",".join(map(str, mg.TOKEN_TILES)),
                    help="comma-separated grouped token tiles")
    ap.add_argument("--baseline", action="store_true",
                    help="also time the f16-staging kernel where the fragment GEMM applies")
    args = ap.parse_args()
    if args.reps < 1:
        raise SystemExit("--reps must be ≥ 1")
    types = [GGMLType[name] for name in args.types.split(",")]
    rng = np.random.default_rng(0)
    print(f"device: {getattr(cuda.get_current_device(), 'name', '?')}; reps {args.reps}")
    kernels = [("", contextlib.nullcontext)] + ([("staged: ", staged_only)] if args.baseline
                                                 else [])
    for n_tok in (int(n) for n in args.tokens.split(",")):
        for label, context in kernels:
            print(f"{label or 'default kernels: '}{n_tok} tokens")
            with context():
                if not args.grouped_only:
                    bench_dense(types, n_tok, args.reps, rng)
                print(f"expert_tile picks {mg.expert_tile(n_tok * TOP_K, N_EXPERT)}")
                for tile in (int(t) for t in args.tiles.split(",")):
                    bench_grouped(types[0], n_tok, tile, args.reps, rng)


if __name__ == "__main__":
    main()
