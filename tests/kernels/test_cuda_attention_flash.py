"""Tensor-core prefill attention (attention_flash) vs a float64 causal reference and the float32
tiled kernel it replaces for F16 caches."""

from __future__ import annotations

import numpy as np
import pytest
from numba import cuda
from paged_batches import (
    REAL_SHAPES,
    PagedBatch,
    causal_reference,
    make_batch,
    real_shape_batch,
    reference_rows,
)

from sparkinfer_cli.kernels.cuda.attention_flash import flash_prefill_attention, supports
from sparkinfer_cli.kernels.cuda.attention_prefill import prefill_attention

# q·scale and P are rounded to f16 on their way into the tensor cores (as llama.cpp's flash
# attention rounds them): with unit-normal q, k, v an output is off by up to ~1e-3
TOL = {"rtol": 2e-3, "atol": 2e-3}


def run(kernel, b: PagedBatch) -> np.ndarray:
    (q, k, v, table, seq_lens), row_seq, _ = b.device_args()
    out = cuda.device_array_like(q)
    kernel(q, k, v, table, seq_lens, out, row_seq=row_seq)
    return out.copy_to_host()


# Two sequences in one block's rows (one block: the simulator runs each mma as a warp-wide
# exchange): one fresh, one continuing a cached prefix whose keys span two key tiles (the
# online-softmax rescaling across tiles). 8 q heads per kv head: 8 tokens a block; 2 per kv head:
# 32 tokens a block, one sequence ending and the next starting inside it.
@pytest.mark.parametrize("head_dim, n_heads, n_kv, starts, new_tokens", [
    (128, 8, 1, [0, 70], [5, 2]),
    (128, 2, 1, [0, 60], [20, 9]),
    (256, 8, 1, [0, 40], [3, 4]),
])
@pytest.mark.slow
def test_flash_prefill_matches_causal_reference(head_dim, n_heads, n_kv, starts, new_tokens,
                                                rng):
    b = make_batch(rng, starts, new_tokens, n_heads=n_heads, n_kv=n_kv, head_dim=head_dim,
                   block_size=16, dtype=np.float16)
    np.testing.assert_allclose(run(flash_prefill_attention, b), causal_reference(b), **TOL)


def test_flash_prefill_refuses_what_it_does_not_take():
    q = cuda.device_array((4, 4, 128), np.float32)
    table, lens = cuda.device_array((4, 1), np.int32), cuda.device_array(4, np.int32)
    int8_cache = cuda.device_array((2, 16, 2, 128), np.int8)
    with pytest.raises(ValueError, match="f16 cache"):
        flash_prefill_attention(q, int8_cache, int8_cache, table, lens,
                                cuda.device_array_like(q))
    assert supports(32, 4, 128, np.float16) and supports(16, 2, 256, np.float16)
    assert not supports(32, 4, 64, np.float16)  # head_dim outside its tiles
    assert not supports(12, 4, 128, np.float16)  # 3 q heads a kv head: 64 rows do not split
    assert not supports(32, 4, 128, np.int8)


# The real shapes, one 4096-row pass of two sequences (one after a 1000-token cached prefix),
# against the float32 kernel and a float64 reference on sampled rows.
@pytest.mark.gpu
@pytest.mark.parametrize("shape", REAL_SHAPES)
def test_flash_prefill_real_shapes(shape):
    rng = np.random.default_rng(11)
    b = real_shape_batch(rng, *REAL_SHAPES[shape])
    out = run(flash_prefill_attention, b)
    np.testing.assert_allclose(out, run(prefill_attention, b), **TOL)
    sample = rng.choice(len(b.row_seq), 16, replace=False)
    np.testing.assert_allclose(out[sample], reference_rows(b, sample), **TOL)
