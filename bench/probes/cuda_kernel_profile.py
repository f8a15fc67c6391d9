"""GPU time per kernel of one decode step (graph replays) or one prefill, read through CUPTI.

    python bench/probes/cuda_kernel_profile.py <preset> OUT.json [--ctx 512] [--steps 20]
        [--batch 1]
    python bench/probes/cuda_kernel_profile.py <preset> OUT.json --prefill 4096 [--steps 2]

--batch B: B sequences of ctx tokens each decode together. --prefill N: one eager forward of N new
tokens (after ctx cached ones) per step instead of decode steps.

Needs PyTorch (its profiler is the CUPTI client; the H200 image has it). Prints and writes: the
step's wall time, the sum of its kernels' GPU times, and per kernel name the launches per step and
GPU µs per step. wall − Σ kernels = the gaps between dependent kernels (launch latency).
"""
from __future__ import annotations

import argparse
import json
import re
import time
from collections import defaultdict
from collections.abc import Callable

import numpy as np
from rich.console import Console

from sparkinfer_cli.bench.runner import ensure_synthetic
from sparkinfer_cli.model.batch import SequenceBatch
from sparkinfer_cli.model.loader import load_model


def _kernel_name(event_name: str) -> str:
    """'module.function' of a numba kernel from its (mangled or demangled) symbol name."""
    if event_name.startswith("_ZN"):  # Itanium: N <len><name>... ; numba appends its ABI tags
        parts, rest = [], event_name[3:]
        while (m := re.match(r"(\d+)", rest)) is not None:
            n = int(m.group(1))
            parts.append(rest[len(m.group(1)):len(m.group(1)) + n])
            rest = rest[len(m.group(1)) + n:]
        parts = [re.sub(r"B\d.*$", "", p) for p in parts if p not in ("_3clocals_3e", "cudapy")]
    else:
        parts = re.split(r"::", re.split(r"\[abi|\(", event_name)[0])
    return ".".join(parts[-3:])[:100]


def kernel_rows(prof, steps: int) -> list[tuple[str, float, float]]:
    """(kernel name, launches a step, GPU µs a step) of a profile over `steps` steps, slowest
    first."""
    per_name: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for ev in prof.events():
        if ev.device_type.name == "CUDA" and ev.device_time_total > 0:
            entry = per_name[_kernel_name(ev.name)]
            entry[0] += 1
            entry[1] += ev.device_time_total
    return sorted(((n, c / steps, t / steps) for n, (c, t) in per_name.items()),
                  key=lambda r: -r[2])


def _decode_step(model, args) -> Callable[[], None]:
    """A step: one new token for each of args.batch sequences that hold args.ctx tokens."""
    n_blocks = -(-(args.ctx + 4 * args.steps + 16) // 16)
    cache = model.create_cache(n_blocks * args.batch, 16, args.batch)
    tables = [np.arange(n_blocks, dtype=np.int32) + b * n_blocks for b in range(args.batch)]
    rng = np.random.default_rng(0)
    for b, table in enumerate(tables):
        prompt = rng.integers(0, model.config.n_vocab, args.ctx).astype(np.int32)
        for lo in range(0, args.ctx, 4096):
            model.forward(SequenceBatch.single(prompt[lo:lo + 4096], lo, table, b), cache)
    pos = args.ctx
    tokens = rng.integers(0, model.config.n_vocab, args.batch).astype(np.int32)

    def step(greedy: bool = True) -> None:
        """greedy: argmax on the device, ids back; else the logits come back to the host."""
        nonlocal tokens, pos
        batch = SequenceBatch(tokens, [pos] * args.batch, [1] * args.batch, tables,
                              list(range(args.batch)))
        if greedy:
            tokens = model.forward_greedy(batch, cache)
        else:
            tokens = model.forward(batch, cache).argmax(axis=1).astype(np.int32)
        pos += 1
    return step


def _prefill_step(model, args) -> Callable[[], None]:
    """A step: args.prefill new tokens after args.ctx cached ones, one sequence, eager."""
    n_blocks = -(-(args.ctx + args.prefill) // 16)
    cache = model.create_cache(n_blocks, 16, 1)
    table = np.arange(n_blocks, dtype=np.int32)
    prompt = np.random.default_rng(0).integers(0, model.config.n_vocab, args.prefill)

    def step(greedy: bool = True) -> None:  # a prefill returns no token either way
        model.forward(SequenceBatch.single(prompt.astype(np.int32), args.ctx, table, 0), cache)
    return step


def _last_step_trace(prof, launches: int) -> list[dict]:
    """The last `launches` GPU events in start order: name, GPU µs and the idle gap before each."""
    events = sorted((ev for ev in prof.events() if ev.device_type.name == "CUDA"),
                    key=lambda ev: ev.time_range.start)[-launches:]
    trace, prev_end = [], events[0].time_range.start
    for ev in events:
        trace.append({"name": _kernel_name(ev.name), "us": ev.time_range.elapsed_us(),
                      "gap_us": ev.time_range.start - prev_end})
        prev_end = ev.time_range.end
    return trace


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("preset")
    ap.add_argument("out")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prefill", type=int, default=0)
    ap.add_argument("--trace", action="store_true",
                    help="also list the last step's launches in order: start, GPU µs, gap before")
    args = ap.parse_args()
    from torch.profiler import ProfilerActivity, profile

    model = load_model(ensure_synthetic(args.preset, Console(stderr=True)), "cuda")
    step = _prefill_step(model, args) if args.prefill else _decode_step(model, args)
    for _ in range(3):  # compile + capture the decode graph
        step()
    plain_us = {}  # wall µs a step without the profiler: ids back (greedy) / logits back
    for greedy in (True, False):
        t0 = time.perf_counter()
        for _ in range(args.steps):
            step(greedy)
        plain_us["ids" if greedy else "logits"] = (time.perf_counter() - t0) / args.steps * 1e6
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            step()
    wall_us = (time.perf_counter() - t0) / args.steps * 1e6
    rows = kernel_rows(prof, args.steps)
    kernels_us = sum(r[2] for r in rows)
    result = {"preset": args.preset, "ctx": args.ctx, "batch": args.batch, "prefill": args.prefill,
              "wall_us_per_step": wall_us,
              "unprofiled_wall_us_per_step": plain_us,
              "kernel_us_per_step": kernels_us,
              "launches_per_step": sum(r[1] for r in rows),
              "kernels": [{"name": n, "per_step": c, "us_per_step": t} for n, c, t in rows],
              "raw_names": sorted({ev.name[:300] for ev in prof.events()
                                   if ev.device_type.name == "CUDA"})}
    if args.trace:
        result["trace"] = _last_step_trace(prof, int(result["launches_per_step"]))
    print(f"unprofiled wall µs a step: {plain_us}")
    print(f"step {wall_us:.0f} µs wall, kernels {kernels_us:.0f} µs, "
          f"{result['launches_per_step']:.0f} launches")
    for n, c, t in rows:
        print(f"  {t:8.1f} µs  {c:6.1f}×  {n}")
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
