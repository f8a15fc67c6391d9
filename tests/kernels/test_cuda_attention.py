"""CUDA split-K decode attention over a paged KV cache vs float64 numpy."""

from __future__ import annotations

import numpy as np
import pytest
from numba import cuda

from sparkinfer_cli.kernels.cuda import attention


@pytest.mark.parametrize("block_size, n_kv, head_dim, n_heads, lens, split_len", [
    (8, 1, 32, 2, (19, 5), 12),
    (8, 1, 32, 1, (300, 130), 256),  # several CHUNKs per split: the online-softmax rescaling
    pytest.param(16, 2, 256, 16, (3000, 700), 512, marks=pytest.mark.gpu),  # Qwen3.6 attention
])
def test_paged_decode_matches_reference(block_size, n_kv, head_dim, n_heads, lens, split_len):
    rng = np.random.default_rng(6)
    per_seq = -(-max(lens) // block_size)
    n_blocks = 2 * per_seq
    block_table = rng.permutation(n_blocks).astype(np.int32).reshape(2, per_seq)  # scattered
    seq_lens = np.array(lens, np.int32)
    positions = [(s, p) for s in range(2) for p in range(seq_lens[s])]
    slots = np.array([block_table[s, p // block_size] * block_size + p % block_size
                      for s, p in positions], np.int32)
    k = rng.standard_normal((len(slots), n_kv, head_dim)).astype(np.float32)
    v = rng.standard_normal((len(slots), n_kv, head_dim)).astype(np.float32)
    k_cache, v_cache = (cuda.to_device(paged_cache(x, slots, n_blocks, block_size))
                        for x in (k, v))
    q = rng.standard_normal((2, n_heads, head_dim)).astype(np.float32)
    out = cuda.device_array_like(q)
    ws = attention.DecodeWorkspace(2, n_heads, head_dim, max(lens) + 5, split_len)
    attention.paged_decode_attention(cuda.to_device(q), k_cache, v_cache,
                                     cuda.to_device(block_table), cuda.to_device(seq_lens), out, ws)
    ref = attention.paged_decode_attention_reference(q, k_cache.copy_to_host(),
                                                     v_cache.copy_to_host(), block_table, seq_lens)
    np.testing.assert_allclose(out.copy_to_host(), ref, rtol=1e-4, atol=1e-5)


def paged_cache(x: np.ndarray, slots: np.ndarray, n_blocks: int, block_size: int,
                dtype=np.float16) -> np.ndarray:
    """A (n_blocks, block_size, n_kv, d) cache: token i's x at row slots[i], zeros elsewhere."""
    cache = np.zeros((n_blocks * block_size, *x.shape[1:]), dtype)
    cache[slots] = x
    return cache.reshape(n_blocks, block_size, *x.shape[1:])


def test_int8_cache_attends_like_its_dequantized_values():
    from sparkinfer_cli.kernels.cuda.quant_gemv import quantize_q8_reference

    rng = np.random.default_rng(10)
    block_size, n_kv, head_dim, n_heads, lens = 4, 1, 64, 2, (11, 6)  # small: the simulator
    per_seq = -(-max(lens) // block_size)
    block_table = rng.permutation(2 * per_seq).astype(np.int32).reshape(2, per_seq)
    rows = [block_table[s, p // block_size] * block_size + p % block_size
            for s in range(2) for p in range(lens[s])]
    caches, scales, dequantized = [], [], []
    for _ in range(2):  # K, V
        x = rng.standard_normal((len(rows), n_kv, head_dim)).astype(np.float32)
        q8, d, _ = quantize_q8_reference(x)
        caches.append(cuda.to_device(paged_cache(q8, np.array(rows), 2 * per_seq, block_size,
                                                 np.int8)))
        scales.append(cuda.to_device(paged_cache(d, np.array(rows), 2 * per_seq, block_size,
                                                 np.float32)))
        deq = (q8.reshape(*d.shape, 32) * d[..., None]).reshape(x.shape)
        dequantized.append(paged_cache(deq, np.array(rows), 2 * per_seq, block_size, np.float32))
    q = rng.standard_normal((2, n_heads, head_dim)).astype(np.float32)
    out = cuda.device_array_like(q)
    ws = attention.DecodeWorkspace(2, n_heads, head_dim, 16, 16)
    seq_lens = np.array(lens, np.int32)
    attention.paged_decode_attention(cuda.to_device(q), *caches, cuda.to_device(block_table),
                                     cuda.to_device(seq_lens), out, ws, scales=scales)
    ref = attention.paged_decode_attention_reference(q, *dequantized, block_table, seq_lens)
    np.testing.assert_allclose(out.copy_to_host(), ref, rtol=1e-4, atol=1e-5)
