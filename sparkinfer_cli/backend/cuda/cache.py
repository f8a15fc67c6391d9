"""CudaModelCache: the paged KV pool and recurrent-state pool of a CUDA model, on the device.

Same contract as model/cache.py's ModelCache (block tables, state slots, copy/reset), plus one
scratch block and one scratch state slot past the engine's range: the padding rows of a decode
graph's batch-size bucket write and read there, never in a block or slot the engine owns.

Each kind of buffer is one pool over all layers of its kind, (layers, ...), which the model's
kernels read through per-layer views. K/V per attention layer: (num_blocks + 1, block_size, n_kv,
head_dim), in one of two pool types: FloatKVPool (f16; f32 for exact runs, as the CPU cache and the
oracle fixtures keep it) or Int8KVPool (int8 with a float32 scale per 32 values,
SPARKINFER_KV_INT8); conv state per GDN layer (slots + 1, conv_dim, K − 1) f32; delta state
(slots + 1, H_v, d_v, d_k) f32 (value column j, key index i contiguous: transposed from the CPU
cache's (H_v, d_k, d_v)).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
from numba import cuda
from numba.cuda.cudadrv.driver import device_memset

from sparkinfer_cli.kernels.cuda import pool_entries
from sparkinfer_cli.kernels.cuda.runtime.intrinsics import IS_SIMULATOR
from sparkinfer_cli.model.config import ModelConfig


def _pool(n_layers: int, entry_shape: tuple[int, ...], dtype) -> Any:
    """A zeroed pool (n_layers, *entry_shape), or None without layers of its kind."""
    return device_zeros((n_layers, *entry_shape), dtype) if n_layers else None


def _layers(pool, n_layers: int) -> list:
    """The per-layer views of a pool ([] for None)."""
    return [pool[i] for i in range(n_layers)] if pool is not None else []


def device_zeros(shape: tuple[int, ...], dtype) -> Any:  # a numba device array
    arr = cuda.device_array(shape, dtype)
    if IS_SIMULATOR:  # the simulator's arrays are numpy arrays
        arr[...] = 0
    else:
        device_memset(arr, 0, arr.nbytes)
    return arr


class PoolShape(NamedTuple):
    """The geometry of a cache's pools that a pass's inputs are laid out by (workspace.py)."""
    num_blocks: int
    block_size: int
    scratch_block: int  # past the engine's blocks: where padding rows write
    scratch_slot: int  # past the engine's state slots: the padding rows' recurrent state

    @property
    def max_context(self) -> int:
        """The longest sequence the pool can hold (all blocks)."""
        return self.num_blocks * self.block_size


class KVLayer(NamedTuple):
    """One attention layer's cache as the kernels take it."""
    k: Any
    v: Any
    scales: tuple | None  # (k_scales, v_scales) of an int8 cache


class FloatKVPool:
    """K and V of every attention layer as floats (float16, or float32 for exact runs)."""

    def __init__(self, n_layers: int, kv_shape: tuple[int, ...], dtype):
        self.pools = [_pool(n_layers, kv_shape, dtype) for _ in range(2)]
        self.k, self.v = (_layers(p, n_layers) for p in self.pools)

    def layer(self, i: int) -> KVLayer:
        return KVLayer(self.k[i], self.v[i], None)


class Int8KVPool:
    """K and V of every attention layer as int8 with a float32 scale per 32 values: half of
    float16's memory."""

    def __init__(self, n_layers: int, kv_shape: tuple[int, ...]):
        scale_shape = (*kv_shape[:3], kv_shape[3] // 32)
        self.pools = [_pool(n_layers, kv_shape, np.int8) for _ in range(2)] + \
            [_pool(n_layers, scale_shape, np.float32) for _ in range(2)]
        self.k, self.v, self.k_scales, self.v_scales = (_layers(p, n_layers) for p in self.pools)

    def layer(self, i: int) -> KVLayer:
        return KVLayer(self.k[i], self.v[i], (self.k_scales[i], self.v_scales[i]))


class CudaModelCache:
    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int, num_state_slots: int,
                 kv_dtype=np.float16, stream=0):
        if num_blocks < 1 or block_size < 1:
            raise ValueError("a model cache needs at least one block of at least one token")
        self.config = config
        self.num_blocks, self.block_size = num_blocks, block_size
        self.num_state_slots = num_state_slots
        self.scratch_block, self.scratch_slot = num_blocks, num_state_slots
        kv_shape = (num_blocks + 1, block_size, config.n_head_kv, config.head_dim)
        self.attn_index = {layer: i for i, layer in enumerate(config.attention_layers)}
        self.rec_index = {layer: i for i, layer in enumerate(config.recurrent_layer_ids)}
        K, C, H_v = config.ssm_conv_kernel, config.ssm_conv_dim, config.ssm_n_v_heads
        d_v = config.ssm_inner_size // max(H_v, 1)
        slots = num_state_slots + 1
        # one array per kind over all its layers (pool_entries copies an entry in one launch);
        # the model's kernels take the per-layer views
        n_attn, n_rec = len(self.attn_index), len(self.rec_index)
        self.kv = Int8KVPool(n_attn, kv_shape) if np.dtype(kv_dtype) == np.int8 else \
            FloatKVPool(n_attn, kv_shape, kv_dtype)
        state_pools = [_pool(n_rec, (slots, C, K - 1), np.float32),
                       _pool(n_rec, (slots, H_v, d_v, config.ssm_d_state), np.float32)]
        self._kv_pools = [pool_entries.flat_pool(p) for p in self.kv.pools if p is not None]
        self._state_pools = [pool_entries.flat_pool(p) for p in state_pools if p is not None]
        self.conv_state, self.delta_state = (_layers(p, n_rec) for p in state_pools)
        self.stream = stream  # where copies and resets queue: the model's passes' stream

    @property
    def shape(self) -> PoolShape:
        return PoolShape(self.num_blocks, self.block_size, self.scratch_block, self.scratch_slot)

    def memory_bytes(self) -> dict[str, int]:
        return {"kv_pool": sum(p.nbytes for p in self.kv.pools if p is not None),
                "state_pool": sum(a.nbytes for a in self.conv_state + self.delta_state)}

    def copy_blocks(self, src: Sequence[int], dst: Sequence[int]) -> None:
        for pool in self._kv_pools:
            for s, d in zip(src, dst):
                pool_entries.copy_entry(pool, s, d, self.stream)

    def copy_state(self, src_slot: int, dst_slot: int) -> None:
        for pool in self._state_pools:
            pool_entries.copy_entry(pool, src_slot, dst_slot, self.stream)

    def reset_state(self, slot: int) -> None:
        """Zeroes the slot's recurrent state in every layer."""
        for pool in self._state_pools:
            pool_entries.zero_entry(pool, slot, self.stream)
