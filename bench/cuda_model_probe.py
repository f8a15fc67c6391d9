"""Decode / prefill timings of the CUDA model on a synthetic preset (F2's probe; prints JSON)."""
import json
import statistics
import sys
import time

import numpy as np
from numba import cuda
from rich.console import Console

from sparkinfer_cli.bench import ensure_synthetic
from sparkinfer_cli.model.batch import SequenceBatch
from sparkinfer_cli.model.loader import load_model

preset, out = sys.argv[1], sys.argv[2]
console = Console(stderr=True)
t0 = time.time()
path = ensure_synthetic(preset, console)
t1 = time.time()
model = load_model(path, "cuda")
t2 = time.time()
cfg, rng, res = model.config, np.random.default_rng(0), {"preset": preset}
res.update(device=cuda.get_current_device().name.decode() if isinstance(
    cuda.get_current_device().name, bytes) else str(cuda.get_current_device().name),
    write_s=t1 - t0, load_s=t2 - t1, weight_bytes=model.weight_bytes)
print(json.dumps(res), flush=True)


def run(n_seqs, prompt, steps):
    per_seq = -(-(prompt + steps + 1) // 16)
    cache = model.create_cache(n_seqs * per_seq, 16, n_seqs)
    tables = [np.arange(i * per_seq, (i + 1) * per_seq, dtype=np.int32) for i in range(n_seqs)]
    group = max(1, 4096 // prompt)
    parts, ts = [], time.perf_counter()
    for lo in range(0, n_seqs, group):
        seqs = list(range(lo, min(n_seqs, lo + group)))
        ids = rng.integers(0, cfg.n_vocab, len(seqs) * prompt).astype(np.int32)
        batch = SequenceBatch(ids, [0] * len(seqs), [prompt] * len(seqs),
                              [tables[i] for i in seqs], seqs)
        parts.append(model.forward(batch, cache))
    logits = np.concatenate(parts)
    prefill_s = time.perf_counter() - ts
    times = []
    h0 = dict(model.times.host_s), dict(model.times.steps)
    for s in range(steps):
        tok = logits.argmax(axis=1).astype(np.int32)
        b = SequenceBatch(tok, [prompt + s] * n_seqs, [1] * n_seqs, tables, list(range(n_seqs)))
        ts = time.perf_counter()
        logits = model.forward(b, cache)
        times.append(time.perf_counter() - ts)
    host = (model.times.host_s["decode"] - h0[0]["decode"]) / max(
        model.times.steps["decode"] - h0[1]["decode"], 1)
    step = statistics.median(times[3:])
    r = dict(n_seqs=n_seqs, prompt=prompt, prefill_tok_s=n_seqs * prompt / prefill_s,
             decode_ms_per_step=step * 1e3, decode_tok_s=n_seqs / step,
             host_us_per_step=host * 1e6, first_steps_ms=[t * 1e3 for t in times[:3]])
    print(json.dumps(r), flush=True)
    res.setdefault("runs", []).append(r)
    del cache


run(1, 512, 64)
for n in (8, 32, 64):
    run(n, 128, 32)
run(1, 4096, 16)
json.dump(res, open(out, "w"), indent=1)
