"""CPU quant kernels against the oracles: gguf.quants.dequantize (bit-exact) and float64 numpy."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from sparkinfer_cli.gguf.ggml_types import BLOCK_GEOMETRY, GGMLType, row_bytes
from sparkinfer_cli.gguf.reader import GGUFFile
from sparkinfer_cli.kernels.cpu.quant import (
    FUSED_MAX_TOKENS,
    SUPPORTED_TYPES,
    dequantize,
    embedding_rows,
    matmul,
)

TYPES = sorted(GGMLType(t) for t in SUPPORTED_TYPES)
# byte offsets of the fp16 scale fields (d, and dmin / m where present) inside one block
_SCALE_OFFSETS = {
    GGMLType.Q4_0: (0,), GGMLType.Q4_1: (0, 2), GGMLType.Q5_0: (0,), GGMLType.Q5_1: (0, 2),
    GGMLType.Q8_0: (0,), GGMLType.IQ4_NL: (0,), GGMLType.Q4_K: (0, 2), GGMLType.Q5_K: (0, 2),
    GGMLType.Q6_K: (208,), GGMLType.IQ4_XS: (0,),
}
NE0 = 512  # two 256-superblocks, sixteen 32-blocks


def random_raw(t: GGMLType, lead_shape: tuple[int, ...], ne0: int,
               rng: np.random.Generator) -> np.ndarray:
    """Random valid tensor data as GGUFFile.raw returns it: random quant bytes, fp16 scales that
    are finite, nonzero and of either sign; F32/F16/BF16 as normal values."""
    if t in (GGMLType.F32, GGMLType.F16, GGMLType.BF16):
        values = rng.standard_normal((*lead_shape, ne0)).astype(np.float32)
        if t == GGMLType.F32:
            return values
        if t == GGMLType.F16:
            return values.astype(np.float16)
        return (values.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    block, size = BLOCK_GEOMETRY[t]
    n_blocks = int(np.prod(lead_shape)) * (ne0 // block)
    raw = rng.integers(0, 256, (n_blocks, size), dtype=np.uint8)
    for off in _SCALE_OFFSETS[t]:
        scale = rng.uniform(1e-3, 0.1, n_blocks) * rng.choice([-1, 1], n_blocks)
        raw[:, off:off + 2] = scale.astype(np.float16).view(np.uint8).reshape(n_blocks, 2)
    return raw.reshape(*lead_shape, row_bytes(t, ne0))


def gguf_dequantize(raw: np.ndarray, t: GGMLType) -> np.ndarray:
    return gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(int(t)))


def assert_bit_equal(actual: np.ndarray, expected: np.ndarray) -> None:
    assert actual.dtype == np.float32 and actual.shape == expected.shape
    bad = actual.view(np.uint32) != expected.astype(np.float32).view(np.uint32)
    assert not bad.any(), f"{bad.sum()} of {bad.size} values differ, first at {np.argwhere(bad)[0]}"


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_dequantize_bit_exact_on_3d_tensor(t: GGMLType, rng: np.random.Generator) -> None:
    raw = random_raw(t, (3, 5), NE0, rng)  # like an expert tensor (n_expert, rows, row_bytes)
    out = dequantize(raw, int(t), NE0)
    assert out.shape == (3, 5, NE0)
    assert_bit_equal(out, gguf_dequantize(raw, t))


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("num_tokens", [1, 3, 37])  # fused kernel (1, 3) and tile + BLAS (37)
def test_matmul_matches_float64_reference(t: GGMLType, num_tokens: int,
                                          rng: np.random.Generator) -> None:
    raw = random_raw(t, (70,), NE0, rng)
    w = gguf_dequantize(raw, t).astype(np.float64)  # (rows, ne0)
    x = rng.standard_normal((num_tokens, NE0)).astype(np.float32)
    out = matmul(raw, int(t), NE0, x)
    assert out.shape == (num_tokens, 70) and out.dtype == np.float32
    ref = x.astype(np.float64) @ w.T
    scale = np.abs(x).astype(np.float64) @ np.abs(w).T  # what float32 rounding is relative to
    err = np.abs(out - ref) / scale
    assert err.max() < 1e-5, f"max relative error {err.max():.3g}"


def test_matmul_paths_agree_at_the_switch(rng: np.random.Generator) -> None:
    t = GGMLType.Q4_K
    raw = random_raw(t, (40,), NE0, rng)
    x = rng.standard_normal((FUSED_MAX_TOKENS + 1, NE0)).astype(np.float32)
    tiled = matmul(raw, int(t), NE0, x)  # BLAS path
    fused = np.stack([matmul(raw, int(t), NE0, x[i:i + 1])[0] for i in range(len(x))])
    np.testing.assert_allclose(fused, tiled, rtol=1e-4, atol=1e-4 * np.abs(tiled).max())


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_embedding_rows_match_gguf(t: GGMLType, rng: np.random.Generator) -> None:
    raw = random_raw(t, (50,), NE0, rng)
    ids = np.array([7, 0, 49, 7, 23])
    out = embedding_rows(raw, int(t), NE0, ids)
    assert_bit_equal(out, gguf_dequantize(raw, t)[ids])


def test_unsupported_type_is_named() -> None:
    raw = np.zeros((2, row_bytes(GGMLType.Q2_K, 256)), np.uint8)
    with pytest.raises(ValueError, match="Q2_K"):
        dequantize(raw, int(GGMLType.Q2_K), 256)
    with pytest.raises(ValueError, match="Q3_K"):
        x = np.zeros((1, 256), np.float32)
        matmul(np.zeros((2, 110), np.uint8), int(GGMLType.Q3_K), 256, x)


def test_bad_shapes_raise_value_error() -> None:
    raw = np.zeros((2, 34 * 8), np.uint8)  # Q8_0 rows of 256
    with pytest.raises(ValueError, match="ne0=512"):
        dequantize(raw, int(GGMLType.Q8_0), 512)
    with pytest.raises(ValueError, match=r"x must be"):
        matmul(raw, int(GGMLType.Q8_0), 256, np.zeros((1, 128), np.float32))
    with pytest.raises(ValueError, match=r"\[0, 2\)"):
        embedding_rows(raw, int(GGMLType.Q8_0), 256, np.array([2]))


def test_every_tensor_of_tiny_qwen3_q4_k_m(fixtures_dir: Path) -> None:
    f = GGUFFile(fixtures_dir / "tiny" / "qwen3" / "qwen3-Q4_K_M.gguf")
    kinds = set()
    for info in f.tensors.values():
        raw = f.raw(info.name)
        assert_bit_equal(dequantize(raw, info.ggml_type, info.shape[0]),
                         gguf_dequantize(np.asarray(raw), GGMLType(info.ggml_type)))
        kinds.add(info.type_name)
    assert {"Q4_K", "Q6_K"} <= kinds, kinds  # the file really exercises the K-quants
