"""One core's time of the CPU int8 row kernel (kernels/cpu/quant_packed.py) per weight type and
number of x rows, on a matrix that stays in the core's caches (the kernel's compute, not DRAM).

    PYTHONPATH=. python bench/probes/cpu_row_kernel_bench.py [--json OUT.json]

A/B against another tree: run it with that tree's package first on PYTHONPATH, alternating the
two a few times (a shared VM moves these figures by ±10 % from run to run). Each case: the best
of REPEATS calls of row_kernel(layout, n) over ROWS rows (one thread, no parallel_calls), x
quantized once by the same module's quantize_kernel.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from sparkinfer_cli.gguf.ggml_types import BLOCK_GEOMETRY, GGMLType, row_bytes
from sparkinfer_cli.gguf.synthetic import random_blocks
from sparkinfer_cli.kernels.cpu import quant_packed as qp
from sparkinfer_cli.kernels.cpu.packed_matvec import _SCRATCH

ROWS = 1024  # rows of the matrix: 0.6-1.1 MB of records, in L2
REPEATS = 50
# (type, ne0): Qwen2.5-Coder's K-quant rows (1,024: 16 records), SmolLM2's (576: 9 records, so a
# row ends with a record alone)
CASES = [(GGMLType.Q4_K, 1024), (GGMLType.Q6_K, 1024), (GGMLType.Q8_0, 1024),
         (GGMLType.Q4_1, 576), (GGMLType.Q8_0, 576)]
X_ROWS = (1, 4, 8)


def time_case(t: GGMLType, ne0: int, n: int, rng: np.random.Generator) -> float:
    """Best seconds of one call of the row kernel: ROWS weight rows × n x rows."""
    n_blocks = ROWS * ne0 // BLOCK_GEOMETRY[t][0]
    raw = random_blocks(t, n_blocks, rng).reshape(ROWS, row_bytes(t, ne0))
    w = qp.pack(raw, t, ne0)
    x = rng.standard_normal((n, ne0)).astype(np.float32)
    plan = _SCRATCH.plan(n, ne0)
    qp.quantize_kernel(ne0)(x.ctypes.data, ne0, n, *plan.buffers, 0, 0, 0, 0)
    out = np.empty((n, ROWS), np.float32)
    kernel = qp.row_kernel(w.layout, n)
    args = (w.records.ctypes.data, w.records.shape[1], *plan.chunks[0].pointers,
            ne0 // qp.RECORD_ELEMENTS, 0, ROWS, out.ctypes.data, ROWS)
    kernel(*args)
    best = float("inf")
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        kernel(*args)
        best = min(best, time.perf_counter() - t0)
    if not np.isfinite(out).all():
        raise SystemExit(f"{t.name}: non-finite outputs")
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="also write the figures here")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    results = []
    for t, ne0 in CASES:
        for n in X_ROWS:
            s = time_case(t, ne0, n, rng)
            gmacs = ROWS * ne0 * n / s / 1e9
            results.append({"type": t.name, "ne0": ne0, "x_rows": n, "us": s * 1e6,
                            "gmac_s": gmacs})
            print(f"{t.name:5} ne0 {ne0:5}  {n} x rows  {s * 1e6:8.1f} µs  {gmacs:6.1f} GMAC/s",
                  flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
