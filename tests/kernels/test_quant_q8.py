"""int8 activation blocks (quant_q8.quantize_rows) vs llama.cpp's rule in float64 numpy."""

from __future__ import annotations

import numpy as np

from sparkinfer_cli.kernels.cpu.quant_q8 import Q8_BLOCK, quantize_rows


def test_quantize_rows_matches_the_q8_rule(rng: np.random.Generator) -> None:
    x = (rng.standard_normal((3, 4 * Q8_BLOCK)) * [[1.0], [1e-3], [50.0]]).astype(np.float32)
    x[1, :Q8_BLOCK] = 0.0  # an all-zero block: scale 0, quants 0
    xq = np.empty(x.shape, np.int8)
    xd, xs = (np.empty((3, 4), np.float32) for _ in range(2))
    quantize_rows(x, xq, xd, xs)
    blocks = x.astype(np.float64).reshape(3, 4, Q8_BLOCK)
    d = np.abs(blocks).max(axis=-1) / 127  # (3, 4)
    q = np.where(d[..., None] > 0, np.rint(blocks / np.where(d > 0, d, 1)[..., None]), 0)
    np.testing.assert_allclose(xd, d, rtol=1e-6)
    assert np.abs(xq.reshape(q.shape) - q).max() <= 1  # float32 division may round a .5 tie
    assert (xq.reshape(q.shape) != q).mean() < 0.01
    np.testing.assert_allclose(xs, xd * xq.reshape(q.shape).sum(-1), rtol=1e-6)
    assert not xq[1, :Q8_BLOCK].any() and xd[1, 0] == 0
