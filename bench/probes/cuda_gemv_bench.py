"""GPU time of the MoE expert GEMVs (one per slot, slot_mat = expert ids) and of batch-1 GEMVs.

    PYTHONPATH=. python bench/probes/cuda_gemv_bench.py [--json OUT.json]   (repo root, on a GPU)

Each case is a CUDA graph of REPEATS launches, replayed REPLAYS times between two CUDA events;
launches rotate over weight copies totalling ≥ ROTATE_BYTES (> the 50 MB L2) so every call streams
its weights from HBM. GB/s counts the weight bytes a call must read: the distinct experts its slots
select (both matrices of a fused gate+up), or the whole matrix. Shapes: Qwen3.6-35B-A3B (256
experts, top-8, n_embd 2048, expert ff 512, vocab 248,320).

Why expert GEMVs are not grouped by expert: on the H200 (2026-11-30) at 512 slots, GEMVs per
expert tile of 8 / 4 slots took 473 / 281 µs vs 222 per slot (Q4_K gate+up), 245 / 181 vs 171 (Q5_K
down), 348 / 273 vs 266 (Q6_K down); at 8 slots 20.9 vs 5.8 µs: a slot's expert re-read hits L2.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable

import numpy as np
from numba import cuda

from sparkinfer_cli.gguf.ggml_types import GGMLType, row_bytes
from sparkinfer_cli.kernels.cuda import mma_gemm as mg
from sparkinfer_cli.kernels.cuda import mmq_q8 as mmq
from sparkinfer_cli.kernels.cuda import quant_gemv as qg
from sparkinfer_cli.kernels.cuda.runtime import graphs
from sparkinfer_cli.kernels.cuda.runtime.launch import to_device_bytes

REPEATS, REPLAYS = 50, 3
ROTATE_BYTES = 256 << 20
EXPERTS, TOP_K = 256, 8
# (name, type, k, rows, fused gate+up, activations per slot (down) rather than per token)
EXPERT_CASES = [
    ("gate+up exps (SwiGLU)", GGMLType.Q4_K, 2048, 512, True, False),
    ("down exps", GGMLType.Q5_K, 512, 2048, False, True),
    ("down exps", GGMLType.Q6_K, 512, 2048, False, True),
]
PLAIN_CASES = [(t, k, n) for t in (GGMLType.Q4_K, GGMLType.Q5_K, GGMLType.Q6_K, GGMLType.Q8_0)
               for k, n in ((2048, 4096), (4096, 2048))] + [(GGMLType.Q6_K, 2048, 248320),
                                                            (GGMLType.Q8_0, 2048, 12352)]
# 64 decoding sequences: the Gated DeltaNet input projection (qkv + z + a + b) and an attention
# output projection (GB/s: the matrix once; each group of 8 tokens reads it again)
BATCH_64_CASES = [(GGMLType.Q8_0, 2048, 12352), (GGMLType.Q8_0, 4096, 2048),
                  (GGMLType.Q6_K, 4096, 2048)]


def gpu_us(launch: Callable[[object, int], None], stream) -> float:
    """Mean GPU µs of launch(stream, i) over REPLAYS × REPEATS launches captured in one graph."""
    launch(stream, 0)  # compiles, and allocates nothing during the capture
    stream.synchronize()
    graph = graphs.capture(lambda s: [launch(s, i) for i in range(REPEATS)], stream)
    graph.replay()
    start, end = cuda.event(), cuda.event()
    start.record(stream)
    for _ in range(REPLAYS):
        graph.replay()
    end.record(stream)
    end.synchronize()
    graph.close()
    return cuda.event_elapsed_time(start, end) * 1e3 / (REPLAYS * REPEATS)


def weight_copies(ggml_type: GGMLType, k: int, n_rows: int, n_mats: int,
                  rng) -> list[qg.DeviceQuantMatrix]:
    """Enough device copies of one random matrix (random bytes: timing ignores their values)."""
    n_bytes = n_mats * n_rows * row_bytes(ggml_type, k)
    # bytes in [1, 0x20): every f16 scale field lies in (0, 0.008), so outputs stay finite
    host = rng.integers(1, 0x20, n_bytes, dtype=np.uint8)  # (n_bytes,)
    n_copies = min(64, -(-ROTATE_BYTES // n_bytes))
    return [qg.DeviceQuantMatrix(to_device_bytes(host), ggml_type, k, n_rows, n_mats)
            for _ in range(n_copies)]


def random_activations(n_groups: int, k: int, rng, stream,
                       n_cols: int = 1) -> qg.QuantizedActivations:
    act = qg.QuantizedActivations(n_groups, n_cols, k)
    x = rng.standard_normal((n_groups, n_cols, k)).astype(np.float32)  # (n_groups, n_cols, k)
    qg.quantize_activations(cuda.to_device(x, stream=stream), act, stream=stream)
    return act


def top_k_ids(n_tokens: int, rng) -> np.ndarray:
    """(n_tokens·TOP_K,) int32: each token picks TOP_K distinct experts uniformly."""
    return np.concatenate([rng.choice(EXPERTS, TOP_K, replace=False)
                           for _ in range(n_tokens)]).astype(np.int32)


def expert_row(case, n_tokens: int, rng, stream) -> dict:
    name, ggml_type, k, n_rows, fused, x_per_slot = case
    n_slots = n_tokens * TOP_K
    ids = top_k_ids(n_tokens, rng)
    gates = weight_copies(ggml_type, k, n_rows, EXPERTS, rng)
    ups = weight_copies(ggml_type, k, n_rows, EXPERTS, rng) if fused else [None] * len(gates)
    pairs = list(zip(gates, ups))
    act = random_activations(n_slots if x_per_slot else n_tokens, k, rng, stream)
    slot_x = cuda.to_device((np.arange(n_slots) // (1 if x_per_slot else TOP_K)).astype(np.int32))
    ids_dev = cuda.to_device(ids)
    y = cuda.device_array((n_slots, 1, n_rows), np.float32)  # (slots, 1, rows)

    def launch(s, i):
        w, up = pairs[i % len(pairs)]
        qg.gemv(w, act, y, slot_mat=ids_dev, slot_x=slot_x, up=up, stream=s)

    touched = len(np.unique(ids)) * n_rows * row_bytes(ggml_type, k) * (1 + fused)
    label = f"{name} {ggml_type.name} k={k} rows={n_rows}, {n_slots} slots"
    return _row(f"{label}: per-slot gemv", gpu_us(launch, stream), touched)


def plain_row(ggml_type: GGMLType, k: int, n_rows: int, rng, stream,
              n_tokens: int = 1) -> dict:
    """A dense linear over n_tokens tokens: groups of ≤ MAX_COLS columns, one slot each (as the
    model's Workspace.linear runs it)."""
    mats = weight_copies(ggml_type, k, n_rows, 1, rng)
    cols = min(n_tokens, qg.MAX_COLS)
    groups = n_tokens // cols
    act = random_activations(groups, k, rng, stream, cols)
    y = cuda.device_array((groups, cols, n_rows), np.float32)  # (groups, cols, rows)
    slot_mat = cuda.to_device(np.zeros(groups, np.int32))
    slot_x = cuda.to_device(np.arange(groups, dtype=np.int32))
    us = gpu_us(lambda s, i: qg.gemv(mats[i % len(mats)], act, y, slot_mat=slot_mat,
                                     slot_x=slot_x, stream=s), stream)
    return _row(f"batch-{n_tokens} gemv {ggml_type.name} k={k} rows={n_rows}", us,
                n_rows * row_bytes(ggml_type, k))


def mma_row(ggml_type: GGMLType, k: int, n_rows: int, rng, stream, n_tokens: int,
            split: bool) -> dict:
    """The same dense linear as a tensor-core GEMM (as Workspace.linear runs it from
    LINEAR_MMA_MIN_ROWS tokens), k split over the grid (split) or not."""
    mats = weight_copies(ggml_type, k, n_rows, 1, rng)
    x = cuda.to_device(rng.standard_normal((n_tokens, k), np.float32), stream=stream)
    y = cuda.device_array((n_tokens, n_rows), np.float32)
    partials = None
    if split:
        partials = cuda.device_array(max(1, mg.partials_size(mats[0], n_tokens)), np.float32)
    us = gpu_us(lambda s, i: mg.matmul(mats[i % len(mats)], x, y, partials=partials, stream=s),
                stream)
    splits = mg.k_splits(mats[0], n_tokens) if split else 1
    return _row(f"batch-{n_tokens} mma {ggml_type.name} k={k} rows={n_rows} ({splits} k ranges)",
                us, n_rows * row_bytes(ggml_type, k))


def mmq_row(k: int, n_rows: int, rng, stream, n_tokens: int) -> dict:
    """A Q8_0 dense linear on int8 tensor cores over q8 activations (mmq_q8, as Workspace.linear
    runs it), k split as mmq_q8.k_splits says."""
    mats = weight_copies(GGMLType.Q8_0, k, n_rows, 1, rng)
    cols = qg.MAX_COLS
    act = random_activations(n_tokens // cols, k, rng, stream, cols)
    y = cuda.device_array((n_tokens, n_rows), np.float32)
    size = mmq.partials_size(mats[0], n_tokens)
    partials = cuda.device_array(size, np.float32) if size else None
    us = gpu_us(lambda s, i: mmq.matmul(mats[i % len(mats)], act, y, partials=partials,
                                        stream=s), stream)
    splits = mmq.k_splits(mats[0], n_tokens)
    return _row(f"batch-{n_tokens} mmq Q8_0 k={k} rows={n_rows} ({splits} k ranges)", us,
                n_rows * row_bytes(GGMLType.Q8_0, k))


def batch_rows(rng, stream) -> list[dict]:
    """The BATCH_64_CASES at 32 and 64 tokens: GEMVs against the tensor-core GEMMs."""
    rows = []
    for t, k, n in BATCH_64_CASES:
        for n_tokens in (32, 64):
            rows.append(plain_row(t, k, n, rng, stream, n_tokens=n_tokens))
            rows += [mma_row(t, k, n, rng, stream, n_tokens, split) for split in (True, False)]
            if t == GGMLType.Q8_0:
                rows.append(mmq_row(k, n, rng, stream, n_tokens))
    return rows


def _row(name: str, us: float, n_bytes: int) -> dict:
    row = {"case": name, "us": us, "gb_s": n_bytes / us / 1e3}
    print(f"{name:72s} {us:9.2f} µs {row['gb_s']:8.0f} GB/s", flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", help="also write the rows here")
    parser.add_argument("--batch-only", action="store_true",
                        help="only the 32/64-token dense linears (GEMV vs tensor cores)")
    args = parser.parse_args()
    rng, stream = np.random.default_rng(0), cuda.stream()
    print(f"{'case':72s} {'GPU time':>12s} {'weights':>13s}")
    rows = batch_rows(rng, stream)
    if args.batch_only:
        _write(rows, args.json)
        return
    rows += [expert_row(case, n_tokens, rng, stream)
             for n_tokens in (64, 1) for case in EXPERT_CASES]
    rows += [plain_row(t, k, n, rng, stream) for t, k, n in PLAIN_CASES]
    _write(rows, args.json)


def _write(rows: list[dict], path: str | None) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
