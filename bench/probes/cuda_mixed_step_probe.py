"""What a step that carries a prefill costs on the GPU, against a decode step and a lone prefill.

    python bench/probes/cuda_mixed_step_probe.py <preset> OUT.json [--decodes 0 64]
        [--prompts 16 128 512]
        [--profile 64:128] [--split 1]

For each (D decodes, P prompt tokens): the first pass (compile / capture, if any) and the median of
later passes of one forward_greedy over D sequences at position ~CTX plus one prompt of P tokens at
position 0, split into host time until the GPU work is queued and total time. --profile D:P also
lists that pass's kernels (CUPTI through PyTorch's profiler, as cuda_kernel_profile.py).
--split K: the P prompt tokens are K prompts of P / K tokens each, as a burst of clients sends them
to the batched scheduler.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
from rich.console import Console

sys.path.insert(0, str(Path(__file__).parent))
from cuda_kernel_profile import kernel_rows  # noqa: E402

from sparkinfer_cli.bench.runner import ensure_synthetic  # noqa: E402
from sparkinfer_cli.model.batch import SequenceBatch  # noqa: E402
from sparkinfer_cli.model.loader import load_model  # noqa: E402

CTX = 130  # tokens each decoding sequence already holds
REPEATS = 5
BLOCK = 16  # tokens a KV block


class MixedPasses:
    """A cache with max_decodes decoding sequences (prefilled once) and `split` prompt slots."""

    def __init__(self, model, max_decodes: int, split: int = 1, max_piece: int = 2048):
        self.model, self.rng, self.split = model, np.random.default_rng(0), split
        n = max_decodes + split
        per_seq = -(-(max(max_piece, CTX) + 1) // BLOCK)  # blocks a sequence may fill
        self.cache = model.create_cache(n * per_seq, BLOCK, n)
        self.tables = [np.arange(per_seq, dtype=np.int32) + i * per_seq
                       for i in range(n)]  # the last `split`: the prompts'
        self.first_prompt_slot = max_decodes
        for i in range(max_decodes):
            self.model.forward(SequenceBatch.single(self._ids(CTX), 0, self.tables[i], i),
                               self.cache)

    def _ids(self, n: int) -> np.ndarray:
        return self.rng.integers(0, self.model.config.n_vocab, n).astype(np.int32)  # (n,)

    def batch(self, decodes: int, prompt: int) -> SequenceBatch:
        """decodes sequences one token on, then (prompt > 0) `split` prompts from position 0."""
        piece = prompt // self.split
        seqs = [(1, CTX, i) for i in range(decodes)] + \
            [(piece, 0, self.first_prompt_slot + j) for j in range(self.split) if piece]
        lens, starts, slots = (list(x) for x in zip(*seqs))
        return SequenceBatch(self._ids(sum(lens)), starts, lens,
                             [self.tables[i] for i in slots], slots)

    def timed(self, decodes: int, prompt: int) -> dict:
        times = self.model.times
        runs = []
        for _ in range(REPEATS + 1):
            host0, n0 = sum(times.host_s.values()), sum(times.steps.values())
            t0 = time.perf_counter()
            self.model.forward_greedy(self.batch(decodes, prompt), self.cache)
            runs.append((time.perf_counter() - t0, sum(times.host_s.values()) - host0))
            assert sum(times.steps.values()) == n0 + 1
        later = runs[1:]
        return {"decodes": decodes, "prompt": prompt, "first_ms": runs[0][0] * 1e3,
                "median_ms": statistics.median(r[0] for r in later) * 1e3,
                "host_ms": statistics.median(r[1] for r in later) * 1e3}


def kernel_table(model, passes: MixedPasses, decodes: int, prompt: int) -> list[dict]:
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(REPEATS):
            model.forward_greedy(passes.batch(decodes, prompt), passes.cache)
    return [{"name": n, "per_step": c, "us_per_step": t}
            for n, c, t in kernel_rows(prof, REPEATS)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("preset")
    ap.add_argument("out")
    ap.add_argument("--decodes", type=int, nargs="+", default=[0, 64])
    ap.add_argument("--prompts", type=int, nargs="+", default=[16, 128, 512, 2048])
    ap.add_argument("--profile", default="64:128")
    ap.add_argument("--split", type=int, default=1)
    args = ap.parse_args()
    t0 = time.perf_counter()
    model = load_model(ensure_synthetic(args.preset, Console(stderr=True)), "cuda")
    print(f"loaded in {time.perf_counter() - t0:.1f} s", flush=True)
    passes = MixedPasses(model, max(args.decodes), args.split, max(args.prompts) // args.split)
    results = []
    for decodes in args.decodes:
        for prompt in [0, *args.prompts] if decodes else args.prompts:
            r = passes.timed(decodes, prompt)
            results.append(r)
            print(f"D={decodes:3d} P={prompt:5d}: first {r['first_ms']:8.1f} ms, then "
                  f"{r['median_ms']:7.2f} ms (host {r['host_ms']:6.2f} ms)", flush=True)
    d, p = (int(x) for x in args.profile.split(":"))
    kernels = kernel_table(model, passes, d, p)
    print(f"kernels of D={d} P={p}: {sum(k['us_per_step'] for k in kernels):.0f} µs")
    for k in kernels[:25]:
        print(f"  {k['us_per_step']:9.1f} µs {k['per_step']:6.1f}×  {k['name']}")
    Path(args.out).write_text(json.dumps({"preset": args.preset, "ctx": CTX, "split": args.split,
                                          "passes": results,
                                          "profile": {"decodes": d, "prompt": p,
                                                      "kernels": kernels}}, indent=1))


if __name__ == "__main__":
    main()
