"""Token embeddings gathered on the device from the GGUF table: out[r] = dequantize(W[ids[r]]).

With the lookup on the device a pass's only per-token input is its token ids, so a decode step can
take the previous step's argmax ids straight from device memory (CudaModel.decode_greedy).
Quantized rows are dequantized 16 elements a thread from the tensor-core GEMM's block decoders
(mma_gemm.dequant_codes) in float32, the values gguf's dequantize (and llama.cpp's get_rows)
gives: rounded to f16 (~5e-4 relative) they moved the first layer's q8 activations a step
against llama.cpp's wherever a value sat that close to a rounding boundary. F32 / F16 / BF16 rows
are read exactly. A row id < 0 (a padding row) gives a zero row.
"""

from __future__ import annotations

import functools

import numpy as np
from numba import cuda, float32

from sparkinfer_cli.gguf.ggml_types import GGMLType
from sparkinfer_cli.kernels.cuda import mma_gemm
from sparkinfer_cli.kernels.cuda import quant_gemv as qg
from sparkinfer_cli.kernels.cuda.runtime.intrinsics import (
    bits_to_f32,
    chain_start,
    f16_bits_to_f32,
    ld_u16,
    ld_u32,
)
from sparkinfer_cli.kernels.cuda.runtime.jit import kernel
from sparkinfer_cli.kernels.cuda.runtime.launch import cdiv, check_array

PIECE = 16  # elements a thread writes
THREADS = 64


def supports(ggml_type: int, k: int) -> bool:
    """Whether embed_rows reads a table of this type and row length: a float type (rows of
    whole 16 bytes, as DeviceQuantMatrix takes them), or one the tensor-core GEMM stages."""
    if ggml_type in qg.FLOAT_TYPES:
        return k % 8 == 0
    return mma_gemm.dequant_codes(ggml_type) is not None and k % PIECE == 0


@functools.cache
def _float_kernel(ggml_type: GGMLType):
    width = 4 if ggml_type == GGMLType.F32 else 2  # bytes an element
    is_f16 = ggml_type == GGMLType.F16  # else BF16 when width is 2

    @kernel
    def embed_float(w, row_bytes, k, ids, out):
        chain_start()
        row, e0 = cuda.blockIdx.y, (cuda.blockIdx.x * THREADS + cuda.threadIdx.x) * PIECE
        if e0 < k:
            token = ids[row]
            for e in range(e0, min(e0 + PIECE, k)):
                value = float32(0.0)
                if token >= 0:
                    at = token * row_bytes + width * e
                    if width == 4:
                        value = bits_to_f32(ld_u32(w, at))
                    elif is_f16:
                        value = f16_bits_to_f32(ld_u16(w, at))
                    else:
                        value = bits_to_f32(ld_u16(w, at) << 16)
                out[row * k + e] = value
    return embed_float


@functools.cache
def _quant_kernel(ggml_type: GGMLType):
    codes = mma_gemm.dequant_codes(ggml_type)

    @kernel
    def embed_quant(w, row_bytes, k, ids, out):
        chain_start()
        row, e0 = cuda.blockIdx.y, (cuda.blockIdx.x * THREADS + cuda.threadIdx.x) * PIECE
        if e0 < k:
            token = ids[row]
            at = row * k + e0
            if token < 0:
                for e in range(PIECE):
                    out[at + e] = float32(0.0)
            else:
                q, scale, shift = codes(w, token * row_bytes, e0)  # 16 byte codes, in order
                for i in range(4):
                    for b in range(4):
                        out[at + 4 * i + b] = scale * float32((q[i] >> (8 * b)) & 0xFF) + shift
    return embed_quant


def embed_rows(w: qg.DeviceQuantMatrix, ids, out, stream=0) -> None:
    """out (n, k) f32 ← row ids[r] of the table w (n_rows tokens × k), zero where ids[r] < 0.
    ids: int32 device array (n,), each < w.n_rows."""
    check_array("ids", ids, np.int32)
    check_array("out", out, np.float32, (ids.size, w.k))
    if not supports(w.ggml_type, w.k):
        raise ValueError(f"no device embedding lookup for {w.ggml_type.name} rows of {w.k}")
    kernel = _float_kernel(w.ggml_type) if w.ggml_type in qg.FLOAT_TYPES else \
        _quant_kernel(w.ggml_type)
    grid = (cdiv(cdiv(w.k, PIECE), THREADS), ids.size)
    kernel[grid, THREADS, stream](w.data, w.row_bytes, w.k, ids, out.reshape(out.size))
