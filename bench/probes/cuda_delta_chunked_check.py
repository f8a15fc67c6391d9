"""The chunked Gated DeltaNet kernels against the float64 reference at given head shapes, on the
device: the relative error and where the bad elements sit (rows, value heads, columns).

    python bench/probes/cuda_delta_chunked_check.py [--shape H_K,H_V,DK,DV,ROWS ...]

Default shapes: the tiny hybrid fixtures' (2 k / 4 v heads of 64) with both head maps, Qwen3.6's
(16 / 32 of 128) and a small one. One sequence of ROWS rows from a zero state; an element is bad
when it is off by more than 1 % of the largest output. The kernel tests bound the same error;
this says where it comes from when they fail.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
from numba import cuda

sys.path.insert(0, str(Path(__file__).parents[2] / "tests" / "kernels"))
from test_cuda_gated_delta_chunked import _chunked_pass, _prepared, _reference  # noqa: E402

from sparkinfer_cli.kernels.cuda import gated_delta_chunked as gdc  # noqa: E402

DEFAULT_SHAPES = ("2,4,64,64,300", "16,32,128,128,300", "1,2,32,64,80")


def check(n_k: int, n_v: int, dk: int, dv: int, rows: int, head_map_mod: bool) -> None:
    rng = np.random.default_rng(3)
    u, log_decay, beta, q, k, v = _prepared(rng, rows, n_k, n_v, dk, dv)
    state = np.zeros((2, n_v, dv, dk), np.float32)
    slots, lo, n = [0, 1], [0, rows], [rows, 0]
    out = cuda.to_device(np.full((rows, n_v, dv), 7, np.float32))
    scratch = np.full((rows, n_v, gdc.scratch_cols(dk, dv)), np.nan, np.float32)
    gdc.delta_rule_chunked(*(cuda.to_device(x) for x in (u, log_decay, beta)),
                           cuda.to_device(state),
                           *(cuda.to_device(np.asarray(x, np.int32)) for x in (slots, lo, n)),
                           out, _chunked_pass(scratch, lo, n, gdc.CHUNK), n_k_heads=n_k,
                           head_map_mod=head_map_mod)
    ref, _ = _reference(q, k, v, log_decay, beta, state, slots, lo, n, head_map_mod)
    got = out.copy_to_host()
    err = np.abs(got - ref)
    print(f"heads {n_k}/{n_v} dk {dk} dv {dv} rows {rows} mod {head_map_mod}: relative "
          f"{np.linalg.norm(got - ref) / np.linalg.norm(ref):.2e}, worst "
          f"{err.max() / np.abs(ref).max():.2e}, non-finite {(~np.isfinite(got)).sum()}",
          flush=True)
    bad = np.argwhere(err > 0.01 * np.abs(ref).max())
    if len(bad):
        print(f"  {len(bad)} bad: rows {np.unique(bad[:, 0])[:24]}, heads "
              f"{np.unique(bad[:, 1])}, columns {np.unique(bad[:, 2])[:24]}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", action="append", help="H_K,H_V,DK,DV,ROWS (repeatable)")
    for shape in ap.parse_args().shape or DEFAULT_SHAPES:
        n_k, n_v, dk, dv, rows = map(int, shape.split(","))
        for head_map_mod in (False, True):
            check(n_k, n_v, dk, dv, rows, head_map_mod)


if __name__ == "__main__":
    main()
