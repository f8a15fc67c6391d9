"""GPU time of one decode-attention call (paged_decode_attention) at the real attention shapes,
swept over the kernels (attention_mma's tensor-core kernel serving a kv head's query heads,
attention.py's with 1 / 2 / 4 query heads a block) × splits per row, each output checked against
the numpy reference.

    PYTHONPATH=. python bench/probes/cuda_decode_attention_bench.py [--json OUT.json]   (on the GPU)

Rows: batch 1 after 512 / 32,768 tokens (Qwen3.6-35B-A3B: 16 q / 2 kv heads, head_dim 256;
Qwen3-30B-A3B: 32 / 4, 128) and 64 sequences of 256 tokens (the throughput figure's depth).
Float16 paged cache, block size 16, shuffled blocks. Each case is a CUDA graph of launches that
rotate over cache copies totalling ≥ 256 MB (a layer's K/V is not in L2 in a real step: the
weights streamed in between evict it). GB/s counts the K/V bytes a call must read; the floor is
those bytes at 4 TB/s.
"""

from __future__ import annotations

import argparse
import json

import numpy as np
from numba import cuda

from bench.probes.cuda_gemv_bench import ROTATE_BYTES, gpu_us
from sparkinfer_cli.kernels.cuda import attention, attention_mma
from sparkinfer_cli.kernels.cuda.runtime.launch import cdiv

BLOCK_SIZE = 16
SHAPES = {"qwen3.6": (16, 2, 256), "qwen3-30b": (32, 4, 128)}  # (n_heads, n_kv, head_dim)
# (shape, sequences, context, [splits per row to try]); None: the launch's own choice
# (DecodeWorkspace.splits: SPLIT_BLOCKS). attention.py's kernel takes at most
# FLOAT_KERNEL_SPLITS (64): its rows asking for more run that many.
CASES = [("qwen3.6", 1, 32768, [None, 32, 64, 128]), ("qwen3.6", 1, 512, [None, 1, 2]),
         ("qwen3-30b", 1, 512, [None, 1, 2]), ("qwen3-30b", 1, 32768, [None, 32, 64, 128]),
         ("qwen3.6", 64, 256, [None, 1, 4, 64])]
DEFAULT_SPLIT_BLOCKS = attention.SPLIT_BLOCKS, attention_mma.SPLIT_BLOCKS
# --crossover: each kernel at its own defaults (splits auto) over batches × contexts: where
# attention.py's CUDA-core kernel beats the tensor-core one (2026-12-01: one sequence under ~2k
# tokens, by ≤ 2.3 µs; not worth a context-dependent decode graph)
CROSSOVER_CASES = [(shape, n_seqs, ctx, [None]) for shape in SHAPES for n_seqs in (1, 8, 64)
                   for ctx in (256, 512, 1024, 2048, 4096, 8192) if n_seqs * ctx <= 131072]
HEADS_PER_BLOCK = (0, 1, 2, 4)  # 0: attention_mma's kernel (all of a kv head's query heads)
PACKED = attention_mma.tensor_core_group
FLOOR_BYTES_PER_US = 4.0e6  # 4 TB/s


