"""What a short kernel costs on the GPU before its work: empty kernels and dependent-load chains,
then the decode attention's kernels at the Qwen3-30B shape (graphs of launches, µs a call).

    PYTHONPATH=. python bench/cuda_launch_floor_probe.py      (on the GPU)
"""

from __future__ import annotations

import numpy as np
from numba import cuda

from bench.cuda_decode_attention_bench import make_case, time_variant
from bench.cuda_gemv_bench import gpu_us
from sparkinfer_cli.kernels.cuda import attention, attention_mma


@cuda.jit
def _empty(out):
    if cuda.threadIdx.x == 1 << 20:
        out[0] = 1


@cuda.jit
def _chain(buf, n, out):
    # n dependent loads: i = buf[i]
    i = cuda.threadIdx.x
    for _ in range(n):
        i = buf[i]
    out[cuda.threadIdx.x] = i


def main() -> None:
    stream = cuda.stream()
    out = cuda.device_array(1024, np.int32)
    for blocks, threads in ((1, 32), (132, 128), (1024, 128)):
        us = gpu_us(lambda s, i: _empty[blocks, threads, s](out), stream)
        print(f"empty kernel {blocks:5d} × {threads:4d}: {us:6.2f} µs", flush=True)
    rng = np.random.default_rng(0)
    perm = cuda.to_device(rng.permutation(1 << 16).astype(np.int32))
    for n in (0, 1, 4, 16):
        us = gpu_us(lambda s, i: _chain[1, 32, s](perm, n, out), stream)
        print(f"chain of {n:2d} dependent loads (64K-int table): {us:6.2f} µs", flush=True)
    for ctx in (16, 512, 4096):
        case = make_case("qwen3-30b", 1, ctx, rng, stream)
        for n_splits in (None, 1, 8):
            us, err = time_variant(case, n_splits, 0, ctx, stream)
            print(f"gqa+merge ctx {ctx:5d} splits {n_splits or 'auto'}: {us:6.2f} µs "
                  f"(err {err:.1e})", flush=True)
    print(f"SPLIT_BLOCKS {attention_mma.SPLIT_BLOCKS}, CHUNK {attention.CHUNK}")


if __name__ == "__main__":
    main()
