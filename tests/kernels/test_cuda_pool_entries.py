"""Copying and zeroing one entry of a cache pool in every layer against numpy (simulator: tiny
pools; on the H200 with the gpu marker at a hybrid model's state-slot size)."""

from __future__ import annotations

import numpy as np
import pytest
from numba import cuda

from sparkinfer_cli.kernels.cuda import pool_entries


def _random_pool(rng, shape, dtype) -> np.ndarray:
    if np.dtype(dtype) == np.int8:
        return rng.integers(-128, 128, shape, dtype=np.int8)
    return (rng.standard_normal(shape) + 3).astype(dtype)  # never zero: a zeroed entry shows


def _check_copy_and_zero(host: np.ndarray, src: int, dst: int, zeroed: int) -> None:
    pool = cuda.to_device(host)
    flat = pool_entries.flat_pool(pool)
    pool_entries.copy_entry(flat, src, dst)
    pool_entries.zero_entry(flat, zeroed)
    expected = host.copy()
    expected[:, dst] = host[:, src]
    expected[:, zeroed] = 0
    np.testing.assert_array_equal(pool.copy_to_host(), expected)


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.int8])
def test_an_entry_is_copied_and_another_zeroed_in_every_layer(dtype, rng) -> None:
    # (layers, entries, block, heads, dims): a KV pool's shape, small
    _check_copy_and_zero(_random_pool(rng, (3, 5, 4, 2, 8), dtype), src=1, dst=4, zeroed=2)


def test_copying_an_entry_onto_itself_changes_nothing(rng) -> None:
    host = _random_pool(rng, (2, 3, 6), np.float32)
    pool = cuda.to_device(host)
    pool_entries.copy_entry(pool_entries.flat_pool(pool), 1, 1)
    np.testing.assert_array_equal(pool.copy_to_host(), host)


def test_an_entry_outside_the_pool_is_refused(rng) -> None:
    flat = pool_entries.flat_pool(cuda.to_device(_random_pool(rng, (2, 3, 6), np.float32)))
    with pytest.raises(ValueError, match="outside"):
        pool_entries.copy_entry(flat, 0, 3)
    with pytest.raises(ValueError, match="outside"):
        pool_entries.zero_entry(flat, -1)


@pytest.mark.gpu
def test_a_hybrid_state_slot_in_every_layer(rng) -> None:
    # Qwen3.6's delta state: 30 layers × (32 heads, 128, 128) floats a slot; more values than
    # the grid's threads, so the grid strides
    _check_copy_and_zero(_random_pool(rng, (30, 4, 32, 128, 128), np.float32), 0, 3, 1)
