"""Unpacking ggml weights into int8 quants + float32 scales: lossless against
gguf.quants.dequantize (quant_packed's records are built from these unpackers)."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
from quant_samples import N_ROWS, NE0, random_weight

from sparkinfer_cli.gguf.ggml_types import GGMLType
from sparkinfer_cli.kernels.cpu.quant_repack import REPACK_TYPES, repack

TYPES = sorted(GGMLType(t) for t in REPACK_TYPES)


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_repack_is_lossless(t: GGMLType, rng: np.random.Generator) -> None:
    raw = random_weight(t, rng)
    w = repack(raw, t, NE0)
    want = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(t))
    got = w.q.reshape(N_ROWS, -1, w.group).astype(np.float32) * w.d[:, :, None]
    if w.m.shape[1]:
        got = got + w.m[:, :, None]
    np.testing.assert_array_equal(got.reshape(N_ROWS, NE0).view(np.uint32), want.view(np.uint32))
    assert np.array_equal(w.dequantize(), want)
    assert w.q.dtype == np.int8 and w.d.dtype == w.m.dtype == np.float32


def test_rejects_bad_input(rng: np.random.Generator) -> None:
    raw = random_weight(GGMLType.Q8_0, rng)
    with pytest.raises(ValueError, match="ggml types"):
        repack(raw, int(GGMLType.IQ4_NL), NE0)
    with pytest.raises(ValueError, match="raw must be"):
        repack(raw[:, :-1], GGMLType.Q8_0, NE0)
