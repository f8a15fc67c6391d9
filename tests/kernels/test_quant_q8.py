"""int8 activation blocks (quant_packed.quantize_kernel) vs the Q8 rule in numpy float32: the same
quants, scales and sums bit for bit, stored in the row kernel's order (quant_packed.x_order: pairs
of records as four 32-byte vectors, a last lone record as two; each lane's block scale and quant
sum, the chunk-major sums for the offsets), from strided rows, in groups that end in a partial
chunk of rows; rows of an even and an odd number of records."""

from __future__ import annotations

import numpy as np
import pytest

from sparkinfer_cli.kernels.cpu.quant_packed import RECORD_ELEMENTS, quantize_kernel, x_order
from sparkinfer_cli.kernels.cpu.quant_q8 import Q8_BLOCK


def _rule(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """xq (T, ne0) int8, xd and xs (T, ne0 / 32) float32: d = max|x| / 127 per block, q =
    rint(x / d) in float32 (0 where d = 0), s = d · Σ q."""
    blocks = x.reshape(len(x), -1, Q8_BLOCK)
    d = (np.abs(blocks).max(axis=-1) / np.float32(127)).astype(np.float32)
    with np.errstate(invalid="ignore", divide="ignore"):
        q = np.where(d[..., None] > 0, np.rint(blocks / d[..., None]), 0).astype(np.int8)
    s = (d * q.sum(axis=-1, dtype=np.int32).astype(np.float32)).astype(np.float32)
    return q.reshape(x.shape), d, s


@pytest.mark.parametrize("rows, ne0", [(1, 64), (13, 576), (24, 1536)])
def test_quantize_kernel_is_the_q8_rule_in_the_row_kernels_order(rows: int, ne0: int,
                                                                 rng: np.random.Generator) -> None:
    wide = (rng.standard_normal((rows, ne0 + 32)) * rng.uniform(1e-3, 50, (rows, 1)))
    x = wide.astype(np.float32)[:, :ne0]  # rows ne0 + 32 floats apart
    x[0, :Q8_BLOCK] = 0  # an all-zero block: scale 0, quants 0
    x[-1, -Q8_BLOCK:] *= np.float32(1e-30)  # a block of tiny values
    n_rec, n_blocks = ne0 // RECORD_ELEMENTS, ne0 // Q8_BLOCK
    xq = np.empty((rows, ne0), np.int8)
    xd = np.empty((rows, n_rec, 8), np.float32)
    xl = np.empty((rows, n_rec, 8), np.int32)
    xs = np.empty(rows * n_blocks, np.float32)
    quantize_kernel(ne0)(x.ctypes.data, x.strides[0] // 4, rows, xq.ctypes.data, xd.ctypes.data,
                         xl.ctypes.data, xs.ctypes.data, 0, 0, 0, 0)
    q, d, s = _rule(x)
    order, lane_blocks = x_order(ne0)  # (ne0,), (lane groups, 8)
    np.testing.assert_array_equal(np.sort(order), np.arange(ne0))  # each element once
    np.testing.assert_array_equal(xq, q[:, order])
    n_groups = len(lane_blocks)
    np.testing.assert_array_equal(xd[:, :n_groups], d[:, lane_blocks])
    start = 0
    for p, blocks in enumerate(lane_blocks):  # a group: 4 vectors of 32 bytes (a pair) or 2
        n_vec = 4 if 2 * p + 1 < n_rec else 2
        lanes = order[start:start + 32 * n_vec].reshape(n_vec, 8, 4)  # (vector, lane, byte)
        assert (lanes // Q8_BLOCK == blocks[None, :, None]).all()  # a lane stays in its block
        in_lanes = xq[:, start:start + 32 * n_vec].reshape(rows, n_vec, 8, 4).astype(np.int32)
        np.testing.assert_array_equal(xl[:, p], in_lanes.sum(axis=(1, 3)))
        start += 32 * n_vec
    for lo in range(0, rows, 8):  # chunk-major: (n_blocks, the chunk's rows)
        m = min(8, rows - lo)
        np.testing.assert_array_equal(xs[lo * n_blocks:(lo + m) * n_blocks].reshape(n_blocks, m),
                                      s[lo:lo + m].T)
    assert not xq[0, order < Q8_BLOCK].any() and d[0, 0] == 0
