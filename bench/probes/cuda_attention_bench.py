"""Prefill attention GPU time: the tensor-core kernel (flash), float32 tiled, decode.

    python bench/probes/cuda_attention_bench.py [--tokens 4096 32768] [--kernels flash tiled decode]
        [--reps 5] [--json OUT.json]

One sequence of `tokens` new tokens (no cached prefix), causal, float16 paged KV cache (block size
16, shuffled blocks), random data, for the Qwen3.6-35B-A3B attention shape (16 q / 2 kv heads,
head_dim 256, 10 layers) and Qwen3-30B-A3B's (32 q / 4 kv, head_dim 128, 48 layers). Times one
layer's call with CUDA events (median of --reps after a compiling warm-up) and scales it to the
model's attention layers; TFLOP/s counts 2 FLOPs per multiply-add of Q·Kᵀ and P·V over the causal
triangle. Also prints each kernel's max |difference| from the first one's output.
"""

from __future__ import annotations

import argparse
import json
import math

import numpy as np
from numba import cuda

from sparkinfer_cli.kernels.cuda import attention
from sparkinfer_cli.kernels.cuda.attention_flash import flash_prefill_attention
from sparkinfer_cli.kernels.cuda.attention_prefill import prefill_attention
from sparkinfer_cli.kernels.cuda.runtime.launch import cdiv

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


def _kernels(x: dict, tokens: int, n_heads: int, head_dim: int) -> dict:
    """name → a call of that kernel on x writing its own output array."""
    def prefill_call(kernel):
        out = cuda.device_array_like(x["q"])
        return out, lambda: kernel(x["q"], x["k"], x["v"], x["table"], x["seq_lens"], out,
                                   row_seq=x["row_seq"])

    split = max(2 * attention.CHUNK, cdiv(tokens, 32))  # as the model's Workspace sizes it
    ws = attention.DecodeWorkspace(tokens, n_heads, head_dim, tokens, split)
    decode_out = cuda.device_array_like(x["q"])
    return {
        "flash": prefill_call(flash_prefill_attention),
        "tiled": prefill_call(prefill_attention),
        "decode": (decode_out, lambda: attention.paged_decode_attention(
            x["q"], x["k"], x["v"], x["table"], x["seq_lens"], decode_out, ws,
            row_seq=x["row_seq"])),
    }


def bench_shape(name: str, tokens: int, reps: int, kernels: list[str], rng) -> list[dict]:
    n_heads, n_kv, head_dim, layers = SHAPES[name]
    x = make_inputs(tokens, n_heads, n_kv, head_dim, rng)
    calls = _kernels(x, tokens, n_heads, head_dim)
    flops = 4.0 * n_heads * head_dim * tokens * (tokens + 1) / 2  # QKᵀ and PV, causal
    rows, first = [], None
    for kernel in kernels:
        out, call = calls[kernel]
        ms = time_ms(call, reps)
        host = out.copy_to_host()
        first = host if first is None else first
        rows.append({"shape": name, "tokens": tokens, "layers": layers, "kernel": kernel,
                     "ms_per_layer": ms, "ms_per_pass": ms * layers,
                     "tflops": flops / ms / 1e9,
                     "max_abs_diff_vs_first": float(np.abs(host - first).max())})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--kernels", nargs="+", default=["flash", "tiled"],
                        choices=["flash", "tiled", "decode"])
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    results = [r for tokens in args.tokens for name in SHAPES
               for r in bench_shape(name, tokens, args.reps, args.kernels, rng)]
    print(f"{'shape':18} {'tokens':>6} {'kernel':>7} {'ms/layer':>9} {'ms/pass':>9} "
          f"{'TFLOP/s':>8} {'max|diff|':>10}")
    for r in results:
        print(f"{r['shape']:18} {r['tokens']:6d} {r['kernel']:>7} {r['ms_per_layer']:9.2f} "
              f"{r['ms_per_pass']:9.1f} {r['tflops']:8.1f} {r['max_abs_diff_vs_first']:10.2e}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    if not all(math.isfinite(r["max_abs_diff_vs_first"]) for r in results):
        raise SystemExit("non-finite attention output")


if __name__ == "__main__":
    main()
