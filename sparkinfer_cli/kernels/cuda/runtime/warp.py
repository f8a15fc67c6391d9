"""Warp shuffles and reductions shared by the CUDA kernels (all 32 lanes of a warp must take part).

The simulator has no warp shuffles, so under NUMBA_ENABLE_CUDASIM=1 `shfl_xor` is a Python twin that
exchanges values between the 32 simulated threads of a warp through a barrier. Reductions use the
same xor butterfly in both modes, so float results are bit-identical.
"""

from __future__ import annotations

import math

from numba import cuda, float32

from sparkinfer_cli.kernels.cuda.runtime.intrinsics import IS_SIMULATOR
from sparkinfer_cli.kernels.cuda.runtime.jit import device_function

WARP_SIZE = 32
FULL_MASK = 0xFFFFFFFF

if IS_SIMULATOR:
    from sparkinfer_cli.kernels.cuda.runtime.intrinsics import lane_id, warp_exchange

    def shfl_xor(v, offset):
        return warp_exchange(v)[lane_id() ^ offset]

else:

    @device_function
    def shfl_xor(v, offset):
        return cuda.shfl_xor_sync(FULL_MASK, v, offset)


@device_function
def warp_sum(v):
    for offset in (16, 8, 4, 2, 1):
        v += shfl_xor(v, offset)
    return v


@device_function
def warp_max(v):
    for offset in (16, 8, 4, 2, 1):
        v = max(v, shfl_xor(v, offset))
    return v


@device_function
def _block_reduce(v, scratch, is_max):
    """Sum or max over the whole block (all threads call it); scratch: float32 shared [≥ 33]."""
    warp = cuda.threadIdx.x // WARP_SIZE
    lane = cuda.threadIdx.x % WARP_SIZE
    v = warp_max(v) if is_max else warp_sum(v)
    if lane == 0:
        scratch[warp] = v
    cuda.syncthreads()
    if warp == 0:
        n_warps = cuda.blockDim.x // WARP_SIZE
        identity = float32(-math.inf) if is_max else float32(0.0)
        v = scratch[lane] if lane < n_warps else identity
        v = warp_max(v) if is_max else warp_sum(v)
        if lane == 0:
            scratch[32] = v
    cuda.syncthreads()
    total = scratch[32]
    cuda.syncthreads()  # scratch may be reused right after
    return total


@device_function
def block_sum(v, scratch):
    return _block_reduce(v, scratch, False)


@device_function
def block_max(v, scratch):
    return _block_reduce(v, scratch, True)