def make_case(shape: str, n_seqs: int, ctx: int, rng, stream) -> dict:
    n_heads, n_kv, head_dim = SHAPES[shape]
    per_seq = cdiv(ctx + 1, BLOCK_SIZE)
    n_blocks = n_seqs * per_seq
    table = rng.permutation(n_blocks).astype(np.int32).reshape(n_seqs, per_seq)  # (seqs, blocks)
    cache_shape = (n_blocks, BLOCK_SIZE, n_kv, head_dim)
    k = rng.standard_normal(cache_shape, np.float32).astype(np.float16)
    v = rng.standard_normal(cache_shape, np.float32).astype(np.float16)
    q = rng.standard_normal((n_seqs, n_heads, head_dim), np.float32)  # (seqs, heads, head_dim)
    seq_lens = np.full(n_seqs, ctx, np.int32)  # (seqs,)
    n_copies = max(1, min(64, ROTATE_BYTES // (2 * k.nbytes)))
    return {"host": (q, k, v, table, seq_lens), "n_heads": n_heads, "head_dim": head_dim,
            "q": cuda.to_device(q, stream=stream), "table": cuda.to_device(table, stream=stream),
            "seq_lens": cuda.to_device(seq_lens, stream=stream),
            "kv": [(cuda.to_device(k, stream=stream), cuda.to_device(v, stream=stream))
                   for _ in range(n_copies)],
            "kv_bytes": 2 * n_seqs * ctx * n_kv * head_dim * 2}


def time_variant(case: dict, n_splits: int | None, heads: int, ctx: int,
                 stream) -> tuple[float, float]:
    """(GPU µs a call, max |out − reference|) with `heads` query heads a block (0: the
    tensor-core kernel), n_splits a row (each split ≥ CHUNK keys: a 512-token row holds at most
    4; the tensor-core kernel's ≥ 64)."""
    # the dispatch and heads_per_block read these at launch
    attention_mma.tensor_core_group = PACKED if heads == 0 else (lambda *_: False)
    attention.MAX_BLOCK_HEADS = max(heads, 1)
    # a forced split count: no block target to lower it
    attention.SPLIT_BLOCKS, attention_mma.SPLIT_BLOCKS = \
        DEFAULT_SPLIT_BLOCKS if n_splits is None else (1 << 30, 1 << 30)
    q, n_seqs = case["q"], case["q"].shape[0]
    ws = attention.DecodeWorkspace(n_seqs, case["n_heads"], case["head_dim"], ctx,
                                   split_len=attention.CHUNK if n_splits is None
                                   else cdiv(ctx, n_splits))
    out = cuda.device_array(q.shape, np.float32)

    def launch(s, i):
        k, v = case["kv"][i % len(case["kv"])]
        attention.paged_decode_attention(q, k, v, case["table"], case["seq_lens"], out, ws,
                                         stream=s)
    us = gpu_us(launch, stream)
    ref = attention.paged_decode_attention_reference(*case["host"])
    return us, float(np.abs(out.copy_to_host(stream=stream) - ref).max())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", help="also write the rows here")
    parser.add_argument("--heads", type=int, action="append",
                        help=f"query heads a block to try (repeatable; default {HEADS_PER_BLOCK})")
    parser.add_argument("--crossover", action="store_true",
                        help="the two kernels (at their defaults) over batches 1/8/64 × contexts "
                             "256..8192")
    args = parser.parse_args()
    if args.crossover:
        args.heads = args.heads or [0, attention.MAX_BLOCK_HEADS]
    rng, stream = np.random.default_rng(0), cuda.stream()
    rows = []
    for shape, n_seqs, ctx, splits in CROSSOVER_CASES if args.crossover else CASES:
        case = make_case(shape, n_seqs, ctx, rng, stream)
        floor_us = case["kv_bytes"] / FLOOR_BYTES_PER_US
        for heads in args.heads or HEADS_PER_BLOCK:
            for n_splits in splits:
                us, err = time_variant(case, n_splits, heads, ctx, stream)
                row = {"shape": shape, "seqs": n_seqs, "ctx": ctx, "heads_per_block": heads,
                       "splits": n_splits, "us": us, "floor_us": floor_us, "max_err": err}
                rows.append(row)
                print(f"{shape:10s} {n_seqs:3d} seqs × {ctx:6d}  heads/block {heads}  "
                      f"splits {n_splits or 'auto':>4}: {us:8.1f} µs (floor {floor_us:6.1f}, "
                      f"{case['kv_bytes'] / us / 1e3:6.0f} GB/s)  max err {err:.1e}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    if any(not r["max_err"] < 1e-2 for r in rows):
        raise SystemExit("a variant's output differs from the reference")


if __name__ == "__main__":
    main()
