"""Where the host time of a batch-1 decode step goes (cProfile over graph-replayed steps).

    python bench/probes/cuda_host_profile.py <preset> [--ctx 512] [--steps 200]

Prints the step's wall time with and without the profiler's overhead and the functions that
take the most host time (tottime), so host work can be told apart from GPU time.
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import numpy as np
from rich.console import Console

from sparkinfer_cli.bench.runner import ensure_synthetic
from sparkinfer_cli.model.batch import SequenceBatch
from sparkinfer_cli.model.loader import load_model


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("preset")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--steps", type=int, default=200)
    args = ap.parse_args()
    model = load_model(ensure_synthetic(args.preset, Console(stderr=True)), "cuda")
    n_blocks = -(-(args.ctx + 2 * args.steps + 64) // 16)
    cache = model.create_cache(n_blocks, 16, 1)
    table = np.arange(n_blocks, dtype=np.int32)
    rng = np.random.default_rng(0)
    model.forward(SequenceBatch.single(rng.integers(0, 1000, args.ctx), 0, table), cache)
    pos, token = args.ctx, np.array([1], np.int32)

    def steps(n: int) -> float:
        nonlocal pos, token
        t0 = time.perf_counter()
        for _ in range(n):
            token = model.forward_greedy(SequenceBatch.single(token, pos, table), cache)
            pos += 1
        return (time.perf_counter() - t0) / n * 1e6

    steps(8)  # compile + capture
    print(f"wall µs a step: {steps(args.steps // 2):.0f}")
    profiler = cProfile.Profile()
    profiler.enable()
    profiled = steps(args.steps // 2)
    profiler.disable()
    print(f"wall µs a step under cProfile: {profiled:.0f}")
    pstats.Stats(profiler).sort_stats("tottime").print_stats(30)


if __name__ == "__main__":
    main()
