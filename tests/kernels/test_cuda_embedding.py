"""Device embedding lookup vs gguf.quants.dequantize of the same rows (simulator: tiny tables)."""

from __future__ import annotations

import numpy as np
import pytest
from gguf.quants import dequantize
from numba import cuda
from test_cuda_quant_gemv import random_weights

from sparkinfer_cli.gguf.ggml_types import GGMLType
from sparkinfer_cli.kernels.cuda import embedding
from sparkinfer_cli.kernels.cuda.quant_gemv import DeviceQuantMatrix
from sparkinfer_cli.kernels.cuda.runtime.launch import to_device_bytes

N_TOKENS = 5
K = 512  # two Q*_K super-blocks, 16 legacy blocks; THREADS · PIECE = 1024 > K: one block a row
QUANT_TYPES = (GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q5_0, GGMLType.Q5_1, GGMLType.Q8_0,
               GGMLType.Q4_K, GGMLType.Q5_K, GGMLType.Q6_K)


def _lookup(raw: np.ndarray, ggml_type: GGMLType, k: int, ids: list[int]) -> np.ndarray:
    w = DeviceQuantMatrix(to_device_bytes(raw), ggml_type, k, raw.shape[0])
    out = cuda.device_array((len(ids), k), np.float32)
    embedding.embed_rows(w, cuda.to_device(np.array(ids, np.int32)), out)
    return out.copy_to_host()


def assert_dequantized(got: np.ndarray, expected: np.ndarray) -> None:
    """got = gguf's float32 dequantize up to the rounding of its last operation: scale·q + shift
    in one fma or two roundings (an ulp of the larger term; f16 would be ~8000 of them)."""
    terms = np.abs(expected) + np.abs(expected).max(axis=-1, keepdims=True)
    np.testing.assert_array_less(np.abs(got - expected), 2.5e-7 * terms)


@pytest.mark.parametrize("ggml_type", QUANT_TYPES)
def test_quantized_rows_are_the_dequantized_rows_in_float32(ggml_type, rng) -> None:
    raw = random_weights(ggml_type, N_TOKENS, K, rng)
    ids = [3, 0, 4, 3]
    expected = dequantize(raw, ggml_type).reshape(N_TOKENS, K)[ids]
    got = _lookup(raw, ggml_type, K, ids)
    assert_dequantized(got, expected)
    assert not np.array_equal(got, expected.astype(np.float16).astype(np.float32))


def _bf16_bytes(x: np.ndarray) -> np.ndarray:
    return (x.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)


@pytest.mark.parametrize("ggml_type", (GGMLType.F32, GGMLType.F16, GGMLType.BF16))
def test_float_rows_are_exact_and_padding_ids_give_zero_rows(ggml_type, rng) -> None:
    k = 40  # not a whole number of 16-element pieces
    table = rng.standard_normal((N_TOKENS, k)).astype(np.float32)  # (tokens, k)
    raw = {GGMLType.F32: lambda: table.view(np.uint8),
           GGMLType.F16: lambda: table.astype(np.float16).view(np.uint8),
           GGMLType.BF16: lambda: _bf16_bytes(table)}[ggml_type]()
    values = dequantize(raw, ggml_type).reshape(N_TOKENS, k)  # the exact stored values
    got = _lookup(raw, ggml_type, k, [4, -1, 1])
    np.testing.assert_array_equal(got[[0, 2]], values[[4, 1]])
    assert not got[1].any()
    assert np.abs(got[[0, 2]] - table[[4, 1]]).max() <= 0.01 * np.abs(table).max()


def test_tables_without_a_device_lookup_are_refused(rng) -> None:
    raw = random_weights(GGMLType.IQ4_XS, N_TOKENS, 256, rng)
    with pytest.raises(ValueError, match="IQ4_XS"):
        _lookup(raw, GGMLType.IQ4_XS, 256, [0])


@pytest.mark.gpu
@pytest.mark.parametrize("ggml_type, n_tokens", [
    (GGMLType.Q4_K, 151936),  # Qwen3-30B token_embd (the anchors' Q4_K_M)
    (GGMLType.Q6_K, 248320),  # Qwen3.6 tied / output-sized table
    (GGMLType.Q8_0, 32768),  # quantized from floats: a smaller table
])
def test_real_tables_a_prefill_of_rows(ggml_type, n_tokens, rng) -> None:
    """2048-wide rows of a vocabulary-sized table, 4096 ids (a prefill pass) with padding."""
    raw = random_weights(ggml_type, n_tokens, 2048, rng)
    ids = rng.integers(0, n_tokens, 4096).astype(np.int32)
    ids[-5:] = -1
    got = _lookup(raw, ggml_type, 2048, ids.tolist())
    live = ids[ids >= 0]
    expected = dequantize(raw[live], ggml_type).reshape(len(live), 2048)
    assert_dequantized(got[ids >= 0], expected)
    assert not got[ids < 0].any()
