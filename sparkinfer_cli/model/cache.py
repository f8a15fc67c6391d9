"""ModelCache: the paged KV pool and the per-sequence recurrent-state pool of one model (CPU)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from sparkinfer_cli.model.config import ModelConfig


class ModelCache:
    """K/V of attention layers in blocks, plus conv + delta-rule state slots for hybrid layers.

    Region map of `k` / `v`: (attention layer, block, slot in block, kv head, head dim);
    position p of a sequence with block table bt lives at [:, bt[p // block_size], p % block_size].
    """

    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int, num_state_slots: int,
                 kv_dtype: type = np.float32):
        if num_blocks < 1 or block_size < 1:
            raise ValueError("a model cache needs at least one block of at least one token")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.num_state_slots = num_state_slots
        n_attn = len(config.attention_layers)
        kv_shape = (n_attn, num_blocks, block_size, config.n_head_kv, config.head_dim)
        # (layer, block, slot, kv head, head dim)
        self.k: np.ndarray = np.zeros(kv_shape, dtype=kv_dtype)
        self.v: np.ndarray = np.zeros(kv_shape, dtype=kv_dtype)
        self.attn_index = {layer: i for i, layer in enumerate(config.attention_layers)}
        n_rec = len(config.recurrent_layer_ids)
        slots = num_state_slots if n_rec else 0
        K, C = config.ssm_conv_kernel, config.ssm_conv_dim
        self.conv_state = np.zeros((n_rec, slots, C, max(K - 1, 0)), dtype=np.float32)
        d_v = config.ssm_inner_size // max(config.ssm_n_v_heads, 1)
        self.delta_state = np.zeros((n_rec, slots, config.ssm_n_v_heads, config.ssm_d_state, d_v),
                                    dtype=np.float32)  # (layer, slot, v head, d_k, d_v)
        self.rec_index = {layer: i for i, layer in enumerate(config.recurrent_layer_ids)}

    # ---- KV ------------------------------------------------------------------------------------
    def copy_blocks(self, src: Sequence[int], dst: Sequence[int]) -> None:
        self.k[:, list(dst)] = self.k[:, list(src)]
        self.v[:, list(dst)] = self.v[:, list(src)]

    # ---- recurrent state -----------------------------------------------------------------------
    def recurrent_state(self, layer: int, slot: int) -> tuple[np.ndarray, np.ndarray]:
        """Views (conv (C, K-1), delta (H_v, d_k, d_v)) that the layer updates in place."""
        li = self.rec_index[layer]
        return self.conv_state[li, slot], self.delta_state[li, slot]

    def copy_state(self, src_slot: int, dst_slot: int) -> None:
        self.conv_state[:, dst_slot] = self.conv_state[:, src_slot]
        self.delta_state[:, dst_slot] = self.delta_state[:, src_slot]

    def reset_state(self, slot: int) -> None:
        self.conv_state[:, slot] = 0
        self.delta_state[:, slot] = 0
