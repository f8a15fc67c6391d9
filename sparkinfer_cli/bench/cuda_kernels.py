"""GEMV bandwidth on the GPU at the Qwen3.6-35B-A3B decode shapes and per quant type.

python -m sparkinfer_cli.bench.cuda_kernels --out results.json
GPU time per call = CUDA-event time of replaying a captured graph of many launches that rotate over
weight copies totalling > L2 (60 MB), so every call streams its weights from HBM.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
from numba import cuda

from sparkinfer_cli.gguf.ggml_types import GGMLType, row_bytes
from sparkinfer_cli.kernels.cuda import quant_gemv as qg
from sparkinfer_cli.kernels.cuda.runtime import graphs
from sparkinfer_cli.kernels.cuda.runtime.launch import to_device_bytes

ROTATE_BYTES = 512 << 20
EXPERTS, TOP_K = 256, 8
# (name, type, k, n_rows, n_mats, per-token count in Qwen3.6-35B-A3B: 30 GDN + 10 attention layers)
QWEN36_SHAPES = [
    ("gdn attn_qkv", GGMLType.Q8_0, 2048, 8192, 1, 30),
    ("gdn attn_gate", GGMLType.Q8_0, 2048, 4096, 1, 30),
    ("gdn ssm_alpha/beta", GGMLType.Q8_0, 2048, 32, 1, 60),
    ("gdn ssm_out", GGMLType.Q8_0, 4096, 2048, 1, 30),
    ("attn_q (+gate)", GGMLType.Q8_0, 2048, 8192, 1, 10),
    ("attn_k / attn_v", GGMLType.Q8_0, 2048, 512, 1, 20),
    ("attn_output", GGMLType.Q8_0, 4096, 2048, 1, 10),
    ("ffn_gate_inp (router)", GGMLType.F32, 2048, 256, 1, 40),
    ("ffn_gate/up_exps, top-8", GGMLType.Q4_K, 2048, 512, EXPERTS, 80),
    ("ffn_down_exps, top-8", GGMLType.Q5_K, 512, 2048, EXPERTS, 40),
    ("ffn_gate/up_shexp", GGMLType.Q8_0, 2048, 512, 1, 80),
    ("ffn_down_shexp", GGMLType.Q8_0, 512, 2048, 1, 40),
    ("output", GGMLType.Q6_K, 2048, 248320, 1, 1),
]
SQUARE_TYPES = [GGMLType.F32, GGMLType.F16, GGMLType.BF16, GGMLType.Q8_0, GGMLType.Q4_0,
                GGMLType.Q4_1, GGMLType.Q5_0, GGMLType.Q5_1, GGMLType.Q4_K, GGMLType.Q5_K,
                GGMLType.Q6_K, GGMLType.IQ4_NL, GGMLType.IQ4_XS]


def _random_bytes(ggml_type, n_bytes, rng):
    """Float weights of RMS 0.03, or random quant bytes (their values do not change the timing)."""
    dtype = {GGMLType.F32: np.float32, GGMLType.F16: np.float16, GGMLType.BF16: np.float16}
    if ggml_type in dtype:
        n = n_bytes // np.dtype(dtype[ggml_type]).itemsize
        return (rng.standard_normal(n) * 0.03).astype(dtype[ggml_type]).view(np.uint8)
    return rng.integers(0, 256, n_bytes, dtype=np.uint8)


def measure(ggml_type, k, n_rows, n_mats, n_slots, n_cols, rng, stream):
    rb = row_bytes(ggml_type, k)
    mat_bytes = n_mats * n_rows * rb
    n_copies = int(min(16, max(2, -(-ROTATE_BYTES // mat_bytes))))
    host = _random_bytes(ggml_type, mat_bytes, rng)
    mats = [qg.DeviceQuantMatrix(to_device_bytes(host), ggml_type, k, n_rows, n_mats)
            for _ in range(n_copies)]
    slot_sets = [cuda.to_device(rng.choice(n_mats, n_slots, replace=n_mats < n_slots).astype(
        np.int32)) for _ in range(n_copies)]
    slot_x = cuda.to_device(np.zeros(n_slots, np.int32))
    x = cuda.to_device(rng.standard_normal((1, n_cols, k)).astype(np.float32))
    act = x if mats[0].takes_float_activations else qg.QuantizedActivations(1, n_cols, k)
    if act is not x:
        qg.quantize_activations(x, act, stream=stream)
    y = cuda.device_array((n_slots, n_cols, n_rows), np.float32)
    reps = max(1, 64 // n_copies)

    def record(s):
        for _ in range(reps):
            for m, sm in zip(mats, slot_sets):
                qg.gemv(m, act, y, slot_mat=sm, slot_x=slot_x, stream=s)

    record(stream)
    stream.synchronize()
    t0 = time.perf_counter()
    record(stream)
    eager_host_us = (time.perf_counter() - t0) / (reps * n_copies) * 1e6
    stream.synchronize()
    g = graphs.capture(record, stream)
    g.replay()
    start, end = cuda.event(), cuda.event()
    n_replays = 5
    start.record(stream)
    for _ in range(n_replays):
        g.replay()
    end.record(stream)
    end.synchronize()
    sec = cuda.event_elapsed_time(start, end) / 1e3 / (n_replays * reps * n_copies)
    g.close()
    touched = n_slots * n_rows * rb
    return {"type": ggml_type.name, "k": k, "n_rows": n_rows, "n_slots": n_slots, "n_cols": n_cols,
            "bytes": touched, "us": sec * 1e6, "tb_s": touched / sec / 1e12,
            "eager_host_us": eager_host_us}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    stream = cuda.stream()
    name = cuda.get_current_device().name
    device = name.decode() if isinstance(name, bytes) else str(name)
    results = {"device": device, "qwen36": [], "square": [], "cols": []}
    step_us = 0.0
    for name, t, k, n, mats, per_token in QWEN36_SHAPES:
        r = measure(t, k, n, mats, TOP_K if mats > 1 else 1, 1, rng, stream)
        r.update(name=name, per_token=per_token)
        step_us += r["us"] * per_token
        results["qwen36"].append(r)
        print(f"{name:26s} {t.name:5s} {r['bytes']/1e6:8.2f} MB {r['us']:8.2f} us "
              f"{r['tb_s']:5.2f} TB/s  eager host {r['eager_host_us']:.1f} us", flush=True)
    results["gemv_us_per_token"] = step_us
    print(f"GEMV-only time per Qwen3.6 token: {step_us:.0f} us", flush=True)
    for t in SQUARE_TYPES:
        r = measure(t, 4096, 4096, 1, 1, 1, rng, stream)
        results["square"].append(r)
        print(f"4096x4096 {t.name:6s} {r['bytes']/1e6:7.2f} MB {r['us']:7.2f} us "
              f"{r['tb_s']:5.2f} TB/s", flush=True)
    for t in (GGMLType.Q4_K, GGMLType.Q8_0):
        for n_cols in (1, 2, 4, 8):
            r = measure(t, 4096, 4096, 1, 1, n_cols, rng, stream)
            results["cols"].append(r)
            print(f"4096x4096 {t.name} cols={n_cols}: {r['us']:7.2f} us {r['tb_s']:5.2f} TB/s",
                  flush=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
