"""Prefill attention GPU time: the tiled prefill kernel vs the decode split-K kernel the model runs.

    python bench/cuda_attention_bench.py [--tokens 4096] [--reps 5] [--json OUT.json]

One sequence of `tokens` new tokens (no cached prefix), causal, float16 paged KV cache (block size
16, shuffled blocks), random data, for the Qwen3.6-35B-A3B attention shape (16 q / 2 kv heads,
head_dim 256, 10 layers) and Qwen3-30B-A3B's (32 q / 4 kv, head_dim 128, 48 layers). Times one
layer's call with CUDA events (median of --reps after a compiling warm-up) and scales it to the
model's attention layers; TFLOP/s counts 2 FLOPs per multiply-add of Q·Kᵀ and P·V over the causal
triangle. Also prints max |prefill − decode| as a sanity check.
"""

from __future__ import annotations

import argparse
import json
import math

import numpy as np
from numba import cuda

from sparkinfer_cli.kernels.cuda import attention
from sparkinfer_cli.kernels.cuda.attention_prefill import prefill_attention
from sparkinfer_cli.kernels.cuda.launch import cdiv

SHAPES = {  # name: (n_heads, n_kv, head_dim, attention layers)
    "qwen3.6-35b-a3b": (16, 2, 256, 10),
    "qwen3-30b-a3b": (32, 4, 128, 48),
}
BLOCK_SIZE = 16


def make_inputs(tokens: int, n_heads: int, n_kv: int, head_dim: int, rng) -> dict:
    n_blocks = cdiv(tokens, BLOCK_SIZE)
    table = rng.permutation(n_blocks).astype(np.int32).reshape(1, n_blocks)  # (1, n_blocks)
    cache_shape = (n_blocks, BLOCK_SIZE, n_kv, head_dim)
    return {
        "q": cuda.to_device(rng.standard_normal((tokens, n_heads, head_dim), np.float32)),
        "k": cuda.to_device(rng.standard_normal(cache_shape, np.float32).astype(np.float16)),
        "v": cuda.to_device(rng.standard_normal(cache_shape, np.float32).astype(np.float16)),
        "table": cuda.to_device(table),
        "seq_lens": cuda.to_device(np.arange(1, tokens + 1, dtype=np.int32)),  # (tokens,)
        "row_seq": cuda.to_device(np.zeros(tokens, np.int32)),  # (tokens,)
    }


def time_ms(fn, reps: int) -> float:
    fn()  # compile + warm-up
    cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = cuda.event(), cuda.event()
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return float(np.median(times))


def bench_shape(name: str, tokens: int, reps: int, rng) -> dict:
    n_heads, n_kv, head_dim, layers = SHAPES[name]
    x = make_inputs(tokens, n_heads, n_kv, head_dim, rng)
    out_p, out_d = cuda.device_array_like(x["q"]), cuda.device_array_like(x["q"])
    split = max(2 * attention.CHUNK, cdiv(tokens, 32))  # as the model's Workspace sizes it
    ws = attention.DecodeWorkspace(tokens, n_heads, head_dim, tokens, split)
    prefill_ms = time_ms(lambda: prefill_attention(x["q"], x["k"], x["v"], x["table"],
                                                   x["seq_lens"], out_p, row_seq=x["row_seq"]),
                         reps)
    decode_ms = time_ms(lambda: attention.paged_decode_attention(
        x["q"], x["k"], x["v"], x["table"], x["seq_lens"], out_d, ws, row_seq=x["row_seq"]), reps)
    flops = 4.0 * n_heads * head_dim * tokens * (tokens + 1) / 2  # QKᵀ and PV, causal
    diff = float(np.abs(out_p.copy_to_host() - out_d.copy_to_host()).max())
    return {"shape": name, "tokens": tokens, "layers": layers,
            "prefill_ms_per_layer": prefill_ms, "decode_ms_per_layer": decode_ms,
            "prefill_ms_per_pass": prefill_ms * layers, "decode_ms_per_pass": decode_ms * layers,
            "prefill_tflops": flops / prefill_ms / 1e9, "decode_tflops": flops / decode_ms / 1e9,
            "speedup": decode_ms / prefill_ms, "max_abs_diff": diff}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    results = [bench_shape(name, args.tokens, args.reps, rng) for name in SHAPES]
    print(f"{'shape':18} {'layers':>6} {'prefill ms':>11} {'decode ms':>10} {'x':>6} "
          f"{'TFLOP/s':>8} {'per pass ms':>18} {'max|diff|':>10}")
    for r in results:
        print(f"{r['shape']:18} {r['layers']:6d} {r['prefill_ms_per_layer']:11.2f} "
              f"{r['decode_ms_per_layer']:10.2f} {r['speedup']:6.1f} {r['prefill_tflops']:8.1f} "
              f"{r['prefill_ms_per_pass']:8.1f} vs {r['decode_ms_per_pass']:7.1f} "
              f"{r['max_abs_diff']:10.2e}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    if not all(math.isfinite(r["max_abs_diff"]) for r in results):
        raise SystemExit("non-finite attention output")


if __name__ == "__main__":
    main()
