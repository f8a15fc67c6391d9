"""Tiled prefill attention over a paged KV cache vs a float64 causal reference and decode."""

from __future__ import annotations

from dataclasses import dataclass
from unittest import mock

import numpy as np
import pytest
from numba import cuda

from sparkinfer_cli.kernels.cuda import attention, attention_mma
from sparkinfer_cli.kernels.cuda.attention_prefill import prefill_attention, supports


@dataclass
class PagedBatch:
    """Query rows of several sequences (each continuing its cached prefix) and their paged cache."""

    q: np.ndarray  # (rows, n_heads, head_dim) f32
    k_cache: np.ndarray  # (blocks, block_size, n_kv, head_dim) f16 / f32 / int8
    v_cache: np.ndarray
    scales: tuple | None  # (k, v) f32 (blocks, block_size, n_kv, head_dim / 32) for int8
    block_table: np.ndarray  # (seqs, blocks per seq) int32, shuffled
    row_seq: np.ndarray  # (rows,) int32
    seq_lens: np.ndarray  # (rows,) int32 = position + 1
    keys: list  # per sequence: dequantized (length, n_kv, head_dim) float64
    values: list

    def device_args(self):
        dev = [cuda.to_device(x) for x in (self.q, self.k_cache, self.v_cache, self.block_table,
                                           self.seq_lens)]
        scales = None if self.scales is None else tuple(cuda.to_device(s) for s in self.scales)
        return dev, cuda.to_device(self.row_seq), scales


def quantize_q8(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """int8 per 32 values with d = max|x| / 127 (the cache's scheme), and d."""
    blocks = x.reshape(*x.shape[:-1], -1, 32)  # (..., D / 32, 32)
    d = (np.abs(blocks).max(axis=-1) / 127).astype(np.float32)  # (..., D / 32)
    q8 = np.round(blocks / np.where(d > 0, d, 1)[..., None]).astype(np.int8)
    return q8.reshape(x.shape), d


def make_batch(rng, starts, new_tokens, n_heads, n_kv, head_dim, block_size, dtype) -> PagedBatch:
    lens = [s + n for s, n in zip(starts, new_tokens)]
    per_seq = -(-max(lens) // block_size)
    n_blocks = len(lens) * per_seq + 1
    block_table = rng.permutation(n_blocks)[:len(lens) * per_seq].astype(np.int32)
    block_table = block_table.reshape(len(lens), per_seq)  # scattered blocks
    caches = [np.zeros((n_blocks, block_size, n_kv, head_dim), dtype) for _ in range(2)]
    scale_arrays = [np.zeros((n_blocks, block_size, n_kv, head_dim // 32), np.float32)
                    for _ in range(2)]
    dense: list[list] = [[], []]
    for s, length in enumerate(lens):
        pos = np.arange(length)
        blk, off = block_table[s, pos // block_size], pos % block_size
        for c in range(2):  # K, V
            x = rng.standard_normal((length, n_kv, head_dim)).astype(np.float32)
            if dtype == np.int8:
                q8, d = quantize_q8(x)
                caches[c][blk, off], scale_arrays[c][blk, off] = q8, d
                x = (q8.reshape(*d.shape, 32) * d[..., None].astype(np.float64)).reshape(x.shape)
            else:
                caches[c][blk, off] = x
            dense[c].append(caches[c][blk, off].astype(np.float64) if dtype != np.int8 else x)
    row_seq = np.repeat(np.arange(len(lens)), new_tokens).astype(np.int32)
    seq_lens = np.concatenate([np.arange(s, s + n) + 1 for s, n in zip(starts, new_tokens)])
    q = rng.standard_normal((len(row_seq), n_heads, head_dim)).astype(np.float32)
    return PagedBatch(q, *caches, tuple(scale_arrays) if dtype == np.int8 else None, block_table,
                      row_seq, seq_lens.astype(np.int32), *dense)


def causal_reference(b: PagedBatch) -> np.ndarray:
    """float64 softmax(scale·q·kᵀ)·v of each row over its sequence's first seq_lens[r] tokens."""
    n_rows, n_heads, head_dim = b.q.shape
    group = n_heads // b.k_cache.shape[2]
    out = np.zeros(b.q.shape)
    for r in range(n_rows):
        keys = b.keys[b.row_seq[r]][:b.seq_lens[r]]  # (L, n_kv, head_dim)
        vals = b.values[b.row_seq[r]][:b.seq_lens[r]]
        for h in range(n_heads):
            z = keys[:, h // group] @ b.q[r, h].astype(np.float64) / np.sqrt(head_dim)
            p = np.exp(z - z.max())
            out[r, h] = p @ vals[:, h // group] / p.sum()
    return out


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
def test_prefill_matches_causal_reference(dtype, n_heads, starts, new_tokens, rng):
    b = make_batch(rng, starts, new_tokens, n_heads=n_heads, n_kv=2, head_dim=64, block_size=16,
                   dtype=dtype)
    np.testing.assert_allclose(run_prefill(b), causal_reference(b), rtol=1e-4, atol=1e-5)


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
@pytest.mark.parametrize("n_heads, n_kv, head_dim", [(16, 2, 256), (32, 4, 128)],
                         ids=["qwen3.6", "qwen3-30b"])
def test_prefill_real_shapes_match_decode_kernel(n_heads, n_kv, head_dim):
    rng = np.random.default_rng(7)
    b = make_batch(rng, starts=[0, 1000], new_tokens=[1500, 2596], n_heads=n_heads, n_kv=n_kv,
                   head_dim=head_dim, block_size=16, dtype=np.float16)
    out = run_prefill(b)
    rows = np.arange(len(b.row_seq))
    np.testing.assert_allclose(out, run_decode(b, rows), rtol=1e-4, atol=2e-5)
    sample = rng.choice(rows, 16, replace=False)
    ref = causal_reference(PagedBatch(b.q[sample], b.k_cache, b.v_cache, None, b.block_table,
                                      b.row_seq[sample], b.seq_lens[sample], b.keys, b.values))
    np.testing.assert_allclose(out[sample], ref, rtol=1e-4, atol=1e-5)


def test_supports_names_the_shapes_the_kernel_takes() -> None:
    assert supports(16, 2, 256) and supports(32, 4, 128) and supports(4, 2, 64)
    assert not supports(16, 2, 80)  # head_dim outside HEAD_DIMS
    assert not supports(130, 2, 128)  # 65 q heads per kv head: more than a block's rows
