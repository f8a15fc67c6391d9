"""Device functions shared by the tensor-core kernels: one mma into an accumulator array, the int8
mma's sums as floats, and the GEMMs' block tile, k range and output epilogue."""

from __future__ import annotations

import math

import numpy as np
from numba import cuda, float32

from sparkinfer_cli.kernels.cuda.runtime.intrinsics import (
    bits_to_f32,
    fma_f32,
    mma_f16_f32,
    mma_s8_s32,
)
from sparkinfer_cli.kernels.cuda.runtime.jit import device_function

# The int8 GEMMs scale each k32 step's s32 sums by per-block floats, so every sum becomes a float.
# A conversion (I2F) issues at 16 lanes a clock an SM, an eighth of an FMA's rate; with the scale
# product it took 3 instructions a sum. A sum of 32 products of int8 values lies within ±2^22, so
# an mma whose accumulators start at the bits of the float B = 1.5·2^23 returns the bits of
# B + sum, and fma(B + sum, scale, −B·scale) is sum·scale rounded once: −B·scale is exact for a
# scale of ≤ 22 significant bits (B has 2), as an f16 block scale, or one times a 6-bit
# sub-block scale, has.
_S32_BIAS = np.int32(0x4B400000)  # the bits of float32 B = 12582912.0
_F32_BIAS = float32(12582912.0)


@device_function(numba_inline=True)
def mma_into(acc, i, a, b0, b1):
    """acc[i..i+3] += A (a: 4 f16x2 fragment registers) · B (b0, b1) for one m16n8k16 tile."""
    d = mma_f16_f32(a[0], a[1], a[2], a[3], b0, b1, acc[i], acc[i + 1], acc[i + 2], acc[i + 3])
    acc[i] = d[0]
    acc[i + 1] = d[1]
    acc[i + 2] = d[2]
    acc[i + 3] = d[3]


@device_function(numba_inline=True)
def mma_s8_biased(a, b0, b1):
    """One m16n8k32 int8 tile A (a: 4 registers) · B (b0, b1): its 4 s32 sums, each biased so that
    scaled_sum reads it without a conversion."""
    return mma_s8_s32(a[0], a[1], a[2], a[3], b0, b1, _S32_BIAS, _S32_BIAS, _S32_BIAS, _S32_BIAS)


@device_function(numba_inline=True)
def sum_offset(scale):
    """The third operand of scaled_sum for this scale (≤ 22 significant bits): −B·scale, exact."""
    return -_F32_BIAS * scale


@device_function(numba_inline=True)
def scaled_sum(c, scale, offset):
    """One of mma_s8_biased's sums times scale, rounded once (offset = sum_offset(scale)): an
    FMA."""
    return fma_f32(bits_to_f32(c), scale, offset)


@device_function(numba_inline=True)
def gemm_epilogue(v, up, swiglu, bias, has_bias, row):
    """An output from its sums: silu(gate)·up with SwiGLU, plus the bias."""
    if swiglu:
        v = v / (float32(1.0) + math.exp(-v)) * up
    if has_bias:
        v += bias[row]
    return v


@device_function(numba_inline=True)
def block_tile(grouped, bn, n_tok, tile_expert, tile_lo, tile_hi):
    """This block's tokens (first slot, how many, weight matrix): route tile blockIdx.y of a
    grouped GEMM, else the dense GEMM's bn-token tile blockIdx.y."""
    if grouped:
        lo = tile_lo[cuda.blockIdx.y]
        return lo, tile_hi[cuda.blockIdx.y] - lo, tile_expert[cuda.blockIdx.y]
    lo = cuda.blockIdx.y * bn
    return lo, min(bn, n_tok - lo), 0


@device_function(numba_inline=True)
def k_range(n_steps):
    """This block's k steps [s0, s1): range blockIdx.z of gridDim.z (split-K; one range
    otherwise)."""
    n_splits = cuda.gridDim.z
    return cuda.blockIdx.z * n_steps // n_splits, (cuda.blockIdx.z + 1) * n_steps // n_splits
