"""CudaModelCache: the paged KV pool and recurrent-state pool of a CUDA model, on the device.

Same contract as model/cache.py's ModelCache (block tables, state slots, copy/reset), plus one
scratch block and one scratch state slot past the engine's range: the padding rows of a decode
graph's batch-size bucket write and read there, never in a block or slot the engine owns.

Layouts (kernels/cuda): K/V per attention layer (num_blocks + 1, block_size, n_kv, head_dim) f16
(f32 for exact runs, as the CPU cache and the oracle fixtures keep it; int8 with a float32 scale per
32 values in k_scales / v_scales under SPARKINFER_KV_INT8);
conv state per GDN layer (slots + 1, conv_dim, K − 1) f32; delta state (slots + 1, H_v, d_v, d_k)
f32 (value column j, key index i contiguous: transposed from the CPU cache's (H_v, d_k, d_v)).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from numba import cuda
from numba.cuda.cudadrv.driver import device_memset

from sparkinfer_cli.kernels.cuda.intrinsics import IS_SIMULATOR
from sparkinfer_cli.model.config import ModelConfig


def device_zeros(shape: tuple[int, ...], dtype) -> Any:  # a numba device array
    arr = cuda.device_array(shape, dtype)
    if IS_SIMULATOR:  # the simulator's arrays are numpy arrays
        arr[...] = 0
    else:
        device_memset(arr, 0, arr.nbytes)
    return arr


class CudaModelCache:
    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int, num_state_slots: int,
                 kv_dtype=np.float16):
        if num_blocks < 1 or block_size < 1:
            raise ValueError("a model cache needs at least one block of at least one token")
        self.config = config
        self.num_blocks, self.block_size = num_blocks, block_size
        self.num_state_slots = num_state_slots
        self.scratch_block, self.scratch_slot = num_blocks, num_state_slots
        kv_shape = (num_blocks + 1, block_size, config.n_head_kv, config.head_dim)
        self.attn_index = {layer: i for i, layer in enumerate(config.attention_layers)}
        self.k = [device_zeros(kv_shape, kv_dtype) for _ in self.attn_index]
        self.v = [device_zeros(kv_shape, kv_dtype) for _ in self.attn_index]
        scale_shape = (*kv_shape[:3], config.head_dim // 32)  # int8 KV: a scale per 32 values
        is_int8 = np.dtype(kv_dtype) == np.int8
        self.k_scales = [device_zeros(scale_shape, np.float32) for _ in self.k if is_int8]
        self.v_scales = [device_zeros(scale_shape, np.float32) for _ in self.v if is_int8]
        self.rec_index = {layer: i for i, layer in enumerate(config.recurrent_layer_ids)}
        K, C, H_v = config.ssm_conv_kernel, config.ssm_conv_dim, config.ssm_n_v_heads
        d_v = config.ssm_inner_size // max(H_v, 1)
        slots = num_state_slots + 1
        self.conv_state = [device_zeros((slots, C, K - 1), np.float32) for _ in self.rec_index]
        self.delta_state = [device_zeros((slots, H_v, d_v, config.ssm_d_state), np.float32)
                            for _ in self.rec_index]
        self.steps: dict = {}  # CudaModel's per-bucket workspaces and graphs (they point in here)

    @property
    def max_context(self) -> int:
        """The longest sequence the pool can hold (all blocks)."""
        return self.num_blocks * self.block_size

    def kv_scales(self, attn_layer: int) -> tuple | None:
        """(k_scales, v_scales) of an int8 KV layer, None for float caches."""
        if not self.k_scales:
            return None
        return self.k_scales[attn_layer], self.v_scales[attn_layer]

    def memory_bytes(self) -> dict[str, int]:
        kv = self.k + self.v + self.k_scales + self.v_scales
        return {"kv_pool": sum(a.nbytes for a in kv),
                "state_pool": sum(a.nbytes for a in self.conv_state + self.delta_state)}

    def copy_blocks(self, src: Sequence[int], dst: Sequence[int]) -> None:
        for pool in self.k + self.v + self.k_scales + self.v_scales:
            for s, d in zip(src, dst):
                pool[d].copy_to_device(pool[s])

    def copy_state(self, src_slot: int, dst_slot: int) -> None:
        for pool in self.conv_state + self.delta_state:
            pool[dst_slot].copy_to_device(pool[src_slot])

    def reset_state(self, slot: int, stream=0) -> None:
        """Zeroes the slot's recurrent state in every layer; on a stream, queued there (a memset
        on the default stream would wait for the model's stream and block the host each time)."""
        for pool in self.conv_state + self.delta_state:
            view = pool[slot]
            if IS_SIMULATOR:
                view[...] = 0
            else:
                device_memset(view, 0, view.nbytes, stream=stream)
