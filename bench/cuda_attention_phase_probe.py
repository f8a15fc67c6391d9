"""Where the tensor-core decode attention's time goes at short contexts: the kernel rebuilt with
one phase replaced by a no-op at a time (outputs are then wrong; only the time counts), Qwen3-30B
shape, batch 1 (graphs of launches, µs a call of scan + merge).

    PYTHONPATH=. python bench/cuda_attention_phase_probe.py [--resident]      (on the GPU)
"""

from __future__ import annotations

import argparse

import numpy as np
from numba import cuda

from bench.cuda_decode_attention_bench import make_case, time_variant
from sparkinfer_cli.kernels.cuda import attention_mma as am
from sparkinfer_cli.kernels.cuda.jit import device_function


@device_function
def _no_pv(acc, v, v_cache, row_sh, rbase, p_sh, pbase, dim0, per_lane, group):
    pass


@device_function
def _no_merge(acc, m_run, l_run, ml_sh, acc_sh, row0, split, n_splits, group, head_dim,
              per_lane, part_m, part_l, part_acc):
    pass


@device_function
def _no_stage_q(q, row0, group, scale, head_dim, q_sh, q_words):
    pass


@device_function
def _no_scores(k_cache, row_sh, rbase, head_dim, k_sh, kbase, k_words, q_sh, q_words):
    return np.float32(0.0), np.float32(0.0), np.float32(0.0), np.float32(0.0)


@device_function
def _no_load_v(v, v_cache, row_sh, rbase, j0, dim0, words):
    pass


@device_function
def _no_scan(q_sh, q_words, k_cache, v_cache, block_table, table, block_size, n_kv, kv_head,
             head_dim, group, start, end, row_sh, k_sh, k_words, p_sh, corr_sh, acc, m_run,
             l_run):
    pass


@device_function
def _rows_without_table(row_sh, base, block_table, table, block_size, n_kv, kv_head, head_dim, k0,
                        start, end):
    lane = cuda.threadIdx.x % 32
    if lane < am.TILE_KEYS:
        t = max(min(k0 + lane, end - 1), start)
        row_sh[base + lane] = (t * n_kv + kv_head) * head_dim


VARIANTS = {"baseline": {}, "no block-table load": {"_key_rows": _rows_without_table},
            "no P·V": {"_add_pv": _no_pv}, "no V loads": {"_load_v": _no_load_v},
            "no warp merge": {"_merge_warps": _no_merge}, "no q staging": {"_stage_q": _no_stage_q},
            "no scores": {"_scores": _no_scores}, "no scan": {"_scan_tiles": _no_scan},
            "no scan, no warp merge": {"_scan_tiles": _no_scan, "_merge_warps": _no_merge}}


CALLERS = ("_scores", "_add_pv", "_scan_tiles")  # device functions that call patched ones


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--resident", action="store_true",
                        help="one K/V copy, L2-resident after the first call (default: copies "
                             "rotated over ≥ 256 MB, as bench/cuda_decode_attention_bench.py)")
    args = parser.parse_args()
    rng, stream = np.random.default_rng(0), cuda.stream()
    cases = {ctx: make_case("qwen3-30b", 1, ctx, rng, stream) for ctx in (16, 512)}
    if args.resident:
        for case in cases.values():
            case["kv"] = case["kv"][:1]
    originals = {name: getattr(am, name) for patch in VARIANTS.values() for name in patch}
    for label, patch in VARIANTS.items():
        for name, fn in originals.items():
            setattr(am, name, patch.get(name, fn))
        for name in CALLERS:  # fresh dispatchers: a compiled caller keeps the callees it saw
            if name not in patch:
                setattr(am, name, device_function(originals[name].py_func))
        am.gqa_kernel.cache_clear()
        times = [time_variant(case, None, 0, ctx, stream)[0] for ctx, case in cases.items()]
        print(f"{label:24s} ctx 16: {times[0]:6.2f} µs   ctx 512: {times[1]:6.2f} µs", flush=True)


if __name__ == "__main__":
    main()
