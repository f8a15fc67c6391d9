"""Device functions that read GGUF quant blocks, shared by quant_gemv (dp4a GEMV) and mma_gemm
(tensor-core GEMM): f16 fields, K-quant scales/mins, 4-word loads at any 2-byte offset, nibble
and bit masks."""

from __future__ import annotations

from sparkinfer_cli.kernels.cuda.runtime.intrinsics import (
    f16_bits_to_f32,
    funnel_shift_r,
    ld_u16,
    ld_u32,
)
from sparkinfer_cli.kernels.cuda.runtime.jit import device_function

M4 = 0x0F0F0F0F
M1 = 0x01010101
M2 = 0x03030303


@device_function
def f16(u):
    return f16_bits_to_f32(u & 0xFFFF)


@device_function
def u32_from_u16s(w, off):
    """A 32-bit word at a 2-byte-aligned offset (GGUF blocks of 18/22/34/210 bytes)."""
    return ld_u16(w, off) | (ld_u16(w, off + 2) << 16)


@device_function
def spread4(bits):
    """4 bits → bit 0 of each of 4 bytes (multiply-and-mask; the shifted copies never overlap)."""
    return (bits * 0x00204081) & M1


@device_function
def scale_min_pair_k4(c, s0, s1, s2):
    """6-bit (scale, min) of sub-blocks 2c and 2c+1 from the 12 packed bytes s0|s1|s2
    (get_scale_min_k4 for a pair at once, branch-free: c differs between a warp's lanes)."""
    shift = 16 * (c & 1)
    a, b, d = s0 >> shift, s1 >> shift, s2 >> shift
    high = c >= 2  # sub-blocks 4..7: low 4 bits in s2, top 2 bits from the top of s0 / s1 bytes
    sc = ((d & 0x0F0F) | ((a >> 2) & 0x3030)) if high else a & 0x3F3F
    mn = (((d >> 4) & 0x0F0F) | ((b >> 2) & 0x3030)) if high else b & 0x3F3F
    return sc & 0xFF, (sc >> 8) & 0xFF, mn & 0xFF, (mn >> 8) & 0xFF


@device_function
def scale_min_k4(j, s0, s1, s2):
    """6-bit (scale, min) of sub-block j from the 12 packed bytes s0|s1|s2 (get_scale_min_k4)."""
    sc_lo, sc_hi, m_lo, m_hi = scale_min_pair_k4(j >> 1, s0, s1, s2)
    return (sc_hi, m_hi) if j & 1 else (sc_lo, m_lo)


@device_function
def words4_aligned(w, off):
    """4 consecutive u32 words at a 4-aligned byte offset."""
    return ld_u32(w, off), ld_u32(w, off + 4), ld_u32(w, off + 8), ld_u32(w, off + 12)


@device_function
def words4_unaligned(w, off):
    """4 consecutive u32 words at a 2-aligned byte offset: 5 aligned loads + funnel shifts.

    NOTE: may read up to 4 bytes past off + 16 (to_device_bytes pads buffers by 16 bytes).
    """
    base = off - (off & 3)
    shift = (off & 3) * 8
    a0, a1, a2 = ld_u32(w, base), ld_u32(w, base + 4), ld_u32(w, base + 8)
    a3, a4 = ld_u32(w, base + 12), ld_u32(w, base + 16)
    return (funnel_shift_r(a0, a1, shift), funnel_shift_r(a1, a2, shift),
            funnel_shift_r(a2, a3, shift), funnel_shift_r(a3, a4, shift))
