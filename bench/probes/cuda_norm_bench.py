"""GPU µs a launch of each RMSNorm mode (kernels/cuda/norm.py) at the Qwen3.6-35B-A3B prefill
pass's shapes: 2,048 tokens of 2,048 features (plain, residual add, the MoE combine with the
shared expert) and 2,048 × 32 value heads of 128 (the Gated DeltaNet output norm gated by
silu(z)), each writing the q8 activations too.

    python bench/probes/cuda_norm_bench.py OUT.json

20 launches behind a sleeping kernel (the host queues them while the GPU waits, so launch
overhead is not timed), CUDA events; random inputs. GB/s counts the bytes each mode must move.
"""
from __future__ import annotations

import json
import sys

import numpy as np
from numba import cuda

from sparkinfer_cli.kernels.cuda import norm
from sparkinfer_cli.kernels.cuda.quant_gemv import QuantizedActivations

T, E, K, HV, DV = 2048, 2048, 8, 32, 128  # tokens, features, experts a token, value heads, head
REPS = 20


@cuda.jit
def _spin(n_ms):
    for _ in range(n_ms):
        cuda.nanosleep(1000000)


def _cases(rng) -> dict:
    """name → (launch, bytes it must move)."""
    def dev(*shape):
        return cuda.to_device(rng.standard_normal(shape).astype(np.float32))

    w, w_head = dev(E), dev(DV)
    x, res, out = dev(T, E), dev(T, E), dev(T, E)
    act, act_heads = QuantizedActivations(T // 8, 8, E), QuantizedActivations(T // 8, 8, HV * DV)
    experts, weights, shared, gate = dev(T * K, E), dev(T, K), dev(T, E), dev(T)
    o, z, y = dev(T * HV, DV), dev(T * HV, DV), dev(T * HV, DV)
    q8 = T * E * 1.25  # int8 values and two floats a 32-block
    return {
        "plain": (lambda: norm.rms_norm(x, w, out, 1e-6, act=act), T * E * 8 + q8),
        "add": (lambda: norm.add_rms_norm(x, res, w, out, 1e-6, act=act), T * E * 16 + q8),
        "moe_shared": (lambda: norm.moe_add_rms_norm(experts, weights, res, w, out, 1e-6,
                                                     act=act, shared=shared, shared_gate=gate),
                       T * E * 4 * (K + 4) + q8),
        "silu_gate (d 128)": (lambda: norm.rms_norm_silu_gate(o, z, w_head, y, 1e-6,
                                                              act=act_heads),
                              T * HV * DV * 13.25),
    }


def main() -> None:
    results = {}
    for name, (launch, n_bytes) in _cases(np.random.default_rng(0)).items():
        launch()
        cuda.synchronize()
        start, end = cuda.event(), cuda.event()
        _spin[1, 1](30)
        start.record()
        for _ in range(REPS):
            launch()
        end.record()
        end.synchronize()
        us = cuda.event_elapsed_time(start, end) * 1e3 / REPS
        results[name] = {"us": us, "GB/s": n_bytes / us / 1e3}
        print(f"{name:20s} {us:8.1f} µs {n_bytes / us / 1e3:7.0f} GB/s", flush=True)
    with open(sys.argv[1], "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
