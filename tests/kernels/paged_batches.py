"""Paged-cache attention batches for the prefill kernels' tests: query rows of several sequences
(each continuing its cached prefix), their scattered cache blocks, and a float64 reference."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numba import cuda


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


# the attention shapes of the Qwen3.6-35B-A3B and Qwen3-30B-A3B models: (n_heads, n_kv, head_dim)
REAL_SHAPES = {"qwen3.6": (16, 2, 256), "qwen3-30b": (32, 4, 128)}


def real_shape_batch(rng, n_heads: int, n_kv: int, head_dim: int) -> PagedBatch:
    """One 4,096-row pass of two sequences, one after a 1,000-token cached prefix."""
    return make_batch(rng, starts=[0, 1000], new_tokens=[1500, 2596], n_heads=n_heads,
                      n_kv=n_kv, head_dim=head_dim, block_size=16, dtype=np.float16)


def reference_rows(b: PagedBatch, rows: np.ndarray) -> np.ndarray:
    """causal_reference of the query rows `rows` only (the whole pass takes minutes)."""
    return causal_reference(PagedBatch(b.q[rows], b.k_cache, b.v_cache, b.scales, b.block_table,
                                       b.row_seq[rows], b.seq_lens[rows], b.keys, b.values))
