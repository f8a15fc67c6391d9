"""Tiled prefill attention over a paged KV cache vs a float64 causal reference and decode."""

from __future__ import annotations

from unittest import mock

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

from sparkinfer_cli.kernels.cuda import attention, attention_mma
from sparkinfer_cli.kernels.cuda.attention_prefill import prefill_attention, supports


def run_prefill(b: PagedBatch) -> np.ndarray:
    (q, k, v, table, seq_lens), row_seq, scales = b.device_args()
    out = cuda.device_array_like(q)
    prefill_attention(q, k, v, table, seq_lens, out, row_seq=row_seq, scales=scales)
    return out.copy_to_host()


def run_decode(b: PagedBatch, rows: np.ndarray) -> np.ndarray:
    """attention.py's split-K kernel on the query rows `rows` (one query row each); float32
    scores as the prefill kernel's (attention_mma's rounds q to f16)."""
    sub = PagedBatch(np.ascontiguousarray(b.q[rows]), b.k_cache, b.v_cache, b.scales,
                     b.block_table, b.row_seq[rows], b.seq_lens[rows], b.keys, b.values)
    (q, k, v, table, seq_lens), row_seq, scales = sub.device_args()
    out = cuda.device_array_like(q)
    ws = attention.DecodeWorkspace(len(rows), q.shape[1], q.shape[2], int(b.seq_lens.max()),
                                   split_len=1024)
    with mock.patch.object(attention_mma, "tensor_core_group", lambda *_: False):
        attention.paged_decode_attention(q, k, v, table, seq_lens, out, ws, row_seq=row_seq,
                                         scales=scales)
    return out.copy_to_host()


# Two sequences in one tile of query rows: one fresh, one continuing a cached prefix (its keys
# span two key tiles: the online-softmax rescaling). 2 q heads per kv head: 32 tokens a tile, all
# live; 3 q heads per kv head: 21 tokens a tile, 19 of them live, and tile row 63 idle.
@pytest.mark.parametrize("dtype, n_heads, starts, new_tokens", [
    (np.float16, 4, [0, 60], [12, 20]),
    (np.int8, 6, [0, 70], [5, 14]),
])
@pytest.mark.slow
def test_prefill_matches_causal_reference(dtype, n_heads, starts, new_tokens, rng):
    b = make_batch(rng, starts, new_tokens, n_heads=n_heads, n_kv=2, head_dim=64, block_size=16,
                   dtype=dtype)
    np.testing.assert_allclose(run_prefill(b), causal_reference(b), rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_prefill_matches_decode_kernel(rng):
    b = make_batch(rng, [0, 60], [12, 20], n_heads=4, n_kv=2, head_dim=64, block_size=16,
                   dtype=np.float16)
    rows = np.array([11, 31])  # the last token of each sequence (the decode kernel is slow here)
    np.testing.assert_allclose(run_prefill(b)[rows], run_decode(b, rows), rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("head_dim, n_heads, n_kv, message", [
    (96, 4, 2, "head_dim 96"),
    (64, 6, 4, "q heads over 4 kv heads"),
    (64, 130, 2, "at most 64 q heads"),
])
def test_prefill_rejects_unsupported_shapes(head_dim, n_heads, n_kv, message):
    q = cuda.device_array((4, n_heads, head_dim), np.float32)
    cache = cuda.device_array((2, 16, n_kv, head_dim), np.float16)
    table, lens = cuda.device_array((4, 1), np.int32), cuda.device_array(4, np.int32)
    with pytest.raises(ValueError, match=message):
        prefill_attention(q, cache, cache, table, lens, cuda.device_array_like(q))


def test_prefill_rejects_mismatched_output():
    q = cuda.device_array((4, 4, 64), np.float32)
    cache = cuda.device_array((2, 16, 2, 64), np.float16)
    table, lens = cuda.device_array((4, 1), np.int32), cuda.device_array(4, np.int32)
    with pytest.raises(ValueError, match="out: shape"):
        prefill_attention(q, cache, cache, table, lens, cuda.device_array((4, 4, 32), np.float32))


# The real shapes, one 4096-row pass of two sequences (one after a 1000-token cached prefix),
# against the decode-split kernel the model runs today and a float64 reference on sampled rows.
@pytest.mark.gpu
@pytest.mark.parametrize("shape", REAL_SHAPES)
def test_prefill_real_shapes_match_decode_kernel(shape):
    rng = np.random.default_rng(7)
    b = real_shape_batch(rng, *REAL_SHAPES[shape])
    out = run_prefill(b)
    rows = np.arange(len(b.row_seq))
    np.testing.assert_allclose(out, run_decode(b, rows), rtol=1e-4, atol=2e-5)
    sample = rng.choice(rows, 16, replace=False)
    np.testing.assert_allclose(out[sample], reference_rows(b, sample), rtol=1e-4, atol=1e-5)


def test_supports_names_the_shapes_the_kernel_takes() -> None:
    assert supports(16, 2, 256) and supports(32, 4, 128) and supports(4, 2, 64)
    assert not supports(16, 2, 80)  # head_dim outside HEAD_DIMS
    assert not supports(130, 2, 128)  # 65 q heads per kv head: more than a block's rows
